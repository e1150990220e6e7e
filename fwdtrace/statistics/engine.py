"""The engine's computing half: a tensor's summary vector on the CPU (a few passes, NumPy for the histogram) and
with tensor ops only (inside a compiled graph, on another device). See :mod:`fwdtrace.statistics`."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from .._host import shared_array, to_numpy
from .rule import (
    _COUNT,
    _EMPTY,
    _EXP,
    _FINEST,
    _FINITE,
    _HEAD,
    _INFS,
    _MAX,
    _MAX_EXPONENT,
    _MEAN,
    _MIN,
    _MIN_EXPONENT,
    _NANS,
    _NORM,
    _OVER,
    _SCALES,
    _STD,
    _WEYL,
    _ZEROS,
    BINS,
    BLOCK,
    HISTOGRAM_SAMPLE,
    SAMPLES,
    _floor_float_array,
    histogram_positions,
    place_float,
    sample_positions,
    width,
)

_TINY = {torch.float32: 2.0**-100, torch.float64: 2.0**-960}  # sums of squares below: some squares lost bits


# -- where the values are read -----------------------------------------------------------------------------
def _histogram_positions_on(count: int, device: torch.device) -> torch.Tensor:
    """:func:`histogram_positions` made by tensor ops on ``device`` (traceable: the same IEEE operations)."""
    if count <= HISTOGRAM_SAMPLE:
        return torch.arange(count, device=device)
    i = torch.arange(1, HISTOGRAM_SAMPLE + 1, dtype=torch.float64, device=device)
    return torch.sort(((i * _WEYL).frac() * count).long()).values


@functools.lru_cache(maxsize=512)
def _gather_index(count: int) -> torch.Tensor:
    """The CPU index of a tensor's sampled values, then its histogram's positions (the array shared with torch)."""
    return torch.from_numpy(np.concatenate([np.asarray(sample_positions(count), dtype=np.int64),
                                            histogram_positions(count)]))


@functools.lru_cache(maxsize=512)
def _gather_array(count: int) -> np.ndarray:
    """:func:`_gather_index` as a NumPy array."""
    return shared_array(_gather_index(count))


def _gathered(flat: torch.Tensor, values: np.ndarray | None = None) -> np.ndarray:
    """``flat``'s sampled values, then its histogram's, as a float32 or float64 array; ``values``: ``flat``'s
    memory as an array, where the caller has it."""
    if flat.dtype in _NUMPY_WORK:
        return (shared_array(flat) if values is None else values).take(_gather_array(flat.numel()))
    g = flat.index_select(0, _gather_index(flat.numel()))
    return to_numpy(g, _work_dtype(g.dtype))


# -- the histogram rule ------------------------------------------------------------------------------------
def place(low: torch.Tensor, high: torch.Tensor, bins: int, least: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The power-of-two bins for values in ``[low, high]`` (tensors of any shape, finite, ``low <= high``):
    ``(exponent, start)`` as float64 tensors, bin ``i`` being ``[(start + i) * 2**exponent, (start + i + 1) *
    2**exponent)``. The exponent is the least whose ``bins`` aligned bins hold both ends (and at least ``least``,
    and no less than ``2**-`` :data:`_FINEST` of the values' magnitude, so that a bin's number stays exact);
    the occupied bins are centred, the odd spare bin above. A single value gets bins ``2**-10`` of its magnitude
    (at least 1) wide in all. Tensor ops only: no synchronisation, traceable by dynamo.

    >>> e, s = place(torch.tensor(0.0, dtype=torch.float64), torch.tensor(0.45, dtype=torch.float64), 4)
    >>> float(e), float(s)
    (-3.0, 0.0)
    """
    low, high = low.to(torch.float64), high.to(torch.float64)
    magnitude = torch.maximum(torch.maximum(low.abs(), high.abs()), torch.ones_like(low))
    span = high - low
    halves = span.isinf()  # past float64's range: from the halves
    span = torch.where(halves, high / 2 - low / 2, torch.where(high > low, span, magnitude * 2.0**-10))
    mantissa, exp2 = torch.frexp(span)  # then span / bins: 2**(exp2 - 1) <= span / bins < 2**exp2, no underflow
    mantissa, shift = torch.frexp(mantissa / bins)
    exp2 = exp2 + shift + halves.to(exp2.dtype)
    # a range: from a rounding below the least that fits; a single value: 2**ceil(log2(width per bin))
    exponent = torch.where(high > low, exp2 - 2.0, exp2 - (mantissa == 0.5).to(torch.float64))
    floor = torch.frexp(torch.maximum(low.abs(), high.abs()))[1].to(torch.float64) - _FINEST
    if least is not None:
        floor = torch.maximum(floor, least.to(torch.float64))
    exponent = torch.maximum(exponent.to(torch.float64), floor).clamp(_MIN_EXPONENT, _MAX_EXPONENT)
    # the least that fits is at most 3 above (span rounded; 2 bins need 2 doublings); one bin, any side of a power
    # of two, up to the values' own magnitude: _FINEST + 1 above
    for _ in range(4 if bins > 1 else _FINEST + 2):
        exponent = torch.where(_fits(low, high, exponent, bins), exponent, (exponent + 1).clamp(max=_MAX_EXPONENT))
    if bins == 1:  # no single bin holds both signs: the one that holds the negative end
        across = (low < 0) & (high >= 0)
        exponent = torch.where(across, torch.maximum(torch.frexp(torch.maximum(low.abs(), high.abs()))[1]
                                                     .to(torch.float64), floor).clamp(max=_MAX_EXPONENT), exponent)
    lo_bin, hi_bin = _floor_scaled(low, exponent), _floor_scaled(high, exponent)
    return exponent, lo_bin - torch.floor((bins - 1 - (hi_bin - lo_bin)).clamp(min=0) / 2)


def _floor_scaled(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``floor(x / 2**exponent)`` exactly (a negative value rounding to -0.0 is in bin -1). Scaled in two steps:
    torch's ``ldexp`` multiplies by ``2**k``, itself past float64 beyond ``k = 1023``."""
    half = torch.floor(-exponent / 2)
    scaled = torch.ldexp(torch.ldexp(x, half), -exponent - half)
    return torch.where((scaled == 0) & (x < 0), -1.0, torch.floor(scaled))


def _fits(low: torch.Tensor, high: torch.Tensor, exponent: torch.Tensor, bins: int) -> torch.Tensor:
    return _floor_scaled(high, exponent) - _floor_scaled(low, exponent) <= bins - 1


# -- the CPU's route --------------------------------------------------------------------------------------
_WORKSPACE = threading.local()


def _buffer(dtype: torch.dtype, which: int) -> torch.Tensor:
    """A reused buffer of :data:`BLOCK` values of ``dtype``, per thread (fresh ones cost page faults)."""
    key = f"{dtype}{which}"
    found = getattr(_WORKSPACE, key, None)
    if found is None:
        found = torch.empty(BLOCK, dtype=dtype)
        setattr(_WORKSPACE, key, found)
    return found


_NUMPY_WORK = frozenset({torch.float32, torch.float64})  # read by NumPy where they lie, in their own dtype
_REAL = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool})


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in flat C order (a complex tensor's as real and imaginary parts), detached."""
    t = t.detach()
    if t.dtype not in _REAL:  # the usual dtypes need neither check (each call counts, at a layer's size)
        if t.is_quantized:
            t = t.dequantize()
        if t.is_complex():
            t = torch.view_as_real(t.resolve_conj())
    return t.resolve_neg().reshape(-1)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float64


def _blocks_of(flat: torch.Tensor) -> Iterable[torch.Tensor]:
    """``flat`` in blocks of at most :data:`BLOCK` values, each in its work dtype (a reused buffer's copy where
    the dtype differs)."""
    work = _work_dtype(flat.dtype)
    for block in flat.split(BLOCK):
        yield block if block.dtype == work else _buffer(work, 0)[: block.numel()].copy_(block)


_SMALL = 8192  # float32 blocks up to this size: NumPy's reductions, whose calls cost less than torch's


def _moments(x: torch.Tensor, values: np.ndarray | None = None) -> list[float]:
    """Sum, sum of squares, min, max and the count of non-zero values of a block of float32 or float64 values, as
    Python numbers: one pass each, in as few calls as the numbers need (at a layer's size each call's own cost is
    most of a pass). A small float32 block is widened to float64 and reduced by NumPy; else the sum and squares
    by torch's cascaded sum and :func:`_squares` (NumPy), min and max by NumPy (no conversion of the
    result), the zeros as NumPy's count of ``x == 0`` (torch's ``count_nonzero`` branches per value, 6x slower).
    ``values``: ``x``'s memory as an array, where the caller has it.
    """
    if values is None:
        values = shared_array(x)
    # inf - inf: NaN, and squares past float32: inf, as torch gives them (then float64 or the careful route)
    with np.errstate(invalid="ignore", over="ignore"):
        if x.dtype == torch.float32 and x.numel() <= _SMALL:
            wide = values.astype(np.float64)
            return [float(wide.sum()), float(np.dot(wide, wide)), float(values.min()), float(values.max()),
                    float(np.count_nonzero(values))]
        zeros = np.count_nonzero(np.equal(values, 0, out=_flags(values.size)))
        return [float(x.sum()), _squares(x, values), float(values.min()), float(values.max()), float(values.size - zeros)]


_ROW = 1024  # values per row whose dot product with itself is one of a block's sums of squares


def _squares(x: torch.Tensor, values: np.ndarray | None = None) -> float:
    """The sum of ``x``'s squares: in float32, the sums (in float64) of the dot products of its rows of
    :data:`_ROW` values with themselves (a dot product over the whole block adds up in order, 10x the error at
    2**18 values), and of the rest; in float64 (or a short float32 block) one dot product. ``values``: ``x``'s
    memory as an array, where the caller has it. Its callers silence NumPy's warning of squares past float32."""
    n = x.numel()
    if x.dtype == torch.float64 or n < 2 * _ROW:
        return float(torch.dot(x, x))
    if values is None:
        values = shared_array(x)
    body = n - n % _ROW
    rows = values[:body].reshape(-1, _ROW)
    total = float(np.einsum("ij,ij->i", rows, rows).sum(dtype=np.float64))
    if body < n:
        tail = values[body:]
        total += float(np.dot(tail, tail))
    return total


def _flags(n: int) -> np.ndarray:
    """A reused boolean array of ``n`` values, per thread."""
    found = getattr(_WORKSPACE, "flags", None)
    if found is None:
        found = _WORKSPACE.flags = np.empty(BLOCK, dtype=bool)
    return found[:n]


class Pending:
    """A CPU tensor's summary but for its histogram, which :func:`finish` bins with other tensors': its moments
    and extremes (read from the values at once, before a later in-place write) and its gathered values; then
    its ``vector``."""

    __slots__ = ("count", "gathered", "head", "vector")

    def __init__(self, head: Sequence[float], gathered: np.ndarray, count: int) -> None:
        # a tuple of floats, which Python's collector stops tracking (a dump holds a step's summaries)
        self.head, self.gathered, self.count = tuple(head), gathered, count
        self.vector: np.ndarray | None = None


def _pending(t: torch.Tensor) -> Pending:
    """A CPU tensor's :class:`Pending` summary: its blocks' moments and its gathered values."""
    flat = _flat(t)
    values = shared_array(flat) if flat.dtype in _NUMPY_WORK else None  # read where it lies: the array made once
    return Pending(_head(flat, values), _gathered(flat, values), flat.numel())


def summarize_all(tensors: Sequence[torch.Tensor], bins: int = BINS, edges: Sequence[float] | None = None
                  ) -> torch.Tensor:
    """The summary vectors of CPU ``tensors`` as the rows of one float64 matrix: each tensor's moments in five
    passes (:func:`_moments`) per block of :data:`BLOCK` values, read with one conversion to Python numbers, then
    its histogram from its sampled values in NumPy.

    >>> from fwdtrace.statistics import as_dict
    >>> m = summarize_all([torch.arange(4.0), torch.ones(3)])
    >>> m.shape, as_dict(m[0])["max"], as_dict(m[1])["std"]
    (torch.Size([2, 38]), 3.0, 0.0)
    """
    return torch.from_numpy(_matrix([_pending(t) for t in tensors], bins, edges))


def _head_of(flat: torch.Tensor, got: list[float]) -> list[float]:
    """The :data:`FIELDS` up to the norm from a tensor's per-block moments: where a sum left the dtype's range or
    lost its squares, over finite float32 values its sums again in float64; where a value is not finite (or the
    sums otherwise left their range, or the variance cancels there), from the careful route."""
    n = flat.numel()
    if not n:
        return list(_EMPTY)
    if len(got) == 5:  # one block
        total, sumsq, low, high, nonzero = got
    else:
        total, sumsq = math.fsum(got[0::5]), math.fsum(got[1::5])
        low, high = min(got[2::5]), max(got[3::5])
        nonzero = sum(got[4::5])
    # a NaN, an Inf or a sum past the dtype's range; or squares that fell below its normal range
    if not all(map(math.isfinite, (total, sumsq, low, high))) or (sumsq < _TINY[_work_dtype(flat.dtype)] and nonzero):
        if not (flat.dtype == torch.float32 and math.isfinite(low) and math.isfinite(high)):
            return _careful_head(flat)
        # finite float32 values (a large negative mask fill, tiny values): their sums in float64 neither overflow
        # nor lose a square, in two passes where the careful route takes a dozen
        wide = shared_array(flat).astype(np.float64)
        total, sumsq = float(wide.sum()), float(np.dot(wide, wide))
        mean = total / n
        m2 = sumsq - total * mean
        # a NaN the blocks' extremes did not show (Python's min and max pass it over), or a variance that cancels
        if not (math.isfinite(total) and math.isfinite(sumsq) and m2 >= sumsq / 8):
            return _careful_head(flat)
    else:
        mean = total / n
        m2 = sumsq - total * mean
        if not m2 >= sumsq / 8:  # the one-pass variance lost more than 3 bits: a second pass, about the mean
            m2, mean = _deviations(flat, mean)
    return [n, n, 0.0, 0.0, n - nonzero, mean, math.sqrt(max(m2, 0.0) / n), low, high, math.sqrt(sumsq)]


def _deviations(flat: torch.Tensor, mean: float) -> tuple[float, float]:
    """The sum of squared deviations of ``flat``'s values from their mean, and that mean, from a second pass about
    ``mean`` rounded to the work dtype: the deviations' sum corrects both (the mean then to the spread's rounding,
    not the magnitude's)."""
    near = float(torch.tensor(mean, dtype=_work_dtype(flat.dtype)))
    total, count, shift = 0.0, 0, 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # as in _moments: squares past float32 are inf (then float64)
        for x in _blocks_of(flat):
            deviation = torch.sub(x, near, out=_buffer(x.dtype, 1)[: x.numel()])
            total += _squares(deviation)
            shift += float(deviation.sum())
            count += x.numel()
    if not count:
        return 0.0, mean
    return total - shift * shift / count, near + shift / count


def _careful_head(flat: torch.Tensor) -> list[float]:
    """:func:`_head_of` for a tensor holding NaN or Inf, or whose sums left their dtype's range (but a float32
    one's that float64 holds): in float64, over the finite values scaled by a power of two to a largest magnitude
    in [0.5, 1) (no square overflows or lies below float64's normal range but those the largest dwarfs)."""
    x = flat.to(torch.float64)
    finite_at = torch.isfinite(x)
    nans, n = int(torch.isnan(x).sum()), x.numel()
    finite = int(finite_at.sum())
    infs = n - finite - nans
    kept = torch.where(finite_at, x, 0.0)
    zeros = finite - int(torch.sign(kept).abs_().sum())
    if not finite:
        return [n, 0.0, nans, infs, zeros] + [math.nan] * 5
    low = float(torch.where(finite_at, x, math.inf).amin())
    high = float(torch.where(finite_at, x, -math.inf).amax())
    scale = math.ldexp(1.0, min(-math.frexp(max(abs(low), abs(high)))[1], 1023)) if high or low else 1.0
    scaled = kept * scale
    mean = float(scaled.sum()) / finite  # of the scaled values: finite where the sum of the values is not
    deviation = torch.where(finite_at, scaled - mean, 0.0)
    m2 = float(torch.dot(deviation, deviation))
    mean += float(deviation.sum()) / finite  # corrected by the deviations' own sum
    norm = math.sqrt(float(torch.dot(scaled, scaled))) / scale
    return [n, finite, nans, infs, zeros, mean / scale, math.sqrt(m2 / finite) / scale, low, high, norm]


def _matrix(pending: Sequence[Pending], bins: int, edges: Sequence[float] | None) -> np.ndarray:
    """The summary matrix of tensors each known by its head and its gathered values (its samples, then its
    histogram's, in float32 or float64), in NumPy: a few operations per tensor on at most
    :data:`HISTOGRAM_SAMPLE` values, where torch's cost per call would be most of the work."""
    fixed = None if edges is None else np.asarray(edges, dtype=np.float64)
    out = np.full((len(pending), width(bins)), np.nan)
    for row, p in zip(out, pending, strict=True):
        head, values = p.head, p.gathered
        k = min(SAMPLES, p.count)
        row[:_NORM + 1] = head
        row[_HEAD + bins:_HEAD + bins + k] = values[:k]
        values = values[k:]
        if head[_FINITE] != head[_COUNT]:
            values = values[np.isfinite(values)]
        exponent = start = math.nan
        under = over = 0
        if fixed is not None:
            index = np.searchsorted(fixed, values, side="right") - 1
            under, over = int((index < 0).sum()), int((index >= bins).sum())
            index = index[(index >= 0) & (index < bins)]
        elif head[_FINITE]:
            exponent, start = place_float(head[_MIN], head[_MAX], bins)
            # values * 2**-exponent is exact (in the values' own dtype: only the exponent changes), its floor the
            # bin's number. Every value lies in [min, max], inside the bins (but for one bin across 0). Scaled down
            # (bins wider than 1) a tiny negative value may round to -0.0, in bin -1, and a scale past the dtype's
            # range is no number: the general route then.
            if not 0 <= -exponent <= (126 if values.dtype == np.float32 else 1000) or bins == 1:
                index = (_floor_float_array(values.astype(np.float64), exponent) - start).astype(np.intp)
                under, over = int((index < 0).sum()), int((index >= bins).sum())
                index = index[(index >= 0) & (index < bins)]
            else:  # a power of two at least 1, in the values' dtype: the product is exact
                index = np.floor(values * values.dtype.type(_SCALES[-exponent])).astype(np.intp)
                index -= start
        else:
            index = np.zeros(0, dtype=np.intp)
        row[_EXP:_OVER + 1] = exponent, start, under, over
        row[_HEAD:_HEAD + bins] = np.bincount(index, minlength=bins)
    return out


def summarize_blocks(blocks: Callable[[], Iterable[torch.Tensor]], count: int, bins: int = BINS) -> torch.Tensor:
    """The summary vector of the ``count`` values that ``blocks()`` yields in flat C order (a tensor read from a
    file a block at a time): the same numbers as :func:`summarize` of the whole tensor, to the sums' rounding.
    Each block is summarised alone and the summaries merged (:func:`_merge_heads`); ``blocks()`` is read once.
    """
    wanted = _gather_index(count)
    heads: list[list[float]] = []
    gathered = torch.zeros(wanted.numel(), dtype=torch.float64)
    offset = 0
    for block in blocks():
        flat = _flat(block)
        n = flat.numel()
        heads.append(_head(flat))
        inside = (wanted >= offset) & (wanted < offset + n)  # in the order the whole tensor's are gathered
        gathered[inside] = flat.index_select(0, wanted[inside] - offset).to(torch.float64)
        offset += n
    return torch.from_numpy(_matrix([Pending(_merge_heads(heads), to_numpy(gathered), count)], bins, None)[0])


def _head(flat: torch.Tensor, values: np.ndarray | None = None) -> list[float]:
    """:func:`_head_of` one tensor, from its blocks' moments; ``values``: ``flat``'s memory as an array, where the
    caller has it."""
    n = flat.numel()
    if not n:
        return _head_of(flat, [])
    if n <= BLOCK and flat.dtype in _NUMPY_WORK:  # one block, in its own dtype: no copy
        return _head_of(flat, _moments(flat, values))
    return _head_of(flat, [p for x in _blocks_of(flat) for p in _moments(x)])


def _merge_heads(heads: list[list[float]]) -> list[float]:
    """The head of the concatenation of tensors with these heads (Chan's pairwise update; norms by ``hypot``, and
    products rather than powers, so that nothing past float64's range raises)."""
    out = [0.0, 0.0, 0.0, 0.0, 0.0, math.nan, math.nan, math.nan, math.nan, math.nan]
    m2 = norm = 0.0
    for h in heads:
        n_a, n_b = out[_FINITE], h[_FINITE]
        out[_COUNT] += h[_COUNT]
        out[_NANS] += h[_NANS]
        out[_INFS] += h[_INFS]
        out[_ZEROS] += h[_ZEROS]
        if n_b:
            if not n_a:
                out[_MEAN], m2, out[_MIN], out[_MAX], norm = h[_MEAN], h[_STD] * h[_STD] * n_b, h[_MIN], h[_MAX], h[_NORM]
            else:
                delta = h[_MEAN] - out[_MEAN]
                out[_MEAN] += delta * n_b / (n_a + n_b)
                m2 += h[_STD] * h[_STD] * n_b + delta * delta * n_a * n_b / (n_a + n_b)
                out[_MIN], out[_MAX] = min(out[_MIN], h[_MIN]), max(out[_MAX], h[_MAX])
                norm = math.hypot(norm, h[_NORM])
            out[_FINITE] = n_a + n_b
    if out[_FINITE]:
        out[_STD], out[_NORM] = math.sqrt(m2 / out[_FINITE]), norm
    return out


# -- on another device, or inside a compiled graph ---------------------------------------------------------
def summarize_in_graph(flat: torch.Tensor, bins: int = BINS, edges: Sequence[float] | None = None) -> torch.Tensor:
    """:func:`summarize`'s vector of the flat tensor ``flat`` with tensor ops only: no synchronisation (the vector
    stays on ``flat``'s device until it is read) and nothing dynamo cannot trace.

    The same numbers as the CPU's route, its sums in float64 (float32 on a device without it).

    >>> from fwdtrace.statistics import as_dict
    >>> v = summarize_in_graph(torch.tensor([1.0, 2.0, float("inf"), 3.0]))
    >>> as_dict(v)["mean"], as_dict(v)["infs"], sum(as_dict(v)["histogram"])
    (2.0, 1.0, 3.0)
    """
    dtype = torch.float32 if flat.device.type == "mps" else torch.float64  # MPS has no float64
    x = flat.to(dtype)
    count = x.numel()
    if count == 0:  # no reduction over nothing: the CPU's vector of an empty tensor
        return torch.tensor([*_EMPTY] + [math.nan, math.nan, 0.0, 0.0] + [0.0] * bins + [math.nan] * SAMPLES, dtype=torch.float64,
                            device=x.device)
    nan_at, inf_at = torch.isnan(x), torch.isinf(x)
    ok = ~(nan_at | inf_at)
    nans, infs = nan_at.sum().to(dtype), inf_at.sum().to(dtype)
    finite = count - nans - infs
    low, high = torch.where(ok, x, math.inf).amin(), torch.where(ok, x, -math.inf).amax()
    none = finite == 0
    # scaled by a power of two to a largest magnitude in [0.5, 1), as the CPU's careful route: no square overflows
    # or falls below the normal range but those the largest dwarfs
    biggest = torch.where(none, 1.0, torch.maximum(low.abs(), high.abs()))
    shift = (-torch.frexp(torch.where(biggest > 0, biggest, 1.0))[1]).clamp(max=1023).to(dtype)
    kept = torch.ldexp(torch.where(ok, x, 0), shift)
    total, sumsq = kept.sum(), (kept * kept).sum()
    mean = torch.where(none, torch.nan, total / finite.clamp(min=1))  # of the scaled values
    one_pass = sumsq - total * mean
    deviation = torch.where(ok, kept - mean, 0)
    m2 = torch.where(one_pass >= sumsq / 8, one_pass, (deviation * deviation).sum())
    zeros = finite - torch.where(ok, x, 0).sign().abs().sum().to(dtype)  # before scaling: tiny values stay nonzero
    half = torch.floor(-shift / 2)  # unscaled in two steps: 2**1024 itself is past float64

    def unscaled(v: torch.Tensor) -> torch.Tensor:
        return torch.ldexp(torch.ldexp(v, half), -shift - half)

    head = torch.stack([torch.full_like(total, float(count)), finite, nans, infs, zeros, unscaled(mean),
                        torch.where(none, torch.nan, unscaled((m2.clamp(min=0) / finite.clamp(min=1)).sqrt())),
                        torch.where(none, torch.nan, low), torch.where(none, torch.nan, high),
                        torch.where(none, torch.nan, unscaled(sumsq.sqrt()))]).to(torch.float64)
    positions = torch.cat([torch.tensor(sample_positions(count), dtype=torch.long, device=x.device),
                           _histogram_positions_on(count, x.device)])
    gathered = x.index_select(0, positions).to(torch.float64)
    k = min(SAMPLES, count)
    values = gathered[k:]
    fixed = None if edges is None else torch.as_tensor(edges, dtype=torch.float64, device=x.device)
    lo64, hi64 = torch.where(none, 0.0, head[_MIN]), torch.where(none, 0.0, head[_MAX])
    if fixed is None:
        exponent, start = place(lo64.reshape(1), hi64.reshape(1), bins)
    else:
        exponent = start = torch.zeros(1, dtype=torch.float64, device=x.device)
    if fixed is None:
        index = _floor_scaled(torch.where(values.isfinite(), values, 0.0), exponent) - start
    else:
        index = torch.bucketize(torch.where(values.isfinite(), values, 0.0), fixed, right=True) - 1.0
    good = values.isfinite()
    under, over = good & (index < 0), good & (index >= bins)
    inside = good & ~under & ~over
    # each value's bin compared with every bin's number, summed: a reduction (no scatter) a compiler fuses
    histogram = ((index.unsqueeze(1) == torch.arange(bins, device=x.device)) & inside.unsqueeze(1)).sum(0)
    samples = torch.cat([gathered[:k], torch.full((SAMPLES - k,), math.nan, dtype=torch.float64, device=x.device)])
    unplaced = none if fixed is None else torch.ones((), dtype=torch.bool, device=x.device)
    exponent, start = torch.where(unplaced, math.nan, exponent), torch.where(unplaced, math.nan, start)
    return torch.cat([head, exponent, start, under.sum().reshape(1).to(torch.float64),
                      over.sum().reshape(1).to(torch.float64), histogram.to(torch.float64), samples])


def summarize(t: torch.Tensor, bins: int = BINS, edges: Sequence[float] | None = None) -> torch.Tensor:
    """The summary vector of ``t`` (see the module's docstring), on ``t``'s device.

    >>> from fwdtrace.statistics import as_dict
    >>> v = summarize(torch.tensor([1.0, 2.0, float("nan"), 3.0]))
    >>> as_dict(v)["mean"], as_dict(v)["nans"], as_dict(v)["samples"][:2]
    (2.0, 1.0, [1.0, 2.0])
    """
    if not t.is_cpu or torch.compiler.is_compiling():
        return summarize_in_graph(_flat(t), bins, edges)
    return torch.from_numpy(_matrix([_pending(t)], bins, edges)[0])


def summarize_later(t: torch.Tensor) -> Pending | torch.Tensor:
    """:func:`summarize`'s vector of ``t`` (:data:`BINS` bins), or on a CPU outside a compiled graph a
    :class:`Pending` whose histogram :func:`finish` bins with others': binned together at the end of a dump's
    step, where the values already taken are still in the cache, rather than between two layers' work.

    >>> p = summarize_later(torch.arange(5.0))
    >>> torch.allclose(torch.from_numpy(finish([p])[0]), summarize(torch.arange(5.0)), rtol=0, atol=0, equal_nan=True)
    True
    """
    if not t.is_cpu or torch.compiler.is_compiling():
        return summarize_in_graph(_flat(t))
    return _pending(t)


def finish(pending: Sequence[Pending]) -> np.ndarray:
    """The summary vectors of :func:`summarize_later`'s ``pending`` summaries, as the rows of a float64 matrix;
    each summary's ``vector`` its row (its gathered values dropped)."""
    matrix = _matrix(pending, BINS, None)
    for p, row in zip(pending, matrix, strict=True):
        p.vector, p.gathered = row, _NO_VALUES
    return matrix


_NO_VALUES = np.zeros(0)

