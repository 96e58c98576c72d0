"""Triton attention backend: PagedAttention with our own kernels (nanovllm/kernels).

The decode kernel (split-KV, "flash decoding") runs the sequences with one new token, the prefill
kernel the query tiles of the prefill chunks, both into one output. Each kernel reads from the data
which rows and tiles to run, so a CUDA graph launches them with a fixed grid and one graph serves
any mix of decodes and chunks of its size. Decodes that share a prefix may read it once instead
(cascade attention, attention/cascade.py), when the step's plan says so. The decode scratch is
preallocated and reused layer after layer, and nothing here reads a device value on the host.
"""
import os

import torch

from nanovllm.attention import AttentionBackend, AttentionMetadata
from nanovllm.attention.cascade import Cascade
from nanovllm.config import Config
from nanovllm.kernels import decode_attention, num_decode_splits, prefill_attention
from nanovllm.kernels.cascade import cascade_attention
from nanovllm.kernels.decode import decode_scratch
from nanovllm.kernels.prefill import QUERY_TILE, query_tiles

CPU_NUM_SMS = 4  # the interpreter has no SMs; a few keeps split-KV in play in CPU tests


class TritonBackend(AttentionBackend):
    cudagraph_support = "always"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, config: Config):
        if config.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attn_backend='triton' on device='cpu' runs only in Triton's "
                             "interpreter (slow; for tests): set TRITON_INTERPRET=1 before Python "
                             "starts, or use attn_backend='sdpa'")
        super().__init__(num_heads, num_kv_heads, head_dim, config)
        device = torch.device(config.device)
        on_gpu = device.type == "cuda"
        self.num_sms = CPU_NUM_SMS
        if on_gpu:
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_model_len = config.max_model_len
        self.scratch = decode_scratch(config.max_num_seqs, num_heads, num_kv_heads, head_dim,
                                      config.max_model_len, self.num_sms, device)
        if not config.disable_cascade_attn:  # shared prefixes read once per step
            self.cascade = Cascade(self, config)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d and meta.cascade is not None:
            c = meta.cascade
            cascade_attention(q, k_cache, v_cache, meta.cu_seqlens_q[:d + 1], meta.context_lens[:d],
                              meta.block_tables[:d], c.key_starts[:d], c.tiles, self.scale,
                              c.num_splits, c.prefix_splits, self.cascade.scratch, out,
                              self.k_scale, self.v_scale)
        elif d:
            splits = num_decode_splits(d, self.num_kv_heads, self.head_dim, self.max_model_len,
                                       self.num_sms)
            decode_attention(q, k_cache, v_cache, meta.cu_seqlens_q[:d + 1], meta.context_lens[:d],
                             meta.block_tables[:d], self.scale, splits, self.scratch, out,
                             self.k_scale, self.v_scale)
        if meta.query_tiles is None:  # eager: list them once per step (a graph uploads them)
            tiles = query_tiles(meta.cu_seqlens_q_host, d)
            meta.query_tiles = torch.tensor(tiles, dtype=torch.int32, device=q.device).view(-1, 2)
        if meta.query_tiles.shape[0]:
            prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                              meta.block_tables, meta.query_tiles, QUERY_TILE, self.scale, out,
                              self.k_scale, self.v_scale)
        return out
