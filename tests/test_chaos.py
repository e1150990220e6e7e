"""Chaos: each fault does what it says, at the logged place, and the same seed repeats it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _run(fault: str, seed: int, p: float = 0.5, steps: int = 6) -> tuple[list, list[torch.Tensor]]:
    model = _model()
    torch.manual_seed(1)
    xs = [torch.randn(2, 6) for _ in range(steps)]
    with fwdtrace.Probe(model) as probe:
        handle = probe.chaos("*.Linear", fault=fault, p=p, seed=seed)
        outs = [model(x).detach() for x in xs]
    return handle.log, outs


@pytest.mark.parametrize("fault", ["nan", "inf", "zero", "noise", "bitflip"])
def test_the_same_seed_gives_the_same_faults(fault: str) -> None:
    log_a, outs_a = _run(fault, seed=7)
    log_b, outs_b = _run(fault, seed=7)
    assert log_a == log_b and len(log_a) > 0
    for a, b in zip(outs_a, outs_b, strict=True):
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    log_c, _ = _run(fault, seed=8)
    assert [(i.call, i.index) for i in log_c] != [(i.call, i.index) for i in log_a]


def _hit(fault: str, x: torch.Tensor, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The Linear's clean output (by plain hooks) and its corrupted one, with the log entry."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Identity())
    clean = model[0](x).detach()
    seen = []
    h = model[1].register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    with fwdtrace.Probe(model) as probe:
        chaos = probe.chaos("0.Linear", fault=fault, p=1.0, seed=seed)
        model(x)
    h.remove()
    (entry,) = chaos.log
    assert (entry.key, entry.call_index, entry.fault) == ("0.Linear", 0, fault)
    return clean, seen[0], entry


@pytest.mark.parametrize("fault", ["nan", "inf"])
def test_nan_and_inf_hit_the_logged_element_only(fault: str) -> None:
    clean, got, entry = _hit(fault, torch.randn(3, 4))
    bad = (~torch.isfinite(got)).reshape(-1).nonzero().reshape(-1).tolist()
    assert bad == [entry.index]
    assert torch.isnan(got.reshape(-1)[entry.index]) == (fault == "nan")
    keep = torch.ones(clean.numel(), dtype=torch.bool)
    keep[entry.index] = False
    assert torch.equal(got.reshape(-1)[keep], clean.reshape(-1)[keep])


def test_bitflip_changes_exactly_one_bit() -> None:
    clean, got, entry = _hit("bitflip", torch.randn(3, 4))
    xor = clean.reshape(-1).view(torch.int32) ^ got.reshape(-1).view(torch.int32)
    changed = xor.nonzero().reshape(-1).tolist()
    assert changed == [entry.index]
    assert bin(int(xor[entry.index]) & 0xFFFFFFFF).count("1") == 1


def test_zero_noise_and_skip() -> None:
    x = torch.randn(3, 4)
    _, got, _ = _hit("zero", x)
    assert torch.equal(got, torch.zeros(3, 5))
    clean, got, entry = _hit("noise", x)
    assert entry.index is None and not torch.equal(got, clean)
    assert (got - clean).abs().max() < 1.0  # std 0.1 noise
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with fwdtrace.Probe(model) as probe:
        probe.chaos("1.Tanh", fault="skip")
        assert torch.equal(model(x), model[0](x))


def test_p_zero_injects_nothing_and_removal_restores() -> None:
    model = _model()
    x = torch.randn(2, 6)
    before = model(x)
    with fwdtrace.Probe(model) as probe:
        quiet = probe.chaos(nn.Linear, fault="nan", p=0.0)
        assert torch.equal(model(x), before) and quiet.log == []
        loud = probe.chaos(nn.Linear, fault="nan", p=1.0)
        assert model(x).isnan().any() and len(loud.log) == 3
    assert torch.equal(model(x), before)


def test_bad_chaos_arguments() -> None:
    probe = fwdtrace.Probe(_model())
    with pytest.raises(FwdtraceError, match=r"^chaos\(\) expected fault as one of nan, inf, zero, noise, bitflip, skip, got 'fire'"):
        probe.chaos("0.Linear", fault="fire")
    with pytest.raises(FwdtraceError, match=r"^chaos\(\) expected p as a probability in \[0, 1\], got 2"):
        probe.chaos("0.Linear", p=2)
    with fwdtrace.Probe(_model()) as probe, pytest.raises(FwdtraceError, match=r"^chaos\(fault='skip'\) expected the layer's first input"):
        probe.chaos("0.Linear", fault="skip")
        probe.model(torch.randn(2, 6))


def test_chaos_from_several_threads_logs_every_call_once() -> None:
    from concurrent.futures import ThreadPoolExecutor

    model = nn.Sequential(nn.Linear(4, 4))
    with fwdtrace.Probe(model) as probe, torch.no_grad():
        faults = probe.chaos("0.Linear", fault="nan", p=0.5, seed=0)
        with ThreadPoolExecutor(4) as pool:
            outputs = list(pool.map(model, [torch.ones(2, 4)] * 64))
    assert faults.chaos.calls == 64 and sorted(i.call for i in faults.log) == sorted({i.call for i in faults.log})
    assert len(faults.log) == sum(int(o.isnan().any()) for o in outputs)
