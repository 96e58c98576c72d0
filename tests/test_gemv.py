"""The fused GEMV kernels of few-row decode steps (nanovllm/kernels/gemv.py) against float64
references, and the decoder layer built on them (nanovllm/layers/fused_decode.py) against the plain
layer, token for token in the engine. Without CUDA the kernels run in Triton's interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

if not torch.cuda.is_available() and isinstance(tl.max, JITFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run with "
                "TRITON_INTERPRET=1 in the environment", allow_module_level=True)

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.kernels.gemv import NORM, PLAIN, SILU, gemv  # noqa: E402
from nanovllm.kernels.gemv import MAX_ROWS  # noqa: E402
from nanovllm.layers import fused_decode  # noqa: E402
from tests.helpers import make_llm, random_prompts, token_ids  # noqa: E402

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K, EPS = 40, 48, 1e-6  # not powers of two: the masks are exercised
SMALL_TILES = dict(BLOCK_N=16, BLOCK_K=16, num_warps=4)  # several programs, several K tiles


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def reference(x, weight, bias, prologue, residual, norm_weight):
    """(a @ weight.T + bias, new residual) in float64, a made from x as the plain layers make it."""
    new_residual = None
    a = x.double()
    if prologue == NORM:
        if residual is not None:
            a = a + residual.double()
        new_residual = a
        a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    elif prologue == SILU:
        gate, up = a.chunk(2, -1)
        a = torch.nn.functional.silu(gate) * up
    y = a @ weight.double().T
    return (y if bias is None else y + bias.double()), new_residual


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prologue,has_res", [(PLAIN, False), (NORM, False), (NORM, True),
                                              (SILU, False)], ids=["plain", "norm", "add_norm",
                                                                   "silu"])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["default", "small"])
def test_gemv_matches_float64(dtype, tol, prologue, has_res, rows, tiles):
    torch.manual_seed(rows)
    opts = dict(device=DEVICE, dtype=dtype)
    x = torch.randn(rows, 2 * K if prologue == SILU else K, **opts)
    weight, bias = torch.randn(N, K, **opts) / K ** 0.5, torch.randn(N, **opts)
    residual = torch.randn(rows, K, **opts) if has_res else None
    norm_weight = torch.rand(K, **opts) + 0.5
    y, new_res = gemv(x, weight, bias, prologue, residual, norm_weight, EPS, config=tiles)
    ref, ref_res = reference(x, weight, bias, prologue, residual, norm_weight)
    assert y.shape == (rows, N) and y.dtype == dtype
    assert rel_err(y, ref) < tol
    if prologue != NORM:
        assert new_res is None
    else:  # x + residual in the dtype (the interpreter's casts truncate: not torch.equal)
        torch.testing.assert_close(new_res, ref_res.to(dtype))


def test_gemv_without_bias():
    x, weight = torch.randn(2, K, device=DEVICE), torch.randn(N, K, device=DEVICE)
    y, _ = gemv(x, weight)
    assert rel_err(y, x.double() @ weight.double().T) < 1e-5


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])  # qwen2: the qkv projection's bias
def test_fused_decode_layer_same_tokens(random_checkpoint, name, monkeypatch):
    """The engine's greedy tokens with every step of <= MAX_ROWS rows through the fused path
    (chosen by the model runner; forced on CPU) equal the plain model's; prompts longer than
    MAX_ROWS prefill through the plain one."""
    path, _ = random_checkpoint(name)
    prompts = random_prompts(3, (2, 20), seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = make_llm(path, attn_backend="sdpa", dtype="float32")
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    calls = []

    def forward(model, input_ids, positions, meta):
        calls.append(len(input_ids))
        return fused_forward(model, input_ids, positions, meta)
    fused_forward = fused_decode.forward
    monkeypatch.setattr(fused_decode, "forward", forward)
    monkeypatch.setattr(fused_decode, "MAX_STEP_ROWS", MAX_ROWS)
    fused = make_llm(path, attn_backend="sdpa", dtype="float32")  # (on CUDA its graphs hold it)
    fused.model_runner.small_batch = fused_decode  # on CPU too
    assert token_ids(fused.generate(prompts, params, use_tqdm=False)) == expected
    assert calls  # the fused path ran
