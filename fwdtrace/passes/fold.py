"""What a picture may fold: side computations, dead ends, loops and runs of identical blocks.

A pass over a finished Graph that draws nothing: it only says which nodes and which module
calls can stand together in one box, so that the drawing pass (``draw.py``) stays readable on
large models. Everything here is independent of the depth a picture is drawn at.

- *Side computations* are function nodes off the data path: the data path starts at layer
  (module) calls, floating-point inputs and integer inputs that a layer reads as its main
  input (token ids into an Embedding, or into the Gather of an embedding table in an ONNX
  graph), and runs through every function that reads one of those. What is left (attention-mask arithmetic, position ids from ``arange``, constants,
  weight arithmetic) only feeds the data path.
- *Dead ends* are function nodes whose results reach no output.
- *Loops* are runs of the same sequence of calls inside one module call (per box, per
  feature level, per time step), ignoring shapes, which change from iteration to iteration.
- *Repeated blocks* are runs of consecutive sibling module calls that compute the same thing
  with the same shapes (the layers of a transformer).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ..graph import Graph
from ..node import Node, Scope

__all__ = ["Folds", "Loop", "find_folds", "side_components"]

MIN_REPEATS = 3  # a run of this many identical blocks or loop iterations is folded
MIN_LOOP_HIDDEN = 6  # ...and a loop only when folding hides at least this many calls
MAX_LOOP_BODY = 256  # the longest loop body looked for, in calls
MAX_ODD_ITERATIONS = 8  # a loop's run of iterations may be broken by this many that took other branches

# An item of a module call's sequence: a child module call, or one of its own nodes (by id).
Item = Scope | int


@dataclass
class Loop:
    """A run of ``count`` iterations of ``body`` (items of the module call ``parent``)."""

    parent: tuple[Scope, ...]
    body: list[Item]
    count: int
    hidden: list[Item] = field(default_factory=list)  # the items of iterations 2..count


@dataclass
class Folds:
    """The folding candidates of one graph; see :func:`find_folds`."""

    side: dict[int, str]  # function node id -> "side", "dead end" or "empty cache"
    loops: list[Loop]
    item2loop: dict[Item, Loop]  # items of the later iterations
    repeats: dict[Scope, tuple[Scope, int]]  # block -> (first block of its run, blocks after it)
    leaf_layers: set[Scope] = field(default_factory=set)  # calls with no child calls, only function nodes


def find_folds(graph: Graph) -> Folds:
    """Side computations, dead ends, loops and repeated blocks of ``graph``.

    >>> import torch, fwdtrace
    >>> from fwdtrace.passes.fold import find_folds
    >>> class Pos(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = torch.nn.Embedding(8, 4)
    ...     def forward(self, x):
    ...         return x + self.emb(torch.arange(x.shape[1]).unsqueeze(0))
    >>> g = fwdtrace.trace(Pos(), torch.ones(1, 8, 4))
    >>> sorted(g.nodes[i].name for i in find_folds(g).side)
    ['arange', 'unsqueeze']
    """
    item2loop, loops = _loops(graph)
    return Folds(_side_nodes(graph), loops, item2loop, _repeated_runs(graph), _leaf_layers(graph))


def _leaf_layers(graph: Graph) -> set[Scope]:
    """Module calls that call no other module and record only function nodes: a layer written
    with functions (transformers' ``Conv1D``: view, addmm, view) or an activation class
    (``NewGELUActivation``: 8 ops), which a picture may draw as one box, as it does ``nn.Linear``."""
    leaves: dict[Scope, bool] = {}
    for n in graph.nodes:
        for i, s in enumerate(n.scope):
            inner = i < len(n.scope) - 1 or n.kind != "function"
            leaves[s] = leaves.get(s, True) and not inner
    return {s for s, leaf in leaves.items() if leaf}


# -- side computations and dead ends ---------------------------------------------------------------
def _is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def _side_nodes(graph: Graph) -> dict[int, str]:
    node2srcs: dict[int, list[int]] = {n.id: [] for n in graph.nodes}
    node2dsts: dict[int, list[int]] = {n.id: [] for n in graph.nodes}
    for e in graph.edges:
        node2srcs[e.dst].append(e.src)
        node2dsts[e.src].append(e.dst)
    by_id = {n.id: n for n in graph.nodes}

    # An ONNX op the reading of the file found to be shape arithmetic (``Shape`` and what it feeds, or
    # an op whose results are read only as shapes) computes no value of the model's: the trace of the
    # same model has no node for it (a shape is a Python int there), so it is drawn as a side
    # computation, never on the data path.
    shapes = {n.id for n in graph.nodes if n.meta.get("data") is False or n.meta.get("shape_only")}

    def propagate(seeds: set[int]) -> set[int]:
        data = set(seeds)
        for n in graph.nodes:  # execution order is a topological order
            if n.kind == "function" and n.id not in shapes and any(s in data for s in node2srcs[n.id]):
                data.add(n.id)
        return data

    seeds = {n.id for n in graph.nodes if n.kind == "module"}
    seeds |= {n.id for n in graph.nodes if n.kind == "input" and any(_is_floating(r.dtype) for r in n.outputs)}
    data = propagate(seeds)
    # Integer inputs a layer reads as its main input (token ids) are data; masks are not. A layer
    # is a module call or, as in an ONNX graph, an op that looks up integers in a table (the
    # Gather of an embedding: a floating-point weight of two dimensions or more); its main input
    # is its first input that is not a weight. Layers are visited in execution order, each found
    # input made data before the next layer is looked at: in an ONNX graph with only integer
    # inputs nothing else is data at first, and the walk from a later layer would otherwise
    # reach the mask through the attention.
    producer = {r.obj_id: n.id for n in graph.nodes for r in n.outputs}
    seen: set[int] = set()
    for n in graph.nodes:
        main = next((r for r in n.inputs if r.param is None), None)
        lookup = n.kind == "function" and main is not None and not _is_floating(main.dtype) and main.dtype != "bool" \
            and any(r.param is not None and _is_floating(r.dtype) and len(r.shape) >= 2 for r in n.inputs)
        if n.kind != "module" and not lookup:
            continue
        stack = [producer[main.obj_id]] if main is not None and main.obj_id in producer else []
        found: set[int] = set()
        while stack:
            i = stack.pop()
            if i in seen or i in data:
                continue
            seen.add(i)
            if by_id[i].kind == "input" and not any(_is_floating(r.dtype) for r in by_id[i].outputs):
                found.add(i)
            elif by_id[i].kind == "function":
                stack.extend(node2srcs[i])
        if found:
            data = propagate(data | found)

    outputs = [n.id for n in graph.nodes if n.kind == "output"]
    live = set(outputs)
    stack = list(outputs)
    while stack:
        for s in node2srcs[stack.pop()]:
            if s not in live:
                live.add(s)
                stack.append(s)
    side: dict[int, str] = {}
    for n in graph.nodes:
        if n.kind != "function":
            continue
        if outputs and n.id not in live:
            side[n.id] = "dead end"
        elif n.id not in data:
            side[n.id] = "side"
    # An empty cache's plumbing: a concatenation onto a tensor made empty from nothing (the
    # first update of transformers' DynamicCache: ``torch.tensor([])`` then ``cat``) passes
    # its one real input through unchanged; it is drawn with the side computations.
    empty = {r.obj_id for n in graph.nodes if n.kind == "function" and not n.inputs and n.outputs
             and all(0 in r.shape for r in n.outputs) for r in n.outputs}
    for n in graph.nodes:
        if n.kind == "function" and n.target.rsplit(".", 1)[-1].lower() in ("cat", "concat", "concatenate") \
                and n.id in live and any(r.obj_id in empty for r in n.inputs):
            rest = [r for r in n.inputs if r.obj_id not in empty]
            if len(rest) == 1 and len(n.outputs) == 1 and tuple(rest[0].shape) == tuple(n.outputs[0].shape):
                side[n.id] = "empty cache"
    return side


def side_components(graph: Graph, candidates: set[int]) -> list[list[int]]:
    """The connected groups of ``candidates`` (node ids) along the graph's edges, in execution order."""
    parent = {i: i for i in candidates}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for e in graph.edges:
        if e.src in parent and e.dst in parent:
            a, b = root(e.src), root(e.dst)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for n in graph.nodes:
        if n.id in parent:
            groups.setdefault(root(n.id), []).append(n.id)
    return list(groups.values())


# -- loops ------------------------------------------------------------------------------------------
def _items(graph: Graph) -> dict[tuple[Scope, ...], list[Item]]:
    """Each module call's sequence of items (child calls and its own nodes), in execution order."""
    chain2items: dict[tuple[Scope, ...], list[Item]] = {}
    seen: set[Scope] = set()
    for n in graph.nodes:
        for i, s in enumerate(n.scope):
            if s not in seen:
                seen.add(s)
                chain2items.setdefault(n.scope[:i], []).append(s)
        chain2items.setdefault(n.scope, []).append(n.id)
    return chain2items


def _loops(graph: Graph) -> tuple[dict[Item, Loop], list[Loop]]:
    chain2items = _items(graph)
    by_id = {n.id: n for n in graph.nodes}
    interned: dict[Hashable, int] = {}
    memo: dict[Item, int] = {}

    def signature(item: Item, chain: tuple[Scope, ...]) -> int:
        """What an item calls, shapes left out; a module call keeps its path so that only calls
        of the same code on the same layers match (a per-step loop calls the same cell)."""
        if item in memo:
            return memo[item]
        key: Hashable
        if isinstance(item, int):
            n: Node = by_id[item]
            # the model's inputs and outputs are each drawn: never the body of a loop (a cache
            # returns two tensors per layer, which would otherwise fold as a run of outputs)
            key = ("io", n.id) if n.kind in ("input", "output") else ("n", n.kind, n.target, n.module_path if n.kind == "module" else "")
        else:
            inner = chain + (item,)
            key = ("s", item.module_path, item.class_name,
                   tuple(signature(c, inner) for c in chain2items.get(inner, [])))
        memo[item] = interned.setdefault(key, len(interned))
        return memo[item]

    item2loop: dict[Item, Loop] = {}
    loops: list[Loop] = []
    for chain, items in chain2items.items():
        seq = [signature(it, chain) for it in items]
        for start, period, count, end in _runs(seq, MAX_LOOP_BODY, tolerate=True):
            if end - start - period < MIN_LOOP_HIDDEN:
                continue
            if all(isinstance(it, int) and not by_id[it].inputs for it in items[start : start + period]):
                # a run of constants (an ONNX file's axes and shapes) is no loop: with the odd
                # iterations tolerated it would swallow the module calls between them (a RetinaNet's
                # backbone and head drawn as "a loop of Constant"); each is drawn with its reader
                continue
            loop = Loop(chain, items[start : start + period], count, items[start + period : end])
            loops.append(loop)
            for it in loop.hidden:
                item2loop[it] = loop
    return item2loop, loops


def _runs(seq: Sequence[Hashable], max_period: int, tolerate: bool = False) -> list[tuple[int, int, int, int]]:
    """Maximal runs ``(start, period, count, end)`` of a sub-sequence repeated ``count >=
    MIN_REPEATS`` times back to back, greedy from the left, preferring the run that covers the
    most. With ``tolerate``, two runs of the same body with at most ``MAX_ODD_ITERATIONS``
    bodies' length of other calls between them are one run: a loop whose iteration took another branch once
    (``0 - x`` as ``__rsub__``) stays one loop, the odd iteration counted in."""
    runs: list[tuple[int, int, int, int]] = []
    i, n = 0, len(seq)
    while i < n:
        best: tuple[int, int, int] | None = None  # (covered, period, count)
        for j in range(i + 1, min(n, i + max_period + 1)):
            p = j - i
            if i + MIN_REPEATS * p > n:
                break
            if seq[j] != seq[i]:
                continue
            body = seq[i:j]
            count = 1
            while seq[i + count * p : i + (count + 1) * p] == body:
                count += 1
            if count >= MIN_REPEATS and (best is None or count * p > best[0]):
                best = (count * p, p, count)
        if best is None:
            i += 1
            continue
        covered, p, count = best
        start, end = i, i + covered
        for k in range(len(runs) - 1, -1, -1) if tolerate else ():
            s0, p0, c0, e0 = runs[k]
            if i - e0 > MAX_ODD_ITERATIONS * p:
                break
            body, window = list(seq[s0 : s0 + p]), list(seq[i : i + p])
            # The odd iteration may have left this run out of phase: a rotation of the body.
            if p0 == p and any(body[k:] + body[:k] == window for k in range(p)):
                del runs[k:]  # the short runs inside the odd iteration go with it
                start, count = s0, c0 + count + max(1, round((i - e0) / p))
                break
        while tolerate and end < n and seq[end] == seq[end - p]:
            end += 1  # a last iteration cut short (or out of phase after an odd one)
        runs.append((start, p, count, end))
        i = end
    return runs


# -- repeated blocks ---------------------------------------------------------------------------------
def _block_signature(nodes: list[Node], depth_of_scope: int) -> tuple[object, ...]:
    """What a block computes, independent of its name: op targets, relative nesting and shapes."""
    return tuple(
        (n.kind, n.target, len(n.scope) - depth_of_scope, tuple(tuple(r.shape) for r in n.outputs))
        for n in nodes
    )


def _repeated_runs(graph: Graph) -> dict[Scope, tuple[Scope, int]]:
    """Blocks to fold into a repeat box: each maps to (the first block of its run, blocks after it).

    A run is consecutive sibling calls (same parent call) with equal signatures.
    """
    scope2nodes: dict[Scope, list[Node]] = {}
    scope2parent: dict[Scope, tuple[Scope, ...]] = {}
    for n in graph.nodes:
        for i, s in enumerate(n.scope):
            scope2nodes.setdefault(s, []).append(n)
            scope2parent.setdefault(s, n.scope[:i])
    siblings: dict[tuple[Scope, ...], list[Scope]] = {}
    for s, parent in scope2parent.items():
        siblings.setdefault(parent, []).append(s)
    folded: dict[Scope, tuple[Scope, int]] = {}
    for parent, scopes in siblings.items():
        sigs = [(s.class_name, _block_signature(scope2nodes[s], len(parent) + 1)) for s in scopes]
        for start, _, count, _ in _runs(sigs, 1):
            for s in scopes[start + 1 : start + count]:
                folded[s] = (scopes[start], count - 1)
    return folded
