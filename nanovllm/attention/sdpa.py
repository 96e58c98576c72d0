"""The baseline backend: PyTorch's scaled_dot_product_attention over K/V gathered through the block
tables.

It copies each sequence's keys (this step's included) out of the paged cache into a dense tensor
(the copy that PagedAttention kernels avoid) and calls SDPA: the decodes as one padded batch, each
prefill chunk on its own. Runs on CPU and CUDA; on CUDA its steps run as piecewise CUDA graphs.
"""
import torch
import torch.nn.functional as F

from nanovllm.attention import AttentionBackend, AttentionMetadata


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype,
              scale: float = 1.0) -> torch.Tensor:
    """Dense keys (or values) in dtype: [num_seqs, num_kv_heads, max_blocks * block_size, D]."""
    if cache.dtype != dtype:  # an FP8 cache, dequantized as it is gathered (attention/fp8.py)
        from nanovllm.attention.fp8 import gather_dequantized
        return gather_dequantized(cache, block_tables, dtype, scale)
    blocks = cache[block_tables]  # [num_seqs, max_blocks, block_size, num_kv_heads, head_dim]
    return blocks.flatten(1, 2).transpose(1, 2)


class SDPABackend(AttentionBackend):
    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        d, cu = meta.num_decodes, meta.cu_seqlens_q_host
        if d:  # one query per sequence: a batch, each row masked to its own context
            keys = gather_kv(k_cache, meta.block_tables[:d], q.dtype, self.k_scale)  # [d,Hkv,L,D]
            values = gather_kv(v_cache, meta.block_tables[:d], q.dtype, self.v_scale)
            mask = torch.arange(keys.size(2), device=q.device) < meta.context_lens[:d, None]
            out[:d] = F.scaled_dot_product_attention(
                q[:d, :, None], keys, values, attn_mask=mask[:, None, None], scale=self.scale,
                enable_gqa=True)[:, :, 0]
        for s in range(d, len(cu) - 1):
            q_len, k_len = cu[s + 1] - cu[s], meta.context_lens_host[s]
            table = meta.block_tables[s:s + 1, :-(-k_len // k_cache.size(1))]
            keys = gather_kv(k_cache, table, q.dtype, self.k_scale)[:, :, :k_len]  # [1,Hkv,k_len,D]
            values = gather_kv(v_cache, table, q.dtype, self.v_scale)[:, :, :k_len]
            # query j sits at position k_len - q_len + j: a causal mask aligned to the bottom right
            rows = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
            mask = torch.arange(k_len, device=q.device) <= rows
            qs = q[cu[s]:cu[s + 1]].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)
            out[cu[s]:cu[s + 1]] = o[0].transpose(0, 1)
        return out
