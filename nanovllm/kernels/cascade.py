"""Cascade attention: a shared prefix read once for all the decodes that share it (FlashInfer's
cascade attention, vLLM's cascade attention, and Hydragen, "High-Throughput LLM Inference with
Shared Prefixes").

When decode rows share a leading run of KV blocks (a system prompt hit in the prefix cache, the n
samples of one request, the beams of a beam search), plain decode reads those keys once per row.
Here the rows come in *tiles* (attention/cascade.py): the members of a tile share `shared_len`
leading keys, and a row that shares nothing is a tile of its own. The queries of all members times
the GROUP query heads of one KV head form one block of rows, and one program per (tile, KV head,
split) walks the tile's *key list*: the shared prefix, then each member's own keys in turn

    [ prefix (every row sees it) | member 0's own keys | member 1's own keys | ... ]

so each key is read once and multiplied with a real matrix (Hydragen's point: many queries, one
read), and a row masks out the other members' own keys. The list is cut into NUM_SPLITS equal
chunks, so a tile's programs all do the same work whatever its members' lengths, and each program
runs one long loop: one launch reads the prefixes and the rows' own keys alike, with no kernel per
part and no idle tail between them. Each split writes a partial output and log-sum-exp per (row,
query head); the merge kernel combines them (with one split, the tile kernel writes the output).

Tiles come from the host: per tile, the row whose block table holds the shared blocks (-1: an
unused tile of a CUDA graph, which returns at once), `shared_len`, and its member rows (-1: none).
"""
import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode import _split_range, decode_config
from nanovllm.kernels.paged import widen_config, widen_v

ROWS = 32  # query rows of a tile: members x GROUP heads (tl.dot wants >= 16)
MAX_CASCADE_SPLITS = 16


def members_per_tile(group: int) -> int:
    """Decode rows one tile holds, for GROUP query heads per KV head."""
    return max(1, ROWS // group)


@triton.jit(do_not_specialize=["stride_bt"])
def _cascade_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    tiles_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, MEMBERS: tl.constexpr, MEMBERS_PAD: tl.constexpr,
    ROWS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tile_ptr = tiles_ptr + tile * (2 + MEMBERS)  # [first row, shared_len, members...]
    first = tl.load(tile_ptr)
    shared_len = tl.load(tile_ptr + 1)
    if first < 0:
        return  # an unused tile of a CUDA graph
    # the members: their rows, and where their own keys sit in the key list (after the prefix)
    slots = tl.arange(0, MEMBERS_PAD)
    slot_row = tl.load(tile_ptr + 2 + slots, mask=slots < MEMBERS, other=-1)
    context = tl.load(context_lens_ptr + slot_row, mask=slot_row >= 0, other=0)
    own = tl.where(slot_row >= 0, context - shared_len, 0)
    own_end = tl.cumsum(own, 0)  # [MEMBERS_PAD]: member m's own keys are list entries
    own_start = own_end - own    # shared_len + [own_start[m], own_end[m])
    start, end = _split_range(0, shared_len + tl.sum(own, 0), split, NUM_SPLITS, BLOCK_N)

    rows = tl.arange(0, ROWS_PAD)  # row r: member r // GROUP, query head r % GROUP of the group
    member = rows // GROUP
    seq = tl.load(tile_ptr + 2 + member, mask=member < MEMBERS, other=-1)  # its decode row
    row_mask = seq >= 0
    seq = tl.where(row_mask, seq, 0)
    token = tl.load(cu_seqlens_q_ptr + seq, mask=row_mask, other=0)  # the row's query token
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
                + dims[None, :], mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)  # [ROWS_PAD, D]
    k_ptr = k_cache_ptr + kv_head * stride_kh
    v_ptr = v_cache_ptr + kv_head * stride_kh

    m_i = tl.full([ROWS_PAD], float("-inf"), tl.float32)
    l_i = tl.full([ROWS_PAD], 0.0, tl.float32)
    acc = tl.full([ROWS_PAD, HEAD_DIM], 0.0, tl.float32)
    for start_n in range(start, end, BLOCK_N):
        entry = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] entries of the key list
        in_range = entry < end
        shared = entry < shared_len
        # an own key's member: how many members' own keys end at or before it
        owner = tl.sum((entry[:, None] - shared_len >= own_end[None, :]).to(tl.int32), 1)
        is_owner = owner[:, None] == slots[None, :]  # [BLOCK_N, MEMBERS_PAD]
        key_row = tl.where(shared, first, tl.sum(tl.where(is_owner, slot_row[None, :], 0), 1))
        pos = tl.where(shared, entry, entry - tl.sum(tl.where(is_owner, own_start[None, :], 0), 1))
        block_ids = tl.load(block_tables_ptr + key_row.to(tl.int64) * stride_bt + pos // BLOCK_SIZE,
                            mask=in_range, other=0).to(tl.int64)
        kv_rows = block_ids * stride_kb + (pos % BLOCK_SIZE) * stride_ks
        kv_offsets = kv_rows[:, None] + dims[None, :]  # [BLOCK_N, D]
        k = tl.load(k_ptr + kv_offsets, mask=in_range[:, None], other=0.0).to(DOT_DTYPE)
        v = widen_v(tl.load(v_ptr + kv_offsets, mask=in_range[:, None], other=0.0), DOT_DTYPE,
                    FP8_ASM)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [ROWS_PAD, BLOCK_N], log2 units
        # a row sees the prefix and its own keys
        visible = in_range[None, :] & (shared[None, :] | (member[:, None] == owner[None, :]))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    saw = l_i > 0  # a row whose keys all fell in other splits: weight 0 in the merge
    l_safe = tl.where(saw, l_i, 1.0)
    out = acc * (v_scale / l_safe)[:, None]  # v_scale: an FP8 cache's V scale (1 otherwise)
    if NUM_SPLITS == 1:  # the one split is the answer: straight to the output
        dst = out_ptr + token.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(dst + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        dst = (partial_ptr + seq[:, None] * stride_pb + split * stride_ps
               + heads[:, None] * stride_ph + dims[None, :])
        tl.store(dst, out, mask=row_mask[:, None])
        tl.store(lse_ptr + seq * stride_lb + split * stride_ls + heads,
                 tl.where(saw, m_i + tl.log2(l_safe), float("-inf")), mask=row_mask)


@triton.jit
def _cascade_merge_kernel(
    partial_ptr, lse_ptr, out_ptr, cu_seqlens_q_ptr,
    stride_pb, stride_ps, stride_ph, stride_lb, stride_ls, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """out = sum_i 2^(lse_i - max lse) * o_i / sum_i 2^(lse_i - max lse) over the splits of one
    (decode row, query head): every split of the row's tile wrote its slot."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(cu_seqlens_q_ptr + seq)
    next_token = tl.load(cu_seqlens_q_ptr + seq + 1)
    if next_token - token != 1:
        return  # not a decode: a prefill chunk (the prefill kernel's) or a padding row
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    live = splits < NUM_SPLITS
    lse = tl.load(lse_ptr + seq * stride_lb + splits * stride_ls + head, mask=live,
                  other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # [SPLITS_PAD]; 0 for the splits that saw no key
    partial = tl.load(partial_ptr + seq * stride_pb + splits[:, None] * stride_ps + head * stride_ph
                      + dims[None, :], mask=live[:, None], other=0.0)  # [SPLITS_PAD, D]
    out = tl.sum(weight[:, None] * partial, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty))


def cascade_scratch(num_seqs: int, num_slots: int, num_heads: int, head_dim: int,
                    device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials [B * slots * Hq * D] and log-sum-exps [B * slots * Hq], float32."""
    size = num_seqs * num_slots * num_heads
    return (torch.empty(size * head_dim, dtype=torch.float32, device=device),
            torch.empty(size, dtype=torch.float32, device=device))


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, tiles: torch.Tensor, scale: float,
                      num_splits: int, scratch: tuple | None = None,
                      out: torch.Tensor | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """decode_attention's result for the decode rows, reading each tile's shared prefix once.

    tiles [T, 2 + members_per_tile(GROUP)]: (first row, shared_len, member rows padded with -1);
    every decode row is a member of one tile (with shared_len 0 if it shares nothing), and
    shared_len is below every member's context length. num_splits cuts each tile's key list.
    """
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    members = members_per_tile(group)
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and block_tables.stride(-1) == 1
    assert tiles.shape[1] == 2 + members and tiles.is_contiguous()
    assert 1 <= num_splits <= MAX_CASCADE_SPLITS
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0 or tiles.shape[0] == 0:
        return out
    if scratch is None:
        scratch = cascade_scratch(num_seqs, num_splits, num_heads, head_dim, q.device)
    size = num_seqs * num_splits * num_heads
    assert scratch[0].numel() >= size * head_dim, "scratch sized for fewer splits"
    partial = scratch[0][:size * head_dim].view(num_seqs, num_splits, num_heads, head_dim)
    lse = scratch[1][:size].view(num_seqs, num_splits, num_heads, 1)
    partial_strides = (partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
                       lse.stride(1))
    cfg = decode_config(head_dim)
    _cascade_kernel[(tiles.shape[0], num_kv_heads, num_splits)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, tiles, out, partial, lse,
        scale * k_scale * math.log2(math.e), v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *partial_strides,
        GROUP=group, MEMBERS=members, MEMBERS_PAD=triton.next_power_of_2(members),
        ROWS_PAD=max(16, triton.next_power_of_2(members * group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], NUM_SPLITS=num_splits, **widen_config(q.dtype, k_cache.dtype),
        **cfg,
    )
    if num_splits > 1:
        _cascade_merge_kernel[(num_seqs, num_heads)](
            partial, lse, out, cu_seqlens_q, *partial_strides, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=2,
        )
    return out
