"""Module keys against torch's own ``named_modules``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import zoo
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.instrument.keys import key2module, module_key, select_modules


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


# -- one name for a layer: the path named_modules() gives selects what its key selects -------------
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_every_selector_api_takes_the_paths_of_named_modules(name: str, tmp_path: Path) -> None:
    from fwdtrace.live.sampler import Sampler

    model, inputs = zoo.ZOO[name]()
    named = dict(model.named_modules())  # the reference: torch's own names
    key_of = {id(m): f"{p}.{type(m).__name__}" if p else type(m).__name__ for p, m in named.items()}
    analysis = fwdtrace.analyze(model, *inputs, repeats=0)
    sampler = Sampler(model)
    recorder = fwdtrace.Recorder(tmp_path, ranks=[])  # a rank that records nothing: validation only, no worker
    tracked = iter(range(1 << 20))
    # every API that takes a layer selector, as selector -> the keys it selected
    apis: dict[str, Callable[[str], list[str]]] = {
        "select_modules": lambda s: list(select_modules(key2module(model), s, "test", "M")),
        "Probe.select": lambda s: list(fwdtrace.Probe(model).select(s)),
        "Sampler.select": sampler.select,
        "Recorder.track": lambda s: recorder.track(model, s, name=f"n{next(tracked)}"),
        "Analysis.row": lambda s: [analysis.row(s).key],
    }
    try:
        for api, select in apis.items():
            for path, module in named.items():
                assert select(path) == [key_of[id(module)]], (api, path)
                assert select(key_of[id(module)]) == [key_of[id(module)]], (api, path)
    finally:
        recorder.stop()
        sampler.close()


@pytest.mark.parametrize("name", ["resnetish", "unetish", "transformer_encoder"])
def test_a_path_glob_selects_the_module_and_everything_inside_it(name: str) -> None:
    model, _ = zoo.ZOO[name]()
    named = dict(model.named_modules())
    k2m = key2module(model)
    for path in named:
        if not path:
            continue
        # "blocks.0.*" matches the paths inside blocks.0, and blocks.0's own key "blocks.0.BasicBlock"
        inside = {id(m) for p, m in named.items() if p == path or p.startswith(path + ".")}
        got = select_modules(k2m, f"{path}.*", "test", "M")
        assert {id(m) for m in got.values()} == inside, path
        assert list(got) == [k for k in k2m if k in got]  # in key order


def test_globs_and_classes_mix_keys_and_paths() -> None:
    model, _ = zoo.resnetish()
    probe = fwdtrace.Probe(model)
    assert list(probe.select("blocks.?.c1")) == ["blocks.0.c1.Conv2d", "blocks.1.c1.Conv2d"]  # a path glob
    assert list(probe.select("blocks.?.c1.Conv2d")) == ["blocks.0.c1.Conv2d", "blocks.1.c1.Conv2d"]  # a key glob
    assert list(probe.select(["fc", nn.ReLU, "stem.0"])) == [
        "fc.Linear", "stem.2.ReLU", "blocks.0.relu.ReLU", "blocks.1.relu.ReLU", "stem.0.Conv2d",
    ]
    assert list(probe.select("")) == ["ResNetish"]  # named_modules() names the root ""


def test_an_unknown_name_lists_the_closest_keys_and_paths() -> None:
    model, _ = zoo.resnetish()
    with pytest.raises(
        FwdtraceError,
        match=r"^Probe expected a module key or path, a glob or a class of ResNetish, got 'blocks\.0\.c1_', "
        r"which matches no key or path; closest keys: 'blocks\.0\.c1\.Conv2d'.*; closest module paths: 'blocks\.0\.c1', ",
    ):
        fwdtrace.Probe(model).select("blocks.0.c1_")


def test_graph_nodes_carry_the_key_selectors_take_through_json() -> None:
    model, inputs = zoo.resnetish()
    graph = fwdtrace.trace(model, *inputs)
    named, k2m = dict(model.named_modules()), key2module(model)
    modules = graph.find(kind="module")
    assert modules
    for node in modules:
        assert k2m[node.key] is named[node.module_path]  # type: ignore[index]
    assert {n.key for n in graph.nodes if n.kind in ("input", "output")} == {None}
    text = graph.to_json()
    data = json.loads(text)
    assert [nd["key"] for nd in data["nodes"]] == [n.key for n in graph.nodes]
    again = fwdtrace.Graph.from_json(text)
    assert [n.key for n in again.nodes] == [n.key for n in graph.nodes] and again.to_json() == text
