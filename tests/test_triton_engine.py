"""The engine with attn_backend="triton" (our kernels, under TRITON_INTERPRET=1 on CPU) equals sdpa,
token for token."""
import pytest

from nanovllm import SamplingParams
from tests.helpers import make_llm, random_prompts, token_ids

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out


@pytest.mark.parametrize("name", ["qwen3", "llama_tied"])
@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_triton_engine_equals_sdpa(random_checkpoint, name, options):
    path, _ = random_checkpoint(name)
    prompts = random_prompts(4, (1, 40), seed=3) + random_prompts(1, (20, 40), seed=4)
    # its first block (16 tokens) comes from the prefix cache
    prompts.append(prompts[-1] + prompts[0])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for backend in ("sdpa", "triton"):
        llm = make_llm(path, attn_backend=backend, dtype="float32", **options)
        first = llm.generate(prompts[:-1], params, use_tqdm=False)
        last = llm.generate(prompts[-1:], params, use_tqdm=False)
        assert last[0]["num_cached_tokens"] >= 16
        outputs[backend] = token_ids(first + last)
    assert outputs["triton"] == outputs["sdpa"]
