"""Histogram edges that stay put over training: the same bins on the live page and in recorder videos.

A chart of a tensor over steps is only readable if its bins do not move. :class:`SteadyBins`
starts from the first sample's range and keeps its edges while later samples fall inside; a
sample that leaves them doubles the bin width until it fits. The width is a power of two and
every edge a multiple of it, so each new bin is exactly two old ones and counts kept so far
merge by addition (no value is ever re-assigned). Edges the user sets are kept as given.

A diverging run sends anything: a jump from 1 to 1e20, values near the largest float, inf, NaN.
None of it raises. A running range grows to at most ``±RUNNING_LIMIT`` (its edges stay finite);
values beyond it count as ``underflow``/``overflow``, non-finite ones as ``nonfinite``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import FwdtraceError

__all__ = ["SteadyBins", "check_bins_spec", "DEFAULT_BINS"]

DEFAULT_BINS = 60  # the recorder's and the live page's: the same values give the same edges in both
RUNNING_LIMIT = 2.0**1000  # a running range never reaches past this (about 1e301): its edges stay finite


def check_bins_spec(bins: Any, caller: str) -> int | tuple[float, ...]:
    """``bins`` as a positive int (a running range) or a tuple of 2+ increasing finite edges, else a FwdtraceError.

    >>> check_bins_spec(32, "f"), check_bins_spec([0, 0.5, 1], "f")
    (32, (0.0, 0.5, 1.0))
    """
    if isinstance(bins, int) and not isinstance(bins, bool):
        if bins >= 1:
            return bins
    elif isinstance(bins, Sequence) and not isinstance(bins, str):
        try:
            edges = tuple(float(e) for e in bins)
        except (TypeError, ValueError):
            edges = ()
        increasing = all(a < b for a, b in zip(edges, edges[1:], strict=False))
        if len(edges) >= 2 and all(math.isfinite(e) for e in edges) and increasing:
            return edges
    raise FwdtraceError(
        f"{caller} expected bins as a positive int or a list of 2+ increasing finite edges, got {bins!r}"
    )


class SteadyBins:
    """Bin edges that grow (by whole doublings) only when a sample leaves them, and the counts kept on them.

    >>> import numpy as np
    >>> b = SteadyBins(4)
    >>> _ = b.add(np.array([0.0, 0.15, 0.3, 0.45]))
    >>> b.edges.tolist(), b.counts.tolist()
    ([0.0, 0.125, 0.25, 0.375, 0.5], [1, 1, 1, 1])
    >>> _ = b.add(np.array([0.9])); b.edges.tolist(), b.counts.tolist()  # left the bins: the width doubled
    ([0.0, 0.25, 0.5, 0.75, 1.0], [2, 2, 0, 1])

    ``bins`` is the number of bins (edges from a running range) or the edges themselves (kept
    as given; values outside count as ``underflow``/``overflow``). Bins are half-open,
    ``[a, b)``: a running range always ends above the largest value seen, so each sample's
    counts equal ``numpy.histogram`` on the same edges. NaN and Inf are left out (``nonfinite``);
    a running range stops growing at ``±RUNNING_LIMIT`` and counts what lies beyond as outside.
    """

    def __init__(self, bins: int | Sequence[float] = DEFAULT_BINS) -> None:
        spec = check_bins_spec(bins, "SteadyBins")
        self.fixed = not isinstance(spec, int)
        self.bins = spec if isinstance(spec, int) else len(spec) - 1
        self._edges: np.ndarray | None = None if isinstance(spec, int) else np.asarray(spec, dtype=np.float64)
        self._width = 0.0  # a power of two; edges are low + i * width with low a multiple of width
        self.counts = np.zeros(self.bins, dtype=np.int64)
        self.underflow = self.overflow = self.nonfinite = 0
        self.rebins = 0  # how many times the edges grew

    @property
    def edges(self) -> np.ndarray:
        """The ``bins + 1`` edges now in use (empty before the first finite value of a running range)."""
        return np.empty(0) if self._edges is None else self._edges.copy()

    @property
    def range(self) -> tuple[float, float] | None:
        return None if self._edges is None else (float(self._edges[0]), float(self._edges[-1]))

    def fit(self, low: float, high: float) -> bool:
        """Grow the edges so that ``[low, high]`` lies inside; True when they changed (fixed edges never do)."""
        if self.fixed or not (math.isfinite(low) and math.isfinite(high)):
            return False
        low, high = (min(max(v, -RUNNING_LIMIT), RUNNING_LIMIT) for v in (min(low, high), max(low, high)))
        if self._edges is None:
            # The smallest power-of-two width whose bins span the first range (a point gets a narrow range around it).
            per_bin = ((high - low) or max(abs(low), 1.0) * 2.0**-10) / self.bins
            width = 2.0 ** (math.ceil(math.log2(per_bin)) if per_bin > 0 else -1074)  # -1074: the smallest float
            # One bin cannot straddle zero (its edges are multiples of the width): it takes the low end.
            self._width, start = self._place(low, high, width) or self._place(low, low, width) or (width, 0)
            self._set(start)
            return True
        first, last = float(self._edges[0]), float(self._edges[-1])
        if first <= low and high < last:
            return False
        old_start = round(first / self._width)
        placed = self._place(min(low, first), max(high, last), self._width * 2)
        if placed is None:  # only one bin, on one side of zero: what lies beyond is counted outside
            return False
        width, start = placed
        # Old bin j covers [j w, (j + 1) w), inside new bin j // factor: whole bins, merged exactly.
        # In Python ints, from the exponents: after a jump by 1e19 the factor is past int64, after 1e-320 -> 1e300 past float.
        factor = 2 ** round(math.log2(width) - math.log2(self._width))
        merged = np.zeros(self.bins, dtype=np.int64)
        index = [(old_start + j) // factor - start for j in range(self.bins)]
        np.add.at(merged, np.asarray(index, dtype=np.int64), self.counts)
        self.counts, self._width = merged, width
        self._set(start)
        self.rebins += 1
        return True

    def _place(self, low: float, high: float, width: float) -> tuple[float, int] | None:
        """The smallest width (``width`` times a power of two) and the start index whose bins hold ``[low, high)``.

        Among the starts that fit, the one that centres the range: room to drift either way.
        None when no width fits (a single bin across zero).
        """
        per_bin = (high - low) / self.bins
        if per_bin > width:  # skip at once the doublings that cannot fit (a jump from 1e-320 to 1e300 needs 2,000)
            width = 2.0 ** (round(math.log2(width)) + math.floor(math.log2(per_bin) - math.log2(width)))
        while width < 2.0**1010:  # any range inside ±RUNNING_LIMIT fits well before
            most = math.floor(low / width)  # the last start with start * width <= low
            least = math.floor(high / width) - self.bins + 1  # the first with high < (start + bins) * width
            if least <= most:
                centred = math.floor((low + high) / (2 * width) - self.bins / 2)
                return width, min(max(centred, least), most)
            width *= 2
        return None

    def _set(self, start: int) -> None:
        self._edges = (start + np.arange(self.bins + 1, dtype=np.float64)) * self._width

    def histogram(self, values: Any) -> np.ndarray:
        """Counts of ``values`` on the current edges (finite values only, those outside left out); nothing kept."""
        finite = _finite(values)
        if self._edges is None or finite.size == 0:
            return np.zeros(self.bins, dtype=np.int64)
        if self.fixed:
            inside = finite[(finite >= self._edges[0]) & (finite < self._edges[-1])]
            # searchsorted on the edges themselves: the same bin numpy.histogram gives, [a, b) everywhere.
            index = np.searchsorted(self._edges, inside, side="right") - 1
        else:
            low, high = self._edges[0], self._edges[-1]
            if finite.min() < low or finite.max() >= high:  # rare (a range at its limit): keep the bins' own
                finite = finite[(finite >= low) & (finite < high)]
            index = self._running_index(finite, round(float(low) / self._width))
            index = index[(index >= 0) & (index < self.bins)]
        return np.bincount(index, minlength=self.bins).astype(np.int64)[: self.bins]

    def _running_index(self, finite: np.ndarray, start: int) -> np.ndarray:
        """The bin of each value on a running range's edges (``(start + i) * width``), outside ones beyond ``0..bins-1``.

        A tenth of searchsorted's cost (the live sampler bins every parameter of a model): with
        ``width`` a power of two ``x / width`` is exact, so its floor is the ``[a, b)`` bin numpy
        gives. Except where it rounds to -0.0 (a negative x below ``width * 2**-1075``), which
        needs a subnormal x and a width of 2 or more: corrected then, at the cost of two more passes.
        """
        bins = np.floor(finite / self._width)
        if self._width >= 2.0:  # at 2 the smallest subnormal halves to a tie, rounded to -0.0
            bins[(bins == 0) & (finite < 0)] = -1
        return bins.astype(np.int64) - start

    def add(self, values: Any) -> tuple[np.ndarray, int, int]:
        """Grow the edges to fit ``values`` if needed, then add their counts to :attr:`counts`.

        Returns what ``values`` alone added: ``(counts, underflow, overflow)`` on the edges now in use.
        """
        finite = _finite(values)
        self.nonfinite += int(np.size(values)) - finite.size
        if finite.size == 0:
            return np.zeros(self.bins, dtype=np.int64), 0, 0
        low, high = float(finite.min()), float(finite.max())
        self.fit(low, high)
        under = over = 0
        assert self._edges is not None  # fit() placed them: finite values came
        if low < self._edges[0] or high >= self._edges[-1]:
            under = int((finite < self._edges[0]).sum())
            over = int((finite >= self._edges[-1]).sum())
            self.underflow += under
            self.overflow += over
        counts = self.histogram(finite)
        self.counts += counts
        return counts, under, over


def _finite(values: Any) -> np.ndarray:
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = np.isfinite(flat)
    return flat if finite.all() else flat[finite]  # no copy in the common case
