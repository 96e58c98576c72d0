"""The baseline backend: PyTorch's scaled_dot_product_attention over K/V gathered through the block table.

It copies each sequence's keys (this step's included, written by the model) out of the paged cache
into a dense tensor (the copy PagedAttention kernels avoid) and calls SDPA. Runs on CPU and CUDA.
"""
import torch
import torch.nn.functional as F

from nanovllm.attention import AttentionBackend, AttentionMetadata


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Dense keys (or values) [num_seqs, num_kv_heads, max_blocks * block_size, head_dim] of each sequence."""
    blocks = cache[block_tables]  # [num_seqs, max_blocks, block_size, num_kv_heads, head_dim]
    return blocks.flatten(1, 2).transpose(1, 2)


class SDPABackend(AttentionBackend):
    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill:
            return self._prefill(q, k_cache, v_cache, meta)
        return self._decode(q, k_cache, v_cache, meta)

    def _prefill(self, q, k_cache, v_cache, meta):
        out = torch.empty_like(q)
        cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
        for i in range(len(cu_q) - 1):
            q_len, k_len = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            table = meta.block_tables[i:i + 1, :(k_len + k_cache.size(1) - 1) // k_cache.size(1)]
            keys = gather_kv(k_cache, table)[:, :, :k_len]  # [1, num_kv_heads, k_len, head_dim]
            values = gather_kv(v_cache, table)[:, :, :k_len]
            # query j sits at position k_len - q_len + j: a causal mask aligned to the bottom right
            rows = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
            mask = torch.arange(k_len, device=q.device)[None, :] <= rows
            qi = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
            o = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[cu_q[i]:cu_q[i + 1]] = o[0].transpose(0, 1)
        return out

    def _decode(self, q, k_cache, v_cache, meta):
        keys = gather_kv(k_cache, meta.block_tables)  # [B, num_kv_heads, L, head_dim]
        values = gather_kv(v_cache, meta.block_tables)
        mask = torch.arange(keys.size(2), device=q.device)[None, :] < meta.context_lens[:, None]  # [B, L]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
                                           scale=self.scale, enable_gqa=True)  # [B, num_heads, 1, head_dim]
        return o.squeeze(2)
