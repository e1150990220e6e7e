"""Independent references for fwdtrace.statistics: torch's statistics in float64, the power-of-two bin rule by brute
force over exact rationals, the Weyl sample positions, and NumPy's histogram of the sampled values.

Moments are checked to the tensor's own rounding, the engine's contract: float32, float16 and bfloat16 tensors are
summed in float32, others in float64.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fwdtrace.statistics import HISTOGRAM_SAMPLE, SAMPLES


def rounding(dtype: torch.dtype) -> float:
    """The unit rounding the engine's sums of a ``dtype`` tensor carry."""
    low = (torch.float32, torch.float16, torch.bfloat16)
    return torch.finfo(torch.float32).eps if dtype in low else torch.finfo(torch.float64).eps


def power_of_two_bins(low: float, high: float, bins: int) -> tuple[int, int]:
    """``(exponent, start)``: the least power-of-two width whose ``bins`` aligned bins hold [low, high] (a single
    value: the least power of two at least ``max(|v|, 1) * 2**-10 / bins``), and at least 2**-40 of the values'
    magnitude; the occupied bins centred, the odd spare one above. Found by trying every exponent with exact
    rationals."""
    lo, hi = Fraction(low), Fraction(high)

    def floor_at(x: Fraction, e: int) -> int:
        return math.floor(x / Fraction(2) ** e)

    magnitude = max(abs(lo), abs(hi), Fraction(1))
    largest = max(abs(lo), abs(hi))  # bins at least 2**-40 of it (of 1 where every value is 0)
    finest = (next(e for e in range(-1100, 1100) if Fraction(2) ** e > largest) if largest else 0) - 40
    if bins == 1 and lo < 0 <= hi:  # no single bin holds both signs: the one that holds the negative end
        exponent = min(max(next(e for e in range(-1100, 1100) if Fraction(2) ** e > largest), finest), 1023)
        return exponent, floor_at(lo, exponent)
    if lo == hi:
        per_bin = magnitude * Fraction(1, 1024) / bins
        exponent = next(e for e in range(-1074, 1100) if Fraction(2) ** e >= per_bin)
    else:
        exponent = next((e for e in range(-1074, 1024) if floor_at(hi, e) - floor_at(lo, e) <= bins - 1), 1023)
    exponent = max(exponent, finest)
    while floor_at(hi, exponent) - floor_at(lo, exponent) > bins - 1 and exponent < 1023:  # (a value on an edge)
        exponent += 1
    lo_bin, hi_bin = floor_at(lo, exponent), floor_at(hi, exponent)
    # the occupied bins centred (none fit past float64's largest width: the low end's bins)
    return exponent, lo_bin - max(bins - 1 - (hi_bin - lo_bin), 0) // 2


def weyl_positions(count: int) -> list[int]:
    """The flat positions binned from a tensor of ``count`` values: all, or HISTOGRAM_SAMPLE of a Weyl sequence."""
    if count <= HISTOGRAM_SAMPLE:
        return list(range(count))
    golden = (math.sqrt(5) - 1) / 2
    return sorted(int(math.modf(i * golden)[0] * count) for i in range(1, HISTOGRAM_SAMPLE + 1))


def reference(t: torch.Tensor, bins: int = 16) -> dict:
    """torch's and NumPy's summary of ``t``: counts, moments of the finite values in float64, the histogram of the
    sampled finite values on the rule's bins, the evenly spaced samples."""
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj()).reshape(-1)
    x = x.to(torch.float64)
    ok = torch.isfinite(x)
    finite = x[ok]
    n = x.numel()
    k = min(SAMPLES, n)
    positions = [0] if k == 1 else [i * (n - 1) // (k - 1) for i in range(k)]
    ref: dict = {"count": n, "finite": finite.numel(), "nans": int(x.isnan().sum()), "infs": int(x.isinf().sum()),
                 "zeros": int((x == 0).sum()), "samples": x[positions].tolist() if n else [],
                 "mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "norm": math.nan,
                 "histogram": [0.0] * bins, "abs_mean": 0.0}
    if finite.numel():
        low, high = float(finite.min()), float(finite.max())
        big = max(abs(low), abs(high))
        scaled = finite / big if big else finite  # no square past float64's range
        # the sum correctly rounded (of the values scaled to at most 1: no sum past float64's range)
        mean = math.fsum(scaled.tolist()) / finite.numel() * (big or 1.0)
        ref.update(mean=mean, min=low, max=high,
                   std=float((scaled - scaled.mean()).square().mean().sqrt()) * (big or 1.0),
                   norm=float(scaled.square().sum().sqrt()) * (big or 1.0), abs_mean=float(finite.abs().mean()))
        exponent, start = power_of_two_bins(low, high, bins)
        ref["bin_exponent"], ref["bin_start"] = exponent, start
        sampled = x[weyl_positions(n)].numpy()
        counts = [0.0] * bins
        for v in sampled[np.isfinite(sampled)].tolist():  # [a, b) bins, by exact rationals
            counts[math.floor(Fraction(v) / Fraction(2) ** exponent) - start] += 1
        ref["histogram"] = counts
    return ref


def assert_summary(got: dict, t: torch.Tensor, bins: int = 16, histogram: bool = True, what: object = "") -> None:
    """``got`` (fwdtrace.statistics.as_dict of ``t``'s summary) equals :func:`reference`: counts, extremes,
    placement and histogram exactly, moments to ``t``'s rounding."""
    ref = reference(t, bins)
    for name in ("count", "finite", "nans", "infs", "zeros", "min", "max"):
        assert got[name] == pytest.approx(ref[name], nan_ok=True, abs=0, rel=0), (what, name)
    assert got["samples"] == pytest.approx(ref["samples"], nan_ok=True), what
    assert_moments(got["mean"], got["std"], got["norm"], t, ref, what)
    if histogram and ref["finite"]:
        assert (got["bin_exponent"], got["bin_start"]) == (ref["bin_exponent"], ref["bin_start"]), what
        assert got["histogram"] == ref["histogram"], what


def assert_moments(mean: float | None, std: float | None, norm: float | None, t: torch.Tensor,
                   ref: dict | None = None, what: object = "", dtype: torch.dtype | None = None) -> None:
    """Mean, std and L2 norm of ``t``'s finite values (each where not None) to its rounding: a sum of n values in
    the tensor's own rounding u (a cascaded sum, a dot product per block of 2**18 values) lies within u log2(n) of
    the magnitudes summed; twice that for safety, the std (from sums of squares, or about the mean) twice more.
    ``dtype``: the dtype the values were summarised in, where ``t`` holds them in another (a float64 copy)."""
    ref = reference(t) if ref is None else ref
    dtype = dtype or (t.real.dtype if t.is_complex() else t.dtype)
    u = rounding(dtype) * 2 * math.log2(ref["finite"] + 2)
    if mean is not None:
        assert mean == pytest.approx(ref["mean"], nan_ok=True, rel=0, abs=u * ref["abs_mean"] + 1e-300), what
    if norm is not None:
        assert norm == pytest.approx(ref["norm"], nan_ok=True, rel=u), what
    spread = ref["std"] + abs(ref["mean"]) if math.isfinite(ref["std"]) else math.nan
    if std is not None:
        assert std == pytest.approx(ref["std"], nan_ok=True, rel=0, abs=2 * u * spread + 1e-300), what
