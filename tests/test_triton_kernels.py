"""Triton kernels (rotary + store, prefill, split-KV decode) and the triton backend against
references: float64 attention, and the plain PyTorch rotary and store the model runs on CPU.

The reference gathers each sequence's keys through its block table in plain PyTorch and runs a
causal softmax in float64. Caches start poisoned with NaN (unused blocks, the tail of a sequence's
last block, the padding of the block table), so a kernel that reads a key it should not, or leaves
an output unwritten, fails. On a machine without CUDA the kernels run in Triton's interpreter.
"""
import os
import random
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# triton imported earlier, in compiled mode
if not torch.cuda.is_available() and isinstance(tl.max, JITFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (by a conftest?): run with "
                "TRITON_INTERPRET=1 in the environment", allow_module_level=True)

from nanovllm.attention import AttentionMetadata  # noqa: E402
from nanovllm.kernels.prefill import QUERY_TILE, query_tiles  # noqa: E402
from nanovllm.attention.paged_attention import store_kv  # noqa: E402
from nanovllm.attention.triton import TritonBackend  # noqa: E402
from nanovllm.kernels import (  # noqa: E402
    decode_attention,
    num_decode_splits,
    prefill_attention,
    rope_store,
)
from nanovllm.kernels.decode import MAX_SPLITS  # noqa: E402
from nanovllm.kernels.elementwise import add_rms_norm, silu_and_mul  # noqa: E402
from nanovllm.layers.norm import add_rms_norm as plain_add_rms_norm  # noqa: E402
from nanovllm.models.llama import silu_and_mul as plain_silu_and_mul  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding, norm_rope  # noqa: E402

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

HEAD_DIMS = [64, 128]
# (query heads, KV heads): groups of 1, 2, 3, 4, 8
HEAD_RATIOS = [(2, 2), (4, 2), (3, 1), (4, 1), (8, 1)]
BLOCK_SIZES = [16, 32, 256]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's dots are exact float32; a GPU's are tf32
FP32_TOL = 1e-4 if DEVICE == "cpu" else 3e-3
BF16_TOL = 1e-2
# the interpreter has no bfloat16 (numpy lacks it): float16 stands in for the half type there
HALF_DTYPES = [torch.float32, torch.float16 if DEVICE == "cpu" else torch.bfloat16]


# ---------- reference and helpers ----------

@pytest.fixture(autouse=True)
def default_device():
    """Tensors on the GPU where there is one (compiled kernels), else on the CPU (interpreter)."""
    if DEVICE == "cpu":  # the default; the device mode would slow the interpreter's torch calls
        yield
        return
    with torch.device(DEVICE):
        yield


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative norm error; NaN anywhere in out makes it NaN, which fails every `<` check."""
    return ((out.double() - ref).norm() / ref.norm()).item()


def gather_keys(cache: torch.Tensor, block_table: torch.Tensor, k_len: int) -> torch.Tensor:
    """Keys 0..k_len-1 of one sequence, read through its block table: [k_len, Hkv, D] float64."""
    block_size = cache.shape[1]
    pos = torch.arange(k_len, device=cache.device)
    blocks = block_table.long()[pos // block_size]
    return cache[blocks, pos % block_size].double()


def ref_attention(q, k_cache, v_cache, block_table, k_len, scale):
    """Causal attention of q [q_len, Hq, D], the last q_len positions of a k_len-key sequence, in
    float64."""
    q_len, num_heads, _ = q.shape
    k = gather_keys(k_cache, block_table, k_len)
    v = gather_keys(v_cache, block_table, k_len)
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [k_len, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device)
    visible = torch.arange(k_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, k_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [q_len, Hq, D]


def make_paged_cache(k_lens, num_kv_heads, head_dim, block_size, dtype, device, spare_blocks=3):
    """A NaN-poisoned pool, shuffled block tables padded with NaN blocks, and random keys in the
    used slots."""
    blocks_per_seq = [-(-n // block_size) for n in k_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    order = torch.randperm(num_blocks).tolist()
    spare, order = order[:spare_blocks], order[spare_blocks:]
    width = max(blocks_per_seq) + 2
    block_tables = torch.tensor([random.choice(spare)] * width * len(k_lens), dtype=torch.int32)
    block_tables = block_tables.view(len(k_lens), width)  # padding points at poisoned blocks
    for i, (n, nb) in enumerate(zip(k_lens, blocks_per_seq)):
        block_tables[i, :nb] = torch.tensor(order[:nb], dtype=torch.int32)
        order = order[nb:]
        pos = torch.arange(n)
        rows = (block_tables[i].long()[pos // block_size].to(device), (pos % block_size).to(device))
        k_cache[rows] = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        v_cache[rows] = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=device)
    return k_cache, v_cache, block_tables.to(device)


def cu_seqlens(lens, device):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)


def ragged_lengths(block_size):
    """(q_len, k_len) pairs: length 1, block boundaries +-1, prefix hits and chunks
    (q_len < k_len)."""
    b = block_size
    return [(1, 1), (b - 1, b - 1), (b + 1, b + 1), (3, b + 2), (1, 2 * b + 1), (b, 2 * b),
            (40, 40 + b - 1)]


# ---------- rope_store ----------

@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 1, 64), (6, 3, 64), (4, 2, 128)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_matches_the_plain_rotary_and_store(num_heads, num_kv_heads, head_dim, qk_norm):
    """Queries out, rotated keys and values in their slots (nothing written for slot -1), as the
    CPU path does."""
    num_blocks, block_size, num_tokens = 4, 16, 37
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim) * 3
    positions = torch.randint(0, 500, (num_tokens,), dtype=torch.int32)
    cos_sin = RotaryEmbedding(head_dim, 512, 10000.0).cos_sin
    weights = ((torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5, 1e-6) if qk_norm
               else (None, None, 0.0))
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(torch.int32)
    slots[::5] = -1  # padding tokens: must not be written anywhere
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    q = rope_store(qkv, positions, cos_sin, num_heads, k_cache, v_cache, slots, *weights)
    ref_q, ref_k = norm_rope(qkv[:, :num_heads + num_kv_heads], positions, cos_sin, num_heads,
                             *weights).split([num_heads, num_kv_heads], dim=1)
    ref_k_cache, ref_v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    store_kv(ref_k, qkv[:, num_heads + num_kv_heads:], ref_k_cache, ref_v_cache, slots)
    assert torch.allclose(q, ref_q, atol=1e-5, rtol=1e-5)
    # NaN exactly where unwritten
    assert torch.allclose(k_cache, ref_k_cache, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(v_cache.isnan(), ref_v_cache.isnan())
    assert torch.equal(v_cache.nan_to_num(), ref_v_cache.nan_to_num())


# ---------- RMSNorm and SwiGLU's gate ----------

@pytest.mark.parametrize("hidden", [64, 96, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_add_rms_norm_matches_float64(hidden, with_residual, dtype):
    """RMSNorm(x + residual) and the new residual, against float64 and the plain PyTorch path (a
    hidden size that is no power of two masks its tail)."""
    x = (torch.randn(13, hidden) * 4).to(dtype)
    residual = (torch.randn(13, hidden) * 4).to(dtype) if with_residual else None
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    out, new_residual = add_rms_norm(x, residual, weight, 1e-6)
    summed = x.double() + (residual.double() if with_residual else 0)
    ref = weight.double() * summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6)
    tol = 1e-5 if dtype == torch.float32 else BF16_TOL
    assert rel_err(out, ref) < tol and rel_err(new_residual, summed) < tol
    plain_out, plain_residual = plain_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, plain_residual)
    assert torch.allclose(out.float(), plain_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("width", [64, 300, 3072])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_silu_and_mul_matches_float64(width, dtype):
    """silu(gate) * up over [gate | up] rows, against float64 and the plain PyTorch path (3,072
    columns take several programs a row)."""
    x = (torch.randn(7, 2 * width) * 3).to(dtype)
    gate, up = x.double().chunk(2, -1)
    out = silu_and_mul(x)
    assert out.shape == (7, width)
    tol = 1e-6 if dtype == torch.float32 else BF16_TOL
    assert rel_err(out, torch.nn.functional.silu(gate) * up) < tol
    assert torch.allclose(out.float(), plain_silu_and_mul(x).float(), atol=tol, rtol=tol)


# ---------- prefill ----------

def tiles_of(q_lens, device, first=0):
    cu = [0] + list(torch.tensor(q_lens).cumsum(0).tolist())
    return torch.tensor(query_tiles(cu, first), dtype=torch.int32, device=device).view(-1, 2)


def check_prefill(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, tol):
    k_cache, v_cache, block_tables = make_paged_cache([k for _, k in lens], num_kv_heads, head_dim,
                                                      block_size, dtype, device)
    q_lens = [q for q, _ in lens]
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim ** -0.5
    k_lens = torch.tensor([k for _, k in lens], dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))  # every query row must be written
    prefill_attention(q, k_cache, v_cache, cu_seqlens(q_lens, device), k_lens, block_tables,
                      tiles_of(q_lens, device), QUERY_TILE, scale, out)
    start = 0
    for i, (q_len, k_len) in enumerate(lens):
        ref = ref_attention(q[start:start + q_len], k_cache, v_cache, block_tables[i], k_len, scale)
        err = rel_err(out[start:start + q_len], ref)
        assert err < tol, f"sequence {i} (q_len={q_len}, k_len={k_len}): rel err {err}"
        start += q_len


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_attention(head_dim, num_heads, num_kv_heads, block_size):
    lens = ragged_lengths(block_size)
    random.shuffle(lens)
    check_prefill(lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, DEVICE,
                  FP32_TOL)


def test_prefill_several_query_tiles():
    """Sequences longer than one query tile, with and without a cached prefix."""
    check_prefill([(200, 200), (130, 300), (1, 1)], 4, 2, 64, 16, torch.float32, DEVICE, FP32_TOL)


def test_query_tiles_list_each_sequence_last_tile_first():
    cu = [0, 1, 2, 70, 200, 201]  # two decodes, then chunks of 68, 130 and 1 queries
    assert query_tiles(cu, 2) == [2, 1, 2, 0, 3, 2, 3, 1, 3, 0, 4, 0]
    assert query_tiles(cu, 5) == []


def test_prefill_skips_unused_tiles():
    """A CUDA graph launches a fixed number of tiles: those of sequence -1 write nothing."""
    k_cache, v_cache, tables = make_paged_cache([20], 2, 64, 16, torch.float32, DEVICE)
    q = torch.randn(20, 2, 64)
    out = torch.full_like(q, float("nan"))
    tiles = torch.tensor([[0, 0], [-1, -1], [-1, -1]], dtype=torch.int32)
    prefill_attention(q, k_cache, v_cache, cu_seqlens([20], DEVICE),
                      torch.tensor([20], dtype=torch.int32), tables, tiles, QUERY_TILE, 0.125, out)
    assert rel_err(out, ref_attention(q, k_cache, v_cache, tables[0], 20, 0.125)) < FP32_TOL


# ---------- decode ----------

def check_decode(context_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits, dtype,
                 device, tol):
    """Decode rows (one query token) among rows the kernel must leave alone: context 0 is a CUDA
    graph's padding sequence (no query token), and one sequence carries a 3-token prefill chunk."""
    lens = [max(n, 1) for n in context_lens] + [40]
    k_cache, v_cache, block_tables = make_paged_cache(lens, num_kv_heads, head_dim, block_size,
                                                      dtype, device)
    q_lens = [1 if n else 0 for n in context_lens] + [3]
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim ** -0.5
    cu = cu_seqlens(q_lens, device)
    out = torch.full_like(q, float("nan"))
    k_lens = torch.tensor(context_lens + [40], dtype=torch.int32, device=device)
    decode_attention(q, k_cache, v_cache, cu, k_lens, block_tables, scale, num_splits, out=out)
    for i, n in enumerate(context_lens):
        if n:
            row = int(cu[i])
            ref = ref_attention(q[row:row + 1], k_cache, v_cache, block_tables[i], n, scale)
            err = rel_err(out[row:row + 1], ref)
            assert err < tol, f"row {i} (context {n}, {num_splits} splits): rel err {err}"
    assert out[-3:].isnan().all(), "the prefill chunk's rows were written"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_attention(head_dim, num_heads, num_kv_heads, block_size):
    b = block_size
    context_lens = [1, b - 1, b, b + 1, 2 * b + 1, 0, 300]
    random.shuffle(context_lens)
    check_decode(context_lens, num_heads, num_kv_heads, head_dim, block_size, 3, torch.float32,
                 DEVICE, FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 2, 7, MAX_SPLITS])
def test_decode_split_counts(num_splits):
    """One split (direct write), a few, and more splits than a short context has tiles (empty
    splits)."""
    check_decode([0, 1, 17, 129, 700], 8, 2, 64, 32, num_splits, torch.float32, DEVICE, FP32_TOL)


def test_num_decode_splits_is_static_and_bounded():
    assert num_decode_splits(1, 8, 128, 8192, 132) == MAX_SPLITS  # 8 programs: split fully
    assert num_decode_splits(8, 8, 128, 4096, 132) == 9  # 64 * 9 programs ~ 4 per SM
    assert num_decode_splits(64, 3, 64, 4096, 132) == 3  # 192 programs: still worth splitting
    assert num_decode_splits(64, 8, 128, 4096, 132) == 1  # 512 programs fill the GPU alone
    assert num_decode_splits(1, 8, 128, 100, 132) == 2  # no split shorter than a 64-key tile


# ---------- backend end to end ----------

def test_triton_backend_mixed_steps():
    """One kind of step: decodes and prefill chunks in one batch (a fresh prompt, a chunk after a
    cached prefix, a one-token prompt), then decode steps; each padded as a CUDA graph pads it
    (padding tokens with slot -1, padding sequences with no tokens, unused tiles)."""
    block_size, num_heads, num_kv_heads, head_dim = 16, 6, 2, 64
    config = SimpleNamespace(max_num_seqs=8, max_model_len=256, kvcache_block_size=block_size,
                             device=DEVICE, disable_cascade_attn=True)
    backend = TritonBackend(num_heads, num_kv_heads, head_dim, config)
    shape = (32, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    # 6 blocks of 16 keys per sequence
    block_tables = torch.randperm(32)[:24].view(4, 6).to(torch.int32)
    prior = [7, 0, 20, 0]  # keys cached: sequence 0 decodes, sequence 2 hit a 20-token prefix
    history = [[torch.randn(n, num_kv_heads, head_dim) for n in prior] for _ in "kv"]
    for i in range(4):  # what earlier steps stored
        store_kv(history[0][i], history[1][i], k_cache, v_cache,
                 slot_of(block_tables[i], torch.arange(prior[i]), block_size))

    def step(q_lens, pad_tokens=0, pad_seqs=0, pad_tiles=0):
        new = [[torch.randn(n, num_kv_heads, head_dim) for n in q_lens] for _ in "kv"]
        slots = [slot_of(block_tables[i], torch.arange(prior[i], prior[i] + n), block_size)
                 for i, n in enumerate(q_lens)]
        k_lens = [p + n for p, n in zip(prior, q_lens)]
        num_decodes = sum(1 for n in q_lens if n == 1)
        cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
        tiles = query_tiles(cu, num_decodes) + [-1, -1] * pad_tiles
        cu_k = [0] + torch.tensor(k_lens).cumsum(0).tolist()
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots + [torch.full((pad_tokens,), -1, dtype=torch.int32)]),
            cu_seqlens_q=torch.tensor(cu + [cu[-1]] * pad_seqs, dtype=torch.int32),
            cu_seqlens_k=torch.tensor(cu_k + [cu_k[-1]] * pad_seqs, dtype=torch.int32),
            context_lens=torch.tensor(k_lens + [0] * pad_seqs, dtype=torch.int32),
            block_tables=torch.cat([block_tables, torch.zeros(pad_seqs, 6, dtype=torch.int32)]),
            query_tiles=torch.tensor(tiles, dtype=torch.int32).view(-1, 2),
            # a graph runs every row
            num_decodes=num_decodes + pad_seqs if pad_seqs else num_decodes,
            cu_seqlens_q_host=cu, context_lens_host=k_lens)
        pad = [torch.randn(pad_tokens, num_kv_heads, head_dim)]
        store_kv(torch.cat(new[0] + pad), torch.cat(new[1] + pad), k_cache, v_cache,
                 meta.slot_mapping)
        q = torch.randn(sum(q_lens) + pad_tokens, num_heads, head_dim)
        out = backend.forward(q, k_cache, v_cache, meta)
        for i, n in enumerate(q_lens):
            history[0][i] = torch.cat([history[0][i], new[0][i]])
            history[1][i] = torch.cat([history[1][i], new[1][i]])
            ref = ref_attention(q[cu[i]:cu[i + 1]], k_cache, v_cache, block_tables[i], k_lens[i],
                                backend.scale)
            assert rel_err(out[cu[i]:cu[i + 1]], ref) < FP32_TOL, f"sequence {i}"
            prior[i] = k_lens[i]

    step([1, 1, 70, 33])  # a decode, a one-token prompt, a chunk after a prefix, a fresh prompt
    step([1, 1, 1, 1], pad_tokens=2, pad_seqs=2)  # a decode step padded to a batch of 6
    step([1, 1, 1, 5], pad_tokens=9, pad_seqs=3, pad_tiles=4)  # a mixed step padded like a graph
    for i in range(4):  # the cache holds exactly what was stored
        assert torch.equal(gather_keys(k_cache, block_tables[i], prior[i]), history[0][i].double())
        assert torch.equal(gather_keys(v_cache, block_tables[i], prior[i]), history[1][i].double())


def slot_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slot of each token position of a sequence."""
    slots = block_table.long()[positions // block_size] * block_size + positions % block_size
    return slots.to(torch.int32)


# ---------- larger shapes in bfloat16 on the GPU ----------

@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads",
                         [(128, 16, 8), (64, 9, 3), (128, 32, 4)])
@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_gpu_bf16_large(head_dim, num_heads, num_kv_heads, block_size):
    prefill_lens = [(1000, 1000), (513, 2048), (1, 300), (2048, 2048), (255, 257)]
    check_prefill(prefill_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16,
                  "cuda", BF16_TOL)
    context_lens = [0, 1, 255, 256, 257, 1000, 4097, 8192] * 4
    most = num_decode_splits(len(context_lens) + 1, num_kv_heads, head_dim, 8192, 132)
    for num_splits in (1, 5, most):
        check_decode(context_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits,
                     torch.bfloat16, "cuda", BF16_TOL)
