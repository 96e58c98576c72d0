"""How many KV-cache blocks fit on a GPU (vLLM's profile run).

The engine may use gpu_memory_utilization of the GPU. The weights are loaded; what else a step needs
at its peak is measured by running the largest prefill and the largest sampling batch once, with a
one-block cache to write into (their Triton kernels compiled first, all at once:
kernels/compile_ahead.py). The blocks get what is left. Every rank of tensor parallelism runs it,
meeting the others in the model's collectives.
"""
import logging

import torch

from nanovllm.core.sequence import Sequence, num_blocks_for
from nanovllm.kernels.compile_ahead import compile_ahead
from nanovllm.layers.sampler import SamplingTensors, sample
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


@torch.inference_mode()
def num_blocks_that_fit(runner) -> int:
    config, device, kv_cache = runner.config, runner.device, runner.kv_cache
    kv_cache.allocate(1)
    torch.cuda.reset_peak_memory_stats(device)
    length = min(config.max_model_len, config.max_num_batched_tokens)
    num_seqs = max(1, min(config.max_num_batched_tokens // length, config.max_num_seqs))
    cu = list(range(0, length * num_seqs + 1, length))
    # every token writes into block 0
    table = [0] * num_blocks_for(length, config.kvcache_block_size)
    slots = [p % config.kvcache_block_size for p in range(length)]
    step = StepInputs([0] * cu[-1], list(range(length)) * num_seqs, slots * num_seqs, cu,
                      [length] * num_seqs, [table] * num_seqs, 0, [end - 1 for end in cu[1:]])
    with compile_ahead(runner.model):  # its Triton kernels compiled at once, then run
        peak_step(runner, step)
    peak_step(runner, step)
    kv_cache.allocate(0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    transient = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    available = total * config.gpu_memory_utilization - (total - free) - transient
    num_blocks = int(available // kv_cache.block_bytes)
    if num_blocks < 1:
        raise ValueError("no memory left for the KV cache (a block takes "
                         f"{kv_cache.block_bytes / 2**20:.1f} MiB): raise gpu_memory_utilization "
                         "or lower max_num_batched_tokens / max_num_seqs")
    logger.info("KV cache: %d blocks of %d tokens, %.2f GiB", num_blocks, config.kvcache_block_size,
                num_blocks * kv_cache.block_bytes / 2**30)
    return num_blocks


def peak_step(runner, step: StepInputs):
    """The largest prefill, then sampling of the largest batch: logits in the model's dtype, and in
    float32 after penalties (the sampling kernel compiles for both); top-p's sort is the sampler's
    peak."""
    config = runner.config
    runner.execute(step)
    for dtype in (config.torch_dtype, torch.float32):
        logits = torch.randn(config.max_num_seqs, config.hf_config["vocab_size"],
                             device=runner.device, dtype=dtype)
        for params in (SamplingParams(top_p=0.9), SamplingParams()):
            rows = [(Sequence([0], params, 1), 0)] * config.max_num_seqs
            t = SamplingTensors.of(rows, config.hf_config["vocab_size"], runner.device)
            sample(logits, t, runner.one_pass_sample)
