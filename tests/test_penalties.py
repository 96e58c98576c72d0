"""Penalties and min_tokens against references nobody here wrote: transformers' logits processors
and generate(), and OpenAI's documented formula."""
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from nanovllm import SamplingParams
from nanovllm.core.sequence import Sequence
from nanovllm.layers import penalties
from tests.helpers import make_llm, random_prompts

VOCAB = 50


def rows_of(histories, prompt_lens, **params):
    seqs = []
    for tokens, p in zip(histories, prompt_lens):
        seq = Sequence(tokens[:p], SamplingParams(**params), 16)
        seq.token_ids = list(tokens)
        seqs.append((seq, 0))
    return seqs


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    torch.manual_seed(0)
    histories = [torch.randint(VOCAB, (n,)).tolist() for n in (7, 12, 3)]
    logits = torch.randn(3, VOCAB) * 3
    rows = rows_of(histories, [4, 5, 3], repetition_penalty=penalty)
    got = penalties.apply(logits, rows, [len(h) for h in histories], set(),
                          torch.zeros(1, dtype=torch.int64))
    for i, h in enumerate(histories):
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([h]), logits[i:i + 1].clone())
        assert torch.equal(got[i:i + 1], ref)


def test_presence_and_frequency_penalties_follow_openai():
    """logit[j] -= c[j] * frequency + (c[j] > 0) * presence, c[j] counting j in the output only."""
    logits = torch.zeros(1, VOCAB)
    history = [3, 3, 9] + [5, 5, 5, 7]  # prompt [3, 3, 9], output [5, 5, 5, 7]
    rows = rows_of([history], [3], presence_penalty=0.5, frequency_penalty=0.25)
    got = penalties.apply(logits, rows, [len(history)], set(), torch.zeros(1, dtype=torch.int64))[0]
    expected = torch.zeros(VOCAB)
    expected[5] = -(3 * 0.25 + 0.5)
    expected[7] = -(1 * 0.25 + 0.5)
    assert torch.allclose(got, expected)


def test_placeholders_are_filled_from_the_last_step():
    """The last token may still be on the GPU: its placeholder -(i + 1) takes sampled[i]."""
    logits = torch.zeros(1, VOCAB)
    # the output's one token: row 1 of the last step
    rows = rows_of([[1, 2, -2]], [2], frequency_penalty=1.0)
    got = penalties.apply(logits, rows, [3], set(), torch.tensor([4, 11]))[0]
    assert got[11] == -1 and (got != 0).sum() == 1


def test_min_tokens_forbids_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(2, VOCAB)
    rows = rows_of([[1, 2, 3], [1, 2, 3, 4, 5]], [2, 2], min_tokens=3, stop_token_ids=[8])
    got = penalties.apply(logits, rows, [3, 5], {0}, torch.zeros(1, dtype=torch.int64))
    assert got[0, 0] == got[0, 8] == float("-inf")  # one token out: still below 3
    assert torch.equal(got[1], torch.zeros(VOCAB))  # three out: free to stop


def test_engine_repetition_penalty_matches_transformers_generate(random_checkpoint):
    path, hf = random_checkpoint("qwen3")
    llm = make_llm(path)
    for prompt in random_prompts(3, (5, 30), seed=5):
        out, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                     repetition_penalty=1.8), use_tqdm=False)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                              do_sample=False, repetition_penalty=1.8,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert out["token_ids"] == ref


def test_min_tokens_in_the_engine(random_checkpoint):
    path, _ = random_checkpoint("qwen3")
    llm = make_llm(path)
    prompt = random_prompts(1, (8, 8), seed=6)[0]
    free, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    stop = free["token_ids"][1]  # greedy would stop at its second token
    out, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                 stop_token_ids=[stop], min_tokens=5),
                        use_tqdm=False)
    assert len(out["token_ids"]) >= 5 and stop not in out["token_ids"][:4]
