"""Swap preemption: a preempted group's blocks go to the CPU pool and come back without
recomputation; outputs equal those of recomputation and of an unconstrained engine."""
import random
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sharing import fork
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.core.swap import Swapper
from tests.sharing_helpers import build_tiny_llama, make_llm

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SWAP = dict(preemption_mode="swap", swap_space=0.001)  # 1 MiB: 128 blocks of this model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    build_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def reference(path):
    return make_llm(path, enable_prefix_caching=False)


def prompts(n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def run(llm, batch, params):
    """Outputs, plus the prompt tokens prefilled and the largest group swapped out along the way."""
    stats, schedule = {"prefilled": 0, "swapped_group": 0}, llm.scheduler.schedule

    def recording():
        batch = schedule()
        # prompt tokens
        stats["prefilled"] += sum(max(0, min(start + n, seq.num_prompt_tokens) - start)
                                  for seq, start, n in zip(batch.seqs, batch.starts,
                                                           batch.num_new_tokens))
        swapped = llm.scheduler.swap.swapped if llm.scheduler.swap else []
        stats["swapped_group"] = max([stats["swapped_group"], *map(len, swapped)])
        return batch
    llm.scheduler.schedule = recording
    outputs = llm.generate(batch, params, use_tqdm=False)
    return outputs, stats


def samples(outputs) -> list[list[list[int]]]:
    return [[o["token_ids"] for o in out["outputs"]] for out in outputs]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swap_and_recompute_give_the_same_tokens(path, reference, prefix_caching):
    batch = prompts(6, (10, 50), seed=1)  # up to 6 blocks each at the end; the cache has 8
    expected = samples(reference.generate(batch, GREEDY, use_tqdm=False))
    swap = make_llm(path, num_kvcache_blocks=8, enable_prefix_caching=prefix_caching, **SWAP)
    recompute = make_llm(path, num_kvcache_blocks=8, enable_prefix_caching=prefix_caching)
    swapped, swap_stats = run(swap, batch, GREEDY)
    recomputed, recompute_stats = run(recompute, batch, GREEDY)
    assert samples(swapped) == samples(recomputed) == expected
    s = swap.scheduler.swap
    assert swap.scheduler.num_preemptions > 0 and s.num_swapped_out_blocks > 0
    assert s.num_swapped_in_blocks == s.num_swapped_out_blocks  # every block came back
    assert swap_stats["prefilled"] == sum(map(len, batch))  # nothing was recomputed
    assert recompute_stats["prefilled"] > sum(map(len, batch))
    assert recompute.scheduler.swap is None
    assert swap.block_manager.num_free_blocks == 8
    assert len(s.free_cpu_blocks) == swap.model_runner.swap_space.num_blocks


def test_sample_groups_are_swapped_whole_and_keep_their_kv(path, reference):
    """n-sample requests under a tiny cache: the same tokens and log-probabilities
    as without pressure."""
    batch = prompts(3, (20, 40), seed=2)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=30, ignore_eos=True,
                            logprobs=2)
    expected = reference.generate(batch, params, use_tqdm=False)
    swap = make_llm(path, num_kvcache_blocks=15, **SWAP)
    outputs, stats = run(swap, batch, params)
    assert swap.scheduler.swap.num_swapped_out_blocks > 0 and stats["swapped_group"] == 3
    assert samples(outputs) == samples(expected)
    for out, ref in zip(outputs, expected):
        for o, r in zip(out["outputs"], ref["outputs"]):
            assert o["cumulative_logprob"] == pytest.approx(r["cumulative_logprob"], abs=1e-3)
    assert swap.block_manager.num_free_blocks == 15


@pytest.mark.parametrize("mode", [dict(preemption_mode="recompute"), SWAP],
                         ids=["recompute", "swap"])
def test_beam_search_under_preemption(path, reference, mode):
    batch = prompts(3, (20, 40), seed=3)
    expected = reference.beam_search(batch, beam_width=3, max_tokens=20)
    llm = make_llm(path, num_kvcache_blocks=12, **mode)
    beams = llm.beam_search(batch, beam_width=3, max_tokens=20)
    assert llm.scheduler.num_preemptions > 0
    assert ([[b["token_ids"] for b in r] for r in beams]
            == [[b["token_ids"] for b in r] for r in expected])
    assert (llm.scheduler.swap is not None
            and llm.scheduler.swap.num_swapped_out_blocks > 0) == (mode is SWAP)
    assert llm.block_manager.num_free_blocks == 12


def test_swap_out_and_in_keep_sharing_within_a_group():
    bm = BlockManager(8, 4)
    swapper = Swapper(bm, 6)
    parent = Sequence(list(range(10)), SamplingParams(), 4)
    assert bm.allocate(parent)
    parent.num_computed_tokens = 10
    child = fork(parent, bm)
    child.token_ids.append(1)
    bm.append_blocks(child)  # copy-on-write: the child owns its own block 2
    group = [parent, child]
    gpu_tables = [list(s.block_table) for s in group]
    out = ScheduledBatch()
    assert swapper.swap_out(group, out)
    # 4 blocks, once each
    assert sorted(g for g, _ in out.swap_out) == sorted(set(gpu_tables[0] + gpu_tables[1]))
    assert bm.num_free_blocks == 8 and len(swapper.free_cpu_blocks) == 2
    assert parent.block_table[:2] == child.block_table[:2]  # the shared blocks share one CPU copy
    assert all(s.status == SequenceStatus.SWAPPED for s in group)
    other = Sequence(list(range(50, 62)), SamplingParams(), 4)
    assert bm.allocate(other)
    # 3 blocks, 2 CPU blocks free: it stays
    assert not swapper.swap_out([other], out) and other.block_table
    bm.free(other)
    # 5 blocks: 3 stay free, the group needs 4
    holder = Sequence(list(range(100, 120)), SamplingParams(), 4)
    assert bm.allocate(holder)
    sched = SimpleNamespace(running=deque())
    swapper.swap_in(sched, ScheduledBatch())
    assert not sched.running and list(swapper.swapped) == [group]
    bm.free(holder)
    back = ScheduledBatch()
    swapper.swap_in(sched, back)
    assert list(sched.running) == group and len(back.swap_in) == 4
    assert len(swapper.free_cpu_blocks) == 6 and bm.num_free_blocks == 4
    assert (parent.block_table[:2] == child.block_table[:2]
            and parent.block_table[2] != child.block_table[2])
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]


def test_block_copies_move_the_right_data_in_the_right_order(path):
    """Swap in, swap out, copy-on-write: each one index copy over all layers, in the order the
    scheduler made them."""
    llm = make_llm(path, num_kvcache_blocks=8, **SWAP)
    kv, swap_space = llm.model_runner.kv_cache, llm.model_runner.swap_space
    kv.tensor.copy_(torch.randn_like(kv.tensor))
    before = kv.tensor.clone()
    swap_space.move([], [(1, 5), (2, 6)])
    assert torch.equal(swap_space.cpu_cache[:, :, [5, 6]], before[:, :, [1, 2]])
    # CPU block 6 comes back into block 1 and is reused by block 3 going out; block 3 then takes a
    # copy of block 1
    swap_space.move([(6, 1)], [(3, 6)])
    kv.copy_blocks([(1, 3)])
    assert torch.equal(swap_space.cpu_cache[:, :, 6], before[:, :, 3])
    assert torch.equal(kv.tensor[:, :, [1, 3]], before[:, :, [2, 2]])
    assert torch.equal(kv.tensor[:, :, [0, 2, 4, 5, 6, 7]], before[:, :, [0, 2, 4, 5, 6, 7]])


@pytest.mark.parametrize("options, name", [
    (dict(preemption_mode="swap", swap_space=0), "swap_space="),
    (dict(preemption_mode="swap", swap_space=-1.0), "swap_space="),
    (dict(preemption_mode="swap", swap_space=1e-9), "swap_space="),  # less than one block
    (dict(preemption_mode="offload"), "preemption_mode="),
])
def test_bad_swap_options_name_the_argument(path, options, name):
    with pytest.raises(ValueError, match=name):
        make_llm(path, **options)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_stop_tokens_while_preempting_keep_outputs_and_free_everything(path, reference, mode):
    """The engine reads a step's tokens after launching the next one, so a request can end (on a
    stop token, at any step) after the next step took it or preempted it: same tokens as without
    pressure, and nothing left held."""
    batch = prompts(6, (10, 50), seed=7)
    free_run = reference.generate(batch, GREEDY, use_tqdm=False)
    stops = sorted({o["token_ids"][i] for o, i in zip(free_run, (3, 9, 17, 25, 33, 38))})
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stops)
    expected = samples(reference.generate(batch, params, use_tqdm=False))
    assert len({len(s[0]) for s in expected}) > 2  # the requests end at different steps
    llm = make_llm(path, num_kvcache_blocks=7, **(SWAP if mode == "swap" else {}))
    assert samples(llm.generate(batch, params, use_tqdm=False)) == expected
    assert llm.scheduler.num_preemptions > 0 and llm.is_finished()
    assert llm.block_manager.num_free_blocks == 7
    if mode == "swap":
        assert len(llm.scheduler.swap.free_cpu_blocks) == llm.model_runner.swap_space.num_blocks
