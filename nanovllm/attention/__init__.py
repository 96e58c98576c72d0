"""Pluggable attention (PagedAttention's kernel side).

Every backend reads the KV cache through a block table: the cache of one layer is a pool of
fixed-size blocks, `k_cache[num_blocks, block_size, num_kv_heads, head_dim]`, and token `i` of a
sequence lives in slot `block_table[i // block_size] * block_size + i % block_size`.
The model runner builds one `AttentionMetadata` per forward pass and hands it down the model. The
model writes the new K/V at `slot_mapping` (fused with rotary: nanovllm/layers/rotary.py), so a
backend only has to attend.
"""
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What the attention of one forward pass needs to know about the batch."""
    is_prefill: bool
    slot_mapping: torch.Tensor   # [num_tokens] int32: cache slot of each new token, -1 = skip (padding)
    context_lens: torch.Tensor   # [num_seqs] int32: keys per sequence after this step (cached + new)
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32: block ids, padded with 0
    # prefill only: the new tokens of the batch are packed, sequence i owning cu_seqlens_q[i]:cu_seqlens_q[i+1]
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    has_prefix: bool = False     # some sequence attends to keys computed in an earlier step


class AttentionBackend:
    """The interface: `forward` attends over the paged cache, which already holds this step's K/V.

    q: [num_tokens, num_heads, head_dim]; returns [num_tokens, num_heads, head_dim]. In prefill, query
    token j of a sequence with q_len new tokens and k_len keys sits at position k_len - q_len + j and
    sees keys 0..that position.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, config):
        # config: nanovllm.config.Config (max_num_seqs, max_model_len, kvcache_block_size, device, ...)
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.config = config

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


BACKENDS = ("flash", "triton", "sdpa")


def get_backend(name: str):
    """Return the backend class for a name in BACKENDS (imports lazily: flash-attn is optional)."""
    if name == "sdpa":
        from nanovllm.attention.sdpa import SDPABackend
        return SDPABackend
    if name == "triton":
        from nanovllm.attention.triton import TritonBackend
        return TritonBackend
    if name == "flash":
        from nanovllm.attention.flash import FlashBackend
        return FlashBackend
    raise ValueError(f"attn_backend={name!r} is not one of {BACKENDS}")
