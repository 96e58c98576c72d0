"""nanovllm: a small, readable LLM inference engine built on PagedAttention."""
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]


def __getattr__(name: str):  # RequestMetrics comes with log_stats=True (engine/metrics.py)
    if name == "RequestMetrics":
        from nanovllm.engine.metrics import RequestMetrics
        return RequestMetrics
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
