"""Load on the OpenAI-compatible server over HTTP (what vLLM's benchmarks/benchmark_serving.py
measures): `python benchmarks/load_http.py --url http://127.0.0.1:8000 --rate 8 32 128`.

Requests arrive by a Poisson process at each `--rate` (`inf`: all at once), with prompt and output
lengths drawn from a trace of the paper's section 6 (benchmarks/serving.py's `synthesize`:
ShareGPT or Alpaca lengths; prompts are random token ids, outputs run to their drawn length with
ignore_eos). Each request is one client on its own connection, streamed (server-sent events) or
not. Per rate it reports the requests and output tokens per second, the time to first token (TTFT)
and time per output token after it (TPOT) at p50 and p99 (streamed only), the end-to-end latency,
the errors by kind, the most clients in flight at once, and the server's resident memory before
and after. `--server "MODEL FLAGS"` starts `python -m nanovllm.serve` itself on a free port and
stops it with SIGTERM at the end (its exit status is printed).
"""
import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import percentile, poisson_arrivals, synthesize  # and the repo's root on the path

from bench import arch_path, archs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Clients:
    """How many requests are in flight now, and the most at once."""

    def __init__(self):
        self.now = self.peak = 0

    def __enter__(self):
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc):
        self.now -= 1


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


async def run_rate(url: str, headers: dict, requests: list[tuple[int, int]], rate: float,
                   stream: bool, seed: int, max_token_id: int, deadline: float) -> dict:
    """All requests at their Poisson arrival times; the figures of the run."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, max_token_id) for _ in range(p)] for p, _ in requests]
    arrivals = poisson_arrivals(rate, len(requests), seed)
    clients = Clients()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(deadline, connect=60)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout,
                                 trust_env=False) as client:
        start = time.perf_counter()

        async def arrive(i):
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
            return await one_request(client, prompts[i], requests[i][1], stream, clients)
        tasks = [asyncio.ensure_future(arrive(i)) for i in range(len(requests))]
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - start
    results = [t.result() for t in done]
    ok = [r for r in results if "error" not in r]
    errors = {}
    for r in results:
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    if pending:
        errors["unfinished at the deadline"] = len(pending)
    figures = {"rate": rate, "requests": len(requests), "completed": len(ok), "wall_s": wall,
               "req_per_s": len(ok) / wall, "out_tok_per_s": sum(r["tokens"] for r in ok) / wall,
               "errors": errors, "peak_clients": clients.peak}
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


def device_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"CPU ({os.cpu_count()} cores)"


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"  # nan: not measured


def table_row(f: dict, rss: tuple[float, float]) -> str:
    errors = sum(f["errors"].values())
    return (f"| {f['rate']:g} | {f['completed']}/{f['requests']} | {f['req_per_s']:.2f} | "
            f"{f['out_tok_per_s']:.0f} | {ms(f['ttft_p50'])} | {ms(f['ttft_p99'])} | "
            f"{ms(f['tpot_p50'])} | {ms(f['tpot_p99'])} | {f['e2e_p50']:.1f} | "
            f"{f['e2e_p99']:.1f} | {errors} | {f['peak_clients']} | {rss[0]:.0f} | {rss[1]:.0f} |")


HEADER = ("| rate (req/s) | completed | req/s | out tok/s | TTFT p50 (ms) | TTFT p99 "
          "| TPOT p50 (ms) | TPOT p99 | e2e p50 (s) | e2e p99 | errors | peak clients "
          "| RSS before (MiB) | after |\n" + "|---" * 14 + "|")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--server", help="start one: 'MODEL FLAGS' for python -m nanovllm.serve")
    p.add_argument("--pid", type=int, default=None, help="the --url server's process (for RSS)")
    p.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"))
    p.add_argument("--rate", "--rates", nargs="+", type=float, default=[8.0],
                   help="requests per second (inf: all at once); several: one row each")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--trace", default="sharegpt", choices=["sharegpt", "alpaca"])
    p.add_argument("--max-model-len", type=int, default=0,
                   help="clip lengths to this (0: the server's, from /v1/models)")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="whole answers (no TTFT or TPOT)")
    p.add_argument("--max-token-id", type=int, default=20000, help="prompt ids in [1000, this)")
    p.add_argument("--deadline", type=float, default=300, help="seconds per row at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write every row's figures here")
    return p


def main():
    args = parser().parse_args()
    proc, url, pid = None, args.url, args.pid
    if args.server:
        proc, url = start_server(args.server, args.api_key)
        pid = proc.pid
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, trust_env=False) as c:
            model = c.get("/v1/models").json()["data"][0]
        max_len = args.max_model_len or model["max_model_len"]
        requests = synthesize(args.trace, args.num_requests, args.seed, max_len)
        asyncio.run(run_rate(url, headers, requests[:4], math.inf, args.stream, args.seed - 1,
                             args.max_token_id, args.deadline))  # warm-up
        print(f"{device_name()}, model {model['id']}, {args.trace} lengths (max_model_len "
              f"{max_len}), {args.num_requests} requests per row, "
              f"{'streamed' if args.stream else 'whole answers'}\n\n{HEADER}", flush=True)
        rows = []
        for row, rate in enumerate(args.rate):  # new prompt ids per row: no prefix-cache hits
            before = rss_mib(pid)
            figures = asyncio.run(run_rate(url, headers, requests, rate, args.stream,
                                           args.seed + 1000 * row, args.max_token_id,
                                           args.deadline))
            figures["rss_before_mib"], figures["rss_after_mib"] = before, rss_mib(pid)
            print(table_row(figures, (before, figures["rss_after_mib"])), flush=True)
            if figures["errors"]:
                print(f"  errors: {figures['errors']}", flush=True)
            rows.append(figures)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device_name(), "model": model["id"], "rows": rows}, f)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            print(proc.stdout.read(), end="")
            print(f"server exit status: {proc.wait()}", flush=True)


if __name__ == "__main__":
    main()
