"""nanovllm: a small, readable LLM inference engine built on PagedAttention."""
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]

import logging

_log = logging.getLogger("nanovllm")
if not _log.handlers:  # the engine reports its KV-cache size; a user's own logging config wins
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("nanovllm: %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)
