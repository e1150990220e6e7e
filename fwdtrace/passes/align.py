"""Two runs' graphs aligned call for call where their names differ: a renamed layer, an added one, an extra cast.

A pass over two finished Graphs, used by :func:`fwdtrace.compare_dumps`. The calls already paired by
name (key and call order) are the anchors; the graphs' inputs pair in order, and so do their outputs.
A call left unpaired in one run is paired with one left unpaired in the other when both are the
same layer class or torch function, read and make tensors of the same shapes, and sit at the same
place among the anchors: the nearest paired calls before them in the dataflow are partners, and
so are the nearest after them (a call that stays unpaired, an added layer or a cast, is looked
through). Each pairing anchors the next, until nothing more pairs. Calls that are alike and sit at
the same place (two parallel projections renamed together) pair in execution order when both runs
have as many of them; otherwise they stay unpaired: listed as one-sided, never paired by guess.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..graph import Graph
from ..node import Node

__all__ = ["align"]

_CALLS = ("module", "function")


class _Side:
    """One graph's dataflow neighbours, built once (``Graph.in_edges`` scans every edge)."""

    def __init__(self, graph: Graph) -> None:
        self.preds: list[set[int]] = [set() for _ in graph.nodes]
        self.succs: list[set[int]] = [set() for _ in graph.nodes]
        for e in graph.edges:
            self.preds[e.dst].add(e.src)
            self.succs[e.src].add(e.dst)

    def anchors(self, paired: Mapping[int, int], forward: bool) -> list[frozenset[int]]:
        """Per node, the nearest paired nodes after (``forward``) or before it in the dataflow, looking through
        unpaired ones: one sweep, as every edge runs from an earlier node to a later one."""
        step = self.succs if forward else self.preds
        out: list[frozenset[int]] = [frozenset()] * len(step)
        for n in reversed(range(len(step))) if forward else range(len(step)):
            found: set[int] = set()
            for m in step[n]:
                if m in paired:
                    found.add(m)
                else:
                    found |= out[m]
            out[n] = frozenset(found)
        return out


def _signature(n: Node) -> tuple:
    # Shapes, not dtypes: an autocast run computes the same calls in another dtype.
    return n.kind, n.target, tuple(r.shape for r in n.inputs), tuple(r.shape for r in n.outputs)


def align(a: Graph, b: Graph, pairs: Mapping[int, int]) -> dict[int, int]:
    """Node id of ``a`` -> node id of ``b``: ``pairs`` (calls paired by name), the inputs and outputs in
    order, and the calls paired through the dataflow (see the module's docstring).

    >>> import torch, fwdtrace
    >>> x = torch.ones(1, 4)
    >>> a = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), x)
    >>> b = fwdtrace.trace(torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(4, 4), torch.nn.ReLU()), x)
    >>> [(n.key, b.nodes[align(a, b, {})[n.id]].key) for n in a.nodes if n.key]
    [('0.Linear', '1.Linear'), ('1.ReLU', '2.ReLU')]
    """
    a2b = dict(pairs)
    for kind in ("input", "output"):
        ends_a = [n.id for n in a.nodes if n.kind == kind]
        ends_b = [n.id for n in b.nodes if n.kind == kind]
        if len(ends_a) == len(ends_b):
            a2b.update(zip(ends_a, ends_b, strict=True))
    side_a, side_b = _Side(a), _Side(b)
    while True:
        b2a = {nb: na for na, nb in a2b.items()}
        # (signature, anchors before, anchors after, in b's ids) -> the unpaired calls of each run there
        places: dict[tuple, tuple[list[int], list[int]]] = {}
        before_a, after_a = side_a.anchors(a2b, False), side_a.anchors(a2b, True)
        for n in a.nodes:
            if n.kind in _CALLS and n.id not in a2b and (before_a[n.id] or after_a[n.id]):
                where = (_signature(n), frozenset(a2b[m] for m in before_a[n.id]),
                         frozenset(a2b[m] for m in after_a[n.id]))
                places.setdefault(where, ([], []))[0].append(n.id)
        if not places:
            return a2b
        before_b, after_b = side_b.anchors(b2a, False), side_b.anchors(b2a, True)
        for n in b.nodes:
            if n.kind in _CALLS and n.id not in b2a:
                where = (_signature(n), before_b[n.id], after_b[n.id])
                if where in places:
                    places[where][1].append(n.id)
        paired = [(na, nb) for ids_a, ids_b in places.values() if len(ids_a) == len(ids_b)
                  for na, nb in zip(ids_a, ids_b, strict=True)]
        if not paired:
            return a2b
        a2b.update(paired)
