"""Test helpers: small random Hugging Face checkpoints, test-sized engines, prompts.

Random checkpoints are real Hugging Face models (`Qwen3ForCausalLM(config)` and friends) saved with
`save_pretrained`, so the engine loads them exactly as it loads downloaded weights.
"""
import os
import random

import torch

from nanovllm import LLM, SamplingParams

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=32)
FRANCE = "What is the capital of France?"
FRANCE_ANSWER = "The capital of France is Paris."  # SmolLM2-135M-Instruct's greedy answer

# name -> (transformers config class, overrides of RANDOM_BASE): GQA everywhere, tied embeddings
# both ways. A large initializer_range keeps the top-2 logit gaps far above float32 rounding, so
# greedy is stable.
RANDOM_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                   pad_token_id=None)
RANDOM_MODELS = {
    # head_dim != hidden / heads
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    # qkv bias; sharded checkpoint
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1)),
}


def build_random_checkpoint(name: str, path: str, seed: int = 0):
    """Save a random HF model `name` (see RANDOM_MODELS) as safetensors in path;
    return the HF model."""
    import transformers
    config_cls, overrides = RANDOM_MODELS[name]
    config = getattr(transformers, config_cls)(**{**RANDOM_BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # norms and biases start at 1 and 0: randomize them so a misloaded one shows
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path, max_shard_size="100KB" if name == "qwen2" else "1GB")
    return model


def make_llm(path: str, **options) -> LLM:
    """An engine with test-sized defaults: 16-token blocks, a small explicit cache, no tokenizer for
    random models, and run-ahead (async_scheduling, the default on CUDA, the path with more to get
    wrong; CPU's default is tested against it in tests/test_run_ahead.py)."""
    defaults = dict(kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=256,
                    load_format="safetensors", async_scheduling=True)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        defaults["skip_tokenizer_init"] = True
    return LLM(path, **{**defaults, **options})


def chat(tokenizer, question: str) -> str:
    """The prompt text of one user message in the model's chat template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def random_prompts(n: int, lengths: tuple[int, int], seed: int,
                   vocab: int = RANDOM_BASE["vocab_size"]):
    """n random token-id prompts with lengths drawn from [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def token_ids(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no batching, no padding)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def until_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """The tokens up to and including the first end-of-sequence token."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


def drain(llm) -> list:
    """Step until nothing is queued or in flight; every output the steps returned."""
    outputs = []
    for _ in range(10_000):
        if llm.is_finished():
            return outputs
        outputs += llm.step()
    raise AssertionError("the engine never finished")
