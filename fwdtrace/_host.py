"""Tensors to the host: the one way fwdtrace turns a tensor into a NumPy array.

A CUDA (or any device's) tensor refuses ``.numpy()``; copying it to the CPU first is one
transfer and one synchronisation for the whole value, where reading it element by element
(``.item()``, ``float(t[i])``) would be one per element. Casts happen on the host, after
the copy: the device's memory holds no second copy, and a bfloat16 value crosses at half
the size of the float32 it becomes (NumPy has no bfloat16, nor float8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # NumPy is torch's to import: ``import fwdtrace`` needs only torch
    import numpy as np

__all__ = ["HostCopy", "host", "shared_array", "to_numpy"]

# dtypes NumPy has no type for: widened to float32, which holds each of their values exactly
_NUMPY_LACKS = {torch.bfloat16, *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                              "float8_e5m2fnuz") if hasattr(torch, n))}


def host(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached and on the CPU: the same tensor when it is there already, else one copy."""
    t = t.detach()
    return t if t.device.type == "cpu" else t.to("cpu")


def to_numpy(t: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """``t`` as a C-contiguous NumPy array, copied from its device once and cast to ``dtype`` on the host.

    Without ``dtype``, a dtype NumPy lacks (bfloat16, float8) becomes float32. The array may
    share memory with ``t`` when ``t`` is a CPU tensor already of that dtype.
    """
    t = host(t)
    if dtype is None and t.dtype in _NUMPY_LACKS:
        dtype = torch.float32
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.resolve_conj().resolve_neg().contiguous().numpy()


def shared_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a NumPy array, no copy: for one detached, unconjugated tensor of a dtype NumPy
    has, read where each call's cost counts (:func:`to_numpy` checks and converts first)."""
    return t.numpy()


class HostCopy:
    """A small CUDA tensor on its way to (pinned) host memory, copied without waiting: :meth:`array` waits.

    For a writer thread that takes a value the training thread computed: the training thread
    starts the copy and goes on; the writer waits for it.
    """

    def __init__(self, t: torch.Tensor) -> None:
        self.host = t.detach().to("cpu", non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        self.nbytes = self.host.numel() * self.host.element_size()

    def array(self) -> np.ndarray:
        """The copy as a NumPy array, once it has arrived."""
        self.copied.synchronize()
        return to_numpy(self.host)
