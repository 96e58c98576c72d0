"""What the FP8 KV cache costs in accuracy, on a GPU: `python benchmarks/fp8_accuracy.py`.

Teacher-forced logits (tests/teacher_forcing.py: the real engine path, sampling replaced by the next
token of fixed sequences) of random Qwen3-0.6B (one set of normal(0, 0.02) weights, copied into
every engine) on random token sequences. The reference is a float32 model with a float32 cache
through the sdpa backend (float32 arithmetic throughout; Triton's dots on float32 take tf32); each
other configuration runs the triton backend, and its logits are compared with the reference's:
relative error ||logits - ref|| / ||ref|| and top-1 agreement. A bfloat16 model with a bfloat16
cache is the default deployment; with an FP8 cache, the error that adds; a float32 model with an
FP8 cache isolates the cache's own error. (On a CPU, in Triton's interpreter, bfloat16 is not
emulated faithfully: run it on a GPU.)
"""
import argparse
import gc
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import arch_path  # noqa: E402
from nanovllm import LLM  # noqa: E402
from tests.teacher_forcing import engine_logits, rel_error  # noqa: E402

CONFIGS = [  # (model dtype, kv_cache_dtype, attn_backend)
    ("float32", "auto", "sdpa"), ("float32", "auto", "triton"), ("bfloat16", "auto", "triton"),
    ("bfloat16", "fp8", "triton"), ("float32", "fp8", "triton")]


def build(dtype: str, kv_cache_dtype: str, backend: str, weights: dict | None, args) -> LLM:
    """An engine over random Qwen3-0.6B; `weights` (a CPU state dict) replaces its own if given."""
    llm = LLM(arch_path(args.arch), load_format="dummy",
              skip_tokenizer_init=True, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
              attn_backend=backend, enforce_eager=True, gpu_memory_utilization=0.5,
              max_model_len=args.prompt_len + args.forced_len)
    if weights is not None:
        with torch.no_grad():
            for name, p in llm.model_runner.model.state_dict().items():
                p.copy_(weights[name])
    return llm


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="Qwen3-0.6B", help="one of benchmarks/archs.json")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--forced-len", type=int, default=64, help="teacher-forced tokens each")
    args = parser.parse_args()
    rng = random.Random(0)
    seqs = [[rng.randrange(10000) for _ in range(args.prompt_len + args.forced_len)]
            for _ in range(args.num_seqs)]
    lens = [args.prompt_len] * args.num_seqs
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    rows, ref, weights = [], None, None
    for dtype, kv, backend in CONFIGS:
        start = time.perf_counter()
        llm = build(dtype, kv, backend, weights, args)
        if weights is None:
            weights = {k: v.float().cpu() for k, v in llm.model_runner.model.state_dict().items()}
        logits = engine_logits(llm, seqs, lens)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        if ref is None:
            ref = logits
        agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(logits, ref))
        total = sum(len(r) for r in ref)
        error = rel_error(logits, ref)
        rows.append(f"| {dtype} | {kv} | {backend} | {error:.2e} | {agree / total:.1%} |")
        print(rows[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\nrandom {args.arch}, {device}; {args.num_seqs} sequences of {args.prompt_len} prompt "
          f"+ {args.forced_len} teacher-forced tokens; reference: the first row\n")
    print("| model dtype | kv_cache_dtype | backend | logits rel error | top-1 agreement |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
