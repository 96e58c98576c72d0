"""Serving under load: `python benchmarks/serving.py --trace sharegpt --rate 8 --num-requests 500`.

Requests arrive by a Poisson process at `--rate` per second (`inf`: all at once); their prompt and
output lengths follow a trace. The vLLM paper (section 6.1, Fig. 11) reports the means of its two
traces, which are what the synthesized ones match: ShareGPT prompts of 161.31 tokens and outputs of
337.99 on average, Alpaca 19.31 and 58.45 (ShareGPT 8.4x and 5.8x longer). The datasets are not at
hand here, so lengths are drawn from log-normal distributions with those means and a spread per
trace (sigma of the log: ShareGPT 1.0 and 0.9, Alpaca 0.5 and 0.6; ShareGPT varies more, as in the
paper), clipped to [2, 2048] and to max_model_len; prompts are random token ids.

The script drives the engine in process, on the wall clock: `add_request` when a request arrives,
`step()` in between. Per request it records the time to first token (TTFT), the mean time per output
token after the first (TPOT) and the end-to-end latency; per run the throughput, the normalized
latency (the paper's metric: the mean over requests of latency / output tokens) and the mean number
of requests running per step. Without a GPU, `--tiny` runs a small random model on the CPU.
"""
import argparse
import math
import os
import random
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH
from nanovllm import LLM, SamplingParams  # noqa: E402

ARCHS = os.path.dirname(os.path.abspath(__file__))
TRACES = {  # (mean, sigma of the log) of prompt and output lengths
    "sharegpt": ((161.31, 1.0), (337.99, 0.9)),
    "alpaca": ((19.31, 0.5), (58.45, 0.6)),
}


def lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A log-normal draw with the given mean (mu = log(mean) - sigma^2 / 2)."""
    return rng.lognormvariate(math.log(mean) - sigma ** 2 / 2, sigma)


def synthesize(trace: str, num_requests: int, seed: int, max_model_len: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request."""
    rng = random.Random(seed)
    (prompt_mean, prompt_sigma), (output_mean, output_sigma) = TRACES[trace]
    requests = []
    for _ in range(num_requests):
        prompt = int(min(max(2, lognormal(rng, prompt_mean, prompt_sigma)), 2048, max_model_len // 2))
        output = int(min(max(2, lognormal(rng, output_mean, output_sigma)), 2048, max_model_len - prompt))
        requests.append((prompt, output))
    return requests


def poisson_arrivals(rate: float, num_requests: int, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of `rate` requests per second."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng, t, times = random.Random(seed + 1), 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def drive(llm: LLM, requests: list[tuple[int, int]], arrivals: list[float], vocab: int, seed: int,
          on_step=None) -> dict:
    """Serve the requests as they arrive; per-run figures and per-request records."""
    rng = random.Random(seed + 2)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n, _ in requests]
    legacy = "output_kind" not in SamplingParams.__dataclass_fields__  # an engine before RequestOutputs
    index_of, done, running, steps, nxt, timeline = {}, {}, 0, 0, 0, []
    start = time.monotonic()
    while len(done) < len(requests):
        now = time.monotonic() - start
        while nxt < len(requests) and arrivals[nxt] <= now:
            extra = {} if legacy else {"output_kind": "final"}
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=requests[nxt][1], **extra)
            index_of[llm.add_request(prompts[nxt], params)] = nxt
            nxt += 1
        if llm.is_finished() and nxt < len(requests):
            time.sleep(max(0.0, arrivals[nxt] - (time.monotonic() - start)))
            continue
        outputs = llm.step()
        steps += 1
        running += len(llm.scheduler.running)
        if llm.in_flight is not None:  # the step just launched: sequences decoding, prompt tokens
            batch = llm.in_flight[0]
            prefill = [n for n in batch.num_new_tokens if n > 1] if legacy is False else (
                batch.num_new_tokens if batch.is_prefill else [])
            timeline.append((time.monotonic() - start, len(batch.seqs) - len(prefill), sum(prefill)))
        if on_step is not None:
            on_step(steps)
        for out in (outputs[0] if legacy else outputs):
            if legacy or out.finished:
                done[index_of[out["request_id"]]] = (time.monotonic() - start, out)
    wall = time.monotonic() - start
    records = []
    for i, (finished_at, out) in done.items():
        metrics = None if legacy else out.metrics
        records.append(dict(prompt=requests[i][0], output=requests[i][1], e2e=finished_at - arrivals[i],
                            ttft=metrics.time_to_first_token if metrics else None,
                            tpot=metrics.time_per_output_token if metrics else None))
    output_tokens = sum(n for _, n in requests)
    return dict(wall=wall, steps=steps, requests_per_s=len(requests) / wall, output_tokens_per_s=output_tokens / wall,
                mean_running=running / max(1, steps), records=records, timeline=timeline,
                normalized_latency=sum(r["e2e"] / r["output"] for r in records) / len(records))


def summary(result: dict) -> str:
    recs = result["records"]
    ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
    tpot = [r["tpot"] for r in recs if r["tpot"] is not None]
    line = (f"{result['wall']:.2f} s, {result['steps']} steps, {result['requests_per_s']:.2f} req/s, "
            f"{result['output_tokens_per_s']:,.0f} output tokens/s, normalized latency "
            f"{result['normalized_latency'] * 1e3:.1f} ms/token, mean running {result['mean_running']:.1f}")
    if ttft:
        line += (f"; TTFT p50 {percentile(ttft, 50) * 1e3:.0f} ms p99 {percentile(ttft, 99) * 1e3:.0f} ms; "
                 f"TPOT p50 {percentile(tpot, 50) * 1e3:.1f} ms p99 {percentile(tpot, 99) * 1e3:.1f} ms")
    return line


def make_llm(args, **options) -> LLM:
    if args.tiny:
        from tests.helpers import build_random_checkpoint
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "nanovllm-serving-tiny")
        if not os.path.isfile(os.path.join(path, "config.json")):
            build_random_checkpoint("qwen3", path)
        return LLM(path, skip_tokenizer_init=True, device="cpu", kvcache_block_size=16,
                   num_kvcache_blocks=args.num_kvcache_blocks or 64, max_model_len=1024, **options)
    return LLM(os.path.join(ARCHS, args.arch), load_format="dummy", skip_tokenizer_init=True,
               attn_backend=args.attn_backend, num_kvcache_blocks=args.num_kvcache_blocks or -1,
               enforce_eager=args.enforce_eager, **options)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default="sharegpt", choices=sorted(TRACES))
    p.add_argument("--rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-backend", default="triton", choices=["flash", "triton", "sdpa"])
    p.add_argument("--arch", default="Qwen3-0.6B")
    p.add_argument("--num-kvcache-blocks", type=int, default=0, help="0: as much as fits")
    p.add_argument("--prefill-first", action="store_true", help="vLLM v0's order instead of mixed steps")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a small random model on the CPU")
    p.add_argument("--json", default="", help="write the run's figures, requests and step timeline here")
    return p


def main():
    args = parser().parse_args()
    options = {"prefill_first": True} if args.prefill_first else {}
    llm = make_llm(args, **options)
    max_len = llm.config.max_model_len
    requests = synthesize(args.trace, args.num_requests, args.seed, max_len)
    arrivals = poisson_arrivals(args.rate, args.num_requests, args.seed)
    warm = synthesize(args.trace, 8, args.seed + 7, max_len)
    drive(llm, warm, [0.0] * len(warm), llm.config.hf_config["vocab_size"], args.seed + 7)  # warm-up
    result = drive(llm, requests, arrivals, llm.config.hf_config["vocab_size"], args.seed)
    print(f"{args.trace}, rate {args.rate}, {args.num_requests} requests, {llm.config.attn_backend}, "
          f"prefill_first={args.prefill_first}: {summary(result)}")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), rate=str(args.rate), **result), f)


if __name__ == "__main__":
    main()
