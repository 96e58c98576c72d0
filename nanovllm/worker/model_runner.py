"""The model runner: one forward step on this rank's device (nano-vllm's ModelRunner).

It owns the model, its attention backend, the KV cache (worker/kv_cache.py) and, on CUDA, the CUDA
graphs (worker/cuda_graphs.py). A step crosses from the CPU side to the GPU side in two moves:
`step_inputs` turns the scheduler's batch into plain lists and `to_tensors` into tensors on the
device (worker/step_inputs.py); `execute` runs the model (or replays a graph) and returns the logits
of the rows that sample. `run` (rank 0) also picks the next tokens (argmax for greedy rows, else
nanovllm/layers/sampler.py), and returns before the GPU is done.
"""
import os

import torch

from nanovllm.attention import get_backend
from nanovllm.config import Config
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.layers.sampler import sample_batch
from nanovllm.models import model_class
from nanovllm.utils.loader import load_model
from nanovllm.worker.kv_cache import CPU_KVCACHE_BYTES, KVCache
from nanovllm.worker.run_ahead import fill_placeholders
from nanovllm.worker.step_inputs import StepInputs, step_inputs, to_tensors


class ModelRunner:
    def __init__(self, config: Config, device: torch.device | None = None):
        """Build the model, its KV cache and, on CUDA, its CUDA graphs. (Tensor parallelism builds
        one shard per rank: TPModelRunner, nanovllm/worker/distributed.py.)"""
        self.config = config
        self.device = device or torch.device("cuda:0" if config.device == "cuda" else "cpu")
        # on CUDA, Triton kernels (imported only where they run): sampling in one pass over the
        # logits (kernels/sample.py), steps of a few rows through fused GEMVs (fused_decode.py),
        # the sampled tokens to pinned memory by a kernel (kernels/host_copy.py)
        self.one_pass_sample = self.small_batch = self.copy_to_host = None
        if self.device.type == "cuda":
            # cuBLAS without a workspace, unless the user set one (before any GEMM of the process):
            # at decode batch sizes its split-K GEMMs, each with a reduce kernel after it, give
            # way to one kernel each (docs/benchmarks.md, "Busy under serving load")
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")
            torch.cuda.set_device(self.device)
            from nanovllm.kernels.host_copy import copy
            from nanovllm.kernels.sample import gumbel_max_sample
            from nanovllm.layers import fused_decode
            self.one_pass_sample, self.small_batch = gumbel_max_sample, fused_decode
            self.copy_to_host = copy
        cfg = config.hf_config
        self.backend = get_backend(config.attn_backend)(*self.heads(), cfg["head_dim"], config)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        with torch.device(self.device):
            self.model = self.build_model()
        torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            from nanovllm.utils.dummy_weights import init_dummy
            init_dummy(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        # the sampled tokens of the steps not read yet, a slot each (worker/run_ahead.py)
        self.sampled = torch.zeros(config.steps_ahead + 1, config.max_num_seqs,
                                   dtype=torch.int64, device=self.device)
        self.sampled_host = None  # on CUDA, the same in pinned memory, where each step's land
        if self.copy_to_host is not None:
            self.sampled_host = torch.zeros_like(self.sampled, device="cpu", pin_memory=True)
            self.copy_to_host(self.sampled[0, :1], self.sampled_host[0, :1])  # compiled now
        self.eos_token_ids: set[int] = set()  # the engine's, for min_tokens
        # a greedy step's argmax by one_pass_sample at temperature 0 (no kernel fills these)
        self.greedy = (torch.zeros(config.max_num_seqs, device=self.device),
                       torch.zeros(1, dtype=torch.int64, device=self.device))
        self.swap_space = self.graphs = None
        self.kv_cache = KVCache(self.model, config, self.device)
        self.kv_cache.allocate(self.num_kv_blocks())
        if config.preemption_mode == "swap":
            from nanovllm.core.swap import SwapSpace
            self.swap_space = SwapSpace(self.kv_cache.tensor, config.swap_space)
        if self.device.type == "cuda" and not config.enforce_eager:
            from nanovllm.worker.cuda_graphs import CUDAGraphs
            self.graphs = CUDAGraphs(self)

    def heads(self) -> tuple[int, int]:
        cfg = self.config.hf_config
        return cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def build_model(self) -> torch.nn.Module:
        return model_class(self.config.hf_config)(self.config.hf_config, self.backend).eval()

    def num_kv_blocks(self) -> int:
        """num_kvcache_blocks, or what fits in memory."""
        if self.config.num_kvcache_blocks > 0:
            return self.config.num_kvcache_blocks
        if self.device.type == "cpu":
            return CPU_KVCACHE_BYTES // self.kv_cache.block_bytes
        from nanovllm.worker.memory_profile import num_blocks_that_fit
        return num_blocks_that_fit(self)

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor | None:
        """One forward pass, on every rank: the logits [rows, vocab] of the rows that sample (None
        on ranks other than 0). Block copies first: swap in, swap out, copy-on-write."""
        if self.swap_space is not None:
            self.swap_space.move(step.swap_in, step.swap_out)
        self.kv_cache.copy_blocks(step.copies)
        if not step.input_ids:  # it preempted all it had to run: its swaps are the whole step
            return None
        if self.graphs is not None:  # uploaded in one copy, replayed (worker/cuda_graphs.py)
            return self.graphs.run(step, self)
        input_ids, positions, meta, sample_rows = to_tensors(step, self.device)
        if min(step.input_ids) < 0:
            self.fill_placeholders(input_ids)
        if self.backend.cascade is not None:  # shared prefixes read once: attention/cascade.py
            self.backend.cascade.prepare(self, step, meta, None)
        return self.model.compute_logits(self.forward(input_ids, positions, meta)[sample_rows])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model's hidden states of a step; a step of a few rows takes the fused path."""
        if self.small_batch is not None and len(input_ids) <= self.small_batch.MAX_STEP_ROWS:
            return self.small_batch.forward(self.model, input_ids, positions, meta)
        return self.model(input_ids, positions, meta)

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        return step_inputs(batch, self.config.kvcache_block_size)

    def fill_placeholders(self, input_ids: torch.Tensor):
        """Put the tokens the last steps sampled in place of their placeholders (run_ahead.py)."""
        fill_placeholders(input_ids, self.sampled)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list | None]:
        """Launch one step of the batch and its sampling, without waiting for the GPU: the next
        token of each sample row (a row per sampling sequence, n rows for the prompt of a new
        n-sample request) and, when asked, their log-probabilities (which do wait). They go into
        the batch's slot of `sampled`, where the steps after it fill their placeholders from (on
        CUDA also into its slot of `sampled_host`, where the engine reads them)."""
        logits = self.execute(self.step_inputs(batch))
        if not batch.seqs:  # only block moves: nothing sampled
            return torch.empty(0, dtype=torch.int64), None
        slot = self.sampled[batch.slot, :len(batch.sampled)]
        params = [seq.params for seq in batch.seqs]
        top = None
        if all(p.greedy and not p.penalized and p.logprobs is None for p in params):
            if self.one_pass_sample is None:
                torch.argmax(logits, -1, out=slot)
            else:
                zeros, seed = self.greedy
                self.one_pass_sample(logits, zeros[:len(slot)], seed, out=slot)
        else:  # penalties, temperature, seeds, truncation, log-probabilities: layers/sampler.py
            token_ids, top = sample_batch(logits, batch, self)
            if token_ids.data_ptr() != slot.data_ptr():  # (a sampler graph draws into the slot)
                slot.copy_(token_ids)
        if self.sampled_host is None:
            return slot, top
        return self.copy_to_host(slot, self.sampled_host[batch.slot, :len(slot)]), top
