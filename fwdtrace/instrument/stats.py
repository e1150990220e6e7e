"""Running statistics of tensors, mergeable across steps at a constant cost per step.

Mean and variance use Welford's update in Chan et al.'s pairwise form, so two partial
results merge exactly as if the data had been seen at once; the histogram has fixed
edges (set by ``range`` or by the first batch) so histograms merge by addition.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from .._tree import tensor_text
from ..errors import FwdtraceError, describe

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

    Mean, std (population, ``correction=0``), min, max and the L2 norm are over the finite
    values; ``zero_fraction`` is over all values. Values outside the histogram's range are
    counted in ``underflow`` and ``overflow``. Without ``range`` the edges are the first
    batch's finite min and max, fixed from then on; ``histogram=False`` keeps no histogram (one pass less).
    """

    def __init__(self, bins: int = 16, range: tuple[float, float] | None = None,  # noqa: A002
                 histogram: bool = True) -> None:
        self.bins = check_bins(bins)
        self.keeps_histogram = histogram  # False: moments only (the live sampler bins on fwdtrace.instrument.bins.SteadyBins)
        self.range: tuple[float, float] | None = check_range(range)
        # update() and merge() may run in several threads at once (a model run by a thread
        # pool); the state of one object changes under its lock.
        self._lock = threading.RLock()
        self.count = 0  # every element
        self.finite = 0
        self.mean = 0.0
        self._m2 = 0.0  # sum of squared deviations from the mean
        self.min = math.inf
        self.max = -math.inf
        self._sumsq = 0.0
        self.zeros = 0
        self.nans = 0
        self.infs = 0
        self.histogram = [0] * bins
        self.underflow = 0
        self.overflow = 0

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
        with self._lock, torch.no_grad():
            x = tensor.detach().reshape(-1)
            if x.is_complex():
                x = torch.view_as_real(x).reshape(-1)
            x = x.to(torch.float64)
            n_all = x.numel()
            other = RunningStats(self.bins, self.range, self.keeps_histogram)
            other.count = n_all
            # One pass per statistic, and none of torch's slow boolean passes when the sum is
            # finite (then no value is NaN or Inf): the live sampler summarises whole models.
            finite = x
            if not math.isfinite(float(x.sum())):
                nan = torch.isnan(x)
                inf = torch.isinf(x)
                other.nans = int(nan.sum())
                other.infs = int(inf.sum())
                if other.nans or other.infs:  # boolean indexing copies
                    finite = x[~(nan | inf)]
            other.zeros = n_all - int(torch.count_nonzero(x))
            n = finite.numel()
            other.finite = n
            if n:
                mean = finite.mean()
                other.mean = float(mean)
                deviation = finite - mean
                other._m2 = float(torch.dot(deviation, deviation))
                low, high = torch.aminmax(finite)
                other.min, other.max = float(low), float(high)
                other._sumsq = float(torch.dot(finite, finite))
                if self.keeps_histogram and self.range is None and self.finite == 0:
                    lo, hi = other.min, other.max
                    if lo == hi:
                        lo, hi = lo - 0.5, hi + 0.5
                    self.range = other.range = (lo, hi)
                if other.range is not None:
                    lo, hi = other.range
                    # histc ignores values outside [lo, hi]: they are counted below.
                    hist = torch.histc(finite, bins=self.bins, min=lo, max=hi)
                    other.histogram = [int(v) for v in hist.tolist()]
                    other.underflow = int((finite < lo).sum())
                    other.overflow = int((finite > hi).sum())
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
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _merge(self, other: RunningStats) -> RunningStats:
        if other.finite and self.finite:
            if other.bins != self.bins or other.range != self.range:
                raise FwdtraceError(
                    "RunningStats.merge() expected the same histogram bins and range, got "
                    f"{self.bins} bins on {self.range} and {other.bins} bins on {other.range}"
                )
        elif other.finite:
            self.bins, self.range = other.bins, other.range
            self.histogram = [0] * other.bins
        n_a, n_b = self.finite, other.finite
        n = n_a + n_b
        if n_b:
            delta = other.mean - self.mean
            self.mean += delta * n_b / n
            self._m2 += other._m2 + delta * delta * n_a * n_b / n
            self.min = min(self.min, other.min)
            self.max = max(self.max, other.max)
            self._sumsq += other._sumsq
            self.histogram = [a + b for a, b in zip(self.histogram, other.histogram, strict=True)]
            self.underflow += other.underflow
            self.overflow += other.overflow
        self.finite = n
        self.count += other.count
        self.zeros += other.zeros
        self.nans += other.nans
        self.infs += other.infs
        return self

    # -- results ----------------------------------------------------------------------------------
    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self.finite) if self.finite else math.nan

    @property
    def l2(self) -> float:
        return math.sqrt(self._sumsq)

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.count if self.count else math.nan

    @property
    def bin_edges(self) -> list[float]:
        if self.range is None:
            return []
        lo, hi = self.range
        return [lo + (hi - lo) * i / self.bins for i in range(self.bins + 1)]

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
    if tensor.numel() and not tensor.is_complex() and tensor.dtype != torch.bool:
        with torch.no_grad():
            x = tensor.detach().to(torch.float64)
            head += (
                f" mean={float(x.mean()):.4g} std={float(x.std(correction=0)):.4g}"
                f" min={float(x.min()):.4g} max={float(x.max()):.4g}"
            )
            nonfinite = int((~torch.isfinite(x)).sum())
            if nonfinite:
                head += f" nonfinite={nonfinite}"
    if values:
        head += "\n" + str(tensor.detach())
    return head
