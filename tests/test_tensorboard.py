"""TensorBoard export, read back with TensorBoard's own event reader, against numpy on the sampled tensors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from stats_reference import power_of_two_bins
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.instrument.bins import SteadyBins
from fwdtrace.live.sampler import Sampler
from fwdtrace.tensorboard import add_running_stats, log_sampler

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    HISTOGRAMS,
    SCALARS,
    EventAccumulator,
)

BINS = 8


def read_events(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={HISTOGRAMS: 0, SCALARS: 0})
    events.Reload()
    return events


def expected_histogram(values: np.ndarray, edges: np.ndarray) -> tuple[list[float], list[int]]:
    """numpy's histogram of the finite values on ``edges``, with a bucket at each end for what falls outside."""
    finite = values[np.isfinite(values)]
    counts, _ = np.histogram(finite, bins=edges)
    limits, buckets = list(edges[1:]), [int(c) for c in counts]
    under, over = int((finite < edges[0]).sum()), int((finite > edges[-1]).sum())
    if under:
        limits, buckets = [edges[0], *limits], [under, *buckets]
    if over:
        limits, buckets = [*limits, float(finite.max())], [*buckets, over]
    return limits, buckets


def check_histogram(event: Any, values: np.ndarray, edges: np.ndarray) -> None:
    limits, buckets = expected_histogram(values, edges)
    h = event.histogram_value
    assert [int(b) for b in h.bucket] == buckets
    assert list(h.bucket_limit) == pytest.approx(limits, rel=1e-9, abs=1e-12)
    finite = values[np.isfinite(values)].astype(np.float64)
    assert h.num == finite.size == sum(buckets)
    assert (h.min, h.max) == pytest.approx((finite.min(), finite.max()), rel=1e-6)
    assert h.sum == pytest.approx(finite.sum(), rel=1e-6, abs=1e-6)
    assert h.sum_squares == pytest.approx((finite * finite).sum(), rel=1e-6)


def check_scalars(events: EventAccumulator, tag: str, by_step: dict[int, np.ndarray]) -> None:
    for name, reference in (
        ("mean", lambda v: v[np.isfinite(v)].mean()),
        ("std", lambda v: v[np.isfinite(v)].std()),  # population std, as the sampler keeps it
        ("nan", lambda v: np.isnan(v).sum()),
        ("inf", lambda v: np.isinf(v).sum()),
    ):
        got = {e.step: e.value for e in events.Scalars(f"{tag}/{name}")}
        assert got == pytest.approx({s: float(reference(v)) for s, v in by_step.items()}, rel=1e-5, abs=1e-6), name


def test_the_live_samplers_samples_read_back_as_numpy_sees_the_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
    seen: dict[str, dict[int, np.ndarray]] = {"output0": {}, "input0": {}, "grad_input0": {}, "grad_output0": {}}
    step = [0]
    # the reference: plain torch hooks copying the same tensors

    def count(module: nn.Module, args: tuple) -> None:
        step[0] += 1

    def forward(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen["input0"][step[0]] = args[0].detach().numpy().copy()
        seen["output0"][step[0]] = out.detach().numpy().copy()

    def backward(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        seen["grad_input0"][step[0]] = grad_input[0].numpy().copy()
        seen["grad_output0"][step[0]] = grad_output[0].numpy().copy()

    model.register_forward_pre_hook(count)
    model[0].register_forward_hook(forward)
    model[0].register_full_backward_hook(backward)
    sampler = Sampler(model, bins=BINS)
    try:
        with log_sampler(sampler, tmp_path) as log:
            assert sampler.arm("0", "forward") == ["0.Linear"]  # by module path
            sampler.arm("0.Linear", "grad")
            for i in range(4):
                x = torch.randn(3, 6) * (1 + 2 * i)  # later steps outgrow the first sample's bins
                if i == 2:
                    x[0, 0] = float("nan")
                model(x.requires_grad_()).sum().backward()
            assert log in sampler.sinks
        assert log not in sampler.sinks
        model(torch.randn(3, 6))  # sampled, but no longer logged
        sampler.drain()
    finally:
        sampler.close()

    events = read_events(tmp_path)
    assert set(events.Tags()["histograms"]) == {f"0.Linear/{role}" for role in seen}
    for tag, by_step in seen.items():
        by_step = {s: v for s, v in by_step.items() if s <= 4}
        steady = SteadyBins(BINS)  # the sampler's documented bins: a running range, fed each step's values in turn
        histograms = events.Histograms(f"0.Linear/{tag}")
        assert [e.step for e in histograms] == [1, 2, 3, 4]
        for event in histograms:
            values = by_step[event.step].astype(np.float64)
            finite = values[np.isfinite(values)]
            steady.fit(float(finite.min()), float(finite.max()))
            check_histogram(event, values, steady.edges)
        check_scalars(events, f"0.Linear/{tag}", by_step)
        if tag == "input0":
            assert steady.rebins > 0  # later steps outgrew the first sample's bins; no value fell outside them
    assert events.Scalars("0.Linear/output0/nan")[2].value == 5  # the NaN spread over its row's 5 outputs


def test_running_stats_read_back_as_numpy_sees_every_output_so_far(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
    outputs: list[np.ndarray] = []

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        outputs.append(out.detach().numpy().copy().ravel())

    model[1].register_forward_hook(keep)
    writer = SummaryWriter(str(tmp_path))
    expected: dict[int, np.ndarray] = {}
    with fwdtrace.Probe(model) as probe:
        stats = probe.running_stats("1", of="output", bins=BINS)  # the path of the Tanh
        for step in range(1, 4):
            model(torch.randn(2, 4) * step)
            stats.to_tensorboard(writer, step)
            expected[step] = np.concatenate(outputs).astype(np.float64)
    writer.close()
    events = read_events(tmp_path)
    histograms = events.Histograms("1.Tanh/output")
    assert [e.step for e in histograms] == [1, 2, 3]
    for event in histograms:  # RunningStats: the power-of-two bins of every output so far
        seen = expected[event.step]
        exponent, start = power_of_two_bins(float(seen.min()), float(seen.max()), BINS)
        check_histogram(event, seen, np.ldexp(start + np.arange(BINS + 1.0), exponent))
    check_scalars(events, "1.Tanh/output", expected)


def test_bad_writers_and_a_missing_tensorboard_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FwdtraceError, match=r"^log_sampler\(\) expected a fwdtrace live Sampler \(server.sampler\), got int"):
        log_sampler(3, tmp_path)
    with pytest.raises(FwdtraceError, match=r"^add_running_stats\(\) expected what Probe.running_stats\(\) returns"):
        add_running_stats(None, [1, 2], step=0)  # type: ignore[arg-type]
    sampler = Sampler(nn.Linear(2, 2))
    try:
        with pytest.raises(FwdtraceError, match=r"^log_sampler\(\) expected a torch.utils.tensorboard.SummaryWriter or a log folder, got int"):
            log_sampler(sampler, 3)
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
        with pytest.raises(FwdtraceError, match=r"^log_sampler\(\) needs the tensorboard package: pip install 'fwdtrace\[tensorboard\]'"):
            log_sampler(sampler, tmp_path)
        assert sampler.sinks == []
    finally:
        sampler.close()
