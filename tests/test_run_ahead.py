"""Run-ahead (async_scheduling) against the plain loop: the same tokens, whatever shares the steps.

On CPU the engine reads each step's tokens as soon as it returns (async_scheduling=False, the CPU
default); on CUDA it launches the next step first (nanovllm/worker/run_ahead.py). Most engine tests
run the run-ahead path (tests/helpers.py's make_llm); here the plain loop runs the same mixed
workload (arrivals during decode, chunked prompts, preemption and recomputation, prefix hits, n > 1
with seeds, log-probabilities, beam search) and must give the same outputs as run-ahead by one,
two (the default) and three steps, in fewer steps.
"""
import pytest

from nanovllm import SamplingParams
from nanovllm.config import Config
from tests.helpers import make_llm, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(llm, requests: list) -> tuple[dict, int]:
    """Requests (prompt, params) arriving one per step; each one's samples and the steps taken."""
    ids, results, steps = {}, {}, 0
    while len(results) < len(requests):
        if steps < len(requests):
            prompt, params = requests[steps]
            ids[llm.add_request(prompt, params)] = steps
        steps += 1
        for out in llm.step():
            if out.finished:
                results[ids[out.request_id]] = [(o.token_ids, o.logprobs) for o in out.outputs]
    assert llm.is_finished() and llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)
    return results, steps


def same(a: dict, b: dict):
    """The same tokens, and log-probabilities of the same tokens within float32 rounding (the
    batches differ)."""
    assert a.keys() == b.keys()
    for i in a:
        assert [tokens for tokens, _ in a[i]] == [tokens for tokens, _ in b[i]], i
        for (_, x), (_, y) in zip(a[i], b[i]):
            assert (x is None) == (y is None)
            for dx, dy in zip(x or [], y or []):
                assert (dx.keys() == dy.keys()
                        and list(dx.values()) == pytest.approx(list(dy.values()), abs=1e-4))


def test_cpu_defaults_to_the_plain_loop(tiny_path):
    assert Config(tiny_path, device="cpu").async_scheduling is False
    assert Config(tiny_path, device="cpu", async_scheduling=True).async_scheduling is True


def test_the_plain_loop_gives_the_run_ahead_tokens(tiny_path):
    shared = random_prompts(1, (40, 40), seed=5)[0]
    prompts = random_prompts(6, (3, 90), seed=11) + [shared + [1, 2], shared + [3]]
    requests = [(p, GREEDY) for p in prompts]
    requests.append((prompts[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10,
                                                ignore_eos=True)))
    requests.append((prompts[1], SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                ignore_eos=True)))
    results = {}
    for ahead in (0, 1, 2, 3):  # 24 blocks of 16 tokens and a 32-token budget: chunks, preemption
        llm = make_llm(tiny_path, async_scheduling=ahead > 0, run_ahead_steps=max(ahead, 1),
                       num_kvcache_blocks=24, max_num_batched_tokens=32)
        results[ahead] = run(llm, requests)
        assert llm.scheduler.num_preemptions > 0
        beams = llm.beam_search([prompts[2]], beam_width=3, max_tokens=6)
        results[ahead] += ([b["token_ids"] for b in beams[0]], [b["score"] for b in beams[0]])
    for ahead in (1, 2, 3):
        same(results[0][0], results[ahead][0])
        assert results[0][2] == results[ahead][2]
        assert results[0][3] == pytest.approx(results[ahead][3], abs=1e-4)
        assert results[0][1] <= results[ahead][1]  # no step waits for the one before's tokens
