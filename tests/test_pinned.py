"""nanovllm/utils/pinned.py: host tensors through array, as torch.tensor would make them."""
import pytest
import torch

from nanovllm.utils.pinned import host_tensor


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_host_tensor_equals_torch_tensor(dtype):
    values = [0, -1, 7, 2**31 - 1, -(2**31)] if dtype == torch.int32 else [0.0, 0.6, 1e-8, 2.5]
    out = host_tensor(values, dtype, pin=False)
    assert out.dtype == dtype and out.device.type == "cpu"
    assert torch.equal(out, torch.tensor(values, dtype=dtype))
    assert host_tensor([], dtype, pin=False).shape == (0,)  # array's empty buffer is refused


def test_host_tensor_owns_its_values():
    values = [1, 2, 3]
    out = host_tensor(values, torch.int32, pin=False)
    values[0] = 9
    assert out.tolist() == [1, 2, 3]


def test_host_tensor_refuses_what_int32_cannot_hold():
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32, pin=False)


@pytest.mark.gpu
def test_host_tensor_pinned():
    out = host_tensor([1, 2], torch.int32, pin=True)
    assert out.is_pinned() and out.tolist() == [1, 2]
