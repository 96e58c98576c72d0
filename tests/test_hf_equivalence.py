"""Greedy outputs token for token against Hugging Face transformers' `generate`.

SmolLM2 with real weights, and small random Qwen3 / Qwen2 / Llama checkpoints (grouped-query
attention, Qwen3's explicit head_dim, Llama 3 rope scaling, tied and untied embeddings, a sharded
checkpoint). The engine runs all prompts in one batch with 16-token blocks, so every sequence
spans many blocks; transformers runs one prompt at a time, without padding.
"""
import json
import os

import pytest
import torch

from tests.helpers import (FRANCE, FRANCE_ANSWER, GREEDY, RANDOM_MODELS, chat, hf_greedy, make_llm,
                           random_prompts, until_eos)

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

MAX_NEW = GREEDY.max_tokens

STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. "
         "He wound the clockwork, trimmed the wick and polished the great lens until it shone. "
         "Ships passing the rocky cape relied on its beam to find the harbor. "
         "One stormy night in November, the lamp went out. ")
NUMBERS = " ".join(f"{i} plus one is {i + 1}." for i in range(1, 40))


def smollm2_prompts(tokenizer) -> list[list[int]]:
    chats = [FRANCE, "Name three colors of the rainbow.", "Write a haiku about the sea.",
             "Explain in two sentences what a hash table is."]
    raws = ["The quick brown fox", "Once upon a time, in a small village by the sea,",
            STORY + "The keeper", STORY * 3 + "What did the keeper do next?", NUMBERS]
    return ([tokenizer.encode(chat(tokenizer, q)) for q in chats]
            + [tokenizer.encode(t) for t in raws])


@pytest.fixture(scope="module")
def smol_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_smollm2_matches_transformers(smol_llm, smol_hf):
    prompts = smollm2_prompts(smol_llm.tokenizer)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] <= 8 and lengths[-1] >= 250, lengths
    outputs = smol_llm.generate(prompts, GREEDY, use_tqdm=False)
    eos = smol_llm.output_processor.eos_token_ids
    assert eos == {smol_hf.generation_config.eos_token_id}
    for prompt, out in zip(prompts, outputs):
        expected = until_eos(hf_greedy(smol_hf, prompt, MAX_NEW), eos)
        assert out["token_ids"] == expected, smol_llm.tokenizer.decode(prompt)[-80:]
        assert out["finish_reason"] == ("stop" if expected[-1] in eos else "length")
        assert out["prompt_token_ids"] == prompt
    assert sum(o["finish_reason"] == "length" for o in outputs) >= 2  # some ran all 32 steps
    assert outputs[0]["text"] == FRANCE_ANSWER


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_random_model_matches_transformers(name, random_checkpoint):
    path, hf_model = random_checkpoint(name)
    llm = make_llm(path)
    prompts = random_prompts(8, (5, 300), seed=1)
    prompts[0] = prompts[0][:5]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(hf_model, prompt, MAX_NEW)
        assert out["finish_reason"] == "length"


def test_random_checkpoints_cover_what_they_claim(random_checkpoint):
    """The parametrized comparison above only means something if the checkpoints
    hold these features."""
    def config(name):
        path = random_checkpoint(name)[0]
        with open(os.path.join(path, "config.json")) as f:
            return path, json.load(f)
    path, qwen3 = config("qwen3")
    assert qwen3["architectures"] == ["Qwen3ForCausalLM"] and qwen3["tie_word_embeddings"]
    assert qwen3["head_dim"] * qwen3["num_attention_heads"] != qwen3["hidden_size"]
    assert qwen3["num_key_value_heads"] < qwen3["num_attention_heads"]
    path, qwen2 = config("qwen2")
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and not qwen2["tie_word_embeddings"]
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    _, llama3 = config("llama3")
    assert llama3["rope_parameters"]["rope_type"] == "llama3"
    _, tied = config("llama_tied")
    assert tied["architectures"] == ["LlamaForCausalLM"] and tied["tie_word_embeddings"]
    # llama3 rope scaling changes this model's greedy output: a backend that ignored it would
    # fail above
    path, hf_model = random_checkpoint("llama3")
    plain = type(hf_model)(type(hf_model.config)(**{**hf_model.config.to_dict(),
                                                   "rope_parameters": {"rope_type": "default",
                                                                       "rope_theta": 10000.0}}))
    plain.load_state_dict(hf_model.state_dict())
    prompt = random_prompts(1, (200, 200), seed=1)[0]
    assert hf_greedy(plain.eval(), prompt, 8) != hf_greedy(hf_model, prompt, 8)
