"""The warm-up forwards on one decoder layer (kernels/compile_ahead.py's `first_layer_only`: before
each CUDA graph's capture, and in the compile-ahead pass), checked on the CPU: a forward that keeps
the first layer only calls every operation a whole forward calls, with the same shapes, so nothing
is first met inside a capture; and the model gets all its layers back, even after an error."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm.kernels.compile_ahead import first_layer_only
from nanovllm.worker.step_inputs import StepInputs, to_tensors
from tests.helpers import make_llm


class Calls(TorchDispatchMode):
    """Every operation called, with its tensor arguments' shapes and dtypes."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
        self.seen.add((str(func), shapes))
        return func(*args, **(kwargs or {}))


def test_one_layer_calls_what_every_layer_calls(tiny_path):
    llm = make_llm(tiny_path)
    runner = llm.model_runner
    layers = runner.model.model.layers
    assert len(layers) > 1
    # two decodes (contexts of 41 and 8 tokens), then a 20-token prompt; blocks of 16 tokens
    step = StepInputs(input_ids=[5, 6] + list(range(100, 120)), positions=[40, 7] + list(range(20)),
                      slot_mapping=[72, 128] + list(range(160, 180)),
                      cu_seqlens_q=[0, 1, 2, 22], context_lens=[41, 8, 20],
                      block_tables=[[3, 1, 4], [8], [10, 11]], num_decodes=2,
                      sample_rows=[0, 1, 21])
    calls = []
    for one_layer in (False, True):
        input_ids, positions, meta, _ = to_tensors(step, runner.device)
        with Calls() as mode, torch.inference_mode():
            if one_layer:
                with first_layer_only(runner.model):
                    assert list(runner.model.model.layers) == [layers[0]]
                    runner.forward(input_ids, positions, meta)
            else:
                runner.forward(input_ids, positions, meta)
        calls.append(mode.seen)
    assert calls[0] == calls[1]
    assert runner.model.model.layers is layers
    with pytest.raises(RuntimeError), first_layer_only(runner.model):
        raise RuntimeError("a warm-up that fails")
    assert runner.model.model.layers is layers
    llm.shutdown()
