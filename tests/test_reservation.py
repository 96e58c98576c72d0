"""kv_reservation (the vLLM paper's Orca baselines, nanovllm/core/reservation.py) and the load
generator of benchmarks/serving.py: reservations, the KV memory breakdown, Poisson arrivals, the
synthesized traces, and the metrics of a tiny CPU run."""
import math
import os
import sys

import numpy as np
import pytest

from nanovllm import SamplingParams
from nanovllm.core.reservation import ReservingBlockManager, reserved_tokens
from nanovllm.core.sequence import Sequence, num_blocks_for
from tests.helpers import make_llm, random_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import serving  # noqa: E402

MODES = [None, "oracle", "pow2", "max"]


class FakeConfig:  # the fields ReservingBlockManager reads
    def __init__(self, mode, max_model_len, block_size=4):
        self.kv_reservation, self.max_model_len = mode, max_model_len
        self.kvcache_block_size, self.enable_prefix_caching = block_size, True


def test_reserved_tokens():
    assert reserved_tokens("oracle", 10, 25, 2048) == 35
    assert reserved_tokens("pow2", 10, 25, 2048) == 10 + 32  # the paper's example: 25 reserve 32
    assert [reserved_tokens("pow2", 0, n, 2048) for n in (1, 2, 3, 32, 33)] == [1, 2, 4, 32, 64]
    assert reserved_tokens("max", 10, 25, 2048) == 2048
    assert reserved_tokens("pow2", 1000, 1500, 2048) == 2048  # never past max_model_len
    assert reserved_tokens("oracle", 1000, 1500, 2048) == 2048


def test_reservation_is_allocated_at_admission_or_not_at_all():
    bm = ReservingBlockManager(8, FakeConfig("pow2", 32))
    seq = Sequence(list(range(5)), SamplingParams(max_tokens=6), 4, 32)  # 5 + 8 slots: 4 blocks
    assert bm.allocate(seq) and len(seq.block_table) == 4 and bm.num_free_blocks == 4
    assert bm.num_blocks_to_append([seq]) == 0  # it never grows
    other = Sequence(list(range(9)), SamplingParams(max_tokens=9), 4, 32)  # 9 + 16 = 25: 7 blocks
    assert not bm.allocate(other) and bm.num_free_blocks == 4 and not other.block_table
    bm.free(seq)
    assert bm.allocate(other) and len(other.block_table) == 7


def test_bad_options(tiny_path):
    allowed = "kv_reservation='fixed' must be one of .None, 'oracle', 'pow2', 'max'."
    with pytest.raises(ValueError, match=allowed):
        make_llm(tiny_path, kv_reservation="fixed")
    with pytest.raises(ValueError, match="max_model_len=256 tokens .16 blocks., but it has 10 "):
        make_llm(tiny_path, kv_reservation="max", max_model_len=256, num_kvcache_blocks=10)


def test_modes_give_identical_greedy_outputs(tiny_path):
    """A cache of 24 blocks: paged preempts and recomputes, the reservations queue; same tokens."""
    prompts = random_prompts(10, (3, 40), seed=1)
    rng = np.random.default_rng(1)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=int(n))
              for n in rng.integers(5, 60, len(prompts))]
    outputs = {}
    for mode in MODES:
        llm = make_llm(tiny_path, kv_reservation=mode, max_model_len=256, num_kvcache_blocks=24)
        done = llm.generate(prompts, params, use_tqdm=False)
        outputs[mode] = [o.outputs[0].token_ids for o in done]
        assert [len(t) for t in outputs[mode]] == [p.max_tokens for p in params]
        assert llm.block_manager.num_free_blocks == 24  # every reservation given back
    for mode in MODES[1:]:
        assert outputs[mode] == outputs[None], mode


def test_reserving_more_runs_fewer_requests_at_once(tiny_path):
    """All requests at once into a small cache: max < pow2 < oracle < paged, in mean running
    requests per step (and no more at the peak)."""
    requests = serving.synthesize("alpaca", 16, 3, 256)
    running = {}
    for mode in MODES:
        llm = make_llm(tiny_path, kv_reservation=mode, max_model_len=256, num_kvcache_blocks=48)
        result = serving.drive(llm, requests, [0.0] * len(requests), 512, 0)
        assert result["unfinished"] == 0 and len(result["records"]) == len(requests)
        running[mode] = (result["mean_running"], result["max_running"])
    means = [running[m][0] for m in reversed(MODES)]
    peaks = [running[m][1] for m in reversed(MODES)]
    assert means == sorted(set(means)), running  # strictly increasing: max, pow2, oracle, paged
    assert peaks == sorted(peaks), running
    assert running["max"][1] <= 3  # 48 blocks hold 3 reservations of 16


def ks_exponential(gaps: np.ndarray, rate: float) -> float:
    """Kolmogorov-Smirnov statistic of the gaps against the exponential law of mean 1 / rate."""
    x = np.sort(gaps)
    cdf = 1 - np.exp(-rate * x)
    n = len(x)
    return max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))


def test_poisson_arrivals():
    rate, n = 40.0, 5000
    arrivals = np.array(serving.poisson_arrivals(rate, n, seed=0))
    gaps = np.diff(arrivals, prepend=0.0)
    assert np.all(gaps > 0)
    # the mean of n exponential gaps has standard deviation (1 / rate) / sqrt(n): allow 4 of them
    assert abs(gaps.mean() * rate - 1) < 4 / math.sqrt(n)
    # KS at significance 0.001: the critical value is sqrt(ln(2 / 0.001) / 2 / n) = 1.95 / sqrt(n)
    critical = 1.95 / math.sqrt(n)
    assert ks_exponential(gaps, rate) < critical
    assert ks_exponential(np.full(n, 1 / rate), rate) > critical  # evenly spaced: not Poisson
    assert serving.poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]


def test_traces_match_the_papers_means():
    """Figure 11's means (fitted on another sample), within 4 standard errors of 20,000 requests."""
    stats = {}
    for trace, ((prompt_mean, _), (output_mean, _)) in serving.TRACES.items():
        lengths = np.array(serving.synthesize(trace, 20_000, seed=5, max_model_len=2048))
        prompt, output = lengths[:, 0], lengths[:, 1]
        for values, mean in ((prompt, prompt_mean), (output, output_mean)):
            standard_error = values.std() / math.sqrt(len(values))
            assert abs(values.mean() - mean) < 4 * standard_error, (trace, mean)
        assert prompt.min() >= 2 and prompt.max() <= 1024 and (prompt + output).max() <= 2048
        stats[trace] = prompt.std() / prompt.mean(), output.std() / output.mean()
    assert stats["sharegpt"][0] > stats["alpaca"][0] and stats["sharegpt"][1] > stats["alpaca"][1]
    short = np.array(serving.synthesize("sharegpt", 1000, seed=5, max_model_len=256))
    assert short[:, 0].max() <= 128 and (short.sum(axis=1)).max() <= 256


def test_kv_breakdown():
    """Block size 4, a prompt of 5 tokens, 6 to generate (max_len 11: 10 get K/V), 5 computed."""
    expected = {  # tokens, tail of block 2, blocks 3 (filled later), the blocks never filled
        "oracle": dict(tokens=5, tail=3, reserved_later=4, reserved_never=0),  # 11 slots: 3 blocks
        "pow2": dict(tokens=5, tail=3, reserved_later=4, reserved_never=4),    # 5 + 8: 4 blocks
        "max": dict(tokens=5, tail=3, reserved_later=4, reserved_never=20),    # 32: 8 blocks
    }
    for mode, want in expected.items():
        bm = ReservingBlockManager(10, FakeConfig(mode, 32))
        seq = Sequence(list(range(5)), SamplingParams(max_tokens=6), 4, 32)
        assert bm.allocate(seq)
        seq.num_computed_tokens = 5
        kv = serving.kv_breakdown(bm, [seq])
        assert kv == dict(want, free=4 * bm.num_free_blocks), mode
        assert sum(kv.values()) == 40


def test_drive_metrics_on_a_tiny_run(tiny_path):
    llm = make_llm(tiny_path, kv_reservation="pow2", max_model_len=256, num_kvcache_blocks=48,
                   log_stats=True)
    requests = serving.synthesize("alpaca", 16, 0, 256)
    arrivals = serving.poisson_arrivals(200.0, len(requests), 0)
    result = serving.drive(llm, requests, arrivals, 512, 0)
    recs = result["records"]
    assert len(recs) == 16 and result["unfinished"] == 0
    assert sorted((r["prompt"], r["output"]) for r in recs) == sorted(requests)
    for r in recs:
        assert 0 <= r["queue"] <= r["ttft"] <= r["e2e"]
        assert r["tpot"] is None or r["tpot"] * (r["output"] - 1) <= r["e2e"] - r["ttft"] + 1e-6
    normalized = sum(r["e2e"] / r["output"] for r in recs) / 16
    assert result["normalized_latency"] == pytest.approx(normalized)
    output_tokens = sum(o for _, o in requests)
    assert result["output_tokens_per_s"] * result["wall"] == pytest.approx(output_tokens)
    assert result["wall"] >= arrivals[-1]
    blocks = sorted(num_blocks_for(reserved_tokens("pow2", p, o, 256), 16) for p, o in requests)
    fit = max(k for k in range(len(blocks) + 1) if sum(blocks[:k]) <= 48)  # the smallest ones
    assert 0 < result["mean_running"] <= result["max_running"] <= fit < len(requests)
    total = 48 * 16
    assert len(result["samples"]) == result["steps"]  # sample_every=0: every step
    for sample in result["samples"]:
        fields = dict(zip(serving.SAMPLE_FIELDS, sample))
        assert sum(fields[k] for k in serving.BREAKDOWN) == total  # no block is shared
    assert result["samples"][-1][3] == output_tokens  # tokens generated
    assert llm.block_manager.num_free_blocks == 48


def test_drive_backlog_and_deadline(tiny_path):
    """A saturated run keeps `backlog` requests waiting and aborts what is left at the deadline."""
    llm = make_llm(tiny_path, kv_reservation="max", max_model_len=256, num_kvcache_blocks=48)
    requests = serving.synthesize("alpaca", 1000, 0, 256)
    result = serving.drive(llm, requests, [0.0] * len(requests), 512, 0, backlog=4, deadline=0.3)
    assert 0 < result["unfinished"] < 1000 - len(result["records"]) + 1
    waiting = [s[2] for s in result["samples"]]
    assert max(waiting) <= 4 and max(s[1] for s in result["samples"]) <= 3
    assert llm.is_finished() and llm.block_manager.num_free_blocks == 48
