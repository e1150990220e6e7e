"""The summary vector's layout and the histogram rule, in Python and NumPy (no torch: a recorder worker reads
summaries and keeps bins without it). :mod:`fwdtrace.statistics.engine` computes the vectors.

>>> as_dict([2, 2, 0, 0, 1, 0.5, 0.5, 0, 1, 1, -1, 0, 0, 0, 1, 1] + [0] * 14 + [0, 1], bins=16)["bin_edges"][:3]
[0.0, 0.5, 1.0]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

FIELDS = ("count", "finite", "nans", "infs", "zeros", "mean", "std", "min", "max", "norm",
          "bin_exponent", "bin_start", "underflow", "overflow")
(_COUNT, _FINITE, _NANS, _INFS, _ZEROS, _MEAN, _STD, _MIN, _MAX, _NORM, _EXP, _START, _UNDER, _OVER) = range(len(FIELDS))
_HEAD = len(FIELDS)
BINS = 16  # a dump's histogram bins (the live page and the recorder use more: see fwdtrace.instrument.bins)
SAMPLES = 8
HISTOGRAM_SAMPLE = 4096  # values binned per tensor at most (see the module's docstring)
BLOCK = 1 << 18  # values summed per float32 dot product / block of work on a CPU
COMPARED = ("mean", "std", "min", "max", "norm")  # compared by value between runs (the rest: counts)
_WEYL = (math.sqrt(5) - 1) / 2  # the golden ratio's fraction: the best-spread Weyl sequence
_MIN_EXPONENT, _MAX_EXPONENT = -1074, 1023
_FINEST = 40  # bins are at least 2**-40 of the values' magnitude wide: a bin's number is an exact float64
_EMPTY = (0.0, 0.0, 0.0, 0.0, 0.0) + (math.nan,) * 5  # the head of a tensor of no values


def width(bins: int = BINS, samples: int = SAMPLES) -> int:
    """The length of a summary vector with ``bins`` bins and ``samples`` sampled values."""
    return _HEAD + bins + samples


def sample_positions(count: int, samples: int = SAMPLES) -> list[int]:
    """The flat positions sampled from a tensor of ``count`` elements: evenly spaced, first and last included.

    >>> sample_positions(100, 4), sample_positions(2, 4), sample_positions(0)
    ([0, 33, 66, 99], [0, 1], [])
    """
    k = min(samples, count)
    if k == 1:
        return [0]
    return [i * (count - 1) // (k - 1) for i in range(k)]


@functools.lru_cache(maxsize=512)
def histogram_positions(count: int, sample: int = HISTOGRAM_SAMPLE) -> np.ndarray:
    """The flat positions a histogram bins in a tensor of ``count`` values: all of them up to ``sample``, else
    ``sample`` positions of a Weyl sequence (``floor(frac(i * 0.618...) * count)``, ``i`` from 1), sorted (two
    may fall on one position of a tensor of fewer than about 2.6 times ``sample`` values).

    >>> histogram_positions(5).tolist(), histogram_positions(10, 4).tolist()
    ([0, 1, 2, 3, 4], [2, 4, 6, 8])
    """
    if count <= sample:
        positions = np.arange(count, dtype=np.int64)
    else:
        positions = np.sort((np.modf(np.arange(1, sample + 1) * _WEYL)[0] * count).astype(np.int64))
    positions.flags.writeable = False
    return positions


def rebin(counts: Sequence[float] | np.ndarray, exponent: int, start: int, to_exponent: int,
          to_start: int) -> tuple[np.ndarray, float, float]:
    """Counts on the power-of-two bins ``(exponent, start)`` moved onto the bins ``(to_exponent, to_start)``, as
    many: ``(counts, underflow, overflow)``, what fell below and above the new bins apart. Onto wider bins (the
    rule's merges) each old bin lies inside one new bin: exact. Onto narrower ones, an old bin's count goes where
    its low edge lies.

    >>> counts, under, over = rebin([1, 2, 3, 4], -3, 0, -2, 1); counts.tolist(), under, over
    ([7.0, 0.0, 0.0, 0.0], 3.0, 0.0)
    """
    counts = np.asarray(counts, dtype=np.float64)
    bins = counts.size
    shift = round(exponent) - round(to_exponent)
    if shift == 0 and abs(start - to_start) < bins:  # the same width: a shift by whole bins
        offset = round(start) - round(to_start)
        out = np.zeros(bins, dtype=np.float64)
        out[max(offset, 0):bins + min(offset, 0)] = counts[max(-offset, 0):bins - max(offset, 0)]
        return out, float(counts[:max(-offset, 0)].sum()), float(counts[bins - max(offset, 0):].sum())
    if -60 < shift <= 0 and abs(start) < 2**60 and abs(to_start) < 2**60:  # in int64, at once (the common case)
        index = ((round(start) + np.arange(bins, dtype=np.int64)) >> -shift) - round(to_start)
        inside = (index >= 0) & (index < bins)
        out = np.bincount(index[inside], weights=counts[inside], minlength=bins)[:bins].astype(np.float64)
        return out, float(counts[index < 0].sum()), float(counts[index >= bins].sum())
    out = np.zeros(bins, dtype=np.float64)
    under = over = 0.0
    for j, c in enumerate(counts.tolist()):
        if not c:
            continue
        edge = round(start) + j  # Python ints: exact past int64 (a jump by 1e19 is 2**63 bins of the old width)
        i = (edge << shift if shift >= 0 else edge >> -shift) - round(to_start)
        if i < 0:
            under += c
        elif i >= bins:
            over += c
        else:
            out[i] += c
    return out, under, over



def place_float(low: float, high: float, bins: int, least: int | None = None) -> tuple[int, int]:
    """:func:`place` for Python floats: ``(exponent, start)`` as ints.

    >>> place_float(0.0, 0.45, 4), place_float(3.0, 3.0, 4), place_float(-1.0, 1.0, 2)
    ((-3, 0), (-10, 3071), (1, -1))
    """
    magnitude = max(abs(low), abs(high), 1.0)
    if not high > low:  # a single value: bins 2**-10 of its magnitude wide in all
        mantissa, exp2 = math.frexp(magnitude * 2.0**-10 / bins)
    else:  # span / bins as mantissa and exponent: neither the span (past float64's range) nor its share overflows
        halves = math.isinf(high - low)
        mantissa, exp2 = math.frexp(high / 2 - low / 2 if halves else high - low)
        mantissa, shift = math.frexp(mantissa / bins)
        exp2 += shift + halves
    exponent = exp2 - 2 if high > low else exp2 - (mantissa == 0.5)
    floor = max(_MIN_EXPONENT, math.frexp(max(abs(low), abs(high)))[1] - _FINEST,
                least if least is not None else _MIN_EXPONENT)
    exponent = min(max(exponent, floor), _MAX_EXPONENT)
    # floor(x / 2**e) by a multiplication, exact where the scale is a normal float of at least 1 (a value scaled
    # up stays within 2**(_FINEST + 1) and never rounds to -0.0); else by _floor_float
    if bins == 1 and low < 0 <= high:  # no single bin holds both signs: the one that holds the negative end
        exponent = min(max(math.frexp(max(abs(low), abs(high)))[1], exponent), _MAX_EXPONENT)
        return exponent, _floor_float(low, exponent)
    floor_at = _floor_fast if -1000 < exponent <= 0 else _floor_float
    # the least that fits is at most 3 above (span rounded; 2 bins need 2 doublings); one bin, any side of a
    # power of two, up to the values' own magnitude: _FINEST + 1 above the least exponent tried
    for _ in range(4 if bins > 1 else _FINEST + 2):
        if floor_at(high, exponent) - floor_at(low, exponent) <= bins - 1:
            break
        exponent = min(exponent + 1, _MAX_EXPONENT)
        floor_at = _floor_fast if -1000 < exponent <= 0 else _floor_float
    lo_bin, hi_bin = floor_at(low, exponent), floor_at(high, exponent)
    return exponent, lo_bin - max(bins - 1 - (hi_bin - lo_bin), 0) // 2


def _floor_fast(x: float, exponent: int) -> int:
    return math.floor(x * _SCALES[-exponent])


_SCALES = [2.0**k for k in range(1001)]  # 2**-exponent for the exponents _floor_fast takes


def _floor_float_array(values: np.ndarray, exponent: int) -> np.ndarray:
    """:func:`_floor_float` of every value (float64)."""
    scaled = np.ldexp(values, -exponent)
    return np.where((scaled == 0) & (values < 0), -1.0, np.floor(scaled))


def _floor_float(x: float, exponent: int) -> int:
    """``floor(x / 2**exponent)`` exactly, as a Python int (past float64's range where the quotient is)."""
    mantissa, shift = math.frexp(x)
    shift -= exponent
    if shift >= 53:  # an integer already: its exact value
        return int(math.ldexp(mantissa, 53)) << (shift - 53)
    scaled = math.ldexp(x, -exponent)
    return -1 if scaled == 0 and x < 0 else math.floor(scaled)


def as_dict(vector: Any, bins: int | None = None) -> dict[str, Any]:
    """A summary vector as ``{"count": ..., ..., "histogram": [...], "bin_edges": [...], "samples": [...]}`` of
    Python numbers; ``bins``: the vector's histogram bins, where not :data:`BINS`.

    The samples are those present (a tensor of fewer than :data:`SAMPLES` values has fewer); ``bin_edges`` is
    empty where the vector's bins were given edges or the tensor had no finite value. A dict (a vector read
    already) is returned as it is.
    """
    if isinstance(vector, dict):  # read already
        return vector
    values = [float(v) for v in (vector.tolist() if hasattr(vector, "tolist") else vector)]
    bins = BINS if bins is None else bins
    out: dict[str, Any] = dict(zip(FIELDS, values, strict=False))
    out["histogram"] = values[_HEAD:_HEAD + bins]
    count = int(out["count"]) if math.isfinite(out["count"]) else 0
    out["samples"] = values[_HEAD + bins:_HEAD + bins + min(SAMPLES, count)]
    e, s = out["bin_exponent"], out["bin_start"]
    if not math.isfinite(e):
        out["bin_edges"] = []
    elif -1000 < e < 1000 and abs(s) + bins < 2**52:  # exact as float64 products: in one pass
        scale = math.ldexp(1.0, int(e))
        out["bin_edges"] = [(s + i) * scale for i in range(bins + 1)]
    else:
        out["bin_edges"] = [_edge(s + i, int(e)) for i in range(bins + 1)]
    return out


def _edge(k: float, exponent: int) -> float:
    """``k * 2**exponent``; infinite past float64's range (the last edge of bins that hold its largest values)."""
    try:
        return math.ldexp(k, exponent)
    except OverflowError:
        return math.copysign(math.inf, k)


def compared(vector: Any) -> list[float]:
    """What two summary vectors are compared by, value against value: :data:`COMPARED`, then the samples."""
    d = as_dict(vector)
    return [d[name] for name in COMPARED] + d["samples"]
