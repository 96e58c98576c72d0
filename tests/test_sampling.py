"""Sampling: greedy and its equivalents end to end, per-request seeds, and the truncation rules.

The statistical tests draw many samples from one synthetic logits row through
`nanovllm.layers.sampler.sample` and compare the frequencies with the renormalized probabilities.
"""
import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.layers.sampler import SamplingTensors, sample
from nanovllm.layers.truncation import Truncation
from tests.helpers import hf_greedy, make_llm, random_prompts, token_ids

N = 32


@pytest.fixture(scope="module")
def qwen3(random_checkpoint):
    path, hf_model = random_checkpoint("qwen3")
    return make_llm(path), hf_model


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, ignore_eos=True, **kw)


# ---------- end to end ----------

def test_temperature_zero_is_greedy_among_sampled_requests(qwen3):
    llm, hf_model = qwen3
    prompts = random_prompts(4, (5, 60), seed=50)
    mixed = [params(temperature=0), params(temperature=1.0, seed=1), params(temperature=0),
             params(temperature=1.5, top_p=0.9, seed=2)]
    outputs = llm.generate(prompts, mixed, use_tqdm=False)
    for i in (0, 2):
        assert outputs[i]["token_ids"] == hf_greedy(hf_model, prompts[i], N)
    for i in (1, 3):  # the sampled ones are not greedy (32 tokens from a 512-token vocabulary)
        assert outputs[i]["token_ids"] != hf_greedy(hf_model, prompts[i], N)


@pytest.mark.parametrize("truncation", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)],
                         ids=["top_k=1", "tiny_top_p", "min_p=1"])
def test_truncation_to_one_token_equals_greedy(qwen3, truncation):
    """Each truncation rule, at its extreme, leaves only the argmax: the engine
    must apply it to every row."""
    llm, _ = qwen3
    prompts = random_prompts(3, (5, 60), seed=51)
    greedy = token_ids(llm.generate(prompts, params(temperature=0), use_tqdm=False))
    hot = token_ids(llm.generate(prompts, params(temperature=2.0, **truncation), use_tqdm=False))
    assert hot == greedy


def test_same_seed_reproduces_whatever_else_is_in_the_batch(qwen3):
    llm, _ = qwen3
    prompt, *others = random_prompts(4, (10, 40), seed=52)
    seeded = params(temperature=1.0, top_k=50, seed=1234)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    crowd = [params(temperature=1.0), params(temperature=0.7, seed=5), params(temperature=0)]
    batch = llm.generate(others[:1] + [prompt] + others[1:], [crowd[0], seeded, crowd[1], crowd[2]],
                         use_tqdm=False)
    assert batch[1]["token_ids"] == alone
    assert llm.generate([prompt, prompt], [seeded, seeded], use_tqdm=False)[1]["token_ids"] == alone


def test_different_seeds_differ_and_no_seed_varies(qwen3):
    llm, _ = qwen3
    prompt, = random_prompts(1, (20, 20), seed=53)
    runs = [llm.generate([prompt], params(temperature=1.0, seed=s), use_tqdm=False)[0]["token_ids"]
            for s in (1, 2)]
    assert runs[0] != runs[1]
    unseeded = [llm.generate([prompt], params(temperature=1.0), use_tqdm=False)[0]["token_ids"]
                for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_engine_top_k_keeps_sampled_tokens_in_the_top_k(qwen3):
    """Teacher-check each sampled token against the model's own logits at that position."""
    llm, hf_model = qwen3
    prompt, = random_prompts(1, (20, 20), seed=54)
    out = llm.generate([prompt], params(temperature=5.0, top_k=3, seed=0),
                       use_tqdm=False)[0]["token_ids"]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    # how many tokens beat the sampled one
    ranks = (logits > logits.gather(1, torch.tensor(out)[:, None])).sum(1)
    assert ranks.max() < 3
    assert ranks.max() > 0  # at temperature 5, not everything is the argmax


# ---------- the sampler on a synthetic row ----------

PROBS = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.06, 0.05, 0.03, 0.01])
DRAWS = 20_000


def draw(temperature=1.0, top_k=None, top_p=None, min_p=None, logits=None) -> torch.Tensor:
    """Token frequencies [vocab] of DRAWS samples of one row (a batch of DRAWS copies)."""
    logits = (PROBS.log() if logits is None else logits).repeat(DRAWS, 1)
    full = lambda v, dtype: None if v is None else torch.full((DRAWS,), v, dtype=dtype)  # noqa: E731
    truncation = Truncation(full(top_k, torch.int64), full(top_p, torch.float32),
                            full(min_p, torch.float32))
    t = SamplingTensors(temperatures=torch.full((DRAWS,), float(temperature)), seeds=[],
                        all_greedy=False,
                        truncation=(truncation if (top_k, top_p, min_p) != (None, None, None)
                                    else None))
    torch.manual_seed(0)
    tokens = sample(logits, t)
    return torch.bincount(tokens, minlength=len(PROBS)).float() / DRAWS


def assert_frequencies(freq: torch.Tensor, keep: list[int], probs: torch.Tensor = PROBS):
    expected = torch.zeros_like(probs)
    expected[keep] = probs[keep] / probs[keep].sum()
    outside = [i for i in range(len(probs)) if i not in keep]
    assert freq[outside].sum() == 0, freq  # never a token outside
    # about 4 sigma at 20,000 draws
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_plain_sampling_follows_the_distribution():
    assert_frequencies(draw(), list(range(8)))


def test_temperature_reshapes_the_distribution():
    sharp = PROBS ** 2 / (PROBS ** 2).sum()  # temperature 0.5 squares the probabilities
    assert_frequencies(draw(temperature=0.5), list(range(8)), sharp)


@pytest.mark.parametrize("top_p, nucleus", [(0.5, 2), (0.7, 3), (0.8, 4), (0.99, 8)])
def test_top_p_keeps_only_the_nucleus(top_p, nucleus):
    """The smallest set of most likely tokens whose probability reaches top_p
    (cumsum: .35 .60 .75 .85 ...)."""
    assert_frequencies(draw(top_p=top_p), list(range(nucleus)))


def test_top_p_works_on_unsorted_logits():
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    freq = draw(top_p=0.7, logits=PROBS[perm].log())
    # where PROBS[0..2] landed
    keep = [int(i) for i in (perm[:, None] == torch.tensor([0, 1, 2])).nonzero()[:, 0]]
    assert_frequencies(freq, sorted(keep), PROBS[perm])


@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_top_k_restricts(top_k):
    assert_frequencies(draw(top_k=top_k), list(range(top_k)))


@pytest.mark.parametrize("min_p, kept", [(0.3, 3), (0.5, 2), (0.1, 6)])
def test_min_p_restricts(min_p, kept):
    """min_p keeps the tokens with at least min_p times the top probability (0.35)."""
    assert_frequencies(draw(min_p=min_p), list(range(kept)))


def test_truncations_combine_in_order():
    """min-p, then top-k, then top-p among what is left (as vLLM): top_k=3 leaves .35 .25 .15,
    i.e. .47 .33 .20 renormalized, whose 0.7 nucleus is two tokens
    (on the full row it would be three)."""
    assert_frequencies(draw(top_k=3, top_p=0.7), [0, 1])
    assert_frequencies(draw(min_p=0.3, top_p=0.7), [0, 1])
    assert_frequencies(draw(top_k=3, min_p=0.2), [0, 1, 2])  # min-p alone would keep 4


def test_rows_are_independent_and_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 100)
    t = SamplingTensors(temperatures=torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]), seeds=[(5, 77)],
                        all_greedy=False,
                        truncation=Truncation(torch.tensor([100, 1, 100, 100, 100, 100]), None,
                                              None))
    tokens = sample(logits, t)
    argmax = logits.argmax(-1)
    assert tokens[[0, 2, 4, 1]].tolist() == argmax[[0, 2, 4, 1]].tolist()  # row 1: top_k=1
    # a seeded row draws the same token whatever the other rows hold
    other = torch.randn(6, 100)
    other[5] = logits[5]
    assert sample(other, t)[5] == tokens[5]


def test_greedy_rows_among_plain_temperature_rows_take_the_argmax():
    """Rows with temperature 0 in a batch sampled without truncation or seeds
    (the one-pass path)."""
    logits = torch.randn(6, 100)
    t = SamplingTensors(temperatures=torch.tensor([0.0, 1.0] * 3), seeds=[], all_greedy=False)
    assert sample(logits, t)[::2].tolist() == logits.argmax(-1)[::2].tolist()


# ---------- the CUDA sampling kernel ----------
# (nanovllm/kernels/sample.py; Triton's interpreter on CPU)

def kernel_draws(temperatures: torch.Tensor, logits: torch.Tensor,
                 seed: int | torch.Tensor = 0, block: int = 8) -> torch.Tensor:
    from nanovllm.kernels.sample import gumbel_max_sample
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = seed.to(device) if isinstance(seed, torch.Tensor) else seed
    return gumbel_max_sample(logits.to(device), temperatures.to(device), seed, block=block).cpu()


@pytest.mark.slow
def test_kernel_follows_the_distribution():
    """The kernel draws a chunk of the vocabulary by its share of the probability, then a token
    inside it. Chunks of 4 tokens: the first holds one likely token and three impossible ones
    (-inf), the second four less likely ones. Temperature 0.5 squares the probabilities: the first
    chunk's share is .64 (drawn by its largest logit, it would be .88). 1,500 draws (the
    interpreter is slow), about 4 sigma."""
    draws, probs = 1500, torch.tensor([0.4, 0.0, 0.0, 0.0, 0.15, 0.15, 0.15, 0.15])
    tokens = kernel_draws(torch.full((draws,), 0.5), probs.log().repeat(draws, 1), block=4)
    freq = torch.bincount(tokens, minlength=len(probs)).float() / draws
    expected = probs ** 2 / (probs ** 2).sum()
    assert torch.allclose(freq, expected, atol=0.05), (freq, expected)


@pytest.mark.slow
def test_kernel_greedy_rows_seeds_and_dtypes():
    logits = torch.randn(6, 37)  # a vocabulary that is not a multiple of the chunk
    temps = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 1.0])
    tokens = kernel_draws(temps, logits, seed=5)
    assert tokens[::2].tolist() == logits.argmax(-1)[::2].tolist()
    assert tokens.tolist() == kernel_draws(temps, logits, seed=5).tolist()  # the seed decides
    hot, row = torch.full((64,), 5.0), logits[:1].repeat(64, 1)
    assert kernel_draws(hot, row, seed=1).tolist() != kernel_draws(hot, row, seed=2).tolist()
    half = logits.to(torch.bfloat16)
    assert kernel_draws(temps, half, seed=5)[::2].tolist() == half.float().argmax(-1)[::2].tolist()
    tied = torch.zeros(2, 37)
    tied[:, [30, 9, 20]] = 1.0  # the largest logit three times, in three chunks: the first wins
    assert kernel_draws(torch.zeros(2), tied).tolist() == tied.argmax(-1).tolist() == [9, 9]
    seed = torch.zeros(1, dtype=torch.int64)  # a tensor, as the model runner's greedy steps pass
    assert kernel_draws(torch.zeros(2), tied, seed).tolist() == [9, 9]


@pytest.mark.slow
def test_kernel_seed_from_torchs_generator_and_out():
    """Without a seed the kernel draws one from torch's generator on the logits' device (so a CUDA
    graph draws anew each replay, worker/cuda_graphs.py): new noise each call, the same after the
    same manual_seed; the tokens go into `out` when it is given."""
    from nanovllm.kernels.sample import gumbel_max_sample
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hot, row = (torch.full((64,), 5.0, device=device),
                torch.randn(1, 37, device=device).repeat(64, 1))
    torch.manual_seed(1)
    first = gumbel_max_sample(row, hot, block=8).tolist()
    out = torch.empty(64, dtype=torch.int64, device=device)
    assert gumbel_max_sample(row, hot, block=8, out=out) is out
    torch.manual_seed(1)
    assert first != out.tolist() and first == gumbel_max_sample(row, hot, block=8).tolist()


def test_settings_per_row_from_shared_and_distinct_params():
    """SamplingTensors.of gives every row its own settings, whether rows share a SamplingParams
    object or not, and an empty batch an empty tensor."""
    from nanovllm.core.sequence import Sequence
    hot, greedy = SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)
    seeded, top_k = SamplingParams(temperature=1.3, seed=5), SamplingParams(top_k=1)
    seqs = [Sequence([1, 2, 3], p, 4) for p in (hot, greedy, hot, seeded, top_k, hot)]
    rows = [(seq, 0) for seq in seqs] + [(seqs[3], 1)]  # the seeded request's second sample
    t = SamplingTensors.of(rows, 100, torch.device("cpu"))
    assert t.temperatures.dtype == torch.float32
    assert t.temperatures.tolist() == pytest.approx([0.7, 0, 0.7, 1.3, 0, 0.7, 1.3])
    assert [row for row, _ in t.seeds] == [3, 6] and t.seeds[0][1] != t.seeds[1][1]
    assert not t.all_greedy and t.truncation is not None
    t = SamplingTensors.of(rows[1:2], 100, torch.device("cpu"))
    assert t.all_greedy and t.truncation is None and not t.seeds
    assert SamplingTensors.of([], 100, torch.device("cpu")).temperatures.shape == (0,)


def test_sampler_graphs_take_only_a_decode_graphs_plainly_sampled_logits():
    """CUDAGraphs.sample (worker/cuda_graphs.py) draws only the logits its last decode graph
    returned (`sampleable`), and only without seeds or truncation: anything else is left to the
    eager sampler (None). Checked on the CPU with a stand-in for the graphs."""
    from types import SimpleNamespace

    from nanovllm.worker.cuda_graphs import CUDAGraphs
    logits = torch.randn(4, 10)
    graphs = SimpleNamespace(sampleable=logits, samplers={}, decode_sizes=[4])
    plain = SamplingTensors(torch.ones(4), [], False)
    seeded = SamplingTensors(torch.ones(4), [(1, 7)], False)
    truncated = SamplingTensors(torch.ones(4), [], False, truncation=object())
    assert CUDAGraphs.sample(graphs, logits.clone(), plain) is None  # not the graph's logits
    assert CUDAGraphs.sample(graphs, logits, seeded) is None
    assert CUDAGraphs.sample(graphs, logits, truncated) is None
    assert not graphs.samplers
