"""The model runner: turns a scheduled batch into tensors, runs the model, samples.

It owns the model, the KV cache (one pair of paged tensors per layer), the CPU block pool of swap
preemption, and the attention backend; before each forward it makes the step's block copies.
`prepare` is the bridge from the CPU-side block tables to the GPU: new tokens, their positions,
their cache slots and the per-sequence context lengths, packed into one AttentionMetadata.
"""
import logging

import torch

from nanovllm.attention import AttentionMetadata, get_backend
from nanovllm.config import CPU_KVCACHE_BYTES, Config
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence, num_blocks_for
from nanovllm.layers.sampler import SamplingTensors, logprobs, sample
from nanovllm.models import model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.loader import init_dummy, load_model

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: Config):
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.kvcache_block_size
        cfg = config.hf_config
        builder = model_class(cfg)
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.backend = self._make_backend(cfg)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        with torch.device(self.device):
            self.model = builder(cfg, self.backend).eval()
        torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        self.graphs = {}
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.num_cpu_blocks = self._allocate_swap_space()
        use_graphs = self.device.type == "cuda" and config.attn_backend != "sdpa" and not config.enforce_eager
        if use_graphs:
            self.capture_cudagraphs()

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
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (a block takes {block_bytes / 2**20:.1f} MiB): "
                             "raise gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs")
        self._bind_kv_cache(num_blocks)
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

    def move_blocks(self, batch: ScheduledBatch):
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
        """Run the largest prefill and the largest sampling batch once, so their peak memory is known."""
        torch.cuda.reset_peak_memory_stats(self.device)
        length = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // length, self.config.max_num_seqs))
        seqs = [Sequence([0] * length, SamplingParams(), self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.block_table = [0] * num_blocks_for(length, self.block_size)  # every token writes into block 0
        self.run(ScheduledBatch(seqs, [length] * num_seqs, is_prefill=True))
        logits = torch.randn(self.config.max_num_seqs, self.config.hf_config["vocab_size"], device=self.device)
        params = [SamplingParams(temperature=1.0, top_p=0.9)] * self.config.max_num_seqs
        sample(logits, self.sampling_tensors([(Sequence([0], p, self.block_size), 0) for p in params]))

    def _tensor(self, data, dtype=torch.int32) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _upload(self, *parts: list[int]) -> list[torch.Tensor]:
        """Copy several int lists to the device in one transfer; one int32 tensor per list."""
        flat = self._tensor([x for part in parts for x in part])
        return list(flat.split([len(part) for part in parts]))

    @staticmethod
    def _padded_block_tables(seqs: list[Sequence]) -> tuple[list[int], int]:
        width = max(len(s.block_table) for s in seqs)
        return [b for s in seqs for b in s.block_table + [0] * (width - len(s.block_table))], width

    def prepare(self, batch: ScheduledBatch):
        """Input ids, positions and attention metadata for the new tokens of the batch."""
        return self.prepare_prefill(batch) if batch.is_prefill else self.prepare_decode(batch.seqs)

    def prepare_prefill(self, batch: ScheduledBatch):
        """Prefill: each sequence computes tokens num_computed_tokens.. (a whole prompt or a chunk of it)."""
        input_ids, positions, slots, cu_q, cu_k, context_lens = [], [], [], [0], [0], []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            for b in range(start // bs, (end + bs - 1) // bs):  # slots run block by block
                first = seq.block_table[b] * bs
                slots += range(first + max(start - b * bs, 0), first + min(end - b * bs, bs))
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            context_lens.append(end)
        tables, width = self._padded_block_tables(batch.seqs)
        ids, pos, slot_mapping, cu_q_t, cu_k_t, ctx, tables = self._upload(
            input_ids, positions, slots, cu_q, cu_k, context_lens, tables)
        meta = AttentionMetadata(True, slot_mapping, ctx, tables.view(len(batch.seqs), width), cu_q_t, cu_k_t,
                                 max(batch.num_new_tokens), max(context_lens), has_prefix=cu_k[-1] != cu_q[-1])
        return ids, pos, meta

    def prepare_decode(self, seqs: list[Sequence]):
        """Decode: one new token per sequence, its last one, at position len - 1."""
        bs = self.block_size
        lens = [len(s) for s in seqs]
        slots = [s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lens)]
        tables, width = self._padded_block_tables(seqs)
        ids, pos, slot_mapping, ctx, tables = self._upload(
            [s.token_ids[-1] for s in seqs], [n - 1 for n in lens], slots, lens, tables)
        return ids, pos, AttentionMetadata(False, slot_mapping, ctx, tables.view(len(seqs), width))

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
        self.graphs, pool = {}, None
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
    def compute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward step of the batch: float32 logits [num_seqs, vocab] at each sequence's last new token."""
        self.move_blocks(batch)
        input_ids, positions, meta = self.prepare(batch)
        if not batch.is_prefill and self.graphs:
            hidden = self._replay(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if batch.is_prefill:
            hidden = hidden[meta.cu_seqlens_q[1:] - 1]  # the last new token of each sequence
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list | None]:
        """One forward step of the batch; returns the next token of each sample row and, when some sequence asks,
        their log-probabilities (a row per sequence, n rows for the prompt of a new n-sample request)."""
        logits = self.compute_logits(batch)
        rows = [(seq, seq.sample_index + j) for seq, k in zip(batch.seqs, batch.num_samples) for j in range(k)]
        if len(rows) > len(batch.seqs):  # the n samples of a new request draw from its one prompt row
            logits = logits.repeat_interleave(self._tensor(batch.num_samples, torch.int64), dim=0)
        token_ids = sample(logits, self.sampling_tensors(rows))
        return token_ids.tolist(), logprobs(logits, token_ids, [seq.params.logprobs for seq, _ in rows])
