"""Memory sharing for parallel sampling and beam search (the vLLM paper, section 4.4).

The sequences of one request form a group. `fork` gives a child its parent's tokens and progress
and every one of its blocks (reference counts up, nothing copied); a sequence about to write into a
block that others still hold copies it first (copy-on-write, BlockManager.append_blocks). A group is
admitted as a whole (`allocate_group`): beams admitted one by one could each hold blocks while
waiting for a sibling that no longer fits. A request with one sequence never imports this.
"""
from copy import copy

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus, num_blocks_for


def fork(parent: Sequence, block_manager: BlockManager) -> Sequence:
    """A new member of the parent's group that shares all its blocks."""
    child = copy(parent)
    child.seq_id, child.sample_index = next(Sequence._ids), len(parent.group)
    child.token_ids, child.logprobs = list(parent.token_ids), list(parent.logprobs)
    child.stream = None
    for block_id in parent.block_table:
        block_manager.blocks[block_id].ref_count += 1
    child.block_table = list(parent.block_table)
    parent.group.append(child)
    return child


def allocate_group(block_manager: BlockManager, seq: Sequence) -> bool:
    """Blocks for all the waiting members of the sequence's group, or for none. The count comes
    first, so a group that does not fit takes no block (taking one may evict a cached prefix)."""
    members = [s for s in seq.group if s.status == SequenceStatus.WAITING and not s.block_table]
    hits = [block_manager._cached_prefix(member) for member in members]
    free_hits = {b for h in hits for b in h if block_manager.blocks[b].ref_count == 0}
    need = sum(num_blocks_for(len(m), block_manager.block_size) - len(h)
               for m, h in zip(members, hits)) + len(free_hits)
    if need > block_manager.num_free_blocks:
        return False
    for i, member in enumerate(members):
        if not block_manager.allocate(member):
            for done in members[:i]:
                block_manager.free(done)
            return False
    return True
