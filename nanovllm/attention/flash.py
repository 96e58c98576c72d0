"""The flash backend: flash-attn's paged-KV kernel for the decodes, its varlen kernel for the
prefill chunks.

Both read the paged cache through the block tables (`block_table=`), which flash-attn supports for
block sizes that are a multiple of 256; the new K/V are already there. The varlen kernel takes its
grid from host numbers (the longest chunk, the number of chunks), so a CUDA graph captures the
decode-only steps whole and the others piecewise.
"""
import torch

from nanovllm.attention import AttentionBackend, AttentionMetadata
from nanovllm.config import Config

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None


class FlashBackend(AttentionBackend):
    cudagraph_support = "decode"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, config: Config):
        if config.kv_cache_dtype == "fp8":
            raise ValueError("kv_cache_dtype='fp8' needs attn_backend 'triton' or 'sdpa', not "
                             "'flash' (flash-attn 2 has no FP8 KV cache)")
        if flash_attn_varlen_func is None:
            raise ValueError("attn_backend='flash' needs flash-attn: pip install -e '.[flash]' "
                             "(or pip install flash-attn), or use attn_backend='triton' "
                             "(or 'sdpa')")
        if config.device != "cuda":
            raise ValueError(f"attn_backend='flash' runs on CUDA only, not "
                             f"device={config.device!r}; use 'sdpa'")
        if config.kvcache_block_size % 256:
            raise ValueError("attn_backend='flash' needs kvcache_block_size to be a multiple of "
                             f"256 (flash-attn's paged KV), got {config.kvcache_block_size}")
        if config.torch_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attn_backend='flash' computes in float16 or bfloat16, not "
                             f"{config.torch_dtype} (dtype='auto' took the checkpoint's): pass "
                             "dtype='bfloat16', or use attn_backend='triton' or 'sdpa'")
        super().__init__(num_heads, num_kv_heads, head_dim, config)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, d: int) -> torch.Tensor:
        return flash_attn_with_kvcache(q[:d, None], k_cache, v_cache,
                                       cache_seqlens=meta.context_lens[:d],
                                       block_table=meta.block_tables[:d], softmax_scale=self.scale,
                                       causal=True)[:, 0]

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        d = meta.num_decodes
        if d == meta.context_lens.shape[0]:
            return self.decode(q, k_cache, v_cache, meta, d)
        # the chunks' offsets into q and into the keys need no rebasing: the kernel reads them
        cu = meta.cu_seqlens_q_host
        max_q = max(b - a for a, b in zip(cu, cu[1:]))
        out = flash_attn_varlen_func(q, k_cache, v_cache, meta.cu_seqlens_q[d:],
                                     meta.cu_seqlens_k[d:], max_q, max(meta.context_lens_host[d:]),
                                     softmax_scale=self.scale, causal=True,
                                     block_table=meta.block_tables[d:])
        if d:
            out[:d] = self.decode(q, k_cache, v_cache, meta, d)
        return out
