"""One request never hurts another: every value of a request that lands in a step's tensors is
bounded when the request is added (SamplingParams, nanovllm/engine/input_processor.py), so a batch
of valid requests, however extreme, never fails a step, and a greedy or seeded request gets the
same tokens beside any others as alone. Also: tiny temperatures sample greedily, a text far too
long is refused before it is tokenized, and a shut-down engine takes no request."""
import pytest

from nanovllm import SamplingParams
from nanovllm.sampling_params import FLOAT32_MAX, SAMPLING_EPS
from tests.helpers import make_llm

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

VOCAB = 512  # tests/helpers.py's random models
MAX_MODEL_LEN = 40


@pytest.fixture(scope="module")
def llm(tiny_path, smollm2_dir):
    """The random Qwen3 with SmolLM2's tokenizer (its ids below 512 decode, so stop strings work),
    run ahead as on CUDA (make_llm's default)."""
    return make_llm(tiny_path, skip_tokenizer_init=False, tokenizer=smollm2_dir,
                    max_model_len=MAX_MODEL_LEN, max_num_seqs=32)


def run(llm, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """Queue the requests, step until all end; per request, each sample's (tokens, finish
    reason), put together from its outputs whatever its output_kind."""
    ids = [llm.add_request(prompt, params) for prompt, params in requests]
    samples = {request_id: {} for request_id in ids}
    for _ in range(10_000):
        if llm.is_finished():
            break
        for out in llm.step():
            for sample in out.outputs:
                tokens, _ = samples[out.request_id].get(sample.index, ([], None))
                params = requests[ids.index(out.request_id)][1]
                tokens = tokens + sample.token_ids if params.output_kind == "delta" \
                    else sample.token_ids
                samples[out.request_id][sample.index] = (tokens, sample.finish_reason)
    assert llm.is_finished() and not llm.requests
    return [samples[request_id] for request_id in ids]


EXTREME_SEEDS = [-2**63, -1, 0, 2**63 - 1, 2**63, 2**64 - 1]
TEMPERATURES = st.one_of(st.sampled_from([0.0, 1e-38, 1e-30, 1e-6, SAMPLING_EPS, 1e3,
                                          FLOAT32_MAX]), st.floats(0, 2))
PARAMS = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 4),
    "temperature": TEMPERATURES,
    "top_p": st.one_of(st.sampled_from([5e-324, 1e-30, 1.0]), st.floats(1e-3, 1)),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB]), st.integers(1, VOCAB)),
    "min_p": st.one_of(st.sampled_from([0.0, 5e-324, 1.0]), st.floats(0, 1)),
    "presence_penalty": st.one_of(st.sampled_from([-2.0, 2.0]), st.floats(-2, 2)),
    "frequency_penalty": st.one_of(st.sampled_from([-2.0, 2.0]), st.floats(-2, 2)),
    "repetition_penalty": st.one_of(st.sampled_from([1e-3, 1e3]), st.floats(1e-3, 1e3)),
    "seed": st.one_of(st.none(), st.sampled_from(EXTREME_SEEDS), st.integers(-2**63, 2**64 - 1)),
    "stop": st.lists(st.sampled_from(["e", " t", "a", "\n", "the", "?"]), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "max_tokens": st.one_of(st.integers(1, 12), st.just(2**62)),
    "logprobs": st.one_of(st.none(), st.sampled_from([0, 1, 20, VOCAB])),
    "skip_special_tokens": st.booleans(),
    "output_kind": st.sampled_from(["cumulative", "delta", "final"]),
})
PROMPTS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)


@st.composite
def requests(draw):
    """A valid request: a prompt and SamplingParams with values up to their bounds (min_tokens
    up to max_tokens)."""
    fields = draw(PARAMS)
    max_tokens = fields.get("max_tokens", 16)
    fields["min_tokens"] = draw(st.integers(0, min(max_tokens, 6)) | st.just(max_tokens))
    return draw(PROMPTS), SamplingParams(**fields)


def test_no_request_fails_or_changes_another(llm):
    """Mixed batches of valid requests at their extremes: no step fails, and each greedy or
    seeded request gets the tokens (and finish reasons) it gets alone."""
    drawn = {"batches": 0, "requests": 0, "compared": 0}

    @hypothesis.settings(max_examples=100, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.lists(requests(), min_size=2, max_size=5))
    def check(batch):
        drawn["batches"] += 1
        drawn["requests"] += len(batch)
        together = run(llm, batch)
        for request, samples in zip(batch, together):
            params = request[1]
            assert sorted(samples) == list(range(params.n))
            assert all(finish is not None for _, finish in samples.values())
            if params.greedy or params.seed is not None:
                drawn["compared"] += 1
                assert run(llm, [request]) == [samples], params
    check()
    print(f"isolation: {drawn['batches']} batches, {drawn['requests']} requests, "
          f"{drawn['compared']} compared with their run alone")
    assert drawn["batches"] == 100 and drawn["compared"] >= 100


def test_top_k_past_the_vocabulary_is_refused_and_runs_nothing(llm):
    """top_k=2**63 is refused when added: accepted, it would overflow the step's top_k tensor and
    fail every request of the step."""
    requests = [SamplingParams(top_k=2**63, temperature=1), SamplingParams(top_k=5, temperature=1)]
    with pytest.raises(ValueError, match=rf"^top_k=9223372036854775808 must be .*\[1, {VOCAB}\]"):
        llm.generate([[1, 2], [3, 4]], requests, use_tqdm=False)
    assert llm.is_finished() and not llm.requests
    with pytest.raises(ValueError, match=r"^top_k=513 "):
        llm.add_request([1, 2], SamplingParams(top_k=VOCAB + 1))
    out = llm.generate([[1, 2], [3, 4]], [SamplingParams(top_k=VOCAB, temperature=1, seed=1),
                                          SamplingParams(top_k=5, temperature=1)], use_tqdm=False)
    assert all(o.finished and o.outputs[0].token_ids for o in out)  # top_k=VOCAB is allowed


@pytest.mark.parametrize("fields, message", [
    ({"seed": 2**64}, r"^seed=18446744073709551616 must be None or an integer in \[-2\*\*63"),
    ({"seed": -2**63 - 1}, r"^seed=-9223372036854775809 must be None or an integer"),
    ({"temperature": 1e39}, r"^temperature=1e\+39 must be a number in \[0, 3.4e38\]"),
    ({"repetition_penalty": 1e-300}, r"^repetition_penalty=1e-300 must be a number in \[0.001"),
    ({"repetition_penalty": 1e300}, r"^repetition_penalty=1e\+300 must be a number in \[0.001"),
])
def test_values_past_their_bounds_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_stop_token_ids_past_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match=rf"^stop_token_ids=\[{VOCAB}\] are outside"):
        llm.add_request([1, 2], SamplingParams(stop_token_ids=[3, VOCAB]))
    assert not llm.requests


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, SAMPLING_EPS / 2])
def test_temperatures_below_epsilon_are_greedy(llm, temperature):
    """A temperature of 1e-38 samples greedily: dividing the logits by it would give infinities,
    and the softmax's NaNs would draw token 0."""
    prompts = [[5, 17, 33], [100, 7]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    tiny = llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=8,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


def test_a_text_far_too_long_is_refused_before_it_is_tokenized(llm, monkeypatch):
    limit = llm.input_processor.max_prompt_chars
    assert limit == MAX_MODEL_LEN * max(map(len, llm.tokenizer.get_vocab()))
    calls = []
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    with pytest.raises(ValueError, match=rf"^prompt has {limit + 1} characters: more than "
                                         rf"max_model_len={MAX_MODEL_LEN} tokens can hold"):
        llm.add_request("x" * (limit + 1), SamplingParams())
    assert calls == [] and not llm.requests
    llm.abort_request(llm.add_request("x" * limit, SamplingParams()))  # tokenized: it may fit
    assert len(calls) == 1


def test_a_shut_down_engine_takes_no_request(tiny_path):
    """add_request and generate after shutdown() raise and queue nothing (a queued request would
    wait for a step() that can only raise)."""
    llm = make_llm(tiny_path, num_kvcache_blocks=16)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.add_request([1, 2, 3], SamplingParams())
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(), use_tqdm=False)
    assert not llm.requests and not llm.scheduler.waiting
