"""PagedAttention, the layer (the vLLM paper, section 4.1): write this step's keys and values into
the block-paged KV cache, then read every key back through the block tables.

`write` rotates the query and key heads (rotary embedding, after Qwen3's per-head RMSNorm) and
stores the keys and values at their slots, `block_id * block_size + offset` (`slot_mapping`; -1 is
a padding token and is skipped). On CUDA that is one Triton kernel per layer (kernels/store_kv.py);
on CPU it is the plain PyTorch below, also the kernel's test reference. `read` is the backend's.
"""
import torch
from torch import nn

from nanovllm.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.rotary import RotaryEmbedding, norm_rope


def store_kv(k, v, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0):
    """Write k, v [N, num_kv_heads, D] into the flattened cache at slot_mapping (skipping -1)."""
    if k_cache.dtype != k.dtype:  # an FP8 cache: quantized on the way in (attention/fp8.py)
        from nanovllm.attention.fp8 import store_quantized
        return store_quantized(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, rotary: RotaryEmbedding,
                 backend: AttentionBackend):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.rotary = rotary
        self.backend = backend
        self.kv_scales = backend.k_scale, backend.v_scale  # what the cache holds is K / k_scale
        self.rope_store = None  # on CUDA: rotary and store in one kernel (kernels/store_kv.py)
        if backend.config.device == "cuda":
            from nanovllm.kernels.store_kv import rope_store  # imports triton: only where it runs
            self.rope_store = rope_store
        # [num_blocks, block_size, num_kv_heads, head_dim] each, bound by the model runner
        self.k_cache = self.v_cache = torch.tensor([])

    def write(self, qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> torch.Tensor:
        """qkv [N, num_heads + 2 * num_kv_heads, D]: store the rotated keys and the values; return
        the rotated queries [N, num_heads, D]."""
        norm = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm else (None, None, 0.0)
        if self.rope_store is not None:
            return self.rope_store(qkv, positions, self.rotary.cos_sin, self.num_heads,
                                   self.k_cache, self.v_cache, slot_mapping, *norm,
                                   *self.kv_scales)
        num_qk = self.num_heads + self.num_kv_heads
        qk = norm_rope(qkv[:, :num_qk], positions, self.rotary.cos_sin, self.num_heads, *norm)
        store_kv(qk[:, self.num_heads:], qkv[:, num_qk:], self.k_cache, self.v_cache, slot_mapping,
                 *self.kv_scales)
        return qk[:, :self.num_heads]

    def read(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each query's attention over its sequence's keys in the cache: [N, num_heads, D]."""
        return self.backend.forward(q, self.k_cache, self.v_cache, meta)
