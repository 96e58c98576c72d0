"""Model registry: config.json's `architectures` (or else its `model_type`) -> how to build the
model."""
from functools import partial

from nanovllm.models.llama import LlamaForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": partial(LlamaForCausalLM, qkv_bias=True),
    "Qwen3ForCausalLM": partial(LlamaForCausalLM, qk_norm=True),
}
MODEL_TYPES = {arch.removesuffix("ForCausalLM").lower(): arch for arch in MODELS}  # "qwen2": ...


def model_class(hf_config: dict):
    """The builder for the checkpoint's architecture, or a ValueError listing the supported ones."""
    archs = hf_config.get("architectures") or [MODEL_TYPES.get(hf_config.get("model_type"), "")]
    if supported := [arch for arch in archs if arch in MODELS]:
        return MODELS[supported[0]]
    raise ValueError(f"architectures={archs} (model_type={hf_config.get('model_type')!r}) is not "
                     f"supported; supported: {sorted(MODELS)} (model_type {sorted(MODEL_TYPES)})")
