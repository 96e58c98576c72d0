"""One kind of step: decodes and prefill chunks share steps, and every request gets the tokens it
gets alone.

Greedy tokens of each request, run alone, are the reference; then the same requests run together
with arrivals while others decode, prompts longer than the token budget (chunked over several
steps), preemption by recomputation, prefix-cache hits, n > 1 samples and beam search, in the sdpa
backend and the triton backend (Triton's interpreter on CPU).
"""
import pytest

from nanovllm import SamplingParams
from tests.helpers import make_llm, random_prompts

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["sdpa", "triton"])
def backend(request):
    return request.param


def alone(llm, prompt, params=GREEDY) -> list[list[int]]:
    out, = llm.generate([prompt], params, use_tqdm=False)
    return [o.token_ids for o in out.outputs]


def test_a_decode_is_not_stalled_by_arrivals(tiny_path):
    """A request decodes 40 tokens while 8 short requests arrive, one per step: with one kind of
    step it finishes after its prefill step and 40 decode steps, give or take the last token's read
    (at most 43 steps); prefill-first stops its decodes for every arrival's prefill step."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = random_prompts(8, (5, 12), seed=3)
    long_prompt = random_prompts(1, (30, 30), seed=4)[0]
    steps = {}
    for prefill_first in (False, True):
        llm = make_llm(tiny_path, prefill_first=prefill_first)
        expected = alone(llm, long_prompt, params)[0]
        request = llm.add_request(long_prompt, params)
        count, tokens = 0, None
        while tokens is None:
            if count < len(short):
                llm.add_request(short[count],
                                SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            count += 1
            for out in llm.step():
                if out.request_id == request and out.finished:
                    tokens = out.outputs[0].token_ids
        assert tokens == expected
        while not llm.is_finished():
            llm.step()
        steps[prefill_first] = count
    assert steps[False] <= 43, steps
    assert steps[True] >= steps[False] + 6, steps  # about one stalled step per arrival


def test_arrivals_during_decode_and_chunked_prompts(tiny_path, backend):
    # prompts of up to 90: chunked
    llm = make_llm(tiny_path, attn_backend=backend, max_num_batched_tokens=32)
    prompts = random_prompts(6, (3, 90), seed=11)
    expected = [alone(llm, p) for p in prompts]
    ids = {}
    for i, prompt in enumerate(prompts):  # one arrives per step while the others decode
        ids[llm.add_request(prompt,
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))] = i
        outputs = llm.step()
        llm.held.extend(outputs)
    got = {}
    while not llm.is_finished():
        for out in llm.step():
            if out.finished:
                got[ids[out.request_id]] = [o.token_ids for o in out.outputs]
    assert [got[i] for i in range(len(prompts))] == expected


def test_preemption_prefix_hits_and_samples_in_mixed_steps(tiny_path, backend):
    """A small cache (recomputation), a shared prefix, n = 3 samples of a seeded request and a beam
    search, all in the same steps; each request's tokens equal those it gets alone."""
    llm = make_llm(tiny_path, attn_backend=backend, max_num_batched_tokens=24,
                   num_kvcache_blocks=14)
    base = random_prompts(1, (40, 40), seed=21)[0]
    prompts = [base + [7, 8, 9], base + [1, 2], *random_prompts(3, (10, 60), seed=22)]
    sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    expected = [alone(llm, p) for p in prompts] + [alone(llm, prompts[2], sampled)]
    beams = llm.beam_search([prompts[3]], beam_width=2, max_tokens=6)
    requests = {llm.add_request(p, GREEDY): i for i, p in enumerate(prompts)}
    requests[llm.add_request(prompts[2], sampled)] = len(prompts)
    # its steps serve the others too
    together = llm.beam_search([prompts[3]], beam_width=2, max_tokens=6)
    got = {}
    while len(got) < len(requests):  # the outputs beam search's steps made wait for this step()
        for out in llm.step():
            if out.finished:
                got[requests[out.request_id]] = [o.token_ids for o in out.outputs]
    assert [b["token_ids"] for b in together[0]] == [b["token_ids"] for b in beams[0]]
    assert [got[i] for i in range(len(expected))] == expected
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)
