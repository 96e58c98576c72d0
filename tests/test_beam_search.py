"""Beam search: the same beams and scores as transformers' `generate(num_beams=w)`, the exact top-w
of an exhaustive enumeration when the beam is wide enough to keep every prefix, greedy at width 1,
and beams sharing their blocks through fork and copy-on-write."""
import itertools
import random

import pytest
import torch

from nanovllm import SamplingParams
from tests.sharing_helpers import build_tiny_llama, make_llm

EOS = 3


@pytest.fixture(scope="module")
def vocab32(tmp_path_factory):
    """A random Llama with a 32-token vocabulary whose EOS (3) is often among the candidates."""
    path = str(tmp_path_factory.mktemp("vocab32"))
    hf_model = build_tiny_llama(path, vocab_size=32, eos_token_id=EOS)
    with torch.no_grad():
        # more beams end early, so the early-stopping rule matters
        hf_model.lm_head.weight[EOS] *= 2
    hf_model.save_pretrained(path)
    return make_llm(path), hf_model


def prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def hf_beam_search(model, prompt, beam_width, max_tokens, length_penalty):
    """transformers' beams (EOS kept, padding dropped) and their scores, best first."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beam_width,
                             do_sample=False, num_return_sequences=beam_width,
                             max_new_tokens=max_tokens, early_stopping=False,
                             length_penalty=length_penalty, eos_token_id=EOS, pad_token_id=EOS,
                             return_dict_in_generate=True, output_scores=True)
    beams = [row[len(prompt):].tolist() for row in out.sequences]
    beams = [b[:b.index(EOS) + 1] if EOS in b else b for b in beams]
    return beams, out.sequences_scores.tolist()


# (2, 2.0, 10) and (2, 1.0, 10) stop early on some prompts: they fail without transformers'
# early-stopping rule
@pytest.mark.parametrize("beam_width, length_penalty, max_tokens",
                         [(2, 1.0, 6), (3, 0.5, 6), (4, 2.0, 6), (2, 2.0, 10), (2, 1.0, 10)])
def test_beams_equal_transformers_beam_search(vocab32, beam_width, length_penalty, max_tokens):
    llm, hf_model = vocab32
    batch = prompts(6, (3, 40), vocab=32, seed=0)
    results = llm.beam_search(batch, beam_width=beam_width, max_tokens=max_tokens,
                              length_penalty=length_penalty)
    for prompt, beams in zip(batch, results):
        expected, scores = hf_beam_search(hf_model, prompt, beam_width, max_tokens, length_penalty)
        assert [b["token_ids"] for b in beams] == expected
        assert [b["score"] for b in beams] == pytest.approx(scores, abs=1e-4)
        for b in beams:  # cumulative log-probability and score agree, EOS ends the "stop" beams
            n = len(b["token_ids"])
            assert b["score"] == pytest.approx(b["cumulative_logprob"] / n ** length_penalty)
            assert (b["finish_reason"] == "stop") == (b["token_ids"][-1] == EOS)
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)
    assert not llm.scheduler.has_unfinished()


def test_eos_finishes_some_beams(vocab32):
    """The comparison above covers beams ended by EOS, not only by max_tokens."""
    llm, _ = vocab32
    results = llm.beam_search(prompts(6, (3, 40), vocab=32, seed=0), beam_width=3, max_tokens=6)
    assert any(b["finish_reason"] == "stop" for beams in results for b in beams)


def test_wide_beam_finds_the_exact_top_w_of_all_continuations(tmp_path):
    """With w = V^(k-1) beams nothing is ever pruned, so beam search must return the exact top w of
    all V^k continuations, enumerated here with one batched forward of transformers."""
    vocab, steps, width = 6, 3, 36
    hf_model = build_tiny_llama(str(tmp_path), vocab_size=vocab, seed=1)
    llm = make_llm(str(tmp_path), max_num_seqs=width)
    prompt = [1, 4, 2, 5, 0]
    beams = llm.beam_search([prompt], beam_width=width, max_tokens=steps, length_penalty=1.0)[0]
    tails = torch.tensor(list(itertools.product(range(vocab), repeat=steps)))  # [V^k, k]
    ids = torch.cat([torch.tensor(prompt).expand(len(tails), -1), tails], 1)
    with torch.no_grad():
        logp = hf_model(ids).logits[:, len(prompt) - 1:-1].float().log_softmax(-1)  # [V^k, k, V]
    cum = logp.gather(2, tails[:, :, None])[:, :, 0].sum(1)
    best = cum.topk(width)
    assert [b["token_ids"] for b in beams] == tails[best.indices].tolist()
    assert [b["cumulative_logprob"] for b in beams] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)


def test_beam_width_one_is_greedy(tmp_path):
    build_tiny_llama(str(tmp_path))
    llm = make_llm(str(tmp_path))
    batch = prompts(4, (5, 50), vocab=300, seed=2)
    greedy = llm.generate(batch, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    beams = llm.beam_search(batch, beam_width=1, max_tokens=12)
    assert [b[0]["token_ids"] for b in beams] == [g["token_ids"] for g in greedy]
    assert all(len(b) == 1 for b in beams)


def test_beams_share_the_prompt_blocks(vocab32):
    """Peak KV-block use of a 4-beam search over a 64-token prompt stays far below
    4 private copies."""
    llm, _ = vocab32
    prompt = prompts(1, (64, 64), vocab=32, seed=3)[0]  # 4 full blocks
    peak, schedule = [0], llm.scheduler.schedule

    def recording():
        batch = schedule()
        peak[0] = max(peak[0], len(llm.block_manager.blocks) - llm.block_manager.num_free_blocks)
        if batch.num_new_tokens.count(1) == len(batch.seqs):
            live = [s for s in llm.scheduler.running if s.beam_width]
            assert all(llm.block_manager.blocks[b].ref_count == len(live)
                       for b in live[0].block_table[:4])
        return batch
    llm.scheduler.schedule = recording
    try:
        llm.beam_search([prompt], beam_width=4, max_tokens=10, length_penalty=1.0)
    finally:
        del llm.scheduler.schedule
    assert peak[0] <= 4 + 4 * 1  # the prompt's blocks once, one block of generated tokens per beam
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)


@pytest.mark.parametrize("beam_width", [0, -1, 1.5])
def test_bad_beam_width_names_the_argument(vocab32, beam_width):
    llm, _ = vocab32
    with pytest.raises(ValueError, match="beam_width="):
        llm.beam_search([[1, 2, 3]], beam_width=beam_width)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.beam_search([[1, 2, 3]], beam_width=llm.config.max_num_seqs + 1)
    with pytest.raises(ValueError, match="max_tokens="):
        llm.beam_search([[1, 2, 3]], beam_width=2, max_tokens=0)
    assert llm.beam_search([[1, 2, 3]], beam_width=2, max_tokens=2)[0]  # still serving
