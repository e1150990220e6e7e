"""fwdtrace.statistics, the one engine: every statistic against torch and NumPy on edge cases, the power-of-two bin
rule against a brute-force search, merges against the concatenation, and the same tensor through every tool."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from stats_reference import assert_summary, power_of_two_bins, rounding
from torch import nn

import fwdtrace
from fwdtrace import statistics
from fwdtrace.instrument.stats import RunningStats
from fwdtrace.statistics import BLOCK, HISTOGRAM_SAMPLE, as_dict, place, place_float, summarize


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _blocks_with_nan() -> torch.Tensor:
    t = torch.randn(BLOCK + 1000, generator=_gen(1)) * 10
    t[[3, BLOCK + 2]] = math.nan
    t[[7, BLOCK + 5]] = math.inf
    t[BLOCK + 9] = -math.inf
    t[BLOCK + 3], t[BLOCK + 4] = 1000, -1000
    return t


EDGE_CASES = {
    "empty": torch.zeros(0),
    "all NaN": torch.full((5,), math.nan),
    "NaN and Inf": torch.tensor([1.0, math.nan, 2.0, math.inf, -math.inf, 0.0]),
    "only Inf": torch.tensor([math.inf, -math.inf]),
    "denormals": torch.tensor([1e-45, -1e-45, 0.0, 3e-44]),
    "tiny squares": torch.randn(1000, generator=_gen(2)) * 1e-25,
    "squares past float32": torch.tensor([3e38, -3e38, 1e20, 0.0, 2.0]),
    "attention scores masked by float32's least": torch.randn(4, 64, 64, generator=_gen(19)).masked_fill(
        torch.ones(64, 64, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min),
    "float16 extremes": torch.tensor([65504.0, -65504.0, 6e-8, 0.0, 1.0], dtype=torch.float16),
    "float16 overflowed": (torch.randn(5000, generator=_gen(3)) * 60000).half(),
    "bfloat16": torch.randn(70000, generator=_gen(4)).bfloat16(),
    "bfloat16 extremes": torch.tensor([3.3e38, -3.3e38, 1e-38, 0.0], dtype=torch.bfloat16),
    "int32": torch.arange(-50, 1000, dtype=torch.int32),
    "int64 large": torch.tensor([2**40, -(2**40), 3], dtype=torch.int64),
    "bool": torch.tensor([True, False, True, True]),
    "non-contiguous": torch.randn(300, 400, generator=_gen(5)).t(),
    "constant": torch.full((10,), 3.0),
    "zeros": torch.zeros(100),
    "mean far from 0": torch.randn(300000, generator=_gen(6)) * 1e-3 + 1,
    "relu": torch.relu(torch.randn(600000, generator=_gen(7))),
    "several blocks with NaN": _blocks_with_nan(),
    "float64 extremes": torch.tensor([1.7e308, -1.7e308, 5.0], dtype=torch.float64),
    "float64 subnormal": torch.tensor([5e-324, -5e-324, 1e-320], dtype=torch.float64),
    "sum past float64": torch.tensor([1.5e308, 1.5e308, -1.0], dtype=torch.float64),
    "complex": torch.randn(50, dtype=torch.complex64, generator=_gen(8)),
    "one value": torch.tensor([-2.5]),
    "conjugated complex": torch.randn(50, dtype=torch.complex64, generator=_gen(17)).conj(),
    "int64 past 2**53": torch.tensor([2**53 + 1, 2**53 + 3, -5], dtype=torch.int64),
    "float64 spread past 2**1000": torch.tensor([1e300, 1e-30, 0.0, -1e-300], dtype=torch.float64),
    "a block of one value": torch.full((BLOCK,), 1.1),
    "float16 a block": (torch.rand(BLOCK, generator=_gen(18)) * 100).half(),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_every_statistic_equals_torchs_and_numpys(name: str) -> None:
    t = EDGE_CASES[name]
    assert_summary(as_dict(summarize(t)), t, what=name)


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_the_route_inside_compiled_graphs_and_on_devices_gives_the_same_summary(name: str) -> None:
    """Tensor ops only (no synchronisation, nothing dynamo cannot trace): the same counts, placement, histogram
    and samples as the CPU's route, the moments to the tensor's rounding."""
    t = EDGE_CASES[name]
    cpu = summarize(t)
    graph = statistics.summarize_in_graph(statistics.engine._flat(t))
    assert_summary(as_dict(graph), t, what=name)
    exact = [i for i, f in enumerate(statistics.FIELDS) if f not in ("mean", "std", "norm")]
    exact += list(range(len(statistics.FIELDS), cpu.numel()))
    assert torch.equal(graph[exact].nan_to_num(nan=7.0), cpu[exact].nan_to_num(nan=7.0)), name


def test_the_route_inside_compiled_graphs_compiles_whole() -> None:
    t = torch.cat([torch.randn(5000, generator=_gen(9)), torch.tensor([math.nan, math.inf])])
    compiled = torch.compile(summarize, backend="aot_eager", fullgraph=True)
    got = compiled(t)
    assert_summary(as_dict(got), t)


def test_power_of_two_bins_are_the_least_that_hold_the_values_centred() -> None:
    rng = random.Random(0)
    ranges = [(0.0, 0.45), (3.0, 3.0), (0.0, 0.0), (-1.0, 1.0), (-7.0, 1e20), (1.0, 1.0 + 1e-15),
              (-1.7e308, 1.7e308), (5e-324, 1e-320), (-5e-324, 5e-324), (1e300, 1e300), (-2.5, -2.5)]
    for _ in range(300):
        a = rng.choice([1e-30, 1e-3, 1.0, 1e3, 1e30]) * rng.uniform(-1, 1)
        ranges.append((a, a + abs(rng.gauss(0, rng.choice([1e-6, 1.0, 1e6])))))
    for low, high in ranges:
        for bins in (1, 2, 3, 16, 60):
            want = power_of_two_bins(low, high, bins)
            assert place_float(low, high, bins) == want, (low, high, bins)
            e, s = place(torch.tensor(low, dtype=torch.float64), torch.tensor(high, dtype=torch.float64), bins)
            assert (int(e), int(s)) == want, (low, high, bins)


def test_a_histogram_from_the_sampled_values_estimates_the_whole_within_its_error() -> None:
    """Past HISTOGRAM_SAMPLE values the bins count a fixed spread of positions: each bin's share within 4
    standard errors of every value's share, on the same edges (torch.histogram)."""
    for t in (torch.randn(1_000_000, generator=_gen(10)), torch.rand(300_000, generator=_gen(11)) ** 3):
        d = as_dict(summarize(t))
        assert sum(d["histogram"]) == HISTOGRAM_SAMPLE
        exact = torch.histogram(t.double(), torch.tensor(d["bin_edges"], dtype=torch.float64))[0]
        share, want = np.array(d["histogram"]) / HISTOGRAM_SAMPLE, exact.numpy() / t.numel()
        error = np.sqrt(want * (1 - want) / HISTOGRAM_SAMPLE)
        assert (np.abs(share - want) <= 4 * error + 1e-12).all(), (share, want)


def test_one_bin_holds_values_either_side_of_a_power_of_two() -> None:
    """With a single bin the narrowest power-of-two bin that holds both ends may be many doublings wider."""
    for low, high in ((7.84, 8.08), (-70784.0, -70656.0), (1023.9, 1024.1), (1e-30, 3e-30)):
        d = as_dict(summarize(torch.tensor([low, high], dtype=torch.float64), bins=1), 1)
        assert d["histogram"] == [2.0] and d["underflow"] == d["overflow"] == 0, d
        assert d["bin_edges"][0] <= low and high < d["bin_edges"][1]
        stats = RunningStats(bins=1)
        stats.update(torch.tensor([low, high], dtype=torch.float64))
        assert stats.histogram == [2] and stats.underflow == stats.overflow == 0


def test_merges_of_values_past_float64s_squares_do_not_raise() -> None:
    """Norms past 1e154: their squares are past float64, so merges add norms by hypot and never raise."""
    t = torch.tensor([1e200, -1e200, 3e200, 5.0], dtype=torch.float64)
    stats = RunningStats()
    stats.update(t[:2])
    stats.update(t[2:])
    norm = math.hypot(*t.tolist())  # torch's own vector_norm squares unscaled: inf here
    assert stats.l2 == pytest.approx(norm, rel=1e-12)
    blocks = as_dict(statistics.summarize_blocks(lambda: iter((t[:2], t[2:])), 4))
    assert blocks["norm"] == pytest.approx(norm, rel=1e-12)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # torch deprecates making them, not reading them
def test_a_quantized_tensor_is_summarised_by_its_values() -> None:
    q = torch.quantize_per_tensor(torch.randn(100, generator=_gen(19)), 0.05, 0, torch.qint8)
    assert_summary(as_dict(summarize(q)), q.dequantize())


def test_the_sampled_positions_follow_no_channel_layout() -> None:
    """A stride would see one channel of a [tokens, channels] tensor: the positions see every channel."""
    t = torch.arange(256.0).repeat(4096)  # value = channel, channels last
    d = as_dict(summarize(t, bins=64), 64)
    counts = np.array(d["histogram"])
    assert (counts > 0).sum() == 64 and counts.max() < 3 * counts[counts > 0].min()


def test_merges_equal_the_summary_of_the_concatenation() -> None:
    """RunningStats merges per-update summaries (Chan's update; histograms moved into wider power-of-two
    bins, never split): the same as one summary of every value."""
    g = _gen(12)
    chunks = [torch.randn(300, generator=g) * s + m for s, m in ((1, 0), (0.1, 3), (10, -5), (1e-3, 0.5))]
    chunks.append(torch.tensor([math.nan, math.inf, 0.0, 0.0]))
    for order in (chunks, chunks[::-1]):
        stats = RunningStats(bins=16)
        for c in order:
            stats.update(c)
        whole = as_dict(summarize(torch.cat(order)))
        d = stats.to_dict()
        assert (d["count"], d["nan"], d["inf"], d["min"], d["max"]) == \
            (whole["count"], whole["nans"], whole["infs"], whole["min"], whole["max"])
        assert stats.zeros == whole["zeros"]
        assert d["histogram"] == [int(c) for c in whole["histogram"]] and d["bin_edges"] == whole["bin_edges"]
        u = rounding(torch.float32)
        assert d["mean"] == pytest.approx(whole["mean"], rel=16 * u)
        assert d["std"] == pytest.approx(whole["std"], rel=16 * u)
        assert d["l2"] == pytest.approx(whole["norm"], rel=16 * u)


def test_a_tensor_read_in_blocks_has_the_summary_of_the_whole() -> None:
    for t in (torch.randn(10000, dtype=torch.float64, generator=_gen(13)), _blocks_with_nan(),
              torch.randn(5000, generator=_gen(14)) + 1e4):
        whole = summarize(t)
        for size in (77, 4096, t.numel()):
            blocks = statistics.summarize_blocks(lambda t=t, size=size: iter(t.split(size)), t.numel())
            exact = [i for i, f in enumerate(statistics.FIELDS) if f not in ("mean", "std", "norm")]
            exact += list(range(len(statistics.FIELDS), whole.numel()))
            assert torch.equal(blocks[exact].nan_to_num(nan=7.0), whole[exact].nan_to_num(nan=7.0)), size
            assert_summary(as_dict(blocks), t)


def test_rebin_moves_whole_bins_onto_wider_ones() -> None:
    rng = np.random.default_rng(15)
    for _ in range(200):
        bins = int(rng.integers(2, 40))
        values = rng.normal(rng.normal(0, 10), rng.uniform(0.01, 5), 200)
        e, s = place_float(float(values.min()), float(values.max()), bins)
        counts = np.bincount(np.floor(np.ldexp(values, -e)).astype(int) - s, minlength=bins)
        wider = place_float(float(values.min()) - rng.uniform(0, 50), float(values.max()), bins, least=e + 1)
        moved, under, over = statistics.rebin(counts, e, s, *wider)
        want = np.bincount(np.floor(np.ldexp(values, -wider[0])).astype(int) - wider[1], minlength=bins)
        assert moved.tolist() == want.tolist() and under == over == 0


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_one_tensor_gives_one_summary_in_a_probe_a_dump_the_live_page_and_a_compiled_graph(tmp_path) -> None:
    """The same output, with the same bins: equal counts, extremes, histograms; the moments to float32's rounding."""
    torch.manual_seed(16)
    model, x = _Layer(), torch.randn(8, 64)
    with torch.no_grad():
        out = model.lin(x)
    bins = 16
    want = as_dict(summarize(out, bins))
    # a Probe's running statistics of one call
    with fwdtrace.Probe(model) as probe:
        handle = probe.running_stats("lin.Linear", of="output", bins=bins)
        with torch.no_grad():
            model(x)
        running = handle.stats["lin.Linear"]
    # a statistics dump
    with fwdtrace.Dumper(tmp_path / "d", values="statistics") as dumper:
        dumper.register(model, grads=False)
        with torch.no_grad():
            model(x)
    dumped = fwdtrace.read_dump(dumper.paths[0], show=False)["groups"]
    dumped = next(g["datasets"]["output0"]["statistics"] for name, g in dumped.items() if name.endswith("Linear"))
    # the live page's series
    from fwdtrace.live.sampler import Series

    series = Series(bins)
    sample = series.add(out)
    # a compiled graph's hooks
    from fwdtrace.instrument.ingraph import StatsSlot

    compiled_stats = RunningStats(bins)
    slot = StatsSlot(compiled_stats)
    torch.compile(lambda t: slot.add(t), backend="aot_eager", fullgraph=True)(out)
    slot.close()
    u = rounding(torch.float32)
    for name, d in (("probe", running.to_dict()), ("dump", dumped), ("live", sample),
                    ("compiled", compiled_stats.to_dict())):
        assert d["min"] == want["min"] and d["max"] == want["max"], name
        assert d["mean"] == pytest.approx(want["mean"], rel=8 * u, abs=8 * u * want["std"]), name
        assert d["std"] == pytest.approx(want["std"], rel=16 * u), name
        assert [int(c) for c in d["histogram"]] == [int(c) for c in want["histogram"]], name
        edges = d.get("bin_edges") or as_dict(summarize(out, bins))["bin_edges"]
        assert edges == want["bin_edges"], name


@pytest.mark.filterwarnings("error")  # no overflow or invalid-value warning from the passes reaches the user
@pytest.mark.parametrize("n", [3000, 5000, 300_001])
def test_squares_past_float32_are_summarised_without_a_warning(n: int) -> None:
    t = torch.randn(n, generator=_gen(20)) * 3e37
    t[::97] = -3.4e38
    assert_summary(as_dict(summarize(t)), t, what=n)
