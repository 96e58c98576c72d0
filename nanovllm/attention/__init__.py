"""Pluggable attention, PagedAttention's read side (the vLLM paper, section 4.1).

Every backend reads the KV cache through block tables: a layer's cache is a pool of blocks,
`k_cache[num_blocks, block_size, num_kv_heads, head_dim]`, and token i of a sequence lives in slot
`block_table[i // block_size] * block_size + i % block_size`. One step's new tokens are packed;
sequence s owns tokens cu_seqlens_q[s]:cu_seqlens_q[s + 1]. The sequences with one new token (the
decodes) come first, then the prefill chunks (vLLM v1's and Sarathi-Serve's mixed batches). The
layer that writes this step's K/V and calls the backend is nanovllm/attention/paged_attention.py.
"""
import importlib
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about one forward pass (built by the model runner)."""
    slot_mapping: torch.Tensor  # [num_tokens] int32: cache slot of each new token, -1 = padding
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: new tokens of sequence s start at [s]
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: the same over keys (flash-attn's varlen)
    context_lens: torch.Tensor  # [num_seqs] int32: keys per sequence after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: block ids, padded with 0
    num_decodes: int            # leading sequences with one new token (a graph: the rows it runs)
    cu_seqlens_q_host: list[int]  # the same numbers on the host, for backends that loop
    context_lens_host: list[int]
    query_tiles: torch.Tensor | None = None  # [num_tiles, 2] int32 (triton's prefill: its tiles)
    cascade: object = None  # a plan reading shared prefixes once (attention/cascade.py)


class AttentionBackend:
    """The interface: `forward` attends over the paged cache, which already holds this step's K/V.

    q: [num_tokens, num_heads, head_dim]; returns the same shape. Query j of a sequence with q_len
    new tokens and k_len keys sits at position k_len - q_len + j and sees keys 0..that position.
    """
    # What a CUDA graph may capture of this backend (vLLM's AttentionCGSupport): "always" (any
    # step), "decode" (steps of decodes only) or "never"; steps it cannot capture run piecewise.
    cudagraph_support = "never"
    cascade = None  # its cascade attention, if it has one (attention/cascade.py)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, config):
        # config: nanovllm.config.Config (max_num_seqs, max_model_len, kvcache_block_size, device)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_scale = self.v_scale = 1.0  # an FP8 cache holds K / k_scale, V / v_scale (fp8.py)
        self.config = config

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


# module: class
BACKENDS = {"flash": "FlashBackend", "triton": "TritonBackend", "sdpa": "SDPABackend"}


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class of a name in BACKENDS (Config checked it; imported on demand: flash-attn
    is optional)."""
    return getattr(importlib.import_module(f"nanovllm.attention.{name}"), BACKENDS[name])
