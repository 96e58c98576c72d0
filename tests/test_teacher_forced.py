"""Teacher-forced logits on CPU: prefill, decode, prefix hits and chunked prefill all agree with
transformers."""
import random

import pytest
import torch

from nanovllm import LLM
from tests.teacher_forcing import engine_logits, hf_logits, rel_error

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=500,
                      max_position_embeddings=1024)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(path)
    rng = random.Random(0)
    seqs = [[rng.randrange(500) for _ in range(n)] for n in (3, 17, 40, 64)]
    # shares two 16-token blocks with seqs[2]
    seqs.append(seqs[2][:33] + [rng.randrange(500) for _ in range(20)])
    prompt_lens = [2, 16, 33, 50, 40]
    return str(path), seqs, prompt_lens, hf_logits(model, seqs, prompt_lens)


@pytest.mark.parametrize("options",
                         [{}, {"max_num_batched_tokens": 16}, {"enable_prefix_caching": False}],
                         ids=["plain", "chunked", "no_prefix_cache"])
def test_teacher_forced_logits_match_transformers(tiny_qwen3, options):
    path, seqs, prompt_lens, ref = tiny_qwen3
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", kvcache_block_size=16, **options)
    assert rel_error(engine_logits(llm, seqs, prompt_lens), ref) < 1e-5
    # again: now from the prefix cache
    assert rel_error(engine_logits(llm, seqs, prompt_lens), ref) < 1e-5
