"""Unit tests of the block manager and of the block arithmetic helpers (no model involved)."""
import time
from collections import OrderedDict

import pytest

from nanovllm import SamplingParams
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence, num_blocks_for
from nanovllm.worker.step_inputs import step_inputs

BS = 4  # tokens per block


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), BS)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None):
    """Pretend a forward step computed the K/V of the sequence's first num_tokens tokens
    (default: all)."""
    seq.num_computed_tokens = len(seq) if num_tokens is None else num_tokens
    bm.cache_computed_blocks(seq, seq.num_computed_tokens)


# ---------- helpers ----------

@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_num_blocks_for(num_tokens, expected):
    assert num_blocks_for(num_tokens, BS) == expected


def slots(table: list[int], start: int, end: int) -> list[int]:
    """The cache slots step_inputs gives positions start..end-1 of a sequence with this table."""
    seq = seq_of(range(12))
    seq.block_table = table
    batch = ScheduledBatch([seq], [end - start], [start], [1])
    return step_inputs(batch, BS).slot_mapping


def test_slot_mapping():
    table = [7, 2, 5]
    assert [slots(table, p, p + 1)[0] for p in (0, 3, 4, 5, 8, 11)] == [28, 31, 8, 9, 20, 23]
    assert slots(table, 2, 10) == [30, 31, 8, 9, 10, 11, 20, 21]  # runs across blocks
    assert slots(table, 4, 8) == [8, 9, 10, 11] and slots(table, 3, 3) == []


def test_block_keys_chain():
    """A block's key is its tokens after the name of what the block before it holds."""
    bm = BlockManager(10, BS)
    seq = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(seq)
    compute(bm, seq)
    first, second = (bm.blocks[b] for b in seq.block_table[:2])
    assert first.key == (None, (1, 2, 3, 4))
    assert second.key == (first.content_id, (5, 6, 7, 8))
    assert first.content_id != second.content_id
    assert bm.blocks[seq.block_table[2]].key is None  # not full: not registered


# ---------- allocation and reference counts ----------

def test_allocate_gives_blocks_for_every_token():
    bm = BlockManager(10, BS)
    seq = seq_of(range(10))
    assert bm.allocate(seq)
    assert len(seq.block_table) == 3 == len(set(seq.block_table))
    assert bm.num_free_blocks == 7
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert seq.num_computed_tokens == 0 and seq.num_cached_tokens == 0


def test_allocate_refuses_without_changing_state():
    bm = BlockManager(3, BS)
    big = seq_of(range(13))  # 4 blocks
    assert not bm.allocate(big)
    assert big.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate(seq_of(range(12)))  # exactly 3 blocks fit
    assert bm.num_free_blocks == 0


def test_append_blocks_grows_the_table_at_block_boundaries():
    bm = BlockManager(10, BS)
    seq = seq_of(range(4))
    bm.allocate(seq)
    compute(bm, seq)
    assert bm.num_blocks_to_append([seq]) == 0
    seq.token_ids.append(99)  # token 4 starts block 1
    assert bm.num_blocks_to_append([seq]) == 1
    bm.append_blocks(seq)
    assert len(seq.block_table) == 2 and bm.num_blocks_to_append([seq]) == 0
    for t in range(3):
        seq.token_ids.append(t)
        assert bm.num_blocks_to_append([seq]) == 0  # tokens 5..7 fit in block 1


def test_shared_prefix_shares_blocks_with_ref_counts():
    bm = BlockManager(10, BS)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    compute(bm, a)
    b = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[x].ref_count for x in b.block_table] == [2, 2, 1]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert bm.num_free_blocks == 10 - 4
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1]
    assert a.block_table == [] and bm.num_free_blocks == 10 - 3
    bm.free(b)
    assert bm.num_free_blocks == 10 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    a = seq_of(range(8))
    bm.allocate(a)
    compute(bm, a)
    assert bm.cached_blocks == {}
    b = seq_of(range(8))
    bm.allocate(b)
    assert set(a.block_table).isdisjoint(b.block_table) and b.num_cached_tokens == 0


def test_full_hit_still_computes_the_last_token():
    bm = BlockManager(10, BS)
    a = seq_of(range(8))
    bm.allocate(a)
    compute(bm, a)
    b = seq_of(range(8))
    bm.allocate(b)
    assert b.block_table == a.block_table
    assert b.num_computed_tokens == b.num_cached_tokens == 7


def test_only_a_partial_prefix_of_blocks_hits():
    """A hit stops at the first block that differs, even if a later block matches again."""
    bm = BlockManager(10, BS)
    a = seq_of([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    bm.allocate(a)
    compute(bm, a)
    b = seq_of([1, 1, 1, 1, 9, 9, 9, 9, 3, 3, 3, 3, 4])
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0]
    assert not set(b.block_table[1:]) & set(a.block_table)
    assert b.num_cached_tokens == 4


# ---------- the prefix cache ----------

def test_cache_computed_blocks_registers_full_blocks_only():
    bm = BlockManager(10, BS)
    seq = seq_of(range(10))
    bm.allocate(seq)
    compute(bm, seq, 6)  # block 0 full, block 1 half computed
    k0 = (None, (0, 1, 2, 3))
    assert bm.cached_blocks == {k0: seq.block_table[0]}
    assert seq.num_hashed_blocks == 1
    compute(bm, seq)  # all 10: blocks 0 and 1 full
    k1 = (bm.blocks[seq.block_table[0]].content_id, (4, 5, 6, 7))
    assert bm.cached_blocks == {k0: seq.block_table[0], k1: seq.block_table[1]}
    assert bm.blocks[seq.block_table[1]].key == k1
    assert seq.num_hashed_blocks == 2


def test_decoded_blocks_are_registered():
    bm = BlockManager(10, BS)
    seq = seq_of(range(3))
    bm.allocate(seq)
    compute(bm, seq)
    seq.token_ids.append(3)
    compute(bm, seq)  # the decode step computed token 3: block 0 is full now
    assert seq.num_hashed_blocks == 1
    other = seq_of([0, 1, 2, 3, 7])
    bm.allocate(other)
    assert other.block_table[0] == seq.block_table[0] and other.num_cached_tokens == 4


def test_freed_cached_blocks_are_reused():
    bm = BlockManager(4, BS)
    a = seq_of(range(12))
    bm.allocate(a)
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached_blocks) == 3  # still findable
    b = seq_of(list(range(12)) + [50])
    assert bm.allocate(b)  # 3 hits (free ones) + 1 new: fits exactly in 4 blocks
    assert b.block_table[:3] == table and b.num_cached_tokens == 12
    assert bm.num_free_blocks == 0
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1, 1]


def test_free_hits_count_against_free_blocks():
    """A hit on a free block takes it out of the free list: it cannot also serve as a new block."""
    bm = BlockManager(4, BS)
    a = seq_of(range(8))
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    b = seq_of(list(range(8)) + list(range(100, 109)))  # 2 hits + 3 new blocks > 4
    assert not bm.allocate(b)
    assert b.block_table == [] and bm.num_free_blocks == 4
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_eviction_takes_least_recently_freed_first_and_tail_first():
    bm = BlockManager(6, BS)
    a, b = seq_of(range(12)), seq_of(range(100, 112))
    for s in (a, b):
        bm.allocate(s)
        compute(bm, s)
    a_table, b_table = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    order = a_table[::-1] + b_table[::-1]  # a before b; within a sequence, its last block first
    taken = []
    for i in range(6):
        s = seq_of(range(1000 + 4 * i, 1004 + 4 * i))
        bm.allocate(s)
        taken += s.block_table
    assert taken == order


def test_taking_a_block_forgets_what_it_cached():
    bm = BlockManager(3, BS)
    a = seq_of(range(12))
    bm.allocate(a)
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)  # its blocks become free tail first
    c = seq_of(range(200, 204))
    bm.allocate(c)  # takes a's last block
    assert c.block_table == [table[2]]
    assert len(bm.cached_blocks) == 2
    again = seq_of(range(12))
    assert not bm.allocate(again)  # 2 hits + 1 block, and only 2 free blocks, both hits
    bm.free(c)
    assert bm.allocate(again) and again.num_cached_tokens == 8


def test_hash_collision_is_not_a_hit():
    """Python hashes 0 and 2**61 - 1 alike, so these blocks' keys collide:
    the dict compares them."""
    m = 2**61 - 1
    assert hash((None, (0, 0, 0, 0))) == hash((None, (m, m, m, m)))
    bm = BlockManager(10, BS)
    a = seq_of([0, 0, 0, 0, 2, 2, 2, 2])
    bm.allocate(a)
    compute(bm, a)
    for tokens, cached in [([m, m, m, m, 5], 0), ([0, 0, 0, 0, 0, 0, 0, 0, 5], 4),
                           ([2, 2, 2, 2, 5], 0), ([0, 0, 0, 0, 5], 4)]:
        s = seq_of(tokens)
        bm.allocate(s)
        assert s.num_cached_tokens == cached, tokens
        assert len(set(s.block_table)) == len(s.block_table)


def test_equal_blocks_computed_twice_both_lead_to_hits():
    """Two sequences that computed the same prefix side by side: a later one hits through either."""
    bm = BlockManager(20, BS)
    a, b = seq_of(range(8)), seq_of(range(8))
    bm.allocate(a)
    bm.allocate(b)  # nothing registered yet: no hit, separate blocks
    assert set(a.block_table).isdisjoint(b.block_table)
    compute(bm, a, 4)
    compute(bm, b)     # b registers block 1 first (after its own block 0)
    compute(bm, a)
    c = seq_of(list(range(8)) + [9])
    bm.allocate(c)
    assert c.num_cached_tokens == 8


# ---------- O(1) per block ----------

def test_operations_do_not_scan_the_pool():
    """Allocating and freeing costs the same with 100,000 blocks as with 400
    (a list scan would not)."""
    def cost(num_blocks: int) -> float:
        bm = BlockManager(num_blocks, BS)
        shared = seq_of(range(16))
        bm.allocate(shared)
        compute(bm, shared)
        # its cached blocks now sit in the free list: hits remove them from the middle
        bm.free(shared)
        start = time.perf_counter()
        for i in range(300):
            s = seq_of(list(range(16)) + list(range(10_000 + i * 40, 10_040 + i * 40)))
            bm.allocate(s)
            compute(bm, s)
            bm.free(s)
        return time.perf_counter() - start
    assert isinstance(BlockManager(1, BS).free_blocks, OrderedDict)
    small = min(cost(400) for _ in range(3))
    large = min(cost(100_000) for _ in range(2))
    assert large < 10 * small, (small, large)
