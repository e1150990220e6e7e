"""The Graph: nodes in execution order and the tensors that flow between them.

The Graph knows nothing of Graphviz, ONNX or HDF5: drawing and comparing are
passes over a finished graph (``fwdtrace/passes``), as in torch.fx.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import FwdtraceError
from .names import UniqueNames
from .node import NODE_KINDS, Edge, Node, Scope, TensorRef, new_tuple

if TYPE_CHECKING:
    import networkx

    from .passes.draw import Digraph
    from .passes.model_explorer import ModelExplorerFiles

JSON_FORMAT_VERSION = 1


class Graph:
    """What a model ran: :class:`Node` s in execution order and :class:`Edge` s between them.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    >>> g = fwdtrace.trace(model, torch.ones(2, 4))
    >>> [n.name for n in g.nodes]
    ['input', '0', '1', 'output']
    >>> [(e.src, e.dst, e.shape) for e in g.edges]
    [(0, 1, (2, 4)), (1, 2, (2, 3)), (2, 3, (2, 3))]

    An edge goes from the node that last wrote a tensor to each node that reads it,
    so in-place ops chain correctly.
    """

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []
        self._names = UniqueNames()
        self._producer: dict[int, int] = {}  # obj_id -> id of the node that last wrote it

    # -- building ---------------------------------------------------------------------------------
    def add_node(
        self,
        kind: str,
        target: str,
        *,
        name: str | None = None,
        module_path: str = "",
        call_index: int = 0,
        inputs: Sequence[TensorRef] = (),
        outputs: Sequence[TensorRef] = (),
        attrs: dict[str, Any] | None = None,
        scope: tuple[Scope, ...] = (),
        meta: dict[str, Any] | None = None,
    ) -> Node:
        """Append a node, connect its inputs to their producers and make its name unique."""
        if kind not in NODE_KINDS:
            raise FwdtraceError(f"Graph.add_node expected kind in {NODE_KINDS}, got {kind!r}")
        return self._append(
            kind, target, name or target.rsplit(".", 1)[-1], module_path, call_index,
            list(inputs), list(outputs), dict(attrs or {}), scope, dict(meta or {}),
        )

    def _append(
        self,
        kind: str,
        target: str,
        name: str,
        module_path: str,
        call_index: int,
        inputs: list[TensorRef],
        outputs: list[TensorRef],
        attrs: dict[str, Any],
        scope: tuple[Scope, ...],
        meta: dict[str, Any] | None = None,
    ) -> Node:
        """:meth:`add_node` for the tracer's hot path: checked arguments, fresh lists, no copies."""
        nodes = self.nodes
        node_id = len(nodes)
        node = Node(node_id, kind, target, self._unique_name(name), module_path, call_index,
                    inputs, outputs, attrs, scope, {} if meta is None else meta)
        nodes.append(node)
        producer = self._producer
        if inputs:
            edges, seen = self.edges, None
            for ref in inputs:
                oid = ref.obj_id
                src = producer.get(oid)
                if src is None:
                    continue
                if seen is None:
                    seen = {oid}
                elif oid in seen:
                    continue
                else:
                    seen.add(oid)
                edges.append(new_tuple(Edge, (src, node_id, oid, ref.shape, ref.dtype)))
        for ref in outputs:
            producer[ref.obj_id] = node_id
        return node

    def _unique_name(self, base: str) -> str:
        if not base:
            base = "node"
        elif "." in base:
            base = base.replace(".", "_")
        return self._names.take(base)

    # -- reading ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return self.nodes == other.nodes and self.edges == other.edges

    __hash__ = None  # type: ignore[assignment]

    def find(self, *, kind: str | None = None, target: str | None = None, module_path: str | None = None) -> list[Node]:
        """The nodes that match every given field, in execution order."""
        return [
            n
            for n in self.nodes
            if (kind is None or n.kind == kind)
            and (target is None or n.target == target)
            and (module_path is None or n.module_path == module_path)
        ]

    @property
    def input_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "input"]

    @property
    def output_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "output"]

    def in_edges(self, node_id: int) -> list[Edge]:
        return [e for e in self.edges if e.dst == node_id]

    def out_edges(self, node_id: int) -> list[Edge]:
        return [e for e in self.edges if e.src == node_id]

    def __repr__(self) -> str:
        kinds = {k: sum(1 for n in self.nodes if n.kind == k) for k in NODE_KINDS}
        return f"Graph({len(self.nodes)} nodes: " + ", ".join(f"{v} {k}" for k, v in kinds.items()) + f"; {len(self.edges)} edges)"

    def __str__(self) -> str:
        """A table of the nodes, one a line, in execution order."""
        rows = [("id", "kind", "name", "target", "module_path", "inputs -> outputs")]
        for n in self.nodes:
            ins = ", ".join(f"%{r.obj_id}" if r.param is None else r.param for r in n.inputs)
            outs = ", ".join(f"%{r.obj_id}{list(r.shape)}" for r in n.outputs)
            rows.append((str(n.id), n.kind, n.name, n.target, n.module_path, f"({ins}) -> ({outs})"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1] for r in rows
        )

    # -- export -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "fwdtrace.Graph",
            "version": JSON_FORMAT_VERSION,
            "nodes": [n.to_dict() for n in self.nodes],
            "edges": [e.to_dict() for e in self.edges],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> Graph:
        """The graph :meth:`to_dict` gave; ``source`` (a file's name) is named in the error when ``data`` is not one.

        A graph read from a file is untrusted: what it holds is checked before it is kept, nothing
        is allocated beyond what it stores, and its edges must run forward, from a call to a later
        one, as a trace's do (the passes read the graph in that order; an edge back would be a loop).
        """
        in_source = f" in {source!r}" if source is not None else ""
        if not isinstance(data, dict) or data.get("format") != "fwdtrace.Graph":
            raise FwdtraceError(
                f"Graph.from_dict expected a dict with format 'fwdtrace.Graph'{in_source}, got {type(data).__name__}"
                + (f" with format {data.get('format')!r}" if isinstance(data, dict) else "")
            )
        graph = cls()
        where = "its body"
        try:
            nodes, edges = data["nodes"], data["edges"]
            if not isinstance(nodes, list) or not isinstance(edges, list):
                raise TypeError(f"nodes and edges should be lists, got {type(nodes).__name__} and {type(edges).__name__}")
            for i, nd in enumerate(nodes):
                where = f"node {i}"
                node = Node.from_dict(nd)
                if node.kind not in NODE_KINDS:
                    raise ValueError(f"kind {node.kind!r} is not one of {', '.join(NODE_KINDS)}")
                if node.id != i:
                    raise ValueError(f"id {node.id} where the node's position is {i}")
                graph.nodes.append(node)
                graph._names.taken.add(node.name)
                for ref in node.outputs:
                    graph._producer[ref.obj_id] = node.id
            for i, e in enumerate(edges):
                where = f"edge {i}"
                edge = Edge.from_dict(e)
                if not (0 <= edge.src < len(nodes) and 0 <= edge.dst < len(nodes)):
                    raise ValueError(f"it joins node {edge.src} to node {edge.dst}, of {len(nodes)} nodes")
                if edge.src >= edge.dst:
                    raise ValueError(f"it runs from node {edge.src} back to node {edge.dst}: a trace's edges run "
                                     "from a call to a later one (a loop otherwise)")
                graph.edges.append(edge)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise FwdtraceError(f"Graph.from_dict expected a graph written by Graph.to_json{in_source}, got one whose "
                                f"{where} has {what}") from None
        return graph

    def to_json(self, indent: int | None = 1) -> str:
        """The graph as JSON text; the same model and input give the same text, byte for byte."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True, default=_json_default)

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> Graph:
        """The graph that :meth:`to_json` wrote: ``Graph.from_json(g.to_json()) == g``.

        ``source`` names where the text came from (a file) in the error when it is not such a
        graph; see :meth:`from_dict` for what is checked.
        """
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # also: integers over 4300 digits, nesting too deep
            in_source = f" in {source!r}" if source is not None else ""
            raise FwdtraceError(f"Graph.from_json expected JSON text written by Graph.to_json{in_source}: "
                                f"{type(e).__name__}: {e}") from None
        return cls.from_dict(data, source)

    def to_networkx(self) -> networkx.MultiDiGraph:
        """A ``networkx.MultiDiGraph`` keyed by node id, with the node and edge fields as attributes."""
        import networkx as nx

        g: networkx.MultiDiGraph = nx.MultiDiGraph()
        for n in self.nodes:
            g.add_node(
                n.id,
                kind=n.kind,
                target=n.target,
                name=n.name,
                module_path=n.module_path,
                call_index=n.call_index,
                inputs=[r.to_dict() for r in n.inputs],
                outputs=[r.to_dict() for r in n.outputs],
                attrs=dict(n.attrs),
            )
        for e in self.edges:
            g.add_edge(e.src, e.dst, key=e.obj_id, obj_id=e.obj_id, shape=e.shape, dtype=e.dtype)
        return g

    # -- drawing (a pass; imported lazily) --------------------------------------------------------
    # The draw pass's options are spelled out here (tests/test_docs.py checks they match
    # fwdtrace.passes.draw.to_dot's, defaults included) so that IDEs and the reference show them.
    def to_dot(
        self,
        depth: int | str | None = "auto",
        *,
        target_nodes: int = 250,
        fold_side: bool = True,
        fold_loops: bool = True,
        collapse_repeats: bool = True,
        open_leaf_layers: bool = False,
        wrap: int = 12,
        show_shapes: bool = True,
        show_path: bool = True,
        highlight: Iterable[int] = (),
        rankdir: str = "TB",
        title: str | None = None,
        name_prefix: str = "",
        cluster_name: str | None = None,
        fills: Mapping[int, str] | None = None,
        notes: Mapping[int, str] | None = None,
        legend: Sequence[tuple[str, str]] = (),
    ) -> Digraph:
        """A ``graphviz.Digraph`` of this graph (shown inline in Jupyter); the options are
        :meth:`render`'s, plus those for embedding the picture in another one.

        Args:
            depth: as for :meth:`render`.
            target_nodes: as for :meth:`render`.
            fold_side: as for :meth:`render`.
            fold_loops: as for :meth:`render`.
            collapse_repeats: as for :meth:`render`.
            open_leaf_layers: as for :meth:`render`.
            wrap: as for :meth:`render`.
            show_shapes: as for :meth:`render`.
            show_path: as for :meth:`render`.
            highlight: as for :meth:`render`.
            rankdir: as for :meth:`render`.
            title: as for :meth:`render`.
            name_prefix: a prefix for every DOT name, which keeps two graphs apart in one picture.
            cluster_name: a name starting with ``cluster`` makes the result embeddable with
                ``outer.subgraph(...)``, boxed and titled ``title``.
            fills: a fill colour per node id (a box holding several takes the first listed).
            notes: a line per node id, added to its box's tooltip.
            legend: what the fills mean, a box per ``(colour, text)`` in a corner of the picture.
            legend: what the fills mean, a box per ``(colour, text)`` in a corner of the picture.
        """
        from .passes.draw import to_dot

        return to_dot(self, depth=depth, target_nodes=target_nodes, fold_side=fold_side, fold_loops=fold_loops,
                      collapse_repeats=collapse_repeats, open_leaf_layers=open_leaf_layers, wrap=wrap,
                      show_shapes=show_shapes, show_path=show_path, highlight=highlight, rankdir=rankdir,
                      title=title, name_prefix=name_prefix, cluster_name=cluster_name, fills=fills, notes=notes, legend=legend)

    def render(
        self,
        path: str | os.PathLike[str],
        depth: int | str | None = "auto",
        *,
        target_nodes: int = 250,
        fold_side: bool = True,
        fold_loops: bool = True,
        collapse_repeats: bool = True,
        open_leaf_layers: bool = False,
        wrap: int = 12,
        show_shapes: bool = True,
        show_path: bool = True,
        highlight: Iterable[int] = (),
        rankdir: str = "TB",
        title: str | None = None,
        name_prefix: str = "",
        cluster_name: str | None = None,
        fills: Mapping[int, str] | None = None,
        notes: Mapping[int, str] | None = None,
        legend: Sequence[tuple[str, str]] = (),
        **unknown: Any,
    ) -> str:
        """Draw the graph into a PNG, SVG or PDF file, chosen by ``path``'s suffix; return the path.

        With no option the picture is chosen for the model: the deepest depth that stays
        readable, side computations and loops folded, every node in exactly one box (an SVG
        box's tooltip lists what it holds). The file appears whole or not at all.

        Args:
            path: where to write; its suffix (``.png``, ``.svg``, ``.pdf``) picks the format, and its
                folder must exist.
            depth: ``"auto"`` (the default) picks the deepest depth whose picture has at most
                ``target_nodes`` boxes and fits a PNG of at most 4096 x 16384 px with legible
                labels, and says which in the caption; an integer ``k`` collapses every module call
                nested deeper than ``k`` levels into one box; ``None`` draws every level.
            target_nodes: the most boxes ``depth="auto"`` aims for. Below 30 it is honoured as
                asked; otherwise the automatic depth never goes below the first depth with 30 boxes.
            fold_side: draw each connected group of side computations (mask and position
                arithmetic, constants, results nothing reads) as one dashed box naming what it feeds.
            fold_loops: draw a loop (the same calls repeated three times or more in one module call)
                as its first iteration and one box for the rest.
            collapse_repeats: draw a run of three or more identical sibling blocks (a
                transformer's layers) as the first and one box for the rest.
            open_leaf_layers: draw the function calls inside a leaf layer (a module call that calls
                no other module, such as transformers' ``Conv1D``) instead of one box.
            wrap: break a rank of more boxes than this into rows.
            show_shapes: label edges with tensor shapes.
            show_path: put each layer's module path in its box.
            highlight: node ids drawn in red.
            rankdir: Graphviz's direction: ``"TB"``, ``"LR"``, ``"BT"`` or ``"RL"``.
            title: a title for the picture.
            name_prefix: a prefix for every DOT name (two graphs in one picture).
            cluster_name: see :meth:`to_dot`.
            fills: a fill colour per node id, drawn as given.
            notes: a line per node id, added to its box's tooltip.
            legend: what the fills mean, a box per ``(colour, text)`` in a corner of the picture.
            legend: what the fills mean, a box per ``(colour, text)`` in a corner of the picture.
            **unknown: none is taken: a misspelt option is answered with a ``FwdtraceError``
                that lists the options.

        >>> import torch, fwdtrace, tempfile, os
        >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
        >>> path = g.render(os.path.join(tempfile.mkdtemp(), "graph.svg"), depth=None, fold_side=False)
        >>> open(path).read().count("<svg")
        1
        """
        from .passes.draw import render

        return render(self, path, depth=depth, target_nodes=target_nodes, fold_side=fold_side,
                      fold_loops=fold_loops, collapse_repeats=collapse_repeats, open_leaf_layers=open_leaf_layers,
                      wrap=wrap, show_shapes=show_shapes, show_path=show_path, highlight=highlight, rankdir=rankdir,
                      title=title, name_prefix=name_prefix, cluster_name=cluster_name, fills=fills, notes=notes, legend=legend,
                      **unknown)

    # -- Model Explorer (a pass; imported lazily) ------------------------------------------------
    def to_model_explorer(self, path: str | os.PathLike[str], *, node_data: Any = None) -> ModelExplorerFiles:
        """Model Explorer's graph JSON at ``path`` and its node-data files beside it; see
        :func:`fwdtrace.passes.model_explorer.to_model_explorer`."""
        from .passes.model_explorer import to_model_explorer

        return to_model_explorer(self, path, node_data=node_data)

    def _repr_svg_(self) -> str:
        from .passes.draw import dot_bytes

        # Where Graphviz cannot lay out, fwdtrace's own layout, with a warning naming what to install.
        return dot_bytes(self.to_dot(), "svg", caller="the notebook's display of a Graph").decode()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    return str(obj)

