"""Host tensors for copies to the GPU that do not wait: Python numbers through `array` into pinned
memory (the CUDA caching host allocator's; vLLM stages its step inputs in pinned buffers too).

A step's inputs start as Python lists. `torch.tensor(list)` converts them one object at a time
through its generic path; `array` converts them in C, about 4x faster (5,500 ints: 77 against
307 us on the project's CPU machine; the H100 host was about 2.3x slower still). That list is every
step's graph upload (worker/cuda_graphs.py), cascade plan (attention/cascade.py) and temperatures
(layers/sampler.py).
"""
from array import array

import torch

TYPECODES = {torch.int32: "i", torch.float32: "f"}


def host_tensor(values: list, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """`values` as a 1-D host tensor of `dtype` (int32 or float32), in pinned memory if `pin`."""
    if not values:
        return torch.zeros(0, dtype=dtype)
    tensor = torch.frombuffer(array(TYPECODES[dtype], values), dtype=dtype)
    return tensor.pin_memory() if pin else tensor
