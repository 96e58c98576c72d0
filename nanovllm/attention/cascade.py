"""Cascade attention's host side (FlashInfer's and vLLM's cascade attention, Hydragen): which decode
rows of a step share which prefix, whether reading it once pays, and the CUDA graphs that do it.

Sharing is visible in the block tables: decode rows whose tables start with the same block ids hold
the same keys there (a prefix-cache hit on a common system prompt, the samples of one request,
beams). Rows are grouped by their first block; a group's shared prefix is the longest run of block
ids common to all its members, in whole blocks, and ends before every member's newest key (each
keeps its own keys, at least the one it writes this step). A group is cut into tiles of at most
`members_per_tile` rows, each read by one program per KV head and split (kernels/cascade.py).

The rule: cascade runs when the keys it saves, (members - 1) x shared_len summed over tiles, are at
least MIN_SAVED_FRACTION of all the keys the step's decodes read; otherwise plain decode does.

CUDA graphs: a decode step that uses cascade replays a twin of its decode graph, captured with it
when the engine starts, that reads the same inputs plus the plan at fixed addresses, with room for
a quarter as many tiles as the graph has rows (unused tiles have shared_len 0; a step with more
tiles runs plain decode). The triton backend alone does this; the others ignore
`disable_cascade_attn`.
"""
import time
from dataclasses import dataclass

import torch
import triton

from nanovllm.config import Config
from nanovllm.kernels.cascade import cascade_scratch, members_per_tile
from nanovllm.kernels.compile_ahead import compile_ahead
from nanovllm.kernels.decode import decode_config, num_decode_splits
from nanovllm.utils.pinned import host_tensor
from nanovllm.worker.cuda_graphs import FullGraph, unpack

# of the decode keys: on an H200 at batch 256, cascade broke even between 0.25 and 0.4 of the keys
# saved (0.89x to 1.04x), and gave 1.5x to 2x at 0.6 to 0.8 (docs/cascade.md)
MIN_SAVED_FRACTION = 0.4
MAX_PREFIX_SPLITS = 16


@dataclass
class CascadeStep:
    """A step's plan on the device, what the triton backend reads (AttentionMetadata.cascade)."""
    key_starts: torch.Tensor  # [B] int32: per decode row, its keys read by its tile (0: none)
    tiles: torch.Tensor       # [T, 2 + members] int32: first row, shared_len, member rows (-1)
    num_splits: int           # of each row's own keys
    prefix_splits: int        # of each tile's prefix


class BlockCopies:
    """Blocks that hold the same keys as another block up to some slot. Copy-on-write makes them:
    the n samples of a request (or the beams) each get a copy of its last prompt block, partly
    filled, and a copy equals its source below the first slot either has been written at since.
    Followed step by step from the copies, the writes and the swaps in (`update`), so that rows
    can share that block's keys too, not only their common whole blocks."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.source: dict[int, list[int]] = {}  # block -> [the block it copies, slots still equal]

    def update(self, step):
        """Take in a step before it runs: its copies, then every slot it writes or swaps in.
        Only steps with tokens come here: a step of swaps alone never reaches the backend, which
        is why the cascade keeps no copies under swap preemption (Cascade.__init__)."""
        bs = self.block_size
        for src, dst in step.copies:
            self.forget(dst)
            self.source[dst] = [src, bs]
        if not self.source:
            return
        lowest = {gpu: 0 for _, gpu in step.swap_in}  # block -> lowest slot written
        cu = step.cu_seqlens_q
        for row, (table, end) in enumerate(zip(step.block_tables, step.context_lens)):
            start = end - cu[row + 1] + cu[row]
            slot = start % bs  # keys start..end-1: their first block from this slot, then whole
            for block in table[start // bs:-(-end // bs)]:
                if slot < lowest.get(block, bs):
                    lowest[block] = slot
                slot = 0
        for block, entry in list(self.source.items()):
            entry[1] = min(entry[1], lowest.get(block, bs), lowest.get(entry[0], bs))
            if entry[1] == 0:
                del self.source[block]

    def forget(self, block: int):
        """The block gets new keys: it is no copy any more, and its copies no longer equal it."""
        self.source.pop(block, None)
        for copy in [b for b, (src, _) in self.source.items() if src == block]:
            del self.source[copy]

    def equal_slots(self, blocks: list[int]) -> int:
        """How many leading slots hold the same keys in all these blocks (0: none known)."""
        root, slots = None, self.block_size
        for block in blocks:
            while block in self.source:
                block, equal = self.source[block]
                slots = min(slots, equal)
            if root is not None and block != root:
                return 0  # copies of different blocks
            root = block
        return slots


def plan_tiles(block_tables: list[list[int]], context_lens: list[int], num_decodes: int,
               block_size: int, members: int,
               copies: BlockCopies | None = None) -> tuple[list[int], list[list[int]], int]:
    """(key_starts per decode row, tiles [first row, shared_len, member rows...], keys saved) of
    the decode rows that share leading blocks (and, with `copies`, the equal leading slots of
    the block after them); tiles are padded with -1 to `members` rows."""
    key_starts, tiles, saved = [0] * num_decodes, [], 0
    if len({table[0] for table in block_tables[:num_decodes]}) == num_decodes:
        return key_starts, tiles, saved  # no two rows share a first block (the common case)
    groups: dict[int, list[int]] = {}
    for row in range(num_decodes):
        groups.setdefault(block_tables[row][0], []).append(row)
    for rows in groups.values():
        if len(rows) < 2:
            continue
        first = block_tables[rows[0]]
        # whole blocks before every member's newest key (the one it writes this step)
        n = min((context_lens[r] - 1) // block_size for r in rows)
        for r in rows[1:]:
            table = block_tables[r]
            if table[:n] != first[:n]:
                n = next(i for i, (a, b) in enumerate(zip(table, first)) if a != b)
        shared_len = n * block_size
        if copies is not None and len({block_tables[r][n] for r in rows}) > 1:
            # copies of one block (the samples' last prompt block): the slots they hold in common
            own_newest = min(context_lens[r] for r in rows) - 1 - shared_len  # kept own
            shared_len += min(copies.equal_slots([block_tables[r][n] for r in rows]), own_newest)
        if shared_len == 0:
            continue
        num_tiles = -(-len(rows) // members)
        for t in range(num_tiles):  # near-equal tiles: each of a group of >= 2 has >= 2 rows
            part = rows[t * len(rows) // num_tiles:(t + 1) * len(rows) // num_tiles]
            tiles.append([part[0], shared_len] + part + [-1] * (members - len(part)))
            saved += (len(part) - 1) * shared_len
            for r in part:
                key_starts[r] = shared_len
    return key_starts, tiles, saved


def pays(saved: int, context_lens: list[int], num_decodes: int) -> bool:
    """The rule: cascade when it saves at least MIN_SAVED_FRACTION of the decodes' key reads."""
    return saved > 0 and saved >= MIN_SAVED_FRACTION * sum(context_lens[:num_decodes])


def prefix_splits(num_tiles: int, num_kv_heads: int, num_sms: int, max_keys: int) -> int:
    """Splits of each tile's prefix: about 2 programs per SM, rounded down, at least 2; no split
    shorter than a key tile. (On an H200 at batch 256, 2 splits of 16 tiles x 8 KV heads beat 3 by
    2-4%: benchmarks/results/h200_cascade.log.)"""
    useful = triton.cdiv(max_keys, decode_config(128)["BLOCK_N"])
    wanted = max(2, 2 * num_sms // (max(1, num_tiles) * num_kv_heads))
    return max(1, min(wanted, useful, MAX_PREFIX_SPLITS))


class Cascade:
    """One triton backend's cascade attention: plans steps, holds the scratch and the graphs."""

    def __init__(self, backend, config: Config):
        self.backend, self.block_size = backend, config.kvcache_block_size
        # a step of swaps alone never comes here, and its swaps in would go unseen: with swap
        # preemption, rows share whole blocks only
        self.copies = BlockCopies(self.block_size) if config.preemption_mode != "swap" else None
        self.members = members_per_tile(backend.num_heads // backend.num_kv_heads)
        self.max_model_len = config.max_model_len
        slots = max(b * (self.num_splits(b) + MAX_PREFIX_SPLITS)
                    for b in range(1, config.max_num_seqs + 1))
        self.scratch = cascade_scratch(slots, 1, backend.num_heads, backend.head_dim,
                                       torch.device(config.device))
        # decode graph size -> (graph, its plan buffer, tiles its last step used, its room)
        self.twins: dict[int, tuple] = {}
        self.pool = None
        self.num_steps = 0  # steps that ran cascade attention (tests and benchmarks read it)
        self.capture_seconds = 0.0

    def num_splits(self, num_decodes: int) -> int:
        b = self.backend
        return num_decode_splits(num_decodes, b.num_kv_heads, b.head_dim, self.max_model_len,
                                 b.num_sms)

    def prepare(self, runner, step, meta, graph):
        """Plan the step; if cascade pays, put the plan in meta (eager) or return the graph twin
        that runs it (a decode step's graph); else return `graph` as it was."""
        if self.copies is not None:
            self.copies.update(step)  # every step with tokens: its copies and writes
        d = step.num_decodes
        if d < 2 or graph is not None and d < len(step.context_lens):
            return graph  # a mixed step's graph runs plain decode
        key_starts, tiles, saved = plan_tiles(step.block_tables, step.context_lens, d,
                                              self.block_size, self.members, self.copies)
        if not pays(saved, step.context_lens, d):
            return graph
        if graph is None:
            self.num_steps += 1
            splits = prefix_splits(len(tiles), self.backend.num_kv_heads, self.backend.num_sms,
                                   max(t[1] for t in tiles))
            flat = self.upload(key_starts + [x for t in tiles for x in t], runner)
            meta.cascade = CascadeStep(flat[:d], flat[d:].view(len(tiles), -1),
                                       self.num_splits(d), splits)
            return None
        size = graph.sizes[1]
        if size not in self.twins or len(tiles) > self.twins[size][3]:
            return graph  # no room for its tiles: plain decode
        self.num_steps += 1
        twin, buffer, live, capacity = self.twins[size]
        # unused tiles have shared_len 0: zero only those the last step of this graph used
        pad = [0] * (2 + self.members) * max(0, live - len(tiles))
        flat = key_starts + [0] * (size - d) + [x for t in tiles for x in t] + pad
        self.upload(flat, runner, buffer[:len(flat)])
        self.twins[size] = twin, buffer, len(tiles), capacity
        return twin

    def upload(self, values: list[int], runner, into: torch.Tensor | None = None) -> torch.Tensor:
        host = host_tensor(values, torch.int32, pin=runner.device.type == "cuda")
        if into is None:
            return host.to(runner.device, non_blocking=True)
        return into.copy_(host, non_blocking=True)

    def capture_twins(self, runner, graphs):
        """The twin of every decode graph of two rows or more (worker/cuda_graphs.py), captured
        when the engine starts: none is captured while it serves."""
        self.pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        plans = [(graph, *self.twin_inputs(runner, graph))
                 for (kind, size), graph in graphs.graphs.items() if kind == "decode" and size >= 2]
        with compile_ahead(runner.model):  # their Triton kernels compiled at once
            for graph, args, _, _ in plans:
                graph.forward(*args)
        for graph, args, buffer, capacity in plans:
            twin = FullGraph(graph.forward, args, self.pool, runner.model)
            twin.sizes, twin.inputs = graph.sizes, graph.inputs
            twin.ends_in_logits = graph.ends_in_logits
            self.twins[graph.sizes[1]] = twin, buffer, 0, capacity
        self.capture_seconds = time.perf_counter() - start

    def twin_inputs(self, runner, graph) -> tuple:
        """The inputs of a decode graph's twin, which runs cascade attention: the graph's, plus a
        plan buffer of [B] key starts and room for B // 4 tiles (a tile has 2 rows or more: B // 2
        at most); (forward's arguments, the buffer, its room in tiles). The launch is static: every
        tile it has room for is a program per KV head and split, and each unused one costs an SM
        slot for a moment, hence not B // 2."""
        size = graph.sizes[1]
        capacity = max(1, size // 4)
        buffer = torch.zeros(size + capacity * (2 + self.members), dtype=torch.int32,
                             device=runner.device)
        input_ids, positions, meta = unpack(graph.inputs, graph.sizes, graph.sizes, size)
        tiles_guess = max(1, size // 16)  # the grid is static: assume 16 rows a tile
        splits = prefix_splits(tiles_guess, self.backend.num_kv_heads, self.backend.num_sms,
                               self.max_model_len)
        meta.cascade = CascadeStep(buffer[:size], buffer[size:].view(capacity, -1),
                                   self.num_splits(size), splits)
        return (input_ids, positions, meta), buffer, capacity
