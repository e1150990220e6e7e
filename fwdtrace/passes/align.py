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

The graphs may come from files (a dump's stored trace), so the work is bounded by their size: a
call's nearest paired calls are a set that can grow with every input of every call looked through
(a crafted graph of fan-ins made them quadratic), so the sets of one sweep hold at most
``_SET_BUDGET`` elements per node and edge, and all sweeps together do at most ``_WORK_BUDGET``
steps per node and edge. A call whose set would go beyond stays unpaired, and so does every call
that looks through it; a trace of a real model stays far below both.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..graph import Graph
from ..node import Node

__all__ = ["align"]

_CALLS = ("module", "function")
_SET_BUDGET = 8  # anchor-set elements one sweep keeps, per node and edge of the graph
_SET_COST = 4  # a set's own memory, in elements, charged to that budget
_WORK_BUDGET = 256  # steps all sweeps of one align() take, per node and edge of both graphs
_EMPTY: frozenset[int] = frozenset()


class _Side:
    """One graph's dataflow neighbours, built once (``Graph.in_edges`` scans every edge)."""

    def __init__(self, graph: Graph) -> None:
        preds: list[list[int]] = [[] for _ in graph.nodes]
        succs: list[list[int]] = [[] for _ in graph.nodes]
        for e in graph.edges:
            preds[e.dst].append(e.src)
            succs[e.src].append(e.dst)
        # tuples of distinct ids: a node's tuple is far smaller than a set, and one edge per tensor repeats pairs
        self.preds = [tuple(dict.fromkeys(p)) for p in preds]
        self.succs = [tuple(dict.fromkeys(s)) for s in succs]
        self.size = len(graph.nodes) + len(graph.edges)

    def anchors(self, paired: Mapping[int, int], forward: bool) -> tuple[list[frozenset[int] | None], int]:
        """Per unpaired node, the nearest paired nodes after (``forward``) or before it in the dataflow, looking
        through unpaired ones, and the steps taken: one sweep, as every edge runs from an earlier node to a later
        one. None for a node whose set would go past the sweep's budget, and for those that look through it;
        a paired node's set is never read (it is an anchor itself) and left empty."""
        step = self.succs if forward else self.preds
        out: list[frozenset[int] | None] = [_EMPTY] * len(step)
        single: dict[int, frozenset[int]] = {}  # {m} for an anchor m: shared by every node next to m alone
        budget = _SET_BUDGET * self.size
        spent = 0
        for n in reversed(range(len(step))) if forward else range(len(step)):
            spent += 1
            if n in paired:
                continue
            direct: list[int] = []
            through: list[frozenset[int]] = []
            unknown = False
            for m in step[n]:
                if m in paired:
                    direct.append(m)
                else:
                    seen = out[m]
                    if seen is None:
                        unknown = True
                        break
                    if seen:
                        through.append(seen)
            spent += len(step[n])
            if len(through) > 1:  # the same set reached by several paths: once
                through = list({id(t): t for t in through}.values())
            if unknown:
                out[n] = None
            elif not direct and len(through) <= 1:  # looked through one call: its set, shared, not copied
                out[n] = through[0] if through else _EMPTY
            elif len(direct) == 1 and not through:
                out[n] = single.get(direct[0]) or single.setdefault(direct[0], frozenset(direct))
            else:
                cost = len(direct) + sum(len(t) for t in through) + _SET_COST
                if spent + cost > budget:
                    out[n] = None
                    continue
                spent += cost
                out[n] = frozenset(direct).union(*through)
        return out, spent


def _numbered(sets: list[frozenset[int] | None], numbers: dict[frozenset[int], int],
              a2b: Mapping[int, int] | None) -> list[int]:
    """Each node's anchor set as its number in ``numbers``, each set object looked at once however many
    nodes share it. With ``a2b`` (a's sets) the set is put in b's ids and numbered anew; without (b's) it
    is looked up: -1 for one no call of a has, and for None (unknown)."""
    seen: dict[int, int] = {}  # id() of a set (alive in ``sets``) -> its number
    out = []
    for anchors in sets:
        if anchors is None:
            out.append(-1)
            continue
        number = seen.get(id(anchors))
        if number is None:
            if a2b is not None:
                number = numbers.setdefault(frozenset(a2b[m] for m in anchors), len(numbers))
            else:
                number = numbers.get(anchors, -1)
            seen[id(anchors)] = number
        out.append(number)
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
    work = _WORK_BUDGET * (side_a.size + side_b.size)
    # Signatures and anchor sets as numbers: each hashed and compared once, however many calls share it.
    signatures: dict[tuple, int] = {}
    sig_a = [signatures.setdefault(_signature(n), len(signatures)) if n.kind in _CALLS else -1 for n in a.nodes]
    sig_b = [signatures.get(_signature(n), -1) if n.kind in _CALLS else -1 for n in b.nodes]
    while True:
        b2a = {nb: na for na, nb in a2b.items()}
        work -= len(a2b)
        # (signature, anchors before, anchors after, in b's ids) -> the unpaired calls of each run there
        places: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
        numbers: dict[frozenset[int], int] = {}  # an anchor set, in b's ids -> its number
        (before_a, spent_before), (after_a, spent_after) = side_a.anchors(a2b, False), side_a.anchors(a2b, True)
        work -= spent_before + spent_after
        number_before, number_after = _numbered(before_a, numbers, a2b), _numbered(after_a, numbers, a2b)
        for i, sig in enumerate(sig_a):
            before, after = before_a[i], after_a[i]
            if sig >= 0 and i not in a2b and before is not None and after is not None and (before or after):
                places.setdefault((sig, number_before[i], number_after[i]), ([], []))[0].append(i)
        if not places or work < 0:
            return a2b
        (before_b, spent_before), (after_b, spent_after) = side_b.anchors(b2a, False), side_b.anchors(b2a, True)
        work -= spent_before + spent_after
        if work < 0:  # b's sets may be cut short: pair nothing on them
            return a2b
        number_before, number_after = _numbered(before_b, numbers, None), _numbered(after_b, numbers, None)
        for i, sig in enumerate(sig_b):
            if sig >= 0 and i not in b2a:
                here = (sig, number_before[i], number_after[i])
                if here in places:
                    places[here][1].append(i)
        paired = [(na, nb) for ids_a, ids_b in places.values() if len(ids_a) == len(ids_b)
                  for na, nb in zip(ids_a, ids_b, strict=True)]
        if not paired:
            return a2b
        a2b.update(paired)
