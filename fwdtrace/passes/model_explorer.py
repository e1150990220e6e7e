"""Google's Model Explorer: a finished Graph as its graph JSON, per-node numbers as its node data.

A pass over the graph, like ``draw.py``. Model Explorer (``pip install ai-edge-model-explorer``)
draws big graphs with WebGL and lays out a node's ``namespace`` (``a/b/c``) as nested layers
that expand and collapse; its PyTorch adapter only reads a ``torch.export.ExportedProgram``,
which many eager models do not export to. Here every traced call is one Model Explorer node
(its id is the node's id in the Graph), its namespace the module calls around it, so layers
expand and collapse as modules; tensors flow on incoming edges, their shapes and dtypes in the
nodes' output metadata (``tensor_shape``, the key Model Explorer's own adapter uses and shows
on edges).

The files are plain JSON in Model Explorer's formats (the dataclasses of its
``model_explorer.graph_builder`` and ``model_explorer.node_data_builder``), written without
the package: only :func:`view` needs it installed.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .._files import write_bytes, write_files
from ..errors import FwdtraceError, describe
from ..graph import Graph
from ..node import Node, Scope

if TYPE_CHECKING:
    from ..analysis import Analysis
    from ..onnx.compare import TopologyReport
    from ..onnx.numeric import NumericResult

__all__ = [
    "ModelExplorerFiles", "ModelExplorerPair", "graph_collection", "node_data_results", "to_model_explorer",
    "onnx_pair_to_model_explorer", "errors_to_model_explorer", "CallErrors", "VERDICTS", "view", "INSTALL_HINT",
]

INSTALL_HINT = "pip install ai-edge-model-explorer (or pip install 'fwdtrace[model-explorer]')"
# Low values pale, high values red: a hot spot stands out in a big graph.
_GRADIENT = [{"stop": 0, "bgColor": "#fff5eb"}, {"stop": 1, "bgColor": "#d7301f"}]
_HIGHLIGHT_STYLE = {"backgroundColor": "#f6c9c4", "borderColor": "#c0392b", "hoveredBorderColor": "#c0392b"}

NodeValues = Mapping[Any, float]
NodeData = Mapping[str, NodeValues]


class ModelExplorerFiles(NamedTuple):
    """What :func:`to_model_explorer` wrote: the graph file and one node-data file per name."""

    graph: str
    node_data: dict[str, str]


class ModelExplorerPair(NamedTuple):
    """What :func:`onnx_pair_to_model_explorer` wrote: both graphs, their node mapping and, for a numeric check,
    the trace's node-data files (its calls' errors) by name."""

    trace: str
    onnx: str
    mapping: str
    node_data: dict[str, str] = {}  # noqa: RUF012 - a NamedTuple field's default, never mutated


# -- the graph ------------------------------------------------------------------------------------
def namespace(scope: tuple[Scope, ...]) -> str:
    """The Model Explorer namespace of a node inside ``scope``: one layer per module call.

    >>> namespace((Scope("encoder", "Encoder"), Scope("encoder.layer.0", "Layer"), Scope("encoder.layer.0.attn", "Attn", 1)))
    'encoder/layer.0/attn#1'

    Each layer is named by its path below the enclosing call's (``layer.0`` inside
    ``encoder``), so joining them with ``.`` gives the module path back; a module's second
    call is ``#1``, as the ONNX report writes it, so two calls are two layers.
    """
    parts: list[str] = []
    parent = ""
    for s in scope:
        rel = s.module_path[len(parent) + 1:] if parent and s.module_path.startswith(parent + ".") else s.module_path
        # "/" separates layers in Model Explorer: a path made of it would nest wrongly.
        rel = rel.replace("/", "_") or "<root>"
        parts.append(f"{rel}#{s.call_index}" if s.call_index else rel)
        parent = s.module_path
    return "/".join(parts)


def _label(n: Node) -> str:
    if n.kind in ("input", "output"):
        return n.name
    return n.class_name


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _tensor_attrs(ref: Any) -> list[dict[str, str]]:
    attrs = [{"key": "tensor_shape", "value": f"{ref.dtype}{list(ref.shape)}"}]
    if ref.param is not None:
        attrs.append({"key": "param", "value": ref.param})
    return attrs


def graph_collection(
    graph: Graph, *, graph_id: str = "fwdtrace", label: str | None = None, highlight: Iterable[int] = ()
) -> dict[str, Any]:
    """``graph`` as Model Explorer's ``GraphCollection`` (a dict ready for ``json.dumps``).

    >>> import torch, fwdtrace
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
    >>> [(n["id"], n["label"], n["namespace"]) for n in graph_collection(g)["graphs"][0]["nodes"]]
    [('0', 'input', ''), ('1', 'Linear', ''), ('2', 'output', '')]

    ``highlight`` names node ids to draw in red (the ONNX pair's missing and extra calls).
    """
    marked = set(highlight)
    groups: dict[str, dict[str, str]] = {}
    nodes: list[dict[str, Any]] = []
    for n in graph.nodes:
        for depth in range(1, len(n.scope) + 1):
            ns = namespace(n.scope[:depth])
            if ns not in groups:
                s = n.scope[depth - 1]
                groups[ns] = {"module_path": s.module_path, "class": s.class_name, "call_index": str(s.call_index)}
        attrs = [{"key": "kind", "value": n.kind}, {"key": "name", "value": n.name}, {"key": "target", "value": n.target}]
        if n.kind in ("module", "function"):
            attrs += [{"key": "module_path", "value": n.module_path}, {"key": "module_key", "value": n.module_key},
                      {"key": "call_index", "value": str(n.call_index)}]
        attrs += [{"key": k, "value": _text(v)} for k, v in sorted(n.attrs.items())]
        position = {(r.obj_id): i for i, r in enumerate(n.inputs)}
        edges = []
        for e in graph.in_edges(n.id):
            src = graph.nodes[e.src]
            out_index = next((i for i, r in enumerate(src.outputs) if r.obj_id == e.obj_id), 0)
            edges.append({"sourceNodeId": str(e.src), "sourceNodeOutputId": str(out_index),
                          "targetNodeInputId": str(position.get(e.obj_id, 0))})
        node: dict[str, Any] = {
            "id": str(n.id),
            "label": _label(n),
            "namespace": namespace(n.scope),
            "subgraphIds": [],
            "attrs": attrs,
            "incomingEdges": edges,
            "outputsMetadata": [{"id": str(i), "attrs": _tensor_attrs(r)} for i, r in enumerate(n.outputs)],
            "inputsMetadata": [{"id": str(i), "attrs": _tensor_attrs(r)} for i, r in enumerate(n.inputs)],
        }
        if n.id in marked:
            node["style"] = dict(_HIGHLIGHT_STYLE)
        nodes.append(node)
    out: dict[str, Any] = {"id": graph_id, "nodes": nodes}
    if groups:
        out["groupNodeAttributes"] = groups
    return {"label": label or graph_id, "graphs": [out], "graphSorting": "node_count_desc"}


# -- node data ------------------------------------------------------------------------------------
def _resolver(graph: Graph) -> Any:
    by_name = {n.name: [n.id] for n in graph.nodes}
    by_key: dict[str, list[int]] = {}
    for n in graph.nodes:
        if n.kind in ("module", "function"):
            by_key.setdefault(n.module_key, []).append(n.id)

    def resolve(key: Any, caller: str) -> list[int]:
        if isinstance(key, int) and not isinstance(key, bool):
            if 0 <= key < len(graph.nodes):
                return [key]
            raise FwdtraceError(f"{caller} expected a node id from 0 to {len(graph.nodes) - 1}, got {key}")
        if isinstance(key, str):
            ids = by_name.get(key) or by_key.get(key)
            if ids:
                return ids
            close = difflib.get_close_matches(key, [*by_key, *by_name], n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise FwdtraceError(f"{caller} expected a node name or module key of the graph, got {key!r}{hint}")
        raise FwdtraceError(f"{caller} expected node data keyed by node id (int), node name or module key (str), got {describe(key)}")

    return resolve


def node_data_results(graph: Graph, values: NodeValues, caller: str = "node_data_results()") -> dict[str, float]:
    """Model Explorer results (node id -> number) from numbers keyed by node id, node name or module key.

    >>> import torch, fwdtrace
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()), torch.ones(1, 4))
    >>> node_data_results(g, {"1.ReLU": 0.5, 1: 2})
    {'1': 2.0, '2': 0.5}

    A module key names every call of the module: each gets the number.
    """
    resolve = _resolver(graph)
    out: dict[int, float] = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FwdtraceError(f"{caller} expected a number for {key!r}, got {describe(value)}")
        if not math.isfinite(value):
            raise FwdtraceError(f"{caller} expected finite numbers (JSON has no NaN or inf), got {value} for {key!r}")
        for node_id in resolve(key, caller):
            out[node_id] = float(value)
    return {str(i): out[i] for i in sorted(out)}


def analysis_node_data(graph: Graph, analysis: Analysis) -> dict[str, dict[Any, float]]:
    """:func:`fwdtrace.analyze`'s numbers per traced call: FLOPs and latency per call, peak memory.

    A row's FLOPs (its ``flops_total``: a leaf call's children are part of it) and time are
    per model run over all its calls, so each call gets the mean; its peak memory is a peak,
    so each call gets it whole. Calls without a row of their own (torch functions inside a
    module: their FLOPs are that module's own) get no number; latency is left out when the
    analysis did not time (``repeats=0``, the meta device).
    """
    keys = {n.module_key for n in graph.nodes if n.kind in ("module", "function")}
    rows = [r for r in analysis.rows if r.key in keys and r.calls]
    data: dict[str, dict[Any, float]] = {
        "flops": {r.key: r.flops_total / r.calls for r in rows},
        "peak_memory_bytes": {r.key: r.peak_memory_bytes for r in rows},
    }
    latency = {r.key: r.latency_ms / r.calls for r in rows if r.latency_ms is not None}
    if latency:
        data["latency_ms"] = latency
    return data


def _node_data_file(graph_id: str, name: str, results: dict[str, float],
                    colors: Mapping[str, str] | None = None) -> dict[str, Any]:
    # ModelNodeData: GraphNodeData per graph id; a result's own bgColor takes precedence over the gradient.
    return {graph_id: {"name": name, "results": {k: {"value": v, **({"bgColor": colors[k]} if colors and k in colors else {})}
                                                 for k, v in results.items()},
                       "gradient": [dict(g) for g in _GRADIENT]}}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "data"


def _dump(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


def to_model_explorer(
    graph: Graph, path: str | os.PathLike[str], *, node_data: NodeData | Analysis | None = None,
    graph_id: str = "fwdtrace", label: str | None = None, highlight: Iterable[int] = (),
) -> ModelExplorerFiles:
    """Write ``graph`` as Model Explorer graph JSON at ``path``, and per-node numbers beside it.

    >>> import torch, fwdtrace, tempfile, os, json
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()), torch.ones(1, 4))
    >>> d = tempfile.mkdtemp()
    >>> files = to_model_explorer(g, os.path.join(d, "g.json"), node_data={"error": {"0.Linear": 1e-6}})
    >>> os.path.basename(files.node_data["error"]), json.load(open(files.node_data["error"]))["fwdtrace"]["results"]
    ('g.error.json', {'1': {'value': 1e-06}})

    ``node_data`` is an :class:`~fwdtrace.Analysis` (FLOPs, latency and peak memory per call,
    see :func:`analysis_node_data`) or a mapping name -> {node id, node name or module
    key: number}: running statistics (``{k: s.mean for k, s in stats.stats.items()}``), a
    numeric check's error per call. Each name becomes Model Explorer's node-data file
    ``{stem}.{name}.json`` beside ``path``, to load in its "node data" panel (:func:`view`
    loads them). The graph is checked entirely before any file is written.
    """
    target = Path(path)
    if target.suffix != ".json":
        raise FwdtraceError(f"to_model_explorer() expected a path ending in .json, got {str(path)!r}")
    if not isinstance(graph, Graph):
        raise FwdtraceError(f"to_model_explorer() expected a fwdtrace.Graph, got {describe(graph)}")
    from ..analysis import Analysis

    if isinstance(node_data, Analysis):
        node_data = analysis_node_data(graph, node_data)
    elif node_data is not None and not isinstance(node_data, Mapping):
        raise FwdtraceError(
            f"to_model_explorer() expected node_data as an Analysis or a mapping name -> {{node: number}}, "
            f"got {describe(node_data)}"
        )
    return _write(graph, target, node_data or {}, {}, graph_id, label, highlight, "to_model_explorer()")


def _write(graph: Graph, target: Path, node_data: NodeData, colors: Mapping[str, Mapping[int, str]], graph_id: str,
           label: str | None, highlight: Iterable[int], caller: str) -> ModelExplorerFiles:
    """The graph file and one node-data file per name (``colors``: per name, a node's own colour by node id)."""
    files: dict[str, tuple[Path, bytes]] = {}
    for name, values in node_data.items():
        if not isinstance(values, Mapping):
            raise FwdtraceError(f"{caller} expected node_data[{name!r}] as a mapping node -> number, "
                                f"got {describe(values)}")
        results = node_data_results(graph, values, caller)
        own = colors.get(name)
        node_colors = None if own is None else {str(n): c for n, c in own.items()}
        files[str(name)] = (target.with_name(f"{target.stem}.{_slug(str(name))}.json"),
                            _dump(_node_data_file(graph_id, str(name), results, node_colors)))
    # The graph and its node data together: an error leaves every file as it was, never a new graph beside old data.
    write_files({target: _dump(graph_collection(graph, graph_id=graph_id, label=label, highlight=highlight)),
                 **dict(files.values())}, caller)
    return ModelExplorerFiles(str(target), {name: str(file) for name, (file, _) in files.items()})


# -- the ONNX pair --------------------------------------------------------------------------------
def onnx_pair_to_model_explorer(report: TopologyReport, folder: str | os.PathLike[str], *,
                                caller: str = "onnx_pair_to_model_explorer()") -> ModelExplorerPair:
    """The ONNX cross-check as a Model Explorer pair: ``trace.json``, ``onnx.json`` and ``mapping.json``
    in ``folder``, made if its parent exists.

    >>> import torch, fwdtrace, tempfile, json
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    >>> report = fwdtrace.check_onnx(model, torch.ones(1, 4), exporter="torchscript")
    >>> pair = onnx_pair_to_model_explorer(report, tempfile.mkdtemp())
    >>> json.load(open(pair.mapping))["mappingEntries"]
    [{'leftNodeIds': ['1'], 'rightNodeIds': ['1']}, {'leftNodeIds': ['2'], 'rightNodeIds': ['2']}]

    The mapping is the report's ``matched`` pairs (Model Explorer's node mapping format, to
    load in its split view's "sync navigation"), so selecting a call on one side selects what
    it became on the other. Missing calls and extra ONNX nodes are drawn in red. A numeric
    check (``numeric=True``) also writes each traced call's errors against onnxruntime's values
    as the trace's node data (``trace.max_rel.json``, ``trace.verdict.json``, ...: see
    :func:`errors_to_model_explorer`), its first divergence drawn in red.
    """
    trace, og = getattr(report, "trace", None), getattr(report, "onnx_graph", None)
    if trace is None or og is None:
        raise FwdtraceError(
            f"{caller} expected a report from fwdtrace.check_onnx or compare_onnx, got {describe(report)}"
        )
    out = _folder(folder, caller)
    ids = report.ids
    mapping = {"mappingEntries": [{"leftNodeIds": [str(t)], "rightNodeIds": [str(o) for o in onnx_ids]}
                                  for t, onnx_ids in ids.matched]}
    label = "traced (PyTorch eager)"
    numeric = getattr(report, "numeric", None)
    if numeric is None:
        trace_files = to_model_explorer(trace, out / "trace.json", graph_id="trace", label=label, highlight=ids.missing)
    else:
        errors, first = _value_errors(numeric, len(trace.nodes))
        trace_files = errors_to_model_explorer(trace, out, errors, highlight=[*ids.missing, *first], stem="trace",
                                               graph_id="trace", label=label, caller=caller)
    onnx_file = to_model_explorer(og, out / "onnx.json", graph_id="onnx", label="exported (ONNX)",
                                  highlight=ids.extra).graph
    write_bytes(out / "mapping.json", _dump(mapping), caller)
    return ModelExplorerPair(trace_files.graph, onnx_file, str(out / "mapping.json"), trace_files.node_data)


def _value_errors(numeric: NumericResult, nodes: int) -> tuple[dict[int, CallErrors], list[int]]:
    """A numeric ONNX check's errors per trace node (a node's worst compared value), and its first divergence's
    node if that is one."""
    worst: dict[int, Any] = {}
    for r in numeric.rows:
        if not r.compared or not 0 <= r.order < nodes:
            continue
        badness = (0 if r.ok else 1 if r.rounding else 2, r.max_rel if not math.isnan(r.max_rel) else math.inf)
        if r.order not in worst or badness > worst[r.order][0]:
            worst[r.order] = badness, r
    errors = {n: CallErrors(r.cosine, r.norm_rel, r.max_abs, r.max_rel, verdict) for n, ((verdict, _), r) in worst.items()}
    first = numeric.first_divergence
    return errors, [first.order] if first is not None and first.order in errors else []


def _folder(folder: str | os.PathLike[str], caller: str) -> Path:
    """``folder``, made if its parent exists. A symlink to a folder, named by the user, is that folder; the
    files written inside replace what is at their names (a symlink planted there is replaced, not followed)."""
    out = Path(folder)
    if not out.is_dir():
        refused = FwdtraceError(f"{caller} expected a folder, or a new one in an existing folder, got {str(folder)!r}")
        if os.path.lexists(out) or not (out.parent if str(out.parent) else Path(".")).is_dir():
            raise refused  # a file, a dangling symlink, or no folder to make it in
        try:
            out.mkdir()
        except OSError as e:
            raise FwdtraceError(f"{caller} could not make the folder {str(folder)!r}: {e.strerror or e}") from None
    return out


# -- two runs' errors ------------------------------------------------------------------------------
VERDICTS = ("allclose", "within rounding", "diverges")  # a call's verdict node data: its index here
ERROR_FIELDS = ("cosine", "norm_rel", "max_abs", "max_rel")


class CallErrors(NamedTuple):
    """One call's value against another run's, as node data: the errors (None where not computed) and
    the verdict, an index in :data:`VERDICTS`."""

    cosine: float | None
    norm_rel: float | None
    max_abs: float | None
    max_rel: float | None
    verdict: int
    nonfinite: int = 0  # inf and NaN elements where the other run's are finite (an overflow in one run)


def errors_to_model_explorer(
    graph: Graph, folder: str | os.PathLike[str], errors: Mapping[int, CallErrors], *,
    highlight: Iterable[int] = (), stem: str = "diff", graph_id: str = "fwdtrace", label: str | None = "fwdtrace diff",
    caller: str = "errors_to_model_explorer()",
) -> ModelExplorerFiles:
    """``graph`` as ``{stem}.json`` in ``folder`` (made if its parent exists), each call's errors against
    another run's values as node data beside it: the one way both comparisons (two dumps, the
    numeric ONNX check) write them.

    >>> import torch, fwdtrace, tempfile, json
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()), torch.ones(1, 4))
    >>> files = errors_to_model_explorer(g, tempfile.mkdtemp(), {1: CallErrors(1.0, 0.0, 0.0, 0.0, 0),
    ...                                                           2: CallErrors(0.5, 0.7, 2.0, 1.0, 2)}, highlight=[2])
    >>> sorted(files.node_data)
    ['cosine', 'max_abs', 'max_rel', 'norm_rel', 'verdict']
    >>> json.load(open(files.node_data["verdict"]))["fwdtrace"]["results"]["2"]
    {'value': 2.0, 'bgColor': '#f3a683'}

    ``errors`` is keyed by node id. One node-data file per error (``diff.cosine.json``,
    ``diff.norm_rel.json``, ``diff.max_abs.json``, ``diff.max_rel.json``: pale to red by value;
    an error that is inf or NaN, which JSON cannot hold, is written as the largest float with the
    saturated colour :data:`fwdtrace.onnx.compare.ERROR_COLORS` ``["nonfinite"]``, never left
    blank; ``diff.nonfinite.json``, where a call has any, counts its inf and NaN elements where the
    other run's are finite) and ``diff.verdict.json``: 0
    allclose, 1 within what rounding explains, 2 diverges, coloured as :meth:`Graph.render`
    colours an error (:data:`fwdtrace.onnx.compare.ERROR_COLORS`). ``highlight`` names the
    node ids drawn in red (the first divergence).
    """
    from ..onnx.compare import ERROR_COLORS

    verdict_colors = (ERROR_COLORS["exact"], ERROR_COLORS["within"], ERROR_COLORS["diverges"])
    out = _folder(folder, caller)
    # an error that is not finite is the worst there is: the largest float (a cosine: -1)
    worst = {name: -1.0 if name == "cosine" else sys.float_info.max for name in ERROR_FIELDS}
    data: dict[str, dict[Any, float]] = {
        name: {n: float(v) if math.isfinite(v) else worst[name] for n, e in errors.items()
               if (v := getattr(e, name)) is not None} for name in ERROR_FIELDS
    }
    colors: dict[str, dict[Any, str]] = {
        name: {n: ERROR_COLORS["nonfinite"] for n, e in errors.items()
               if (v := getattr(e, name)) is not None and not math.isfinite(v)} for name in ERROR_FIELDS}
    colors = {name: c for name, c in colors.items() if c}
    if any(e.nonfinite for e in errors.values()):
        data["nonfinite"] = {n: e.nonfinite for n, e in errors.items()}
        colors["nonfinite"] = {n: ERROR_COLORS["nonfinite"] if e.nonfinite else ERROR_COLORS["exact"]
                               for n, e in errors.items()}
    data["verdict"] = {n: e.verdict for n, e in errors.items()}
    colors["verdict"] = {n: verdict_colors[e.verdict] for n, e in errors.items()}
    return _write(graph, out / f"{stem}.json", data, colors, graph_id, label, highlight, caller)


# -- opening it -----------------------------------------------------------------------------------
def view(
    graph_or_model: Any, *args: Any, node_data: NodeData | Analysis | None = None, folder: str | None = None,
    host: str = "127.0.0.1", port: int = 8080, open_browser: bool = True, token: str | None = None,
    notebook: bool | None = None, max_connections: int = 32, timeout: float = 10.0,
) -> ModelExplorerFiles:
    """Open a graph (or ``model(*args)``, traced) in Model Explorer, with its node data.

    >>> import fwdtrace  # doctest: +SKIP
    >>> fwdtrace.view(model, torch.ones(1, 3, 224, 224), node_data=fwdtrace.analyze(model, x))  # doctest: +SKIP

    Writes the files (:func:`to_model_explorer`) to ``folder`` (a new temporary folder by
    default) and serves Model Explorer's page with them until Ctrl+C, opening a browser tab
    unless ``open_browser=False``. The server is fwdtrace's own
    (:class:`fwdtrace.live.explorer.ExplorerServer`), not Model Explorer's, which reads any
    file a client names: it serves the page and the files written here, nothing else. As
    :func:`fwdtrace.serve`: loopback by default; another ``host`` needs ``token`` (one is made
    and printed when None), the ``Host`` header must name the address bound, at most
    ``max_connections`` connections are open and each is closed after ``timeout`` seconds
    without a whole request. Needs
    ``pip install ai-edge-model-explorer``; without it a FwdtraceError says so. Returns the files written.

    In a Jupyter or Colab notebook (``notebook=None`` finds out; ``True``/``False`` decide) the
    page shows in the cell's output and ``view()`` returns at once: the server runs on until the
    next ``view()`` in the notebook, or the kernel's end. Jupyter gets an iframe to the loopback
    address; Colab serves the port through its own proxy
    (``google.colab.output.serve_kernel_port_as_iframe``), whose requests name the proxy's host:
    there the ``Host`` check is left out, since the port is reachable only from the notebook's VM
    and through Colab's signed-in proxy.
    """
    try:
        import model_explorer
    except ImportError:
        raise FwdtraceError(f"fwdtrace.view() needs Model Explorer: {INSTALL_HINT}") from None
    if notebook is not None and not isinstance(notebook, bool):
        raise FwdtraceError(f"fwdtrace.view() expected notebook as True, False or None (find out), got "
                            f"{describe(notebook)} {notebook!r}")
    if isinstance(graph_or_model, Graph):
        if args:
            raise FwdtraceError(f"fwdtrace.view() expected no inputs with a Graph, got {len(args)}")
        graph = graph_or_model
    else:
        from ..tracer import trace

        graph = trace(graph_or_model, *args)
    where = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="fwdtrace-model-explorer-"))
    files = to_model_explorer(graph, where / "graph.json", node_data=node_data)
    config = model_explorer.config()
    config.add_model_from_path(files.graph)
    for file in files.node_data.values():
        config.add_node_data_from_path(file)
    from ..live.explorer import ExplorerServer

    web_app = Path(model_explorer.__file__).parent / "web_app"
    where_shown = _notebook() if notebook is None else ("colab" if _in_colab() else "jupyter") if notebook else None
    server = ExplorerServer(web_app, [files.graph, *files.node_data.values()], host, port, token,
                            any_host=where_shown == "colab", max_connections=max_connections, timeout=timeout)
    if where_shown is not None:
        try:
            _show_in_notebook(server, config.to_url_param_value(), where_shown)
        except BaseException:
            server.stop()
            raise
        return files
    try:
        url = server.page_url(config.to_url_param_value())
        print(f"fwdtrace.view(): Model Explorer at\n{url}\n(Ctrl+C stops it)", flush=True)
        if open_browser:
            import webbrowser

            webbrowser.open_new_tab(url)
        _serve_until_interrupted(server)
    finally:
        server.stop()
    return files


_NOTEBOOK_HEIGHT = 800  # pixels of a cell's output the page takes
_notebook_servers: list[Any] = []  # the server a notebook's view() left running: one at a time


def _in_colab() -> bool:
    return "google.colab" in sys.modules


def _notebook() -> str | None:
    """"colab", "jupyter" (an IPython kernel, which shows HTML), or None (a terminal, a script)."""
    if _in_colab():
        return "colab"
    ipython = sys.modules.get("IPython")  # imported by the kernel itself: never imported here
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return "jupyter" if getattr(shell, "kernel", None) is not None else None


def _show_in_notebook(server: Any, data: str, where: str) -> None:
    """Show the page in the cell's output; the server runs on (the previous one of this notebook stops)."""
    while _notebook_servers:
        _notebook_servers.pop().stop()
    url = server.page_url(data)
    if where == "colab":
        from google.colab import output

        output.serve_kernel_port_as_iframe(server.port, path=url[len(server.url) - 1:], height=_NOTEBOOK_HEIGHT)
    else:
        from IPython.display import IFrame, display

        display(IFrame(url, width="100%", height=_NOTEBOOK_HEIGHT))
    _notebook_servers.append(server)
    print(f"fwdtrace.view(): Model Explorer at\n{url}\n(until the next view() or the kernel's end)", flush=True)


def _serve_until_interrupted(server: Any) -> None:
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
