"""Requests in flight as vLLM shows them. RequestOutputs holding
CompletionOutputs (and nano-vllm's `out["text"]`), streaming from step() and llm.stream with
incremental detokenization (multi-byte characters, stop strings), llm.chat, per-request metrics,
llm.get_stats() and the progress bar's rates. Before these, generate returned dicts, step()
returned only finished requests, and none of stream, chat, metrics or get_stats existed.
"""
import random
from itertools import accumulate, pairwise
from types import SimpleNamespace

import pytest

import nanovllm.llm
from nanovllm import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams
from nanovllm.core.sequence import Sequence
from nanovllm.engine.streaming import Stream
from tests.helpers import FRANCE, FRANCE_ANSWER, chat, drain, make_llm, random_prompts

JAPANESE = "How do you say 'thank you' in Japanese? Answer in Japanese script."  # greedy: kana
STATS_KEYS = {"num_running", "num_waiting", "num_swapped", "kv_blocks_used", "kv_blocks_total",
              "prefix_cache_hit_rate", "num_preemptions", "num_swapped_out", "prompt_tokens",
              "cached_prompt_tokens", "generation_tokens"}
TOKEN_KEYS = {"prefix_cache_hit_rate", "prompt_tokens", "cached_prompt_tokens", "generation_tokens"}


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 24, **kwargs})


def by_request(outputs) -> dict:
    """request id -> its outputs, in the order they came."""
    grouped = {}
    for out in outputs:
        grouped.setdefault(out.request_id, []).append(out)
    return grouped


@pytest.fixture(scope="module")
def llm(smol_llm):
    return smol_llm


@pytest.fixture(scope="module")
def france(llm) -> str:
    return chat(llm.tokenizer, FRANCE)


@pytest.fixture(scope="module")
def japanese(llm) -> str:
    return chat(llm.tokenizer, JAPANESE)


@pytest.fixture
def tiny(tiny_path):
    """A fresh random engine that keeps request timings and token counts: they count from zero."""
    return make_llm(tiny_path, log_stats=True)


# 1. vLLM's output shape ------------------------------------------------------------------------

def test_outputs_are_shaped_like_vllms(llm, france):
    out, = llm.generate([france], greedy(), use_tqdm=False)
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    assert out.prompt == france and out.prompt_token_ids == llm.tokenizer.encode(france)
    assert out.finished and isinstance(out.num_cached_tokens, int)
    assert out.metrics is None  # timings come with log_stats=True (test_request_metrics)
    sample = out.outputs[0]
    assert sample.index == 0 and sample.text == FRANCE_ANSWER
    assert sample.finish_reason == "stop" and sample.stop_reason is None  # ended by end-of-sequence
    assert sample.token_ids[-1] in llm.output_processor.eos_token_ids
    assert sample.logprobs is None and sample.cumulative_logprob is None
    # nano-vllm's dict access reads the first sample, then the request
    assert out["text"] == sample.text and out["token_ids"] == sample.token_ids
    assert out["finish_reason"] == "stop" and out["prompt_token_ids"] == out.prompt_token_ids
    assert out["request_id"] == out.request_id and out["outputs"] == out.outputs


def test_vllm_prompt_dicts(llm, france):
    ids = llm.tokenizer.encode(france)
    by_ids, by_text = llm.generate([{"prompt_token_ids": ids}, {"prompt": france}], greedy(),
                                   use_tqdm=False)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_text.prompt == france and by_text.prompt_token_ids == ids
    assert by_ids.outputs[0].text == by_text.outputs[0].text == FRANCE_ANSWER


def test_stop_reason_samples_and_logprobs(llm, france):
    answer = llm.generate([france], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    by_string, by_token = llm.generate([france, france], [greedy(stop=["Paris"]),
                                                          greedy(stop_token_ids=[answer[2]])],
                                       use_tqdm=False)
    by_string, by_token = by_string.outputs[0], by_token.outputs[0]
    assert by_string.stop_reason == "Paris" and by_string.finish_reason == "stop"
    assert by_token.stop_reason == answer[2] and by_token.token_ids == answer[:3]
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6, logprobs=1)
    out, = llm.generate([france], params, use_tqdm=False)
    assert [s.index for s in out.outputs] == [0, 1]
    for sample in out.outputs:
        assert len(sample.logprobs) == len(sample.token_ids)
        chosen = sum(lp[t] for lp, t in zip(sample.logprobs, sample.token_ids))
        assert sample.cumulative_logprob == pytest.approx(chosen)


# 2. streaming ----------------------------------------------------------------------------------

def test_step_reports_every_request_that_got_tokens(llm, france):
    """Cumulative requests report at every token, final ones once at the end, delta ones only
    what is new; a generate() of the same prompts gives the same final outputs."""
    prompts = [france, chat(llm.tokenizer, "Name three colors."), chat(llm.tokenizer, "Say hello.")]
    kinds = ["cumulative", "final", "delta"]
    params = [greedy(max_tokens=n, ignore_eos=True, output_kind=k)
              for n, k in zip((5, 9, 7), kinds)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = []
    while not llm.is_finished():
        steps.append(llm.step())
    for outputs in steps:  # one output per request per step at most
        assert len({o.request_id for o in outputs}) == len(outputs)
    got = by_request([o for outputs in steps for o in outputs])
    cumulative, final, delta = (got[i] for i in ids)
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5]
    assert [o.finished for o in cumulative] == [False] * 4 + [True]
    assert all(b.outputs[0].text.startswith(a.outputs[0].text) for a, b in pairwise(cumulative))
    assert len(final) == 1 and final[0].finished
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 7
    for out, ref in zip((cumulative[-1], final[-1]), expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].text == ref.outputs[0].text
    assert [t for o in delta for t in o.outputs[0].token_ids] == expected[2].outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in delta) == expected[2].outputs[0].text


def test_delta_text_of_multibyte_characters(llm, japanese):
    """The greedy answer holds kana whose UTF-8 bytes span two tokens: no piece holds half of one
    (U+FFFD), and the pieces add up to the final text exactly."""
    expected, = llm.generate([japanese], greedy(), use_tqdm=False)
    tokens = expected.outputs[0].token_ids
    assert any("\ufffd" in llm.tokenizer.decode([t]) for t in tokens)  # a character split in two
    assert any(ord(c) > 0x3000 for c in expected.outputs[0].text)
    pieces = [out.outputs[0].text for out in llm.stream([japanese], greedy(output_kind="delta"))]
    assert "".join(pieces) == expected.outputs[0].text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_multibyte_stop_string(llm, japanese):
    """A stop string of kana, each character two tokens: the streamed text never holds half a
    character or a part of the stop string, and ends before the stop string."""
    free, = llm.generate([japanese], greedy(), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[3:5]
    assert all(ord(c) > 0x3000 for c in stop)
    streamed = llm.stream([japanese], greedy(stop=[stop], output_kind="delta"))
    pieces = [out.outputs[0].text for out in streamed]
    assert "".join(pieces) == text[:text.index(stop)]
    assert not any("\ufffd" in piece for piece in pieces)


def test_delta_samples_and_logprobs(tiny):
    """n = 2 samples streamed as deltas: each sample's tokens and log-probabilities add up to what
    a generate of the same seeded request returns."""
    prompt = random_prompts(1, (12, 12), seed=85)[0]
    params = {"n": 2, "temperature": 1.0, "seed": 9, "max_tokens": 10, "ignore_eos": True,
              "logprobs": 2}
    expected, = tiny.generate([prompt], SamplingParams(**params), use_tqdm=False)
    streamed = list(tiny.stream([prompt], SamplingParams(**params, output_kind="delta")))
    for index, ref in enumerate(expected.outputs):
        pieces = [out.outputs[index] for out in streamed]
        assert [t for p in pieces for t in p.token_ids] == ref.token_ids
        assert [lp for p in pieces for lp in p.logprobs] == ref.logprobs
        assert pieces[-1].cumulative_logprob == pytest.approx(ref.cumulative_logprob)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_streaming_through_preemption(tiny_path, tiny, mode):
    """Requests preempted on the way (recomputed, or swapped out and back) report one more token
    at each output, never one twice, and end with the tokens of an unconstrained run."""
    llm = make_llm(tiny_path, num_kvcache_blocks=8, preemption_mode=mode, swap_space=0.001)
    prompts = random_prompts(6, (10, 50), seed=40)
    params = greedy(max_tokens=40, ignore_eos=True)
    expected = tiny.generate(prompts, params, use_tqdm=False)
    streamed = by_request(llm.stream(prompts, params))
    assert llm.get_stats()["num_preemptions"] > 0
    for outputs, ref in zip(streamed.values(), expected):
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 41))
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == ref.outputs[0].token_ids


def test_stream_class_on_an_emoji_split_over_tokens(llm):
    """Stream alone, fed an emoji of two tokens at a time between ASCII words, one token a step."""
    decode = llm.output_processor.decode
    text = "I am \U0001F642 and \U0001F642\U0001F642 ok"
    tokens = llm.tokenizer.encode(text)
    assert len(tokens) > len(text.split())  # the emojis take several tokens each
    seq = Sequence([1, 2, 3], SamplingParams(output_kind="delta", max_tokens=len(tokens)), 16)
    stream, pieces = Stream(decode), []
    for i, token in enumerate(tokens):
        seq.token_ids.append(token)
        final = decode(seq.completion_token_ids) if i == len(tokens) - 1 else None
        piece, new_tokens, before = stream.report(seq, final)
        assert new_tokens == [token] and before == i
        pieces.append(piece)
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # a first half of an emoji waited for its second


@pytest.mark.parametrize("output_kind", ["delta", "cumulative"])
def test_a_stop_string_is_never_partly_emitted(llm, france, output_kind):
    """The stop string spans several tokens and is longer than the text before it: what was
    streamed is at every point a prefix of the final text (which ends before the stop string),
    and never shrinks. Before: the held-back end was cut with a negative index while the text was
    shorter than the stop string, so deltas repeated text ("The capiThe cap...")."""
    stop = "France is Paris"
    assert stop in FRANCE_ANSWER
    outputs = list(llm.stream([france], greedy(stop=[stop], output_kind=output_kind)))
    final = FRANCE_ANSWER[:FRANCE_ANSWER.index(stop)]
    streamed = ""
    for out in outputs:
        before = streamed
        streamed = streamed + out.outputs[0].text if output_kind == "delta" else out.outputs[0].text
        assert final.startswith(streamed) and streamed.startswith(before), streamed
    assert streamed == final and outputs[-1].finished and outputs[-1].outputs[0].stop_reason == stop
    assert len(outputs) > 3  # it streamed


@pytest.mark.parametrize("output_kind", ["delta", "cumulative"])
def test_stop_strings_cut_anywhere_in_the_text(llm, output_kind):
    """Stop strings of 1 to 14 characters taken at random places of a greedy answer, streamed in
    one batch: each request's streamed text adds up to (or grows into) the text before the first
    occurrence of its stop string."""
    prompt = chat(llm.tokenizer, "Name three colors of the rainbow.")
    text = llm.generate([prompt], greedy(max_tokens=40), use_tqdm=False)[0].outputs[0].text
    rng = random.Random(0)
    starts_and_lengths = [(rng.randrange(len(text) - 14), rng.randint(1, 14)) for _ in range(10)]
    stops = [text[i:i + n] for i, n in starts_and_lengths]
    params = [greedy(max_tokens=40, stop=[stop], output_kind=output_kind) for stop in stops]
    streamed = by_request(llm.stream([prompt] * len(stops), params))
    for stop, outputs in zip(stops, streamed.values()):
        texts = [out.outputs[0].text for out in outputs]
        if output_kind == "delta":
            texts = list(accumulate(texts))
        assert all(b.startswith(a) for a, b in pairwise(texts))
        assert texts[-1] == text[:text.index(stop)] and outputs[-1].outputs[0].stop_reason == stop


def test_llm_stream_yields_growing_outputs_ending_finished(llm, france, japanese):
    prompts = [france, japanese]
    expected = llm.generate(prompts, greedy(), use_tqdm=False)
    streamed = list(llm.stream(prompts, greedy()))
    got = by_request(streamed)
    assert len(got) == 2
    for outputs, ref in zip(got.values(), expected):
        counts = [len(o.outputs[0].token_ids) for o in outputs]
        assert counts == list(range(1, len(counts) + 1))
        texts = [o.outputs[0].text for o in outputs]
        assert all(b.startswith(a) for a, b in pairwise(texts))
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].outputs[0].text == ref.outputs[0].text
        assert outputs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.is_finished()


# 3. chat ---------------------------------------------------------------------------------------

def test_chat_one_conversation_and_a_list(llm):
    question = [{"role": "user", "content": FRANCE}]
    out, = llm.chat(question, greedy(), use_tqdm=False)
    assert out.outputs[0].text == FRANCE_ANSWER and out.prompt == chat(llm.tokenizer, FRANCE)
    other = [{"role": "user", "content": "Name three colors."}]
    both = llm.chat([question, other], greedy(), use_tqdm=False)
    expected, = llm.generate([chat(llm.tokenizer, "Name three colors.")], greedy(), use_tqdm=False)
    assert [o.outputs[0].text for o in both] == [FRANCE_ANSWER, expected.outputs[0].text]


# 4. sampling: min_tokens and skip_special_tokens -----------------------------------------------

def test_skip_special_tokens(llm, france):
    answer, = llm.generate([france], greedy(), use_tqdm=False)
    eos = llm.tokenizer.decode(answer.outputs[0].token_ids[-1:])
    n = len(answer.outputs[0].token_ids) + 3
    params = [greedy(max_tokens=n, ignore_eos=True, skip_special_tokens=s) for s in (False, True)]
    kept, skipped = llm.generate([france, france], params, use_tqdm=False)
    assert kept.outputs[0].token_ids == skipped.outputs[0].token_ids
    assert kept.outputs[0].text.startswith(FRANCE_ANSWER + eos) and eos.startswith("<|")
    assert skipped.outputs[0].text.startswith(FRANCE_ANSWER) and eos not in skipped.outputs[0].text
    streamed = llm.stream([france], greedy(max_tokens=n, ignore_eos=True, skip_special_tokens=False,
                                           output_kind="delta"))
    assert "".join(o.outputs[0].text for o in streamed) == kept.outputs[0].text


def test_min_tokens_holds_back_end_of_sequence(llm, france):
    answer, = llm.generate([france], greedy(), use_tqdm=False)
    n = len(answer.outputs[0].token_ids)  # ends with end-of-sequence
    out, = llm.generate([france], greedy(min_tokens=n + 3, max_tokens=n + 6), use_tqdm=False)
    tokens, eos = out.outputs[0].token_ids, llm.output_processor.eos_token_ids
    assert len(tokens) >= n + 3 and not eos & set(tokens[:n + 2])
    assert tokens[:n - 1] == answer.outputs[0].token_ids[:-1]


# 5. metrics, statistics, progress bar ----------------------------------------------------------

def check_metrics(m: RequestMetrics, num_tokens: int):
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_output_tokens == num_tokens
    assert m.queue_time == m.first_scheduled_time - m.arrival_time >= 0
    assert m.time_to_first_token == m.first_token_time - m.arrival_time >= m.queue_time
    assert m.e2e_latency == m.finished_time - m.arrival_time >= m.time_to_first_token
    tpot = m.time_per_output_token
    assert tpot == pytest.approx((m.last_token_time - m.first_token_time) / (num_tokens - 1))
    assert tpot >= 0


def test_request_metrics(tiny_path):
    """With one sequence at a time the second request waits for the first: its queue time covers
    the first one's whole run (timings are kept with log_stats=True, as in vLLM v1)."""
    llm = make_llm(tiny_path, max_num_seqs=1, log_stats=True)
    prompts = random_prompts(2, (10, 30), seed=80)
    params = [greedy(max_tokens=n, ignore_eos=True) for n in (12, 7)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        check_metrics(out.metrics, len(out.outputs[0].token_ids))
    first, second = (o.metrics for o in outputs)
    assert second.first_scheduled_time >= first.finished_time


def test_without_log_stats_there_are_no_timings_or_token_counts(tiny_path):
    llm = make_llm(tiny_path)
    out, = llm.generate(random_prompts(1, (10, 10), seed=81), greedy(max_tokens=3), use_tqdm=False)
    assert out.metrics is None and not llm.observers
    assert set(llm.get_stats()) == STATS_KEYS - TOKEN_KEYS


def test_get_stats_counts_blocks_tokens_and_prefix_hits(tiny):
    stats = tiny.get_stats()
    assert set(stats) == STATS_KEYS
    assert stats["kv_blocks_total"] == tiny.config.num_kvcache_blocks == 256
    assert stats["kv_blocks_used"] == stats["prompt_tokens"] == stats["generation_tokens"] == 0
    long, short = random_prompts(2, (40, 40), seed=81)[0], random_prompts(1, (20, 20), seed=82)[0]
    params = greedy(max_tokens=10, ignore_eos=True)
    tiny.add_request(long, params)
    tiny.add_request(short, params)
    stats = tiny.get_stats()
    assert (stats["num_waiting"], stats["num_running"], stats["kv_blocks_used"]) == (2, 0, 0)
    tiny.step()  # both prompts prefilled: 3 + 2 blocks of 16
    stats = tiny.get_stats()
    assert (stats["num_waiting"], stats["num_running"], stats["kv_blocks_used"]) == (0, 2, 5)
    outputs = drain(tiny)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
    stats = tiny.get_stats()
    assert generated == 20 and stats["generation_tokens"] == 20 and stats["prompt_tokens"] == 60
    assert stats["kv_blocks_used"] == stats["num_running"] == 0
    assert stats["prefix_cache_hit_rate"] == 0
    out, = tiny.generate([long], params, use_tqdm=False)  # two full blocks from the prefix cache
    stats = tiny.get_stats()
    assert out.num_cached_tokens == stats["cached_prompt_tokens"] == 32
    assert stats["prompt_tokens"] == 100
    assert stats["prefix_cache_hit_rate"] == pytest.approx(32 / 100)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_get_stats_counts_preemptions(tiny_path, mode):
    """A cache of 8 blocks for 6 requests: preemptions, each prompt counted once even when it is
    computed again, every generated token counted."""
    llm = make_llm(tiny_path, num_kvcache_blocks=8, preemption_mode=mode, swap_space=0.001,
                   log_stats=True)
    prompts = random_prompts(6, (10, 50), seed=40)
    for prompt in prompts:
        llm.add_request(prompt, greedy(max_tokens=40, ignore_eos=True))
    swapped_seen = 0
    while not llm.is_finished():
        llm.step()
        stats = llm.get_stats()
        assert stats["kv_blocks_used"] <= stats["kv_blocks_total"] == 8
        swap = llm.scheduler.swap
        assert stats["num_swapped"] == (sum(map(len, swap.swapped)) if mode == "swap" else 0)
        swapped_seen = max(swapped_seen, stats["num_swapped"])
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prompt_tokens"] == sum(map(len, prompts))
    assert stats["generation_tokens"] == 6 * 40 and stats["kv_blocks_used"] == 0
    if mode == "swap":
        assert 0 < stats["num_swapped_out"] <= stats["num_preemptions"] and swapped_seen > 0
    else:
        assert stats["num_swapped_out"] == 0 and swapped_seen == 0


def test_progress_bar_rates_are_tokens_over_total_time(tiny, monkeypatch):
    """The postfix shows prompt and generated tokens so far over the time since generate began
    (a fake clock: 2 s per reading). Before: each rate divided the tokens of the step just
    launched by the time of the step before."""
    bars, clock = [], iter(range(1000, 10_000, 2))

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.postfixes = total, 0, []
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_postfix_str(self, text, refresh=True):
            self.postfixes.append(text)

        def update(self, n):
            self.n += n
    monkeypatch.setattr(nanovllm.llm, "tqdm", Bar)
    fake_time = SimpleNamespace(perf_counter=lambda: float(next(clock)))
    monkeypatch.setattr(nanovllm.llm, "time", fake_time)
    # an earlier generate's tokens do not count
    tiny.generate(random_prompts(2, (30, 30), seed=83), greedy(max_tokens=4, ignore_eos=True))
    prompts = random_prompts(3, (20, 60), seed=84)
    outputs = tiny.generate(prompts, [greedy(max_tokens=n, ignore_eos=True) for n in (5, 17, 30)])
    bar = bars[-1]
    assert bar.total == bar.n == 3 and len(bar.postfixes) == 3
    seconds = 2 * len(bar.postfixes)  # one clock reading at the start, one per finished request
    prompt_tokens = sum(map(len, prompts))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == 52
    assert bar.postfixes[-1] == (f"input: {prompt_tokens / seconds:.0f} tok/s, "
                                 f"output: {generated / seconds:.0f} tok/s")
    # vLLM's rates count the requests done: the first to finish is the one of 5 tokens
    assert bar.postfixes[0] == f"input: {len(prompts[0]) / 2:.0f} tok/s, output: {5 / 2:.0f} tok/s"
