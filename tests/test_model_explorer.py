"""Model Explorer export: the written JSON read back with Model Explorer's own dataclasses, against networkx, the
model's modules and analyze()'s numbers; view() with the server mocked; the ONNX pair from the check's report."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.onnx.compare import ERROR_COLORS
from fwdtrace.passes import model_explorer as mx

graph_builder = pytest.importorskip("model_explorer.graph_builder", reason="pip install ai-edge-model-explorer")
node_data_builder = pytest.importorskip("model_explorer.node_data_builder")
dacite = pytest.importorskip("dacite")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)) + x


class SharedBlock(nn.Module):
    """A block called twice (two layers in Model Explorer), a ModuleList and a Linear called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.stack = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.block(x))
        for b in self.stack:
            x = b(x)
        return self.head(x) + self.head(x)


def _shared() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return SharedBlock().eval(), (torch.randn(2, 6),)


MODELS = {"shared_block": _shared, "resnetish": zoo.resnetish, "transformer_encoder": zoo.transformer_encoder}


def _load(path: str) -> Any:
    """The file as Model Explorer's GraphCollection: strict, so a field it does not know fails."""
    return dacite.from_dict(graph_builder.GraphCollection, json.loads(Path(path).read_text()),
                            config=dacite.Config(strict=True))


def _load_node_data(path: str) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    return {gid: dacite.from_dict(node_data_builder.GraphNodeData, d, config=dacite.Config(strict=True))
            for gid, d in data.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_graph_json_against_networkx_and_the_modules(name: str, tmp_path: Path) -> None:
    model, inputs = MODELS[name]()
    graph = fwdtrace.trace(model, *inputs)
    files = graph.to_model_explorer(tmp_path / "g.json")
    (me_graph,) = _load(files.graph).graphs
    nxg = graph.to_networkx()
    nodes = {n.id: n for n in me_graph.nodes}
    assert sorted(nodes) == sorted(str(i) for i in nxg.nodes)
    assert sum(len(n.incomingEdges) for n in me_graph.nodes) == nxg.number_of_edges()
    # every networkx edge arrives as an incoming edge from the tensor's producer, its shape and dtype on the output
    for src, dst, data in nxg.edges(data=True):
        edge = next(e for e in nodes[str(dst)].incomingEdges if e.sourceNodeId == str(src)
                    and nxg.nodes[src]["outputs"][int(e.sourceNodeOutputId)]["obj_id"] == data["obj_id"])
        meta = {m.id: {kv.key: kv.value for kv in m.attrs} for m in nodes[str(src)].outputsMetadata}
        assert meta[edge.sourceNodeOutputId]["tensor_shape"] == f"{data['dtype']}{list(data['shape'])}"
        assert nxg.nodes[dst]["inputs"][int(edge.targetNodeInputId)]["obj_id"] == data["obj_id"]
    # namespaces: one layer per enclosing module call, each a module of the model, joined back into its path
    path2module = dict(model.named_modules())
    for n in graph.nodes:
        ns = nodes[str(n.id)].namespace
        if not n.scope:
            assert ns == ""
            continue
        prefix = ""
        for part in ns.split("/"):
            prefix = f"{prefix}.{part.split('#')[0]}" if prefix else part.split("#")[0]
            assert prefix in path2module, (ns, prefix)
        assert prefix == n.scope[-1].module_path
        assert n.module_path.startswith(prefix)
    groups = me_graph.groupNodeAttributes or {}
    assert {g["module_path"] for g in groups.values()} == {s.module_path for n in graph.nodes for s in n.scope}
    for g in groups.values():
        assert type(path2module[g["module_path"]]).__name__ == g["class"]


def test_a_module_called_twice_is_two_layers(tmp_path: Path) -> None:
    model, inputs = _shared()
    calls: list[str] = []
    handle = model.block.register_forward_hook(lambda m, i, o: calls.append("block"))
    graph = fwdtrace.trace(model, *inputs)
    handle.remove()
    (me_graph,) = _load(graph.to_model_explorer(tmp_path / "g.json").graph).graphs
    block_layers = {n.namespace for n in me_graph.nodes if n.namespace.startswith("block")}
    assert len(calls) == 2 and block_layers == {"block", "block#1"}
    for ns in block_layers:  # each call holds its own Linear, GELU and add
        assert sorted(n.label for n in me_graph.nodes if n.namespace == ns) == ["GELU", "Linear", "add"]


def test_node_data_from_analyze(tmp_path: Path) -> None:
    model, inputs = _shared()
    graph = fwdtrace.trace(model, *inputs)
    analysis = fwdtrace.analyze(model, *inputs, warmup=2, repeats=1)  # the repeat's module-timed run gives each call a time
    files = graph.to_model_explorer(tmp_path / "g.json", node_data=analysis)
    assert sorted(files.node_data) == ["flops", "latency_ms", "peak_memory_bytes"]
    assert Path(files.node_data["flops"]).name == "g.flops.json"
    flops = _load_node_data(files.node_data["flops"])["fwdtrace"].results
    memory = _load_node_data(files.node_data["peak_memory_bytes"])["fwdtrace"].results
    latency = _load_node_data(files.node_data["latency_ms"])["fwdtrace"].results
    linears = [n for n in graph.nodes if n.target == "torch.nn.Linear"]
    assert len(linears) == 6  # block twice, the stack's two, head twice
    for n in linears:
        fc = model.get_submodule(n.module_path)
        # one call of a Linear on a (2, in) input: 2 * 2 * in * out multiply-adds (the bias is not counted)
        assert flops[str(n.id)].value == 2 * 2 * fc.in_features * fc.out_features
        row = analysis.row(n.module_key)
        assert memory[str(n.id)].value == row.peak_memory_bytes
        assert row.latency_ms is not None
        assert latency[str(n.id)].value == pytest.approx(row.latency_ms / row.calls)
    # torch functions have no row of their own: their FLOPs are their module's
    assert all(str(n.id) not in flops for n in graph.nodes if n.kind == "function")


def test_node_data_without_timing_and_from_any_numbers(tmp_path: Path) -> None:
    model, inputs = _shared()
    graph = fwdtrace.trace(model, *inputs)
    untimed = fwdtrace.analyze(SharedBlock().to("meta"), torch.randn(2, 6, device="meta"))  # the meta device: no time
    files = graph.to_model_explorer(tmp_path / "g.json", node_data=untimed)
    assert sorted(files.node_data) == ["flops", "peak_memory_bytes"]
    with fwdtrace.Probe(model) as probe:
        stats = probe.running_stats("block.fc.Linear", of="output")
        model(*inputs)
    means = {k: s.mean for k, s in stats.stats.items()}
    files = graph.to_model_explorer(tmp_path / "s.json", node_data={"output mean": means, "by id": {3: 7}})
    results = _load_node_data(files.node_data["output mean"])["fwdtrace"].results
    with torch.no_grad():
        first = model.block.fc(inputs[0])
        second = model.block.fc(model.block(inputs[0]))
    expected = torch.cat([first.flatten(), second.flatten()]).double().mean().item()
    ids = [str(n.id) for n in graph.nodes if n.module_key == "block.fc.Linear"]
    assert sorted(results) == sorted(ids) and len(ids) == 2
    assert all(results[i].value == pytest.approx(expected, rel=1e-5) for i in ids)
    assert Path(files.node_data["by id"]).name == "s.by_id.json"
    assert {k: v.value for k, v in _load_node_data(files.node_data["by id"])["fwdtrace"].results.items()} == {"3": 7}


BAD_NODE_DATA = [
    ({"x": {"blok.fc.Linear": 1.0}}, r"^to_model_explorer\(\) expected a node name or module key of the graph, "
                                     r"got 'blok\.fc\.Linear'; closest: block\.fc\.Linear"),
    ({"x": {"block.fc.Linear": float("nan")}}, r"^to_model_explorer\(\) expected finite numbers"),
    ({"x": {"block.fc.Linear": "1"}}, r"^to_model_explorer\(\) expected a number for 'block\.fc\.Linear', got"),
    ({"x": {999: 1.0}}, r"^to_model_explorer\(\) expected a node id from 0 to \d+, got 999"),
    ({"x": [1.0]}, r"^to_model_explorer\(\) expected node_data\['x'\] as a mapping node -> number"),
    ([1.0], r"^to_model_explorer\(\) expected node_data as an Analysis or a mapping"),
]


@pytest.mark.parametrize("node_data,match", BAD_NODE_DATA)
def test_bad_node_data_writes_nothing(node_data: Any, match: str, tmp_path: Path) -> None:
    model, inputs = _shared()
    graph = fwdtrace.trace(model, *inputs)
    with pytest.raises(FwdtraceError, match=match):
        graph.to_model_explorer(tmp_path / "g.json", node_data=node_data)
    assert list(tmp_path.iterdir()) == []


def test_bad_path_and_graph(tmp_path: Path) -> None:
    graph = fwdtrace.trace(nn.Linear(2, 2), torch.ones(1, 2))
    with pytest.raises(FwdtraceError, match=r"^to_model_explorer\(\) expected a path ending in \.json, got '.*g\.svg'"):
        graph.to_model_explorer(tmp_path / "g.svg")
    with pytest.raises(FwdtraceError, match=r"^to_model_explorer\(\) expected a fwdtrace\.Graph, got"):
        mx.to_model_explorer("graph", tmp_path / "g.json")  # type: ignore[arg-type]


def test_the_same_graph_gives_the_same_bytes(tmp_path: Path) -> None:
    model, inputs = _shared()
    a = fwdtrace.trace(model, *inputs).to_model_explorer(tmp_path / "a.json").graph
    b = fwdtrace.trace(model, *inputs).to_model_explorer(tmp_path / "b.json").graph
    assert Path(a).read_bytes() == Path(b).read_bytes()


def test_view_without_model_explorer_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "model_explorer", None)
    with pytest.raises(FwdtraceError, match=r"^fwdtrace\.view\(\) needs Model Explorer: pip install ai-edge-model-explorer"):
        fwdtrace.view(nn.Linear(2, 2), torch.ones(1, 2))


def _get(port: int, path: str, host: str | None = None, headers: dict[str, str] | None = None,
         method: str = "GET") -> tuple[int, bytes, Any]:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.putrequest(method, path, skip_host=True)
    connection.putheader("Host", host or f"127.0.0.1:{port}")
    for name, value in (headers or {}).items():
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, body, response.headers


def test_view_serves_the_page_and_its_files_and_nothing_else(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import model_explorer

    seen: dict[str, Any] = {}

    def requests(server: Any) -> None:  # instead of waiting for Ctrl+C
        port, graph = server.port, seen["graph"]
        seen["url"] = server.page_url("x")
        seen["page"] = _get(port, "/")
        seen["graph_file"] = _get(port, f"/api/v1/read_text_file?path={graph}")
        seen["passwd"] = _get(port, "/api/v1/read_text_file?path=/etc/passwd")
        seen["beside"] = _get(port, f"/api/v1/read_text_file?path={Path(graph).parent / 'other.json'}")
        seen["rebinding"] = _get(port, f"/api/v1/read_text_file?path={graph}", host=f"evil.example:{port}")
        seen["traversal"] = _get(port, "/../../../../etc/passwd")
        seen["command"] = _get(port, '/api/v1/send_command?json={"extensionId":"x"}')
        seen["upload"] = _get(port, "/apipost/v1/upload", method="POST")

    (tmp_path / "other.json").write_text("secret")
    monkeypatch.setattr(mx, "_serve_until_interrupted", requests)
    seen["graph"] = str(tmp_path / "graph.json")
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    files = fwdtrace.view(model, torch.ones(2, 4), node_data={"n": {"0.Linear": 1.5}}, folder=str(tmp_path),
                          port=0, open_browser=False)
    assert files.graph == seen["graph"]
    web_app = Path(model_explorer.__file__).parent / "web_app"
    assert seen["page"][:2] == (200, (web_app / "index.html").read_bytes())
    assert seen["graph_file"][0] == 200 and json.loads(seen["graph_file"][1]) == {"content": Path(files.graph).read_text()}
    for refused, status in (("passwd", 403), ("beside", 403), ("rebinding", 403), ("traversal", 404),
                            ("command", 404), ("upload", 404)):
        assert seen[refused][0] == status, refused
        assert b"root:" not in seen[refused][1] and b"secret" not in seen[refused][1]
    assert seen["url"].startswith("http://127.0.0.1:") and "token" not in seen["url"]
    assert len(_load(files.graph).graphs[0].nodes) == len(fwdtrace.trace(model, torch.ones(2, 4)).nodes)
    with pytest.raises(FwdtraceError, match=r"^fwdtrace\.view\(\) expected no inputs with a Graph, got 1"):
        fwdtrace.view(fwdtrace.trace(model, torch.ones(2, 4)), torch.ones(2, 4))


def test_view_beyond_loopback_needs_the_token_it_prints(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    def requests(server: Any) -> None:
        port, graph = server.port, str(tmp_path / "graph.json")
        seen["token"] = server.token
        seen["none"] = _get(port, f"/api/v1/read_text_file?path={graph}", host="anything")
        seen["wrong"] = _get(port, f"/?token={'x' * 22}", host="anything")
        seen["first"] = _get(port, f"/?token={server.token}", host="anything")
        cookie = seen["first"][2]["Set-Cookie"].split(";")[0]
        seen["cookie"] = _get(port, f"/api/v1/read_text_file?path={graph}", host="anything", headers={"Cookie": cookie})
        seen["bearer"] = _get(port, "/", host="anything", headers={"Authorization": f"Bearer {server.token}"})

    monkeypatch.setattr(mx, "_serve_until_interrupted", requests)
    fwdtrace.view(nn.Linear(2, 2), torch.ones(1, 2), folder=str(tmp_path), host="0.0.0.0", port=0, open_browser=False)
    assert seen["token"] and seen["token"] in capsys.readouterr().err  # made and printed
    assert seen["none"][0] == 401 and seen["wrong"][0] == 401
    assert seen["first"][0] == seen["cookie"][0] == seen["bearer"][0] == 200
    assert json.loads(seen["cookie"][1])["content"] == (tmp_path / "graph.json").read_text()


def _fake_jupyter(monkeypatch: pytest.MonkeyPatch, shown: list[Any]) -> None:
    """An IPython kernel as a notebook runs one: ``get_ipython().kernel`` set, ``display`` recording what it shows."""
    ipython, display = types.ModuleType("IPython"), types.ModuleType("IPython.display")
    ipython.get_ipython = lambda: types.SimpleNamespace(kernel=object())  # type: ignore[attr-defined]
    display.IFrame = lambda src, width, height: ("iframe", src, width, height)  # type: ignore[attr-defined]
    display.display = shown.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)


def _fake_colab(monkeypatch: pytest.MonkeyPatch, shown: list[Any]) -> None:
    """Colab's module: ``serve_kernel_port_as_iframe`` records the port and path it was asked to show."""
    google, colab, output = (types.ModuleType(n) for n in ("google", "google.colab", "google.colab.output"))
    output.serve_kernel_port_as_iframe = lambda port, path, height: shown.append(("colab", port, path, height))  # type: ignore[attr-defined]
    google.colab, colab.output = colab, output  # type: ignore[attr-defined]
    for module in (google, colab, output):
        monkeypatch.setitem(sys.modules, module.__name__, module)


@pytest.mark.parametrize("where", ["jupyter", "colab"])
def test_view_in_a_notebook_shows_the_page_in_the_cell_and_returns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                   where: str) -> None:
    shown: list[Any] = []
    (_fake_jupyter if where == "jupyter" else _fake_colab)(monkeypatch, shown)
    monkeypatch.setattr(mx, "_serve_until_interrupted", lambda server: pytest.fail("a notebook's view() blocked"))
    monkeypatch.setattr("webbrowser.open_new_tab", lambda url: pytest.fail("a notebook's view() opened a tab"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        files = fwdtrace.view(nn.Linear(2, 2), torch.ones(1, 2), folder=str(tmp_path / "a"), port=0)
        ((kind, *shape),) = shown
        server = mx._notebook_servers[0]
        if where == "jupyter":  # an iframe to the loopback page, under the Host check
            src, width, height = shape
            assert kind == "iframe" and src.startswith(f"http://127.0.0.1:{server.port}/?data=") and width == "100%"
            path, host = src[len(server.url) - 1:], f"127.0.0.1:{server.port}"
            assert _get(server.port, path, host="evil.example")[0] == 403
        else:  # the port through Colab's proxy, whose requests name its own host
            port, path, height = shape
            assert kind == "colab" and port == server.port and path.startswith("/?data=")
            host = f"{server.port}-m-s-abc.colab.googleusercontent.com"
        assert height == mx._NOTEBOOK_HEIGHT
        assert _get(server.port, path, host=host)[0] == 200
        answer = _get(server.port, f"/api/v1/read_text_file?path={files.graph}", host=host)
        assert answer[0] == 200 and json.loads(answer[1])["content"] == Path(files.graph).read_text()
        assert _get(server.port, "/api/v1/read_text_file?path=/etc/passwd", host=host)[0] == 403
        fwdtrace.view(nn.Linear(2, 2), torch.ones(1, 2), folder=str(tmp_path / "b"), port=0)  # the next one
        assert len(shown) == 2 and mx._notebook_servers[0] is not server
        with pytest.raises(OSError):  # the previous server stopped
            _get(server.port, "/", host=host)
    finally:
        while mx._notebook_servers:
            mx._notebook_servers.pop().stop()
    with pytest.raises(FwdtraceError, match=r"^fwdtrace\.view\(\) expected notebook as True, False or None \(find "
                                            r"out\), got str 'yes'"):
        fwdtrace.view(nn.Linear(2, 2), torch.ones(1, 2), notebook="yes")  # type: ignore[arg-type]


def test_onnx_pair_maps_the_reports_matches(tmp_path: Path) -> None:
    model, inputs = zoo.resnetish()
    model.eval()
    proto = fwdtrace.export_onnx(model, *inputs, exporter="torchscript")
    report = fwdtrace.check_onnx(model, *inputs, onnx=proto)
    assert report.ok
    pair = report.to_model_explorer(tmp_path)
    (trace,) = _load(pair.trace).graphs
    (onnx_side,) = _load(pair.onnx).graphs
    # the two graphs: the trace, and the ONNX model as fwdtrace reads it (pruned of shape arithmetic)
    assert len(trace.nodes) == len(fwdtrace.trace(model, *inputs).nodes)
    assert len(onnx_side.nodes) == len(fwdtrace.onnx_graph(proto, prune=True).nodes)
    entries = json.loads(Path(pair.mapping).read_text())["mappingEntries"]
    assert len(entries) == len(report.matched)
    # each entry is one of the report's matches: the trace call by its module path and class, ONNX nodes by name
    onnx_names = {n.name for n in proto.graph.node}
    t_nodes = {n.id: n for n in trace.nodes}
    o_graph = report.onnx_graph
    assert o_graph is not None
    for entry, (label, onnx) in zip(entries, report.matched, strict=True):
        (left,) = entry["leftNodeIds"]
        attrs = {kv.key: kv.value for kv in t_nodes[left].attrs}
        if attrs["kind"] == "module":
            call = f"#{attrs['call_index']}" if attrs["call_index"] != "0" else ""
            assert label == f"{attrs['module_path']}{call} ({t_nodes[left].label})"
        else:
            assert label.startswith(f"{attrs['name']} = {attrs['target']}")
        names = [o_graph.nodes[int(r)].meta["onnx_name"] for r in entry["rightNodeIds"]]
        assert tuple(names) == onnx and all(n in onnx_names for n in names)
        assert all(r in {n.id for n in onnx_side.nodes} for r in entry["rightNodeIds"])
    assert not any(n.style for n in trace.nodes + onnx_side.nodes)  # nothing missing or extra


def test_onnx_pair_marks_missing_and_extra(tmp_path: Path) -> None:
    import onnx

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    x = torch.ones(1, 4)
    proto = fwdtrace.export_onnx(model, x, exporter="torchscript")
    relu = next(n for n in proto.graph.node if n.op_type == "Relu")
    relu.op_type = "Sigmoid"  # a tampered export: the ReLU is missing, a Sigmoid extra
    onnx.checker.check_model(proto)
    report = fwdtrace.check_onnx(model, x, onnx=proto)
    assert not report.ok and report.missing and report.extra
    pair = report.to_model_explorer(tmp_path)
    (trace,) = _load(pair.trace).graphs
    (onnx_side,) = _load(pair.onnx).graphs
    red_trace = [n.label for n in trace.nodes if n.style is not None]
    red_onnx = [n.label for n in onnx_side.nodes if n.style is not None]
    assert red_trace == ["ReLU"] and red_onnx == ["Sigmoid"]
    # a new folder is made (as the docs' `report.to_model_explorer("pair/")` does), not one in a missing folder
    made = report.to_model_explorer(tmp_path / "pair")
    assert sorted(p.name for p in (tmp_path / "pair").iterdir()) == ["mapping.json", "onnx.json", "trace.json"]
    assert Path(made.mapping).read_text() == Path(pair.mapping).read_text()
    with pytest.raises(FwdtraceError, match=r"^TopologyReport\.to_model_explorer\(\) expected a folder, or a new one"):
        report.to_model_explorer(tmp_path / "nope" / "pair")
    with pytest.raises(FwdtraceError, match=r"^TopologyReport\.to_model_explorer\(\) expected a folder, or a new one"):
        report.to_model_explorer(pair.mapping)  # a file


class _Scores(nn.Module):
    """Scores offset by 2e4, which softmax ignores and float16 does not: the softmax run in ``dtype`` diverges."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(4, 4)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2) + 2e4
        return scores.to(self.dtype).softmax(-1).to(x.dtype) @ x


def _scores_dumps(tmp_path: Path, calls: str = "all") -> tuple[list[Path], torch.Tensor]:
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    paths = []
    for dtype in (torch.float32, torch.float16):
        model = _Scores(dtype)
        with fwdtrace.Dumper(tmp_path / str(dtype), calls=calls) as dumper:
            dumper.register(model, grads=False)
            model(x)
        paths += dumper.paths
    return paths, x


def test_a_dump_comparison_writes_each_calls_errors_as_node_data(tmp_path: Path) -> None:
    from fwdtrace import dump
    from fwdtrace.cli import build_parser

    paths, x = _scores_dumps(tmp_path)
    report = fwdtrace.compare_dumps(*paths)
    files = report.to_model_explorer(tmp_path / "explorer")
    assert Path(files.graph) == tmp_path / "explorer" / "diff.json"
    (me_graph,) = _load(files.graph).graphs
    data = {name: _load_node_data(path)["fwdtrace"].results for name, path in files.node_data.items()}
    assert sorted(data) == ["cosine", "max_abs", "max_rel", "norm_rel", "verdict"]
    assert report.graph is not None
    softmax = next(str(n.id) for n in report.graph.nodes if n.key == "softmax")
    q = next(str(n.id) for n in report.graph.nodes if n.key == "q.Linear")
    # the reference: the softmax's output in float32 and in float16, computed by torch
    with torch.no_grad():
        scores = _Scores(torch.float32).q(x) @ x.transpose(-1, -2) + 2e4
        fp32, fp16 = scores.softmax(-1).double(), scores.half().softmax(-1).double()
    assert data["max_abs"][softmax].value == pytest.approx((fp32 - fp16).abs().max().item(), rel=1e-9)
    assert data["cosine"][softmax].value == pytest.approx(
        torch.nn.functional.cosine_similarity(fp32.flatten(), fp16.flatten(), dim=0).item(), rel=1e-9)
    assert data["verdict"][softmax].value == 2 and data["verdict"][softmax].bgColor == ERROR_COLORS["diverges"]
    assert data["verdict"][q].value == 0 and data["max_abs"][q].value == 0  # the same layer, the same input
    # the first divergence, and it alone, is drawn in red
    assert report.first_divergence == "softmax"
    assert [n.id for n in me_graph.nodes if n.style is not None] == [softmax]
    # from the command line: the same files, byte for byte
    out = tmp_path / "cli"
    assert dump.run_cli(build_parser().parse_args(["dump-diff", *map(str, paths), "--model-explorer", str(out)])) == 1
    assert (out / "diff.json").read_bytes() == Path(files.graph).read_bytes()
    assert (out / "diff.verdict.json").read_bytes() == Path(files.node_data["verdict"]).read_bytes()


def test_a_dump_comparison_without_a_graph_has_nothing_to_write(tmp_path: Path) -> None:
    paths, _ = _scores_dumps(tmp_path, "modules")
    report = fwdtrace.compare_dumps(*paths)
    with pytest.raises(FwdtraceError, match=r"^DumpReport\.to_model_explorer\(\) expected dumps that hold their run's"):
        report.to_model_explorer(tmp_path / "explorer")
    paths, _ = _scores_dumps(tmp_path / "all")
    with pytest.raises(FwdtraceError, match=r"^DumpReport\.to_model_explorer\(\) expected a folder, or a new one"):
        fwdtrace.compare_dumps(*paths).to_model_explorer(tmp_path / "no" / "such" / "folder")
    assert not (tmp_path / "explorer").exists()


def test_a_numeric_onnx_check_writes_the_traces_errors_as_node_data(tmp_path: Path) -> None:
    import numpy as np
    import onnx
    import onnxruntime

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    x = torch.randn(3, 4)
    proto = fwdtrace.export_onnx(model, x, exporter="torchscript")
    (weight,) = [i for i in proto.graph.initializer if tuple(i.dims) in ((2, 4), (4, 2))]  # the last Linear's
    weight.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight) * np.float32(1.01), weight.name))
    report = fwdtrace.check_onnx(model, x, onnx=proto, numeric=True)
    pair = report.to_model_explorer(tmp_path)
    assert Path(pair.node_data["verdict"]).name == "trace.verdict.json"
    (trace,) = _load(pair.trace).graphs
    data = {name: _load_node_data(path)["trace"].results for name, path in pair.node_data.items()}
    assert sorted(data) == ["cosine", "max_abs", "max_rel", "norm_rel", "verdict"]
    assert report.trace is not None
    first, last = (str(n.id) for n in report.trace.nodes if n.target == "torch.nn.Linear")
    # the reference: onnxruntime's output of the tampered file against the model's own
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {proto.graph.input[0].name: x.numpy()})
    with torch.no_grad():
        want = model(x).double().numpy()
    assert data["max_abs"][last].value == pytest.approx(float(np.abs(got - want).max()), rel=1e-6)
    assert data["verdict"][last].value == 2 and data["verdict"][last].bgColor == ERROR_COLORS["diverges"]
    assert data["verdict"][first].value == 0
    assert [n.id for n in trace.nodes if n.style is not None] == [last]  # the first divergence
    # a check of the structure only writes no node data
    assert fwdtrace.check_onnx(model, x, onnx=proto).to_model_explorer(tmp_path / "structure").node_data == {}
