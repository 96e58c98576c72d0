"""Greedy tokens with tensor_parallel_size=N against one rank, on random Qwen3-0.6B-shaped weights.

    python benchmarks/tp_check.py                 # on 2 GPUs: NCCL, float32, sdpa attention
    python benchmarks/tp_check.py --tiny          # a tiny model on CPU (gloo), as a smoke test
    python benchmarks/tp_check.py --dtype bfloat16 --attn-backend flash  # CUDA graphs with NCCL

The weights are drawn once, saved as safetensors and loaded by both runs, so the two engines hold
the same model (load_format="dummy" would draw each rank's shard on its own). float32 by default:
random bf16 weights give nearly flat logits, where a different summation order flips greedy picks,
so in bf16 expect most tokens, not all, to agree. float32 needs a backend that takes it (sdpa;
flash-attn does not).
"""
import argparse
import os
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from nanovllm import LLM, SamplingParams

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
TINY = dict(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            tie_word_embeddings=True)


def save_random_model(path: str, dims: dict, init_std: float, seed: int):
    """Random weights from a fixed seed, written once (skipped when `path` already holds them)."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return
    torch.manual_seed(seed)
    config = Qwen3Config(**dims, initializer_range=init_std, torch_dtype="float32")
    Qwen3ForCausalLM(config).save_pretrained(path)


def run(path: str, prompts: list[list[int]], max_tokens: int,
        **options) -> tuple[list[list[int]], float]:
    """Greedy completions and the seconds `generate` took; the engine is shut down before
    returning."""
    with LLM(path, skip_tokenizer_init=True, **options) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        start = time.perf_counter()
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return [o["token_ids"] for o in outputs], time.perf_counter() - start


def first_difference(a: list[int], b: list[int]) -> int | None:
    shorter = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), shorter)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="/tmp/nanovllm-tp-check",
                        help="where the random weights are saved")
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size to compare with 1")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attn-backend", default="sdpa",
                        help="sdpa takes float32; '' lets the engine pick")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--init-std", type=float, default=0.02,
                        help="initializer_range of the random weights")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model on CPU instead of Qwen3-0.6B on GPUs")
    args = parser.parse_args()

    dims = TINY if args.tiny else QWEN3_0_6B
    path = args.model_dir + ("-tiny" if args.tiny else "")
    save_random_model(path, dims, args.init_std, seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, dims["vocab_size"], (args.prompt_len + 7 * i,),
                             generator=gen).tolist() for i in range(args.num_prompts)]
    device = "cpu" if args.tiny else "cuda"
    options = dict(device=device, dtype=args.dtype, attn_backend=args.attn_backend,
                   num_kvcache_blocks=64, max_model_len=1024)
    if args.tiny:
        options.update(kvcache_block_size=16)
    expected, t1 = run(path, prompts, args.max_tokens, tensor_parallel_size=1, **options)
    got, tn = run(path, prompts, args.max_tokens, tensor_parallel_size=args.tp, **options)

    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    print(f"\nGreedy tokens, tensor_parallel_size={args.tp} vs 1, random Qwen3 weights "
          f"({'tiny' if args.tiny else 'Qwen3-0.6B shapes'}), {args.dtype}, {name}\n")
    print("| prompt | prompt tokens | generated | equal | first difference at |")
    print("| --- | --- | --- | --- | --- |")
    for i, (a, b) in enumerate(zip(expected, got)):
        diff = first_difference(a, b)
        equal, where = ("yes", "") if diff is None else ("no", diff)
        print(f"| {i} | {len(prompts[i])} | {len(a)} | {equal} | {where} |")
    same = sum(x == y for a, b in zip(expected, got) for x, y in zip(a, b))
    total = sum(len(a) for a in expected)
    print(f"\n{same}/{total} tokens agree; generate took {t1:.2f} s with 1 rank, {tn:.2f} s with "
          f"{args.tp}")


if __name__ == "__main__":
    main()
