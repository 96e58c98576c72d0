"""The KV cache's memory (vLLM's cache engine): one tensor holding, for K and for V and for every
layer, a pool of blocks [num_blocks, block_size, num_kv_heads, head_dim], and the block copies of
copy-on-write. How many blocks: `num_kvcache_blocks` if given; on CPU, CPU_KVCACHE_BYTES; on CUDA,
what gpu_memory_utilization leaves free (nanovllm/worker/memory_profile.py). With
kv_cache_dtype="fp8" a block takes half the bytes of bfloat16: twice as many fit (attention/fp8.py).
"""
import math

import torch

from nanovllm.attention.paged_attention import PagedAttention

CPU_KVCACHE_BYTES = 1 << 30


class KVCache:
    def __init__(self, model: torch.nn.Module, config, device: torch.device):
        self.attns = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.shape = [2, len(self.attns), 0, config.kvcache_block_size, self.attns[0].num_kv_heads,
                      config.hf_config["head_dim"]]
        self.dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else config.torch_dtype
        self.device, self.tensor = device, None
        self.block_bytes = self.dtype.itemsize * math.prod(self.shape[:2] + self.shape[3:])

    def allocate(self, num_blocks: int):
        """Allocate the pools and point every layer at its own K and V."""
        self.tensor = None  # free the old pools first
        self.shape[2] = num_blocks
        # an FP8 pool is held as bytes, which block copies and swaps index on any device
        storage = torch.uint8 if self.dtype == torch.float8_e4m3fn else self.dtype
        self.tensor = torch.zeros(self.shape, dtype=storage, device=self.device)
        for i, attn in enumerate(self.attns):
            attn.k_cache, attn.v_cache = self.tensor[:, i].view(self.dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]):
        """Copy-on-write: each (src, dst) block, over all layers, in one index copy."""
        if copies:
            src, dst = map(list, zip(*copies))
            self.tensor[:, :, dst] = self.tensor[:, :, src]
