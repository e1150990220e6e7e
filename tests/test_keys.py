"""Module keys against torch's own ``named_modules``."""

from __future__ import annotations

import pytest
import torch
import zoo
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.keys import key2module, module_key


class TestModel(nn.Module):
    __test__ = False  # not a pytest class: the model of the issue's example

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.ModuleList([nn.Conv2d(1, 1, 1) for _ in range(4)])


def test_the_issue_example() -> None:
    assert fwdtrace.module_keys(TestModel()) == [
        "seq.0.Conv2d", "seq.1.Conv2d", "seq.2.Conv2d", "seq.3.Conv2d", "seq.ModuleList", "TestModel",
    ]


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_keys_name_every_module_once_children_before_parents(name: str) -> None:
    model, _ = zoo.ZOO[name]()
    keys = key2module(model)
    named = dict(model.named_modules())
    assert sorted(keys) == sorted(f"{p}.{type(m).__name__}" if p else type(m).__name__ for p, m in named.items())
    for key, module in keys.items():
        path = key.rsplit(".", 1)[0] if "." in key else ""
        assert named[path] is module
        assert module_key(path, module) == key
    order = list(keys)
    for path, module in named.items():
        for child_name, child in module.named_children():
            child_path = f"{path}.{child_name}" if path else child_name
            if named.get(child_path) is child:
                assert order.index(module_key(child_path, child)) < order.index(module_key(path, module))
    assert order[-1] == type(model).__name__


def test_a_shared_module_is_listed_once_under_its_first_path() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert fwdtrace.module_keys(model) == ["0.Linear", "1.ReLU", "Sequential"]
    assert [p for p, _ in model.named_modules()] == ["", "0", "1"]  # torch agrees


def test_keys_match_the_trace_node_keys() -> None:
    model, inputs = zoo.resnetish()
    graph = fwdtrace.trace(model, *inputs)
    keys = set(fwdtrace.module_keys(model))
    assert {n.module_key for n in graph.find(kind="module")} <= keys


def test_a_non_module_is_refused() -> None:
    with pytest.raises(FwdtraceError, match=r"^module_keys\(\) expected a torch\.nn\.Module, got Tensor\[2\]"):
        fwdtrace.module_keys(torch.ones(2))
