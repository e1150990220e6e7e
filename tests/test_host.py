"""Host copies: every tensor-to-NumPy path goes through fwdtrace._host, which copies a device's tensor once.

No GPU here: a tensor subclass plays one. Like a CUDA tensor it reports a cuda device,
refuses ``.numpy()`` and any per-element read (each would be a synchronisation), and becomes
a plain CPU tensor only when copied there, counted.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import fwdtrace
from fwdtrace._host import host, to_numpy
from fwdtrace.onnx import numeric


class OnDevice(torch.Tensor):
    copies = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: A002 - torch's signature
        kwargs = kwargs or {}
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__):
            raise AssertionError(f"a per-element read from the device: {func.__name__}")
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the device property
            return torch.device("cuda", 0)
        if func in (torch.Tensor.to, torch.Tensor.cpu) and _to_cpu(func, args[1:], kwargs):
            cls.copies += 1
            plain = args[0].as_subclass(torch.Tensor)
            return plain.to(*args[1:], **kwargs) if func is torch.Tensor.to else plain.clone()
        return super().__torch_function__(func, types, args, kwargs)


def _to_cpu(func, args, kwargs) -> bool:
    if func is torch.Tensor.cpu:
        return True
    wanted = [*args, kwargs.get("device")]
    return any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu" for a in wanted if a is not None)


def on_device(t: torch.Tensor) -> OnDevice:
    OnDevice.copies = 0
    return t.as_subclass(OnDevice)


def test_the_fake_refuses_numpy_as_cuda_does():
    t = on_device(torch.arange(4.0))
    assert t.device.type == "cuda"
    with pytest.raises(TypeError, match="can't convert cuda:0"):
        t.numpy()


@pytest.mark.parametrize("dtype, want", [(torch.float32, np.float32), (torch.bfloat16, np.float32),
                                         (torch.float16, np.float16), (torch.int64, np.int64)])
def test_to_numpy_copies_once_and_widens_what_numpy_lacks(dtype, want):
    plain = torch.tensor([[1.5, -2.0], [0.25, 3.0]]).to(dtype)
    arr = to_numpy(on_device(plain).t())  # not contiguous, too
    assert OnDevice.copies == 1
    assert arr.dtype == want
    np.testing.assert_array_equal(arr, plain.t().to(torch.float64).numpy().astype(want))


def test_to_numpy_casts_on_the_host():
    arr = to_numpy(on_device(torch.tensor([1.0, 2.0])), torch.float64)
    assert OnDevice.copies == 1 and arr.dtype == np.float64


def test_a_cpu_tensor_is_not_copied():
    t = torch.ones(3)
    assert host(t).data_ptr() == t.data_ptr()


def test_numeric_check_takes_device_values():
    """check_onnx(numeric=True)'s inputs and compared values: refused with TypeError before the host copies."""
    eager = torch.tensor([[1.0, 2.0, 3.0]])
    feed = numeric._to_numpy(on_device(eager), "float32")
    assert OnDevice.copies == 1 and feed.dtype == np.float32
    row = numeric.ValueRow(0, "call", "", "Linear", "n", "v", (), "")
    numeric._compare_into(row, on_device(eager), eager.numpy() + 1e-3, dict(numeric.DEFAULT_TOLERANCES))
    assert OnDevice.copies == 1  # the compared value: once
    assert row.compared and not row.ok and row.max_abs == pytest.approx(1e-3, rel=1e-3)


def test_no_other_numpy_conversion_in_the_package():
    """One conversion path: a `.numpy()` elsewhere would fail on a GPU tensor (or copy per value twice)."""
    package = Path(fwdtrace.__file__).parent
    found = [f"{p.relative_to(package)}:{i}" for p in package.rglob("*.py") if p.name != "_host.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\.numpy\(\)", line)]
    assert found == []


@pytest.mark.parametrize("available, first", [
    (["CUDAExecutionProvider", "CPUExecutionProvider"], ("CUDAExecutionProvider", {"use_tf32": "0"})),
    (["AzureExecutionProvider", "CPUExecutionProvider"], "CPUExecutionProvider"),
])
def test_onnxruntime_runs_on_cuda_where_it_can(available, first):
    ort = types.SimpleNamespace(get_available_providers=lambda: available)
    chosen = numeric.providers(ort)
    assert chosen[0] == first and chosen[-1] == "CPUExecutionProvider"
