"""Load on the OpenAI-compatible server over HTTP (what vLLM's benchmarks/benchmark_serving.py
measures): `python benchmarks/load_http.py --url http://127.0.0.1:8000 --rate 8 32 128`.

Requests arrive by a Poisson process at each `--rate` (`inf`: all at once), with prompt and output
lengths drawn from a trace of the paper's section 6 (benchmarks/serving.py's `synthesize`:
ShareGPT or Alpaca lengths; prompts are random token ids, outputs run to their drawn length with
ignore_eos). `--trace shared-prefix` sends prompts that share long prefixes instead: `--prefixes`
K random prefixes of `--prefix-len` tokens, each request one of them (at random) and SUFFIX_LEN
tokens of its own, OUTPUT_LEN tokens out, so that the prefix cache (and, with replicas, where a
request is routed) decides how much of each prompt is computed. Each request is one client on its
own connection, streamed (server-sent events) or not; `--client-processes N` spreads the clients
over N processes (httpx costs a process tens of microseconds per streamed token: one process reads
about 10,000 tokens/s at most, less than two replicas write).

Per rate it reports the requests and output tokens per second, the time to first token (TTFT)
and time per output token after it (TPOT) at p50 and p99 (streamed only), the end-to-end latency,
the errors by kind, the most clients in flight at once (summed over the client processes), and the
server's resident memory before and after; then, from the server's /v1/stats, the output tokens
per second while it was saturated (between the moments it had produced 10% and 90% of the row's
tokens: no ramp-up, no tail), the prefix cache's hit rate over the row (prompt tokens served from
the cache; per replica with --data-parallel-size), and the CPU time that the client processes, the
server and each replica spent per second of the row (100%: one core busy).

`--server "MODEL FLAGS"` starts `python -m nanovllm.serve` itself on a free port and stops it with
SIGTERM at the end (its exit status is printed); MODEL may name an architecture of
benchmarks/archs.json (random weights with --load-format dummy). With `--compare "FLAGS" ...` it
runs one server per flag set (MODEL FLAGS, then these), each through every rate, and ends with a
table of each one's figures beside the first's, for example replicas against one engine:

    python benchmarks/load_http.py --server "Qwen3-0.6B --load-format dummy --skip-tokenizer-init" \
        --compare "--data-parallel-size 1" "--data-parallel-size 2" --rate 200 --num-requests 1500
"""
import argparse
import asyncio
import functools
import json
import math
import multiprocessing as mp
import os
import random
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import percentile, poisson_arrivals, synthesize  # and the repo's root on the path

from bench import arch_path, archs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIX_LEN, OUTPUT_LEN = 32, 128  # --trace shared-prefix: a request's own prompt tokens, its output
STATS_EVERY = 0.5  # seconds between two reads of /v1/stats during a row
STEADY = (0.1, 0.9)  # the share of the row's output tokens between which "steady" is measured


class Clients:
    """How many requests are in flight now, and the most at once."""

    def __init__(self):
        self.now = self.peak = 0

    def __enter__(self):
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc):
        self.now -= 1


def workload(args, max_len: int, seed: int) -> list[tuple[list[int], int]]:
    """One row's requests: (prompt token ids, output tokens). Token ids are drawn from `seed` (new
    ones per row: no prefix-cache hits from one row to the next); trace lengths from --seed."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, args.max_token_id) for _ in range(n)]
    if args.trace == "shared-prefix":
        prefixes = [ids(args.prefix_len) for _ in range(args.prefixes)]
        return [(rng.choice(prefixes) + ids(SUFFIX_LEN), OUTPUT_LEN)
                for _ in range(args.num_requests)]
    return [(ids(p), o) for p, o in synthesize(args.trace, args.num_requests, args.seed, max_len)]


async def one_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                      stream: bool, clients: Clients) -> dict:
    """Send one completion; its timings (seconds from its start) or the error it met."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start, first, last, tokens = time.perf_counter(), None, None, 0
    with clients:
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return {"error": f"HTTP {r.status_code}"}
                if not stream:
                    tokens = json.loads(await r.aread())["usage"]["completion_tokens"]
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event, now = json.loads(line[6:]), time.perf_counter()
                        if event["choices"]:  # a token (its text may be empty), or the end
                            first, last = first or now, now
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
        except httpx.HTTPError as e:
            return {"error": type(e).__name__}
    end = time.perf_counter()
    if tokens != max_tokens:
        return {"error": f"{tokens} of {max_tokens} tokens"}
    result = {"e2e": end - start, "tokens": tokens}
    if stream and first is not None:
        result["ttft"] = first - start
        result["tpot"] = (last - first) / (tokens - 1) if tokens > 1 else None
    return result


class StatsReader:
    """The server's /v1/stats every STATS_EVERY seconds, on a thread of its own, until stop():
    (time.monotonic(), the figures) in `samples`, the first read at once."""

    def __init__(self, url: str, headers: dict):
        self.client = httpx.Client(base_url=url, headers=headers, trust_env=False, timeout=60)
        self.samples = [(time.monotonic(), self.read())]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="stats", daemon=True)
        self.thread.start()

    def read(self) -> dict:
        """The figures; {} if the server does not answer with them."""
        try:
            stats = self.client.get("/v1/stats").json()
        except (httpx.HTTPError, ValueError):
            return {}
        return stats if isinstance(stats, dict) else {}

    def run(self):
        while not self.done.wait(STATS_EVERY):
            self.samples.append((time.monotonic(), self.read()))

    def stop(self) -> list[tuple[float, dict]]:
        """Stop reading, read once more (the row's last figures) and return every read."""
        self.done.set()
        self.thread.join()
        self.samples.append((time.monotonic(), self.read()))
        self.client.close()
        return self.samples


def steady_rate(samples: list[tuple[float, dict]]) -> float:
    """Output tokens per second between the moments the server had produced STEADY[0] and
    STEADY[1] of the row's output tokens (interpolated between reads of its counter): the pace of a
    saturated server, without the ramp-up and the tail of the last long requests."""
    points = [(t, stats["generation_tokens"]) for t, stats in samples
              if "generation_tokens" in stats]
    if len(points) < 2 or points[-1][1] == points[0][1]:
        return math.nan
    total = points[-1][1] - points[0][1]

    def when(share: float) -> float:
        target = points[0][1] + share * total
        for (t0, g0), (t1, g1) in zip(points, points[1:]):
            if g1 >= target:
                return t0 + (t1 - t0) * (target - g0) / max(1, g1 - g0)
        return points[-1][0]
    seconds = when(STEADY[1]) - when(STEADY[0])
    return (STEADY[1] - STEADY[0]) * total / seconds if seconds > 0 else math.nan


def hit_rates(before: dict, after: dict) -> tuple[float, list[float]]:
    """The prefix cache's hit rate between two /v1/stats reads: prompt tokens served from the cache
    over prompt tokens admitted, in all and per replica (one engine: a list of one)."""
    def rate(a: dict, b: dict) -> float:
        prompt = b.get("prompt_tokens", 0) - a.get("prompt_tokens", 0)
        cached = b.get("cached_prompt_tokens", 0) - a.get("cached_prompt_tokens", 0)
        return cached / prompt if prompt > 0 else math.nan
    pairs = list(zip(before.get("replicas", [before]), after.get("replicas", [after])))
    return rate(before, after), [rate(a, b) for a, b in pairs]


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system, all threads) a process has spent; nan if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return math.nan


def process_ids(server_pid: int | None, stats: dict) -> dict[str, int]:
    """The processes whose CPU time is reported: the server, and each replica it runs."""
    pids = {"server": server_pid} if server_pid is not None else {}
    for entry in stats.get("replicas", []):
        pids[f"replica {entry['replica']}"] = entry["pid"]
    return pids


async def send_all(url: str, headers: dict, requests: list[tuple[list[int], int]],
                   arrivals: list[float], stream: bool, deadline: float, start: float) -> dict:
    """Requests at their arrival times (seconds after `start`, a time.monotonic(), which every
    client process shares): their results, the most in flight at once, the CPU seconds this
    process spent, and when the last one ended."""
    clients, cpu = Clients(), time.process_time()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(deadline, connect=60)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout,
                                 trust_env=False) as client:
        async def arrive(i):
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.monotonic()))
            return await one_request(client, *requests[i], stream, clients)
        tasks = [asyncio.ensure_future(arrive(i)) for i in range(len(requests))]
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, start + deadline
                                                              - time.monotonic()))
        for task in pending:
            task.cancel()
        end = time.monotonic()
    results = [t.result() for t in done] + [{"error": "unfinished at the deadline"}] * len(pending)
    return {"results": results, "peak": clients.peak, "cpu_s": time.process_time() - cpu,
            "end": end}


def send_share(*args) -> dict:
    """A client process's share of the requests (send_all's arguments)."""
    return asyncio.run(send_all(*args))


def run_rate(url: str, headers: dict, requests: list[tuple[list[int], int]], rate: float,
             stream: bool, seed: int, deadline: float, pid: int | None = None,
             processes: int = 1) -> dict:
    """All requests at their Poisson arrival times, sent by `processes` client processes (request
    i by process i % processes; one: this process); the figures of the run."""
    arrivals = poisson_arrivals(rate, len(requests), seed)
    pool = mp.get_context("fork").Pool(processes) if processes > 1 else None  # before any thread
    try:
        stats = StatsReader(url, headers)
        pids = process_ids(pid, stats.samples[0][1])
        cpu_before = {name: cpu_seconds(p) for name, p in pids.items()}
        if pool is None:
            start = time.monotonic()
            parts = [send_share(url, headers, requests, arrivals, stream, deadline, start)]
        else:  # a second for the requests to reach the processes
            start = time.monotonic() + 1.0
            shares = [range(k, len(requests), processes) for k in range(processes)]
            parts = pool.starmap(send_share, [
                (url, headers, [requests[i] for i in share], [arrivals[i] for i in share], stream,
                 deadline, start) for share in shares])
        wall = max(part["end"] for part in parts) - start
        cpu = {"client": sum(part["cpu_s"] for part in parts) / wall}
        cpu.update({name: (cpu_seconds(p) - cpu_before[name]) / wall for name, p in pids.items()})
        samples = stats.stop()
    finally:
        if pool is not None:  # its processes have returned their shares, or are cut short
            pool.terminate()
            pool.join()
    results = [r for part in parts for r in part["results"]]
    ok = [r for r in results if "error" not in r]
    errors = {}
    for r in results:
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    figures = {"rate": rate, "requests": len(requests), "completed": len(ok), "wall_s": wall,
               "req_per_s": len(ok) / wall, "out_tok_per_s": sum(r["tokens"] for r in ok) / wall,
               "errors": errors, "peak_clients": sum(part["peak"] for part in parts), "cpu": cpu,
               "steady_out_tok_per_s": steady_rate(samples)}
    if "prompt_tokens" in samples[0][1] and "prompt_tokens" in samples[-1][1]:
        figures["hit_rate"], figures["replica_hit_rates"] = hit_rates(samples[0][1],
                                                                      samples[-1][1])
    for name in ("ttft", "tpot", "e2e"):
        values = [r[name] for r in ok if r.get(name) is not None]
        figures[f"{name}_p50"] = percentile(values, 50)
        figures[f"{name}_p99"] = percentile(values, 99)
    return figures


def rss_mib(pid: int | None) -> float:
    """A process's resident memory (MiB), from /proc; nan if unknown."""
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return math.nan


def start_server(spec: str, api_key: str | None) -> tuple[subprocess.Popen, str]:
    """`python -m nanovllm.serve SPEC --port 0` and its address, once it listens."""
    key = ["--api-key", api_key] if api_key else []
    model, *flags = shlex.split(spec)
    if not os.path.isdir(os.path.join(ROOT, model)) and model in archs():
        model = arch_path(model)  # an architecture of benchmarks/archs.json: --load-format dummy
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", model, *flags,
                             "--port", "0", "--log-level", "warning", *key],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith("nanovllm: serving "):
            return proc, line.rsplit(" on ", 1)[1].strip()
    raise SystemExit(f"the server exited with status {proc.wait()} before it listened")


@functools.cache
def device_name() -> str:
    """The first GPU's name, from nvidia-smi (this process then holds no GPU memory), else torch;
    else the CPU."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", gpu],
                           capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"CPU ({os.cpu_count()} cores)"


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"  # nan: not measured


def share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def table_row(f: dict, rss: tuple[float, float]) -> str:
    errors = sum(f["errors"].values())
    return (f"| {f['rate']:g} | {f['completed']}/{f['requests']} | {f['req_per_s']:.2f} | "
            f"{f['out_tok_per_s']:.0f} | {ms(f['ttft_p50'])} | {ms(f['ttft_p99'])} | "
            f"{ms(f['tpot_p50'])} | {ms(f['tpot_p99'])} | {f['e2e_p50']:.1f} | "
            f"{f['e2e_p99']:.1f} | {errors} | {f['peak_clients']} | {rss[0]:.0f} | {rss[1]:.0f} |")


def server_lines(f: dict) -> str:
    """What the server's /v1/stats and /proc tell of a row."""
    lines = f"  steady: {f['steady_out_tok_per_s']:.0f} out tok/s"
    if "hit_rate" in f:
        lines += f"; prefix cache hit rate {share(f['hit_rate'])}"
        if len(f["replica_hit_rates"]) > 1:
            lines += f" (per replica: {', '.join(map(share, f['replica_hit_rates']))})"
    cpu = ", ".join(f"{name} {100 * seconds:.0f}%" for name, seconds in f["cpu"].items())
    return lines + f"\n  CPU time per second of the row: {cpu}"


HEADER = ("| rate (req/s) | completed | req/s | out tok/s | TTFT p50 (ms) | TTFT p99 "
          "| TPOT p50 (ms) | TPOT p99 | e2e p50 (s) | e2e p99 | errors | peak clients "
          "| RSS before (MiB) | after |\n" + "|---" * 14 + "|")


def times(value: float, first: float) -> str:
    return f"{value / first:.2f}" if first > 0 else "-"  # nan compares False: "-" too


def comparison(runs: list[tuple[str, list[dict]]]) -> str:
    """One row per server and rate: its throughput beside the first server's at that rate."""
    lines = ["| server flags | rate (req/s) | out tok/s | x first | steady out tok/s | x first "
             "| prefix cache hit rate | per replica | TTFT p50 (ms) | errors |",
             "|---" * 10 + "|"]
    for flags, rows in runs:
        for f, first in zip(rows, runs[0][1]):
            lines.append(
                f"| {flags} | {f['rate']:g} | {f['out_tok_per_s']:.0f} | "
                f"{times(f['out_tok_per_s'], first['out_tok_per_s'])} | "
                f"{f['steady_out_tok_per_s']:.0f} | "
                f"{times(f['steady_out_tok_per_s'], first['steady_out_tok_per_s'])} | "
                f"{share(f.get('hit_rate', math.nan))} | "
                f"{', '.join(map(share, f.get('replica_hit_rates', [])))} | "
                f"{ms(f['ttft_p50'])} | {sum(f['errors'].values())} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--server", help="start one: 'MODEL FLAGS' for python -m nanovllm.serve")
    p.add_argument("--compare", nargs="+", default=None, metavar="FLAGS",
                   help="with --server: one server per flag set, added to its FLAGS, in turn")
    p.add_argument("--pid", type=int, default=None, help="the --url server's process (for RSS)")
    p.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"))
    p.add_argument("--rate", "--rates", nargs="+", type=float, default=[8.0],
                   help="requests per second (inf: all at once); several: one row each")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--trace", default="sharegpt", choices=["sharegpt", "alpaca", "shared-prefix"])
    p.add_argument("--prefixes", type=int, default=32,
                   help="--trace shared-prefix: how many distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=2048,
                   help="--trace shared-prefix: tokens of each prefix")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="clip lengths to this (0: the server's, from /v1/models)")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="whole answers (no TTFT or TPOT)")
    p.add_argument("--max-token-id", type=int, default=20000, help="prompt ids in [1000, this)")
    p.add_argument("--deadline", type=float, default=300, help="seconds per row at most")
    p.add_argument("--client-processes", type=int, default=1,
                   help="processes sending the requests (a streamed token costs a client process "
                        "tens of microseconds: one keeps up with about 10,000 tokens/s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write every row's figures here")
    return p


def check_args(args):
    """The flags that argparse's types leave unchecked: a ValueError naming the flag."""
    if args.compare and not args.server:
        raise ValueError("--compare needs --server: the servers it starts get its flag sets")
    for name in ("num_requests", "prefixes", "prefix_len", "max_token_id", "client_processes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if args.max_token_id <= 1000:
        raise ValueError(f"--max-token-id must be > 1000, not {args.max_token_id}")
    if any(not rate > 0 for rate in args.rate):
        raise ValueError(f"--rate must be > 0 (inf: all at once), not {args.rate}")


def raise_open_files_limit():
    """One connection per client: let the client, and a server it starts, hold as many open
    sockets as the system allows (the usual soft limit of 1024 is below the peak of a heavy row)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit is not a number of files
        pass


def run_server(args, spec: str | None) -> tuple[dict, list[dict]]:
    """Every rate against one server (started from `spec`, or --url's): the model, each row."""
    proc, url, pid = None, args.url, args.pid
    if spec:
        proc, url = start_server(spec, args.api_key)
        pid = proc.pid
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    try:
        with httpx.Client(base_url=url, headers=headers, trust_env=False) as c:
            model = c.get("/v1/models").json()["data"][0]
        max_len = args.max_model_len or model["max_model_len"]
        if args.trace == "shared-prefix" and args.prefix_len + SUFFIX_LEN + OUTPUT_LEN > max_len:
            raise ValueError(f"--prefix-len {args.prefix_len} + {SUFFIX_LEN + OUTPUT_LEN} tokens "
                             f"of each request's own exceed max_model_len {max_len}")
        run_rate(url, headers, workload(args, max_len, args.seed - 1)[:4], math.inf, args.stream,
                 args.seed - 1, args.deadline)  # warm-up
        print(f"{device_name()}, model {model['id']}, {args.trace} lengths (max_model_len "
              f"{max_len}), {args.num_requests} requests per row, "
              f"{'streamed' if args.stream else 'whole answers'}\n\n{HEADER}", flush=True)
        for row, rate in enumerate(args.rate):
            before = rss_mib(pid)
            requests = workload(args, max_len, args.seed + 1000 * row)
            figures = run_rate(url, headers, requests, rate, args.stream, args.seed + 1000 * row,
                               args.deadline, pid, args.client_processes)
            figures["rss_before_mib"], figures["rss_after_mib"] = before, rss_mib(pid)
            print(table_row(figures, (before, figures["rss_after_mib"])), flush=True)
            print(server_lines(figures), flush=True)
            if figures["errors"]:
                print(f"  errors: {figures['errors']}", flush=True)
            rows.append(figures)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            print(proc.stdout.read(), end="")
            print(f"server exit status: {proc.wait()}", flush=True)
    return model, rows


def main():
    args = parser().parse_args()
    check_args(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: still stop the server
    raise_open_files_limit()
    device_name()  # before any server starts
    flag_sets = args.compare or [""]
    runs = []
    for flags in flag_sets:
        spec = f"{args.server} {flags}".strip() if args.server else None
        if args.compare:
            print(f"\n## {spec}\n", flush=True)
        model, rows = run_server(args, spec)
        runs.append((flags, rows))
    if args.compare:
        print(f"\n{device_name()}, model {model['id']}, {args.trace}, {args.num_requests} requests "
              f"per row, server {args.server!r} with:\n\n{comparison(runs)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(), "model": model["id"], "server": args.server,
                       "runs": [{"flags": flags, "rows": rows} for flags, rows in runs]}, f)


if __name__ == "__main__":
    main()
