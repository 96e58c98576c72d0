"""Bad input: each gives a clear error that names the argument, and the engine goes on serving.

After every error the shared SmolLM2 engine must still answer the France question correctly,
so a failed request may leave nothing behind (no queued sequence, no held block).
"""
import json
import os

import pytest

from nanovllm import LLM, SamplingParams
from tests.helpers import FRANCE, FRANCE_ANSWER, GREEDY, chat, make_llm


@pytest.fixture(scope="module")
def llm(smol_llm):
    return smol_llm


@pytest.fixture(scope="module")
def france(llm) -> list[int]:
    return llm.tokenizer.encode(chat(llm.tokenizer, FRANCE))


def assert_serves(llm, france):
    assert llm.is_finished() and not llm.scheduler.waiting
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)  # nothing held
    out, = llm.generate([france], GREEDY, use_tqdm=False)
    assert out["text"] == FRANCE_ANSWER and out["finish_reason"] == "stop"


def test_empty_prompt(llm, france):
    for prompt in ([], ""):
        with pytest.raises(ValueError, match="prompt has 0 tokens"):
            llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_serves(llm, france)


def test_prompt_over_max_model_len(llm, france):
    too_long = france * (llm.config.max_model_len // len(france) + 1)
    with pytest.raises(ValueError, match=f"max_model_len={llm.config.max_model_len}"):
        llm.generate([too_long], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request(too_long, GREEDY)
    assert_serves(llm, france)


@pytest.mark.parametrize("bad_id", [49152, 10**9, -1])
def test_token_id_outside_the_vocabulary(llm, france, bad_id):
    with pytest.raises(ValueError, match=r"prompt token ids .*outside the vocabulary \[0, 49152\)"):
        llm.generate([france[:5] + [bad_id]], GREEDY, use_tqdm=False)
    assert_serves(llm, france)


def test_bad_prompt_in_a_batch_runs_nothing(llm, france):
    good = [france, france[:-3], france]
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(good[:2] + [[1, 2, 49152]] + good[2:], GREEDY, use_tqdm=False)
    assert llm.is_finished()  # nothing of the batch was queued
    outputs = llm.generate(good, GREEDY, use_tqdm=False)
    assert outputs[0]["text"] == outputs[2]["text"] == FRANCE_ANSWER
    assert outputs[1]["token_ids"]
    assert_serves(llm, france)


def test_prompt_of_the_wrong_type(llm, france):
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([[1, 2.5, 3]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate([france], [{"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 items for 1 prompts"):
        llm.generate([france], [GREEDY, GREEDY], use_tqdm=False)
    assert_serves(llm, france)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.1), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params(llm, france, kwargs, name):
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(f"{name}=") and str(value) in str(err.value)
    assert_serves(llm, france)


def test_unknown_sampling_param(llm, france):
    with pytest.raises(TypeError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=4)
    assert_serves(llm, france)


def test_unknown_option(llm, france, smollm2_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(smollm2_dir, max_num_seq=4)
    assert_serves(llm, france)


@pytest.mark.parametrize("options, name", [
    (dict(kvcache_block_size=24), "kvcache_block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=65536), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(dtype="float8"), "dtype"),
    (dict(num_kvcache_blocks=0), "num_kvcache_blocks"), (dict(load_format="pt"), "load_format"),
    (dict(attn_backend="paged"), "attn_backend"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(run_ahead_steps=0), "run_ahead_steps"), (dict(run_ahead_steps=9), "run_ahead_steps"),
])
def test_bad_option_values(llm, france, tiny_path, options, name):
    with pytest.raises(ValueError, match=f"^{name}="):
        LLM(tiny_path, skip_tokenizer_init=True, **options)
    assert_serves(llm, france)


def test_missing_model_directory(llm, france, tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(empty))
    assert_serves(llm, france)


def test_missing_weights(llm, france, tiny_path, tmp_path):
    with open(os.path.join(tiny_path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), skip_tokenizer_init=True, num_kvcache_blocks=8)
    assert_serves(llm, france)


def test_unsupported_architecture(llm, france, tmp_path):
    config = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=512, n_embd=64,
                  n_layer=2, n_head=4, n_positions=1024)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path), skip_tokenizer_init=True, load_format="dummy", num_kvcache_blocks=8)
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)
    assert_serves(llm, france)


def test_flash_backend_without_flash_attn(llm, france, tiny_path):
    """flash-attn is not installed in CI: the error says how to install it, or to use triton."""
    with pytest.raises((ValueError, ImportError)) as err:
        make_llm(tiny_path, attn_backend="flash")
    assert "pip install" in str(err.value) and "triton" in str(err.value)
    assert_serves(llm, france)


def test_text_without_tokenizer(tiny_path):
    """Text prompts and stop strings need the tokenizer: refused at add time,
    nothing left queued."""
    tiny = make_llm(tiny_path, num_kvcache_blocks=8)
    with pytest.raises(ValueError, match="tokenizer"):
        tiny.generate(["hello"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="^stop=.*tokenizer"):
        tiny.generate([[1, 2, 3]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert tiny.is_finished()
    assert tiny.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["finish_reason"] == "length"
