"""Triton attention backend: PagedAttention with our own kernels (nanovllm/kernels).

PagedAttention keeps each layer's KV cache as a pool of fixed-size blocks and gives every sequence a
block table, so memory is claimed a block at a time and blocks can be shared between sequences
(prefix caching). The model has written this step's K/V into their slots already; the backend attends by
reading every key through the block table: a causal varlen kernel for prefill, a split-KV
("flash decoding") kernel for decode. One backend object serves all layers of a model; the decode
scratch it preallocates is reused layer after layer, and nothing here syncs with the host, so the
decode path can be captured in a CUDA graph.
"""
import torch

from nanovllm.attention import AttentionBackend, AttentionMetadata
from nanovllm.kernels import decode_attention, num_decode_splits, prefill_attention
from nanovllm.kernels.decode import decode_scratch

CPU_NUM_SMS = 4  # the interpreter has no SMs; a few keeps split-KV in play in CPU tests


class TritonBackend(AttentionBackend):
    """Attend with the Triton prefill or decode kernel."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, config):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, config)
        device = torch.device(config.device)
        on_gpu = device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else CPU_NUM_SMS
        self.max_model_len = config.max_model_len
        self.scratch = decode_scratch(config.max_num_seqs, num_heads, num_kv_heads, head_dim,
                                      config.max_model_len, self.num_sms, device)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill:
            return prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                     meta.block_tables, self.scale, meta.max_seqlen_q)
        num_splits = num_decode_splits(q.shape[0], self.num_kv_heads, self.head_dim, self.max_model_len, self.num_sms)
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                                num_splits, self.scratch)
