"""Drawing where Graphviz's system libraries are missing (slim and CUDA container images).

Each case runs in a fresh interpreter whose import of pygraphviz fails as it does there
(``libgobject-2.0.so.0: cannot open shared object file``), with PATH holding a ``dot``
executable or not. The stand-in ``dot`` lays out with this machine's pygraphviz in its own
process (as ``dot -Tfmt`` does, DOT on stdin) and logs its calls: proof it was used.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import fwdtrace
from fwdtrace.passes import draw

ROOT = Path(__file__).resolve().parents[1]
LOAD_ERROR = "libgobject-2.0.so.0: cannot open shared object file: No such file or directory"

NO_LIBRARIES = f"""
import importlib.abc, sys

class NoGraphvizLibraries(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "pygraphviz" or name.startswith("pygraphviz."):
            raise ImportError({LOAD_ERROR!r})

sys.meta_path.insert(0, NoGraphvizLibraries())
"""

MODEL = """
import json, os, sys, torch, fwdtrace
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
g = fwdtrace.trace(model, torch.ones(1, 3, 8, 8))
out = sys.argv[1]
"""


def _fake_dot(folder: Path, log: Path) -> Path:
    """A ``dot`` executable: ``dot -Tfmt`` reads DOT on stdin and writes the picture, via pygraphviz elsewhere."""
    folder.mkdir()
    dot = folder / "dot"
    dot.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import sys
        import pygraphviz
        fmt = next(a[2:] for a in sys.argv[1:] if a.startswith("-T"))
        with open({str(log)!r}, "a") as f:
            f.write(" ".join(sys.argv[1:]) + "\\n")
        sys.stdout.buffer.write(pygraphviz.AGraph(string=sys.stdin.read()).draw(format=fmt, prog="dot"))
    """))
    dot.chmod(0o755)
    return folder


SCRIPT = """
from fwdtrace import FwdtraceError
from fwdtrace.passes.draw import layout_missing
# PATH without any dot
dot = g.to_dot()  # the automatic depth, with nothing to measure it
g.to_model_explorer(os.path.join(out, "me.json"))
result = {"dot": dot.source, "json": len(g.to_json()), "nx": g.to_networkx().number_of_nodes(),
          "me": os.path.exists(os.path.join(out, "me.json")), "missing": layout_missing(), "svg": g._repr_svg_()}
try:
    g.render(os.path.join(out, "graph.png"))
except FwdtraceError as e:
    result["error"] = str(e)
try:
    dot.pipe(format="png")
except FwdtraceError as e:
    result["pipe"] = str(e)
# then a dot executable on PATH
os.environ["PATH"] = sys.argv[2] + os.pathsep + os.environ["PATH"]
result["drawn"] = open(g.render(os.path.join(out, "graph.svg"))).read()
result["drawn_dot"] = g.to_dot().source
result["loaded"] = "pygraphviz" in sys.modules
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def without_libraries(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What a process whose pygraphviz cannot load did, with no dot on PATH, then with one (its calls in "calls")."""
    assert draw.shutil.which("dot") is None or pytest.skip("a system dot is installed")  # this machine has none
    root = tmp_path_factory.mktemp("no_graphviz")
    empty = root / "bin"
    empty.mkdir()
    log = root / "dot.log"
    folder = _fake_dot(root / "graphviz", log)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": str(empty)}
    done = subprocess.run([sys.executable, "-c", NO_LIBRARIES + MODEL + SCRIPT, str(root), str(folder)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "calls": log.read_text().splitlines()}


def test_without_graphviz_files_need_no_layout_and_render_says_what_to_install(without_libraries: dict) -> None:
    got = without_libraries
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 2))
    g = fwdtrace.trace(model, torch.ones(1, 3, 8, 8))
    assert got["dot"] == g.to_dot().source  # a small model: the same picture as where Graphviz measures it
    assert got["json"] == len(g.to_json()) and got["nx"] == len(g.nodes) and got["me"]
    assert got["svg"].count("<svg") == 1 and not got["loaded"]  # fwdtrace's own layout (test below)
    error = got["error"]
    assert error.startswith("render() could not lay out the picture: pygraphviz cannot load the system's "
                            "libgobject-2.0.so.0 (ImportError: libgobject-2.0.so.0: cannot open"), error
    for hint in ("apt-get install libglib2.0-0 libxrender1", "apt-get install graphviz libgraphviz-dev",
                 "dnf install graphviz", "conda install -c conda-forge pygraphviz", "no Graphviz dot executable",
                 "render('graph.svg') draws fwdtrace's own layout", "pip install cairosvg"):
        assert hint in error
    assert got["missing"] == error
    assert got["pipe"] == error.replace("render()", "Digraph.pipe()", 1)  # named by what the user called


class _Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.head(self.block(x) + x), -1)


def _drawn(svg: str) -> dict:
    """What an SVG shows, read as Graphviz writes it: each box's label and rectangle by DOT name,
    each cluster's rectangle by name, each edge's ends."""
    ns = {"s": "http://www.w3.org/2000/svg"}
    root = ET.fromstring(svg.encode())
    boxes, clusters, edges = {}, {}, []
    for g in root.iter("{http://www.w3.org/2000/svg}g"):
        kind, title = (g.get("class") or "").split(" ")[0], g.findtext("s:title", namespaces=ns)
        texts = "\n".join(t.text or "" for t in g.iter("{http://www.w3.org/2000/svg}text"))
        shape = next(iter([*g.iterfind(".//s:rect", ns), *g.iterfind(".//s:ellipse", ns)]), None)
        if kind in ("node", "cluster"):
            if shape.tag.endswith("ellipse"):
                cx, cy, rx, ry = (float(shape.get(a)) for a in ("cx", "cy", "rx", "ry"))
                rect = (cx - rx, cy - ry, cx + rx, cy + ry)
            else:
                x, y, w, h = (float(shape.get(a)) for a in ("x", "y", "width", "height"))
                rect = (x, y, x + w, y + h)
            (boxes if kind == "node" else clusters)[title] = {"label": texts, "rect": rect, "class": g.get("class")}
        elif kind == "edge":
            edges.append(tuple(title.split("->")))
    return {"boxes": boxes, "clusters": clusters, "edges": edges}


def _inside(a: tuple, b: tuple) -> bool:
    return b[0] <= a[0] and b[1] <= a[1] and a[2] <= b[2] and a[3] <= b[3]


def _apart(a: tuple, b: tuple) -> bool:
    return a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


def no_graphviz(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This process as where Graphviz cannot lay out: pygraphviz unimportable, no dot on PATH."""
    monkeypatch.setitem(sys.modules, "pygraphviz", None)  # import pygraphviz raises ImportError
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert draw.layout_missing() is not None


@pytest.mark.parametrize("rankdir", ["TB", "LR", "BT", "RL"])
def test_without_graphviz_render_and_the_notebook_draw_fwdtraces_own_layout(
        rankdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every box, label, cluster and edge the draw pass wrote (as pygraphviz reads its DOT) is in the SVG;
    boxes do not overlap, each lies inside its clusters, sibling clusters apart; one warning says what to install."""
    g = fwdtrace.trace(_Nested(), torch.ones(1, 4))
    reference = draw._agraph(g.to_dot(depth=None, rankdir=rankdir).source)  # Graphviz's own reading
    labels = {str(n): n.attr["label"] for n in reference.nodes()}
    edges = sorted((str(u), str(v)) for u, v in reference.edges())
    cluster2boxes = {str(s.name): {str(n) for n in s.nodes()} for s in reference.subgraphs()}
    no_graphviz(monkeypatch, tmp_path)
    for how in ("render", "notebook"):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            if how == "render":
                svg = Path(g.render(tmp_path / "graph.svg", depth=None, rankdir=rankdir)).read_text()
            else:
                svg = g._repr_svg_()
        assert [w.category for w in said] == [fwdtrace.FwdtraceWarning], [str(w.message) for w in said]
        message = str(said[0].message)
        assert "fwdtrace's own layout" in message and "pygraphviz cannot load" in message
        assert "apt-get install libglib2.0-0 libxrender1" in message
        if how == "render":
            assert said[0].filename == __file__  # pointed at the caller
        drawn = _drawn(svg)
        assert {k: v["label"] for k, v in drawn["boxes"].items()} == labels
        assert sorted(drawn["edges"]) == edges
        assert set(drawn["clusters"]) == set(cluster2boxes) and cluster2boxes
        rects = [b["rect"] for b in drawn["boxes"].values()]
        assert all(_apart(a, b) for i, a in enumerate(rects) for b in rects[i + 1:])
        for name, members in cluster2boxes.items():
            assert all(_inside(drawn["boxes"][m]["rect"], drawn["clusters"][name]["rect"]) for m in members)
            for other in drawn["boxes"].keys() - members:
                assert _apart(drawn["boxes"][other]["rect"], drawn["clusters"][name]["rect"])


def test_without_graphviz_a_png_is_cairosvgs_or_an_error_naming_the_svg_route(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_graphviz(monkeypatch, tmp_path)
    g = fwdtrace.trace(_Nested(), torch.ones(1, 4))
    monkeypatch.setitem(sys.modules, "cairosvg", None)
    with pytest.raises(fwdtrace.FwdtraceError, match=r"^render\(\) could not lay out the picture: pygraphviz cannot "
                       r"load .*An SVG needs none of it \(render\('graph.svg'\) draws fwdtrace's own layout"):
        g.render(tmp_path / "graph.png")
    assert not (tmp_path / "graph.png").exists()
    rasterised = []
    stand_in = types.SimpleNamespace(svg2png=lambda bytestring: rasterised.append(bytestring) or b"\x89PNG")
    monkeypatch.setitem(sys.modules, "cairosvg", stand_in)
    with pytest.warns(fwdtrace.FwdtraceWarning, match="own layout"):
        g.render(tmp_path / "graph.png")
        g.render(tmp_path / "graph.svg")
    assert (tmp_path / "graph.png").read_bytes() == b"\x89PNG"
    assert rasterised == [(tmp_path / "graph.svg").read_bytes()]  # the SVG drawn, rasterised


def test_without_graphviz_the_live_pages_keys_are_read_from_fwdtraces_own_layout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The own layout writes Graphviz's skeleton, so the live page's keyed drawing reads the keys
    and kinds it reads from Graphviz's SVG."""
    from fwdtrace.live.svg import graph_svg

    g = fwdtrace.trace(_Nested(), torch.ones(1, 4))
    keyed = re.compile(r'class="(?:node|cluster)" (data-key="[^"]+" data-kind="[^"]+")')
    with_graphviz = sorted(keyed.findall(graph_svg(g)))
    no_graphviz(monkeypatch, tmp_path)
    with pytest.warns(fwdtrace.FwdtraceWarning):
        assert sorted(keyed.findall(graph_svg(g))) == with_graphviz and len(with_graphviz) == 4


def test_render_falls_back_to_a_dot_executable(without_libraries: dict) -> None:
    got = without_libraries
    calls = got["calls"]
    assert any(c.startswith("-Tplain") for c in calls) and any(c.startswith("-Tsvg") for c in calls), calls
    titles = set(re.findall(r"<title>([^<]*)</title>", got["drawn"]))
    boxes = {name for edge in draw._dot_edges(got["drawn_dot"]) for name in edge}
    assert got["drawn"].count("<svg") == 1 and boxes and boxes <= titles  # every box drawn
    assert not got["loaded"]


def test_dot_edges_are_those_graphviz_reads() -> None:
    """The density check reads edges from the DOT text itself: the same edges pygraphviz parses."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    g = fwdtrace.trace(model, torch.ones(2, 4))
    for depth in (None, 0, 1):
        source = g.to_dot(depth=depth, name_prefix='a"b').source
        want = sorted((str(u), str(v)) for u, v in draw._agraph(source).edges_iter())
        assert sorted(draw._dot_edges(source)) == want


def test_the_live_page_lists_layers_where_nothing_lays_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's drawing is refused once, saying why (501, layout false: the page stops asking and
    lists /api/keys instead); the layers can still be armed."""
    from test_live import Net, request

    monkeypatch.setattr(draw, "_pygraphviz_error", lambda: f"ImportError: {LOAD_ERROR}")
    monkeypatch.setattr(draw.shutil, "which", lambda name, *a, **k: None)
    torch.manual_seed(0)
    model = Net()
    with fwdtrace.serve(model, example_inputs=torch.randn(2, 8), port=0) as server:
        status, answer = request(server, "GET", "/api/graph.svg?depth=1")
        assert status == 501 and answer["layout"] is False
        assert answer["error"].startswith("the live page could not lay out the picture: pygraphviz cannot load "
                                          "the system's libgobject-2.0.so.0")
        assert server._layouts is None  # no layout process started
        status, keys = request(server, "GET", "/api/keys")
        assert [k["key"] for k in keys] == fwdtrace.module_keys(model)
        status, _ = request(server, "POST", "/api/sample", {"key": "body.2.Linear", "kind": "forward"})
        assert status == 200
        model(torch.randn(2, 8))
        status, answer = request(server, "GET", "/api/status")
        assert [a["key"] for a in answer["arms"] if a["armed"]] == ["body.2.Linear"]
