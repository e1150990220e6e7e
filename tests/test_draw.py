"""The drawing pass: DOT structure, depth collapsing, repeated blocks, PNG/SVG/PDF files."""

from __future__ import annotations

import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import zoo
from torch import nn

import fwdtrace
from fwdtrace.passes.draw import Digraph, to_dot

GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("FWDTRACE_UPDATE_GOLDEN") == "1"  # regenerate with this flag set


def dot_graph(dot: Digraph) -> tuple[set[str], list[tuple[str, str]]]:
    """The node names and edges of a DOT text, read back with pygraphviz (an independent parser)."""
    import pygraphviz

    agraph = pygraphviz.AGraph(string=dot.source)
    return {str(n) for n in agraph.nodes()}, [(str(u), str(v)) for u, v in agraph.edges()]


def dot_labels(dot: Digraph) -> list[str]:
    """The labels of the boxes drawn, read back with pygraphviz."""
    import pygraphviz

    agraph = pygraphviz.AGraph(string=dot.source)  # kept alive while its nodes are read
    return [str(n.attr.get("label")) for n in agraph.nodes()]


def test_golden_dot_of_a_small_model() -> None:
    model, inputs = zoo.shared_weights()
    source = fwdtrace.trace(model, *inputs).to_dot().source
    path = GOLDEN / "shared_weights.dot"
    if UPDATE_GOLDEN:
        path.write_text(source)
    assert source == path.read_text()


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_every_trace_edge_is_drawn_between_drawn_nodes(name: str) -> None:
    model, inputs = zoo.ZOO[name]()
    graph = fwdtrace.trace(model, *inputs)
    nodes, edges = dot_graph(graph.to_dot(None, collapse_repeats=False, fold_side=False, fold_loops=False))
    assert len(nodes) == len(graph.nodes)  # full detail: one box per node
    assert all(u in nodes and v in nodes for u, v in edges)
    assert len(set(edges)) == len({(e.src, e.dst) for e in graph.edges})


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_depth_collapses_without_dangling_edges(depth: int) -> None:
    model, inputs = zoo.resnetish()
    graph = fwdtrace.trace(model, *inputs)
    nodes, edges = dot_graph(graph.to_dot(depth=depth))
    assert all(u in nodes and v in nodes for u, v in edges)
    # Inputs and outputs stay connected through the collapsed boxes: a path from input to output.
    import networkx as nx

    g = nx.DiGraph(edges)
    assert nx.has_path(g, "u0", f"u{len(nodes) - 1}")
    deeper = [n for n in graph.nodes if n.kind in ("module", "function") and len(n.scope) >= max(depth, 1)]
    assert len(nodes) < len(graph.nodes) and deeper


def test_depth_one_shows_top_level_modules_only() -> None:
    model, inputs = zoo.resnetish()
    labels = " ".join(dot_labels(fwdtrace.trace(model, *inputs).to_dot(depth=1)))
    assert "stem (Sequential)" in labels and "blocks (Sequential)" in labels
    assert "BatchNorm2d" not in labels  # only inside stem and blocks (their tooltips list it)
    assert "16→10" in labels  # fc is at depth 1 and drawn as itself


def test_repeated_blocks_are_folded_and_edges_rerouted() -> None:
    layers = 12
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(layers)])
    graph = fwdtrace.trace(model, torch.ones(2, 8))
    folded = graph.to_dot()
    nodes, edges = dot_graph(folded)
    assert "1 … 11" in folded.source and f"×{layers - 1} same as 0" in folded.source
    assert len(nodes) == 1 + 2 + 1 + 1  # input, the first block's two layers, the fold, output
    assert len(edges) == 4
    full_nodes, _ = dot_graph(graph.to_dot(collapse_repeats=False))
    assert len(full_nodes) == len(graph.nodes) == 2 + 2 * layers


def test_blocks_that_differ_are_not_folded() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8 + i), nn.ReLU(), nn.Linear(8 + i, 8)) for i in range(4)])
    source = fwdtrace.trace(model, torch.ones(1, 8)).to_dot().source
    assert "same as" not in source


def test_highlight_and_prefix_and_cluster_embedding() -> None:
    model, inputs = zoo.mobilenetish()
    graph = fwdtrace.trace(model, *inputs)
    conv = graph.find(target="torch.nn.Conv2d")[0].id
    sub = to_dot(graph, highlight=[conv], name_prefix="t_", cluster_name="cluster_trace", title="trace")
    outer = Digraph()
    outer.subgraph(sub)
    nodes, _ = dot_graph(outer)
    assert all(n.startswith("t_") for n in nodes)
    assert sub.source.count("#c0392b") == 1  # exactly one highlighted box
    assert b"<svg" in outer.pipe(format="svg")


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_render_writes_valid_files(tmp_path: Path, suffix: str, magic: bytes) -> None:
    model, inputs = zoo.densenetish()
    path = fwdtrace.trace(model, *inputs).render(tmp_path / f"graph{suffix}")
    data = Path(path).read_bytes()
    assert data.startswith(magic) and len(data) > 1000
    if suffix == ".svg":
        root = ET.fromstring(data)
        texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
        assert "Conv2d" in texts and "cat" in texts
    assert [p.name for p in tmp_path.iterdir()] == [f"graph{suffix}"]  # no temporary left behind
    umask = os.umask(0)
    os.umask(umask)
    assert Path(path).stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not a private temporary


def test_png_size_matches_layout(tmp_path: Path) -> None:
    import struct

    model, inputs = zoo.resnetish()
    graph = fwdtrace.trace(model, *inputs)
    full = Path(graph.render(tmp_path / "full.png")).read_bytes()
    small = Path(graph.render(tmp_path / "small.png", depth=1)).read_bytes()
    height = lambda png: struct.unpack(">II", png[16:24])[1]  # noqa: E731  (the IHDR chunk)
    assert height(small) < height(full)


def test_rendering_needs_no_graphviz_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` reachable
    assert shutil.which("dot") is None
    model, inputs = zoo.unetish()
    graph = fwdtrace.trace(model, *inputs)
    assert Path(graph.render(tmp_path / "g.png")).stat().st_size > 1000
    assert "<svg" in graph._repr_svg_()  # what Jupyter shows inline


def test_dot_is_deterministic() -> None:
    model, inputs = zoo.transformer_encoder()
    a = fwdtrace.trace(model, *inputs).to_dot().source
    b = fwdtrace.trace(model, *inputs, pin=False).to_dot().source
    assert a == b
    assert not re.search(r"0x[0-9a-f]{6,}", a)  # no addresses


def test_bad_render_arguments(tmp_path: Path) -> None:
    graph = fwdtrace.trace(nn.Linear(2, 2), torch.ones(1, 2))
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^render\(\) expected a path ending in .png, .svg or .pdf, got '.*graph.gif'"):
        graph.render(tmp_path / "graph.gif")
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^render\(\) expected an existing folder"):
        graph.render(tmp_path / "missing" / "graph.png")
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^to_dot\(\) expected depth as 'auto', None or an integer >= 0, got -1"):
        graph.to_dot(depth=-1)
    assert list(tmp_path.iterdir()) == []


def test_onnx_style_scopes_and_unknown_dimensions() -> None:
    from fwdtrace.node import Scope, TensorRef

    graph = fwdtrace.Graph()
    scope = (Scope("c1", ""),)
    x = TensorRef(0, (-1, 8), "float32")
    graph.add_node("input", "input", name="x", outputs=[x])
    graph.add_node("function", "onnx.Relu", scope=scope, inputs=[x], outputs=[TensorRef(1, (-1, 8), "float32")])
    source = graph.to_dot().source
    assert 'label=c1 ' in source or 'label="c1"' in source  # no empty "()" for a scope without a class
    assert "?×8" in source and "-1" not in source
