"""Running statistics of tensors: merges of :mod:`fwdtrace.statistics` summaries, at a constant cost per step.

Mean and variance merge by Chan et al.'s pairwise update, so two partial results merge exactly
as if the data had been seen at once; histograms on power-of-two bins merge by moving counts
into wider bins, histograms on fixed edges by addition.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

from .._tree import tensor_text
from ..errors import FwdtraceError, describe
from ..statistics import as_dict, place_float, rebin, summarize

__all__ = ["RunningStats", "summary_text", "check_bins", "check_range"]


def check_bins(bins: Any) -> int:
    """``bins`` if it is a positive int, else a FwdtraceError saying what was given."""
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise FwdtraceError(f"RunningStats expected bins as a positive int, got {bins!r}")
    return bins


def check_has_values(tensor: torch.Tensor, caller: str) -> None:
    """A FwdtraceError naming ``caller`` for a tensor that holds no values (the meta device's).

    Statistics read values; torch's own error ("Tensor.item() cannot be called on meta
    tensors") would name none of what the user called.
    """
    if tensor.is_meta:
        raise FwdtraceError(
            f"{caller} cannot summarise a tensor on the meta device (shape {list(tensor.shape)}, "
            f"{str(tensor.dtype).removeprefix('torch.')}): it holds no values. Run the model on a real device "
            f"(model.to_empty(device=...) and load its weights) for statistics; fwdtrace.trace and analyze "
            f"work on the meta device")


def check_range(range: Any) -> tuple[float, float] | None:  # noqa: A002
    """``range`` as ``(low, high)`` floats with low < high (or None), else a FwdtraceError."""
    if range is None:
        return None
    try:
        low, high = (float(v) for v in range)
        ok = not isinstance(range, str) and math.isfinite(low) and math.isfinite(high) and low < high
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise FwdtraceError(f"RunningStats expected range as (low, high) finite numbers with low < high, got {range!r}")
    return low, high


class RunningStats:
    """Count, mean, std, min, max, L2 norm, zero fraction, NaN/Inf counts and a histogram.

    >>> import torch
    >>> from fwdtrace.instrument.stats import RunningStats
    >>> s = RunningStats(bins=4, range=(0.0, 4.0))
    >>> s.update(torch.tensor([0.0, 1.0])); s.update(torch.tensor([2.0, 3.0]))
    >>> s.mean, s.std, s.histogram
    (1.5, 1.118033988749895, [1, 1, 1, 1])

    Each :meth:`update` summarises the tensor with :mod:`fwdtrace.statistics` and merges that
    summary in: mean and variance by Chan et al.'s pairwise update, so partial results merge as
    if the data had been seen at once. Mean, std (population, ``correction=0``), min, max and the
    L2 norm are over the finite values; ``zero_fraction`` is over all values.

    The histogram follows :mod:`fwdtrace.statistics`' rule: ``bins`` power-of-two bins around
    every finite value seen so far, which widen by whole doublings as values arrive (counts move
    into wider bins, never split), and are binned from at most ``HISTOGRAM_SAMPLE`` values per
    update. With ``range`` the edges are ``bins`` equal bins over it, kept; finite values outside
    count in ``underflow`` and ``overflow``. ``histogram=False`` keeps no histogram.
    """

    def __init__(self, bins: int = 16, range: tuple[float, float] | None = None,  # noqa: A002
                 histogram: bool = True) -> None:
        self.bins = check_bins(bins)
        self.keeps_histogram = histogram
        self.fixed: tuple[float, float] | None = check_range(range)  # edges the user set, kept
        # update() and merge() may run in several threads at once (a model run by a thread
        # pool); the state of one object changes under its lock.
        self._lock = threading.RLock()
        self.count = 0  # every element
        self.finite = 0
        self.mean = 0.0
        self._m2 = 0.0  # sum of squared deviations from the mean
        self.min = math.inf
        self.max = -math.inf
        self._l2 = 0.0  # merged by hypot: no square of a large norm overflows
        self.zeros = 0
        self.nans = 0
        self.infs = 0
        self.histogram = [0] * bins
        self._placed: tuple[int, int] | None = None  # the power-of-two bins (exponent, start), once values came
        self.underflow = 0
        self.overflow = 0

    @property
    def range(self) -> tuple[float, float] | None:
        """The histogram's first and last edges (None before any finite value, on a running range)."""
        if self.fixed is not None:
            return self.fixed
        if self._placed is None:
            return None
        exponent, start = self._placed
        return math.ldexp(start, exponent), math.ldexp(start + self.bins, exponent)

    def edges(self) -> list[float] | None:
        """The edges summaries are counted on for this object: its fixed ones, else None (their own)."""
        if self.fixed is None:
            return None
        lo, hi = self.fixed
        return [lo + (hi - lo) * i / self.bins for i in range(self.bins)] + [hi]

    @classmethod
    def from_summary(cls, numel: int, nan: int, inf: int, mean: float, std: float, min: float,  # noqa: A002
                     max: float) -> RunningStats:  # noqa: A002
        """The moments of a tensor known only by its summary (no histogram), to :meth:`merge` with others.

        >>> a = RunningStats.from_summary(numel=2, nan=0, inf=0, mean=1.0, std=0.0, min=1.0, max=1.0)
        >>> a.merge(RunningStats.from_summary(numel=2, nan=0, inf=0, mean=3.0, std=0.0, min=3.0, max=3.0)).std
        1.0
        """
        stats = cls(histogram=False)
        stats.count, stats.nans, stats.infs = numel, nan, inf
        finite = numel - nan - inf
        if finite > 0 and math.isfinite(mean):
            stats.finite, stats.mean, stats._m2, stats.min, stats.max = finite, mean, std * std * finite, min, max
        return stats

    # -- updating ---------------------------------------------------------------------------------
    def update(self, tensor: torch.Tensor) -> None:
        """Add every element of ``tensor`` (any shape, dtype and device)."""
        if not isinstance(tensor, torch.Tensor):
            raise FwdtraceError(f"RunningStats.update() expected a torch.Tensor, got {describe(tensor)}")
        check_has_values(tensor, "RunningStats.update()")
        with torch.no_grad():
            self.add_summary(summarize(tensor, self.bins, self.edges()))

    def add_summary(self, vector: Any) -> None:
        """Merge in one :mod:`fwdtrace.statistics` summary vector counted with this object's ``bins`` (and its
        :meth:`edges`, where fixed): what :meth:`update` does with the tensor's."""
        d = as_dict(vector, self.bins)
        other = RunningStats.__new__(RunningStats)  # what _merge reads, no more (no lock: never shared)
        other.bins, other.fixed, other.keeps_histogram = self.bins, self.fixed, self.keeps_histogram
        other.count, other.nans, other.infs = int(d["count"]), int(d["nans"]), int(d["infs"])
        other.zeros = int(d["zeros"]) if math.isfinite(d["zeros"]) else 0
        n = other.finite = int(d["finite"])
        other.histogram, other._placed, other.underflow, other.overflow = [0] * self.bins, None, 0, 0
        if n:
            # products, not powers: past float64 they are inf where ** raises
            other.mean, other._m2, other.min, other.max = d["mean"], d["std"] * d["std"] * n, d["min"], d["max"]
            other._l2 = d["norm"]
            if self.keeps_histogram:
                other.histogram = [int(c) for c in d["histogram"]]
                other.underflow, other.overflow = int(d["underflow"]), int(d["overflow"])
                if self.fixed is None and math.isfinite(d["bin_exponent"]):
                    other._placed = int(d["bin_exponent"]), int(d["bin_start"])
        else:
            other.mean = other._m2 = other._l2 = 0.0
            other.min, other.max = math.inf, -math.inf
        with self._lock:
            self._merge(other)

    def merge(self, other: RunningStats) -> RunningStats:
        """Fold ``other`` into these statistics (Chan's parallel update) and return ``self``."""
        if not isinstance(other, RunningStats):
            raise FwdtraceError(f"RunningStats.merge() expected a RunningStats, got {describe(other)}")
        if other is not self:
            with other._lock:  # a consistent copy, then merged under our own lock (no lock order to get wrong)
                other = other._copy()
        with self._lock:
            return self._merge(other)

    def _copy(self) -> RunningStats:
        new = RunningStats.__new__(RunningStats)
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_lock"})
        new.histogram = list(self.histogram)
        new._lock = threading.RLock()
        return new

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_sumsq" in state:  # pickled before the norm was kept as a norm
            state["_l2"] = math.sqrt(state.pop("_sumsq"))
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _merge(self, other: RunningStats) -> RunningStats:
        if other.finite and self.finite and self.keeps_histogram and other.keeps_histogram \
                and (other.bins != self.bins or other.fixed != self.fixed):
            raise FwdtraceError(
                "RunningStats.merge() expected the same histogram bins and range, got "
                f"{self.bins} bins on {self.fixed or 'a running range'} and {other.bins} bins on "
                f"{other.fixed or 'a running range'}"
            )
        if other.finite and not self.finite:
            self.bins, self.fixed = other.bins, other.fixed
            self.histogram = [0] * other.bins
        n_a, n_b = self.finite, other.finite
        n = n_a + n_b
        if n_b:
            delta = other.mean - self.mean
            self.mean += delta * n_b / n
            self._m2 += other._m2 + delta * delta * n_a * n_b / n
            self._merge_histogram(other)
            self.min = min(self.min, other.min)
            self.max = max(self.max, other.max)
            self._l2 = math.hypot(self._l2, other._l2)
            self.underflow += other.underflow
            self.overflow += other.overflow
        self.finite = n
        self.count += other.count
        self.zeros += other.zeros
        self.nans += other.nans
        self.infs += other.infs
        return self

    def _merge_histogram(self, other: RunningStats) -> None:
        """Add ``other``'s histogram to ours: on fixed edges by addition; on power-of-two bins, both moved onto
        the bins that hold every finite value of both (the coarser's, or wider), then added."""
        if self.fixed is not None or other._placed is None:
            self.histogram = [a + b for a, b in zip(self.histogram, other.histogram, strict=True)]
            return
        if self._placed is None:
            self._placed, self.histogram = other._placed, list(other.histogram)
            return
        if self.min <= other.min and other.max <= self.max and other._placed[0] <= self._placed[0]:
            placed = self._placed  # the values' range and the narrowest width as they were: the bins too
        else:
            placed = place_float(min(self.min, other.min), max(self.max, other.max), self.bins,
                                 least=max(self._placed[0], other._placed[0]))
        same = (np.asarray(self.histogram, dtype=np.float64), 0.0, 0.0)  # bins already the merged ones: as they are
        mine = same if placed == self._placed else rebin(self.histogram, *self._placed, *placed)
        theirs = rebin(other.histogram, *other._placed, *placed)
        self.histogram = [int(a + b) for a, b in zip(mine[0], theirs[0], strict=True)]
        self.underflow += int(mine[1] + theirs[1])
        self.overflow += int(mine[2] + theirs[2])
        self._placed = placed

    # -- results ----------------------------------------------------------------------------------
    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self.finite) if self.finite else math.nan

    @property
    def l2(self) -> float:
        return self._l2

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.count if self.count else math.nan

    @property
    def bin_edges(self) -> list[float]:
        if self.fixed is not None:
            return self.edges() or []
        if self._placed is None:
            return []
        exponent, start = self._placed
        return [math.ldexp(start + i, exponent) for i in range(self.bins + 1)]

    def to_dict(self) -> dict[str, Any]:
        """Every statistic as plain Python numbers and lists (JSON-serialisable but for NaN)."""
        empty = self.finite == 0
        return {
            "count": self.count,
            "mean": math.nan if empty else self.mean,
            "std": self.std,
            "min": math.nan if empty else self.min,
            "max": math.nan if empty else self.max,
            "l2": self.l2,
            "zero_fraction": self.zero_fraction,
            "nan": self.nans,
            "inf": self.infs,
            "histogram": list(self.histogram),
            "bin_edges": self.bin_edges,
            "underflow": self.underflow,
            "overflow": self.overflow,
        }

    def __repr__(self) -> str:
        return (
            f"RunningStats(count={self.count}, mean={self.mean:.4g}, std={self.std:.4g}, "
            f"min={self.min:.4g}, max={self.max:.4g}, nan={self.nans}, inf={self.infs})"
        )


def summary_text(tensor: Any, values: bool = False) -> str:
    """``float32[1, 4] mean=0.5 std=0.5 min=0 max=1``: one line about a tensor for printing.

    >>> import torch
    >>> summary_text(torch.tensor([[0.0, 1.0]]))
    'float32[1, 2] mean=0.5 std=0.5 min=0 max=1'

    With ``values=True`` the full tensor follows on the next lines. ``None`` (a missing
    gradient) and non-tensors are described by their type.
    """
    if not isinstance(tensor, torch.Tensor):
        return "None" if tensor is None else describe(tensor)
    head = tensor_text(tensor)
    if tensor.numel() and not tensor.is_complex() and tensor.dtype != torch.bool and not tensor.is_meta:
        with torch.no_grad():
            d = as_dict(summarize(tensor))
        head += f" mean={d['mean']:.4g} std={d['std']:.4g} min={d['min']:.4g} max={d['max']:.4g}"
        nonfinite = int(d["nans"] + d["infs"])
        if nonfinite:
            head += f" nonfinite={nonfinite}"
    if values:
        head += "\n" + str(tensor.detach())
    return head
