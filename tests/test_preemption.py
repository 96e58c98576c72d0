"""Preemption by recomputation, chunked prefill and admission control: outputs never change.

Every run is compared with the same model on an unconstrained engine
(a large cache and token budget).
"""
import pytest

from nanovllm import SamplingParams
from tests.helpers import BLOCK_SIZE, make_llm, random_prompts, token_ids

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_path):
    return make_llm(tiny_path, enable_prefix_caching=False)


def expected(reference, prompts, params=PARAMS):
    return token_ids(reference.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_outputs(tiny_path, reference, prefix_caching):
    # 6 requests need up to 6 blocks each at the end; the cache has 8: preemption must happen
    llm = make_llm(tiny_path, num_kvcache_blocks=8, enable_prefix_caching=prefix_caching)
    prompts = random_prompts(6, (10, 50), seed=40)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert token_ids(outputs) == expected(reference, prompts)
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert llm.block_manager.num_free_blocks == 8  # everything given back


def test_seeded_sampling_survives_preemption(tiny_path, reference):
    """A seeded request draws the same tokens when it is preempted and recomputed on the way."""
    llm = make_llm(tiny_path, num_kvcache_blocks=8)
    prompts = random_prompts(6, (10, 50), seed=50)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(6)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert token_ids(outputs) == expected(reference, prompts, params)


def test_preemption_with_shared_prefix(tiny_path, reference):
    """Preempted requests find their own freed blocks again (and those of their siblings)."""
    llm = make_llm(tiny_path, num_kvcache_blocks=10)
    prefix, = random_prompts(1, (40, 40), seed=41)
    prompts = [prefix + tail for tail in random_prompts(5, (1, 20), seed=42)]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert token_ids(outputs) == expected(reference, prompts)


def record_batches(llm) -> list:
    """Make llm.scheduler.schedule record every batch it returns."""
    batches, schedule = [], llm.scheduler.schedule

    def recording():
        batch = schedule()
        has_prefill = batch.num_new_tokens.count(1) < len(batch.seqs)
        batches.append((has_prefill, [s.seq_id for s in batch.seqs], list(batch.num_new_tokens)))
        return batch
    llm.scheduler.schedule = recording
    return batches


@pytest.mark.parametrize("budget", [1, 16, 40])
def test_chunked_prefill_keeps_outputs(tiny_path, reference, budget):
    llm = make_llm(tiny_path, max_num_batched_tokens=budget)
    # clamped to one block at least
    assert llm.config.max_num_batched_tokens == max(budget, BLOCK_SIZE)
    batches = record_batches(llm)
    prompts = random_prompts(1, (100, 100), seed=43) + random_prompts(4, (30, 120), seed=44)
    prompts.append(prompts[0][:64] + prompts[1][:20])  # a prefix hit, then a chunked rest
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert token_ids(outputs) == expected(reference, prompts)
    assert max(sum(n) for _, _, n in batches) <= llm.config.max_num_batched_tokens
    prefills = [sum(n) for has_prefill, _, n in batches if has_prefill]
    assert len(prefills) >= sum(len(p) for p in prompts[:5]) // llm.config.max_num_batched_tokens
    seq_ids = [i for _, ids, n in batches for i, k in zip(ids, n) if k > 1]
    assert len(seq_ids) > len(set(seq_ids))  # some prompt was prefilled over several steps
    assert outputs[-1]["num_cached_tokens"] == 64


def test_chunked_prefill_and_preemption_together(tiny_path, reference):
    llm = make_llm(tiny_path, max_num_batched_tokens=16, num_kvcache_blocks=9)
    prompts = random_prompts(6, (20, 90), seed=48)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert token_ids(outputs) == expected(reference, prompts)


def test_max_model_len_ends_with_length(tiny_path, reference):
    llm = make_llm(tiny_path, max_model_len=64)
    prompt, = random_prompts(1, (50, 50), seed=45)
    out, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                        use_tqdm=False)
    assert out["finish_reason"] == "length"
    assert len(out["token_ids"]) == 64 - 50
    assert out["token_ids"] == expected(reference, [prompt])[0][:14]


def test_request_that_can_never_fit_is_refused(tiny_path, reference):
    llm = make_llm(tiny_path, num_kvcache_blocks=8, max_model_len=256)
    prompts = random_prompts(2, (100, 100), seed=46)
    # 100 + 40 tokens need 9 blocks of 16; the cache has 8
    with pytest.raises(ValueError, match="blocks"):
        llm.generate(prompts[:1], PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="blocks"):
        llm.add_request(prompts[0], PARAMS)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request(random_prompts(1, (257, 257), seed=47)[0], PARAMS)
    assert llm.is_finished()  # nothing was queued
    # the same prompt with fewer new tokens fits (100 + 28 = 128 tokens = 8 blocks), and runs
    fits = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    out, = llm.generate(prompts[:1], fits, use_tqdm=False)
    assert out["token_ids"] == expected(reference, prompts[:1], fits)[0]


def test_max_num_seqs_caps_every_batch(tiny_path, reference):
    llm = make_llm(tiny_path, max_num_seqs=3)
    batches = record_batches(llm)
    prompts = random_prompts(7, (5, 40), seed=49)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert token_ids(outputs) == expected(reference, prompts)
    assert max(len(ids) for _, ids, _ in batches) == 3
    # the first prefill fills the cap
    assert max(len(ids) for is_prefill, ids, _ in batches if is_prefill) == 3
