"""The model runner: turns a scheduled batch into tensors, runs the model, samples.

It owns the model, the KV cache (one pair of paged tensors per layer) and the attention backend.
`step_inputs` is the bridge from the CPU-side block tables to the model: new tokens, their
positions, their cache slots and the per-sequence context lengths, as plain lists; `prepare` turns
them into tensors and one AttentionMetadata. With tensor parallelism, rank 0 sends those lists to
the other ranks (nanovllm/engine/distributed.py) and every rank `execute`s the same step.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanovllm.attention import AttentionMetadata, get_backend
from nanovllm.config import CPU_KVCACHE_BYTES, Config
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.linear import tensor_parallel
from nanovllm.layers.sampler import SamplingTensors, sample
from nanovllm.models import model_class
from nanovllm.utils.loader import init_dummy, load_model

if TYPE_CHECKING:
    from nanovllm.engine.distributed import TPGroup


@dataclass
class StepInputs:
    """One forward pass as plain lists: all that a tensor-parallel worker is sent each step."""
    is_prefill: bool
    input_ids: list[int]           # the new tokens of all sequences, packed
    positions: list[int]
    slot_mapping: list[int]        # the cache slot of each new token
    context_lens: list[int]        # per sequence: keys after this step (cached + new)
    block_tables: list[list[int]]  # per sequence, unpadded
    cu_seqlens_q: list[int]        # [num_seqs + 1]: sequence i owns new tokens cu_seqlens_q[i]:cu_seqlens_q[i+1]
    cu_seqlens_k: list[int]        # [num_seqs + 1]


def step_inputs(batch: ScheduledBatch, bs: int) -> StepInputs:
    """The new tokens of the batch, their positions and cache slots (block size `bs`), each sequence's context."""
    step = StepInputs(batch.is_prefill, [], [], [], [], [s.block_table for s in batch.seqs], [0], [0])
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
        """Build this rank's shard of the model (all of it without `tp`) and its KV cache."""
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
        self.num_kvcache_blocks = self._allocate_kv_cache()
        if tp is not None:
            tp.idle = True  # every rank is built: the workers now wait for steps

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
        if self.tp is not None:  # one block manager (rank 0's) hands out blocks for every rank's cache
            num_blocks = self.tp.min(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (one block takes {block_bytes} bytes); "
                             "raise gpu_memory_utilization or lower max_model_len")
        shape = (2, len(attns), num_blocks, self.block_size, num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        for i, attn in enumerate(attns):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def _tensor(self, data, dtype=torch.int32) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables])

    def prepare(self, step: StepInputs):
        """Input ids, positions and attention metadata of the step, as tensors on this rank's device."""
        meta = AttentionMetadata(
            is_prefill=step.is_prefill, slot_mapping=self._tensor(step.slot_mapping),
            context_lens=self._tensor(step.context_lens), block_tables=self._block_tables(step.block_tables))
        if step.is_prefill:
            cu_q, cu_k = step.cu_seqlens_q, step.cu_seqlens_k
            meta.cu_seqlens_q, meta.cu_seqlens_k = self._tensor(cu_q), self._tensor(cu_k)
            meta.max_seqlen_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
            meta.max_seqlen_k = max(step.context_lens)
            meta.has_prefix = cu_k[-1] != cu_q[-1]
        return self._tensor(step.input_ids, torch.int64), self._tensor(step.positions, torch.int64), meta

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """Per-row sampling settings; truncation tensors only when some row uses them."""
        ps = [s.params for s in seqs]
        vocab = self.config.hf_config["vocab_size"]
        temps = [0.0 if p.greedy else p.temperature for p in ps]
        top_ks = [p.top_k if p.top_k > 0 else vocab for p in ps]
        return SamplingTensors(
            temperatures=self._tensor(temps, torch.float32),
            top_ks=self._tensor(top_ks, torch.int64) if min(top_ks) < vocab else None,
            top_ps=self._tensor([p.top_p for p in ps], torch.float32) if any(p.top_p < 1 for p in ps) else None,
            min_ps=self._tensor([p.min_p for p in ps], torch.float32) if any(p.min_p > 0 for p in ps) else None,
            seeds=[(i, hash((p.seed, s.num_tokens)) & (2**63 - 1)) for i, (p, s) in enumerate(zip(ps, seqs))
                   if p.seed is not None and not p.greedy],
            all_greedy=all(t == 0 for t in temps))

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass, on every rank: logits [num_seqs, vocab] of each sequence's last new token
        (None on ranks other than 0)."""
        input_ids, positions, meta = self.prepare(step)
        hidden = self.model(input_ids, positions, meta)
        last = self._tensor(step.cu_seqlens_q[1:], torch.int64) - 1
        return self.model.compute_logits(hidden[last])

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """One step of the batch (rank 0); returns the next token of each sequence."""
        step = step_inputs(batch, self.block_size)
        if self.tp is not None:
            self.tp.send_step(step)  # the other ranks run the same forward pass on their shards
        logits = self.execute(step).float()
        if self.tp is not None:
            self.tp.idle = True
        return sample(logits, self.sampling_tensors(batch.seqs)).tolist()
