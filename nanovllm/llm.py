"""The public entry point: `LLM(model, **options).generate(prompts, sampling_params)`."""
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    pass
