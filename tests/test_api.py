"""The public surface on SmolLM2: stopping rules, output order, per-prompt parameters,
add_request + step.

Expected outputs are derived from an unconstrained greedy run of the same engine, except the one
known answer to the France question.
"""
import pytest

from nanovllm import SamplingParams
from tests.helpers import FRANCE, FRANCE_ANSWER, chat, token_ids

QUESTIONS = [FRANCE, "Name three colors of the rainbow.", "Write one sentence about the sea.",
             "What is 12 times 12?"]


@pytest.fixture(scope="module")
def llm(smol_llm):
    return smol_llm


@pytest.fixture(scope="module")
def prompts(llm) -> list[str]:
    return [chat(llm.tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def full(llm, prompts) -> list[dict]:
    """Greedy, 24 new tokens at most, no stop rule besides eos."""
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert outputs[0]["text"] == FRANCE_ANSWER and outputs[0]["finish_reason"] == "stop"
    return outputs


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 24, **kw})


def test_stop_string_ends_the_text_before_it(llm, prompts, full):
    out, = llm.generate(prompts[:1], greedy(stop=["Paris"]), use_tqdm=False)
    assert out["text"] == FRANCE_ANSWER[:FRANCE_ANSWER.index("Paris")]
    assert out["finish_reason"] == "stop"
    assert len(out["token_ids"]) < len(full[0]["token_ids"])  # generation stopped there, not at eos
    assert out["token_ids"] == full[0]["token_ids"][:len(out["token_ids"])]


def test_first_of_several_stop_strings_wins(llm, prompts, full):
    text = full[1]["text"]
    early, late = text.split()[2], text.split()[5]
    out, = llm.generate(prompts[1:2], greedy(stop=[late, early, "no such text here"]),
                        use_tqdm=False)
    assert (out["text"] == text[:min(text.index(early), text.index(late))]
            and out["finish_reason"] == "stop")


def test_stop_string_that_never_appears(llm, prompts, full):
    out, = llm.generate(prompts[1:2], greedy(stop="zebra crossing"), use_tqdm=False)
    assert out["text"] == full[1]["text"] and out["finish_reason"] == full[1]["finish_reason"]


def test_stop_token_ids(llm, prompts, full):
    tokens = full[2]["token_ids"]
    stop = tokens[3]
    out, = llm.generate(prompts[2:3], greedy(stop_token_ids=[stop]), use_tqdm=False)
    assert out["token_ids"] == tokens[:tokens.index(stop) + 1]  # the stop token is the last one
    assert out["finish_reason"] == "stop"


def test_max_tokens_ends_with_length(llm, prompts, full):
    outputs = llm.generate(prompts, greedy(max_tokens=3), use_tqdm=False)
    assert token_ids(outputs) == [o["token_ids"][:3] for o in full]
    assert all(o["finish_reason"] == "length" for o in outputs)


def test_ignore_eos_runs_past_eos(llm, prompts, full):
    answer = full[0]["token_ids"]
    assert answer[-1] in llm.output_processor.eos_token_ids
    out, = llm.generate(prompts[:1], greedy(max_tokens=len(answer) + 6, ignore_eos=True),
                        use_tqdm=False)
    assert out["token_ids"][:len(answer)] == answer
    assert len(out["token_ids"]) == len(answer) + 6 and out["finish_reason"] == "length"
    assert out["text"].startswith(FRANCE_ANSWER)  # special tokens are not in the text


def test_outputs_come_back_in_input_order(llm, prompts, full):
    """The first prompt finishes last, the last first; outputs still follow the input order."""
    lengths = [12, 9, 5, 2]
    params = [greedy(max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == lengths
    assert [o["prompt_token_ids"] for o in outputs] == [llm.tokenizer.encode(p) for p in prompts]
    for out, ref in zip(outputs, full):  # ignore_eos: the same tokens as far as both go
        n = min(len(out["token_ids"]), len(ref["token_ids"]))
        assert out["token_ids"][:n] == ref["token_ids"][:n]


def test_per_prompt_sampling_params(llm, prompts, full):
    params = [greedy(stop=["Paris"]), greedy(max_tokens=4),
              greedy(stop_token_ids=[full[2]["token_ids"][1]]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert (outputs[0]["text"] == "The capital of France is "
            and outputs[0]["finish_reason"] == "stop")
    assert (outputs[1]["token_ids"] == full[1]["token_ids"][:4]
            and outputs[1]["finish_reason"] == "length")
    assert (outputs[2]["token_ids"] == full[2]["token_ids"][:2]
            and outputs[2]["finish_reason"] == "stop")
    assert len(outputs[3]["token_ids"]) == 10
    assert (outputs[3]["token_ids"]
            == llm.generate(prompts[3:], params[3], use_tqdm=False)[0]["token_ids"])


def test_add_request_and_step_equal_generate(llm, prompts, full):
    ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=24)) for p in prompts]
    assert len(set(ids)) == len(ids) and not llm.is_finished()
    finished, steps, seen = {}, 0, {}
    while not llm.is_finished():
        outputs = llm.step()
        steps += 1
        for out in outputs:  # every request with new tokens, its tokens so far (cumulative)
            assert len(out.outputs[0].token_ids) > len(seen.get(out.request_id, []))
            seen[out.request_id] = out.outputs[0].token_ids
            if out.finished:
                finished[out["request_id"]] = out
    assert sorted(finished) == sorted(ids)
    assert [finished[i]["token_ids"] for i in ids] == token_ids(full)
    assert [finished[i]["text"] for i in ids] == [o["text"] for o in full]
    assert steps >= max(len(o["token_ids"]) for o in full)  # one token per step after the prefill


def test_repeated_prompt_is_served_from_the_prefix_cache(llm, prompts):
    """Real weights: the second run of a prompt reuses its blocks and answers the same."""
    n = len(llm.tokenizer.encode(prompts[0]))
    outputs = [llm.generate(prompts[:1], greedy(), use_tqdm=False)[0] for _ in range(2)]
    assert outputs[1]["num_cached_tokens"] == min(
        n // llm.config.kvcache_block_size * llm.config.kvcache_block_size, n - 1)
    assert outputs[0]["text"] == outputs[1]["text"] == FRANCE_ANSWER


def test_step_on_an_idle_engine_does_nothing(llm):
    assert llm.is_finished()
    assert llm.step() == []


def test_single_string_prompt(llm):
    out, = llm.generate(chat(llm.tokenizer, FRANCE), SamplingParams(temperature=0), use_tqdm=False)
    assert out["text"] == FRANCE_ANSWER


HIDE_TRITON = r"""
import importlib.abc, sys
class HideTriton(importlib.abc.MetaPathFinder):  # as if triton were not installed
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, HideTriton())
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], skip_tokenizer_init=True, num_kvcache_blocks=16, kvcache_block_size=16)
params = [SamplingParams(temperature=0, max_tokens=4),
          SamplingParams(temperature=1.0, top_p=0.9, top_k=5, seed=1, max_tokens=4, n=2)]
outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
assert all(len(c.token_ids) == 4 for o in outs for c in o.outputs)
print("triton" in sys.modules)
"""


@pytest.mark.slow
def test_the_cpu_path_runs_without_triton(tiny_path):
    """`pip install -e .` on a CPU takes no Triton (PyTorch's CUDA build brings it): the engine
    builds and serves greedy, sampled and parallel requests on the CPU without importing it."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", HIDE_TRITON, tiny_path], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
