"""Following tensor memory without an allocator's help: live storage bytes and their peak.

CUDA has ``max_memory_allocated``; the CPU has nothing alike, so analysis (and the trace
benchmark) count the storages that ops create until they are freed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._tree import tensors_of

__all__ = ["StorageTracker"]


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(StorageImpl address, bytes) of a tensor's storage; None for subclasses without one."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata, storage.nbytes()


class StorageTracker:
    """Live bytes of tensor storage and their peak, fed with each op's outputs.

    >>> import torch
    >>> from fwdtrace.memory import StorageTracker
    >>> weight = torch.ones(256)                     # 1 KiB that exists before: the base
    >>> tracker = StorageTracker([weight])
    >>> y = weight * 2; tracker.add(y)               # 1 KiB more
    >>> del y; z = weight + 1; tracker.add(z)        # y was freed before z came
    >>> tracker.live_bytes, tracker.peak_bytes
    (2048, 2048)

    Storages of ``base`` (weights, inputs) count from the start and stay; new ones count once
    (views share their storage) until freed. Kernel workspaces and allocator overhead are not seen.
    """

    def __init__(self, base: Iterable[torch.Tensor] = ()) -> None:
        self._base = dict(filter(None, map(_storage, base)))
        self._live: dict[int, tuple[Any, int]] = {}
        self.live_bytes = sum(self._base.values())
        self.peak_bytes = self.live_bytes

    def add(self, out: Any) -> None:
        """Count the storages of the tensors in ``out`` (an op's result) and update the peak."""
        for cdata, (ref, nbytes) in list(self._live.items()):  # first retire, then add: addresses get reused
            if ref.expired():
                del self._live[cdata]
                self.live_bytes -= nbytes
        for t in tensors_of(out):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
                continue
            cdata = storage._cdata
            if cdata not in self._base and cdata not in self._live:
                nbytes = storage.nbytes()
                self._live[cdata] = (StorageWeakRef(storage), nbytes)
                self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
