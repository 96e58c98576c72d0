"""Matrix-vector products for decode steps of a few rows, with their producer fused in.

At batch 1 a decode layer is a chain of small kernels, and on an H200 each GEMM of Qwen3-0.6B takes
5-8 us whatever the kernel while its weight (4-12 MiB) would stream in 1-3 us: the fixed cost of a
dependent kernel dominates (docs/benchmarks.md, batch 1). So fewer kernels: y = a @ W.T
for an input a of M <= MAX_ROWS rows, where a is made in the kernel's prologue from what the layer
before left:
- NORM: a = RMSNorm(x + residual) (the residual add optional), the new residual x + residual
  written by program 0; before the qkv and gate_up projections.
- SILU: a = silu(gate) * up of x = [gate | up]; before the down projection.
- PLAIN: a = x; the o projection.
Each program owns BLOCK_N output features of every row and reads its [BLOCK_N, K] slice of W once;
the inputs (a few KiB) are re-read by every program from L2 and the norm's sum of squares is
recomputed by each, which costs far less than a kernel. Products accumulate in float32, and a is
rounded to the activation dtype exactly where the plain PyTorch layers round it.

With programmatic dependent launch (PDL, Hopper), a program loads its first weight tile before it
waits for the kernel before it (`gdc_wait`), so the weight stream overlaps that kernel's tail.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_for_inputs

MAX_ROWS = 8  # rows the kernels take; a decoder layer uses them at <= 2 (models/llama.py)
PLAIN, NORM, SILU = 0, 1, 2


@triton.jit
def _input_tile(x_ptr, res_ptr, norm_w_ptr, rows, row_mask, kk, k_mask, rstd, stride_x,
                stride_res, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
    """The [M_PAD, BLOCK_K] tile of the product's input a, in float32 (rounded as the plain layers
    round it)."""
    offsets = rows[:, None] * stride_x + kk[None, :]
    mask = row_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    dtype = x.dtype
    if PROLOGUE == 2:  # SILU: x holds [gate | up]
        up = tl.load(x_ptr + offsets + K, mask=mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        return (gate * tl.sigmoid(gate) * up).to(dtype).to(tl.float32)
    if PROLOGUE == 1:  # NORM: (x + residual) * rstd, rounded, times the norm weight, rounded
        if HAS_RES:
            res = tl.load(res_ptr + rows[:, None] * stride_res + kk[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
        weight = tl.load(norm_w_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
        return (normed * weight[None, :]).to(dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, y_ptr, res_out_ptr, M, eps,
    stride_x, stride_res, stride_w, stride_y, stride_res_out,
    N: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, M_PAD)
    row_mask = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    # the first weight tile: weights are no output of the kernel before, so it streams in early
    w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & (ks < K)[None, :], other=0.0)
    wait_for_inputs(PDL)  # the inputs are the kernel before's outputs

    rstd = tl.zeros([M_PAD], tl.float32)
    if PROLOGUE == 1:  # RMSNorm's 1 / rms of each row, over all K (re-read from L2 below)
        sum_sq = tl.zeros([M_PAD], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            mask = row_mask[:, None] & (kk < K)[None, :]
            h = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
            if HAS_RES:
                res = tl.load(res_ptr + rows[:, None] * stride_res + kk[None, :], mask=mask,
                              other=0.0)
                h = (h.to(tl.float32) + res.to(tl.float32)).to(h.dtype)
                if pid == 0:  # the new residual, x + residual, once
                    tl.store(res_out_ptr + rows[:, None] * stride_res_out + kk[None, :], h,
                             mask=mask)
            h = h.to(tl.float32)
            sum_sq += tl.sum(h * h, 1)
        rstd = tl.rsqrt(sum_sq / K + eps)

    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_mask = kk < K
        if k0 > 0:
            w = tl.load(w_rows + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        a = _input_tile(x_ptr, res_ptr, norm_w_ptr, rows, row_mask, kk, k_mask, rstd, stride_x,
                        stride_res, K, PROLOGUE, HAS_RES)
        acc += a[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, 2)  # [M_PAD, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def gemv_config(n: int, k: int) -> dict:
    """BLOCK_N, BLOCK_K and warps of one projection: the best of a sweep on an H200 at M=1 for each
    of Qwen3-0.6B's (its log: benchmarks/results/h200_batch1_micro.log of commit ecd9371)."""
    return dict(BLOCK_N=4, BLOCK_K=min(1024, triton.next_power_of_2(k)),
                num_warps=8 if k > 1024 else 4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         prologue: int = PLAIN, residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a @ weight.T + bias, new residual) for x [M, *] with M <= MAX_ROWS, where a is x (PLAIN),
    RMSNorm(x + residual) with norm_weight (NORM; the new residual is x + residual, or x without
    one) or silu(gate) * up of x = [gate | up] (SILU; new residual None)."""
    m = x.shape[0]
    n, k = weight.shape
    assert m <= MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert x.shape[1] == (2 * k if prologue == SILU else k)
    assert prologue != NORM or norm_weight is not None
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    has_res = residual is not None
    res_out = torch.empty_like(x) if has_res else None
    if m == 0:
        return y, (res_out if has_res else x) if prologue == NORM else None
    cfg = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, residual if has_res else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else x, y, res_out if has_res else y, m, eps,
        x.stride(0), residual.stride(0) if has_res else 0, weight.stride(0), y.stride(0),
        res_out.stride(0) if has_res else 0,
        N=n, K=k, PROLOGUE=prologue, HAS_RES=has_res, HAS_BIAS=bias is not None,
        M_PAD=triton.next_power_of_2(m), **cfg, **pdl_launch(x.device, m),
    )
    if prologue != NORM:
        return y, None
    return y, res_out if has_res else x
