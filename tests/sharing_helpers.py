"""Helpers of the memory-sharing tests: tiny random Llama checkpoints and test-sized engines."""
import os

import torch
import transformers

from nanovllm import LLM

# tiny models: one thread is fastest
torch.set_num_threads(int(os.environ.get("NANOVLLM_TEST_THREADS", "1")))

BLOCK_SIZE = 16


def build_tiny_llama(path: str, vocab_size: int = 300, eos_token_id: int | None = None,
                     seed: int = 0):
    """Save a random Llama (hidden 64, 2 layers) to path; return the transformers model."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def make_llm(path: str, **options) -> LLM:
    defaults = dict(skip_tokenizer_init=True, device="cpu", attn_backend="sdpa",
                    kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=128,
                    async_scheduling=True)  # run-ahead, as on CUDA
    return LLM(path, **{**defaults, **options})


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-softmax [len(tokens), vocab] of transformers' logits predicting each of
    tokens after prompt."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1)
