"""A tensor's statistics as one small vector, computed where the tensor lives.

A statistics dump (``Dumper(dir, values="statistics")``) stores, per tensor, this vector
instead of the tensor: a few hundred bytes whatever its size, so every step of a long run
can be dumped. It is computed on the tensor's device with no synchronisation (no
``.item()``, no boolean indexing); the dump copies the small result to the host once.
The same function summarises a full dump's tensor block by block (the blocks read from
the file), so a statistics dump compares against a full one.

Layout: the :data:`FIELDS` (count, finite, nans, infs, mean, std, min, max, L2 norm), then
a histogram of :data:`BINS` counts over ``[min, max]`` of the finite values, then up to
:data:`SAMPLES` values at evenly spaced positions of the flattened tensor. Mean, std
(population, ``correction=0``), min, max, the norm and the histogram are over the finite
values; with none, they are NaN (the histogram zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["FIELDS", "BINS", "SAMPLES", "summarize", "summarize_blocks", "sample_positions", "as_dict"]

FIELDS = ("count", "finite", "nans", "infs", "mean", "std", "min", "max", "norm")
BINS = 16
SAMPLES = 8
# compared by value (the rest are counts: compared exactly, or the histogram: not compared)
COMPARED = ("mean", "std", "min", "max", "norm")


def sample_positions(count: int, samples: int = SAMPLES) -> list[int]:
    """The flat positions sampled from a tensor of ``count`` elements: evenly spaced, first and last included.

    >>> sample_positions(100, 4), sample_positions(2, 4), sample_positions(0)
    ([0, 33, 66, 99], [0, 1], [])
    """
    k = min(samples, count)
    if k == 1:
        return [0]
    return [i * (count - 1) // (k - 1) for i in range(k)]


def _work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _flat(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).to(dtype)


def summarize(t: torch.Tensor) -> torch.Tensor:
    """The statistics vector of ``t``, on ``t``'s device (see the module's docstring for its layout).

    >>> v = summarize(torch.tensor([1.0, 2.0, float("nan"), 3.0]))
    >>> as_dict(v)["mean"], as_dict(v)["nans"], as_dict(v)["samples"][:2]
    (2.0, 1.0, [1.0, 2.0])
    """
    flat = _flat(t, _work_dtype(t.device))
    return summarize_blocks(lambda: iter((flat,)), flat.numel(), flat.dtype, flat.device)


def summarize_blocks(blocks: Callable[[], Iterable[torch.Tensor]], count: int,
                     dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """The statistics vector of the ``count`` values that ``blocks()`` yields in flat C order.

    ``blocks`` is called twice (two passes: the mean and the histogram's edges come first);
    every sum is a tensor, so nothing waits on the device.
    """
    zero = torch.zeros((), dtype=dtype, device=device)
    finite, nans, infs, total, sumsq = zero, zero, zero, zero, zero
    low = torch.full((), torch.inf, dtype=dtype, device=device)
    high = -low
    positions = sample_positions(count)
    picked: list[torch.Tensor] = []
    offset = 0
    for block in _as_work(blocks(), dtype):
        ok = torch.isfinite(block)
        finite = finite + ok.sum()
        nans = nans + torch.isnan(block).sum()
        infs = infs + torch.isinf(block).sum()
        kept = torch.where(ok, block, 0)
        total = total + kept.sum()
        sumsq = sumsq + (kept * kept).sum()
        low = torch.minimum(low, torch.where(ok, block, torch.inf).amin()) if block.numel() else low
        high = torch.maximum(high, torch.where(ok, block, -torch.inf).amax()) if block.numel() else high
        # the samples in this block: a run of consecutive i, indexed on the device (no host-to-device copy)
        i_in = [i for i, p in enumerate(positions) if offset <= p < offset + block.numel()]
        if i_in:
            i = torch.arange(i_in[0], i_in[-1] + 1, device=block.device)
            picked.append(block[i * (count - 1) // max(len(positions) - 1, 1) - offset])
        offset += block.numel()
    none = finite == 0
    nan = torch.full((), torch.nan, dtype=dtype, device=device)
    mean = torch.where(none, nan, total / finite.clamp(min=1))
    width = torch.where(high > low, high - low, 1)
    m2 = zero
    histogram = torch.zeros(BINS + 1, dtype=dtype, device=device)  # the last bin takes the non-finite values
    for block in _as_work(blocks(), dtype):
        ok = torch.isfinite(block)
        m2 = m2 + torch.where(ok, (block - mean) ** 2, 0).sum()
        bucket = ((torch.where(ok, block, low) - low) / width * BINS).floor().clamp(0, BINS - 1).long()
        histogram.scatter_add_(0, torch.where(ok, bucket, BINS), torch.ones_like(block))
    std = torch.where(none, nan, (m2 / finite.clamp(min=1)).sqrt())
    norm = torch.where(none, nan, sumsq.sqrt())
    low, high = torch.where(none, nan, low), torch.where(none, nan, high)
    head = torch.stack([torch.full((), float(count), dtype=dtype, device=device), finite, nans, infs, mean, std, low,
                        high, norm])
    return torch.cat([head, histogram[:BINS], *picked])


def _as_work(blocks: Iterable[torch.Tensor], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    for block in blocks:
        yield _flat(block, dtype)


def as_dict(vector: Any) -> dict[str, Any]:
    """A statistics vector as ``{"count": ..., ..., "histogram": [...], "samples": [...]}`` of Python numbers."""
    values = [float(v) for v in vector]
    out: dict[str, Any] = dict(zip(FIELDS, values, strict=False))
    out["histogram"] = values[len(FIELDS):len(FIELDS) + BINS]
    out["samples"] = values[len(FIELDS) + BINS:]
    return out


def compared(vector: Any) -> list[float]:
    """What two statistics vectors are compared by, value against value: :data:`COMPARED`, then the samples."""
    d = as_dict(vector)
    return [d[name] for name in COMPARED] + d["samples"]
