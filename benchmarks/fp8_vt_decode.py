"""Decode attention over an FP8 cache whose V is stored transposed within each block
([block, KV head, dim, slot]), against the engine's FP8 decode kernel
(`python benchmarks/fp8_vt_decode.py` on a GPU; `--count` compiles both for sm_90 on any machine
and counts the instructions of their key-tile loops).

The engine's cache is [block, slot, KV head, dim] for K and V alike. In p @ V the keys are the
reduction: V's rows. Tensor cores take that operand with the reduction contiguous, so V's tile is
transposed in shared memory on the way, and an FP8 tile widened after that transpose is read a byte
at a time: the engine's FP8 decode kernel issues 41 instructions a KB of cache against bfloat16's
13.2 (results/offline_sm90_resources.log). With V stored transposed, each dim's keys lie
contiguous, the tile arrives already in the order the dot wants, and the widening is elementwise.
Only the kernel is here (the benchmark transposes a copy of V); the engine would also have to store
and copy V that way. Checked against float64 in Triton's interpreter (tests/test_fp8.py); not yet
run on a GPU.

Compiled offline with the GPU host's Triton 3.6 (`--count`; results/offline_sm90_resources.log),
it does not pay: 32 to 43 instructions a KB of cache against the engine's 41 and widen_v's PTX at
128 keys, 24.9. A tile masked along its contiguous keys loads a byte at a time (so the tile is
loaded whole, the keys past the end zeroed after: SEL), and Triton still shuffles the widened
bytes into the dot's layout (PRMT).
"""
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.paged import widen_config, widen_v  # noqa: E402


@triton.jit(do_not_specialize=["stride_bt"])
def _vt_decode_kernel(
    q_ptr, k_cache_ptr, vt_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    out_ptr, qk_scale, v_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vh, stride_vd, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr,
):
    """One (KV head, sequence) of decode attention, one split (batch-256 decode needs no more)."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    token = tl.load(cu_seqlens_q_ptr + seq)
    next_token = tl.load(cu_seqlens_q_ptr + seq + 1)
    end = tl.load(context_lens_ptr + seq)
    if next_token - token != 1:
        return
    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)
    k_ptr = k_cache_ptr + kv_head * stride_kh
    vt_ptr = vt_cache_ptr + kv_head * stride_vh
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM], 0.0, tl.float32)
    for start_n in range(0, end, BLOCK_N):
        first = tl.multiple_of(start_n % BLOCK_SIZE, BLOCK_N)
        slots = first + tl.arange(0, BLOCK_N)  # one block holds the whole tile
        key_mask = start_n + tl.arange(0, BLOCK_N) < end
        block = tl.load(block_table_row + start_n // BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_ptr + block * stride_kb + slots[:, None] * stride_ks + dims[None, :],
                    mask=key_mask[:, None], other=0.0).to(DOT_DTYPE)
        # [D, BLOCK_N], each dim's keys contiguous: loaded whole (a mask along the contiguous
        # keys would split the 16-byte loads), the slots past the end zeroed after (not NaN)
        vt = widen_v(tl.load(vt_ptr + block * stride_vb + dims[:, None] * stride_vd
                             + slots[None, :]), DOT_DTYPE, FP8_ASM)
        vt = tl.where(key_mask[None, :], vt, 0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), tl.trans(vt), input_precision="ieee")
        m_i = m_new
    out = acc * (v_scale / l_i)[:, None]
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def transposed(v_cache: torch.Tensor) -> torch.Tensor:
    """[block, slot, KV head, dim] -> [block, KV head, dim, slot]."""
    return v_cache.permute(0, 2, 3, 1).contiguous()


def vt_decode(q, k_cache, vt_cache, cu_seqlens_q, context_lens, block_tables, scale,
              k_scale=1.0, v_scale=1.0, block_n=128, num_warps=4, num_stages=2, maxnreg=None):
    """decode_attention's result with one split, V read from `transposed(v_cache)`; a tile of
    keys lies in one block (block_n divides the block size)."""
    assert k_cache.shape[1] % block_n == 0
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _vt_decode_kernel[(num_kv_heads, num_seqs)](
        q, k_cache, vt_cache, cu_seqlens_q, context_lens, block_tables, out,
        scale * k_scale * math.log2(math.e), v_scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), vt_cache.stride(0),
        vt_cache.stride(1), vt_cache.stride(2), block_tables.stride(0), out.stride(0),
        out.stride(1), GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        **widen_config(q.dtype, k_cache.dtype), num_warps=num_warps,
        num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return out


def count():
    """Key-tile loop instructions of this kernel and the engine's, compiled for sm_90 here."""
    from collections import Counter

    from kernel_resources import aligned, loop_body, resources, signature
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels.decode import _decode_split_kernel
    print(f"sm_90 (compiled here, Triton {triton.__version__}), FP8 cache, 4 warps, 2 stages\n\n"
          "| kernel | BLOCK_N | register cap | registers | shared bytes | programs per SM | "
          "instructions a tile | a KB of cache | most common |\n" + "|---" * 9 + "|")
    common = dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=256, DOT_DTYPE=tl.float16)
    rows = [("the engine's (.to())", _decode_split_kernel,
             dict(common, NUM_SPLITS=1, CASCADE=False, FP8_ASM=False), 128, 128)]
    rows += [(f"V transposed{', widen_v PTX' if asm else ''}", _vt_decode_kernel,
              dict(common, FP8_ASM=asm), n, cap)
             for asm in (False, True) for n in (64, 128) for cap in (None, 128)]
    for name, fn, constexprs, block_n, cap in rows:
        constexprs = dict(constexprs, BLOCK_N=block_n)
        types = signature(fn, constexprs)
        types.update({p: "*fp8e4nv" for p in ("k_cache_ptr", "v_cache_ptr", "vt_cache_ptr")
                      if p in types})
        src = ASTSource(fn=fn, signature=types, constexprs=constexprs, attrs=aligned(fn, types))
        options = dict(num_warps=4, num_stages=2, **({"maxnreg": cap} if cap else {}))
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        regs, _, shared, per_sm = resources(None, None, 4, kernel=kernel)
        body = loop_body(kernel)
        kb = block_n * 128 * 2 / 1024
        top = ", ".join(f"{op} {n}" for op, n in Counter(body).most_common(5))
        print(f"| {name} | {block_n} | {cap or '-'} | {regs} | {shared} | {per_sm} | {len(body)} | "
              f"{len(body) / kb:.1f} | {top} |", flush=True)


def main():
    from cascade_merge_variants import per_layer_us

    from nanovllm.attention.fp8 import quantize
    from nanovllm.kernels.decode import decode_attention
    props = torch.cuda.get_device_properties(0)
    hq, hkv, dim, block = 16, 8, 128, 256
    print(f"{props.name}: decode over an FP8 cache, Qwen3-0.6B heads, one layer, 28 launches in a "
          "CUDA graph, us per launch\n\n| batch | context | kernel | us | TB/s | max abs diff |"
          " vs the engine's |\n|---|---|---|---:|---:|---:|---:|")
    for batch, ctx in ((256, 640), (256, 1024), (128, 2048)):
        blocks = -(-ctx // block)
        k = quantize(torch.randn(batch * blocks + 1, block, hkv, dim, device="cuda"), 1.0)
        v = quantize(torch.randn_like(k, dtype=torch.float32), 1.0)
        vt = transposed(v)
        tables = (torch.randperm(batch * blocks, device="cuda").int() + 1).view(batch, blocks)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, hq, dim, dtype=torch.bfloat16, device="cuda")
        gb = batch * ctx * hkv * dim * 2 / 1e9
        ref = decode_attention(q, k, v, cu, lens, tables, dim ** -0.5).float()
        base = per_layer_us(lambda: decode_attention(q, k, v, cu, lens, tables, dim ** -0.5))
        print(f"| {batch} | {ctx} | the engine's | {base:.1f} | {gb / base * 1e3:.2f} | - | "
              "1.00x |", flush=True)
        for n, w, cap in ((64, 4, None), (128, 4, None), (128, 4, 128), (128, 8, None)):
            def fn(n=n, w=w, cap=cap):
                return vt_decode(q, k, vt, cu, lens, tables, dim ** -0.5, block_n=n,
                                 num_warps=w, maxnreg=cap)
            us = per_layer_us(fn)
            diff = (fn().float() - ref).abs().max().item()
            print(f"| {batch} | {ctx} | V transposed, {n} keys, {w} warps"
                  f"{f', at most {cap} registers' if cap else ''} | {us:.1f} | "
                  f"{gb / us * 1e3:.2f} | {diff:.1e} | {base / us:.2f}x |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    count() if "--count" in sys.argv else main()
