"""nanovllm: a small, readable LLM inference engine built on PagedAttention."""
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
