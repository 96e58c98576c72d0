"""The block manager: PagedAttention's KV-cache allocator with prefix caching.

The cache is a pool of fixed-size blocks; each sequence owns a block table (a list of block ids) and
blocks are shared through reference counts. A full block is registered, as soon as the step that
computes its K/V is scheduled (vLLM v1's order), under its key: its tokens and the name
(`content_id`) of what the block before it holds, so the key of a block stands for its whole prefix
(vLLM's chained block hashes) while the lookup is a dict's, which compares keys on a hash collision:
a hit never returns wrong K/V. A freed block keeps its contents and stays findable until it is
taken for new data; free blocks are taken least recently freed first. Every operation is O(1) per
block.

Memory sharing (the paper's section 4.4): blocks shared by the sequences of one request
(nanovllm/core/sharing.py) are copied before one of them writes into them (copy-on-write), and the
(source, destination) pair goes to the model runner. (Swap preemption's CPU pool is
nanovllm/core/swap.py.)
"""
from collections import OrderedDict
from itertools import count

from nanovllm.core.sequence import Sequence, num_blocks_for


class Block:
    __slots__ = ("block_id", "ref_count", "key", "content_id")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.key: tuple | None = None  # (content_id of the block before or None, its token ids)
        self.content_id: int | None = None  # names what it holds: these tokens after that prefix


class BlockManager:
    """Allocates, shares and frees KV-cache blocks; finds cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks = OrderedDict.fromkeys(range(num_blocks))  # block ids, oldest first
        self.cached_blocks: dict[tuple, int] = {}  # key -> block id
        self._content_ids = count()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def take_free_block(self) -> int:
        """Take the least recently freed block for new data, forgetting what it cached."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.key is not None and self.cached_blocks.get(block.key) == block_id:
            del self.cached_blocks[block.key]
        block.key = block.content_id = None
        block.ref_count = 1
        return block_id

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that hold the sequence's leading full blocks."""
        if not self.enable_prefix_caching:
            return []
        hits, content_id = [], None
        for i in range(len(seq) // self.block_size):
            block_id = self.cached_blocks.get((content_id, tuple(seq.block_tokens(i))))
            if block_id is None:
                break
            hits.append(block_id)
            content_id = self.blocks[block_id].content_id
        return hits

    def allocate(self, seq: Sequence, num_slots: int = 0) -> bool:
        """Give a waiting sequence blocks for all its tokens (or for num_slots tokens if more: a
        reservation, core/reservation.py), reusing a cached prefix; False if they don't fit."""
        assert not seq.block_table
        hits = self._cached_prefix(seq)
        num_new = num_blocks_for(max(len(seq), num_slots), self.block_size) - len(hits)
        # hits on free blocks take free blocks too
        if num_new + sum(self.blocks[b].ref_count == 0 for b in hits) > self.num_free_blocks:
            return False
        for block_id in hits:  # a hit on a free block takes it out of the free list
            self.free_blocks.pop(block_id, None)
            self.blocks[block_id].ref_count += 1
        seq.block_table = hits + [self.take_free_block() for _ in range(num_new)]
        seq.num_hashed_blocks = len(hits)
        # a full hit still computes the last prompt token: its logits give the first new token
        seq.num_computed_tokens = min(len(hits) * self.block_size, len(seq) - 1)
        if len(seq) == seq.num_prompt_tokens:  # report the first admission, not a recomputation
            seq.num_cached_tokens = seq.num_computed_tokens
        return True

    def num_blocks_to_append(self, seqs: list[Sequence], ref_counts: list | None = None) -> int:
        """New blocks the sequences (one, or a group) need before their next tokens fit: fresh tail
        blocks, plus copies of a shared block they write into (k of its r holders writing make
        min(k, r - 1) copies). `ref_counts`: where their blocks' counts are, if not here."""
        new, writes = 0, {}  # block -> how many of the sequences write into it
        for seq in seqs:
            num_tokens = len(seq.token_ids)
            if seq.num_computed_tokens == num_tokens:
                continue  # a beam waiting for beam search writes nothing
            new += max(0, num_blocks_for(num_tokens, self.block_size) - len(seq.block_table))
            i = seq.num_computed_tokens // self.block_size  # the block the next token goes into
            if i < len(seq.block_table):
                writes[seq.block_table[i]] = writes.get(seq.block_table[i], 0) + 1
        for b, k in writes.items():
            count = ref_counts[b] if ref_counts is not None else self.blocks[b].ref_count
            new += min(k, count - 1)
        return new

    def append_blocks(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give every token of the sequence a slot it may write: copy-on-write the block the next
        token goes into if others share it, then grow the table. Returns the (src, dst) block copies
        to make before the forward."""
        copies = []
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            src = seq.block_table[i]
            self.blocks[src].ref_count -= 1
            seq.block_table[i] = self.take_free_block()
            copies.append((src, seq.block_table[i]))
        for _ in range(num_blocks_for(len(seq), self.block_size) - len(seq.block_table)):
            seq.block_table.append(self.take_free_block())
        return copies

    def cache_computed_blocks(self, seq: Sequence, num_tokens: int):
        """Register the sequence's full blocks among its first num_tokens in the prefix cache. The
        scheduler registers a step's blocks as it schedules them: sequences admitted after, in that
        step too, hit them (each layer writes a step's K/V before it reads the cache). A block that
        holds a placeholder waits for its token."""
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_hashed_blocks, num_tokens // self.block_size):
            block, tokens = self.blocks[seq.block_table[i]], tuple(seq.block_tokens(i))
            if min(tokens) < 0:
                return
            if block.key is None:  # else registered by a sequence sharing it (a hit, or a fork)
                block.key = (self.blocks[seq.block_table[i - 1]].content_id if i else None, tokens)
                owner = self.blocks[self.cached_blocks.setdefault(block.key, block.block_id)]
                # a block equal to the registered one shares its name: blocks after either hit
                block.content_id = next(self._content_ids) if owner is block else owner.content_id
            seq.num_hashed_blocks = i + 1

    def free(self, seq: Sequence):
        """Drop the sequence's references; blocks reaching zero become free, tail first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
