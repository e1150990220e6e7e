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

import functools
import math
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["FIELDS", "BINS", "SAMPLES", "summarize", "summarize_blocks", "summarize_in_graph", "sample_positions", "as_dict"]

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


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in flat C order, in its own dtype (a complex tensor's as real and imaginary parts)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1)


def summarize(t: torch.Tensor) -> torch.Tensor:
    """The statistics vector of ``t``, on ``t``'s device (see the module's docstring for its layout).

    >>> v = summarize(torch.tensor([1.0, 2.0, float("nan"), 3.0]))
    >>> as_dict(v)["mean"], as_dict(v)["nans"], as_dict(v)["samples"][:2]
    (2.0, 1.0, [1.0, 2.0])
    """
    flat = _flat(t)
    if torch.compiler.is_compiling():
        return summarize_in_graph(flat)
    on_cpu = flat.device.type == "cpu"
    if on_cpu and 0 < flat.numel() <= _CPU_BLOCK:
        finite = _summarize_finite(flat)
        if finite is not None:
            return finite
    # On a CPU in blocks that a reused workspace holds (see _Workspace); elsewhere whole
    per_block = _CPU_BLOCK if on_cpu else max(flat.numel(), 1)
    return summarize_blocks(lambda: iter(flat.split(per_block)), flat.numel(), _work_dtype(flat.device), flat.device)


def _summarize_finite(flat: torch.Tensor) -> torch.Tensor | None:
    """The statistics vector of a CPU tensor of finite values in a few kernels, each a single pass that torch
    vectorises (sums and dot products in float64, one bin count of bytes), with no NaN and Inf bookkeeping; None
    when a value is not finite (the sum then is not) or the values span past float64's range. Reading a CPU
    tensor's numbers costs no synchronisation; a compiled graph or another device takes the general route."""
    n = flat.numel()
    x, tmp = _Workspace(torch.float64).take(flat)
    total, sumsq, low, high = torch.stack([x.sum(), torch.dot(x, x), *torch.aminmax(x)]).tolist()
    width = high - low if high > low else 1.0
    # x - low below stays finite; width / BINS is exact there, so dividing by it bins as histc does
    if not (math.isfinite(total) and math.isfinite(width) and width / BINS >= sys.float_info.min):
        return None
    mean = total / n
    m2 = sumsq - total * mean  # as _head chooses it: see there
    if not m2 >= sumsq / 8:
        deviation = torch.sub(x, mean, out=tmp)
        m2 = float(torch.dot(deviation, deviation))
    # Bins 0 to BINS (the top edge's, folded into the last), as bytes: a byte per value to write and to count
    counts = torch.bincount(torch.sub(x, low, out=tmp).div_(width / BINS).to(torch.uint8), minlength=BINS + 1).tolist()
    head = [n, n, 0, 0, mean, math.sqrt(m2 / n), low, high, math.sqrt(sumsq)]
    histogram = counts[:BINS - 1] + [counts[BINS - 1] + counts[BINS]]
    return torch.cat([torch.tensor(head + histogram, dtype=torch.float64), x.index_select(0, _sample_index(n))])


def summarize_in_graph(flat: torch.Tensor) -> torch.Tensor:
    """:func:`summarize`'s vector of the flat tensor ``flat``, as a compiled graph computes it.

    Functional tensor ops only, each a pointwise op or a reduction over ``flat``'s values (no
    scatter, no in-place op), so that a compiler can fuse them into a few loops over the tensor;
    the route :func:`summarize_blocks` takes in place, through a workspace, made every tensor a
    score of kernels to generate and compile. The same numbers: the same sums in the same dtype,
    the same choice of the one-pass variance, the same bins (a compiler may contract a multiply
    and an add into one rounding: a value within a rounding of a bin's edge may fall on its other
    side). Summarising a CPU tensor, the eager routes are faster: a compiled dump hands those over.

    >>> v = summarize_in_graph(torch.tensor([1.0, 2.0, float("inf"), 3.0]))
    >>> as_dict(v)["mean"], as_dict(v)["infs"], as_dict(v)["histogram"][0]
    (2.0, 1.0, 1.0)
    """
    dtype = _work_dtype(flat.device)
    x = flat.to(dtype)
    count = x.numel()
    nan_at, inf_at = torch.isnan(x), torch.isinf(x)
    ok = ~(nan_at | inf_at)
    kept = torch.where(ok, x, 0)
    nans, infs = nan_at.sum().to(dtype), inf_at.sum().to(dtype)
    total, sumsq = kept.sum(), (kept * kept).sum()
    low, high = torch.where(ok, x, math.inf).amin(), torch.where(ok, x, -math.inf).amax()
    finite = count - nans - infs
    mean = _mean(total, finite)
    # the bins as summarize_blocks computes them, of the finite values only
    low_edge, scale, width = _bin_edges(low, high, finite)
    bins = ((torch.where(ok, x, low_edge) * scale - low_edge * scale) * BINS / width).floor().clamp(0, BINS - 1)
    # each value's bin compared with every bin's number, summed over the values: a reduction, no scatter
    edges = torch.arange(BINS, dtype=dtype, device=x.device)
    histogram = ((bins.unsqueeze(1) == edges) & ok.unsqueeze(1)).sum(0).to(dtype)
    deviation = torch.where(ok, x - mean, 0)
    head = _head(count, finite, nans, infs, total, sumsq, mean, (deviation * deviation).sum(), low, high)
    positions = torch.tensor(sample_positions(count), dtype=torch.long, device=x.device)
    return torch.cat([head, histogram, x.index_select(0, positions)])


@functools.lru_cache(maxsize=256)
def _sample_index(count: int) -> torch.Tensor:
    """:func:`sample_positions` as a CPU index tensor, made once per size."""
    return torch.tensor(sample_positions(count), dtype=torch.long)


def summarize_blocks(blocks: Callable[[], Iterable[torch.Tensor]], count: int,
                     dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """The statistics vector of the ``count`` values that ``blocks()`` yields in flat C order.

    ``blocks`` is called twice (two passes: the mean and the histogram's edges come first);
    every sum is a tensor, so nothing waits on the device. Each block is worked on in ``dtype``
    in two buffers, in place: on a CPU, allocating a temporary per op costs more than the op.
    """
    zero = torch.zeros((), dtype=dtype, device=device)
    nonfinite, signed, total, sumsq = zero, zero, zero, zero
    low = torch.full((), torch.inf, dtype=dtype, device=device)
    high = -low
    positions = sample_positions(count)
    picked: list[torch.Tensor] = []
    offset = 0
    workspace = _Workspace(dtype)
    for block in blocks():
        block = _flat(block)
        n = block.numel()
        x, tmp = workspace.take(block)
        if n:
            low = torch.minimum(low, tmp.copy_(x).nan_to_num_(nan=torch.inf, neginf=torch.inf).amin())
            high = torch.maximum(high, tmp.copy_(x).nan_to_num_(nan=-torch.inf, posinf=-torch.inf).amax())
        kept, bad = _split(x, tmp)
        # bad is 1 at a NaN, -1 at an Inf: its sum and its sum of squares give both counts
        signed = signed + bad.sum()
        nonfinite = nonfinite + torch.dot(bad, bad)
        total = total + kept.sum()
        sumsq = sumsq + torch.dot(kept, kept)
        # the samples in this block: a run of consecutive i, indexed on the device (no host-to-device copy)
        i_in = [i for i, p in enumerate(positions) if offset <= p < offset + n]
        if i_in:
            i = torch.arange(i_in[0], i_in[-1] + 1, device=block.device)
            picked.append(block[i * (count - 1) // max(len(positions) - 1, 1) - offset].to(dtype))
        offset += n
    finite = count - nonfinite
    mean = _mean(total, finite)
    low_edge, scale, width = _bin_edges(low, high, finite)
    # Non-finite values are replaced by the mean (no deviation), or by the least finite value where the mean is
    # not finite (a sum past the dtype's range), or by 0 where no value is finite (the edges are then [0, 1]); all
    # land in fill's bin, taken out below.
    fill = torch.where(mean.isfinite(), mean, low_edge)
    low_edge = low_edge * scale
    m2 = zero
    histogram = torch.zeros(BINS, dtype=dtype, device=device)
    one = torch.ones((), dtype=dtype, device=device)
    for block in blocks():
        block = _flat(block)
        kept, bad = _split(*workspace.take(block))
        filled = bad.mul_(bad).mul_(fill).add_(kept)
        deviation = kept.copy_(filled).sub_(mean)
        m2 = m2 + torch.dot(deviation, deviation)
        histogram.scatter_add_(0, _bins(filled.mul_(scale).sub_(low_edge), width), one.expand(block.numel()))
    histogram.scatter_add_(0, _bins((fill * scale - low_edge).reshape(1), width), -nonfinite.reshape(1))
    head = _head(count, finite, (nonfinite + signed) / 2, (nonfinite - signed) / 2, total, sumsq, mean, m2, low, high)
    return torch.cat([head, histogram, *picked])


def _mean(total: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The mean of ``finite`` values summing to ``total``; NaN with none."""
    return torch.where(finite == 0, torch.nan, total / finite.clamp(min=1))


def _bin_edges(low: torch.Tensor, high: torch.Tensor, finite: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The histogram's low edge (0 with no finite value), the scale the values are binned at and the scaled width
    (1 where every finite value is the same): a value is in bin ``(x * scale - low_edge * scale) * BINS / width``.

    Values that span past the dtype's range (a width of inf) are binned scaled by 1 / (2 * BINS), exact there, so
    that neither the width nor an offset times BINS overflows; else the scale is 1.
    """
    low_edge = torch.where(finite == 0, 0, low)
    width = torch.where(high > low, high - low, 1)
    scale = 1 - width.isinf().to(width.dtype) * (1 - 1 / (2 * BINS))
    return low_edge, scale, torch.where(width.isinf(), high * scale - low_edge * scale, width)


def _head(count: int, finite: torch.Tensor, nans: torch.Tensor, infs: torch.Tensor, total: torch.Tensor,
          sumsq: torch.Tensor, mean: torch.Tensor, deviations: torch.Tensor, low: torch.Tensor,
          high: torch.Tensor) -> torch.Tensor:
    """The :data:`FIELDS` as one vector, from the sums over the finite values and their squared ``deviations``
    from the mean. The sum of squared deviations is taken from the sums where that loses at most 3 of the
    dtype's bits (the mean within about 2.6 std of 0): the CPU's shorter route then skips the deviations' pass,
    with the same result."""
    one_pass = sumsq - total * mean
    m2 = torch.where(one_pass >= sumsq / 8, one_pass, deviations)
    none = finite == 0
    return torch.stack([torch.full_like(total, float(count)), finite, nans, infs, mean,
                        torch.where(none, torch.nan, (m2 / finite.clamp(min=1)).sqrt()), torch.where(none, torch.nan, low),
                        torch.where(none, torch.nan, high), torch.where(none, torch.nan, sumsq.sqrt())])


# A CPU tensor is summarised in blocks of at most this many elements, in a workspace kept per thread: a fresh
# buffer of a few hundred kB costs its page faults each time, more than the arithmetic on it.
_CPU_BLOCK = 1 << 18
_CPU_WORKSPACE = threading.local()


class _Workspace:
    """Two buffers of ``dtype`` for one block at a time: the CPU's kept per thread and reused (at most
    :data:`_CPU_BLOCK` elements each), another device's or a compiled graph's made per call."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.buffers: torch.Tensor | None = None

    def take(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``block`` copied into the first buffer in ``dtype``, and the second buffer, both of its size."""
        n = block.numel()
        buffers = self.buffers
        if buffers is None or buffers.shape[1] < n or buffers.device != block.device:
            reuse = block.device.type == "cpu" and n <= _CPU_BLOCK and not torch.compiler.is_compiling()
            buffers = getattr(_CPU_WORKSPACE, str(self.dtype), None) if reuse else None
            if buffers is None or buffers.shape[1] < n:
                buffers = torch.empty(2, _CPU_BLOCK if reuse else n, dtype=self.dtype, device=block.device)
                if reuse:
                    setattr(_CPU_WORKSPACE, str(self.dtype), buffers)
            self.buffers = buffers
        x, tmp = buffers[0, :n], buffers[1, :n]
        return x.copy_(block), tmp


def _split(x: torch.Tensor, tmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``tmp`` becomes ``x``'s finite values with 0 elsewhere, ``x`` 1 where it held a NaN, -1 an
    Inf, 0 a finite value. Arithmetic only: torch's boolean reductions (``isfinite(x).sum()``) are several times
    slower on a CPU."""
    kept = tmp.copy_(x).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return kept, x.sub_(kept).nan_to_num_(nan=1.0, posinf=-1.0, neginf=-1.0)


def _bins(offset: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The histogram bin of each value ``offset`` above the low edge, as ``torch.histc`` counts it
    (``offset * bins / width``, truncated; the top edge in the last bin), computed in place in ``offset``."""
    return offset.mul_(BINS).div_(width).floor_().clamp_(0, BINS - 1).long()


def as_dict(vector: Any) -> dict[str, Any]:
    """A statistics vector as ``{"count": ..., ..., "histogram": [...], "samples": [...]}`` of Python numbers."""
    # a tensor's or an array's tolist() in one call: iterating it makes a tensor per number
    values = [float(v) for v in (vector.tolist() if hasattr(vector, "tolist") else vector)]
    out: dict[str, Any] = dict(zip(FIELDS, values, strict=False))
    out["histogram"] = values[len(FIELDS):len(FIELDS) + BINS]
    out["samples"] = values[len(FIELDS) + BINS:]
    return out


def compared(vector: Any) -> list[float]:
    """What two statistics vectors are compared by, value against value: :data:`COMPARED`, then the samples."""
    d = as_dict(vector)
    return [d[name] for name in COMPARED] + d["samples"]
