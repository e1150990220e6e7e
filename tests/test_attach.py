"""fwdtrace.instrument.attach: the one place where the tools put hooks on a model, and take them off."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace.instrument.attach import Attachment, attach
from fwdtrace.instrument.ingraph import StatsSlot
from fwdtrace.instrument.keys import key2module
from fwdtrace.instrument.stats import RunningStats

PACKAGE = Path(fwdtrace.__file__).parent
# torch's hook registrations (module, tensor, parameter, global) and fwdtrace's own gradient hook
HOOK_CALL = re.compile(r"^register_\w*hook$")


def hook_registrations(path: Path) -> list[str]:
    """``"file:line name"`` of every call of a hook registration in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if HOOK_CALL.match(name):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_no_tool_registers_a_hook_outside_the_instrumentation_layer() -> None:
    inside = PACKAGE / "instrument"
    outside = [hit for path in sorted(PACKAGE.rglob("*.py")) if inside not in path.parents
               for hit in hook_registrations(path)]
    assert outside == []
    # the walk does see registrations where they belong
    assert any("register_forward_hook" in hit for hit in hook_registrations(inside / "attach.py"))


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_attach_calls_each_keys_hooks_and_removes_them_all() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    x = torch.randn(4, 2, requires_grad=True)
    seen: list[tuple[str, str]] = []
    reference = {}
    for key, module in key2module(model).items():  # plain torch hooks, for the expected values
        module.register_forward_hook(lambda m, a, out, key=key: reference.__setitem__(key, out.detach().clone()))
    got: dict[str, torch.Tensor] = {}
    on = attach(model, key2module(model), caller="test",
                pre=lambda key, m: lambda m, a: seen.append(("pre", key)),
                post=lambda key, m: lambda m, a, out: got.__setitem__(key, out.detach().clone()),
                grads=lambda key, m: lambda m, gin, gout: seen.append(("grad", key)))
    model(x).sum().backward()
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(got[key], value)
    assert [k for what, k in seen if what == "pre"] == ["Sequential", "0.Linear", "1.ReLU", "2.Linear"]
    assert sorted(k for what, k in seen if what == "grad") == sorted(key2module(model))
    assert on.route == "eager" and on.runs == "eager"
    on.remove()
    on.remove()  # twice is harmless
    assert _hook_count(model) == len(reference)  # the reference hooks alone are left
    model(x).sum().backward()
    assert len(seen) == 8


def test_a_factory_that_raises_leaves_nothing_attached() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    compiled = torch.compile(model, backend="eager")
    before = compiled.forward

    def post(key: str, module: nn.Module) -> object:
        if key == "1.ReLU":
            raise RuntimeError("no hook for this key")
        return lambda m, a, out: None

    with pytest.raises(RuntimeError, match="^no hook"):
        attach(compiled, key2module(compiled), caller="test", post=post)
    assert _hook_count(model) == 0 and compiled.forward is before


def test_the_eager_route_is_held_while_attached_and_given_back_after() -> None:
    compiled = torch.compile(nn.Sequential(nn.Linear(2, 2)), backend="eager")
    before = compiled.forward
    with Attachment(compiled, "test") as on:
        assert compiled.forward is not before and on.runs == "eager route"
    assert compiled.forward is before


def test_an_in_graph_attachment_takes_plain_hooks_only_outside_compiled_code() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    inner = model[0]
    model[0] = torch.compile(inner, backend="eager")
    on = Attachment(model, "test", "graph")
    with pytest.raises(ValueError, match="^test: an in-graph attachment takes only in-graph hooks inside compiled code"):
        on.forward(inner, lambda m, a, out: None)
    outside: list[torch.Tensor] = []
    on.forward(model[1], lambda m, a, out: outside.append(out))  # runs eagerly: allowed
    stats = RunningStats(bins=4)
    on.stats(inner, StatsSlot(stats), "output")
    x = torch.randn(3, 2)
    out = model(x)
    on.remove()
    reference = RunningStats(bins=4)
    reference.update(inner(x))  # plain torch, after the fact
    assert _hook_count(model) == 0 and len(outside) == 1 and torch.equal(outside[0], out)
    assert stats.count == reference.count and stats.mean == pytest.approx(reference.mean)
    assert stats.histogram == reference.histogram
    with pytest.raises(ValueError, match="^route is one of"):
        Attachment(model, "test", "lazy")
