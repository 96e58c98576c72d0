"""Parallel sampling (n > 1): the prompt's blocks are shared by fork, a shared last block is copied
on write, and every sample's KV stays its own (checked through its log-probabilities against
transformers)."""
import random
from dataclasses import replace

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sharing import fork
from nanovllm.core.sequence import Sequence
from tests.sharing_helpers import BLOCK_SIZE, build_tiny_llama, hf_logprobs, make_llm

BS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(engine, transformers model) of one random tiny Llama."""
    path = str(tmp_path_factory.mktemp("tiny"))
    hf_model = build_tiny_llama(path)
    return make_llm(path), hf_model


def prompts(n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    seq = Sequence(tokens, SamplingParams(), BS)
    assert bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    return seq


# ---------- block manager: fork and copy-on-write ----------

def test_fork_shares_every_block_and_raises_ref_counts():
    bm = BlockManager(10, BS)
    parent = computed(bm, list(range(10)))  # 2 full blocks and a partial one
    children = [fork(parent, bm) for _ in range(2)]
    assert all(c.block_table == parent.block_table for c in children)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [3, 3, 3]
    assert bm.num_free_blocks == 7  # nothing copied
    assert parent.group == [parent, *children] and [c.sample_index for c in children] == [1, 2]
    for seq in [parent, *children]:
        bm.free(seq)
    assert bm.num_free_blocks == 10


def test_copy_on_write_copies_a_shared_partial_block_once_per_extra_writer():
    bm = BlockManager(10, BS)
    parent = computed(bm, list(range(10)))
    child = fork(parent, bm)
    shared = parent.block_table[2]
    for seq, token in ((parent, 100), (child, 200)):
        seq.token_ids.append(token)  # both write token 10 into the shared block 2
    assert bm.num_blocks_to_append([parent, child]) == 1  # the last writer keeps the block
    assert bm.append_blocks(child) == [(shared, child.block_table[2])]
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != shared
    assert bm.blocks[shared].ref_count == 1
    # no one else holds it now
    assert bm.append_blocks(parent) == [] and parent.block_table[2] == shared
    assert [bm.blocks[b].ref_count for b in parent.block_table[:2]] == [2, 2]


def test_a_full_shared_block_is_never_copied():
    bm = BlockManager(10, BS)
    parent = computed(bm, list(range(8)))  # exactly 2 full blocks
    child = fork(parent, bm)
    child.token_ids.append(1)
    # a new block, no copy
    assert bm.num_blocks_to_append([child]) == 1 and bm.append_blocks(child) == []
    assert child.block_table[:2] == parent.block_table


# ---------- the engine ----------

def test_prompt_blocks_are_shared_and_the_partial_block_copied_on_write(model):
    llm, _ = model
    prompt = prompts(1, (40, 40), seed=1)[0]  # blocks: 16 + 16 + 8 tokens
    llm.add_request(prompt,
                    SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True))
    free = llm.block_manager.num_free_blocks
    llm.step()  # prefill once, fork 3 children
    samples = list(llm.scheduler.running)
    assert len(samples) == 4 and len({id(s.group) for s in samples}) == 1
    table = list(samples[0].block_table)
    assert all(s.block_table == table for s in samples)
    assert [llm.block_manager.blocks[b].ref_count for b in table] == [4, 4, 4]
    assert free - llm.block_manager.num_free_blocks == 3  # the prompt's blocks, once
    llm.step()  # the first decode step
    batch, _ = llm.in_flight[-1]
    # 3 copy, the 4th keeps it
    assert len(batch.copies) == 3 and {src for src, _ in batch.copies} == {table[2]}
    assert [llm.block_manager.blocks[b].ref_count for b in table[:2]] == [4, 4]
    assert len({s.block_table[2] for s in samples}) == 4
    while not llm.is_finished():
        llm.step()
    assert llm.block_manager.num_free_blocks == free


@pytest.mark.parametrize("prompt_len", [21, 32])
def test_every_sample_keeps_its_own_kv(model, prompt_len):
    """Each sample's log-probabilities equal transformers' on prompt + that sample's tokens: a write
    into a block another sample still reads (no copy-on-write) would change them."""
    llm, hf_model = model
    prompt = prompts(1, (prompt_len, prompt_len), seed=prompt_len)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True,
                            logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(out["outputs"]) == 4
    for sample in out["outputs"]:
        ref = hf_logprobs(hf_model, prompt, sample["token_ids"])
        chosen = torch.tensor([lp[t] for t, lp in zip(sample["token_ids"], sample["logprobs"])])
        expected = ref.gather(1, torch.tensor(sample["token_ids"])[:, None])[:, 0]
        torch.testing.assert_close(chosen, expected, atol=1e-4, rtol=0)
        assert sample["cumulative_logprob"] == pytest.approx(expected.sum().item(), abs=1e-3)
        for step, lp in zip(ref, sample["logprobs"]):
            top = step.topk(3)
            assert set(top.indices.tolist()) <= set(lp)
            torch.testing.assert_close(torch.tensor([lp[t] for t in top.indices.tolist()]),
                                       top.values, atol=1e-4, rtol=0)


def test_seeded_samples_reproduce_and_differ(model):
    llm, _ = model
    prompt, *others = prompts(3, (10, 40), seed=7)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    samples = [o["token_ids"] for o in first["outputs"]]
    # 12 tokens from 300: distinct seeds give distinct samples
    assert len({tuple(s) for s in samples}) == 4
    assert first["token_ids"] == samples[0] and first["finish_reason"] == "length"
    crowd = [SamplingParams(temperature=0.8, max_tokens=5), params,
             SamplingParams(n=2, temperature=1.0, max_tokens=7)]
    again = llm.generate([others[0], prompt, others[1]], crowd, use_tqdm=False)
    assert [o["token_ids"] for o in again[1]["outputs"]] == samples
    assert len(again[2]["outputs"]) == 2 and len(again[0]["outputs"]) == 1
    other_seed = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=12, max_tokens=12,
                                                       ignore_eos=True),
                              use_tqdm=False)[0]
    assert [o["token_ids"] for o in other_seed["outputs"]] != samples


def test_greedy_samples_equal_greedy_decoding(model):
    llm, _ = model
    prompt = prompts(1, (25, 25), seed=13)[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10),
                          use_tqdm=False)[0]["token_ids"]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=10),
                       use_tqdm=False)[0]
    assert [o["token_ids"] for o in out["outputs"]] == [greedy] * 3


def test_logprobs_zero_reports_the_chosen_token_only(model):
    llm, _ = model
    out = llm.generate([prompts(1, (9, 9), seed=17)[0]],
                       SamplingParams(temperature=0, max_tokens=4, logprobs=0), use_tqdm=False)[0]
    assert [list(lp) for lp in out["logprobs"]] == [[t] for t in out["token_ids"]]
    assert all(lp[t] <= 0 for t, lp in zip(out["token_ids"], out["logprobs"]))
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2),
                        use_tqdm=False)[0]["logprobs"] is None


@pytest.mark.parametrize("kwargs, name, error", [
    (dict(n=0), "n=", ValueError), (dict(n=-2), "n=", ValueError), (dict(n=1.5), "n=", TypeError),
    (dict(logprobs=-1), "logprobs=", ValueError), (dict(logprobs=0.5), "logprobs=", TypeError)])
def test_bad_sampling_params_name_the_argument(kwargs, name, error):
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)


def test_requests_that_cannot_fit_are_refused_with_the_reason(model):
    llm, _ = model
    with pytest.raises(ValueError, match="logprobs=301"):
        llm.generate([[1, 2]], SamplingParams(logprobs=301), use_tqdm=False)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([[1, 2]], SamplingParams(n=llm.config.max_num_seqs + 1), use_tqdm=False)
    blocks = len(llm.block_manager.blocks)
    # n copies of its longest state must fit
    with pytest.raises(ValueError, match="KV-cache blocks"):
        llm.generate([[1, 2]], SamplingParams(n=blocks // 2 + 1, max_tokens=2 * BLOCK_SIZE - 2),
                     use_tqdm=False)
    assert llm.generate([[1, 2]], SamplingParams(n=2, max_tokens=3), use_tqdm=False)[0]["outputs"]


def test_a_group_that_does_not_fit_takes_no_block_and_evicts_no_cached_prefix():
    from nanovllm.core.sharing import allocate_group
    bm = BlockManager(6, BS)
    cached = computed(bm, list(range(8)))  # 2 full blocks, registered in the prefix cache
    bm.cache_computed_blocks(cached, cached.num_computed_tokens)
    bm.free(cached)
    before = dict(bm.cached_blocks)
    root = Sequence(list(range(100, 120)), SamplingParams(n=2), BS)  # 5 blocks each: 10 > 6
    sibling = Sequence(list(range(100, 120)), SamplingParams(n=2), BS)
    root.group = sibling.group = [root, sibling]
    assert not allocate_group(bm, root)
    assert bm.cached_blocks == before and bm.num_free_blocks == 6
    assert not root.block_table and not sibling.block_table
    again = computed(bm, list(range(8)) + [9])
    assert again.num_cached_tokens == 8  # the prefix still hits


def test_a_step_samples_at_most_max_num_seqs_rows(tmp_path):
    """A 3-sample request whose prompt runs in chunks forks at its prompt's end, in the step that
    admits three short requests with the budget its last chunk leaves: the step must still sample
    at most max_num_seqs rows (the run-ahead's slots and the decode graphs hold that many).
    Before: 6 rows of 4, a RuntimeError where the samples went into their slot."""
    path = str(tmp_path)
    build_tiny_llama(path)
    llm = make_llm(path, max_num_seqs=4, max_num_batched_tokens=16)
    rows, record = [], llm.scheduler._record

    def recorded(batch):
        record(batch)
        rows.append(len(batch.sampled))
    llm.scheduler._record = recorded
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    ids = [llm.add_request(prompts(1, (50, 50), seed=4)[0], params)]  # chunks of 16, 16, 16, 2
    ids += [llm.add_request(p, replace(params, n=1)) for p in prompts(3, (3, 4), seed=5)]
    outputs = {}
    while not llm.is_finished():
        outputs.update({out.request_id: out for out in llm.step() if out.finished})
    assert sorted(outputs) == sorted(ids) and len(outputs[ids[0]].outputs) == 3
    assert max(rows) == 4
