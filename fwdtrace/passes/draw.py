"""Drawing a finished Graph: DOT text, PNG, SVG and PDF.

A pass over the graph (torch.fx's ``graph_drawer`` is the model): modules become nested
clusters, ``depth=k`` collapses everything below depth ``k`` into one box per module
call, and runs of identical blocks (the layers of a transformer) are drawn once with a
box standing for the rest. Rendering goes through pygraphviz, whose wheel bundles
Graphviz's layout engine, so no ``dot`` binary is needed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import graphviz

from .._files import write_bytes
from ..errors import FwdtraceError
from ..graph import Graph
from ..node import Node, Scope

__all__ = ["Digraph", "to_dot", "render", "render_digraph", "FORMATS"]

FORMATS = ("png", "svg", "pdf")

_FILL = {"input": "#e8e8e8", "output": "#e8e8e8", "module": "#d6e6f5", "function": "#f7efd2"}
_SHAPE = {"input": "box", "output": "box", "module": "box", "function": "ellipse"}
_HIGHLIGHT = {"color": "#c0392b", "fillcolor": "#f6c9c4", "penwidth": "2"}
_MIN_REPEATS = 3  # a run of this many identical blocks is drawn as the first one plus one box


class Digraph(graphviz.Digraph):
    """A ``graphviz.Digraph`` that lays itself out with pygraphviz: no Graphviz binary needed.

    It shows inline in Jupyter like any Digraph; ``pipe(format="png")`` returns the bytes.
    """

    def pipe(self, format: str | None = None, *args: Any, encoding: str | None = None, **kwargs: Any) -> Any:
        data = layout_bytes(self.source, format or self.format or "svg")
        return data.decode(encoding) if encoding else data


def layout_bytes(source: str, fmt: str) -> bytes:
    """Lay out DOT ``source`` with Graphviz's ``dot`` engine (bundled in pygraphviz) as ``fmt``."""
    try:
        import pygraphviz
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise FwdtraceError("rendering needs pygraphviz: pip install pygraphviz") from e
    agraph = pygraphviz.AGraph(string=source)
    agraph.layout(prog="dot")
    return bytes(agraph.draw(format=fmt))


def render_digraph(dot: graphviz.Digraph, path: str | os.PathLike[str]) -> str:
    """Write ``dot`` to ``path`` as PNG, SVG or PDF, chosen by the suffix; return the path.

    The file appears whole or not at all: it is written beside the target and moved in place.
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise FwdtraceError(f"render() expected a path ending in .png, .svg or .pdf, got {str(path)!r}")
    data = layout_bytes(dot.source, fmt)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise FwdtraceError(f"render() expected an existing folder for {str(path)!r}, but {str(directory)!r} is not one")
    write_bytes(path, data, caller="render()")
    return str(path)


def render(graph: Graph, path: str | os.PathLike[str], depth: int | None = None, **options: Any) -> str:
    """Draw ``graph`` into a PNG, SVG or PDF file, chosen by ``path``'s suffix.

    >>> import torch, fwdtrace, tempfile, os
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
    >>> path = g.render(os.path.join(tempfile.mkdtemp(), "graph.svg"))
    >>> open(path).read().count("<svg")
    1

    ``depth`` and ``options`` are those of :func:`to_dot`.
    """
    return render_digraph(to_dot(graph, depth=depth, **options), path)


# -- which box each node is drawn in ------------------------------------------------------------------
@dataclass
class _Unit:
    """One box in the picture: a node, a collapsed module call, or a run of repeated blocks."""

    key: str
    placement: tuple[Scope, ...]  # the clusters it sits in, outermost first
    kind: str
    label: str
    members: list[int] = field(default_factory=list)


def _scope_label(s: Scope) -> str:
    call = f" call {s.call_index + 1}" if s.call_index else ""
    cls = f" ({s.class_name})" if s.class_name else ""  # an ONNX scope may not know its class
    return f"{s.module_path}{cls}{call}"


def _shape_text(shape: Iterable[int]) -> str:
    return "×".join(str(d) if d >= 0 else "?" for d in shape) or "scalar"  # ONNX writes -1 for unknown


_ATTR_ORDER = ("kernel_size", "stride", "padding", "dilation", "groups", "num_heads", "p", "mode", "scale_factor")


def _attrs_text(node: Node) -> str:
    """A compact summary of a layer's hyperparameters: ``3→64 k3 s2 p1``."""
    a = node.attrs
    parts = []
    for cin, cout in (("in_channels", "out_channels"), ("in_features", "out_features"),
                      ("num_embeddings", "embedding_dim"), ("input_size", "hidden_size")):
        if cin in a and cout in a:
            parts.append(f"{a[cin]}→{a[cout]}")
    for name in _ATTR_ORDER:
        if name not in a:
            continue
        value = a[name]
        if isinstance(value, list) and len(set(value)) == 1:
            value = value[0]
        if (name in ("stride", "dilation", "groups") and value == 1) or (name == "padding" and value == 0):
            continue
        short = {"kernel_size": "k", "stride": "s", "padding": "p", "dilation": "d", "groups": "g"}.get(name)
        parts.append(f"{short}{value}" if short else f"{name}={value}")
    if "num_features" in a and not parts:  # norms: the channel count says the most
        parts.append(str(a["num_features"]))
    return " ".join(str(p) for p in parts)


def _node_label(node: Node, show_path: bool) -> str:
    if node.kind in ("input", "output"):
        shapes = ", ".join(_shape_text(r.shape) for r in (node.outputs or node.inputs))
        return f"{node.kind}: {node.name}\n{shapes}"
    if node.kind == "function":
        if node.target.startswith(("torch.", "onnx.")):
            return node.target.rsplit(".", 1)[-1].strip("_")
        return node.target  # a torch.library op (mylib.twice) or an ONNX custom domain's: with its namespace
    lines = [node.class_name]
    if show_path and node.module_path:
        last = node.module_path.rsplit(".", 1)[-1]  # the cluster around it shows the rest
        call = f" (call {node.call_index + 1})" if node.call_index else ""
        if last != node.class_name or call:
            lines.append(last + call)
    attrs = _attrs_text(node)
    if attrs:
        lines.append(attrs)
    return "\n".join(lines)


def _signature(nodes: list[Node], depth_of_scope: int) -> tuple[Any, ...]:
    """What a block computes, independent of its name: op targets, relative nesting and shapes."""
    return tuple(
        (n.kind, n.target, len(n.scope) - depth_of_scope, tuple(tuple(r.shape) for r in n.outputs))
        for n in nodes
    )


def _repeated_runs(graph: Graph) -> dict[Scope, tuple[Scope, int]]:
    """Scopes to fold into a repeat box: each maps to (the first block of its run, run length).

    A run is consecutive sibling calls (same parent scope) with equal signatures.
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
        sigs = [(s.class_name, _signature(scope2nodes[s], len(parent) + 1)) for s in scopes]
        i = 0
        while i < len(scopes):
            j = i + 1
            while j < len(scopes) and sigs[j] == sigs[i]:
                j += 1
            if j - i >= _MIN_REPEATS:
                for s in scopes[i + 1 : j]:
                    folded[s] = (scopes[i], j - i - 1)
            i = j
    return folded


def _units(graph: Graph, depth: int | None, collapse_repeats: bool, show_path: bool) -> tuple[dict[int, _Unit], list[_Unit]]:
    folded = _repeated_runs(graph) if collapse_repeats else {}
    node2unit: dict[int, _Unit] = {}
    units: dict[str, _Unit] = {}
    for n in graph.nodes:
        unit = None
        if depth is not None and depth <= 0 and n.kind in ("module", "function"):
            unit = units.get("model") or units.setdefault(
                "model", _Unit("model", (), "group", "model (collapsed)"))
        for i, s in enumerate(n.scope if unit is None else ()):
            if s in folded:
                first, count = folded[s]
                key = f"r:{first.module_path}:{first.call_index}"
                unit = units.get(key)
                if unit is None:
                    last = [t for t, (f, _) in folded.items() if f == first][-1]
                    label = f"{s.module_path} … {last.module_path}\n×{count} same as {first.module_path} ({first.class_name})"
                    unit = units[key] = _Unit(key, n.scope[:i], "repeat", label)
                break
            if depth is not None and i == depth - 1:
                key = f"g:{s.module_path}:{s.call_index}"
                unit = units.get(key) or units.setdefault(key, _Unit(key, n.scope[:i], "group", _scope_label(s)))
                break
        if unit is None:
            unit = units[f"n:{n.id}"] = _Unit(f"n:{n.id}", n.scope, n.kind, _node_label(n, show_path))
        unit.members.append(n.id)
        node2unit[n.id] = unit
    return node2unit, list(units.values())


def to_dot(
    graph: Graph,
    depth: int | None = None,
    *,
    collapse_repeats: bool = True,
    show_shapes: bool = True,
    show_path: bool = True,
    highlight: Iterable[int] = (),
    rankdir: str = "TB",
    title: str | None = None,
    name_prefix: str = "",
    cluster_name: str | None = None,
) -> Digraph:
    """A ``graphviz.Digraph`` of ``graph``: modules as nested clusters, edges labelled with shapes.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.nn.Linear(4, 2))
    >>> g = fwdtrace.trace(model, torch.ones(1, 4))
    >>> dot = g.to_dot(depth=1)
    >>> "0 (Sequential)" in dot.source and "ReLU" not in dot.source
    True

    ``depth=k`` collapses every module call nested deeper than ``k`` levels into one box,
    re-routing edges to it. ``collapse_repeats`` draws a run of three or more identical
    sibling blocks as the first block and one box for the rest. ``highlight`` is a set of
    node ids drawn in red. ``name_prefix`` keeps DOT names apart when two graphs share a
    picture; ``cluster_name`` (starting with ``cluster``) makes the result embeddable with
    ``outer.subgraph(...)``, boxed and titled ``title``.
    """
    if depth is not None and (not isinstance(depth, int) or depth < 0):
        raise FwdtraceError(f"to_dot() expected depth as None or an integer >= 0, got {depth!r}")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise FwdtraceError(f"to_dot() expected rankdir in TB, LR, BT, RL, got {rankdir!r}")
    highlighted = set(highlight)
    node2unit, units = _units(graph, depth, collapse_repeats, show_path)
    names = {u.key: f"{name_prefix}u{i}" for i, u in enumerate(units)}

    dot = Digraph(name=cluster_name or "fwdtrace", format="svg")
    dot.attr(rankdir=rankdir, fontname="Helvetica", fontsize="11", nodesep="0.25", ranksep="0.35")
    if title:
        dot.attr(label=title, labelloc="t", fontsize="14")
    if cluster_name:
        dot.attr(style="rounded", color="#888888")
    dot.attr("node", fontname="Helvetica", fontsize="10", style="filled", margin="0.08,0.04", height="0.3")
    dot.attr("edge", fontname="Helvetica", fontsize="8", color="#555555", arrowsize="0.6")

    # Clusters: a tree keyed by the placement chain; units go into their innermost cluster.
    children: dict[tuple[Scope, ...], list[tuple[Scope, ...]]] = {}
    members: dict[tuple[Scope, ...], list[_Unit]] = {}
    for u in units:
        members.setdefault(u.placement, []).append(u)
        for i in range(len(u.placement)):
            parent, child = u.placement[:i], u.placement[: i + 1]
            if child not in children.setdefault(parent, []):
                children[parent].append(child)

    def emit_units(target: graphviz.Digraph, chain: tuple[Scope, ...]) -> None:
        for u in members.get(chain, []):
            attrs = {"shape": _SHAPE.get(u.kind, "box3d"), "fillcolor": _FILL.get(u.kind, "#e4e4e4")}
            if u.kind in ("input", "output"):
                attrs["style"] = "filled,rounded"
            if highlighted.intersection(u.members):
                attrs.update(_HIGHLIGHT)
            target.node(names[u.key], label=u.label, **attrs)
        for child in children.get(chain, []):
            with target.subgraph(name=f"cluster_{name_prefix}{len(child)}_{_cluster_id(child)}") as sub:
                sub.attr(label=_scope_label(child[-1]), style="rounded,dashed", color="#999999",
                         fontsize="9", labeljust="l")
                emit_units(sub, child)

    emit_units(dot, ())

    drawn: set[tuple[str, str, int]] = set()
    for e in graph.edges:
        u, v = node2unit[e.src], node2unit[e.dst]
        if u is v or (u.key, v.key, e.obj_id) in drawn:
            continue
        drawn.add((u.key, v.key, e.obj_id))
        label = ""
        if show_shapes:
            label = _shape_text(e.shape) + ("" if e.dtype == "float32" else f" {e.dtype}")
        dot.edge(names[u.key], names[v.key], label=label)
    return dot


def _cluster_id(chain: tuple[Scope, ...]) -> str:
    s = chain[-1]
    return f"{s.module_path.replace('.', '_').replace('<', '').replace('>', '').replace('@', '_')}_{s.call_index}"
