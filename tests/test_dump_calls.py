"""Function-level dumps: the calls a trace records, keyed as its graph's nodes, in execution order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.instrument.keys import module_key


class _Attention(nn.Module):
    def __init__(self, softmax_dtype: torch.dtype) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.softmax_dtype = softmax_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) + 2e4  # an offset softmax ignores and float16 does not
        return scores.to(self.softmax_dtype).softmax(-1).to(x.dtype) @ x


class _Model(nn.Module):
    def __init__(self, softmax_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.attn = _Attention(softmax_dtype)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.attn(self.embed(x))))


_X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


def _dump(tmp_path: Path, name: str, model: nn.Module, calls: str, values: str = "tensors") -> Path:
    with fwdtrace.Dumper(tmp_path / name, calls=calls, values=values) as dumper:
        dumper.register(model)
        model(_X).sum().backward()
    return dumper.paths[0]


def _keys(path: Path) -> list[str]:
    return [g["attrs"]["module_key"] for g in fwdtrace.read_dump(path, show=False)["groups"].values()]


def test_function_calls_are_keyed_as_the_traces_function_nodes_in_execution_order(tmp_path: Path) -> None:
    model = _Model()
    graph = fwdtrace.trace(model, _X)
    # the reference: the trace's own function nodes, and plain forward hooks' module calls
    function_keys = [n.key for n in graph.nodes if n.kind == "function"]
    assert "attn.softmax" in function_keys
    assert _keys(_dump(tmp_path, "f", model, "functions")) == function_keys
    order: list[str] = []
    keys = {id(m): module_key(p, m) for p, m in model.named_modules()}
    handles = [m.register_forward_pre_hook(lambda m, a: order.append(keys[id(m)])) for m in model.modules()]
    model(_X)
    for h in handles:
        h.remove()
    everything = _keys(_dump(tmp_path, "a", model, "all"))
    assert [k for k in everything if k in set(order)] == order
    assert [k for k in everything if k not in set(order)] == function_keys
    # a function call comes after the module calls that made its inputs: attn.q and attn.k before the matmul
    assert everything.index("attn.k.Linear") < everything.index("attn.matmul") < everything.index("attn.softmax")
    assert everything.index("attn.softmax") < everything.index("out.Linear")


def test_function_calls_hold_the_values_torch_computed(tmp_path: Path) -> None:
    model = _Model()
    seen = {}
    model.attn.k.register_forward_hook(lambda m, a, out: seen.setdefault("k", out.detach().clone()))
    tree = fwdtrace.read_dump(_dump(tmp_path, "f", model, "functions"), show=False, values=True)
    groups = {g["attrs"]["module_key"]: g for g in tree["groups"].values()}
    transpose = groups["attn.transpose"]["datasets"]
    assert torch.equal(transpose["input0"]["value"], seen["k"])
    assert torch.equal(transpose["output0"]["value"], seen["k"].transpose(-1, -2))
    assert groups["attn.softmax"]["attrs"]["function"] == "torch.Tensor.softmax"
    assert tree["status"] == "complete"
    assert "grad_output0" in groups["attn.softmax"]["datasets"]


@pytest.mark.parametrize("values", ["tensors", "statistics"])
def test_a_float16_softmax_is_the_first_divergence_at_function_level(tmp_path: Path, values: str) -> None:
    a = _dump(tmp_path, "a", _Model(), "all", values)
    b = _dump(tmp_path, "b", _Model(torch.float16), "all", values)
    report = fwdtrace.compare_dumps(a, b)
    assert report.first_divergence == "attn.softmax", report.to_text()
    rows = {(r.key, r.name): r for r in report.rows}
    given, made = rows[("attn.softmax", "input0")], rows[("attn.softmax", "output0")]
    assert given.allclose or given.rounding == "float16"  # what it was given agrees, to float16's rounding
    assert not made.allclose and made.rounding is None
    # at module level the same runs part at the attention block
    report = fwdtrace.compare_dumps(_dump(tmp_path, "ma", _Model(), "modules", values),
                                    _dump(tmp_path, "mb", _Model(torch.float16), "modules", values))
    assert report.first_divergence == "attn", report.to_text()


def test_dumper_checks_calls(tmp_path: Path) -> None:
    with pytest.raises(FwdtraceError, match=r"^Dumper expected calls as one of 'modules', 'functions', 'all', got 'ops'"):
        fwdtrace.Dumper(tmp_path, calls="ops")
