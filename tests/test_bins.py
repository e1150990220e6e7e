"""fwdtrace.instrument.bins.SteadyBins: edges that hold still, grow by doubling, and keep every count (numpy.histogram as reference)."""

from __future__ import annotations

import numpy as np
import pytest

from fwdtrace.errors import FwdtraceError
from fwdtrace.instrument.bins import SteadyBins, check_bins_spec


def test_edges_hold_while_samples_stay_inside() -> None:
    rng = np.random.default_rng(0)
    bins = SteadyBins(32)
    bins.add(rng.uniform(-1, 1, 500))
    first = bins.edges
    assert first[0] <= -1 + 1e-9 and first[-1] > 1 - 1e-3  # the first sample's range lies inside
    for _ in range(20):  # narrower samples: nothing moves
        sample = rng.uniform(-0.5, 0.5, 500)
        assert not bins.fit(sample.min(), sample.max())
        bins.add(sample)
        assert np.array_equal(bins.edges, first)
    assert bins.rebins == 0


def test_a_sample_leaving_the_bins_rebins_and_every_count_is_kept() -> None:
    rng = np.random.default_rng(1)
    bins = SteadyBins(16)
    seen = []
    for step in range(30):  # a drifting, widening signal, as weights in training
        sample = rng.normal(0.2 * step, 1 + 0.1 * step, 300)
        before = bins.edges
        bins.add(sample)
        seen.append(sample)
        edges = bins.edges
        assert edges[0] <= sample.min() and sample.max() < edges[-1]
        if step and not np.array_equal(before, edges):
            # Whole doublings: each new edge within the old range was an old edge, so old bins merged whole.
            inside = edges[(edges >= before[0]) & (edges <= before[-1])]
            assert np.isin(inside, before).all()
            width_ratio = (edges[1] - edges[0]) / (before[1] - before[0])
            assert width_ratio >= 2 and np.log2(width_ratio) == int(np.log2(width_ratio))
        reference, _ = np.histogram(np.concatenate(seen), bins=edges)
        assert bins.counts.tolist() == reference.tolist()
    assert bins.rebins >= 2
    assert bins.counts.sum() == 30 * 300


def test_each_sample_histogram_matches_numpy_on_the_same_edges() -> None:
    rng = np.random.default_rng(2)
    bins = SteadyBins(60)
    for _ in range(5):
        sample = rng.standard_t(3, 1000)
        bins.fit(sample.min(), sample.max())
        assert bins.histogram(sample).tolist() == np.histogram(sample, bins=bins.edges)[0].tolist()


def test_a_running_range_bins_edge_values_tiny_values_and_leaves_out_values_outside_as_numpy() -> None:
    # The running range bins by floor(x / width), not by searching the edges: values on an edge,
    # a negative subnormal whose quotient rounds to -0.0 (a width above 2), values outside.
    bins = SteadyBins(8)
    bins.fit(-40.0, 40.0)
    edges = bins.edges
    assert edges[1] - edges[0] > 2
    tiny = -np.nextafter(0.0, 1.0)  # -5e-324: tiny / width is -0.0
    sample = np.array([*edges[:-1], tiny, 0.0, -0.0, np.nextafter(edges[3], -np.inf), edges[0] - 1, edges[-1], 1e9])
    reference = np.histogram(sample, bins=np.append(edges[:-1], np.nextafter(edges[-1], -np.inf)))[0]  # [a, b) last
    assert bins.histogram(sample).tolist() == reference.tolist()
    below_zero = int(np.searchsorted(edges, 0.0)) - 1  # the bin [-width, 0)
    assert bins.histogram(np.array([tiny])).tolist() == np.eye(8, dtype=int)[below_zero].tolist()


def test_a_constant_first_sample_gets_a_usable_range() -> None:
    bins = SteadyBins(8)
    bins.add(np.full(10, 3.0))
    lo, hi = bins.range
    assert lo <= 3.0 < hi and bins.counts.sum() == 10


def test_fixed_edges_never_move_and_count_what_falls_outside() -> None:
    bins = SteadyBins([0.0, 1.0, 2.0, 4.0])
    values = np.array([-1.0, 0.5, 1.5, 3.9, 4.0, 9.0, np.nan, np.inf])
    bins.add(values)
    assert bins.edges.tolist() == [0.0, 1.0, 2.0, 4.0] and bins.rebins == 0
    assert bins.counts.tolist() == [1, 1, 1]
    assert (bins.underflow, bins.overflow, bins.nonfinite) == (1, 2, 2)  # [a, b): 4.0 is past the last bin


@pytest.mark.parametrize("spec", [0, -3, True, [1.0], [0.0, 0.0], [1.0, 0.0], [0.0, float("inf")], "0,1", ["a", "b"]])
def test_bad_bins_raise(spec: object) -> None:
    with pytest.raises(FwdtraceError, match=r"^SteadyBins expected bins as a positive int or a list of 2\+ increasing finite edges, got "):
        SteadyBins(spec)  # type: ignore[arg-type]


def test_check_bins_spec_names_the_caller() -> None:
    with pytest.raises(FwdtraceError, match=r"^Recorder expected bins as"):
        check_bins_spec(0, "Recorder")


def test_grown_bins_are_as_fine_as_the_range_allows() -> None:
    # The notebook's convolution: -0.69..0.64 at first, then -1.02..4.64. Anchoring the new bins at
    # the old lower edge made a 0.02 overshoot below cost a width of 2 (axis up to 118).
    bins = SteadyBins(60)
    bins.fit(-0.689, 0.6418)
    bins.fit(-1.022, 4.644)
    assert bins.range == (-1.875, 5.625)  # bins 1/8 wide, the 47 that hold the values centred in 60
    rng = np.random.default_rng(3)
    for _ in range(200):  # any drift: a re-bin is at most one doubling coarser than what must fit needs
        bins = SteadyBins(int(rng.integers(4, 64)))
        bins.fit(*sorted(rng.normal(0, 1, 2)))
        for _ in range(4):
            a, b = sorted(rng.normal(rng.normal(0, 5), rng.uniform(0.01, 10), 2))
            first, last = bins.range
            if bins.fit(a, b):
                must_hold = max(b, last) - min(a, first)  # the new values and the old bins' counts
                finest = 2.0 ** np.ceil(np.log2(must_hold / bins.bins))
                lo, hi = bins.range
                assert lo <= a and b < hi and lo <= first and last <= hi
                assert (hi - lo) / bins.bins <= 2 * finest


DIVERGING = [  # what a diverging run sends, one sample after another
    [np.linspace(0, 1, 100), np.array([1e20])],
    [np.linspace(-1, 1, 50), np.array([-1e300, 1e300])],
    [np.array([0.0, 1.0]), np.array([1.7e308, -1.7e308]), np.array([np.inf, -np.inf, np.nan, 0.5])],
    [np.array([-1.7e308, 1.7e308]), np.array([0.0])],
    [np.array([5e-324, 1e-320]), np.array([1e308])],
]


@pytest.mark.parametrize("samples", DIVERGING, ids=range(len(DIVERGING)))
def test_diverging_values_are_binned_or_counted_never_raised(samples: list[np.ndarray]) -> None:
    bins = SteadyBins(60)
    for sample in samples:
        counts, under, over = bins.add(sample)
        edges = bins.edges
        assert np.isfinite(edges).all() and (np.diff(edges) > 0).all()
        finite = sample[np.isfinite(sample)]
        # The sample's counts are numpy's on the same edges; what lies outside them is counted apart.
        assert counts.tolist() == np.histogram(finite[(finite >= edges[0]) & (finite < edges[-1])], edges)[0].tolist()
        assert (under, over) == (int((finite < edges[0]).sum()), int((finite >= edges[-1]).sum()))
    total = sum(s.size for s in samples)
    assert int(bins.counts.sum()) + bins.underflow + bins.overflow + bins.nonfinite == total


def test_a_jump_by_1e19_keeps_every_count() -> None:
    bins = SteadyBins(60)
    bins.add(np.linspace(0, 1, 100))
    bins.add(np.array([1e20]))
    assert bins.range is not None and bins.range[0] <= 0 and bins.range[1] > 1e20
    assert int(bins.counts.sum()) == 101 and bins.overflow == 0
    assert int(bins.counts[np.searchsorted(bins.edges, 0.5, side="right") - 1]) == 100  # all the small ones, one bin


EXTREMES = np.array([0, 1, -1, 0.5, 3, -7, 1e20, -1e20, 1e300, -1e300, 1.7e308, -1.7e308, 2.0**1000, -(2.0**1000),
                     2.0**1001, 5e-324, -5e-324, 1e-310, np.inf, -np.inf, np.nan])


@pytest.mark.filterwarnings("error")  # no overflow warnings either
def test_any_mix_of_extreme_values_matches_numpy_on_the_edges_in_use() -> None:
    rng = np.random.default_rng(0)
    for _ in range(1000):
        bins, seen = SteadyBins(int(rng.integers(1, 80))), 0  # one bin too: it cannot straddle zero
        for _ in range(int(rng.integers(1, 6))):
            sample = rng.choice(EXTREMES, size=int(rng.integers(1, 6))) * rng.choice([1, 1.0001, 0.999])
            seen += sample.size
            counts, under, over = bins.add(sample)
            edges, finite = bins.edges, sample[np.isfinite(sample)]
            if edges.size:
                assert np.isfinite(edges).all() and (np.diff(edges) > 0).all()
                inside = finite[(finite >= edges[0]) & (finite < edges[-1])]
                assert counts.tolist() == np.histogram(inside, edges)[0].tolist(), (edges, sample)
                assert (under, over) == (int((finite < edges[0]).sum()), int((finite >= edges[-1]).sum()))
        assert int(bins.counts.sum()) + bins.underflow + bins.overflow + bins.nonfinite == seen
