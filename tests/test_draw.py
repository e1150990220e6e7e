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
from corpus import assert_nothing_lost, cache_field, png_size  # box-membership checks, shared with the corpus
from torch import nn

import fwdtrace
from fwdtrace.passes.draw import Digraph, render_digraph, to_dot

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
    # the function the user called is named, not the helper that checks
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^render\(\) expected depth as 'auto', None or an integer >= 0, got -1"):
        graph.render(tmp_path / "graph.svg", depth=-1)
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^render\(\) expected rankdir in TB, LR, BT, RL, got 'up'"):
        graph.render(tmp_path / "graph.svg", rankdir="up")
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^render\(\) expected options of to_dot \(target_nodes, .*\), got fold_sides"):
        graph.render(tmp_path / "graph.svg", fold_sides=False)
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^render_side_by_side\(\) expected depth as 'auto', None or an integer"):
        fwdtrace.render_side_by_side(graph, tmp_path / "unread.onnx", tmp_path / "pair.svg", depth=-1)
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


def test_render_replaces_a_symlink_at_the_target_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "graph.svg"
    target.symlink_to(victim)
    graph = fwdtrace.trace(nn.Sequential(nn.Linear(2, 2)), torch.ones(1, 2))
    graph.render(target)
    assert victim.read_text() == "keep me"
    assert not target.is_symlink() and "<svg" in target.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.svg", "victim.txt"]  # no temporary file left


# -- readable by default: bounds, and nothing lost in the folding ---------------------------------------
def gpt2() -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=50, n_positions=16)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # padded: the mask arithmetic runs
    return transformers.GPT2Model(config).eval(), (torch.randint(0, 50, (2, 8)),), {"attention_mask": mask}


def bert() -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=50, max_position_embeddings=16)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0
    return transformers.BertModel(config).eval(), (torch.randint(0, 50, (2, 8)),), {"attention_mask": mask}


class PostProcess(nn.Module):
    """A detector's tail in miniature: a conv head, then a per-box loop of small ops at the top
    level (the 32767-px-wide row that made Mask R-CNN unreadable) and a score threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        boxes = self.head(x).flatten(1).view(-1, 4).sigmoid()
        keep = (boxes[:, 2] > 0.1).nonzero()  # noqa: F841  (a dead end)
        out = []
        for i in range(boxes.shape[0]):
            b = boxes[i]
            out.append(torch.stack([b[0] * 2, b[1] * 2, (b[2] - b[0]).clamp(min=0), (b[3] - b[1]).clamp(min=0)]))
        return torch.stack(out)


def models() -> dict[str, object]:
    return {**zoo.ZOO, "gpt2": gpt2, "bert": bert,
            "postprocess": lambda: (PostProcess().eval(), (torch.randn(1, 3, 4, 4),))}


def trace_model(name: str) -> fwdtrace.Graph:
    model, args, *kwargs = models()[name]()  # type: ignore[operator]
    return fwdtrace.trace(model, *args, **(kwargs[0] if kwargs else {}))


@pytest.mark.parametrize("name", sorted(models()))
def test_default_picture_is_within_bounds_and_loses_nothing(name: str, tmp_path: Path) -> None:
    graph = trace_model(name)
    dot = graph.to_dot()
    boxes = assert_nothing_lost(graph, dot)
    assert min(30, len(dot_labels(graph.to_dot(None)))) <= boxes <= 250
    width, height = png_size(graph.render(tmp_path / "g.png"))
    assert width <= 4096 and height <= 16384
    # Whatever depth is asked for, folding keeps every node and edge.
    for depth in range(0, 4):
        assert_nothing_lost(graph, graph.to_dot(depth))
    assert_nothing_lost(graph, graph.to_dot(None, fold_side=False, fold_loops=False, collapse_repeats=False))


def test_a_wide_loop_is_folded_into_a_picture_of_readable_size(tmp_path: Path) -> None:
    graph = trace_model("postprocess")
    full = graph.to_dot(None, fold_loops=False, fold_side=False)
    folded = graph.to_dot(None)
    boxes = 4 * 4 * 4 // 4  # the head's output as boxes of 4
    assert f"loop in the model: ×{boxes - 1} more of" in " ".join(dot_labels(folded))
    assert assert_nothing_lost(graph, folded) * 5 < len(dot_labels(full))
    w_full, _ = png_size(render_digraph(full, tmp_path / "full.png"))
    w_folded, _ = png_size(render_digraph(folded, tmp_path / "folded.png"))
    assert w_folded * 3 < w_full


def test_auto_depth_stays_within_the_target_and_says_so() -> None:
    graph = trace_model("bert")
    levels = max(len(n.scope) for n in graph.nodes) + 1  # depth `levels` collapses nothing
    counts = {d: len(dot_labels(graph.to_dot(d))) for d in range(0, levels + 1)}
    for target in (10, 20):  # a target below 30 boxes is honoured as asked
        dot = graph.to_dot(target_nodes=target)
        chosen = max(d for d, c in counts.items() if c <= target)  # the deepest depth within the target
        labels = dot_labels(dot)
        assert len(labels) == counts[chosen] <= target
        assert f"depth {chosen} of {levels}: {len(labels)} boxes for {len(graph.nodes)} nodes" in dot.source
    # From 30 on, the picture shows at least 30 boxes, if the target has to give.
    floor = min(d for d, c in counts.items() if c >= 30)
    assert max(d for d, c in counts.items() if c <= 30) < floor  # BERT's depths jump over 30
    dot = graph.to_dot(target_nodes=30)
    assert len(dot_labels(dot)) == counts[floor] > 30 and f"{counts[floor]} boxes" in dot.source
    assert "(auto, at least 30)" in dot.source
    assert counts[levels] <= 250 and f"full detail: {counts[levels]} boxes" in graph.to_dot().source
    explicit = graph.to_dot(1)  # honoured, no caption
    assert len(dot_labels(explicit)) == counts[1] and "auto" not in explicit.source
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^to_dot\(\) expected target_nodes as an integer >= 1, got 0"):
        graph.to_dot(target_nodes=0)


class Stage(nn.Module):
    """Distinct layers one after the other: nothing to fold."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Detector(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        widths = list(range(4, 5 + n))
        self.backbone, self.rpn, self.roi_heads = Stage(widths), Stage(widths[::-1]), Stage(widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.roi_heads(self.rpn(self.backbone(x)))


class Wrapped(nn.Module):
    """Deep and narrow, as torchvision's detectors: the top level is one module holding everything."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.model = Detector(n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@pytest.mark.parametrize("layers", [40, 60])
def test_auto_depth_never_collapses_the_model_to_a_few_boxes(layers: int, tmp_path: Path) -> None:
    # 40 layers a stage: full detail is within 250 boxes but too tall for 72 dpi; 60: over 250 boxes.
    # Every shallower depth shows 5 boxes or fewer (model, or backbone, rpn, roi_heads).
    graph = fwdtrace.trace(Wrapped(layers).eval(), torch.randn(1, 4))
    full = len(dot_labels(graph.to_dot(None)))
    assert full == len(graph.nodes) == 6 * layers + 2
    assert all(len(dot_labels(graph.to_dot(d))) <= 5 for d in range(3))
    dot = graph.to_dot()
    boxes = assert_nothing_lost(graph, dot)
    if layers == 40:
        assert boxes == full and f"full detail: {full} boxes for {full} nodes (auto, at most 250)" in dot.source
    else:  # the depth above, with as many stages opened in order as 250 boxes allow: two of three
        stage = 2 * layers  # a stage's Linear and relu calls
        assert boxes == 2 + 2 * stage + 1 <= 250  # input, output, two stages opened, one collapsed
        assert f"depth 2 of 3, 2 of 3 module calls opened to depth 3: {boxes} boxes" in dot.source
        labels = dot_labels(dot)
        assert "model.roi_heads (Stage)" in labels and "model.backbone (Stage)" not in labels
    width, height = png_size(render_digraph(dot, tmp_path / "g.png"))
    assert width <= 4096 and height <= 16384


def test_wide_fan_outs_wrap_into_rows(tmp_path: Path) -> None:
    class Fan(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([torch.tanh(x * (i + 1)) for i in range(40)]).sum(0)

    graph = fwdtrace.trace(Fan(), torch.ones(3))
    options = dict(fold_loops=False)
    wrapped, flat = graph.to_dot(None, **options), graph.to_dot(None, wrap=0, **options)
    assert_nothing_lost(graph, wrapped)
    (w1, h1), (w0, h0) = (png_size(render_digraph(d, tmp_path / f"{i}.png")) for i, d in enumerate((wrapped, flat)))
    assert w1 < w0 * 0.9 and h1 > h0 * 1.5  # rows: narrower and taller (the long edges keep some width)


def test_svg_tooltips_say_where_what_and_what_a_box_holds(tmp_path: Path) -> None:
    model, inputs = zoo.resnetish()
    graph = fwdtrace.trace(model, *inputs)
    root = ET.parse(graph.render(tmp_path / "g.svg", depth=1)).getroot()
    titles = [a.get("{http://www.w3.org/1999/xlink}title") or "" for a in root.iter("{http://www.w3.org/2000/svg}a")]
    fc = next(t for t in titles if t.startswith("fc · torch.nn.Linear"))
    assert "in: 1×16 float32" in fc and "out: 1×10 float32" in fc and "in_features: 16" in fc
    blocks = next(t for t in titles if t.startswith("blocks (Sequential), collapsed"))
    inside = [n for n in graph.nodes if n.module_path.startswith("blocks.")]
    assert len(blocks.splitlines()) == 1 + len(inside)  # one line per node it holds
    assert "blocks.1.down.0: Conv2d 8→16 k1 s2 (1×8×16×16 → 1×16×8×8)" in blocks


# -- the box graph in any order: folding may close cycles, ONNX may order boxes otherwise ----------------
class RunningBuffer(nn.Module):
    """A buffer reassigned in forward, read again by the next step."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = self.lin(x)
            self.running = 0.9 * self.running + 0.1 * x.mean(0)
            x = x - self.running
        return x


class Coupling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor, logdet: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, -1)
        s, t = self.net(a).chunk(2, -1)
        return torch.cat([b * torch.exp(s) + t, a], -1), logdet + s.sum(-1)


class Flow(nn.Module):
    """A normalizing flow: affine couplings that also sum a log-determinant."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Coupling() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = torch.zeros(x.shape[0])
        for layer in self.layers:
            x, logdet = layer(x, logdet)
        return x, logdet


class EmbedConvLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.lstm = nn.LSTM(8, 8, batch_first=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.lstm(h)[0]


CYCLIC = {  # model, inputs, the exporters whose ONNX graph crashed the draw pass
    "running_buffer": (RunningBuffer, (torch.randn(3, 4),), ("torchscript", "fwdtrace")),
    "flow": (Flow, (torch.randn(3, 4),), ("fwdtrace",)),
    "embed_conv_lstm": (EmbedConvLSTM, (torch.randint(0, 20, (2, 6)),), ("fwdtrace",)),
}


def export(model: nn.Module, args: tuple[torch.Tensor, ...], exporter: str) -> object:
    if exporter == "fwdtrace":
        return fwdtrace.to_onnx(model, *args)
    return fwdtrace.export_onnx(model, *args, exporter=exporter)


@pytest.mark.parametrize("name", sorted(CYCLIC))
def test_boxes_are_ranked_whatever_order_they_come_in(name: str, tmp_path: Path) -> None:
    factory, args, exporters = CYCLIC[name]
    torch.manual_seed(0)
    model = factory().eval()
    graph = fwdtrace.trace(model, *args)
    for exporter in exporters:
        proto = export(model, args, exporter)
        og = fwdtrace.onnx_graph(proto)  # type: ignore[arg-type]
        for depth in ("auto", None):
            assert_nothing_lost(og, og.to_dot(depth))
        svg = fwdtrace.render_side_by_side(graph, proto, tmp_path / f"{exporter}.svg")  # type: ignore[arg-type]
        assert "exported (ONNX)" in Path(svg).read_text()


def test_side_by_side_of_bert_draws(tmp_path: Path) -> None:
    model, args, kwargs = bert()
    graph = fwdtrace.trace(model, *args, **kwargs)
    proto = fwdtrace.export_onnx(model, *args, exporter="torchscript", **kwargs)
    og = fwdtrace.onnx_graph(proto)
    for depth in ("auto", None, 1, 2):
        assert_nothing_lost(og, og.to_dot(depth))
    assert "exported (ONNX)" in Path(fwdtrace.render_side_by_side(graph, proto, tmp_path / "both.svg")).read_text()


def test_side_by_side_of_gpt2_draws_the_onnx_layers(tmp_path: Path) -> None:
    model, args, kwargs = gpt2()
    graph = fwdtrace.trace(model, *args, **kwargs)
    proto = fwdtrace.export_onnx(model, *args, exporter="torchscript", **kwargs)
    og = fwdtrace.onnx_graph(proto)
    labels = dot_labels(og.to_dot())
    # The embedding's Gather and each Conv1D's Gemm, in the scopes the exporter recorded (leaf
    # layers, one box each); layers 1 and 2 are folded as repeats of layer 0.
    assert {"wte", "c_attn", "c_proj", "c_fc"} <= set(labels)
    assert not any(label.startswith("constants and side arithmetic") for label in labels)
    svg = Path(fwdtrace.render_side_by_side(graph, proto, tmp_path / "both.svg")).read_text()
    assert svg.count(">c_attn</text>") == 2  # one box a side
    assert svg.count(">Conv1D</text>") == 4  # the trace's layer 0: c_attn, c_proj, c_fc, c_proj


def test_rendering_prints_nothing_and_graphviz_speaks_in_fwdtrace_words(tmp_path: Path) -> None:
    import subprocess
    import sys

    # A fresh process: fontconfig complains once, when Graphviz first measures a label.
    code = ("import torch, fwdtrace; g = fwdtrace.trace(torch.nn.Linear(2, 2), torch.ones(1, 2)); "
            f"g.render({str(tmp_path / 'g.png')!r}); g.render({str(tmp_path / 'g.svg')!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == ""
    from fwdtrace.passes.draw import layout_bytes

    with pytest.raises(fwdtrace.FwdtraceError, match=r"^Graphviz could not lay out the picture: syntax error in line 1"):
        layout_bytes("digraph { a -> ; }", "svg")
    with pytest.warns(UserWarning, match=r"^Graphviz: using box for unknown shape nonsense"):
        assert b"<svg" in layout_bytes("digraph { a [shape=nonsense] }", "svg")


def test_a_png_over_cairos_size_limit_is_a_warning_not_a_line_on_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    """Graphviz prints "(null): graph is too large for cairo-renderer bitmaps. Scaling by 0.85 to fit" on the
    process's stderr for a bitmap over its limit (a 400-inch-wide box here): fwdtrace says it once, as a warning."""
    from fwdtrace.passes.draw import layout_bytes

    with pytest.warns(UserWarning, match=r"^Graphviz: the picture is over cairo's bitmap size limit and was drawn at "
                                         r"0\.85 of its size; the SVG keeps every detail$"):
        png = layout_bytes('digraph { a [shape=box, width=400, height=0.3, fixedsize=true, label=""] }', "png")
    assert png.startswith(b"\x89PNG")
    assert capfd.readouterr().err == ""


def test_leaf_layers_are_one_box_and_the_empty_cache_is_folded() -> None:
    graph = trace_model("gpt2")
    model, args, *kwargs = models()["gpt2"]()  # type: ignore[operator]
    cache = cache_field(model(*args, **(kwargs[0] if kwargs else {})))
    folded, opened = graph.to_dot(None), graph.to_dot(None, open_leaf_layers=True)
    assert_nothing_lost(graph, folded)
    assert_nothing_lost(graph, opened)
    agraph = __import__("pygraphviz").AGraph(string=folded.source)
    label2members = {str(n.attr["label"]): str(n.attr["fwdtrace_members"]) for n in agraph.nodes()}
    # transformers' Conv1D (view, addmm, view) and NewGELUActivation (8 ops): one box each, holding
    # exactly the calls recorded in that module call; the graph keeps them.
    for label, path in (("Conv1D\nc_attn", "h.0.attn.c_attn"), ("NewGELUActivation\nact", "h.0.mlp.act")):
        inside = [n.id for n in graph.nodes if n.module_path == path]
        assert len(inside) == (3 if "Conv1D" in label else 8) and all(graph.nodes[i].kind == "function" for i in inside)
        assert label2members[label] == f"{inside[0]}-{inside[-1]}"
    labels, open_labels = set(dot_labels(folded)), set(dot_labels(opened))
    assert "addmm" not in labels and "tanh" not in labels and {"addmm", "tanh"} <= open_labels
    # The first cache update concatenates keys and values onto tensors made empty from nothing.
    cats = [n for n in graph.nodes if n.target == "torch.cat" and n.module_path == "h.0.attn"]
    assert len(cats) == 2 and all(0 in n.inputs[0].shape and n.inputs[1].shape == n.outputs[0].shape for n in cats)
    assert "cat" not in labels and "tensor" not in labels and "cat" in dot_labels(graph.to_dot(None, fold_side=False))
    # ... feeding the attention and the cache tensors the model returns (outputs of the trace)
    fed = sorted(label for label in dot_labels(folded) if label.startswith("empty cache, 2 ops\n"))
    assert fed == [f"empty cache, 2 ops\n→ h.0.attn, output: output_{cache}_layers[0]_{kv}" for kv in ("keys", "values")]
    # every output is a box of its own: a cache's run of outputs (two per layer) is no loop
    outputs = {str(n.id) for n in graph.nodes if n.kind == "output"}
    assert len(outputs) == 7 and outputs <= {str(n.attr["fwdtrace_members"]) for n in agraph.nodes()}


def test_only_calls_of_functions_alone_are_leaf_layers() -> None:
    class Scale(nn.Module):  # a layer written with functions: a leaf
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w + 1

    class Holder(nn.Module):  # calls a layer: not a leaf, though it has functions of its own
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).relu() - 2

    model = nn.Sequential(Scale(), Holder(), nn.Sequential(Scale()))
    graph = fwdtrace.trace(model, torch.ones(2, 4))
    labels = dot_labels(graph.to_dot(None))
    assert labels.count("Scale\n0") == 2  # model.0 and model.2.0
    assert {"relu", "sub", "Linear\nlin\n4→4"} <= set(labels)  # Holder stays open
    opened = dot_labels(graph.to_dot(None, open_leaf_layers=True))
    assert "mul" not in labels and "add" not in labels and opened.count("mul") == opened.count("add") == 2


# -- `fwdtrace draw` ----------------------------------------------------------------------------------
def _seeded_inputs(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """What the CLI's --input-shape/--dtype promise: seeded normal floats, token ids in [0, 10)."""
    generator = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    return [torch.randint(0, 10, s, generator=generator, dtype=dtype) for s in shapes]


@pytest.mark.parametrize(
    "factory, argv, model, inputs, depth",
    [
        ("zoo:ResNetish", ["--input-shape", "1,3,16,16", "--depth", "1"], zoo.ResNetish, ((1, 3, 16, 16),), 1),
        ("zoo:EmbedNormGelu", ["--input-shape", "2,8", "--dtype", "int64", "--depth", "all"], zoo.EmbedNormGelu,
         ((2, 8),), None),
        ("zoo:ResNetish", ["--input-shape", "1,3,16,16"], zoo.ResNetish, ((1, 3, 16, 16),), "auto"),
    ],
)
def test_the_draw_command_writes_what_the_api_draws(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], factory: str, argv: list[str], model: type, inputs: tuple,
    depth: int | str | None,
) -> None:
    from fwdtrace.cli import main

    dtype = torch.int64 if "int64" in argv else torch.float32
    graph = fwdtrace.trace(model().eval(), *_seeded_inputs(*inputs, dtype=dtype))  # the reference: the API
    assert main(["draw", factory, *argv, "-o", str(tmp_path / "g.svg")]) == 0
    assert (tmp_path / "g.svg").read_text() == Path(graph.render(str(tmp_path / "ref.svg"), depth=depth)).read_text()
    assert main(["draw", factory, *argv, "-o", str(tmp_path / "g.json")]) == 0
    assert (tmp_path / "g.json").read_text() == graph.to_json()
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"wrote {tmp_path / 'g.json'}: {len(graph.nodes)} nodes " \
        f"({len(graph.find(kind='module'))} modules), {len(graph.edges)} edges"
    assert main(["draw", factory, *argv, "-o", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes().startswith(b"\x89PNG")


def test_the_draw_command_refuses_what_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fwdtrace.cli import main

    argv = ["draw", "zoo:ResNetish", "--input-shape", "1,3,16,16"]
    assert main([*argv, "-o", str(tmp_path / "g.gif")]) == 2
    assert capsys.readouterr().err.startswith("fwdtrace draw: error: draw expected -o ending in .png, .svg, .pdf, .json")
    assert main([*argv, "--depth", "-1", "-o", str(tmp_path / "g.svg")]) == 2
    assert "expected auto, all or an integer >= 0, got '-1'" in capsys.readouterr().err
    assert main(["draw", "zoo:ResNetish", "--input-shape", "1,5,16,16", "-o", str(tmp_path / "g.svg")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fwdtrace draw: error: zoo:ResNetish: the forward failed on inputs float32[1, 5, 16, 16]: RuntimeError: ")
    assert "raised in module 'stem.0.Conv2d'" in err  # the layer is named
    assert not list(tmp_path.iterdir())
    explorer = tmp_path / "g.model-explorer.json"
    assert main([*argv, "-o", str(explorer)]) == 0 and explorer.exists()


def test_render_lays_out_once_per_picture_and_draws_what_a_new_layout_draws(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The automatic depth measures the picture with a layout; render() draws from that same layout,
    # and a second format reuses the measured size: one dot layout per file, not two.
    from fwdtrace.passes import draw

    model, inputs = zoo.resnetish()
    graph = fwdtrace.trace(model, *inputs)
    layouts = []
    monkeypatch.setattr(draw, "_SIZES", type(draw._SIZES)())
    real = draw._Layout.__init__
    monkeypatch.setattr(draw._Layout, "__init__", lambda self, source: (layouts.append(source), real(self, source))[1])
    png, svg = graph.render(tmp_path / "g.png"), graph.render(tmp_path / "g.svg")
    assert len(layouts) == 2 and layouts[0] == layouts[1] == graph.to_dot().source
    monkeypatch.undo()
    source = graph.to_dot().source
    assert Path(png).read_bytes() == draw.layout_bytes(source, "png")
    assert Path(svg).read_bytes() == draw.layout_bytes(source, "svg")


class ScaledByConstants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * torch.full((4,), 2.0)
        torch.tensor([2, 2, 1])  # read by nothing: a dead end, its own box
        return y.reshape(2, 2, 1) + torch.ones(1)


def test_a_constant_feeding_one_op_is_drawn_inside_its_box() -> None:
    # An ONNX graph has a Constant per Unsqueeze, Slice or Reshape (RetinaNet by TorchScript: 218 of 742 boxes).
    graph = fwdtrace.trace(ScaledByConstants().eval(), torch.randn(1, 4))
    dot = graph.to_dot(None)
    assert assert_nothing_lost(graph, dot) == len(graph.nodes) - 2
    import pygraphviz

    agraph = pygraphviz.AGraph(string=dot.source)  # kept alive while its nodes are read
    tooltips = {str(n.attr["label"]): str(n.attr["tooltip"]) for n in agraph.nodes()}
    assert tooltips["mul"].endswith("with its input (root): full (- → 4)")
    assert tooltips["add"].endswith("with its input (root): ones (- → 1)")
    assert "tensor" in tooltips  # a dead end feeds no box
    assert len(dot_labels(graph.to_dot(None, fold_side=False))) == len(graph.nodes)  # fold_side=False draws each


def test_side_by_side_draws_each_side_at_its_automatic_depth(tmp_path: Path) -> None:
    # Full detail on both sides took Graphviz over 300 s on timm's swinv2_cr_tiny_224: each side is
    # drawn at the depth render() would choose for it alone, an explicit depth at that depth.
    model, x = Wrapped(6).eval(), torch.randn(1, 4)
    graph = fwdtrace.trace(model, x)
    proto = fwdtrace.export_onnx(model, x, exporter="torchscript")
    og = fwdtrace.onnx_graph(proto, prune=True)
    captions = [re.search(r'label="([^"]*\(auto, [^"]*)"', g.to_dot().source) for g in (graph, og)]
    assert all(captions)
    svg = Path(fwdtrace.render_side_by_side(graph, proto, tmp_path / "auto.svg")).read_text()
    for caption in captions:
        assert f">{caption[1]}</text>" in svg  # type: ignore[index]
    explicit = Path(fwdtrace.render_side_by_side(graph, proto, tmp_path / "one.svg", depth=1)).read_text()
    assert "(auto," not in explicit and "model (Detector)" in explicit


class Branches(nn.Module):
    """A layer, then 30 short branches of plain ops: in an ONNX file they sit outside every module scope."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(30, 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        first = [torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.neg, torch.abs]
        last = [torch.exp, torch.relu, torch.square, torch.sqrt, torch.log1p]  # no run of equal branches: no loop
        return torch.stack([last[k // 6](first[k % 6](h[:, k]) * (k + 1)) for k in range(30)])


def test_ops_outside_every_module_are_drawn_as_chains_when_no_depth_fits(tmp_path: Path) -> None:
    # An ONNX file's post-processing is hundreds of ops no depth collapses (torchvision's RetinaNet by
    # to_onnx: 270 boxes at the first depth of 30 or more). Each chain of single ops becomes one box.
    model, x = Branches().eval(), torch.randn(2, 30)
    og = fwdtrace.onnx_graph(fwdtrace.export_onnx(model, x, exporter="torchscript"))
    target = 60
    first = len(dot_labels(og.to_dot(1)))  # the first depth of 30 boxes or more, and the last
    assert first > target
    dot = og.to_dot(target_nodes=target)
    boxes = assert_nothing_lost(og, dot)
    assert 30 <= boxes <= target and f"chains of single ops drawn as one box: {boxes} boxes" in dot.source
    chains = [label for label in dot_labels(dot) if " → " in label]
    assert len(chains) == 30 and all(label.endswith(" ops") for label in chains), chains[:3]
    png_size(render_digraph(dot, tmp_path / "g.png"))


def test_a_large_layout_bounds_its_network_simplex_passes() -> None:
    # timm's swinv2_cr_tiny_224 side by side at full detail (1335 boxes): 18 s of a 20 s layout
    # were network simplex; bounded, 4 s and a picture of the same size. Small pictures stay exact.
    from fwdtrace.passes.draw import LARGE_LAYOUT, NSLIMIT, layout_bytes

    def limits(boxes: int, own: str = "") -> dict[str, str]:
        edges = " ".join(f"n{i} -> n{i + 1};" for i in range(0, boxes - 1, 2))
        laid = layout_bytes(f"digraph {{ {own} {' '.join(f'n{i};' for i in range(boxes))} {edges} }}", "dot").decode()
        return dict(re.findall(r"\b(nslimit1?)=(\w+)", laid.split("];", 1)[0]))  # the graph's attributes

    assert limits(LARGE_LAYOUT + 1) == {"nslimit": str(NSLIMIT), "nslimit1": str(NSLIMIT)}
    assert limits(LARGE_LAYOUT) == {}
    assert limits(LARGE_LAYOUT + 1, "nslimit=7;") == {"nslimit": "7", "nslimit1": str(NSLIMIT)}  # a user's own stands
    # edges count too: DenseNet-121 at depth 4 has 433 boxes and 967 edges
    assert limits(LARGE_LAYOUT // 4, " ".join(f"n0 -> n{i % 8 + 1};" for i in range(LARGE_LAYOUT + 1))) == {
        "nslimit": str(NSLIMIT), "nslimit1": str(NSLIMIT)}


class _DenseBlock(nn.Module):
    """DenseNet's pattern: each layer reads the concatenation of every earlier output."""

    def __init__(self, layers: int = 8, growth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Conv2d(growth * (i + 1), growth, 1) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


class _DenseNet(nn.Module):
    """DenseNet's layout in small: a stem, two small dense blocks and a large one, with transitions."""

    def __init__(self, growth: int = 2) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, growth, 1), _DenseBlock(6, growth), nn.Conv2d(7 * growth, growth, 1),
            _DenseBlock(6, growth), nn.Conv2d(7 * growth, growth, 1), _DenseBlock(24, growth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def test_the_automatic_picture_keeps_a_dense_block_closed() -> None:
    # torchvision's DenseNet-201 by default: depth 3, 125 boxes and 1927 edges, 600 abreast: Graphviz
    # took 100 s to draw a tangle. Its parts are opened call by call, the blocks that make it dense closed.
    import pygraphviz

    from fwdtrace.passes.draw import DENSE_WIDTH, MIN_AUTO_BOXES, _widest_skip

    graph = fwdtrace.trace(_DenseNet(), torch.randn(1, 3, 3, 3))
    full = pygraphviz.AGraph(string=graph.to_dot(3).source)
    assert _widest_skip(full.edges_iter()) > DENSE_WIDTH and full.number_of_nodes() < 250  # within the box target, yet dense
    dot = graph.to_dot()
    assert "depth 2 of 3, 2 of 3 module calls opened to depth 3" in dot.source, re.findall(r"depth [^\"]*", dot.source)
    boxes = assert_nothing_lost(graph, dot)
    assert boxes >= MIN_AUTO_BOXES and _widest_skip(pygraphviz.AGraph(string=dot.source).edges_iter()) <= DENSE_WIDTH
    convs = [label for label in dot_labels(dot) if label.startswith("Conv2d")]
    assert len(convs) == 3 + 2 * 6  # the stem, transitions and small blocks' layers drawn, the large block one box
    assert any(label.startswith("features.5") for label in dot_labels(dot)), dot_labels(dot)


def test_a_dense_layout_places_its_shape_labels_after_ranking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A label ranked in doubles the ranks its edge crosses: routing DenseNet-121 at depth 4 (433 boxes,
    # 967 edges, 156 abreast) took Graphviz over 10 minutes. Dense pictures place each box's shapes after the layout.
    import pygraphviz

    from fwdtrace.passes import draw
    from fwdtrace.passes.draw import DENSE_WIDTH, _widest_skip, layout_bytes

    def dot(model: nn.Module) -> str:
        return fwdtrace.trace(model, torch.randn(1, 2, 3, 3)).to_dot(None).source

    # a 24-layer block's middle: x and the 11 outputs before it, each read by the 12 layers after it
    # and by the last concatenation, pass over it, as 156 edges do in DenseNet-121's largest block
    assert _widest_skip(pygraphviz.AGraph(string=dot(_DenseBlock(24))).edges_iter()) == 12 * 13 > DENSE_WIDTH
    # a few long edges abreast keep their labels ranked in, between the boxes, as a chain does
    graph = fwdtrace.trace(_DenseBlock(8), torch.randn(1, 2, 3, 3))
    source = graph.to_dot(None).source
    agraph = pygraphviz.AGraph(string=source)
    assert _widest_skip(agraph.edges_iter()) == 4 * 5 <= DENSE_WIDTH
    laid_small = pygraphviz.AGraph(string=layout_bytes(source, "dot").decode())
    assert all(e.attr.get("label") and not e.attr.get("xlabel") for e in laid_small.edges())
    assert not laid_small.graph_attr.get("mclimit")  # crossing minimisation left whole
    chain = dot(nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU()))
    kept = pygraphviz.AGraph(string=layout_bytes(chain, "dot").decode())  # alive while its edges are read
    assert len(kept.edges()) == 3 and all(e.attr.get("label") and not e.attr.get("xlabel") for e in kept.edges())
    # over the width (lowered here, to keep the test fast), each box's shapes are placed after ranking
    monkeypatch.setattr(draw, "DENSE_WIDTH", 4 * 5 - 1)
    wanted = {(e[0], e.attr["label"]) for e in agraph.edges() if e.attr.get("label")}
    assert len(wanted) < agraph.number_of_edges()  # fan-outs repeat a shape
    laid = pygraphviz.AGraph(string=layout_bytes(source, "dot").decode())
    assert not [e for e in laid.edges() if e.attr.get("label")]
    assert sorted((e[0], e.attr["xlabel"]) for e in laid.edges() if e.attr.get("xlabel")) == sorted(wanted)
    # crossing minimisation's iterations scaled by the width over the edges abreast (DenseNet-201 at
    # depth 3, 600 abreast: 60 s of a 106 s layout), a user's own limit kept
    assert float(laid.graph_attr["mclimit"]) == pytest.approx(19 / 20, abs=1e-3)
    monkeypatch.setattr(draw, "DENSE_WIDTH", 1)
    laid = pygraphviz.AGraph(string=layout_bytes(source, "dot").decode())
    assert float(laid.graph_attr["mclimit"]) == draw.MIN_MCLIMIT
    own = source.replace("{", "{ mclimit=2;", 1)
    laid = pygraphviz.AGraph(string=layout_bytes(own, "dot").decode())
    assert laid.graph_attr["mclimit"] == "2"
    monkeypatch.setattr(draw, "DENSE_WIDTH", 4 * 5 - 1)
    svg = Path(graph.render(tmp_path / "dense.svg", depth=None)).read_text()
    assert {label for _, label in wanted} <= set(re.findall(r">([^<>]+)</text>", svg))
