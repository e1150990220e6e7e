"""compare_dumps' matching through the graphs recorded with each dump: a refactor that renames or adds a layer, an
autocast run with casts of its own; against plain forward hooks and the refactor's known renames."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zoo
from torch import nn

import fwdtrace
from fwdtrace.instrument.keys import module_key

_X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class _Before(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.block = _Block()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.block(self.embed(x)))))


class _After(nn.Module):
    """The refactor: ``block`` renamed ``layer``, ``fc`` renamed ``proj``, an Identity added after it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layer = _Block()
        self.proj = nn.Linear(8, 8)
        self.extra = nn.Identity()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.extra(self.proj(self.layer(self.embed(x))))))


_RENAMES = {"block": "layer", "fc": "proj"}  # module path prefixes, before -> after


def _renamed(path: str) -> str:
    head, _, rest = path.partition(".")
    return ".".join(filter(None, (_RENAMES.get(head, head), rest)))


def _refactored(before: nn.Module) -> _After:
    after = _After()
    after.load_state_dict({_renamed(k): v for k, v in before.state_dict().items()})
    return after


def _dump(tmp_path: Path, name: str, model: nn.Module, calls: str = "all", values: str = "tensors") -> Path:
    with fwdtrace.Dumper(tmp_path / name, calls=calls, values=values) as dumper:
        dumper.register(model)
        model(_X).sum().backward()
    return dumper.paths[0]


def _module_calls(model: nn.Module) -> list[str]:
    """The reference: each submodule call's key in order, by plain forward pre-hooks."""
    keys = {id(m): module_key(p, m) for p, m in model.named_modules() if p}
    order: list[str] = []
    handles = [m.register_forward_pre_hook(lambda m, a: order.append(keys[id(m)])) for m in model.modules()
               if id(m) in keys]
    try:
        model(_X)
    finally:
        for h in handles:
            h.remove()
    return order


def _module_pairs(report: fwdtrace.DumpReport) -> list[tuple[str, str]]:
    """The report's pairs of submodule calls (key in a, key in b), in a's order."""
    return list(dict.fromkeys((r.key, r.key_b or r.key) for r in report.rows
                              if not r.one_sided and not r.function and r.module_path))


@pytest.mark.parametrize("values", ["tensors", "statistics"])
def test_a_renamed_and_an_added_layer_pair_the_rest_as_plain_hooks_do(tmp_path: Path, values: str) -> None:
    before = _Before()
    after = _refactored(before)
    report = fwdtrace.compare_dumps(_dump(tmp_path, "a", before, values=values),
                                    _dump(tmp_path, "b", after, values=values))
    # the reference: plain hooks' calls of both models, paired in order once the added layer is left out
    calls_a, calls_b = _module_calls(before), _module_calls(after)
    reference = list(zip(calls_a, [k for k in calls_b if k != "extra.Identity"], strict=True))
    assert all(kb == _renamed(ka) for ka, kb in reference)
    assert _module_pairs(report) == reference
    assert report.only_in_a == [] and report.only_in_b == ["extra.Identity"]
    assert ("block.relu", "layer.relu") in report.renamed and ("fc.Linear", "proj.Linear") in report.renamed
    assert all(r.allclose for r in report.rows if not r.one_sided), report.to_text()
    assert report.first_divergence is None and not report.equal
    assert "fc.Linear (b: proj.Linear)" in report.to_text()


def test_function_calls_inside_a_renamed_layer_pair_through_the_graphs(tmp_path: Path) -> None:
    before = _Before()
    report = fwdtrace.compare_dumps(_dump(tmp_path, "a", before, "functions"),
                                    _dump(tmp_path, "b", _refactored(before), "functions"))
    assert report.only_in_a == report.only_in_b == []
    assert report.renamed == [("block.relu", "layer.relu"), ("block.add", "layer.add")]
    assert report.equal, report.to_text()


@pytest.mark.parametrize("nudged,expected", [("proj", "fc"), ("layer.fc", "block.fc")])
def test_a_nudged_weight_in_a_renamed_layer_is_the_first_divergence(tmp_path: Path, nudged: str, expected: str) -> None:
    before = _Before()
    after = _refactored(before)
    with torch.no_grad():
        after.get_submodule(nudged).weight.mul_(1.01)
    report = fwdtrace.compare_dumps(_dump(tmp_path, "a", before), _dump(tmp_path, "b", after), rtol=1e-4, atol=1e-6)
    assert report.first_divergence == expected, report.to_text()
    assert report.only_in_b == ["extra.Identity"]


def test_dumps_without_a_graph_keep_matching_by_key_and_say_so(tmp_path: Path) -> None:
    before = _Before()
    a = _dump(tmp_path, "a", before, "modules")
    b = _dump(tmp_path, "b", _refactored(before), "modules")
    report = fwdtrace.compare_dumps(a, b)
    assert report.without_graph == [str(a), str(b)] and report.renamed == []
    assert report.only_in_a == ["block._Block", "block.fc.Linear", "fc.Linear"]
    assert "calls matched by key and call order only: neither dump holds a graph" in report.to_text()
    with_graph = _dump(tmp_path, "c", before, "all")
    report = fwdtrace.compare_dumps(with_graph, b)
    assert report.without_graph == [str(b)] and "dump b holds no graph" in report.to_text()
    assert "matched by key and call order only" not in fwdtrace.compare_dumps(a, a).to_text()


class _Wrapped(nn.Module):
    """The model one level down: every key of its calls gains ``backbone.``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.backbone = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.backbone(*inputs)


ZOO = ["resnetish", "transformer_encoder", "hand_attention", "lstm_tagger", "shared_weights"]  # a row per architecture


@pytest.mark.parametrize("name", ZOO)
def test_a_model_whose_every_key_changed_still_pairs_call_for_call(tmp_path: Path, name: str) -> None:
    model, inputs = getattr(zoo, name)()
    paths = []
    for run in (model, _Wrapped(model)):
        with fwdtrace.Dumper(tmp_path / str(len(paths)), calls="all") as dumper:
            dumper.register(run, grads=False)
            with torch.no_grad():
                run(*inputs)
        paths += dumper.paths
    report = fwdtrace.compare_dumps(*paths)
    # the reference: the wrapper is the one call b added, and every other key is a's behind "backbone."
    assert report.only_in_a == [] and report.only_in_b == [f"backbone.{type(model).__name__}"], report.to_text()
    paired = {r.key: r.key_b or r.key for r in report.rows if not r.one_sided and (r.module_path or r.function)}
    assert paired and all(kb == f"backbone.{ka}" for ka, kb in paired.items())
    assert all(r.allclose for r in report.rows if not r.one_sided) and report.first_divergence is None


def test_a_long_loop_pairs_every_call_but_the_changed_ones() -> None:
    """A 500-iteration loop whose run b swaps one call every 25 iterations: every other call pairs with
    itself (the known answer), where a whole-run diff of so repetitive a sequence pairs far fewer, slowly."""
    from fwdtrace.dump.compare import _matching

    a = [(op, ((("input0", (2, 4)),))) for _ in range(500) for op in ("mul", "add", "tanh")]
    changed = set(range(2, len(a), 75))
    b = [("sigmoid", t[1]) if i in changed else t for i, t in enumerate(a)]
    assert list(_matching(a, b)) == [(i, i) for i in range(len(a)) if i not in changed]


@pytest.mark.parametrize("edge, message", [
    (lambda e: {**e, "src": e["dst"], "dst": e["src"]}, r"it runs from node \d+ back to node \d+"),  # a cycle
    (lambda e: {**e, "dst": 10 ** 6}, r"it joins node \d+ to node 1000000, of \d+ nodes"),  # dangling
])
def test_a_stored_graph_with_a_cycle_or_a_dangling_edge_is_refused_naming_the_dump(
        tmp_path: Path, edge, message: str) -> None:  # noqa: ANN001
    import json
    import re

    import h5py

    from fwdtrace.dump.layout import _create_text

    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    b = _dump(tmp_path, "b", model, values="statistics")
    crafted = _dump(tmp_path, "a", model, values="statistics")  # the first run's graph is read by every comparison
    with h5py.File(crafted, "r+") as f:
        graph = json.loads(bytes(f["trace_graph"][()]))
        graph["edges"][-1] = edge(graph["edges"][-1])
        del f["trace_graph"]
        _create_text(f, "trace_graph", json.dumps(graph))
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^Graph\.from_dict expected a graph written by Graph\.to_json in "
                                                     rf"'{re.escape(str(crafted))}', got one whose edge \d+ has {message}"):
        fwdtrace.compare_dumps(crafted, b)
