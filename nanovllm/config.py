"""Engine options, validated once: the `Config` every part of the engine reads."""
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import torch

from nanovllm.attention import BACKENDS
from nanovllm.models import model_class
from nanovllm.utils.checks import at_least, check_fields, rule

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "max_position_embeddings")


@dataclass(slots=True)
class Config:
    """Every engine option (LLM(model, **options)), checked when it is built."""
    model: str
    max_num_batched_tokens: int = at_least(1, default=16384)  # new tokens per step
    # sequences per step (at most a CUDA grid's second axis: one program row per sequence)
    max_num_seqs: int = rule(512, lambda v: 1 <= v <= 65535, "an integer in [1, 65535]")
    # prompt + generated tokens (clipped to the model's)
    max_model_len: int = at_least(1, default=4096)
    gpu_memory_utilization: float = rule(0.9, lambda v: 0 < v <= 1, "a number in (0, 1]")
    kvcache_block_size: int = rule(256, lambda v: v >= 1 and not v & (v - 1),
                                   "a power of two (an int)")
    # -1: from free GPU memory, or 1 GiB on CPU
    num_kvcache_blocks: int = rule(-1, lambda v: v >= 1 or v == -1, "an integer >= 1 (or -1: auto)")
    enforce_eager: bool = False          # no CUDA graphs
    async_scheduling: bool | None = None  # run ahead of the GPU (worker/run_ahead.py); None: CUDA
    # with async_scheduling: steps launched ahead of the one the engine reads
    run_ahead_steps: int = rule(2, lambda v: 1 <= v <= 8, "an integer in [1, 8]")
    steps_ahead: int = 0  # filled in: run_ahead_steps with async_scheduling, else 0
    attn_backend: Literal[("", *BACKENDS)] = ""  # "": triton on CUDA (the fastest), sdpa on CPU
    device: Literal["", "cuda", "cpu"] = ""  # "": cuda when present, else cpu
    dtype: Literal[("auto", *DTYPES)] = "auto"  # "auto": the checkpoint's on CUDA, float32 on CPU
    load_format: Literal["safetensors", "dummy"] = "safetensors"  # "dummy": random weights
    enable_prefix_caching: bool = True
    prefill_first: bool = False          # True: steps that prefill run no decodes (vLLM v0's order)
    preemption_mode: Literal["recompute", "swap"] = "recompute"  # "swap": blocks go to a CPU pool
    # GiB of CPU memory for swapped-out blocks
    swap_space: float = rule(4.0, lambda v: v > 0, "a number > 0 (GiB)")
    kv_reservation: Literal[None, "oracle", "pow2", "max"] = None  # Orca's reservations, not paging
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # "fp8": e4m3 (attention/fp8.py)
    disable_cascade_attn: bool = False   # True: shared prefixes read per row (attention/cascade.py)
    skip_tokenizer_init: bool = False
    log_stats: bool = False              # request timings, token counts (engine/metrics.py)
    tokenizer: str = ""                  # "": the model directory's; else a directory holding one
    seed: int = 0
    tensor_parallel_size: int = at_least(1, default=1)
    hf_config: dict | None = None        # filled in: the model's config.json
    torch_dtype: torch.dtype | None = None  # filled in from dtype

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        """Build a Config, naming any option that does not exist (a TypeError, not a silent
        drop)."""
        known = {f.name for f in fields(cls)} - {"model", "hf_config", "torch_dtype", "steps_ahead"}
        if unknown := sorted(set(options) - known):
            raise TypeError(f"unknown option(s) {unknown}; allowed options: {sorted(known)}")
        return cls(model, **options)

    def __post_init__(self):
        check_fields(self)
        self.hf_config = read_model_config(self.model)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.async_scheduling is None:  # on CPU a step is done when it returns: nothing to gain
            self.async_scheduling = self.device == "cuda"
        self.steps_ahead = self.run_ahead_steps if self.async_scheduling else 0
        if not self.attn_backend:
            self.attn_backend = "sdpa" if self.device == "cpu" else "triton"
        checkpoint = self.hf_config.get("torch_dtype") or self.hf_config.get("dtype")
        auto = torch.float32 if self.device == "cpu" else DTYPES.get(checkpoint, torch.bfloat16)
        self.torch_dtype = auto if self.dtype == "auto" else DTYPES[self.dtype]
        self.max_model_len = min(self.max_model_len, self.hf_config["max_position_embeddings"])
        self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.kvcache_block_size)
        if self.tensor_parallel_size > 1 or "WORLD_SIZE" in os.environ:  # or torchrun's ranks
            from nanovllm.worker.distributed import check_tensor_parallel
            check_tensor_parallel(self)


def read_model_config(model: str) -> dict:
    """The model directory's config.json, with the keys the engine reads filled in where
    optional."""
    path = Path(model, "config.json")
    if not path.is_file():
        raise ValueError(f"model={model!r} is not a directory holding config.json and weights")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    model_class(cfg)  # a ValueError naming the supported architectures
    if missing := [key for key in REQUIRED_KEYS if not isinstance(cfg.get(key), int)]:
        raise ValueError(f"{path} lacks {missing} (integers every model config has)")
    cfg["num_key_value_heads"] = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.setdefault("rms_norm_eps", 1e-6)
    return cfg
