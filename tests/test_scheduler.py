"""Unit tests of the scheduler with a real block manager and fake model steps
(no model involved)."""
from types import SimpleNamespace

import pytest

from nanovllm import SamplingParams
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.core.swap import Swapper

BS = 4


def make(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, prefix_caching=True,
         prefill_first=False):
    config = SimpleNamespace(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             prefill_first=prefill_first, steps_ahead=0)
    return Scheduler(config, BlockManager(num_blocks, BS, prefix_caching))


def never(seq, position):
    return False


def add(sched, *lengths, start=0) -> list[Sequence]:
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence([start + 100 * i + t for t in range(n)], SamplingParams(), BS)
        sched.waiting.append(seq)
        seqs.append(seq)
    return seqs


def step(sched, token=7):
    """Schedule and record one fake model step that samples `token` for every sequence."""
    batch = sched.schedule()
    sched.update(batch, [token] * len(batch.sampled), None, never)
    return batch


def decode_only(batch) -> bool:
    return batch.num_new_tokens.count(1) == len(batch.seqs)


def test_prefill_is_first_come_first_served():
    sched = make()
    seqs = add(sched, 5, 3, 8)
    batch = sched.schedule()
    assert batch.seqs == seqs and batch.num_new_tokens == [5, 3, 8]
    assert list(sched.running) == seqs and not sched.waiting
    assert all(s.status == SequenceStatus.RUNNING for s in seqs)


def test_decode_steps_every_running_sequence():
    sched = make()
    seqs = add(sched, 5, 3)
    step(sched)
    assert [len(s) for s in seqs] == [6, 4]
    batch = step(sched, token=9)
    assert decode_only(batch) and batch.seqs == seqs and batch.num_new_tokens == [1, 1]
    assert [s.token_ids[-2:] for s in seqs] == [[7, 9], [7, 9]]
    assert [s.num_computed_tokens for s in seqs] == [6, 4]


@pytest.mark.parametrize("prefill_first", [False, True])
def test_max_num_seqs_limits_the_batch(prefill_first):
    sched = make(max_num_seqs=2, prefill_first=prefill_first)
    seqs = add(sched, 3, 3, 3)
    assert step(sched).seqs == seqs[:2]
    batch = step(sched)  # the third waits: two are running already
    assert decode_only(batch) and batch.seqs == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    sched.finish([seqs[0]])
    # one kind of step: the decode and the new prompt together; prefill-first: the prompt alone
    assert step(sched).seqs == ([seqs[2]] if prefill_first else [seqs[1], seqs[2]])
    assert list(sched.running) == [seqs[1], seqs[2]]


@pytest.mark.parametrize("prefill_first", [False, True])
def test_token_budget_limits_the_batch_and_chunks_the_last_prompt(prefill_first):
    sched = make(max_num_batched_tokens=25, prefill_first=prefill_first)
    s1, s2, s3 = add(sched, 10, 10, 10)
    batch = step(sched)
    assert batch.seqs == [s1, s2, s3] and batch.num_new_tokens == [10, 10, 5]
    assert s3.status == SequenceStatus.RUNNING and s3.num_computed_tokens == 5
    assert len(s3) == 10  # a partial prefill samples nothing
    assert [len(s) for s in (s1, s2)] == [11, 11]
    batch = step(sched)  # the rest of the prompt, with the decodes unless prefill comes first
    if prefill_first:
        assert batch.seqs == [s3] and batch.num_new_tokens == [5]
    else:
        assert batch.seqs == [s1, s2, s3] and batch.num_new_tokens == [1, 1, 5]
    assert len(s3) == 11


def test_chunked_prefill_of_a_long_prompt():
    sched = make(max_num_batched_tokens=16)
    seq, = add(sched, 40)
    chunks = []
    while seq.num_computed_tokens < 40:
        batch = step(sched)
        assert batch.seqs == [seq] and not decode_only(batch)
        chunks.append(batch.num_new_tokens[0])
    assert chunks == [16, 16, 8]
    assert seq.num_computed_tokens == 40 and len(seq) == 41
    assert seq.num_hashed_blocks == 10  # every full block registered as it was computed
    assert decode_only(step(sched))


def test_decodes_share_steps_with_a_long_prompt():
    """A prompt that arrives while a sequence decodes is prefilled in chunks beside its decode
    steps: the decode never stalls (Sarathi-Serve)."""
    sched = make(max_num_batched_tokens=8)
    old, = add(sched, 4)
    step(sched)
    new, = add(sched, 20, start=50)
    for chunk in (7, 7, 6):
        batch = step(sched)
        assert batch.seqs == [old, new] and batch.num_new_tokens == [1, chunk]


def test_waiting_request_that_does_not_fit_waits():
    sched = make(num_blocks=4)
    s1, s2 = add(sched, 12, 8)  # 3 + 2 blocks > 4
    assert step(sched).seqs == [s1]
    assert list(sched.waiting) == [s2] and s2.block_table == []
    sched.finish([s1])
    assert step(sched).seqs == [s2]


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched = make(num_blocks=6)
    s1, s2, s3 = add(sched, 8, 8, 8)  # two blocks each: the cache is full
    step(sched)  # prefill: each now holds 9 tokens and needs a third block
    assert sched.block_manager.num_free_blocks == 0
    batch = step(sched)
    # s3 (newest) is preempted and frees 2 blocks: s1 and s2 take one each
    assert batch.seqs == [s1, s2] and sched.num_preemptions == 1
    assert list(sched.waiting) == [s3] and s3.status == SequenceStatus.WAITING
    assert s3.block_table == [] and s3.num_computed_tokens == 0
    assert len(s3) == 9  # its sampled token is kept and recomputed later


def test_preempted_sequences_keep_their_order():
    sched = make(num_blocks=3)
    s1, s2, s3 = add(sched, 4, 4, 4)
    step(sched)  # each holds 5 tokens and needs a second block: only s1 can grow
    batch = step(sched)
    assert batch.seqs == [s1] and sched.num_preemptions == 2
    assert list(sched.waiting) == [s2, s3]  # s3 went first, then s2 in front of it


def test_last_running_sequence_preempts_itself_when_blocks_are_held_elsewhere():
    sched = make(num_blocks=2)
    s1, s2 = add(sched, 4, 4)
    step(sched)
    # both need a second block; s2 is preempted, then s1 takes a block
    assert step(sched).seqs == [s1]
    assert list(sched.waiting) == [s2]


def test_preempted_sequence_recomputes_and_hits_its_own_cached_blocks():
    sched = make(num_blocks=5)
    s1, s2 = add(sched, 8, 8)
    step(sched)   # 9 tokens each, 2 blocks each, 1 free
    step(sched)   # s1 takes the free block; s2 needs one too: preempted
    assert list(sched.waiting) == [s2]
    sched.finish([s1])
    # s2 comes back: its 8 prompt tokens were registered, only the rest is computed
    batch = sched.schedule()
    assert batch.seqs == [s2]
    assert batch.num_new_tokens == [1] and batch.starts == [8]
    assert s2.num_cached_tokens == 0  # the report is about the first admission only


def test_finish_frees_blocks_and_leaves_running():
    sched = make(num_blocks=8)
    s1, s2 = add(sched, 5, 5)
    step(sched)
    [s3] = add(sched, 5)
    waiting = sched.waiting
    sched.finish([s1])
    assert s1.status == SequenceStatus.FINISHED and s1.block_table == []
    assert list(sched.running) == [s2]
    assert sched.waiting is waiting and list(waiting) == [s3]  # not walked: none of them waited
    assert sched.block_manager.num_free_blocks == 8 - 2
    sched.finish([s3])
    assert not sched.waiting
    sched.finish([s2])
    assert not sched.has_unfinished()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sequence_preempted_before_its_last_token_is_read_finishes_cleanly(mode):
    """The engine schedules step t+1 before it reads step t: a sequence preempted by step t+1 can
    turn out to have ended at step t. Finishing it must take it out of the waiting queue (or the
    swapped groups) and free its blocks."""
    sched = make(num_blocks=4)
    bm = sched.block_manager
    if mode == "swap":
        sched.swap = Swapper(bm, 8)
    a, b = add(sched, 8, 8)  # two full blocks each: the whole cache
    prefill = sched.schedule()
    # placeholders: rows 0 and 1 of the prefill's tokens
    assert [s.token_ids[8] for s in (a, b)] == [-1, -2]
    decode = sched.schedule()  # a's next token needs a third block: b, the newest, gives way
    assert decode.seqs == [a] and b.status == (SequenceStatus.SWAPPED if mode == "swap"
                                               else SequenceStatus.WAITING)
    assert bool(decode.swap_out) == (mode == "swap")
    assert sched.update(prefill, [5, 6], None, lambda seq, position: seq is b) == [(a, 8), (b, 8)]
    assert b.token_ids[8] == 6 and b.is_finished  # token 6 ended b
    assert (not sched.waiting and not (sched.swap and sched.swap.swapped)
            and list(sched.running) == [a])
    assert bm.num_free_blocks == 1 and (mode == "recompute" or len(sched.swap.free_cpu_blocks) == 8)
