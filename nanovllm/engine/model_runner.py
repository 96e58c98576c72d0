"""The model runner: turns a scheduled batch into tensors, runs the model, samples.

It owns the model, the KV cache (one pair of paged tensors per layer), the CPU block pool of swap
preemption, and the attention backend; before each forward it makes the step's block copies.
`prepare` is the bridge from the CPU-side block tables to the GPU: new tokens, their positions,
their cache slots and the per-sequence context lengths, packed into one AttentionMetadata.
"""
import torch

from nanovllm.attention import AttentionMetadata, get_backend
from nanovllm.config import CPU_KVCACHE_BYTES, Config
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingTensors, logprobs, sample
from nanovllm.models import model_class
from nanovllm.utils.loader import init_dummy, load_model


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
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.num_cpu_blocks = self._allocate_swap_space()

    def _make_backend(self, cfg: dict):
        num_heads = cfg["num_attention_heads"] // self.config.tensor_parallel_size
        num_kv_heads = max(1, cfg["num_key_value_heads"] // self.config.tensor_parallel_size)
        return get_backend(self.config.attn_backend)(num_heads, num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                                     self.config)

    def _allocate_kv_cache(self) -> int:
        """One [num_blocks, block_size, num_kv_heads, head_dim] K and V tensor per layer."""
        attns = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        num_kv_heads = attns[0].num_kv_heads
        block_bytes = 2 * len(attns) * self.block_size * num_kv_heads * self.head_dim * self.config.torch_dtype.itemsize
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks < 0:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - total * (1 - self.config.gpu_memory_utilization)
            else:
                budget = CPU_KVCACHE_BYTES
            num_blocks = int(budget // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (one block takes {block_bytes} bytes); "
                             "raise gpu_memory_utilization or lower max_model_len")
        shape = (2, len(attns), num_blocks, self.block_size, num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        for i, attn in enumerate(attns):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
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

    def _tensor(self, data, dtype=torch.int32) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])

    def prepare(self, batch: ScheduledBatch):
        """Input ids, positions and attention metadata for the new tokens of the batch."""
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
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill, slot_mapping=self._tensor(slots), context_lens=self._tensor(context_lens),
            block_tables=self._block_tables(batch.seqs))
        if batch.is_prefill:
            meta.cu_seqlens_q, meta.cu_seqlens_k = self._tensor(cu_q), self._tensor(cu_k)
            meta.max_seqlen_q = max(batch.num_new_tokens)
            meta.max_seqlen_k = max(context_lens)
            meta.has_prefix = cu_k[-1] != cu_q[-1]
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta, cu_q

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
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list | None]:
        """One forward step of the batch; returns the next token of each sample row and, when some sequence asks,
        their log-probabilities (a row per sequence, n rows for the prompt of a new n-sample request)."""
        self.move_blocks(batch)
        input_ids, positions, meta, cu_q = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        last = self._tensor(cu_q[1:], torch.int64) - 1  # the last new token of each sequence
        logits = self.model.compute_logits(hidden[last]).float()
        rows = [(seq, seq.sample_index + j) for seq, k in zip(batch.seqs, batch.num_samples) for j in range(k)]
        if len(rows) > len(batch.seqs):  # the n samples of a new request draw from its one prompt row
            logits = logits.repeat_interleave(self._tensor(batch.num_samples, torch.int64), dim=0)
        token_ids = sample(logits, self.sampling_tensors(rows))
        return token_ids.tolist(), logprobs(logits, token_ids, [seq.params.logprobs for seq, _ in rows])
