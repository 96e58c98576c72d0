"""CUDA graphs for every step (nano-vllm captures decode steps; vLLM v1 captures mixed steps too).

A step is a few hundred small kernels; launched one by one they leave the GPU waiting for the host.
Replaying a graph captured once launches them all at once. Each step is padded to a captured size: a
step of decodes only to the next batch size of one ladder, any other step to the next token count of
another, up to max_num_batched_tokens. Padding tokens write no K/V (slot -1); padding sequences have
no tokens and no keys. Each graph reads its inputs from a flat tensor of its own, at fixed
addresses: a step laid out by the graph's sizes is uploaded into it in one copy (`upload`). The
graphs are captured largest first and share one memory pool; their Triton kernels compile
first, all at once (kernels/compile_ahead.py), and the run before each capture that loads them
keeps the model's first decoder layer only (the other layers launch the same kernels).

How much of a step a graph holds is the backend's to say (AttentionBackend.cudagraph_support):
- a whole graph where the attention kernels take their grids from the graph's sizes and read from
  the data which rows to run: the triton backend for any step, flash-attn's decode kernel for
  decodes;
- a piecewise graph otherwise (vLLM v1's piecewise mode, worker/piecewise_graph.py): the layers
  between two attention calls are captured, and attention runs eagerly between the replays, with
  the step's own shapes (flash-attn's varlen kernel and sdpa take them from the host).

A whole decode graph also holds what comes before and after the forward, which eagerly cost the
host more than the forward's replay: it fills the placeholders of its token ids from the tokens the
last steps sampled (run_ahead.py), and it ends with the logits of every row, written into one buffer
that all decode graphs share. A decode step whose rows all sample plainly (temperature or greedy:
no seeds, truncation, penalties or log-probabilities) draws its tokens with a captured
gumbel_max_sample of its size (`sample`, kernels/sample.py), one for each slot of the model
runner's sampled tokens, where the next steps' graphs fill their placeholders from.
"""
import time
from itertools import accumulate

import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.core.sequence import num_blocks_for
from nanovllm.kernels.compile_ahead import compile_ahead, first_layer_only
from nanovllm.kernels.host_copy import copy
from nanovllm.kernels.prefill import QUERY_TILE, query_tiles
from nanovllm.kernels.sample import gumbel_max_sample
from nanovllm.utils.pinned import host_tensor
from nanovllm.worker.run_ahead import fill_placeholders
from nanovllm.worker.step_inputs import StepInputs


def step_sizes(step: StepInputs) -> tuple[int, int, int, int]:
    """Tokens, sequences, query tiles and block table width of a step."""
    cu = step.cu_seqlens_q[step.num_decodes:]
    num_tiles = sum(-(-(b - a) // QUERY_TILE) for a, b in zip(cu, cu[1:]))
    return len(step.input_ids), len(step.context_lens), num_tiles, max(map(len, step.block_tables))


def field_sizes(num_tokens: int, num_seqs: int, num_tiles: int, width: int) -> list[int]:
    """Sizes of the fields of a step's upload: token ids, positions, slots, cu_seqlens_q,
    cu_seqlens_k, context_lens, query tiles, block tables; each rounded up to 16 bytes (Triton
    compiles a kernel once per alignment of its pointers: keep it to one)."""
    sizes = [num_tokens] * 3 + [num_seqs + 1] * 2 + [num_seqs, 2 * num_tiles, num_seqs * width]
    return [size + -size % 4 for size in sizes]


def upload(step: StepInputs, sizes: tuple, into: torch.Tensor,
           staging: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the step's fields into a graph's flat int32 inputs, laid out and padded to the graph's
    `sizes`: padding tokens write nowhere (slot -1), padding sequences have no tokens and no keys,
    padding tiles no sequence. The sampled rows' token indices follow. On the GPU they go through
    `staging`, pinned host memory that the copy kernel reads (kernels/host_copy.py)."""
    cu_k, tables = list(accumulate(step.context_lens, initial=0)), []
    for table in step.block_tables:  # each padded to the graph's width (a row at a time: faster)
        tables += table
        tables += [0] * (sizes[3] - len(table))
    fields = [step.input_ids, step.positions, step.slot_mapping, step.cu_seqlens_q, cu_k,
              step.context_lens, query_tiles(step.cu_seqlens_q, step.num_decodes), tables]
    pads = [0, 0, -1, step.cu_seqlens_q[-1], cu_k[-1], 0, -1, 0]
    flat = []
    for values, size, pad in zip(fields, field_sizes(*sizes), pads):
        flat += values + [pad] * (size - len(values))
    host = host_tensor(flat + step.sample_rows, torch.int32, pin=False)
    if staging is None:
        return into[:host.numel()].copy_(host)
    return copy(staging[:host.numel()].copy_(host), into[:host.numel()])


def unpack(flat: torch.Tensor, layout: tuple, lengths: tuple, num_decodes: int,
           step: StepInputs | None = None):
    """Token ids, positions and attention metadata of `lengths` (tokens, sequences, tiles, table
    width): views of a flat upload laid out by `layout` (a graph's sizes)."""
    sizes = field_sizes(*layout)
    ids, positions, slots, cu_q, cu_k, lens, tiles, tables = flat[:sum(sizes)].split(sizes)
    n, num_seqs, num_tiles, width = lengths
    meta = AttentionMetadata(slots[:n], cu_q[:num_seqs + 1], cu_k[:num_seqs + 1], lens[:num_seqs],
                             tables[:num_seqs * layout[3]].view(num_seqs, layout[3])[:, :width],
                             num_decodes, step.cu_seqlens_q if step else [],
                             step.context_lens if step else [], tiles[:2 * num_tiles].view(-1, 2))
    return ids[:n], positions[:n], meta


def token_ladder(largest: int) -> list[int]:
    """16, 24, 32, 48, 64, ... (powers of two and halfway between), up to `largest`."""
    sizes = {largest}
    for size in (16 << i for i in range(largest.bit_length())):
        sizes |= {s for s in (size, size * 3 // 2) if s < largest}
    return sorted(sizes)


class FullGraph:
    """A whole forward pass: `forward(*inputs)`, the model or a decode step's `decode_forward`."""
    eager_attention = False  # it reads its inputs where they were uploaded

    def __init__(self, forward, inputs: tuple, pool, model):
        self.forward = forward
        with first_layer_only(model):  # warm up outside the capture: kernels loaded, workspaces
            forward(*inputs)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool):
            self.hidden = forward(*inputs)

    def replay(self, meta) -> torch.Tensor:
        self.graph.replay()
        return self.hidden


class CUDAGraphs:
    """Every graph of a model runner, by (kind, size)."""

    def __init__(self, runner):
        config = runner.config
        max_tokens, max_seqs = config.max_num_batched_tokens, config.max_num_seqs
        largest_batch = min(max_seqs, max_tokens)
        ladder = (1, 2, 4, 8, *range(16, largest_batch, 16))
        self.decode_sizes = sorted({s for s in ladder if s < largest_batch} | {largest_batch})
        self.token_sizes = token_ladder(max_tokens)
        support = runner.backend.cudagraph_support
        # where the pieces hand queries to attention and take its output back
        if support != "always":
            from nanovllm.worker.piecewise_graph import PiecewiseGraph  # flash's and sdpa's steps
            q = torch.empty(max_tokens, runner.backend.num_heads, config.hf_config["head_dim"],
                            dtype=config.torch_dtype, device=runner.device)
            out = torch.empty_like(q)
        start, memory = time.perf_counter(), torch.cuda.memory_reserved(runner.device)
        self.graphs, self.samplers, self.sampleable = {}, {}, None
        self.pool = pool = torch.cuda.graph_pool_handle()
        # a decode graph's logits and sampled tokens (one tensor-parallel rank only: the LM head of
        # several gathers its logits)
        head = runner.model.lm_head
        self.logits = None
        if support != "never" and not hasattr(runner, "tp") and head.bias is None:
            self.logits = torch.empty(largest_batch, head.weight.shape[0], dtype=config.torch_dtype,
                                      device=runner.device)
            self.temperatures = torch.zeros(largest_batch, device=runner.device)
        shapes = ([("mixed", t) for t in self.token_sizes]
                  + [("decode", s) for s in self.decode_sizes])
        max_blocks = num_blocks_for(config.max_model_len, config.kvcache_block_size)  # per table
        plans = []  # (kind, size, sizes, inputs, args, whole?, ends in logits?, forward)
        for kind, size in sorted(shapes, key=lambda shape: -shape[1]):  # largest first
            sizes = self.sizes(kind, size, max_seqs, max_blocks)
            # the step's fields at fixed addresses, then room for its sampled rows (upload)
            inputs = torch.zeros(sum(field_sizes(*sizes)) + max_seqs, dtype=torch.int32,
                                 device=runner.device)
            args = unpack(inputs, sizes, sizes, num_decodes=sizes[1])
            whole = support == "always" or (support == "decode" and kind == "decode")
            ends_in_logits = whole and kind == "decode" and self.logits is not None
            forward = self.decode_forward(runner) if ends_in_logits else runner.forward
            plans.append((kind, size, sizes, inputs, args, whole, ends_in_logits, forward))
        # uploads staged in rows of pinned memory, in turn (kernels/host_copy.py); each row's
        # event marks when the GPU has read it
        self.staging = torch.zeros(len(runner.sampled) + 1, max(p[3].numel() for p in plans),
                                   dtype=torch.int32, pin_memory=True)
        self.staged = [torch.cuda.Event() for _ in self.staging]
        self.row = 0
        copy(self.staging[0, :1], plans[0][3][:1])  # compiled now, not at the first step
        with compile_ahead(runner.model):  # the whole graphs' Triton kernels, all at once
            for _, _, _, _, args, whole, _, forward in plans:
                if whole:
                    forward(*args)
        for kind, size, sizes, inputs, args, whole, ends_in_logits, forward in plans:
            graph = (FullGraph(forward, args, pool, runner.model) if whole else
                     PiecewiseGraph(runner, args, q, out, pool))
            graph.sizes, graph.inputs, graph.ends_in_logits = sizes, inputs, ends_in_logits
            self.graphs[kind, size] = graph
            if ends_in_logits:  # its rows drawn by sampling graphs of the same size, one a slot
                self.samplers[size] = [self.capture_sampler(size, slot)
                                       for slot in runner.sampled]
        if runner.backend.cascade is not None:  # the decode graphs' twins: attention/cascade.py
            runner.backend.cascade.capture_twins(runner, self)
        self.capture_seconds = time.perf_counter() - start  # what they cost: bench.py prints it
        self.capture_bytes = torch.cuda.memory_reserved(runner.device) - memory
        if hasattr(runner, "tp"):  # destroyed before NCCL shuts down (TPGroup.close)
            runner.tp.graphs = [self.graphs, self.samplers]
            if runner.backend.cascade is not None:
                runner.tp.graphs.append(runner.backend.cascade.twins)

    def decode_forward(self, runner):
        """A decode step as its graph holds it: placeholders filled from the last steps' tokens,
        the forward, then the logits of every row (one GEMM, into the shared buffer)."""
        def forward(input_ids, positions, meta):
            fill_placeholders(input_ids, runner.sampled)
            hidden = runner.forward(input_ids, positions, meta)
            head = runner.model.lm_head.weight
            return torch.mm(hidden, head.t(), out=self.logits[:len(input_ids)])
        return forward

    @staticmethod
    def sizes(kind: str, size: int, max_seqs: int, width: int) -> tuple[int, int, int, int]:
        """(tokens, sequences, query tiles, block table width) of a graph."""
        if kind == "decode":
            return size, size, 0, width
        num_seqs = min(size, max_seqs)
        return size, num_seqs, size // QUERY_TILE + num_seqs, width

    def find(self, step: StepInputs):
        """The graph a step runs in: the smallest of its kind that holds it."""
        if step.num_decodes == len(step.context_lens):
            size = next(s for s in self.decode_sizes if s >= step.num_decodes)
            return self.graphs["decode", size]
        size = next(s for s in self.token_sizes if s >= len(step.input_ids))
        return self.graphs["mixed", size]

    def run(self, step: StepInputs, runner) -> torch.Tensor | None:
        """Upload the step into the inputs of the graph that holds it and replay the graph: the
        logits of the rows that sample (None on tensor-parallel ranks other than 0)."""
        graph = self.find(step)
        flat = upload(step, graph.sizes, graph.inputs, self.stage())
        self.staged[self.row].record()
        if not graph.ends_in_logits and min(step.input_ids) < 0:  # the token ids lead the upload
            runner.fill_placeholders(flat[:len(step.input_ids)])
        meta = None  # the eager attention between a piecewise graph's pieces takes views of them
        if graph.eager_attention:
            meta = unpack(flat, graph.sizes, step_sizes(step), step.num_decodes, step)[2]
        if runner.backend.cascade is not None:  # perhaps its twin that reads shared prefixes once
            graph = runner.backend.cascade.prepare(runner, step, meta, graph)
        hidden = graph.replay(meta)
        rows = flat[flat.numel() - len(step.sample_rows):]
        if not graph.ends_in_logits:
            return runner.model.compute_logits(hidden[rows])
        if len(rows) != step.num_decodes:  # a new n-sample request's prompt ends in a decode row
            return hidden[rows]
        self.sampleable = hidden[:len(rows)]  # one row each: `sample` may draw them in a graph
        return self.sampleable

    def stage(self) -> torch.Tensor:
        """The next row of the staging memory, once the GPU has read what it last held."""
        self.row = (self.row + 1) % len(self.staging)
        self.staged[self.row].synchronize()  # long since, but for a failed launch's upload
        return self.staging[self.row]

    def sample(self, logits: torch.Tensor, t, slot: int = 0) -> torch.Tensor | None:
        """The next tokens of a decode graph's logits (all its rows, as `run` returned them), if
        sampled plainly (SamplingTensors `t`, layers/sampler.py: temperature or greedy): drawn by a
        captured gumbel_max_sample of the graph's size into the slot of the model runner's sampled
        tokens. Else None."""
        if logits is not self.sampleable or not t.one_pass:
            return None
        n = len(logits)
        size = next(s for s in self.decode_sizes if s >= n)
        self.temperatures[:n].copy_(t.temperatures)
        graph, out = self.samplers[size][slot]
        graph.replay()
        return out[:n]

    def capture_sampler(self, size: int, tokens: torch.Tensor) -> tuple:
        """gumbel_max_sample of `size` rows of the shared logits, into `tokens`: the graph and its
        output."""
        args, out = (self.logits[:size], self.temperatures[:size]), tokens[:size]
        gumbel_max_sample(*args, out=out)  # warm up: compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            gumbel_max_sample(*args, out=out)
        return graph, out
