"""Prefix caching end to end: hits are reported, and outputs never change because of them.

Every comparison is against the same model with enable_prefix_caching=False. Tests use fresh
random prompts, so what earlier tests left in the cache cannot hit.
"""
import pytest

from nanovllm import SamplingParams
from tests.helpers import BLOCK_SIZE, make_llm, random_prompts, token_ids

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def cached(tiny_path):
    return make_llm(tiny_path)


@pytest.fixture(scope="module")
def uncached(tiny_path):
    return make_llm(tiny_path, enable_prefix_caching=False)


def run(llm, prompts):
    return llm.generate(prompts, PARAMS, use_tqdm=False)


def test_shared_prefix_is_served_from_cache(cached, uncached):
    prefix, tail_a, tail_b = random_prompts(3, (100, 100), seed=10)
    a, b = prefix + tail_a[:7], prefix + tail_b[:13]
    out_a, = run(cached, [a])
    out_b, = run(cached, [b])
    assert out_a["num_cached_tokens"] == 0
    # the full blocks of the prefix
    assert out_b["num_cached_tokens"] == len(prefix) // BLOCK_SIZE * BLOCK_SIZE
    assert token_ids([out_a, out_b]) == token_ids(run(uncached, [a, b]))
    assert all(o["num_cached_tokens"] == 0 for o in run(uncached, [a, b]))


def test_generated_tokens_are_cached_too(cached, uncached):
    """Blocks filled during decode are registered: a follow-up turn reuses them."""
    prompt, = random_prompts(1, (40, 40), seed=11)
    first, = run(cached, [prompt])
    follow_up = prompt + first["token_ids"][:-1] + random_prompts(1, (9, 9), seed=12)[0]
    second, = run(cached, [follow_up])
    # the last sampled token was never fed back
    computed = len(prompt) + len(first["token_ids"]) - 1
    assert second["num_cached_tokens"] == computed // BLOCK_SIZE * BLOCK_SIZE
    assert second["token_ids"] == run(uncached, [follow_up])[0]["token_ids"]


@pytest.mark.parametrize("length", [4 * BLOCK_SIZE, 4 * BLOCK_SIZE + 5])
def test_full_prefix_hit(cached, uncached, length):
    """The same prompt twice: every full block hits, the last prompt token is still computed."""
    prompt, = random_prompts(1, (length, length), seed=13 + length)
    first, = run(cached, [prompt])
    second, = run(cached, [prompt])
    assert second["num_cached_tokens"] == min(length // BLOCK_SIZE * BLOCK_SIZE, length - 1)
    assert first["token_ids"] == second["token_ids"] == run(uncached, [prompt])[0]["token_ids"]


def test_shared_prefix_in_one_batch(cached, uncached):
    """Several requests with one prefix in the same batch, then again: hits within
    and across batches."""
    prefix, = random_prompts(1, (70, 70), seed=20)
    prompts = [prefix + tail for tail in random_prompts(4, (1, 30), seed=21)]
    expected = token_ids(run(uncached, prompts))
    assert token_ids(run(cached, prompts)) == expected
    again = run(cached, prompts[::-1])
    assert token_ids(again) == expected[::-1]
    assert all(o["num_cached_tokens"] >= len(prefix) // BLOCK_SIZE * BLOCK_SIZE for o in again)


def test_a_block_hits_only_after_the_same_prefix(tiny_path, uncached):
    """A hit needs the block's tokens at the same place after the same prefix: the same tokens later
    in a prompt, or after another prefix, are not the same K/V."""
    llm = make_llm(tiny_path)
    x, y, z, tail = (p[:BLOCK_SIZE] for p in random_prompts(4, (BLOCK_SIZE, BLOCK_SIZE), seed=30))
    a = x + y + tail             # registers blocks X (position 0) and Y (after X)
    b = x + x + tail             # block 1 holds X's tokens, but after X: not block 0's K/V
    c = y + z + tail             # block 0 holds Y's tokens, but at position 0: not A's block 1
    d = z + tail                 # a different prompt: nothing to hit
    outputs = [run(llm, [p])[0] for p in (a, b, c, d)]
    assert token_ids(outputs) == token_ids(run(uncached, [a, b, c, d]))
    assert outputs[1]["num_cached_tokens"] == BLOCK_SIZE  # block X at position 0 is a true hit
    assert outputs[2]["num_cached_tokens"] == 0
    assert outputs[3]["num_cached_tokens"] == 0


def test_blocks_hit_in_the_step_that_computes_them(tiny_path, uncached):
    """Blocks are registered as their step is scheduled: requests admitted later in that step, or
    in the next one (launched before the first's tokens are read), hit them. Before: only after
    the step was read, so requests admitted meanwhile computed the shared prefix again."""
    llm = make_llm(tiny_path, max_num_batched_tokens=3 * BLOCK_SIZE)  # the prefix takes 2 steps
    prefix, = random_prompts(1, (4 * BLOCK_SIZE, 4 * BLOCK_SIZE), seed=22)
    prompts = [prefix + tail for tail in random_prompts(4, (8, 8), seed=23)]
    outputs = run(llm, prompts)
    assert token_ids(outputs) == token_ids(run(uncached, prompts))
    assert [o["num_cached_tokens"] for o in outputs] == [0] + [len(prefix)] * 3


def test_a_step_that_fails_to_launch_leaves_no_blocks_in_the_cache(tiny_path, uncached,
                                                                   monkeypatch):
    """Its blocks were registered when it was scheduled, but their K/V were never computed: a later
    request must not hit them."""
    llm = make_llm(tiny_path)
    prompt, = random_prompts(1, (3 * BLOCK_SIZE, 3 * BLOCK_SIZE), seed=24)
    run_step = llm.model_runner.run

    def fail(batch):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(llm.model_runner, "run", fail)
    with pytest.raises(RuntimeError, match="launch failed"):
        run(llm, [prompt])
    monkeypatch.setattr(llm.model_runner, "run", run_step)
    out, = run(llm, [prompt])
    assert out["num_cached_tokens"] == 0
    assert out["token_ids"] == run(uncached, [prompt])[0]["token_ids"]
