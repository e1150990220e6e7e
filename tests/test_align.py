"""The alignment pass: two traces' calls paired through the dataflow where their names differ, checked against
what each refactor is known to have renamed, added or duplicated."""

from __future__ import annotations

import json

import torch
from torch import nn

import fwdtrace
from fwdtrace import Graph
from fwdtrace.passes.align import align

_X = torch.ones(2, 4)


class _TwoHeads(nn.Module):
    """Two parallel projections of the same shapes (an ambiguity only call order settles), named by the caller."""

    def __init__(self, first: str, second: str, extra: bool = False) -> None:
        super().__init__()
        self.names = first, second
        self.add_module(first, nn.Linear(4, 4))
        self.add_module(second, nn.Linear(4, 4))
        self.extra = nn.Linear(4, 4) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = (getattr(self, n)(x) for n in self.names)
        if self.extra is not None:
            b = b + self.extra(x)
        return a * b


def _keys(a: fwdtrace.Graph, b: fwdtrace.Graph, a2b: dict[int, int]) -> dict[str, str]:
    return {str(a.nodes[i].key): str(b.nodes[j].key) for i, j in a2b.items() if a.nodes[i].key}


def test_parallel_calls_renamed_together_pair_in_call_order() -> None:
    a = fwdtrace.trace(_TwoHeads("q", "k"), _X)
    b = fwdtrace.trace(_TwoHeads("query", "key"), _X)
    assert _keys(a, b, align(a, b, {})) == {"q.Linear": "query.Linear", "k.Linear": "key.Linear", "mul": "mul"}


def test_an_added_call_of_the_same_kind_is_never_paired_by_guess() -> None:
    a = fwdtrace.trace(_TwoHeads("q", "k"), _X)
    b = fwdtrace.trace(_TwoHeads("query", "key", extra=True), _X)  # a third Linear(4, 4) of x, and an add
    keys = _keys(a, b, align(a, b, {}))
    # three Linears read x in b and two in a: which two are q and k is not for the dataflow to guess
    assert "q.Linear" not in keys and "k.Linear" not in keys
    assert "extra.Linear" not in keys.values() and keys.get("mul") == "mul"


def test_calls_paired_by_name_are_kept_and_anchor_the_rest() -> None:
    a = fwdtrace.trace(_TwoHeads("q", "k", extra=True), _X)
    b = fwdtrace.trace(_TwoHeads("query", "key", extra=True), _X)
    extra = next(n.id for n in a.nodes if n.key == "extra.Linear"), next(n.id for n in b.nodes if n.key == "extra.Linear")
    keys = _keys(a, b, align(a, b, dict([extra])))
    assert keys == {"q.Linear": "query.Linear", "k.Linear": "key.Linear", "extra.Linear": "extra.Linear",
                    "add": "add", "mul": "mul"}


def _fan_in_graph(hub_inputs: int, chain: int) -> tuple[str, list[int]]:
    """A crafted graph's JSON and its anchors: calls the caller pairs, feeding unpaired calls whose nearest
    anchors grow: a hub reading ``hub_inputs`` anchors, then a chain whose every call reads the previous one
    and one more anchor (each call's set is one larger than the last: quadratic in sets kept whole)."""
    nodes: list[dict] = [{"id": 0, "kind": "input", "target": "x", "name": "x"}]
    edges: list[dict] = []

    def add(kind: str, name: str) -> int:
        nodes.append({"id": len(nodes), "kind": kind, "target": "t", "name": name})
        return len(nodes) - 1

    def edge(src: int, dst: int) -> None:
        edges.append({"src": src, "dst": dst, "obj_id": 0, "shape": [], "dtype": "f"})

    anchors = [add("function", f"p{i}") for i in range(hub_inputs + chain)]
    for p in anchors:
        edge(0, p)
    previous = add("function", "hub")
    for p in anchors[:hub_inputs]:
        edge(p, previous)
    for p in anchors[hub_inputs:]:
        call = add("function", "c")
        edge(previous, call)
        edge(p, call)
        previous = call
    edge(previous, add("output", "out"))
    return json.dumps({"format": "fwdtrace.Graph", "nodes": nodes, "edges": edges}, separators=(",", ":")), anchors


def test_a_crafted_fan_in_graph_is_aligned_in_memory_bounded_by_its_size() -> None:
    import tracemalloc

    text, anchors = _fan_in_graph(300, 300)  # 129 KiB; sets kept whole peaked at 197 times that
    tracemalloc.start()
    try:
        a, b = Graph.from_json(text), Graph.from_json(text)
        a2b = align(a, b, {p: p for p in anchors})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * len(text), (peak, len(text))
    # The same graph on both sides: whatever pairs, pairs a call with itself, never by guess.
    assert all(i == j for i, j in a2b.items()) and set(anchors) <= set(a2b)
