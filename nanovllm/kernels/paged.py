"""The paged-KV address rule, shared by the prefill and decode kernels.

The cache of one layer is a pool of blocks, `cache[num_blocks, block_size, num_kv_heads, head_dim]`;
key `i` of a sequence lives in block `block_table[i // block_size]` at offset `i % block_size`.
A tile of keys may span several blocks (block_size < tile) or sit inside one (block_size >= tile):
looking up the block of every key on its own handles both with one code path, and the lookups of
one tile mostly hit the same few block-table entries in L1.
"""
import os

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def widen_config(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> dict:
    """How the kernels widen the cache for their tensor-core dots: DOT_DTYPE, and FP8_ASM (V's
    e4m3 -> float16 through `widen_v`'s inline PTX; the interpreter runs no PTX).

    The dots run in q's dtype, except float16 over an FP8 cache with a 16-bit model: e4m3 widens
    to float16 in one packed instruction per two values (cvt.rn.f16x2.e4m3x2, sm_89+), to bfloat16
    only through float16 and a second, scalar conversion per value, which made the FP8 cache slower
    to read than bfloat16 on an H200. float16 holds every e4m3 value exactly, a softmax weight in
    [0, 1] more finely than bfloat16, and q (normed or projected activations) far below its 65504
    limit; the dots accumulate in float32 either way.
    """
    fp8 = cache_dtype == torch.float8_e4m3fn and q_dtype in (torch.float16, torch.bfloat16)
    return dict(DOT_DTYPE=tl.float16 if fp8 else TL_DTYPES[q_dtype],
                FP8_ASM=fp8 and os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def widen_v(v, DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr):
    """A V tile [BLOCK_N, D] as loaded, in DOT_DTYPE.

    V is the second operand of p @ v, summed over keys, which are rows apart in the cache: the dot
    reads it from shared memory transposed. Left to itself, Triton moves an FP8 tile's conversion
    to after that transpose, where 8-bit values can only be read one byte at a time (one LDS.U8 per
    value). The conversion as inline PTX that is not marked pure stays here, on the 16-byte rows as
    loaded, and the float16 tile is transposed by ldmatrix like a bfloat16 cache's.
    """
    if FP8_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4)
    return v.to(DOT_DTYPE)


@triton.jit
def kv_row_offsets(block_table_row, keys, key_mask, stride_block, stride_slot,
                   BLOCK_SIZE: tl.constexpr):
    """Element offset of each key's row (for one KV head) in the cache; int64 since the pool can
    pass 2**31."""
    block_ids = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    return block_ids * stride_block + (keys % BLOCK_SIZE) * stride_slot  # [BLOCK_N]
