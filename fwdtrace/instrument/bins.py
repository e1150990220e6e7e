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
from ..statistics.rule import _floor_float, as_dict, place_float, rebin

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
        self._exponent = 0  # the bins' width is 2**exponent; edges are multiples of it
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
        """Grow the edges so that ``[low, high]`` lies inside; True when they changed (fixed edges never do).

        The edges are :mod:`fwdtrace.statistics`' power-of-two bins (:func:`~fwdtrace.statistics.place_float`):
        first those of ``[low, high]``, then the narrowest at least twice as wide that hold the old edges too.
        """
        if self.fixed or not (math.isfinite(low) and math.isfinite(high)):
            return False
        low, high = (min(max(v, -RUNNING_LIMIT), RUNNING_LIMIT) for v in (min(low, high), max(low, high)))
        if self._edges is None:
            exponent, start = place_float(low, high, self.bins)
            if not self._holds(low, high, exponent, start):  # one bin across zero: it takes the low end
                exponent, start = place_float(low, low, self.bins)
            self._exponent = exponent
            self._set(start)
            return True
        first, last = float(self._edges[0]), float(self._edges[-1])
        if first <= low and high < last:
            return False
        old = self._exponent, round(first / self._width)
        exponent, start = place_float(min(low, first), max(high, last), self.bins, least=self._exponent + 1)
        if not self._holds(min(low, first), max(high, last), exponent, start):
            return False  # only one bin, on one side of zero: what lies beyond is counted outside
        counts, _, _ = rebin(self.counts, *old, exponent, start)  # whole bins into whole bins: nothing outside
        self.counts = counts.astype(np.int64)
        self._exponent = exponent
        self._set(start)
        self.rebins += 1
        return True

    def _holds(self, low: float, high: float, exponent: int, start: int) -> bool:
        return start * 2.0**exponent <= low and high < (start + self.bins) * 2.0**exponent

    @property
    def _width(self) -> float:
        return math.ldexp(1.0, self._exponent)

    def _set(self, start: int) -> None:
        self._edges = (start + np.arange(self.bins + 1, dtype=np.float64)) * self._width

    def summarize(self, values: Any, edges: bool = False) -> Any:
        """The :mod:`fwdtrace.statistics` summary of ``values`` with these bins' count; on the edges in use where
        they are fixed or ``edges`` is set."""
        import torch  # here: a recorder worker keeps bins from summaries made elsewhere, without torch

        from ..statistics.engine import summarize

        t = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.asarray(values, dtype=np.float64))
        on = self._edges is not None and (self.fixed or edges)
        return summarize(t, self.bins, self._edges.tolist() if on and self._edges is not None else None)

    def counts_of(self, vector: Any) -> tuple[np.ndarray, int, int]:
        """A summary's histogram (made with these bins' count, or on their fixed edges) on the edges in use:
        ``(counts, underflow, overflow)``; nothing kept."""
        return self._counts_of(vector)[:3]

    def _counts_of(self, vector: Any) -> tuple[np.ndarray, int, int, bool]:
        """A summary's histogram on the edges in use: ``(counts, underflow, overflow, exact)``. ``exact`` is False
        only where its bins were wider than ours (a range held at ``RUNNING_LIMIT``) and its values not all one:
        each bin's count then went where its low edge lies."""
        d = as_dict(vector, self.bins)
        exact = True
        if self.fixed or not math.isfinite(d["bin_exponent"]):  # counted on our edges, or on none
            counts, under, over = np.asarray(d["histogram"]), d["underflow"], d["overflow"]
        elif self._edges is None or not d["finite"]:
            counts, under, over = np.zeros(self.bins), 0.0, 0.0
        else:
            start = round(float(self._edges[0]) / self._width)
            if d["min"] == d["max"]:  # one value, wherever its bins: all in ours that holds it
                counts, i = np.zeros(self.bins), _floor_float(d["min"], self._exponent) - start
                total = sum(d["histogram"])
                under, over = (total, 0.0) if i < 0 else (0.0, total) if i >= self.bins else (0.0, 0.0)
                if 0 <= i < self.bins:
                    counts[i] = total
            else:
                exact = d["bin_exponent"] <= self._exponent
                counts, under, over = rebin(d["histogram"], int(d["bin_exponent"]), int(d["bin_start"]),
                                            self._exponent, start)
            under, over = under + d["underflow"], over + d["overflow"]
        return counts.astype(np.int64), int(under), int(over), exact

    def histogram(self, values: Any) -> np.ndarray:
        """Counts of ``values`` on the current edges (finite values only, those outside left out); nothing kept."""
        if self._edges is None:
            return np.zeros(self.bins, dtype=np.int64)
        return self._counts_of(self.summarize(values, edges=True))[0]

    def add(self, values: Any, vector: Any = None) -> tuple[np.ndarray, int, int]:
        """Grow the edges to fit ``values`` (an array or a tensor) if needed, then add their counts to
        :attr:`counts`; the values are summarised by :func:`fwdtrace.statistics.summarize` (``vector``: their
        summary by :meth:`summarize`, where made already), so a tensor of more than ``HISTOGRAM_SAMPLE`` values
        adds the counts of that many.

        Returns what ``values`` alone added: ``(counts, underflow, overflow)`` on the edges now in use.
        """
        vector = d = as_dict(self.summarize(values) if vector is None else vector, self.bins)  # read once
        if d["finite"]:
            self.fit(d["min"], d["max"])
        if not self._counts_of(vector)[3]:  # its bins wider than ours: counted again, on ours
            vector = self.summarize(values, edges=True)
        return self.add_summary(vector)

    def add_summary(self, vector: Any) -> tuple[np.ndarray, int, int]:
        """:meth:`add` of values already summarised (on this object's bins, and fixed edges where it has them)."""
        d = as_dict(vector, self.bins)
        self.nonfinite += int(d["nans"] + d["infs"])
        if d["finite"]:
            self.fit(d["min"], d["max"])
        counts, under, over, _ = self._counts_of(d)
        self.underflow += under
        self.overflow += over
        self.counts += counts
        return counts, under, over
