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
    assert bins.range == (-2.0, 5.5)
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
