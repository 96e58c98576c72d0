"""Tensor parallelism checked on random Qwen3 weights: greedy tokens, and with --torchrun speed.

    python benchmarks/tp_check.py                 # on 2 GPUs: NCCL, float32, sdpa attention
    python benchmarks/tp_check.py --tiny          # a tiny model on CPU (gloo), as a smoke test
    python benchmarks/tp_check.py --dtype bfloat16 --attn-backend flash  # CUDA graphs with NCCL
    python benchmarks/tp_check.py --torchrun      # on 2 GPUs: local workers vs two torchrun hosts
    python benchmarks/tp_check.py --torchrun --tiny  # the same on CPU (gloo)

By default it compares tensor_parallel_size=N with one rank. The weights are drawn once, saved as
safetensors and loaded by both runs, so the two engines hold the same model (load_format="dummy"
would draw each rank's shard on its own). float32 by default: random bf16 weights give nearly flat
logits, where a different summation order flips greedy picks, so in bf16 expect most tokens, not
all, to agree. float32 needs a backend that takes it (sdpa; flash-attn does not).

--torchrun compares two launches of one tensor_parallel_size=2 engine, in the engine's own dtype
and backend (bf16, triton and CUDA graphs on GPUs): `LLM(model, tensor_parallel_size=2)` started
plainly (rank 1 a worker process it starts), then the same script under two torchrun processes,
`torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`, two
"hosts" of one rank each on this machine (c10d's rendezvous numbers them). Each host's cuda:0 (its
cuda:LOCAL_RANK) is its own GPU: CUDA_VISIBLE_DEVICES lists it first, then the other host's, so that
NCCL links the two GPUs as it links two local ranks (with only its own GPU visible, a rank cannot
reach the other GPU's memory and NCCL goes through host memory, as it would between hosts).
Both launches draw the same random weights (load_format="dummy": each rank draws its shard from
the seed, so rank r's shard is the same in both) and run the same greedy prompts with the same
number of KV blocks, so they run the same steps: the tokens must be equal, and the speeds close.
It prints each launch's output tokens/s (the median of --repeat runs), their ratio, and whether
every token agrees.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # after PYTHONPATH
from bench import arch_path, archs  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.core.sequence import num_blocks_for  # noqa: E402

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
TINY = dict(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            tie_word_embeddings=True)
# (num_prompts, prompt_len, max_tokens) unless given: a token check, a throughput run, a smoke test
WORKLOADS = {"check": (4, 100, 32), "torchrun": (256, 256, 256), "torchrun-tiny": (8, 20, 16)}
SCORED = 16  # prompts whose tokens' log-probabilities are compared too


def save_random_model(path: str, dims: dict, init_std: float, seed: int):
    """Random weights from a fixed seed, written once (skipped when `path` already holds them)."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return
    torch.manual_seed(seed)
    config = Qwen3Config(**dims, initializer_range=init_std, torch_dtype="float32")
    Qwen3ForCausalLM(config).save_pretrained(path)


def run(path: str, prompts: list[list[int]], max_tokens: int, repeat: int = 1,
        **options) -> tuple[list[list[int]], float, list[list[float]]]:
    """Greedy completions, the seconds `generate` took (the median of `repeat` runs), and the
    log-probabilities of the first SCORED prompts' tokens (an untimed run); the engine is shut down
    before returning."""
    with LLM(path, skip_tokenizer_init=True, **options) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        seconds = []
        for _ in range(repeat):
            start = time.perf_counter()
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        scored = llm.generate(prompts[:SCORED], SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0), use_tqdm=False)
        logprobs = [[step[token] for token, step in zip(o["token_ids"], o["logprobs"])]
                    for o in scored]
        return [o["token_ids"] for o in outputs], statistics.median(seconds), logprobs


def first_difference(a: list[int], b: list[int]) -> int | None:
    shorter = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), shorter)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({os.cpu_count()} cores)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The processes that process `pid` started (a torchrun process: its ranks)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:
        return []


def stop(proc: subprocess.Popen):
    """Kill a torchrun process still running, and its ranks first (torchrun starts each with
    setsid: a kill of torchrun alone would leave them behind)."""
    if proc.poll() is None:
        for pid in children(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    proc.wait()


def run_on_two_hosts(argv: list[str], device: str, timeout: float) -> dict:
    """This script with `argv` as two torchrun "hosts" of one rank each; what rank 0 wrote."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    endpoint = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rank0.json")
        procs = []
        try:
            for node in range(2):
                env = {**os.environ, "PYTHONUNBUFFERED": "1",
                       "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
                if device == "cuda":  # its own GPU first (its cuda:0), the other's after it
                    env["CUDA_VISIBLE_DEVICES"] = f"{visible[node]},{visible[1 - node]}"
                else:  # each rank half the cores, as the local workers get
                    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // 2))
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                       "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       endpoint, "--max-restarts", "0", os.path.abspath(__file__), *argv,
                       "--result", result]
                procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
            deadline = time.monotonic() + timeout
            statuses = [proc.wait(max(1.0, deadline - time.monotonic())) for proc in procs]
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the torchrun hosts did not finish within {timeout:.0f} s") from None
        finally:
            for proc in procs:
                stop(proc)
        if statuses != [0, 0] or not os.path.isfile(result):
            raise SystemExit(f"the torchrun hosts exited with status {statuses}; see above")
        with open(result) as f:
            return json.load(f)


def print_token_table(prompts: list[list[int]], expected: list[list[int]], got: list[list[int]]):
    print("| prompt | prompt tokens | generated | equal | first difference at |")
    print("| --- | --- | --- | --- | --- |")
    for i, (a, b) in enumerate(zip(expected, got)):
        diff = first_difference(a, b)
        equal, where = ("yes", "") if diff is None else ("no", diff)
        print(f"| {i} | {len(prompts[i])} | {len(a)} | {equal} | {where} |")


def agreement(expected: list[list[int]], got: list[list[int]]) -> tuple[int, int, int]:
    """Tokens that agree, tokens in all, sequences equal in full."""
    same = sum(x == y for a, b in zip(expected, got) for x, y in zip(a, b))
    return same, sum(len(a) for a in expected), sum(a == b for a, b in zip(expected, got))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="/tmp/nanovllm-tp-check",
                   help="where the random weights are saved")
    p.add_argument("--tp", type=int, default=2, help="tensor_parallel_size to compare with 1")
    p.add_argument("--torchrun", action="store_true",
                   help="tensor_parallel_size=2 started plainly vs as two torchrun hosts")
    p.add_argument("--arch", default="Qwen3-0.6B", choices=list(archs()),
                   help="with --torchrun: the random-weight architecture (benchmarks/archs.json)")
    p.add_argument("--dtype", default=None,
                   help="default: float32, or with --torchrun the engine's (bf16 on GPUs)")
    p.add_argument("--attn-backend", default=None,
                   help="default: sdpa (takes float32), or with --torchrun the engine's")
    p.add_argument("--num-prompts", type=int, default=None, help=f"default: {WORKLOADS}")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt i has prompt_len + 7 * (i % 32) tokens")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None,
                   help="timed runs of the prompts per engine, the median reported (default: 1, "
                        "3 with --torchrun)")
    p.add_argument("--timeout", type=float, default=600, help="seconds the torchrun hosts get")
    p.add_argument("--init-std", type=float, default=0.02,
                   help="initializer_range of the saved random weights")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model on CPU instead of Qwen3 shapes on GPUs")
    p.add_argument("--result", default="", help=argparse.SUPPRESS)  # a torchrun host's: rank 0's
    return p


def main():
    args = parser().parse_args()
    workload = "check" if not args.torchrun else "torchrun-tiny" if args.tiny else "torchrun"
    for name, default in zip(("num_prompts", "prompt_len", "max_tokens"), WORKLOADS[workload]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    dims = TINY if args.tiny else QWEN3_0_6B if not args.torchrun else archs()[args.arch]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, dims["vocab_size"], (args.prompt_len + 7 * (i % 32),),
                             generator=gen).tolist() for i in range(args.num_prompts)]
    device = "cpu" if args.tiny else "cuda"
    if args.torchrun:
        compare_launches(args, prompts, device)
    else:
        compare_with_one_rank(args, prompts, dims, device)


def compare_with_one_rank(args, prompts: list[list[int]], dims: dict, device: str):
    """Greedy tokens of tensor_parallel_size=N against those of one rank, saved weights."""
    path = args.model_dir + ("-tiny" if args.tiny else "")
    save_random_model(path, dims, args.init_std, seed=0)
    options = dict(device=device, dtype=args.dtype or "float32",
                   attn_backend="sdpa" if args.attn_backend is None else args.attn_backend,
                   num_kvcache_blocks=64, max_model_len=1024)
    if args.tiny:
        options.update(kvcache_block_size=16)
    repeat = args.repeat or 1
    expected, t1, _ = run(path, prompts, args.max_tokens, repeat, tensor_parallel_size=1,
                          **options)
    got, tn, _ = run(path, prompts, args.max_tokens, repeat, tensor_parallel_size=args.tp,
                     **options)

    print(f"\nGreedy tokens, tensor_parallel_size={args.tp} vs 1, random Qwen3 weights "
          f"({'tiny' if args.tiny else 'Qwen3-0.6B shapes'}), {options['dtype']}, "
          f"{device_name(device)}\n")
    print_token_table(prompts, expected, got)
    same, total, _ = agreement(expected, got)
    print(f"\n{same}/{total} tokens agree; generate took {t1:.2f} s with 1 rank, {tn:.2f} s with "
          f"{args.tp}")


def compare_launches(args, prompts: list[list[int]], device: str):
    """tensor_parallel_size=2 with local workers, then the same engine as two torchrun hosts: the
    tokens/s of each, their ratio and whether the tokens agree. Under torchrun (--result) it is
    one host: its rank 0 runs the prompts and writes what it got to --result."""
    if args.tiny:  # a config.json of tiny dimensions, for random weights as on GPUs
        path = args.model_dir + "-tiny-dummy"
        if not os.path.isfile(os.path.join(path, "config.json")):
            Qwen3Config(**TINY).save_pretrained(path)
    else:
        path = arch_path(args.arch)
    block_size = 16 if args.tiny else 256
    blocks = sum(num_blocks_for(len(p) + args.max_tokens, block_size) for p in prompts)
    options = dict(device=device, tensor_parallel_size=2, load_format="dummy",
                   num_kvcache_blocks=blocks + 8, kvcache_block_size=block_size,
                   max_model_len=max(map(len, prompts)) + args.max_tokens)
    if args.dtype:
        options["dtype"] = args.dtype
    if args.attn_backend:
        options["attn_backend"] = args.attn_backend
    repeat = args.repeat or 3
    if args.result:  # a torchrun host: ranks > 0 leave in LLM(...); rank 0 reports
        tokens, seconds, logprobs = run(path, prompts, args.max_tokens, repeat, **options)
        with open(args.result, "w") as f:
            json.dump({"token_ids": tokens, "seconds": seconds, "logprobs": logprobs}, f)
        return
    # a SIGTERM (`timeout`) still runs the cleanup that stops the torchrun hosts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    local, local_s, local_logprobs = run(path, prompts, args.max_tokens, repeat, **options)
    if device == "cuda":
        torch.cuda.empty_cache()  # the GPUs to the torchrun hosts
    hosts = run_on_two_hosts(sys.argv[1:], device, args.timeout)

    total = sum(map(len, local))
    name = "tiny" if args.tiny else args.arch
    print(f"\ntensor_parallel_size=2: local workers vs two torchrun hosts (one rank each), random "
          f"{name} weights, {args.num_prompts} greedy prompts of {len(prompts[0])}-"
          f"{max(map(len, prompts))} tokens, {args.max_tokens} output tokens each, median of "
          f"{repeat}, {device_name(device)}\n")
    print("| launch | output tokens | seconds | tokens/s |")
    print("| --- | --- | --- | --- |")
    print(f"| local workers | {total} | {local_s:.2f} | {total / local_s:,.0f} |")
    print(f"| torchrun, 2 hosts | {total} | {hosts['seconds']:.2f} | "
          f"{total / hosts['seconds']:,.0f} |")
    same, _, equal = agreement(local, hosts["token_ids"])
    verdict = "yes" if same == total and equal == len(local) else "NO"
    print(f"\ntokens/s ratio (torchrun / local): {local_s / hosts['seconds']:.3f}")
    print(f"tokens equal: {verdict} ({same}/{total} tokens, {equal}/{len(local)} sequences, "
          f"{len({t for seq in local for t in seq})} distinct token ids)")
    pairs = [(a, b) for x, y in zip(local_logprobs, hosts["logprobs"]) for a, b in zip(x, y)]
    worst = max(abs(a - b) for a, b in pairs)
    print(f"log-probabilities of the first {len(local_logprobs)} prompts' tokens equal: "
          f"{'yes' if worst == 0 else 'NO'} (largest difference {worst:.3g})")


if __name__ == "__main__":
    main()
