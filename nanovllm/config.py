"""Engine options, validated once: the `Config` every part of the engine reads."""
import json
import os
from dataclasses import dataclass, fields

import torch

from nanovllm.attention import BACKENDS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU_KVCACHE_BYTES = 1 << 30  # on CPU the KV cache takes 1 GiB unless num_kvcache_blocks says otherwise


@dataclass(slots=True)
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1       # -1: size the cache from free memory (GPU) or CPU_KVCACHE_BYTES
    enforce_eager: bool = False
    attn_backend: str = ""            # "" picks flash on cuda when flash-attn is installed, else triton; sdpa on cpu
    device: str = ""                  # "" picks cuda when present, else cpu
    dtype: str = "auto"               # "auto": the checkpoint's dtype on cuda, float32 on cpu
    load_format: str = "safetensors"  # or "dummy": random weights from config.json alone
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap": preempted blocks move to a CPU pool and come back
    swap_space: float = 4.0           # GiB of CPU memory for swapped-out blocks (used only in swap mode)
    skip_tokenizer_init: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    hf_config: dict | None = None     # filled in: the model's config.json
    torch_dtype: torch.dtype | None = None  # filled in from dtype

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        """Build a Config, naming any option that does not exist (a TypeError, not a silent drop)."""
        known = {f.name for f in fields(cls)} - {"model", "hf_config", "torch_dtype"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; allowed options: {sorted(known)}")
        return cls(model, **options)

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise ValueError(f"model={self.model!r} is not a directory holding config.json and weights")
        path = os.path.join(self.model, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model={self.model!r} has no config.json")
        with open(path) as f:
            self.hf_config = json.load(f)
        self._check_choices()
        self._check_ranges()
        if not self.device:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if not self.attn_backend:
            self.attn_backend = "sdpa" if self.device == "cpu" else "flash" if _has_flash_attn() else "triton"
        if self.dtype == "auto":
            name = self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "bfloat16"
            self.torch_dtype = DTYPES.get(name, torch.bfloat16) if self.device == "cuda" else torch.float32
        else:
            self.torch_dtype = DTYPES[self.dtype]
        self.max_model_len = min(self.max_model_len, self.hf_config.get("max_position_embeddings", self.max_model_len))
        self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.kvcache_block_size)

    def _check_choices(self):
        choices = {"attn_backend": ("", *BACKENDS), "device": ("", "cuda", "cpu"),
                   "dtype": ("auto", *DTYPES), "load_format": ("safetensors", "dummy"),
                   "preemption_mode": ("recompute", "swap")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")

    def _check_ranges(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        bs = self.kvcache_block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size={bs} must be a power of two")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.preemption_mode == "swap" and not self.swap_space > 0:
            raise ValueError(f"swap_space={self.swap_space} must be > 0 GiB with preemption_mode='swap'")
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(f"num_kvcache_blocks={self.num_kvcache_blocks} must be >= 1 (or -1: automatic)")

    def _check_tensor_parallel(self):
        """Every rank needs a GPU of its own and an equal share of the heads and of the MLP."""
        tp, cfg = self.tensor_parallel_size, self.hf_config
        if self.device == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} but only {torch.cuda.device_count()} GPU(s) are visible")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={heads}")
        if kv_heads % tp and tp % kv_heads:  # fewer KV heads than ranks: each is replicated on tp // kv_heads ranks
            raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads={kv_heads} or be a "
                             "multiple of it")
        if cfg["intermediate_size"] % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size={cfg['intermediate_size']}")


def _has_flash_attn() -> bool:
    import importlib.util
    return importlib.util.find_spec("flash_attn") is not None
