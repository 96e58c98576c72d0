"""The flash backend: flash-attn's varlen kernel for prefill and its paged-KV kernel for decode.

Both read the paged cache through the block table (`block_table=`), which flash-attn supports for
block sizes that are a multiple of 256; the new K/V are already there (the model writes them).
"""
import torch

from nanovllm.attention import AttentionBackend, AttentionMetadata

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None


class FlashBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, config):
        if flash_attn_varlen_func is None:
            raise ValueError("attn_backend='flash' needs flash-attn: pip install -e '.[flash]' "
                             "(or pip install flash-attn), or use attn_backend='triton' (or 'sdpa')")
        if config.device != "cuda":
            raise ValueError(f"attn_backend='flash' runs on CUDA only, not device={config.device!r}; use 'sdpa'")
        if config.kvcache_block_size % 256:
            raise ValueError(f"attn_backend='flash' needs kvcache_block_size to be a multiple of 256 "
                             f"(flash-attn's paged KV), got {config.kvcache_block_size}")
        super().__init__(num_heads, num_kv_heads, head_dim, scale, config)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if not meta.is_prefill:
            return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                           block_table=meta.block_tables, softmax_scale=self.scale,
                                           causal=True).squeeze(1)
        return flash_attn_varlen_func(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                      meta.max_seqlen_k, softmax_scale=self.scale, causal=True,
                                      block_table=meta.block_tables)
