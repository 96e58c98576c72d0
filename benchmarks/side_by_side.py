"""nano-vllm and nanovllm side by side: `python benchmarks/side_by_side.py --model DIR [--nano-vllm
ROOT]`.

Each engine runs in a process of its own, through the API both share (`LLM(path)`, `generate`
with token ids and `SamplingParams(temperature, max_tokens, ignore_eos)`), on the same checkpoint
(a Hugging Face Qwen3 directory with a tokenizer; random weights serve, `--save-random DIR` writes
a Qwen3-0.6B one). `--engine NAME=ROOT[@BACKEND]` adds a tree (another commit of nanovllm, say)
and the attention backend it builds. Per engine and run (`--runs`), a row of:

- ready: seconds to import the package and to build `LLM(path)`; with `--cold`, each engine's
  first run starts from empty Triton and Inductor caches (directories of its own), the next ones
  find them warm; with `--serve`, for nanovllm trees, seconds from starting `python -m
  nanovllm.serve DIR` to its /health answering 200 (a cold run's server from empty caches of
  its own, a warm run's from the engine's); `--serve-only` times the server alone, the row's
  only column (a cold run's from the empty caches that the warm runs then find filled);
- first use: the first request of 8 tokens, the first batch of 64 requests sharing a 1,024-token
  prefix, a batch of the same shape with a prefix never seen, and that batch again (what the
  first use of a feature builds while serving shows here);
- throughput: nano-vllm's bench.py workload (256 sequences of 100-1,024 random prompt and output
  tokens, temperature 0.6), and batch 1 (a 512-token prompt, 512 output tokens), output tokens/s.

nano-vllm needs flash-attn; ROOT is a checkout of it (the directory holding its `nanovllm`).
"""
import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(root: str, model: str, backend: str):
    """Measure one engine (the package under `root`) and print its row as JSON."""
    from random import Random, randint, seed
    start = time.perf_counter()
    sys.path.insert(0, root)
    import torch
    from nanovllm import LLM, SamplingParams
    row = {"import_s": time.perf_counter() - start}
    start = time.perf_counter()
    llm = LLM(model, max_model_len=4096, **({"attn_backend": backend} if backend else {}))
    row["build_s"] = time.perf_counter() - start

    def timed(prompts, params) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def shared_batch(seed: int) -> list[list[int]]:
        rng = Random(seed)
        prefix = [rng.randrange(10000) for _ in range(1024)]
        return [prefix + [rng.randrange(10000) for _ in range(32)] for _ in range(64)]
    short = SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True)
    row["first_request_s"] = timed([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))
    row["first_shared_batch_s"] = timed(shared_batch(1), short)
    row["new_prefix_batch_s"] = timed(shared_batch(2), short)
    row["same_batch_again_s"] = timed(shared_batch(2), short)
    seed(0)  # nano-vllm's bench.py, step for step
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024))
              for _ in range(256)]
    row["bench_tok_s"] = sum(p.max_tokens for p in params) / timed(prompts, params)
    one, p512 = [[randint(0, 10000) for _ in range(512)]], SamplingParams(
        temperature=0.6, ignore_eos=True, max_tokens=512)
    timed(one, p512)  # its graphs and kernels warm
    row["batch1_tok_s"] = 512 / timed(one, p512)
    print(json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)


def save_random_qwen3(path: str, tokenizer: str | None):
    """A Qwen3-0.6B-shaped checkpoint with random bf16 weights, and the tokenizer of the directory
    `tokenizer` (default: the SmolLM2 that example.py fetched; the prompts are token ids, only the
    engines' loading reads it)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.append(ROOT)  # this tree's package, where it is not installed (the GPU hosts)
    from nanovllm.utils.fetch import smollm2_path
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer or smollm2_path(), name), path)


def empty_caches(root: str) -> dict:
    """The environment that points Triton's and Inductor's compile caches into `root`."""
    return {"TRITON_CACHE_DIR": os.path.join(root, "triton"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor")}


def serve_ready(root: str, model: str, backend: str, env: dict) -> float:
    """Seconds from starting `python -m nanovllm.serve` (of the tree `root`) to /health's 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--attn-backend", backend] if backend else []
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", model, "--port", str(port),
                             "--max-model-len", "4096", *flags], cwd=root,
                            env={**env, "PYTHONPATH": os.pathsep.join([root, *path])},
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise SystemExit(f"the server of {root} exited with status {proc.returncode}")
    finally:
        proc.terminate()
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Qwen3 checkpoint directory")
    parser.add_argument("--nano-vllm", help="a nano-vllm checkout (left out: nanovllm alone)")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=ROOT[@BACKEND]",
                        help="one more engine: a tree holding a nanovllm package, and its backend")
    parser.add_argument("--runs", type=int, default=1, help="runs of each engine, one process each")
    parser.add_argument("--cold", action="store_true",
                        help="each engine's first run starts from empty compile caches")
    parser.add_argument("--serve", action="store_true",
                        help="also time nanovllm.serve from start to /health (nanovllm trees)")
    parser.add_argument("--serve-only", action="store_true",
                        help="time nanovllm.serve's start alone, --runs times per tree")
    parser.add_argument("--save-random", action="store_true",
                        help="first write a random Qwen3-0.6B checkpoint into --model")
    parser.add_argument("--tokenizer", help="with --save-random: the directory of the tokenizer")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_only and args.nano_vllm:
        parser.error("--serve-only times nanovllm trees: nano-vllm has no server")
    args.serve |= args.serve_only
    if args.child:
        return child(args.child, args.model, args.backend)
    if args.save_random:
        save_random_qwen3(args.model, args.tokenizer)
    engines = [("nanovllm", ROOT, "")]
    engines += [("nano-vllm", os.path.abspath(args.nano_vllm), "")] if args.nano_vllm else []
    for spec in args.engine:
        name, _, where = spec.partition("=")
        root, _, backend = where.partition("@")
        if not name or not os.path.isdir(os.path.join(root, "nanovllm")):
            parser.error(f"--engine {spec!r}: NAME=ROOT[@BACKEND], ROOT holding a nanovllm package")
        engines.append((name, os.path.abspath(root), backend))
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{device}, {args.model}", flush=True)
    keys = ["run"] if args.serve_only else [
        "run", "import_s", "build_s", "first_request_s", "first_shared_batch_s",
        "new_prefix_batch_s", "same_batch_again_s", "bench_tok_s", "batch1_tok_s"]
    keys += ["serve_ready_s"] if args.serve else []
    print("| engine | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys), flush=True)
    for name, root, backend in engines:
        caches = tempfile.mkdtemp(prefix="side_by_side_")
        cold_env = empty_caches(os.path.join(caches, "engine"))
        for run in range(args.runs):
            env = {**os.environ, **cold_env} if args.cold else os.environ
            cold = args.cold and run == 0
            row = {"run": "cold" if cold else "warm"}
            if not args.serve_only:
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child",
                                      root, "--backend", backend], capture_output=True, text=True,
                                     cwd=root, env=env)
                if out.returncode:
                    sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
                row |= json.loads(out.stdout.strip().splitlines()[-1])
            if args.serve and name != "nano-vllm":
                serve_env = env
                if cold and not args.serve_only:  # the server starts from empty caches of its own
                    serve_env = {**os.environ, **empty_caches(os.path.join(caches, "serve"))}
                row["serve_ready_s"] = round(serve_ready(root, args.model, backend, serve_env), 2)
            cells = [row[k] if isinstance(row.get(k), str) else f"{row.get(k, math.nan):,}"
                     for k in keys]
            print(f"| {name}{'@' + backend if backend else ''} | " + " | ".join(cells) + " |",
                  flush=True)
        shutil.rmtree(caches, ignore_errors=True)


if __name__ == "__main__":
    main()
