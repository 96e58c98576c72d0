"""Serving under load (the vLLM paper's section 6): `python benchmarks/serving.py --rate 8`.

Requests arrive by a Poisson process at `--rate` per second (`inf`: all at once); their prompt and
output lengths follow a trace. The paper's Figure 11 gives the means of its two traces: ShareGPT
prompts of 161.31 tokens and outputs of 337.99, Alpaca 19.31 and 58.45 (its text: ShareGPT's are
8.4x and 5.8x longer; 161.31 / 19.31 = 8.35 and 337.99 / 58.45 = 5.78 agree). No package at hand
ships the datasets or their lengths, so lengths are drawn from log-normal distributions with a
spread per trace (sigma of the log: ShareGPT 1.0 and 0.9, Alpaca 0.5 and 0.6; ShareGPT varies more,
as in the paper), clipped as the paper's 2048-token OPT models clip them (prompts to half of
max_model_len, outputs to what is left, both to [2, 2048]); the log-means are fitted so that the
clipped lengths have the paper's means at max_model_len=2048. Prompts are random token ids.
A third trace, `wmt16`, stands for the paper's translation workload (section 6.4, Figure 16: WMT16
English-to-German), whose lengths the paper does not give. Chosen here: a sentence to translate of
32 tokens on average (a news sentence of about 25 words) and its translation of 40 (German takes
more tokens), log-sigmas 0.5 and 0.5. `--prefix-len` puts the same random prefix before every
prompt (the paper's few-shot instruction and examples, shared by all requests).

The script drives the engine in process, on the wall clock: `add_request` when a request arrives,
`step()` in between. Per request it records the time to first token (TTFT), the mean time per output
token after the first (TPOT) and the end-to-end latency; per run the throughput, the normalized
latency (the paper's metric: the mean over requests of latency / output tokens), the mean number of
requests running per step, and what the KV cache holds over time (`kv_breakdown`). Several values
of `--rate` or `--kv-reservation` (paged memory or one of the paper's Orca baselines) run a sweep.
Without a GPU, `--tiny` runs a small random model on the CPU.
"""
import argparse
import functools
import math
import os
import sys
import time

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH
from bench import arch_path  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.core.sequence import num_blocks_for  # noqa: E402

TRACES = {  # (mean, sigma of the log) of prompt and output lengths
    "sharegpt": ((161.31, 1.0), (337.99, 0.9)),
    "alpaca": ((19.31, 0.5), (58.45, 0.6)),
    "wmt16": ((32.0, 0.5), (40.0, 0.5)),  # a sentence and its translation (Figure 16's workload)
}
PAPER_MAX_LEN = 2048  # OPT's longest sequence: the paper's traces fit in it
MODES = {"paged": None, "oracle": "oracle", "pow2": "pow2", "max": "max"}  # --kv-reservation
BREAKDOWN = ("tokens", "tail", "reserved_later", "reserved_never", "free")  # kv_breakdown's keys
SAMPLE_FIELDS = ("t", "running", "waiting", "generated") + BREAKDOWN
SAMPLE_EVERY = 0.05  # seconds between two samples (kv_breakdown costs the host 0.1-0.2 ms a call)


def clipped_lengths(z: np.ndarray, mus: tuple[float, float], sigmas: tuple[float, float],
                    max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths from standard normal draws z[2, n]: exp(mu + sigma z), clipped."""
    prompt = np.clip(np.exp(mus[0] + sigmas[0] * z[0]), 2, min(PAPER_MAX_LEN, max_model_len // 2))
    prompt = prompt.astype(np.int64)
    high = np.minimum(PAPER_MAX_LEN, max_model_len - prompt)
    return prompt, np.clip(np.exp(mus[1] + sigmas[1] * z[1]), 2, high).astype(np.int64)


@functools.lru_cache
def fitted_mus(trace: str) -> tuple[float, float]:
    """Log-means whose clipped lengths (at max_model_len=2048) have the paper's means, by bisection
    on a large fixed sample; the prompt's first, as the output's clip depends on it."""
    (prompt_mean, prompt_sigma), (output_mean, output_sigma) = TRACES[trace]
    z = np.random.default_rng(12345).standard_normal((2, 200_000))
    mus = [math.log(prompt_mean), math.log(output_mean)]
    for which, target in ((0, prompt_mean), (1, output_mean)):
        low, high = mus[which] - 3, mus[which] + 3
        for _ in range(50):
            mus[which] = (low + high) / 2
            lengths = clipped_lengths(z, mus, (prompt_sigma, output_sigma), PAPER_MAX_LEN)
            mean = lengths[which].mean()
            low, high = (mus[which], high) if mean < target else (low, mus[which])
    return mus[0], mus[1]


def synthesize(trace: str, num_requests: int, seed: int,
               max_model_len: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request."""
    sigmas = (TRACES[trace][0][1], TRACES[trace][1][1])
    z = np.random.default_rng(seed).standard_normal((2, num_requests))
    prompt, output = clipped_lengths(z, fitted_mus(trace), sigmas, max_model_len)
    return list(zip(prompt.tolist(), output.tolist()))


def shared_prefix(num_tokens: int, vocab: int, seed: int) -> list[int]:
    """Random token ids that every prompt of a run starts with (a shared instruction)."""
    return np.random.default_rng(seed + 3).integers(vocab, size=num_tokens).tolist()


def poisson_arrivals(rate: float, num_requests: int, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of `rate` requests per second:
    independent exponential gaps of mean 1 / rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed + 1).exponential(1 / rate, num_requests)
    return np.cumsum(gaps).tolist()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def kv_breakdown(block_manager, seqs) -> dict[str, int]:
    """What the KV cache's slots hold (the paper's Figure 2), summed over the running sequences:
    token states (K/V computed, or being computed by the step in flight), the unused tail of the
    last block that holds tokens, whole blocks reserved for tokens the request will compute later,
    whole blocks it will never fill (it ends first: over-reservation), and free slots. A request's
    final length is known here (the benchmark ignores end-of-sequence tokens). A block shared by
    several sequences (a prefix-cache hit) counts once, for the first of them: it is a full block
    of computed tokens, so the others count it out of their token states."""
    bs = block_manager.block_size
    out = dict.fromkeys(BREAKDOWN, 0)
    seen = set()  # block ids counted already
    for seq in seqs:
        shared = sum(block_id in seen for block_id in seq.block_table)
        seen.update(seq.block_table)
        held = len(seq.block_table) * bs
        computed = min(seq.num_computed_tokens, held)
        filled = num_blocks_for(computed, bs) * bs  # the blocks holding tokens
        max_len = getattr(seq, "max_len", None)  # None: an engine before max_len (2429d52)
        if max_len is None:
            max_len = seq.num_prompt_tokens + seq.params.max_tokens
        last = num_blocks_for(max_len - 1, bs) * bs  # its last token gets no K/V
        will_fill = min(held, max(filled, last))
        out["tokens"] += computed - shared * bs
        out["tail"] += filled - computed
        out["reserved_later"] += will_fill - filled
        out["reserved_never"] += held - will_fill
    out["free"] = block_manager.num_free_blocks * bs
    return out


def drive(llm: LLM, requests: list[tuple[int, int]], arrivals: list[float], vocab: int, seed: int,
          on_step=None, sample_every: float = 0.0, deadline: float = math.inf,
          backlog: int = 0, prefix: list[int] = ()) -> dict:
    """Serve the requests as they arrive, or with backlog > 0 whenever fewer than `backlog` wait
    (the engine is never short of work: a saturated run), until all end or `deadline` seconds pass
    (the rest are then aborted). Every prompt is `prefix` and then its own random tokens. Per-run
    figures, per-request records, the step timeline, and every `sample_every` seconds a sample of
    SAMPLE_FIELDS (running, waiting, tokens generated, KV)."""
    rng = np.random.default_rng(seed + 2)
    legacy = "output_kind" not in SamplingParams.__dataclass_fields__  # before RequestOutputs
    index_of, done, arrived, timeline, samples = {}, {}, [], [], []
    running = max_running = steps = nxt = 0
    # log_stats' counts (engine/metrics.py), or an older engine's `stats` or output processor's
    if hasattr(llm, "observers"):
        from nanovllm.engine.metrics import engine_counts
        counts = engine_counts(llm)
    else:
        counts = getattr(llm, "stats", None) or getattr(llm, "output_processor", None)
    generated0, last_sample = getattr(counts, "num_generation_tokens", 0), -math.inf
    preemptions0 = llm.scheduler.num_preemptions
    start = time.monotonic()
    while len(done) < len(requests):
        now = time.monotonic() - start
        if now > deadline:
            for request_id, i in index_of.items():
                if i not in done:
                    llm.abort_request(request_id)
            while not llm.is_finished():
                llm.step()
            break
        while nxt < len(requests) and (
                len(llm.scheduler.waiting) < backlog if backlog else arrivals[nxt] <= now):
            extra = {} if legacy else {"output_kind": "final"}
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=requests[nxt][1],
                                    **extra)
            prompt = list(prefix) + rng.integers(vocab, size=requests[nxt][0]).tolist()
            index_of[llm.add_request(prompt, params)] = nxt
            arrived.append(now if backlog else arrivals[nxt])
            nxt += 1
        if llm.is_finished() and nxt < len(requests):
            time.sleep(max(0.0, min(arrivals[nxt], deadline) - (time.monotonic() - start)))
            continue
        outputs = llm.step()
        steps += 1
        running += len(llm.scheduler.running)
        max_running = max(max_running, len(llm.scheduler.running))
        now = time.monotonic() - start
        if llm.in_flight:  # the step just launched: sequences decoding, prompt tokens
            batch = llm.in_flight[-1][0]
            prefill = [n for n in batch.num_new_tokens if n > 1] if legacy is False else (
                batch.num_new_tokens if batch.is_prefill else [])
            timeline.append((now, len(batch.seqs) - len(prefill), sum(prefill)))
        if now - last_sample >= sample_every:
            last_sample = now
            kv = kv_breakdown(llm.block_manager, llm.scheduler.running)
            generated = getattr(counts, "num_generation_tokens", 0) - generated0
            samples.append([now, len(llm.scheduler.running), len(llm.scheduler.waiting), generated]
                           + [kv[k] for k in BREAKDOWN])
        if on_step is not None:
            on_step(steps)
        for out in (outputs[0] if legacy else outputs):  # kept: what the records take, no more
            if legacy or out.finished:
                done[index_of[out["request_id"]]] = (time.monotonic() - start, None if legacy else
                                                     (out.num_cached_tokens, out.metrics))
    wall = time.monotonic() - start
    records = []
    for i, (finished_at, out) in done.items():
        cached, metrics = out or (None, None)
        records.append(dict(prompt=requests[i][0], output=requests[i][1],
                            e2e=finished_at - arrived[i], prefix=len(prefix), cached=cached,
                            queue=metrics.queue_time if metrics else None,
                            ttft=metrics.time_to_first_token if metrics else None,
                            tpot=metrics.time_per_output_token if metrics else None))
    output_tokens = sum(r["output"] for r in records)
    normalized = sum(r["e2e"] / r["output"] for r in records) / max(1, len(records))
    return dict(wall=wall, steps=steps, requests_per_s=len(records) / wall,
                output_tokens_per_s=output_tokens / wall, normalized_latency=normalized,
                mean_running=running / max(1, steps), max_running=max_running, records=records,
                unfinished=len(requests) - len(records), timeline=timeline, samples=samples,
                preemptions=llm.scheduler.num_preemptions - preemptions0)


def window(samples: list[list[float]], skip: float = 0.0) -> list[list[float]]:
    """The samples after the first `skip` share of the run's time (a saturated run ramps up)."""
    if not samples:
        return []
    t0 = samples[0][0] + skip * (samples[-1][0] - samples[0][0])
    return [s for s in samples if s[0] >= t0]


def sample_means(samples: list[list[float]]) -> dict[str, float]:
    """The mean of each sampled quantity over the samples (each sample stands for an equal time)."""
    n = max(1, len(samples))
    return {k: sum(s[j] for s in samples) / n for j, k in enumerate(SAMPLE_FIELDS)}


def tokens_per_s(samples: list[list[float]]) -> float:
    """Output tokens per second between the first and the last of the samples."""
    if len(samples) < 2 or samples[-1][0] == samples[0][0]:
        return float("nan")
    return (samples[-1][3] - samples[0][3]) / (samples[-1][0] - samples[0][0])


def shares(means: dict[str, float]) -> dict[str, float]:
    """KV slots of each kind as a share of the whole cache."""
    total = sum(means[k] for k in BREAKDOWN)
    return {k: means[k] / total if total else float("nan") for k in BREAKDOWN}


def summary(result: dict) -> str:
    recs = result["records"]
    ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
    tpot = [r["tpot"] for r in recs if r["tpot"] is not None]
    line = (f"{result['wall']:.2f} s, {result['steps']} steps, {result['requests_per_s']:.2f} "
            f"req/s, {result['output_tokens_per_s']:,.0f} output tokens/s, normalized latency "
            f"{result['normalized_latency'] * 1e3:.1f} ms/token, mean running "
            f"{result['mean_running']:.1f}")
    if ttft:
        line += (f"; TTFT p50 {percentile(ttft, 50) * 1e3:.0f} ms p99 "
                 f"{percentile(ttft, 99) * 1e3:.0f} ms; TPOT p50 {percentile(tpot, 50) * 1e3:.1f} "
                 f"ms p99 {percentile(tpot, 99) * 1e3:.1f} ms")
    if result.get("samples"):
        kv = shares(sample_means(result["samples"]))
        line += "; KV cache: " + ", ".join(f"{k} {v:.0%}" for k, v in kv.items())
    if result["preemptions"]:
        line += f"; {result['preemptions']} preemptions"
    if result["unfinished"]:
        line += f"; {result['unfinished']} requests aborted at the deadline"
    return line


def make_llm(args, **options) -> LLM:
    """Qwen3-0.6B's shape (--arch) with random weights, or with --tiny a small random model on the
    CPU; `options` override the defaults."""
    if args.run_ahead_steps:  # else the engine's
        options = {"run_ahead_steps": args.run_ahead_steps, **options}
    if args.tiny:
        import torch
        from tests.helpers import build_random_checkpoint
        torch.set_num_threads(1)  # a small model runs faster on one thread than on shared cores
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "nanovllm-serving-tiny")
        if not os.path.isfile(os.path.join(path, "config.json")):
            build_random_checkpoint("qwen3", path)
        defaults = dict(skip_tokenizer_init=True, device="cpu", kvcache_block_size=16,
                        num_kvcache_blocks=args.num_kvcache_blocks or 64, max_model_len=1024,
                        log_stats=True, async_scheduling=True)  # run ahead as on CUDA
        return LLM(path, **{**defaults, **options})
    defaults = dict(load_format="dummy", skip_tokenizer_init=True, attn_backend=args.attn_backend,
                    num_kvcache_blocks=args.num_kvcache_blocks or -1,
                    enforce_eager=args.enforce_eager, log_stats=True)
    return LLM(arch_path(args.arch), **{**defaults, **options})


def engine_options(args, mode: str) -> dict:
    """The engine options of this command line, with kv_reservation for `mode` (a key of MODES)."""
    options = {"kv_reservation": MODES[mode]}
    if args.tensor_parallel_size > 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    if args.prefill_first:
        options["prefill_first"] = True
    if args.block_size:
        options["kvcache_block_size"] = args.block_size
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    return options


def warm_up(llm: LLM, trace: str, seed: int, prefix: list[int] = ()):
    """A few short requests at once, so that the measured runs compile and capture nothing (and,
    with a shared prefix, find it cached as they would in a long run)."""
    max_len = llm.config.max_model_len - len(prefix)
    warm = [(p, min(o, 64)) for p, o in synthesize(trace, 8, seed + 7, max_len)]
    drive(llm, warm, [0.0] * len(warm), llm.config.hf_config["vocab_size"], seed + 7,
          prefix=prefix)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default="sharegpt", choices=sorted(TRACES))
    p.add_argument("--rate", "--rates", nargs="+", type=float, default=[math.inf],
                   help="requests per second (inf: all at once); several: a sweep")
    p.add_argument("--kv-reservation", nargs="+", default=["paged"], choices=list(MODES),
                   help="paged KV memory, or an Orca baseline's reservation; several: a sweep")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-backend", default="triton", choices=["flash", "triton", "sdpa"])
    p.add_argument("--arch", default="Qwen3-0.6B", help="random weights of benchmarks/archs.json's")
    p.add_argument("--num-kvcache-blocks", type=int, default=0, help="0: as much as fits")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split on")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--block-size", type=int, default=0, help="KV block size (0: the engine's)")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the engine's default")
    p.add_argument("--sample-every", type=float, default=SAMPLE_EVERY,
                   help="seconds between KV samples")
    p.add_argument("--prefill-first", action="store_true", help="vLLM v0's order, not mixed steps")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--run-ahead-steps", type=int, default=None,
                   help="steps launched ahead of the one read (default: the engine's)")
    p.add_argument("--tiny", action="store_true", help="a small random model on the CPU")
    p.add_argument("--json", default="", help="write each run's figures, requests, steps, samples")
    return p


def main():
    args = parser().parse_args()
    runs = []
    for mode in args.kv_reservation:
        llm = make_llm(args, **engine_options(args, mode))
        vocab, max_len = llm.config.hf_config["vocab_size"], llm.config.max_model_len
        prefix = shared_prefix(args.prefix_len, vocab, args.seed)
        warm_up(llm, args.trace, args.seed, prefix)
        requests = synthesize(args.trace, args.num_requests, args.seed, max_len - len(prefix))
        for rate in args.rate:
            arrivals = poisson_arrivals(rate, args.num_requests, args.seed)
            result = drive(llm, requests, arrivals, vocab, args.seed,
                           sample_every=args.sample_every, prefix=prefix)
            print(f"{args.trace}, {mode}, rate {rate}, {args.num_requests} requests, "
                  f"{llm.config.attn_backend}, prefill_first={args.prefill_first}: "
                  f"{summary(result)}", flush=True)
            runs.append(dict(vars(args), rate=str(rate), kv_reservation=mode, **result))
        llm.shutdown()
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"sample_fields": SAMPLE_FIELDS, "runs": runs}, f)


if __name__ == "__main__":
    main()
