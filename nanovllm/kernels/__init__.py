"""Triton kernels, one file per role: the triton attention backend's, and those that every
backend uses on CUDA.

- `store_kv.py`: rotary (and Qwen3's q/k norm) fused with writing this step's K/V into the paged
  cache at `slot_mapping` (PagedAttention's write side); used by every backend on CUDA.
- `prefill.py`: causal varlen FlashAttention-2 (online softmax) that reads every key through the
  block table, so prefix-cache hits and chunked prefill need no special case.
- `decode.py`: paged decode attention with split-KV ("flash decoding") and a log-sum-exp reduction.
- `sample.py`: exact temperature sampling (the Gumbel-max trick over vocabulary chunks, then inside
  the drawn chunk) in one read of the logits, at temperature 0 the argmax; used by every backend
  on CUDA.
- `host_copy.py`: a step's upload and its sampled tokens copied by a kernel through pinned memory,
  so a step's boundary is a chain of kernels; used by every backend on CUDA.
- `elementwise.py`: RMSNorm with the residual add, and SwiGLU's gate: the layers between the
  projections; used by every backend on CUDA.
- `paged.py`: the one piece they share, the address of a key's row in the block-paged cache.
- `pdl.py`: programmatic dependent launch, for the kernels of steps of one or two rows.
- `compile_ahead.py`: the engine's kernels compiled at once, on threads, while it starts.
"""
from nanovllm.kernels.decode import decode_attention, num_decode_splits
from nanovllm.kernels.prefill import prefill_attention
from nanovllm.kernels.store_kv import rope_store

__all__ = ["rope_store", "prefill_attention", "decode_attention", "num_decode_splits"]
