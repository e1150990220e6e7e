"""Running statistics against torch's own statistics over the concatenated data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from stats_reference import assert_moments, power_of_two_bins

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.instrument.stats import RunningStats, summary_text


def _chunks() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(50, generator=g) * 3 + 1, torch.relu(torch.randn(7, 9, generator=g)), torch.randn(1, generator=g)]
    chunks[1][0, 0] = float("nan")
    chunks[0][3] = float("inf")
    chunks[0][4] = -float("inf")
    return chunks


def _assert_matches_torch(s: RunningStats, data: torch.Tensor) -> None:
    x = data.to(torch.float64).reshape(-1)
    finite = x[torch.isfinite(x)]
    assert s.count == x.numel()
    assert_moments(s.mean, s.std, s.l2, data.reshape(-1))
    assert s.min == float(finite.min()) and s.max == float(finite.max())
    assert s.zero_fraction == float((x == 0).sum()) / x.numel()
    assert s.nans == int(torch.isnan(x).sum()) and s.infs == int(torch.isinf(x).sum())
    edges = np.array(s.bin_edges)
    if s.fixed is None:  # a running range: the power-of-two bins of every value seen
        assert (edges[0], edges[-1]) == s.range
        exponent, start = power_of_two_bins(float(finite.min()), float(finite.max()), s.bins)
        assert edges.tolist() == [math.ldexp(start + i, exponent) for i in range(s.bins + 1)]
    # [a, b) bins, the last one too; NumPy's last bin is closed: its edge moved down by a rounding
    inside = finite.numpy()[(finite.numpy() >= edges[0]) & (finite.numpy() < edges[-1])]
    assert s.histogram == np.histogram(inside, np.append(edges[:-1], np.nextafter(edges[-1], -np.inf)))[0].tolist()
    assert s.underflow == int((finite < edges[0]).sum()) and s.overflow == int((finite >= edges[-1]).sum())


def test_update_in_steps_equals_torch_on_the_concatenation() -> None:
    chunks = _chunks()
    s = RunningStats(bins=10, range=(-2.0, 4.0))
    for c in chunks:
        s.update(c)
    _assert_matches_torch(s, torch.cat([c.reshape(-1) for c in chunks]))


def test_update_with_empty_all_nan_and_all_finite_tensors_equals_torch() -> None:
    # update() counts NaN and Inf only when the sum is not finite: each path against torch.
    data = [torch.empty(0), torch.full((3,), float("nan")), torch.tensor([0.0, -2.5, 1e-3, 0.0]),
            torch.tensor([float("inf"), 2.0, 0.0])]
    s = RunningStats(bins=4, range=(-3.0, 3.0))
    for i, chunk in enumerate(data):
        s.update(chunk)
        seen = torch.cat(data[: i + 1])
        if torch.isfinite(seen).any():
            _assert_matches_torch(s, seen)
        else:
            assert (s.count, s.finite, s.nans, s.infs, s.zeros) == (seen.numel(), 0, int(torch.isnan(seen).sum()), 0, 0)


def test_merge_of_partial_results_equals_one_pass() -> None:
    chunks = _chunks()
    a, b, whole = RunningStats(8, (-3.0, 3.0)), RunningStats(8, (-3.0, 3.0)), RunningStats(8, (-3.0, 3.0))
    a.update(chunks[0])
    b.update(chunks[1])
    b.update(chunks[2])
    for c in chunks:
        whole.update(c)
    merged = a.merge(b).to_dict()
    expected = whole.to_dict()
    for name in ("count", "nan", "inf", "histogram", "underflow", "overflow", "min", "max"):
        assert merged[name] == expected[name], name
    for name in ("mean", "std", "l2", "zero_fraction"):
        assert merged[name] == pytest.approx(expected[name], rel=1e-12), name


def test_a_running_histogram_widens_to_hold_every_value() -> None:
    """Without a range the bins are the power-of-two bins of every value so far: wider (by whole doublings) when
    a value falls outside, each count moved into the wider bin that holds it, none outside."""
    s = RunningStats(bins=4)
    s.update(torch.tensor([0.0, 4.0]))
    first = s.range
    s.update(torch.tensor([5.0, -1.0, 2.0]))
    assert first is not None and s.range is not None and s.range[0] <= -1 and s.range[1] > 5
    assert s.underflow == s.overflow == 0 and sum(s.histogram) == 5
    _assert_matches_torch(s, torch.tensor([0.0, 4.0, 5.0, -1.0, 2.0]))


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(FwdtraceError, match=r"^RunningStats expected bins as a positive int, got 0"):
        RunningStats(bins=0)
    with pytest.raises(FwdtraceError, match=r"^RunningStats.update\(\) expected a torch.Tensor, got list"):
        RunningStats().update([1.0])  # type: ignore[arg-type]
    with pytest.raises(FwdtraceError, match=r"^RunningStats.merge\(\) expected the same histogram bins"):
        a, b = RunningStats(4, (0.0, 1.0)), RunningStats(4, (0.0, 2.0))
        a.update(torch.ones(1))
        b.update(torch.ones(1))
        a.merge(b)


def test_summary_text_uses_torch_statistics() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 7.0]])
    text = summary_text(x)
    assert text == (
        f"float32[2, 2] mean={float(x.mean()):.4g} std={float(x.std(correction=0)):.4g} "
        f"min={float(x.min()):.4g} max={float(x.max()):.4g}"
    )
    assert str(x) in summary_text(x, values=True)
    assert summary_text(None) == "None"


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def test_running_stats_of_activations_and_grads_across_steps() -> None:
    model = _mlp()
    seen: dict[str, list[torch.Tensor]] = {"output": [], "grad_output": []}
    ref_handles = [
        model[1].register_forward_hook(lambda m, i, o: seen["output"].append(o.detach().clone())),
        model[1].register_full_backward_hook(lambda m, gi, go: seen["grad_output"].append(go[0].clone())),
    ]
    with fwdtrace.Probe(model) as probe:
        acts = probe.running_stats("1.Tanh", of="output", bins=5, range=(-1.0, 1.0))
        grads = probe.running_stats(torch.nn.Tanh, of="grad_output")
        for step in range(3):
            model(torch.randn(4 + step, 6)).pow(2).sum().backward()
    for h in ref_handles:
        h.remove()
    _assert_matches_torch(acts.stats["1.Tanh"], torch.cat([t.reshape(-1) for t in seen["output"]]))
    _assert_matches_torch(grads.stats["1.Tanh"], torch.cat([t.reshape(-1) for t in seen["grad_output"]]))
    assert acts.summary()["1.Tanh"]["count"] == sum(t.numel() for t in seen["output"])


def test_running_stats_rejects_an_unknown_kind() -> None:
    with pytest.raises(FwdtraceError, match=r"^running_stats\(\) expected of= one of input, output"):
        fwdtrace.Probe(_mlp()).running_stats("0.Linear", of="weights")


def test_weight_stats_match_torch_on_each_parameter() -> None:
    model = _mlp()
    stats = fwdtrace.Probe(model).weight_stats(torch.nn.Linear)
    assert set(stats) == {"0.Linear", "2.Linear"}
    for key, module in (("0.Linear", model[0]), ("2.Linear", model[2])):
        for name, p in module.named_parameters():
            got = stats[key][name]
            x = p.detach().double()
            assert_moments(got["mean"], got["std"], got["l2"], p.detach(), what=(key, name))
            assert (got["min"], got["max"]) == (float(x.min()), float(x.max()))
            assert sum(got["histogram"]) == x.numel()
    assert math.isnan(RunningStats().to_dict()["mean"])


def test_merging_while_another_thread_updates_stays_consistent() -> None:
    import threading

    source = RunningStats(bins=4, range=(0.0, 1.0))
    total = RunningStats(bins=4, range=(0.0, 1.0))
    ones = torch.full((100,), 0.5)

    def feed() -> None:
        for _ in range(200):
            source.update(ones)

    thread = threading.Thread(target=feed)
    thread.start()
    snapshots = []
    while thread.is_alive():
        snap = RunningStats(bins=4, range=(0.0, 1.0)).merge(source)
        snapshots.append((snap.count, sum(snap.histogram)))
    thread.join()
    total.merge(source)
    assert total.count == 20_000 and total.histogram[2] == 20_000
    assert all(count == hist for count, hist in snapshots)  # never a half-merged batch


def test_bad_ranges_say_what_was_expected() -> None:
    for value in ((1, 0), (0, float("inf")), "ab", 5, (1, 2, 3)):
        with pytest.raises(FwdtraceError, match=r"^RunningStats expected range as \(low, high\) finite numbers"):
            RunningStats(range=value)  # type: ignore[arg-type]
