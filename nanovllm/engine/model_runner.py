"""The model runner: turns a scheduled batch into tensors, runs the model, samples.

It owns the model, the KV cache (one pair of paged tensors per layer), the CPU block pool of swap
preemption, and the attention backend. `step_inputs` is the bridge from the CPU-side block tables
to the model: new tokens, their positions, their cache slots, the per-sequence context lengths and
the step's block copies, as plain lists; `prepare` uploads them and packs one AttentionMetadata.
With tensor parallelism, rank 0 sends those lists to the other ranks (nanovllm/engine/distributed.py)
and every rank `execute`s the same step. `run` returns before the GPU is done: a decode input that the
previous step sampled is a placeholder in the lists, filled in on the device from `last_tokens`.
"""
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanovllm.attention import AttentionMetadata, get_backend
from nanovllm.config import CPU_KVCACHE_BYTES, Config
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence, num_blocks_for, slot_of
from nanovllm.layers.linear import tensor_parallel
from nanovllm.layers.sampler import SamplingTensors, logprobs, sample
from nanovllm.models import model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.loader import init_dummy, load_model

if TYPE_CHECKING:
    from nanovllm.engine.distributed import TPGroup

logger = logging.getLogger(__name__)


@dataclass
class SampledTokens:
    """A launched step's sampled token ids on their way to the host (and their log-probabilities, if asked)."""
    host: torch.Tensor                  # [rows] int64, pinned on CUDA: filled when `ready` is reached
    ready: torch.cuda.Event | None
    logprobs: list | None = None

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # waits for that step only, not for one launched after it
        return self.host.tolist()


@dataclass
class StepInputs:
    """One forward pass as plain lists: all that a tensor-parallel worker is sent each step."""
    is_prefill: bool
    input_ids: list[int]           # the new tokens of all sequences, packed
    positions: list[int]
    slot_mapping: list[int]        # the cache slot of each new token
    context_lens: list[int]        # per sequence: keys after this step (cached + new)
    block_tables: list[list[int]]  # per sequence, unpadded
    cu_seqlens_q: list[int]        # prefill: sequence i owns new tokens cu_seqlens_q[i]:cu_seqlens_q[i+1]
    cu_seqlens_k: list[int]        # prefill: the same over keys (cached + new)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu block, gpu block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)    # copy-on-write (src, dst)


def step_inputs(batch: ScheduledBatch, bs: int) -> StepInputs:
    """The new tokens of the batch, their positions and cache slots (block size `bs`), each sequence's context."""
    tables = [s.block_table for s in batch.seqs]
    if not batch.is_prefill:  # one new token per sequence, its last one, at position len - 1
        lens = [len(s) for s in batch.seqs]
        slots = [slot_of(s.block_table, n - 1, bs) for s, n in zip(batch.seqs, lens)]
        return StepInputs(False, [s.token_ids[-1] for s in batch.seqs], [n - 1 for n in lens], slots, lens, tables,
                          [], [], batch.swap_in, batch.swap_out, batch.copies)
    # prefill: each sequence computes tokens num_computed_tokens.. (a whole prompt or a chunk of it)
    step = StepInputs(True, [], [], [], [], tables, [0], [0], batch.swap_in, batch.swap_out, batch.copies)
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        step.input_ids += seq.token_ids[start:end]
        step.positions += range(start, end)
        for b in range(start // bs, (end + bs - 1) // bs):  # slots run block by block
            first = seq.block_table[b] * bs
            step.slot_mapping += range(first + max(start - b * bs, 0), first + min(end - b * bs, bs))
        step.cu_seqlens_q.append(step.cu_seqlens_q[-1] + n)
        step.cu_seqlens_k.append(step.cu_seqlens_k[-1] + end)
        step.context_lens.append(end)
    return step


class ModelRunner:
    def __init__(self, config: Config, tp: "TPGroup | None" = None):
        """Build this rank's shard of the model (all of it without `tp`), its KV cache and CUDA graphs."""
        self.config = config
        self.tp = tp
        self.device = torch.device("cuda", tp.rank if tp else 0) if config.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.block_size = config.kvcache_block_size
        cfg = config.hf_config
        builder = model_class(cfg)
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.backend = self._make_backend(cfg)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        with torch.device(self.device), tensor_parallel(tp.device_group if tp else None):
            self.model = builder(cfg, self.backend).eval()
        torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        self.graphs, self.last_tokens = {}, None
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.num_cpu_blocks = self._allocate_swap_space()
        use_graphs = self.device.type == "cuda" and config.attn_backend != "sdpa" and not config.enforce_eager
        if use_graphs:
            self.capture_cudagraphs()
        if tp is not None:
            tp.idle = True  # every rank is built: the workers now wait for steps

    def _make_backend(self, cfg: dict):
        num_heads = cfg["num_attention_heads"] // self.config.tensor_parallel_size
        num_kv_heads = max(1, cfg["num_key_value_heads"] // self.config.tensor_parallel_size)
        return get_backend(self.config.attn_backend)(num_heads, num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                                     self.config)

    def _bind_kv_cache(self, num_blocks: int):
        """Allocate one [num_blocks, block_size, num_kv_heads, head_dim] K and V tensor per layer."""
        self.kv_cache = None
        shape = (2, len(self.attns), num_blocks, self.block_size, self.attns[0].num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        for i, attn in enumerate(self.attns):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _allocate_kv_cache(self) -> int:
        """Size the KV cache: what gpu_memory_utilization leaves after the weights and a warm-up pass."""
        self.attns = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        block_bytes = (2 * len(self.attns) * self.block_size * self.attns[0].num_kv_heads * self.head_dim
                       * self.config.torch_dtype.itemsize)
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks < 0 and self.device.type == "cpu":
            num_blocks = CPU_KVCACHE_BYTES // block_bytes
        elif num_blocks < 0:
            self._bind_kv_cache(1)  # the warm-up only needs somewhere to write
            self._warmup()
            self.kv_cache = None
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            stats = torch.cuda.memory_stats(self.device)
            transient = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
            num_blocks = int((total * self.config.gpu_memory_utilization - (total - free) - transient) // block_bytes)
        if self.tp is not None:  # one block manager (rank 0's) hands out blocks for every rank's cache
            num_blocks = self.tp.min(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (a block takes {block_bytes / 2**20:.1f} MiB): "
                             "raise gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs")
        self._bind_kv_cache(num_blocks)
        if self.tp is None or self.tp.rank == 0:
            logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB", num_blocks, self.block_size,
                        num_blocks * self.block_size, num_blocks * block_bytes / 2**30)
        return num_blocks

    def _allocate_swap_space(self) -> int:
        """Swap preemption's CPU block pool: a tensor shaped like the KV cache (pinned on CUDA)."""
        if self.config.preemption_mode != "swap":
            return 0
        shape = list(self.kv_cache.shape)  # [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        block_bytes = self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()
        shape[2] = int(self.config.swap_space * (1 << 30) // block_bytes)
        if shape[2] < 1:
            raise ValueError(f"swap_space={self.config.swap_space} GiB holds no KV block ({block_bytes} bytes)")
        self.cpu_cache = torch.zeros(shape, dtype=self.kv_cache.dtype, pin_memory=self.device.type == "cuda")
        return shape[2]

    def move_blocks(self, batch: "StepInputs"):
        """The step's block copies, each kind one batched index copy over all layers, in the order the scheduler
        made them: swap in (its CPU blocks may be reused by a swap out), swap out (its GPU blocks by a copy),
        copy-on-write (its source may be a swapped-in block)."""
        if batch.swap_in:
            cpu, gpu = map(list, zip(*batch.swap_in))
            self.kv_cache[:, :, gpu] = self.cpu_cache[:, :, cpu].to(self.device)
        if batch.swap_out:
            gpu, cpu = map(list, zip(*batch.swap_out))
            self.cpu_cache[:, :, cpu] = self.kv_cache[:, :, gpu].cpu()
        if batch.copies:
            src, dst = map(list, zip(*batch.copies))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def _warmup(self):
        """Run the largest prefill and the largest sampling batch once, so their peak memory is known
        (every rank runs it on its own, meeting the others in the model's collectives)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        length = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // length, self.config.max_num_seqs))
        seqs = [Sequence([0] * length, SamplingParams(), self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.block_table = [0] * num_blocks_for(length, self.block_size)  # every token writes into block 0
        self.execute(step_inputs(ScheduledBatch(seqs, [length] * num_seqs, is_prefill=True), self.block_size))
        rows = self.config.max_num_seqs
        logits = torch.randn(rows, self.config.hf_config["vocab_size"], device=self.device, dtype=self.config.torch_dtype)
        for params in (SamplingParams(top_p=0.9), SamplingParams()):  # top-p's sort is the sampler's peak
            sample(logits, self.sampling_tensors([(Sequence([0], params, self.block_size), 0)] * rows))

    def _tensor(self, data, dtype=torch.int32) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _upload(self, *parts: list[int]) -> list[torch.Tensor]:
        """Copy several int lists to the device in one transfer; one int32 tensor per list, each starting on a
        16-byte boundary (Triton compiles a kernel once per alignment of its pointers: keep it to one)."""
        sizes = [len(part) + -len(part) % 4 for part in parts]  # 4 int32s = 16 bytes
        flat = [x for part, size in zip(parts, sizes) for x in part + [0] * (size - len(part))]
        return [t[:len(part)] for t, part in zip(self._tensor(flat).split(sizes), parts)]

    def prepare(self, step: StepInputs):
        """Input ids, positions and attention metadata of the step, uploaded to this rank's device in one copy."""
        num_seqs, width = len(step.block_tables), max(len(t) for t in step.block_tables)
        tables = [b for t in step.block_tables for b in t + [0] * (width - len(t))]
        if not step.is_prefill:
            ids, pos, slot_mapping, ctx, tables = self._upload(
                step.input_ids, step.positions, step.slot_mapping, step.context_lens, tables)
            if min(step.input_ids) < 0:
                ids = self._fill_placeholders(ids)
            return ids, pos, AttentionMetadata(False, slot_mapping, ctx, tables.view(num_seqs, width))
        cu_q, cu_k = step.cu_seqlens_q, step.cu_seqlens_k
        ids, pos, slot_mapping, cu_q_t, cu_k_t, ctx, tables = self._upload(
            step.input_ids, step.positions, step.slot_mapping, cu_q, cu_k, step.context_lens, tables)
        max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
        meta = AttentionMetadata(True, slot_mapping, ctx, tables.view(num_seqs, width), cu_q_t, cu_k_t,
                                 max_q, max(step.context_lens), has_prefix=cu_k[-1] != cu_q[-1])
        return ids, pos, meta

    def _fill_placeholders(self, ids: torch.Tensor) -> torch.Tensor:
        """Replace each placeholder -(r + 1) by token r sampled at the previous step, which never left the device
        (rank 0 samples, and sends the filled ids to the other ranks)."""
        if self.tp is None or self.tp.rank == 0:
            ids = torch.where(ids < 0, self.last_tokens[(-ids - 1).clamp(min=0)].int(), ids)
        if self.tp is not None:
            dist.broadcast(ids, group=self.tp.device_group, group_src=0)
        return ids

    def sampling_tensors(self, rows: list[tuple[Sequence, int]]) -> SamplingTensors:
        """Per-row sampling settings of (sequence, sample index) rows; truncation tensors only when some row uses them."""
        ps = [s.params for s, _ in rows]
        vocab = self.config.hf_config["vocab_size"]
        temps = [0.0 if p.greedy else p.temperature for p in ps]
        top_ks = [p.top_k if p.top_k > 0 else vocab for p in ps]
        return SamplingTensors(
            temperatures=self._tensor(temps, torch.float32),
            top_ks=self._tensor(top_ks, torch.int64) if min(top_ks) < vocab else None,
            top_ps=self._tensor([p.top_p for p in ps], torch.float32) if any(p.top_p < 1 for p in ps) else None,
            min_ps=self._tensor([p.min_p for p in ps], torch.float32) if any(p.min_p > 0 for p in ps) else None,
            seeds=[(i, hash((p.seed, k, s.num_tokens)) & (2**63 - 1)) for i, (p, (s, k)) in enumerate(zip(ps, rows))
                   if p.seed is not None and not p.greedy],
            all_greedy=all(t == 0 for t in temps))

    @torch.inference_mode()
    def capture_cudagraphs(self):
        """CUDA graphs for decode: one per batch size of a ladder up to max_num_seqs, sharing one memory pool.

        A decode step is dozens of small kernels per layer; replaying a graph launches them all at
        once. The graph reads its inputs from static tensors that `run` fills before each replay.
        """
        max_bs = self.config.max_num_seqs
        max_blocks = num_blocks_for(self.config.max_model_len, self.block_size)
        hidden_size = self.config.hf_config["hidden_size"]
        self.graph_sizes = sorted({1, 2, 4, 8, *range(16, max_bs, 16), max_bs})
        g = self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            positions=torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int32, device=self.device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=self.device),
            hidden=torch.zeros(max_bs, hidden_size, dtype=self.config.torch_dtype, device=self.device))
        self.graphs, pool = self.tp.graphs if self.tp else {}, None  # TPGroup.close() destroys them before NCCL
        for bs in reversed(self.graph_sizes):
            meta = AttentionMetadata(False, g["slot_mapping"][:bs], g["context_lens"][:bs], g["block_tables"][:bs])
            g["hidden"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs], meta)  # warm up (Triton autotune, workspaces)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                g["hidden"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs], meta)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def _replay(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Copy a decode batch into the static inputs, pad it to the next captured size, replay."""
        n = input_ids.size(0)
        bs = next(b for b in self.graph_sizes if b >= n)
        g = self.graph_vars
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"][n:bs] = -1  # padding rows write nowhere and attend to nothing
        g["slot_mapping"][:n] = meta.slot_mapping
        g["context_lens"][n:bs] = 0
        g["context_lens"][:n] = meta.context_lens
        g["block_tables"][:n, :meta.block_tables.size(1)] = meta.block_tables
        self.graphs[bs].replay()
        return g["hidden"][:n]

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass, on every rank: float32 logits [num_seqs, vocab] at each sequence's last new
        token (None on ranks other than 0)."""
        self.move_blocks(step)
        input_ids, positions, meta = self.prepare(step)
        if not step.is_prefill and self.graphs:
            hidden = self._replay(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if step.is_prefill:
            hidden = hidden[meta.cu_seqlens_q[1:] - 1]  # the last new token of each sequence
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward step of the batch (rank 0): logits [num_seqs, vocab] in the model's dtype."""
        step = step_inputs(batch, self.block_size)
        if self.tp is not None:
            self.tp.send_step(step)  # the other ranks run the same forward pass on their shards
        logits = self.execute(step)
        if self.tp is not None:
            self.tp.idle = True
        return logits

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> SampledTokens:
        """Launch one forward step of the batch and its sampling, without waiting for them: the next token of each
        sample row (a row per sequence, n rows for the prompt of a new n-sample request) and, when some sequence
        asks, their log-probabilities (which do wait). The tokens also stay on the device for the next step."""
        logits = self.compute_logits(batch)
        rows = [(seq, seq.sample_index + j) for seq, k in zip(batch.seqs, batch.num_samples) for j in range(k)]
        if len(rows) > len(batch.seqs):  # the n samples of a new request draw from its one prompt row
            logits = logits.repeat_interleave(self._tensor(batch.num_samples, torch.int64), dim=0)
        self.last_tokens = token_ids = sample(logits, self.sampling_tensors(rows))
        top = logprobs(logits, token_ids, [seq.params.logprobs for seq, _ in rows])
        if self.device.type == "cpu":
            return SampledTokens(token_ids, None, top)
        host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True).copy_(token_ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return SampledTokens(host, ready, top)
