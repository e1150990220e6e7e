"""Drawing a finished Graph: DOT text, PNG, SVG and PDF.

A pass over the graph (torch.fx's ``graph_drawer`` is the model): modules become nested
clusters, ``depth=k`` collapses everything below depth ``k`` into one box per module
call, and what ``fold.py`` finds (side computations, dead ends, loops, runs of identical
blocks) is drawn as one box each. By default the depth is chosen so that the picture
stays readable: at most a target number of boxes, within PNG bounds at a legible resolution. Rendering goes through pygraphviz, whose wheel bundles
Graphviz's layout engine, so no ``dot`` binary is needed; where pygraphviz cannot load (its wheel
needs the system's GLib and libXrender, which slim and CUDA container images lack), through a
``dot`` executable on PATH; with neither, an SVG (and a notebook's picture) comes from fwdtrace's own
layout (``layered.py``) with a warning naming what to install. The DOT text itself needs none of
them: without a layout engine the automatic depth goes by box count alone.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import contextvars
import inspect
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import graphviz

from .._files import check_folder, write_bytes
from ..errors import FwdtraceError, FwdtraceWarning, user_stacklevel
from ..graph import Graph
from ..machinery import NODE_TARGETS
from ..node import Edge, Node, Scope
from .fold import Folds, Item, Loop, find_folds, side_components

__all__ = ["Digraph", "to_dot", "render", "render_digraph", "FORMATS", "run_cli"]

FORMATS = ("png", "svg", "pdf")

_FILL = {"input": "#e8e8e8", "output": "#e8e8e8", "module": "#d6e6f5", "layer": "#d6e6f5", "function": "#f7efd2",
         "side": "#f4f4f4", "loop": "#e2ecd9"}
_SHAPE = {"input": "box", "output": "box", "module": "box", "layer": "box", "function": "ellipse", "side": "note"}
_HIGHLIGHT = {"color": "#c0392b", "fillcolor": "#f6c9c4", "penwidth": "2"}
HIGHLIGHT_COLOR = _HIGHLIGHT["color"]  # a legend entry of this colour is drawn as the highlight's outline


class Digraph(graphviz.Digraph):
    """A ``graphviz.Digraph`` that lays itself out with pygraphviz (or a ``dot`` executable where
    pygraphviz cannot load).

    It shows inline in Jupyter like any Digraph; ``pipe(format="png")`` returns the bytes.
    """

    def pipe(self, format: str | None = None, *args: Any, encoding: str | None = None, **kwargs: Any) -> Any:
        data = dot_bytes(self, format or self.format or "svg", caller="Digraph.pipe()")
        return data.decode(encoding) if encoding else data


def layout_bytes(source: str, fmt: str, caller: str = "render()") -> bytes:
    """Lay out DOT ``source`` with Graphviz's ``dot`` engine as ``fmt``: pygraphviz's bundled one, else
    a ``dot`` executable; with neither, fwdtrace's own layout (:mod:`fwdtrace.passes.layered`) with a
    :class:`FwdtraceWarning` saying what to install, rasterised for PNG and PDF by cairosvg where it is
    installed, else a :class:`FwdtraceError` from ``caller`` naming the SVG route."""
    need = _layout_need()
    if need is not None:
        return _own_layout(source, fmt, caller, need)
    engine = layout_engine(caller)
    if engine != "pygraphviz":
        return _run_dot(engine, source, fmt, caller)
    with _graphviz_messages(), _Layout(source) as layout:
        return layout.draw(fmt)


def _own_layout(source: str, fmt: str, caller: str, need: str) -> bytes:
    """``source`` drawn by fwdtrace's own layout as ``fmt`` (see :func:`layout_bytes`)."""
    from .layered import layered_svg

    svg = layered_svg(source).encode()
    if fmt != "svg":
        try:
            import cairosvg
        except ImportError:
            raise FwdtraceError(str(layout_missing(caller))) from None
        svg = getattr(cairosvg, f"svg2{fmt}")(bytestring=svg)  # svg2png, svg2pdf
    warnings.warn(f"{caller} drew the picture with fwdtrace's own layout, since {need}, and there is no "
                  "Graphviz dot executable on PATH. For Graphviz's layout (more compact, fewer crossings) install "
                  f"what it needs: {INSTALL_HINTS}", FwdtraceWarning, stacklevel=user_stacklevel())
    return svg


def dot_bytes(dot: graphviz.Digraph, fmt: str, caller: str = "render()") -> bytes:
    """``dot`` drawn as ``fmt``: what :func:`to_dot`'s automatic depth drew while measuring it, or a new layout."""
    drawn: dict[tuple[str, str], bytes] = getattr(dot, "_fwdtrace_drawn", {})
    data = drawn.get((dot.source, fmt))
    return data if data is not None else layout_bytes(dot.source, fmt, caller)


# -- which Graphviz lays out -------------------------------------------------------------------------
# What to install where pygraphviz cannot load: its manylinux wheel bundles Graphviz but, as the
# manylinux policy allows, loads GLib (libglib-2.0, libgobject-2.0) and libXrender from the system.
INSTALL_HINTS = (
    "on Debian/Ubuntu apt-get install libglib2.0-0 libxrender1 (libglib2.0-0t64 on Ubuntu 24.04), or apt-get "
    "install graphviz libgraphviz-dev for Graphviz with its dot; on Fedora dnf install graphviz; with conda "
    "conda install -c conda-forge pygraphviz"
)
WHEEL_LIBRARIES = ("libglib-2.0.so.0", "libgobject-2.0.so.0", "libXrender.so.1")
_LIBRARY = re.compile(r"lib[\w.+-]*?\.so(?:\.\d+)*")


def _pygraphviz_error() -> str | None:
    """Why pygraphviz cannot load here (its ImportError's text), or None when it loads."""
    try:
        import pygraphviz  # noqa: F401 - loads its C extension, and with it the system's libraries
    except (ImportError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _layout_need() -> str | None:
    """What keeps Graphviz from laying out here (pygraphviz cannot load and no ``dot`` on PATH), or None."""
    error = _pygraphviz_error()
    if error is None or shutil.which("dot"):
        return None
    libraries = list(dict.fromkeys(_LIBRARY.findall(error)))
    if "No module named" in error:
        return "pygraphviz is not installed (pip install pygraphviz)"
    if libraries:  # the loader names the first library missing; the others may be missing too
        return (f"pygraphviz cannot load the system's {', '.join(libraries)} ({error}; its wheel loads "
                f"{', '.join(WHEEL_LIBRARIES)})")
    return f"pygraphviz cannot load ({error})"


def layout_missing(caller: str = "render()") -> str | None:
    """Why Graphviz cannot lay out a picture here, and so why a PNG or PDF cannot be drawn without
    cairosvg (the text of the error ``caller`` would raise), or None."""
    need = _layout_need()
    if need is None:
        return None
    return (f"{caller} could not lay out the picture: {need}, and there is no Graphviz dot executable on PATH. "
            f"Install what it needs: {INSTALL_HINTS}. An SVG needs none of it (render('graph.svg') draws "
            "fwdtrace's own layout, and so does a notebook; pip install cairosvg rasterises that as PNG), nor "
            "do to_dot(), the JSON, networkx and Model Explorer files")


def layout_engine(caller: str = "render()") -> str:
    """``"pygraphviz"``, else the path of a ``dot`` executable; a :class:`FwdtraceError` naming what to
    install when there is neither."""
    if _pygraphviz_error() is None:
        return "pygraphviz"
    dot = shutil.which("dot")
    if dot is None:
        raise FwdtraceError(str(layout_missing(caller)))
    return dot


def _run_dot(dot: str, source: str, fmt: str, caller: str) -> bytes:
    """``source`` laid out by the ``dot`` executable as ``fmt``; its warnings become ``UserWarning``s."""
    try:
        done = subprocess.run([dot, f"-T{fmt}", "-Gnewrank=true"], input=source.encode(), capture_output=True,
                              check=False)
    except OSError as e:
        raise FwdtraceError(f"{caller} could not run Graphviz's {dot}: {e}") from e
    lines = done.stderr.decode(errors="replace").splitlines()
    if done.returncode != 0:
        said = "; ".join(line.removeprefix("Error:").strip() for line in lines if line.strip()) or \
            f"exit status {done.returncode}"
        raise FwdtraceError(f"Graphviz could not lay out the picture: {said}")
    for line in lines:
        if line.startswith("Warning:"):
            warnings.warn(f"Graphviz: {line.removeprefix('Warning:').strip()}", UserWarning, stacklevel=3)
    return done.stdout


def _plain_size(plain: bytes) -> tuple[float, float]:
    """The width and height in points of a layout in Graphviz's ``plain`` format (``graph scale w h``, inches)."""
    _, scale, width, height = plain.split(b"\n", 1)[0].split()[:4]
    return float(width) * float(scale) * 72, float(height) * float(scale) * 72


def _agraph(source: str) -> Any:
    import pygraphviz

    return pygraphviz.AGraph(string=source)


_EDGE = re.compile(r'^\s*("(?:[^"\\]|\\.)*"|[\w.]+)(?::\S+?)?\s*->\s*("(?:[^"\\]|\\.)*"|[\w.]+)', re.MULTILINE)


def _dot_edges(source: str) -> list[tuple[str, str]]:
    """The edges of DOT text written by :func:`to_dot` (one statement a line), by box name: no Graphviz needed."""
    return [(_dot_name(u), _dot_name(v)) for u, v in _EDGE.findall(source)]


def _dot_name(token: str) -> str:
    return token[1:-1].replace('\\"', '"') if token.startswith('"') else token


LARGE_LAYOUT = 500  # boxes or edges: above this, the layout's network simplex passes are bounded (see _Layout)
NSLIMIT = 2  # ...to this many iterations per box
DENSE_WIDTH = 64  # edges passing over one rank: above this, edge labels are placed after the layout (see _Layout)
MIN_MCLIMIT = 0.05  # ...and crossing minimisation gets DENSE_WIDTH / that many of its iterations, at least this share


def _dense(dot: Digraph) -> bool:
    """Whether a picture has more than ``DENSE_WIDTH`` edges abreast (see :class:`_Layout`)."""
    return _widest_skip(_dot_edges(dot.source)) > DENSE_WIDTH


def _widest_skip(edges: Iterable[tuple[str, str]]) -> int:
    """The most edges that pass over one rank, ranked by longest path: how many long edges run abreast."""
    succ: dict[str, list[str]] = collections.defaultdict(list)
    indegree: collections.Counter[str] = collections.Counter()
    rank: dict[str, int] = {}  # a box without edges passes no rank over
    for u, v in edges:
        succ[u].append(v)
        indegree[v] += 1
        rank[u] = rank[v] = 0
    ready = [n for n in rank if not indegree[n]]
    while ready:  # a node on a cycle keeps rank 0: it only shortens the edges counted
        u = ready.pop()
        for v in succ[u]:
            rank[v] = max(rank[v], rank[u] + 1)
            indegree[v] -= 1
            if not indegree[v]:
                ready.append(v)
    starts: collections.Counter[int] = collections.Counter()
    for u, vs in succ.items():
        for v in vs:
            if rank[v] > rank[u] + 1:
                starts[rank[u] + 1] += 1
                starts[rank[v]] -= 1
    widest = running = 0
    for r in sorted(starts):
        running += starts[r]
        widest = max(widest, running)
    return widest


class _Layout:
    """One run of ``dot``'s layout on a DOT source, its size, and drawings from it.

    Drawing a laid-out AGraph with pygraphviz's ``draw()`` re-runs it through ``neato -n2``,
    whose picture came out wider than the layout measured for the resolution (T5: 4121 px
    where 4096 were planned); this keeps ``dot``'s own layout and renders from it, as
    ``dot -Tpng`` does. Use it inside :func:`_graphviz_messages` and close it there: a
    layout kept while Graphviz lays out another graph is corrupted (styles lost, then a crash).

    Every layout ranks the whole graph at once (``newrank=true``, which :func:`to_dot` also
    writes): ``dot``'s default ranks each cluster apart and then merges them, which on
    pictures of many nested clusters with edges between them takes minutes (timm's
    ``swinv2_cr_tiny_224`` at depth 6, 728 boxes in 59 clusters: 105 s, and 6 s ranked at
    once; a side-by-side picture's outer graph, made elsewhere, gets it here).

    A graph of more than ``LARGE_LAYOUT`` boxes or edges (only an explicit depth draws one) has
    its two network-simplex passes, ranking and x coordinates, bounded (``nslimit1``, ``nslimit``:
    at most that many iterations per box): on timm's ``swinv2_cr_tiny_224`` side by side at full
    detail, 1335 boxes, they were 18 s of the layout's 20 and end at a picture of the same size.
    Crossing minimisation, which decides how readable it is, is left whole.

    A dense graph (more than ``DENSE_WIDTH`` edges passing over one rank: DenseNet, whose every
    layer reads each earlier layer's output) has its edges' shape labels placed after the layout
    (``xlabel``) instead of ranked in, once per box and shape (a fan-out's edges carry the same
    shape; an SVG's tooltips keep it on each). A label doubles the ranks its edge crosses, and
    routing 156 edges side by side across hundreds of ranks took Graphviz over 10 minutes on
    torchvision's DenseNet-121 at depth 4 (433 boxes, 967 edges; 6 s this way, and 2.7 s instead
    of 23 s at depth 3). Long edges few abreast route fast: swinv2's 728 boxes at full detail
    (32 abreast) in 1 s. A dense graph also has its crossing minimisation's iterations scaled
    down (``mclimit``, by ``DENSE_WIDTH`` over the edges abreast): each runs over every rank an
    edge passes, and DenseNet-201 at depth 3 (125 boxes, 1927 edges, 600 abreast: 54,000 such
    points) spent 60 s of a 106 s layout there to leave 109,000 crossings where 140,000 take 3 s.
    """

    def __init__(self, source: str) -> None:
        import pygraphviz.graphviz as gv

        self._gv, self._agraph = gv, _agraph(source)
        self._agraph.graph_attr["newrank"] = "true"
        boxes, edges = self._agraph.number_of_nodes(), self._agraph.number_of_edges()
        if max(boxes, edges) > LARGE_LAYOUT:
            for name in ("nslimit", "nslimit1"):
                if not self._agraph.graph_attr.get(name):  # a user's own limit stands
                    self._agraph.graph_attr[name] = str(NSLIMIT)
        widest = _widest_skip(self._agraph.edges_iter())
        if widest > DENSE_WIDTH:
            if not self._agraph.graph_attr.get("mclimit"):  # a user's own limit stands
                self._agraph.graph_attr["mclimit"] = f"{max(MIN_MCLIMIT, DENSE_WIDTH / widest):.3g}"
            shown: set[tuple[str, str]] = set()  # one label per box and shape: fan-outs repeat it
            for edge in self._agraph.edges_iter():
                label = edge.attr.get("label")
                if label and not edge.attr.get("xlabel"):
                    edge.attr["label"] = ""
                    if (edge[0], label) not in shown:
                        shown.add((edge[0], label))
                        edge.attr["xlabel"] = label
        self._context = gv.gvContextWithBuiltins()
        if gv.gvLayout(self._context, self._agraph.handle, b"dot") != 0:
            gv.gvFreeContext(self._context)
            raise ValueError("Graphviz raised a layout error")
        gv.gvRender(self._context, self._agraph.handle, format=b"dot")  # the positions, as attributes
        x0, y0, x1, y1 = (float(v) for v in str(self._agraph.graph_attr["bb"]).split(","))
        self.size = (x1 - x0, y1 - y0)  # points

    def draw(self, fmt: str) -> bytes:
        error, data = self._gv.gvRenderData(self._context, self._agraph.handle, fmt.encode())
        if error:
            raise ValueError(f"Graphviz could not draw {fmt}")
        return bytes(data)

    def __enter__(self) -> _Layout:
        return self

    def __exit__(self, *exc: object) -> None:
        self._gv.gvFreeLayout(self._context, self._agraph.handle)
        self._gv.gvFreeContext(self._context)


# The sizes of the pictures measured last, by DOT source: rendering a picture as PNG and then as
# SVG measures its automatic depth once.
_SIZES: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
_SIZES_KEPT = 32
# The format render() is drawing, if any: the automatic depth then draws the picture it chose
# from the layout it measured (one layout, not two).
_DRAW_FORMAT: contextvars.ContextVar[str | None] = contextvars.ContextVar("fwdtrace_draw_format", default=None)


_STDERR_LOCK = threading.Lock()
# What Graphviz's cairo renderer prints, with no "Warning:", when a bitmap would exceed its size limit.
_SCALED = re.compile(r"graph is too large for cairo-renderer bitmaps\. Scaling by ([0-9.]+) to fit")


@contextlib.contextmanager
def _graphviz_messages() -> Iterator[None]:
    """Catch what Graphviz and its fontconfig write to the process's stderr (file descriptor 2,
    below Python) while laying out: fontconfig's complaints about the system's newer config
    files, printed by the older fontconfig bundled in pygraphviz's wheel, are dropped; Graphviz's
    own warnings become a ``UserWarning`` and its errors go into fwdtrace's error.

    The descriptor is the process's: other threads' writes meanwhile are passed on unchanged.
    """
    with _STDERR_LOCK, tempfile.TemporaryFile() as caught:
        if sys.stderr is not None:
            sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        failure: BaseException | None = None
        try:
            yield
        except Exception as e:  # pygraphviz says "Invalid Input"; Graphviz said why on stderr
            failure = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        lines = caught.read().decode(errors="replace").splitlines()
    messages = [line for line in lines if line.strip() and not line.startswith("Fontconfig ")]
    graphviz_lines = [line for line in messages if line.startswith(("Warning:", "Error:"))]
    scaled = [m for m in map(_SCALED.search, messages) if m]
    others = [line for line in messages if line not in graphviz_lines and not _SCALED.search(line)]
    if others and sys.stderr is not None:
        sys.stderr.write("\n".join(others) + "\n")
    if isinstance(failure, FwdtraceError):
        raise failure
    errors = [line for line in graphviz_lines if line.startswith("Error:")]
    if failure is not None or errors:
        said = "; ".join(line.removeprefix("Error:").strip() for line in errors) or str(failure)
        raise FwdtraceError(f"Graphviz could not lay out the picture: {said}") from failure
    for line in graphviz_lines:
        warnings.warn(f"Graphviz: {line.removeprefix('Warning:').strip()}", UserWarning, stacklevel=3)
    for m in scaled:
        warnings.warn(f"Graphviz: the picture is over cairo's bitmap size limit and was drawn at {float(m[1]):.2g} "
                      "of its size; the SVG keeps every detail", UserWarning, stacklevel=3)


def render_digraph(dot: graphviz.Digraph, path: str | os.PathLike[str], caller: str = "render()") -> str:
    """Write ``dot`` to ``path`` as PNG, SVG or PDF, chosen by the suffix; return the path.

    The file appears whole or not at all: it is written beside the target and moved in place.
    ``caller`` is the public function whose errors these are, a missing layout engine included.
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise FwdtraceError(f"{caller} expected a path ending in .png, .svg or .pdf, got {str(path)!r}")
    check_folder(path, caller)  # before the layout, which may take long
    write_bytes(path, dot_bytes(dot, fmt, caller), caller=caller)
    return str(path)


def render(graph: Graph, path: str | os.PathLike[str], depth: int | str | None = "auto", **options: Any) -> str:
    """Draw ``graph`` into a PNG, SVG or PDF file, chosen by ``path``'s suffix.

    >>> import torch, fwdtrace, tempfile, os
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
    >>> path = g.render(os.path.join(tempfile.mkdtemp(), "graph.svg"))
    >>> open(path).read().count("<svg")
    1

    ``depth`` and ``options`` are those of :func:`to_dot`: by default the deepest depth
    whose picture has at most ``target_nodes`` boxes (250) and fits a PNG of at most
    4096 x 16384 px at a resolution where 10 pt labels stay legible.
    """
    unknown = sorted(set(options) - set(DRAW_OPTIONS))
    if unknown:
        raise FwdtraceError(f"render() expected options of to_dot ({', '.join(DRAW_OPTIONS)}), got {', '.join(unknown)}")
    check_draw_options("render()", depth, **{k: options[k] for k in ("rankdir", "target_nodes") if k in options})
    fmt = Path(path).suffix.lower().lstrip(".")
    token = _DRAW_FORMAT.set(fmt if fmt in FORMATS else None)
    try:
        dot = to_dot(graph, depth=depth, **options)
    finally:
        _DRAW_FORMAT.reset(token)
    return render_digraph(dot, path)


# -- which box each node is drawn in ------------------------------------------------------------------
@dataclass
class _Unit:
    """One box in the picture: a node, a collapsed module call, a run of repeated blocks or loop
    iterations, or a group of side computations."""

    key: str
    placement: tuple[Scope, ...]  # the clusters it sits in, outermost first
    kind: str
    label: str
    members: list[int] = field(default_factory=list)
    about: str = ""  # the first line of its tooltip, for a box that holds several nodes
    module_key: str | None = None  # the module it is (a layer node or one module call); None for folds


def _box_key(module_path: str, class_name: str) -> str | None:
    """The module key of a module call's box (see :func:`fwdtrace.module_keys`); None where there
    is none: an ONNX scope may not know its class, and a module outside the traced model (the
    tracer names it ``<Class@N>``) has no key in it."""
    if not class_name or module_path.startswith("<"):
        return None
    return f"{module_path}.{class_name}" if module_path else class_name


def _scope_key(s: Scope) -> str | None:
    return _box_key(s.module_path, s.class_name)


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
        if node.attrs.get("atomic"):  # a hooked function, one box: its name (the tooltip has its path)
            return node.class_name
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


def _node_line(node: Node) -> str:
    """One line of a tooltip: where a node ran, what it is, what it read and wrote."""
    refs = lambda rs: ", ".join(r.param or _shape_text(r.shape) for r in rs) or "-"  # noqa: E731
    what = node.name if node.kind in ("input", "output") else node.target.rsplit(".", 1)[-1]
    attrs = _attrs_text(node) if node.kind == "module" else ""
    return f"{node.module_path or '(root)'}: {what}{' ' + attrs if attrs else ''} ({refs(node.inputs)} → {refs(node.outputs)})"


_TOOLTIP_LINES = 300  # a box holding more nodes lists the first ones and says how many are left


def _tooltip(unit: _Unit, nodes: list[Node]) -> str:
    if unit.about == "":
        n = nodes[0]
        lines = [f"{n.module_path or '(root)'} · {n.target}" + (f" · call {n.call_index + 1}" if n.call_index else "")]
        lines += [f"in: {', '.join((r.param + ' ' if r.param else '') + _shape_text(r.shape) + ' ' + r.dtype for r in n.inputs) or '-'}",
                  f"out: {', '.join(_shape_text(r.shape) + ' ' + r.dtype for r in n.outputs) or '-'}"]
        lines += [f"{k}: {v}" for k, v in sorted(n.attrs.items())]
        lines += [f"with its input {_node_line(other)}" for other in nodes[1:]]  # constants drawn inside it
        return "\n".join(lines)
    lines = [unit.about] + [_node_line(n) for n in nodes[:_TOOLTIP_LINES]]
    if len(nodes) > _TOOLTIP_LINES:
        lines.append(f"… and {len(nodes) - _TOOLTIP_LINES} more")
    return "\n".join(lines)


def _id_ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2 5"``: which nodes a box holds, as a DOT attribute."""
    ranges: list[list[int]] = []
    for i in sorted(ids):
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return " ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def _paths_text(paths: list[str], limit: int = 3) -> str:
    """Module paths, those that differ only in one index merged: ``h.*.attn (×12)``."""
    if not paths:
        return ""
    pattern2paths: dict[str, list[str]] = {}
    for p in paths:
        pattern = ".".join("*" if part.isdigit() else part for part in p.split("."))
        pattern2paths.setdefault(pattern, [])
        if p not in pattern2paths[pattern]:
            pattern2paths[pattern].append(p)
    texts = [ps[0] if len(ps) == 1 else f"{pattern} (×{len(ps)})" for pattern, ps in pattern2paths.items()]
    more = f", … {len(texts) - limit} more" if len(texts) > limit else ""
    return ", ".join(texts[:limit]) + more


def _side_kind(nodes: list[Node], graph_inputs: dict[int, Node], reads: set[int], dead: bool) -> str:
    if dead:
        return "unused results"
    names = [graph_inputs[i].name.lower() for i in reads if i in graph_inputs]
    targets = [n.target.rsplit(".", 1)[-1].lower() for n in nodes]
    if any("mask" in name for name in names) or any(r.dtype == "bool" for n in nodes for r in n.outputs) \
            or any(t in ("tril", "triu", "masked_fill") for t in targets):
        return "mask arithmetic"
    if "arange" in targets or any("position" in name for name in names):
        return "position / index arithmetic"
    return "constants and side arithmetic"


@dataclass
class _Picture:
    """The boxes of one picture and the node -> box map."""

    node2unit: dict[int, _Unit]
    units: list[_Unit]


def _units(graph: Graph, folds: Folds, depth: int | None, *, collapse_repeats: bool, fold_loops: bool,
           fold_side: bool, show_path: bool, open_leaf_layers: bool, opened: frozenset[Scope] = frozenset(),
           chain_ops: bool = False) -> _Picture:
    """The boxes at ``depth``; the module calls in ``opened`` (at that depth's last level) drawn one level deeper;
    with ``chain_ops``, each chain of single-op boxes one box (see :func:`_chain_ops`)."""
    node2unit: dict[int, _Unit] = {}
    units: dict[str, _Unit] = {}
    loop2key = {id(loop): f"l:{i}" for i, loop in enumerate(folds.loops)}
    for n in graph.nodes:
        unit = None
        if depth is not None and depth <= 0 and n.kind in ("module", "function"):
            unit = units.get("model") or units.setdefault(
                "model", _Unit("model", (), "group", "model (collapsed)", about="the whole model, collapsed"))
        for i in range(len(n.scope) + 1 if unit is None else 0):
            item: Item = n.scope[i] if i < len(n.scope) else n.id
            loop = folds.item2loop.get(item) if fold_loops else None
            if loop is not None:
                key = loop2key[id(loop)]
                unit = units.get(key) or units.setdefault(key, _loop_unit(key, loop, graph, n.scope[:i]))
                break
            if i == len(n.scope):
                break
            s = n.scope[i]
            if collapse_repeats and s in folds.repeats:
                first, count = folds.repeats[s]
                key = f"r:{first.module_path}:{first.call_index}"
                unit = units.get(key)
                if unit is None:
                    last = [t for t, (f, _) in folds.repeats.items() if f == first][-1]
                    label = f"{s.module_path} … {last.module_path}\n×{count} same as {first.module_path} ({first.class_name})"
                    unit = units[key] = _Unit(key, n.scope[:i], "repeat", label,
                                              about=f"{count} blocks that compute the same as {first.module_path}")
                break
            if not open_leaf_layers and s in folds.leaf_layers:
                key = f"g:{s.module_path}:{s.call_index}"
                unit = units.get(key) or units.setdefault(key, _leaf_unit(key, s, n.scope[:i], show_path))
                break
            if depth is not None and i >= depth - 1 and s not in opened:
                key = f"g:{s.module_path}:{s.call_index}"
                unit = units.get(key) or units.setdefault(
                    key, _Unit(key, n.scope[:i], "group", _scope_label(s), about=f"{_scope_label(s)}, collapsed",
                               module_key=_scope_key(s)))
                break
        if unit is None:
            # An atomic function's box carries its function key, which tools take as they take a module key
            box_key = _box_key(n.module_path, n.class_name) if n.kind == "module" or n.attrs.get("atomic") is True else None
            unit = units[f"n:{n.id}"] = _Unit(f"n:{n.id}", n.scope, n.kind, _node_label(n, show_path), module_key=box_key)
        unit.members.append(n.id)
        node2unit[n.id] = unit
    if fold_side:
        _fold_side(graph, folds, node2unit)
    if chain_ops:
        _chain_ops(graph, node2unit)
    ordered: dict[str, _Unit] = {}
    for n in graph.nodes:  # execution order, side boxes where their first op ran
        u = node2unit[n.id]
        ordered.setdefault(u.key, u)
    return _Picture(node2unit, list(ordered.values()))


def _leaf_unit(key: str, s: Scope, placement: tuple[Scope, ...], show_path: bool) -> _Unit:
    """One box for a leaf layer (see ``fold._leaf_layers``), labelled as a layer node is."""
    lines = [s.class_name or s.module_path.rsplit(".", 1)[-1]]
    last = s.module_path.rsplit(".", 1)[-1]
    call = f" (call {s.call_index + 1})" if s.call_index else ""
    if show_path and s.class_name and (last != s.class_name or call):
        lines.append(last + call)
    return _Unit(key, placement, "layer", "\n".join(lines), about=f"{_scope_label(s)}, a layer drawn as one box",
                 module_key=_scope_key(s))


def _loop_unit(key: str, loop: Loop, graph: Graph, placement: tuple[Scope, ...]) -> _Unit:
    def name(item: Item) -> str:
        if isinstance(item, Scope):
            return f"{item.module_path.rsplit('.', 1)[-1]} ({item.class_name})"
        node = graph.nodes[item]
        if node.kind == "module" and node.module_path:
            return f"{node.module_path.rsplit('.', 1)[-1]} ({node.class_name})"
        return node.target.rsplit(".", 1)[-1].strip("_")

    names = [name(it) for it in loop.body]
    body = ", ".join(names[:4]) + (f", … {len(names) - 4} more" if len(names) > 4 else "")
    where = placement[-1].module_path if placement else "the model"
    return _Unit(key, placement, "loop", f"loop in {where}: ×{loop.count - 1} more of\n{body}",
                 about=f"iterations 2 to {loop.count} of a loop of {len(loop.body)} calls in {where}")


def _unit_name(unit: _Unit, graph: Graph) -> str:
    """How a side box names a box it feeds: a module path where there is one."""
    if unit.kind in ("module", "function", "input", "output"):
        node = graph.nodes[unit.members[0]]
        return node.module_path or node.name if node.kind == "module" else node.module_path or unit.label.split("\n")[0]
    if unit.kind == "layer":
        return graph.nodes[unit.members[0]].scope[len(unit.placement)].module_path
    if unit.kind == "loop":
        return f"the loop in {unit.placement[-1].module_path if unit.placement else 'the model'}"
    return unit.placement[-1].module_path if unit.placement and unit.kind != "group" else unit.label.split("\n")[0]


def _fold_side(graph: Graph, folds: Folds, node2unit: dict[int, _Unit]) -> None:
    """Replace each connected group of side computations still drawn one by one with one box."""
    candidates = {i for i in folds.side if node2unit[i].key == f"n:{i}"}
    inputs = {n.id: n for n in graph.input_nodes}
    for group in side_components(graph, candidates):
        if len(group) < 2:  # one op is as small as a box for it
            continue
        members = set(group)
        nodes = [graph.nodes[i] for i in group]
        reads = {e.src for e in graph.edges if e.dst in members and e.src not in members}
        consumers = [_unit_name(node2unit[e.dst], graph) for e in graph.edges if e.src in members and e.dst not in members]
        dead = all(folds.side[i] == "dead end" for i in group)
        cache = any(folds.side[i] == "empty cache" for i in group)
        kind = "empty cache" if cache else _side_kind(nodes, inputs, reads, dead)
        fed = _paths_text(list(dict.fromkeys(consumers)))
        label = f"{kind}, {len(group)} ops" + (f"\n→ {fed}" if fed else "")
        placement = nodes[0].scope
        for n in nodes[1:]:
            k = 0
            while k < min(len(placement), len(n.scope)) and placement[k] == n.scope[k]:
                k += 1
            placement = placement[:k]
        unit = _Unit(f"s:{group[0]}", placement, "side", label, list(group),
                     about=f"{kind}: {len(group)} ops off the data path" + (f", feeding {fed}" if fed else ""))
        for i in group:
            node2unit[i] = unit
    _fold_lone_constants(graph, folds, node2unit)


def _chain_ops(graph: Graph, node2unit: dict[int, _Unit]) -> None:
    """Draw each chain of single-op boxes outside every module, where each box is the only reader of
    the one before and reads only it, as one box (``Sigmoid → Reshape → Greater``).

    The last resort of the automatic depth: an ONNX file's post-processing is hundreds of ops
    outside any module scope (torchvision's RetinaNet exported by ``to_onnx``: 237 at depth 1),
    which no depth collapses. Contracting a chain keeps every branch and join of the picture and
    closes no cycle: nothing enters or leaves a chain but at its ends.
    """
    succ: dict[str, set[str]] = {}
    pred: dict[str, set[str]] = {}
    key2unit: dict[str, _Unit] = {}
    for e in graph.edges:
        u, v = node2unit[e.src], node2unit[e.dst]
        key2unit[u.key], key2unit[v.key] = u, v
        if u is not v:
            succ.setdefault(u.key, set()).add(v.key)
            pred.setdefault(v.key, set()).add(u.key)
    single = lambda u: u.kind == "function" and not u.placement  # noqa: E731
    key2chain: dict[str, list[_Unit]] = {}
    for n in graph.nodes:  # execution order: a box after the one it reads
        unit = node2unit[n.id]
        if not single(unit) or unit.key in key2chain or n.id != unit.members[0]:
            continue
        before = pred.get(unit.key, set())
        p = key2unit[next(iter(before))] if len(before) == 1 else None
        if p is not None and single(p) and succ.get(p.key) == {unit.key} and p.key in key2chain:
            key2chain[p.key].append(unit)
            key2chain[unit.key] = key2chain[p.key]
        else:
            key2chain[unit.key] = [unit]
    done: set[int] = set()
    for chain in key2chain.values():
        if len(chain) < 2 or id(chain) in done:
            continue
        done.add(id(chain))
        names = [u.label.split("\n")[0] for u in chain]
        shown = names if len(names) <= 4 else names[:2] + ["…"] + names[-1:]
        label = " → ".join(shown) + f"\n{len(chain)} ops"
        members = [i for u in chain for i in u.members]
        merged = _Unit(f"c:{chain[0].key}", chain[0].placement, "ops", label, members,
                       about=f"{len(chain)} ops one after the other: {' → '.join(names)}")
        for i in members:
            node2unit[i] = merged


def _puts_parameters(node: Node) -> bool:
    """Whether ``node`` is another tool putting a layer's parameters in place (FSDP's unshard,
    accelerate's onload: :data:`fwdtrace.machinery.NODE_TARGETS`), drawn as a box of its own."""
    return node.kind == "function" and node.target in NODE_TARGETS


def _parameter_edges(graph: Graph, node2unit: dict[int, _Unit]) -> dict[tuple[str, str], list[str]]:
    """The parameters each :func:`_puts_parameters` box puts on a layer drawn as one node, by pair of boxes.

    A layer's node lists its activations, not its parameters, so no edge of the graph joins the
    two; the picture says with a dashed edge which layer's weights the box brought in (its next call).
    """
    path2calls: dict[str, list[int]] = {}
    for n in graph.nodes:
        if n.kind == "module":
            path2calls.setdefault(n.module_path, []).append(n.id)
    read = {(e.src, e.obj_id) for e in graph.edges}
    pairs: dict[tuple[str, str], list[str]] = {}
    for n in graph.nodes:
        if not _puts_parameters(n):
            continue
        for r in n.outputs:
            if (n.id, r.obj_id) in read or r.param is None:
                continue
            layer = next((i for i in path2calls.get(r.param.rpartition(".")[0], ()) if i > n.id), None)
            if layer is not None and node2unit[layer] is not node2unit[n.id]:
                pairs.setdefault((node2unit[n.id].key, node2unit[layer].key), []).append(r.param)
    return pairs


def _fold_lone_constants(graph: Graph, folds: Folds, node2unit: dict[int, _Unit]) -> None:
    """Draw a side op that reads nothing and feeds one box (an ONNX ``Constant``: an axis, a shape)
    inside that box, as Netron draws a constant input inside its node.

    An ONNX graph has one per ``Unsqueeze``, ``Slice`` or ``Reshape``: torchvision's RetinaNet
    exported by TorchScript draws 218 of its 742 boxes at depth 1 for them.
    """
    reads = {e.dst for e in graph.edges}
    consumers: dict[int, set[str]] = {}
    key2unit: dict[str, _Unit] = {}
    for e in graph.edges:
        unit = node2unit[e.dst]
        consumers.setdefault(e.src, set()).add(unit.key)
        key2unit[unit.key] = unit
    for i in folds.side:
        own = node2unit[i]
        feeds = consumers.get(i, set())
        if own.key != f"n:{i}" or i in reads or len(feeds) != 1 or own.key in feeds or _puts_parameters(graph.nodes[i]):
            continue
        into = key2unit[next(iter(feeds))]
        if into.kind == "side" or into.key.startswith("n:") and into.members[0] in folds.side:
            continue  # a side box of its own: the lone op stays beside it
        into.members.append(i)
        node2unit[i] = into


# -- fitting the picture ---------------------------------------------------------------------------------
DPI = 96  # Graphviz's PNG default: a 10 pt label is 13 px high
MIN_DPI = 72  # below this a 10 pt label (10 px) is no longer legible: draw less detail instead
MAX_PNG = (4096, 16384)  # px, width and height
TARGET_NODES = 250
MIN_AUTO_BOXES = 30  # the automatic depth shows at least this many boxes (all there are, if fewer)


def _max_depth(graph: Graph) -> int:
    return max((len(n.scope) for n in graph.nodes), default=0) + 1


def _measure(dot: graphviz.Digraph, final: Callable[[float, float], bool]) -> tuple[float, float] | None:
    """The width and height of ``dot``'s laid-out picture in points; inside :func:`render`, a picture
    of a size that makes it ``final`` is drawn from that layout too (kept on ``dot``, see :func:`dot_bytes`).
    None where nothing here can lay out (see :func:`layout_missing`): the DOT text is made all the same."""
    source, fmt = dot.source, _DRAW_FORMAT.get()
    size = _SIZES.get(source)
    if size is None and _pygraphviz_error() is not None:
        dot_path = shutil.which("dot")
        if dot_path is None:
            return None
        size = _SIZES[source] = _plain_size(_run_dot(dot_path, source, "plain", "to_dot()"))
        while len(_SIZES) > _SIZES_KEPT:
            _SIZES.popitem(last=False)
        return size
    if size is None or (fmt is not None and final(*size) and _pygraphviz_error() is None):
        with _graphviz_messages(), _Layout(source) as layout:
            size = layout.size
            if fmt is not None and final(*size):
                dot._fwdtrace_drawn = {(source, fmt): layout.draw(fmt)}
        _SIZES[source] = size
        while len(_SIZES) > _SIZES_KEPT:
            _SIZES.popitem(last=False)
    return size


def _wrap_edges(keys: list[str], edges: set[tuple[str, str]], width: int) -> list[tuple[str, str]]:
    """Invisible edges that break each rank wider than ``width`` boxes into rows of ``width``.

    Ranks are longest paths from the sources over the box graph with its cycles broken (see
    :func:`_acyclic`), a source placed just above its first reader (as Graphviz does),
    recomputed after each rank is wrapped, since pushing boxes down widens the ranks below.
    Boxes of one rank have no path between them, so an edge from a box to a later one of its
    rank closes no cycle.
    """
    order = {k: i for i, k in enumerate(keys)}
    succ = _acyclic(keys, edges)
    extra: list[tuple[str, str]] = []
    for _ in range(len(keys)):
        rank = _ranks(keys, succ)
        rank2keys: dict[int, list[str]] = {}
        for k in keys:
            rank2keys.setdefault(rank[k], []).append(k)
        wide = [r for r, row in sorted(rank2keys.items()) if len(row) > width]
        if not wide:
            break
        row = sorted(rank2keys[wide[0]], key=order.__getitem__)
        for i in range(len(row) - width):
            extra.append((row[i], row[i + width]))
            succ[row[i]].append(row[i + width])
    return extra


def _acyclic(keys: list[str], edges: set[tuple[str, str]]) -> dict[str, list[str]]:
    """The box graph's successor lists without the edges that close a cycle.

    Contracting an acyclic graph by box can close cycles (a side box both feeding a layer and
    reading it, through a dead end it holds; a loop box); Graphviz breaks them by reversing
    the back edges of a depth-first search, and so does this, visiting boxes in ``keys``
    order, so that the ranks computed here are those Graphviz draws.
    """
    succ: dict[str, list[str]] = {k: [] for k in keys}
    for u, v in sorted(edges):
        succ[u].append(v)
    state: dict[str, int] = {}  # 1 while on the search's stack, 2 once done
    back: set[tuple[str, str]] = set()
    for root in keys:
        if root in state:
            continue
        state[root] = 1
        stack = [(root, iter(succ[root]))]
        while stack:
            u, it = stack[-1]
            v = next(it, "")
            if not v:  # keys are never empty
                state[u] = 2
                stack.pop()
            elif v not in state:
                state[v] = 1
                stack.append((v, iter(succ[v])))
            elif state[v] == 1:
                back.add((u, v))
    return {u: [v for v in vs if (u, v) not in back and u != v] for u, vs in succ.items()}


def _ranks(keys: list[str], succ: dict[str, list[str]]) -> dict[str, int]:
    """Each box's rank in the acyclic box graph ``succ``: its longest path from a source, a
    source placed just above its first reader."""
    pred: dict[str, list[str]] = {k: [] for k in keys}
    for u in keys:
        for v in succ[u]:
            pred[v].append(u)
    waiting = {k: len(pred[k]) for k in keys}
    ready = [k for k in reversed(keys) if not waiting[k]]
    rank: dict[str, int] = {}
    while ready:  # Kahn's order: every box after those with an edge into it
        k = ready.pop()
        rank[k] = max((rank[p] + 1 for p in pred[k]), default=0)
        for v in succ[k]:
            waiting[v] -= 1
            if not waiting[v]:
                ready.append(v)
    assert len(rank) == len(keys), "the box graph still has a cycle"
    for k in keys:
        if not pred[k] and succ[k]:
            rank[k] = max(rank[k], min(rank[s] for s in succ[k]) - 1)
    return rank


def check_draw_options(caller: str, depth: Any, rankdir: Any = "TB", target_nodes: Any = TARGET_NODES) -> None:
    """The checks of :func:`to_dot`'s options, in the words of ``caller``, the public function the user called."""
    if depth != "auto" and depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 0):
        raise FwdtraceError(f"{caller} expected depth as 'auto', None or an integer >= 0, got {depth!r}")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise FwdtraceError(f"{caller} expected rankdir in TB, LR, BT, RL, got {rankdir!r}")
    if isinstance(target_nodes, bool) or not isinstance(target_nodes, int) or target_nodes < 1:
        raise FwdtraceError(f"{caller} expected target_nodes as an integer >= 1, got {target_nodes!r}")


def to_dot(
    graph: Graph,
    depth: int | str | None = "auto",
    *,
    target_nodes: int = TARGET_NODES,
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
    """A ``graphviz.Digraph`` of ``graph``: modules as nested clusters, edges labelled with shapes.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.nn.Linear(4, 2))
    >>> g = fwdtrace.trace(model, torch.ones(1, 4))
    >>> dot = g.to_dot(depth=1)
    >>> "0 (Sequential)" in dot.source and 'label="ReLU' not in dot.source  # in the box's tooltip only
    True
    >>> 'label="ReLU' in g.to_dot(depth=None).source
    True

    ``depth=k`` collapses every module call nested deeper than ``k`` levels into one box,
    re-routing edges to it; ``None`` draws every level. The default, ``"auto"``, picks the
    deepest depth whose picture has at most ``target_nodes`` boxes and fits a PNG of
    ``MAX_PNG`` pixels at ``MIN_DPI`` or more, and says so in the caption.

    Folding keeps large models readable, and every folded node stays in exactly one box:
    ``fold_side`` draws each connected group of side computations (mask and position
    arithmetic, constants, results nothing reads) as one box naming what it feeds;
    ``fold_loops`` draws a loop (the same calls repeated in one module call, three times or
    more) as its first iteration and one box for the rest; ``collapse_repeats`` does the same
    for a run of three or more identical sibling blocks. A leaf layer, a module call that
    calls no other module and records only function calls (transformers' ``Conv1D``, an
    activation class), is one box like ``nn.Linear``; ``open_leaf_layers`` draws its calls
    (the graph keeps them either way). ``wrap`` breaks a rank of more boxes
    than that into rows. In SVG each box has a tooltip: module path, class, shapes and
    attributes, or the list of the nodes a collapsed box holds (the DOT attribute
    ``fwdtrace_members`` lists their ids). Each box's and cluster's ``class``, which the SVG
    keeps, names its kind and the module key it stands for (``class="node layer key:h.0.mlp.c_fc.Conv1D"``):
    a layer, a leaf layer or a collapsed module call carries its key; side, loop and repeat boxes none.

    ``highlight`` is a set of node ids drawn in red. ``fills`` colours boxes by node id (a
    box holding several coloured nodes takes the colour listed first: list the most telling
    first), ``notes`` adds a line per node id to its box's tooltip; both are drawn as given
    (:func:`fwdtrace.render_side_by_side` colours by relative error this way); ``legend`` draws what the
    colours mean, a box per ``(colour, text)`` in a corner cluster. ``name_prefix`` keeps DOT names apart
    when two graphs share a picture; ``cluster_name`` (starting with ``cluster``) makes the
    result embeddable with ``outer.subgraph(...)``, boxed and titled ``title``.
    """
    check_draw_options("to_dot()", depth, rankdir, target_nodes)
    folds = find_folds(graph)
    options: dict[str, Any] = dict(collapse_repeats=collapse_repeats, fold_loops=fold_loops, fold_side=fold_side, show_path=show_path,
                   open_leaf_layers=open_leaf_layers)
    def draw(d: int | None, caption: str | None, wrap: int, opened: frozenset[Scope] = frozenset(),
             chain_ops: bool = False) -> Digraph:
        return _dot(graph, _units(graph, folds, d, **options, opened=opened, chain_ops=chain_ops), caption, wrap=wrap,
                    show_shapes=show_shapes, highlight=set(highlight), rankdir=rankdir, title=title,
                    name_prefix=name_prefix, cluster_name=cluster_name, fills=dict(fills or {}), notes=dict(notes or {}),
                    legend=list(legend))

    if not isinstance(depth, str):  # "auto", the one string checked above
        return draw(depth, None, wrap)
    return _auto_depth(graph, folds, options, target_nodes, wrap, draw)


# render()'s **options: to_dot's keyword-only parameters
DRAW_OPTIONS = tuple(name for name, p in inspect.signature(to_dot).parameters.items() if p.kind is p.KEYWORD_ONLY)


def _auto_depth(graph: Graph, folds: Folds, options: dict[str, Any], target_nodes: int, wrap: int,
                draw: Callable[..., Digraph]) -> Digraph:
    """The picture at the deepest depth with at most ``target_nodes`` boxes that fits ``MAX_PNG`` at
    ``MIN_DPI``, but never shallower than the first depth that shows the model's parts.

    That floor is the first depth with at least ``MIN_AUTO_BOXES`` boxes (all there are, if
    fewer), even if it has more than ``target_nodes``: a detector whose top level is one
    wrapper, or whose every deeper picture is too large, would otherwise collapse to one
    "model" box. Where the floor has more than ``target_nodes`` boxes (a Swin's blocks hold
    their ops directly: 24 boxes at depth 3, 268 at depth 4), the depth above it is drawn
    with as many of its module calls opened one level deeper, in execution order, as the
    target allows (see :func:`_partly_opened`). A dense floor (more than ``DENSE_WIDTH`` edges
    abreast: DenseNet-201's 125 boxes at depth 3, 1927 edges, took Graphviz 100 s to draw as a
    tangle) is opened the same way, its calls that make the picture dense left closed, and no
    deeper depth is tried (DenseNet-201: 45 boxes, 2 s); where the floor is still over the target (ops
    outside every module: an ONNX file's post-processing), its chains of single ops are drawn as
    one box each (see :func:`_chain_ops`). Only a target below ``MIN_AUTO_BOXES`` is
    honoured as asked. At the floor, a picture too large is re-wrapped (wider rows when too
    tall, narrower when too wide) and drawn at the resolution that fits, below ``MIN_DPI``
    if it must.
    """
    top = _max_depth(graph)
    pictures = [_units(graph, folds, d, **options) for d in range(top + 1)]
    counts = [len(p.units) for p in pictures]
    least = min(MIN_AUTO_BOXES, counts[top])
    if target_nodes < MIN_AUTO_BOXES:  # asked for a small picture: the deepest depth within it
        floor = max((d for d, c in enumerate(counts) if c <= target_nodes), default=0)
    else:
        floor = next(d for d, c in enumerate(counts) if c >= least)
    opened: frozenset[Scope] = frozenset()
    partly = ""
    openable = floor >= 2 and target_nodes >= least
    # a dense floor (DenseNet: more than DENSE_WIDTH edges abreast, see _Layout) is as unreadable as an
    # over-full one, and takes Graphviz minutes: the calls that make it so stay closed
    dense = openable and _dense(draw(floor, None, 0))
    if openable and (counts[floor] > target_nodes or dense):
        opened, count, candidates = _partly_opened(graph, folds, options, floor - 1, pictures[floor - 1],
                                                   pictures[floor], target_nodes,
                                                   lambda o: dense and _dense(draw(floor - 1, None, 0, o)))
        if count >= least:
            partly = f", {len(opened)} of {candidates} module calls opened to depth {floor}"
            floor -= 1
            counts[floor] = count
        else:
            opened = frozenset()
    chained = False
    if counts[floor] > target_nodes >= least:  # no depth collapses ops outside every module (see _chain_ops)
        count = len(_units(graph, folds, floor, **options, opened=opened, chain_ops=True).units)
        if count >= least:
            chained, counts[floor] = True, count
            partly += ", chains of single ops drawn as one box"
    max_w, max_h = (px * 72 / MIN_DPI for px in MAX_PNG)  # in points
    pad = 2 * 4  # Graphviz's default pad, 4 points a side, around the layout's bounding box
    fits = lambda w, h: w <= max_w and h <= max_h  # noqa: E731
    resolution = lambda w, h: min(DPI, MAX_PNG[0] * 72 / (w + pad), MAX_PNG[1] * 72 / (h + pad))  # noqa: E731
    # the picture chosen as it is: fits, at the default resolution (a lower one changes the DOT source)
    final = lambda w, h: fits(w, h) and resolution(w, h) >= DPI  # noqa: E731
    for d in range(top, floor - 1, -1):
        if (counts[d] > target_nodes or dense) and d > floor:  # a depth below a dense one is dense
            continue
        level = "full detail" if d == top else f"depth {d} of {top}"
        bound = f"at most {target_nodes}" if counts[d] <= target_nodes else f"at least {MIN_AUTO_BOXES}"
        mine, chains = (opened, chained) if d == floor else (frozenset(), False)
        caption = f"{level}{partly if d == floor else ''}: {counts[d]} boxes for {len(graph.nodes)} nodes (auto, {bound})"
        dot = draw(d, caption, wrap, mine, chains)
        size = _measure(dot, final)
        if size is None:  # nothing to lay out with: the deepest depth within the box target
            return dot
        w, h = size
        if fits(w, h):
            break
        if d == floor:
            tries = [max(2, wrap // 2), max(2, wrap // 4)] if w > max_w else [wrap * 2, wrap * 4]
            for other in tries if wrap else []:  # the least scaled down of the wrappings
                rewrapped = draw(d, caption, other, mine, chains)
                w2, h2 = _measure(rewrapped, lambda w, h: False) or (w, h)
                if min(max_w / w2, max_h / h2) > min(max_w / w, max_h / h):
                    dot, w, h = rewrapped, w2, h2
    dpi = resolution(w, h)
    if dpi < DPI:
        dot.attr(dpi=f"{math.floor(dpi * 10) / 10:.1f}")  # rounded down: never a pixel over
    return dot


def _partly_opened(graph: Graph, folds: Folds, options: dict[str, Any], depth: int, shallow: _Picture, deep: _Picture,
                   target_nodes: int, dense: Callable[[frozenset[Scope]], bool]) -> tuple[frozenset[Scope], int, int]:
    """Which module calls collapsed at ``depth`` (its picture: ``shallow``) to open one level deeper
    (``deep``, the picture at ``depth + 1``), in execution order, each that keeps the picture within
    ``target_nodes`` boxes and not ``dense``; with the picture's box count and how many calls could
    have been opened.

    A call opened adds the boxes it holds at ``depth + 1``, less its own; folds that span
    several calls (side computations) make that an estimate, so the picture is counted and the
    last call opened is closed again while it is over. A call whose boxes make the picture
    dense (DenseNet's larger blocks, every layer reading each earlier one: see ``_Layout``)
    stays closed.
    """
    collapsed = [u for u in shallow.units if u.kind == "group" and u.key.startswith("g:") and len(u.placement) == depth - 1]
    chosen: list[Scope] = []
    count = len(shallow.units)
    for unit in collapsed:
        grows = len({deep.node2unit[i].key for i in unit.members}) - 1
        if count + grows <= target_nodes:
            chosen.append(graph.nodes[unit.members[0]].scope[depth - 1])
            if dense(frozenset(chosen)):
                chosen.pop()
                continue
            count += grows
    while True:
        count = len(_units(graph, folds, depth, **options, opened=frozenset(chosen)).units)
        if count <= target_nodes or not chosen:
            return frozenset(chosen), count, len(collapsed)
        chosen.pop()


def _dot(graph: Graph, picture: _Picture, caption: str | None, *, wrap: int, show_shapes: bool,
         highlight: set[int], rankdir: str, title: str | None, name_prefix: str, cluster_name: str | None,
         fills: dict[int, str], notes: dict[int, str], legend: list[tuple[str, str]] = []) -> Digraph:  # noqa: B006 - read only
    node2unit, units = picture.node2unit, picture.units
    names = {u.key: f"{name_prefix}u{i}" for i, u in enumerate(units)}

    dot = Digraph(name=cluster_name or "fwdtrace", format="svg")
    dot.attr(rankdir=rankdir, fontname="Helvetica", fontsize="11", nodesep="0.25", ranksep="0.35")
    if not cluster_name:  # a root graph's attribute (see _Layout): what a user's own dot needs to lay it out fast
        dot.attr(newrank="true")
    label = "\n".join(t for t in (title, caption) if t)
    if label:
        dot.attr(label=label, labelloc="t" if title else "b")
    if title:
        dot.attr(fontsize="14")
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
            if u.kind == "side":
                attrs["style"] = "filled,dashed"
            inside = set(u.members)
            fill = next((c for i, c in fills.items() if i in inside), None)
            if fill is not None:
                attrs["fillcolor"] = fill
            if highlight.intersection(u.members):
                # outlined in red; a fill given for the box (its error's colour) is kept under the outline
                attrs.update({k: v for k, v in _HIGHLIGHT.items() if k != "fillcolor" or fill is None})
            attrs["tooltip"] = _tooltip(u, [graph.nodes[i] for i in u.members])
            attrs["tooltip"] += "".join(f"\n{notes[i]}" for i in u.members if i in notes)
            attrs["fwdtrace_members"] = _id_ranges(u.members)
            attrs["class"] = _svg_class(u.kind, u.module_key)
            target.node(names[u.key], label=u.label, **attrs)
        for child in children.get(chain, []):
            with target.subgraph(name=f"cluster_{name_prefix}{len(child)}_{_cluster_id(child)}") as sub:
                sub.attr(label=_scope_label(child[-1]), style="rounded,dashed", color="#999999",
                         fontsize="9", labeljust="l", tooltip=_scope_label(child[-1]),
                         **{"class": _svg_class("scope", _scope_key(child[-1]))})
                emit_units(sub, child)

    emit_units(dot, ())

    # One edge per pair of boxes: a folded box can exchange dozens of tensors with another.
    pair2edges: dict[tuple[str, str], list[Edge]] = {}
    for e in graph.edges:
        u, v = node2unit[e.src], node2unit[e.dst]
        if u is not v:
            pair2edges.setdefault((u.key, v.key), []).append(e)
    for (u_key, v_key), edges in pair2edges.items():
        texts = list(dict.fromkeys(_edge_text(e) for e in edges))
        label = ", ".join(texts) if len(texts) <= 2 else f"{texts[0]}, … {len(texts) - 1} more"
        tooltip = "\n".join(f"%{e.obj_id} {_edge_text(e)}" for e in list(dict.fromkeys(edges))[:_TOOLTIP_LINES])
        dot.edge(names[u_key], names[v_key], label=label if show_shapes else "", tooltip=tooltip)
    for (u_key, v_key), params in _parameter_edges(graph, node2unit).items():
        if (u_key, v_key) not in pair2edges:
            dot.edge(names[u_key], names[v_key], style="dashed", tooltip="parameters: " + ", ".join(params[:_TOOLTIP_LINES]))
    if wrap:
        for u_key, v_key in _wrap_edges([u.key for u in units], set(pair2edges), wrap):
            dot.edge(names[u_key], names[v_key], style="invis")
    if legend:
        _draw_legend(dot, legend, name_prefix)
    return dot


def _draw_legend(dot: Digraph, legend: list[tuple[str, str]], name_prefix: str) -> None:
    """What the fills mean: one filled box per (colour, text), in a row of their own, joined by invisible edges.
    The boxes carry no tooltip: a reader of the SVG that takes boxes with tooltips for calls finds none here."""
    with dot.subgraph(name=f"cluster_{name_prefix}legend") as sub:
        sub.attr(label="legend", style="rounded", color="#999999", fontsize="9", labeljust="l",
                 **{"class": "legend"})
        previous = None
        for i, (color, text) in enumerate(legend):
            name = f"{name_prefix}legend{i}"
            attrs = {"shape": "box", "fillcolor": color, "class": "legend"}
            if color == _HIGHLIGHT["color"]:  # the outline the first divergence gets, not a fill
                attrs.update(_HIGHLIGHT)
            sub.node(name, label=text, **attrs)
            if previous is not None:
                sub.edge(previous, name, style="invis")
            previous = name


KEY_CLASS = "key:"  # the class token that carries a box's module key into the SVG


def _svg_class(kind: str, module_key: str | None) -> str:
    """A box's or cluster's ``class`` attribute, which Graphviz copies into the SVG (``class="node layer
    key:blocks.0.Conv2d"``): its kind, and the module key it stands for, URL-quoted to one token."""
    return kind if module_key is None else f"{kind} {KEY_CLASS}{quote(module_key, safe='')}"


def _edge_text(e: Edge) -> str:
    return _shape_text(e.shape) + ("" if e.dtype == "float32" else f" {e.dtype}")


def _cluster_id(chain: tuple[Scope, ...]) -> str:
    s = chain[-1]
    return f"{s.module_path.replace('.', '_').replace('<', '').replace('>', '').replace('@', '_')}_{s.call_index}"


# -- the `fwdtrace draw` subcommand ----------------------------------------------------------------------
def run_cli(args: argparse.Namespace) -> int:
    """Run ``fwdtrace draw``: trace the factory's model on seeded inputs and write the file its suffix names."""
    import torch

    from ..cli import MODEL_EXPLORER_SUFFIX, forward_failed, load_factory, make_inputs
    from ..tracer import trace

    output = str(args.output)
    lower = output.lower()
    suffixes = [f".{f}" for f in FORMATS] + [".json"]
    if not any(lower.endswith(s) for s in suffixes):
        raise FwdtraceError(
            f"draw expected -o ending in {', '.join(suffixes)} or {MODEL_EXPLORER_SUFFIX}, got {output!r}"
        )
    explorer = lower.endswith(MODEL_EXPLORER_SUFFIX)
    inputs = make_inputs(args)
    model = load_factory(args.factory).eval()
    try:
        with torch.no_grad():
            graph = trace(model, *inputs)
    except FwdtraceError:
        raise
    except Exception as e:
        raise forward_failed(args.factory, inputs, e) from e
    if explorer:
        graph.to_model_explorer(output)
    elif lower.endswith(".json"):
        write_bytes(output, graph.to_json().encode(), caller="draw")
    else:
        render(graph, output, depth=args.depth)
    modules = sum(n.kind == "module" for n in graph.nodes)
    print(f"wrote {output}: {len(graph.nodes)} nodes ({modules} modules), {len(graph.edges)} edges")
    return 0
