"""What a persistent batch would save on the inputs of a steady decode step: `python
benchmarks/persistent_inputs.py` (CPU).

Today every step rebuilds its inputs as Python lists (worker/step_inputs.py) and flattens them for
the graph upload (worker/cuda_graphs.py upload). vLLM v1 keeps a batch's per-row state in arrays
across steps instead (its InputBatch), so a decode row only advances: position + 1, its slot from
its block table, its context + 1. This times both on the same 256 decode rows of a tiny random
Qwen3 (benchmarks/host_step.py's setup): the engine's step_inputs + upload, and numpy advancing
arrays laid out as the graph's upload, then one copy. It does not handle what a real one must:
rows that end, join or get a new block between steps.
"""
import os
import sys
import tempfile
from dataclasses import replace

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_step  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.engine import cuda_graphs  # noqa: E402


def main():
    config = Qwen3Config(vocab_size=10001, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=8, max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as path:
        Qwen3ForCausalLM(config).save_pretrained(path)
        llm = LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=3000, device="cpu",
                  async_scheduling=True)
        prompts, params = host_step.requests("random", 640, 256, 80)
        for prompt, p in zip(prompts, params):
            llm.add_request(prompt, replace(p, output_kind="final"))
        for _ in range(12):  # prefill, then decode
            llm.step()
        batch, runner = llm.scheduler.schedule(), llm.model_runner
        rows, bs = len(batch.seqs), llm.config.kvcache_block_size
        width = -(-llm.config.max_model_len // bs)
        sizes = (rows, rows, 0, width)
        fields = cuda_graphs.field_sizes(*sizes)
        into = torch.zeros(sum(fields) + rows, dtype=torch.int32)
        lists = host_step.mean_us(lambda: cuda_graphs.upload(runner.step_inputs(batch), sizes,
                                                             into), 300)
        # the same layout as numpy views, filled once, then advanced each step
        flat = np.zeros(into.numel(), dtype=np.int32)
        ids, positions, slots, cu_q, cu_k, lens, _, tables = np.split(flat, np.cumsum(fields))[:8]
        tables = tables.reshape(rows, width)
        for row, seq in enumerate(batch.seqs):
            tables[row, :len(seq.block_table)] = seq.block_table
        positions[:rows] = [seq.num_computed_tokens - 2 for seq in batch.seqs]  # a step before
        cu_q[:rows + 1] = np.arange(rows + 1)
        index = np.arange(rows)
        flat[len(flat) - rows:] = index  # the sampled rows' token indices

        def advance():
            positions[:rows] += 1
            lens[:rows] = positions[:rows] + 1
            slots[:rows] = tables[index, positions[:rows] // bs] * bs + positions[:rows] % bs
            ids[:rows] = -1 - index  # each row's placeholder: last step's token (run_ahead.py)
            np.cumsum(lens[:rows], out=cu_k[1:rows + 1])
            into.copy_(torch.from_numpy(flat))
        advance()  # to the scheduled step: the same upload as the engine's, padding aside
        engine = cuda_graphs.upload(runner.step_inputs(batch), sizes, torch.zeros_like(into))
        padding = np.concatenate([np.arange(o + rows + (f > rows), o + f)
                                  for o, f in zip(np.cumsum([0] + fields[:-1]), fields[:6])])
        same = engine.numpy() == flat
        same[padding] = True  # (the engine pads; these arrays would keep stale values there)
        assert same.all(), np.flatnonzero(~same)[:10]
        arrays = host_step.mean_us(advance, 300)
    print(f"{rows} decode rows, this machine's CPU: step_inputs + upload {lists:,.0f} us; "
          f"arrays kept across steps {arrays:,.0f} us")


if __name__ == "__main__":
    main()
