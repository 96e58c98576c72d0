"""Throughput benchmark: `python bench.py --attn-backend flash triton sdpa [--table] [--model DIR]`.

By default it reproduces nano-vllm's published workload exactly: random.seed(0); 256 sequences of
randint(100, 1024) random token ids in [0, 10000]; max_tokens=randint(100, 1024); temperature 0.6;
ignore_eos; max_model_len 4096; one warm-up generate; throughput = sum(max_tokens) / wall time.
Without --model it runs an architecture of benchmarks/archs.json (--arch: Qwen3-0.6B, Qwen3-8B,
Qwen3-32B, SmolLM2-135M) with random weights; `--tp 2` splits it over 2 GPUs. Each row also gives
the seconds that building the engine took (`LLM(...)`: weights, memory profile, CUDA graphs).
`--table` runs the batch x length grid (output length = input length) and reports decode tokens/s.
`--kv-cache-dtype auto fp8` runs each backend with each KV cache dtype, in one run (a row each).
`--workload shared-prefix` (16 system prompts of 1,024 tokens, 16 requests each with 32 tokens of
their own) and `--workload n8` (32 prompts of 2,000 tokens, n=8 samples each): 256 sequences of 256
output tokens, run with cascade attention on and off (`--cascade`, a row each;
attention/cascade.py).
`--repeat 3` runs every configuration three times, in turn, and prints the medians: runs whose steps
wait on the host (cascade on, at batch 256) vary from one process to the next.
"""
import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from random import randint, seed

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.metrics import engine_counts

ARCHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks", "archs.json")


def archs() -> dict:
    """The benchmarks' architectures: name -> that model's config.json (benchmarks/archs.json)."""
    with open(ARCHS) as f:
        return json.load(f)


def arch_path(name: str) -> str:
    """A directory holding only the config.json of architecture `name`, for random weights
    (load_format="dummy"); written once under the system's temporary directory."""
    configs = archs()
    if name not in configs:
        raise ValueError(f"arch {name!r} is not in benchmarks/archs.json: use one of "
                         f"{', '.join(configs)}")
    path = os.path.join(tempfile.gettempdir(), "nanovllm-archs", name)
    config, file = json.dumps(configs[name], indent=2) + "\n", os.path.join(path, "config.json")
    if not os.path.isfile(file) or open(file).read() != config:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path, delete=False) as f:
            f.write(config)
        os.replace(f.name, file)  # whole or absent for another process reading it
    return path


def make_llm(args, backend: str, kv_cache_dtype: str = "auto", **options) -> LLM:
    weights = dict(load_format="dummy", skip_tokenizer_init=True) if args.model is None else {}
    return LLM(args.model or arch_path(args.arch), attn_backend=backend,
               enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp,
               kv_cache_dtype=kv_cache_dtype, **weights, **options)


def nano_vllm_requests(num_seqs: int = 256, max_input_len: int = 1024,
                       max_output_len: int = 1024) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py workload, step for step: 256 random prompts and their sampling
    parameters (fewer and shorter with the arguments, for a laptop)."""
    seed(0)
    low_in, low_out = min(100, max_input_len), min(100, max_output_len)  # under 100: a laptop's run
    prompts = [[randint(0, 10000) for _ in range(randint(low_in, max_input_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=randint(low_out, max_output_len)) for _ in range(num_seqs)]
    return prompts, params


def nano_vllm_workload(llm: LLM, args) -> tuple[int, float]:
    """nano-vllm's benchmark: one warm-up generate, then the workload; returns (output tokens,
    seconds)."""
    prompts, params = nano_vllm_requests(args.num_seqs, args.max_input_len, args.max_output_len)
    llm.generate([[1, 2, 3]], SamplingParams(), use_tqdm=False)  # warm-up
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return sum(p.max_tokens for p in params), time.perf_counter() - start


def sharing_requests(workload: str, seed_value: int = 0, max_tokens: int = 256):
    """The prompts and parameters of a workload whose sequences share KV blocks: 256 sequences of
    max_tokens output tokens (temperature 0.6, ignore_eos)."""
    seed(seed_value)
    tokens = lambda n: [randint(0, 10000) for _ in range(n)]  # noqa: E731
    if workload == "shared-prefix":  # request j of system prompt i at j * 16 + i: arrivals mix
        systems = [tokens(1024) for _ in range(16)]
        prompts = [systems[i] + tokens(32) for _ in range(16) for i in range(16)]
        return prompts, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    return [tokens(2000) for _ in range(32)], SamplingParams(temperature=0.6, ignore_eos=True,
                                                             max_tokens=max_tokens, n=8)


def sharing_workload(llm: LLM, workload: str) -> tuple[int, float]:
    """A warm-up on other prompts of the same shape (a few tokens: it captures the graphs the
    workload replays), then the workload; returns (output tokens, seconds)."""
    llm.generate(*sharing_requests(workload, seed_value=1, max_tokens=4), use_tqdm=False)
    prompts, params = sharing_requests(workload)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(c.token_ids) for o in outputs for c in o.outputs), time.perf_counter() - start


def decode_throughput(llm: LLM, batch: int, length: int) -> float:
    """Decode tokens/s of `batch` random prompts of `length` tokens, generating `length` tokens
    each: tokens generated after every request has its first one, over the time they took."""
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=length,
                            output_kind="final")
    for _ in range(batch):
        llm.add_request([randint(0, 10000) for _ in range(length)], params)
    counts = engine_counts(llm)  # the engine's token counts (log_stats=True)
    base = counts.num_generation_tokens
    while counts.num_generation_tokens - base < batch:  # prefill (every request's first token)
        llm.step()
    start, first = time.perf_counter(), counts.num_generation_tokens
    while not llm.is_finished():
        llm.step()
    return (counts.num_generation_tokens - first) / (time.perf_counter() - start)


def print_kv_cache(llm, name: str):
    """The KV cache's size in tokens (a function, for the same reason as print_graphs)."""
    kv = llm.model_runner.kv_cache
    print(f"{name}: a KV cache of {kv.shape[2] * kv.shape[3]:,} tokens", file=sys.stderr,
          flush=True)


def print_graphs(llm, backend: str):
    """What the CUDA graphs cost (a function: no reference to them may outlive the engine, as
    they hold views of its KV cache)."""
    graphs = getattr(llm.model_runner, "graphs", None)
    if hasattr(graphs, "capture_seconds"):
        print(f"{backend}: {len(graphs.graphs)} CUDA graphs captured in "
              f"{graphs.capture_seconds:.1f} s, {graphs.capture_bytes / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)


def print_cascade(llm, name: str):
    """How many steps read shared prefixes once (attention/cascade.py)."""
    cascade = getattr(llm.model_runner.backend, "cascade", None)
    if cascade is not None:
        print(f"{name}: cascade attention in {cascade.num_steps} steps, {len(cascade.twins)} "
              f"graph twins captured in {cascade.capture_seconds:.1f} s", file=sys.stderr,
              flush=True)


def release(llm):
    llm.shutdown()  # stops tensor-parallel workers too, freeing their GPUs
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def timed_build(args, backend: str, kv_cache_dtype: str, **options) -> tuple[LLM, float]:
    """make_llm, and the seconds it took."""
    start = time.perf_counter()
    llm = make_llm(args, backend, kv_cache_dtype, **options)
    return llm, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attn-backend", nargs="+", default=None,
                        choices=["flash", "triton", "sdpa"],
                        help="default: flash and triton on a GPU (flash if installed), sdpa on "
                             "a CPU")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face model dir (default: random weights of --arch)")
    parser.add_argument("--arch", default="Qwen3-0.6B", choices=list(archs()),
                        help="the random-weight architecture, from benchmarks/archs.json")
    parser.add_argument("--table", action="store_true",
                        help="batch x length decode grid instead of the default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--num-seqs", type=int, default=256, help="nano-vllm's workload: sequences")
    parser.add_argument("--max-input-len", type=int, default=1024,
                        help="prompts of randint(100, this) tokens")
    parser.add_argument("--max-output-len", type=int, default=1024,
                        help="outputs of randint(100, this)")
    parser.add_argument("--workload", default="nano-vllm",
                        choices=["nano-vllm", "shared-prefix", "n8"],
                        help="shared-prefix, n8: sequences that share KV blocks (see above)")
    parser.add_argument("--cascade", nargs="+", choices=["on", "off"], default=None,
                        help="cascade attention (triton); default: on and off for shared-prefix "
                             "and n8")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8"],
                        help="KV cache dtypes, each with every backend (fp8: triton, sdpa)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every configuration this many times, in turn (a fresh engine "
                             "each): host-bound runs vary from one process to the next; medians "
                             "at the end")
    args = parser.parse_args()
    if args.attn_backend is None:
        flash = importlib.util.find_spec("flash_attn") is not None
        on_gpu = (["flash"] if flash else []) + ["triton"]
        args.attn_backend = on_gpu if torch.cuda.is_available() else ["sdpa"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    model = args.model or f"{args.arch} (random weights)"
    workload = {"nano-vllm": "nano-vllm's workload", "shared-prefix": "16 system prompts of 1,024 "
                "tokens x 16 requests (+32 tokens each), 256 output tokens each",
                "n8": "32 prompts of 2,000 tokens, n=8 samples of 256 tokens each"}[args.workload]
    # the table's header first, then each row as its run ends (kept if a time limit cuts the runs);
    # what each engine reports while it runs goes to stderr
    print(f"{model}, {device}, tensor_parallel_size={args.tp}"
          + ("" if args.table else f", {workload}"))
    if args.table:
        print("decode tokens/s, batch b, prompt length L = output length L; build s: seconds for "
              "LLM(...)\n")
        columns = [f"b{b} L{n}" for n in args.lengths for b in args.batches] + ["build s"]
    else:
        print("build s: seconds for LLM(...)\n")
        columns = ["output tokens", "seconds", "tokens/s", "build s"]
    print("| backend | " + " | ".join(columns) + " |\n" + "|---" * (len(columns) + 1) + "|",
          flush=True)
    rates = {}
    cascades = args.cascade or (["on"] if args.workload == "nano-vllm" else ["on", "off"])
    runs = [(backend, kv_dtype, cascade) for _ in range(args.repeat)
            for backend in args.attn_backend for kv_dtype in args.kv_cache_dtype
            for cascade in cascades]
    for backend, kv_dtype, cascade in runs:
        name = backend if kv_dtype == "auto" else f"{backend} {kv_dtype}"
        if backend == "triton" and args.cascade or len(cascades) > 1:
            name += f", cascade {cascade}"
        if not args.table:
            llm, build = timed_build(args, backend, kv_dtype, max_model_len=4096,
                                     disable_cascade_attn=cascade == "off")
            print_kv_cache(llm, name)
            print_graphs(llm, name)
            if args.workload == "nano-vllm":
                tokens, seconds = nano_vllm_workload(llm, args)
            else:
                tokens, seconds = sharing_workload(llm, args.workload)
            print_cascade(llm, name)
            row = (f"| {name} | {tokens} | {seconds:.2f} | {tokens / seconds:,.0f} | "
                   f"{build:.1f} |")
            rates.setdefault(name, []).append(tokens / seconds)
        else:
            grid = dict(max_model_len=2 * max(args.lengths), max_num_seqs=max(args.batches),
                        log_stats=True)
            llm, build = timed_build(args, backend, kv_dtype, **grid)
            cells = []
            for length in args.lengths:
                for batch in args.batches:
                    try:
                        cells.append(f"{decode_throughput(llm, batch, length):,.0f}")
                    except torch.OutOfMemoryError:
                        cells.append("OOM")
                        release(llm)
                        llm = make_llm(args, backend, kv_dtype, **grid)
                    # kept if a time limit cuts the grid
                    print(f"{name} b{batch} L{length}: {cells[-1]}", file=sys.stderr, flush=True)
            row = f"| {name} | " + " | ".join(cells) + f" | {build:.1f} |"
        release(llm)
        print(row, flush=True)
    if args.repeat > 1 and rates:  # (--table prints each grid instead)
        print(f"\nmedian of {args.repeat} runs, tokens/s: " + ", ".join(
            f"{name} {statistics.median(r):,.0f} ({min(r):,.0f}-{max(r):,.0f})"
            for name, r in rates.items()))


if __name__ == "__main__":
    main()
