"""A CUDA graph's one-copy upload (worker/cuda_graphs.py), checked on the CPU: read back through
`unpack`, it holds what `to_tensors` builds field by field, and its padding is inert (padding tokens
write to slot -1, padding sequences have no tokens and no keys, padding tiles no sequence)."""
import torch

from nanovllm.worker.cuda_graphs import CUDAGraphs, field_sizes, step_sizes, unpack, upload
from nanovllm.worker.step_inputs import StepInputs, to_tensors
from nanovllm.kernels.prefill import QUERY_TILE


def mixed_step() -> StepInputs:
    """Two decodes (tables of 3 and 1 blocks), then a 70-token prefill chunk (2 blocks)."""
    return StepInputs(input_ids=[5, -2] + list(range(100, 170)),
                      positions=[40, 7] + list(range(70)),
                      slot_mapping=[50, 301] + list(range(400, 470)), cu_seqlens_q=[0, 1, 2, 72],
                      context_lens=[41, 8, 70], block_tables=[[3, 9, 2], [18], [25, 26]],
                      num_decodes=2, sample_rows=[0, 1, 71])


def test_upload_reads_back_as_to_tensors_with_inert_padding():
    step = mixed_step()
    layout = CUDAGraphs.sizes("mixed", 128, max_seqs=8, width=6)
    into = torch.full((sum(field_sizes(*layout)) + 8,), 12345, dtype=torch.int32)
    flat = upload(step, layout, into)
    assert flat.data_ptr() == into.data_ptr()
    ids, positions, meta = unpack(flat, layout, step_sizes(step), step.num_decodes, step)
    want_ids, want_positions, want, want_rows = to_tensors(step, torch.device("cpu"))
    assert ids.tolist() == want_ids.tolist() and positions.tolist() == want_positions.tolist()
    for name in ("slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens", "block_tables"):
        assert getattr(meta, name).tolist() == getattr(want, name).tolist(), name
    assert meta.query_tiles.tolist() == [[2, 1], [2, 0]]  # the chunk's 2 tiles, last one first
    assert flat[len(flat) - len(step.sample_rows):].tolist() == want_rows.tolist()
    # the whole layout, padding included, as the graph reads it
    tokens, seqs, tiles, width = layout
    full = unpack(flat, layout, (tokens, seqs, tiles, width), step.num_decodes)[2]
    assert full.slot_mapping[72:].eq(-1).all()  # padding tokens write nowhere
    assert full.cu_seqlens_q[3:].eq(72).all() and full.cu_seqlens_k[3:].eq(41 + 8 + 70).all()
    assert full.context_lens[3:].eq(0).all()
    assert full.query_tiles[2:].eq(-1).all()  # no sequence
    assert full.block_tables.tolist()[:3] == [[3, 9, 2, 0, 0, 0], [18, 0, 0, 0, 0, 0],
                                              [25, 26, 0, 0, 0, 0]]
    assert tiles == 128 // QUERY_TILE + seqs


def test_uploads_of_a_run_read_back_as_to_tensors(tmp_path):
    """Every step of a CPU run with prompts of many lengths, chunked prefill and n = 3 samples,
    uploaded into the smallest graph layout that holds it, reads back as `to_tensors` builds it."""
    import random

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nanovllm import LLM, SamplingParams
    from nanovllm.worker.cuda_graphs import token_ladder
    cfg = Qwen3Config(vocab_size=1001, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=2048)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, num_kvcache_blocks=200,
              kvcache_block_size=16, max_num_batched_tokens=256, max_num_seqs=32, device="cpu")
    runner, kinds = llm.model_runner, set()
    step_inputs = runner.step_inputs

    def checked(batch):
        step = step_inputs(batch)
        if not step.input_ids:
            return step
        decode = step.num_decodes == len(step.context_lens)
        size = len(step.context_lens) if decode else next(
            s for s in token_ladder(256) if s >= len(step.input_ids))
        layout = CUDAGraphs.sizes("decode" if decode else "mixed", size, 32, width=128)
        flat = upload(step, layout, torch.zeros(sum(field_sizes(*layout)) + 32, dtype=torch.int32))
        ids, positions, meta = unpack(flat, layout, step_sizes(step), step.num_decodes, step)
        want_ids, want_positions, want, want_rows = to_tensors(step, torch.device("cpu"))
        assert ids.tolist() == want_ids.tolist() and positions.tolist() == want_positions.tolist()
        for name in ("slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens",
                     "block_tables"):
            assert getattr(meta, name).tolist() == getattr(want, name).tolist(), name
        assert flat[len(flat) - len(step.sample_rows):].tolist() == want_rows.tolist()
        kinds.add(decode)
        return step
    runner.step_inputs = checked
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(1, 300))] for _ in range(30)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 3]),
                             ignore_eos=True) for _ in prompts]
    llm.generate(prompts, params, use_tqdm=False)
    assert kinds == {True, False}
