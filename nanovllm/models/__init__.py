"""Model registry: config.json's `architectures` name -> how to build the model."""
from functools import partial

from nanovllm.models.llama import LlamaForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": partial(LlamaForCausalLM, qkv_bias=True),
    "Qwen3ForCausalLM": partial(LlamaForCausalLM, qk_norm=True),
}


def model_class(hf_config: dict):
    """The builder for the checkpoint's architecture, or a ValueError listing the supported ones."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(f"architectures={archs} is not supported; supported: {sorted(MODELS)}")
