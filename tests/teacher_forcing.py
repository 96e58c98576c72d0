"""Teacher-forced logits through the real engine path (scheduler, chunked prefill, prefix cache,
CUDA graphs).

Sampling is replaced by the next token of a fixed sequence, so the logits of two implementations
can be compared position by position even where greedy decoding of near-flat logits would diverge.
"""
import torch

from nanovllm import SamplingParams
from nanovllm.worker.step_inputs import step_inputs


def engine_logits(llm, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """For each sequence, the logits [len - prompt_len, vocab] predicting tokens
    prompt_len.. of it."""
    seqs = []
    for tokens, p in zip(sequences, prompt_lens):
        params = SamplingParams(max_tokens=len(tokens) - p, ignore_eos=True)
        seq = llm.input_processor.make_sequence(tokens[:p], params)
        llm.scheduler.waiting.append(seq)
        seqs.append((seq, tokens))
    full = {seq.seq_id: tokens for seq, tokens in seqs}
    rows = {seq.seq_id: [] for seq, _ in seqs}
    while llm.scheduler.has_unfinished():
        batch = llm.scheduler.schedule()
        logits = llm.model_runner.execute(
            step_inputs(batch, llm.config.kvcache_block_size)).float().cpu()
        forced = [full[seq.seq_id][position] for seq, _, position in batch.sampled]
        for seq, row, _ in batch.sampled:
            rows[seq.seq_id].append(logits[row])
        llm.scheduler.update(batch, forced, None, llm.output_processor.check_stop)
    return [torch.stack(rows[seq.seq_id]) for seq, _ in seqs]


def hf_logits(model, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """The same logits from a transformers model, one full forward per sequence."""
    out = []
    with torch.no_grad():
        for tokens, p in zip(sequences, prompt_lens):
            ids = torch.tensor([tokens], device=model.device)
            out.append(model(ids).logits[0, p - 1:len(tokens) - 1].float().cpu())
    return out


def rel_error(a: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """||a - ref|| / ||ref|| over all positions of all sequences."""
    a, ref = torch.cat(a).double(), torch.cat(ref).double()
    return ((a - ref).norm() / ref.norm()).item()
