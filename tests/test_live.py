"""The live service end to end over real HTTP on loopback, while a tiny model trains.

References are independent of the service: plain torch hooks record what each module
saw, and torch computes the statistics the service must report.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zoo
from process_groups import run_in_session
from stats_reference import assert_moments
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.instrument.bins import SteadyBins

TESTS = Path(__file__).parent


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def request(server: Any, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
            raw: bool = False) -> tuple[int, Any]:
    """One HTTP request on a fresh connection; the JSON answer decoded (bytes with ``raw``)."""
    # The timeout only stops a hung test: the first drawing waits for the layout process to start.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    headers = dict(headers or {})
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    if raw or not response.getheader("Content-Type", "").startswith("application/json"):
        return response.status, data
    return response.status, json.loads(data)


def hook_dicts(model: nn.Module) -> list[tuple[str, list[int]]]:
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")
    return [(f"{path}:{n}", list(getattr(m, n))) for path, m in model.named_modules() for n in names]


def train_steps(model: nn.Module, n: int, batch: int = 5) -> None:
    """Plain SGD steps, written out: torch.optim's first use imports torch._dynamo (seconds)."""
    for _ in range(n):
        zoo.sgd_step(model, model(torch.randn(batch, 8)).pow(2).mean())


def test_api_end_to_end_during_training() -> None:
    model = _model()
    before = hook_dicts(model)
    # Plain hooks record every output of body.2.Linear and every gradient reaching body.0.Linear's output.
    outputs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    # (Training forwards only: the graph's trace runs one more forward, in eval mode under no_grad.)
    h1 = model.body[2].register_forward_hook(
        lambda m, a, out: outputs.append(out.detach().clone()) if torch.is_grad_enabled() else None)
    def on_grad(m: nn.Module, a: tuple, out: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            out.register_hook(lambda g: grads.append(g.clone()))

    h2 = model.body[0].register_forward_hook(on_grad)
    reference = hook_dicts(model)
    with fwdtrace.serve(model, port=0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/" and server.token is None
        status, answer = request(server, "GET", "/api/graph")
        assert status == 503 and answer["error"].startswith("no graph yet")

        status, answer = request(server, "POST", "/api/sample", {"key": "body.2.Linear", "kind": "forward", "every": 2})
        assert (status, answer["armed"]) == (200, ["body.2.Linear"])
        status, answer = request(server, "POST", "/api/sample", {"key": "body.0.*", "kind": "grad", "count": 2})
        assert (status, answer["armed"]) == (200, ["body.0.Linear"])

        train_steps(model, 6)
        assert len(outputs) == 6 and len(grads) == 6

        status, answer = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward")
        assert status == 200
        assert (answer["calls"], answer["taken"], answer["dropped"], answer["armed"]) == (6, 3, 0, True)
        assert [s["call"] for s in answer["samples"]] == [1, 3, 5]
        assert [s["step"] for s in answer["samples"]] == [1, 3, 5]
        steady = SteadyBins(server.sampler.bins)  # the recorder's bins, fed the same outputs in the same order
        for sample, ref in zip(answer["samples"], [outputs[i] for i in (0, 2, 4)], strict=True):
            out = [t for t in sample["tensors"] if t["role"] == "output"][0]
            steady.fit(float(ref.min()), float(ref.max()))
            assert out["shape"] == [5, 4] and out["dtype"] == "float32" and sample["rank"] == 0
            assert_moments(out["mean"], None, None, ref, dtype=torch.float32)
            assert_moments(None, out["std"], None, ref, dtype=torch.float32)
            assert (out["min"], out["max"]) == (pytest.approx(float(ref.min())), pytest.approx(float(ref.max())))
            assert sum(out["histogram"]) + out["underflow"] + out["overflow"] == 20 and (out["nan"], out["inf"]) == (0, 0)
            assert out["bin_edges"] == steady.edges.tolist() and len(out["histogram"]) == 60
            assert np.histogram(ref.double().numpy(), bins=out["bin_edges"])[0].tolist() == out["histogram"]
            assert out["overflow"] == out["underflow"] == 0  # a running range holds every value

        status, answer = request(server, "GET", "/api/stats?key=body.2.Linear&which=forward_output")
        sampled = torch.cat([outputs[i].reshape(-1) for i in (0, 2, 4)]).double()
        assert answer["stats"]["count"] == 60
        assert_moments(answer["stats"]["mean"], None, None, sampled, dtype=torch.float32)
        assert_moments(None, answer["stats"]["std"], None, sampled, dtype=torch.float32)

        status, answer = request(server, "GET", "/api/samples?key=body.0.Linear&kind=grad")
        assert (answer["calls"], answer["taken"]) == (6, 2)  # count=2: two samples, the calls still counted
        for sample, ref in zip(answer["samples"], grads[:2], strict=True):
            gout = [t for t in sample["tensors"] if t["role"] == "grad_output"][0]
            assert_moments(gout["mean"], None, None, ref, dtype=torch.float32)
        status, answer = request(server, "GET", "/api/stats?key=body.0.Linear&which=grad_output")
        assert answer["stats"]["count"] == 2 * 5 * 16

        # The module path people see in the graph and in named_modules() reads the same samples as the key.
        by_path = request(server, "GET", "/api/samples?key=body.2&kind=forward")
        assert by_path == request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward")
        assert dict(model.named_modules())["body.2"] is server.sampler.key2module["body.2.Linear"]
        status, answer = request(server, "GET", "/api/samples?key=body.3&kind=forward")
        assert status == 404 and {"body.2", "body.2.Linear"} & set(answer["closest"])

        status, answer = request(server, "DELETE", "/api/sample?key=body.2.Linear&kind=forward")
        assert (status, answer["disarmed"]) == (200, ["body.2.Linear"])
        train_steps(model, 2)
        status, answer = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward")
        assert (answer["armed"], answer["taken"], len(answer["samples"])) == (False, 3, 3)

        status, answer = request(server, "GET", "/api/status")
        assert (answer["step"], answer["rank"], answer["world_size"], answer["graph"]) == (8, 0, 1, "ready")

        # Raw values, as .npy bytes, equal to what the plain hook saw.
        request(server, "POST", "/api/sample", {"key": "body.2.Linear", "kind": "forward", "raw": True})
        train_steps(model, 1)
        status, data = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward&format=npy&index=1", raw=True)
        assert status == 200
        np.testing.assert_array_equal(np.load(io.BytesIO(data), allow_pickle=False), outputs[-1].numpy())
        status, answer = request(server, "GET", "/api/samples?key=body.0.Linear&kind=grad&format=npy&index=0")
        assert status == 409 and 'armed without "raw": true' in answer["error"]

        thread = server._thread
        kept = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)  # a browser's keep-alive
        kept.request("GET", "/api/status")
        assert kept.getresponse().read()
    assert not thread.is_alive()
    with pytest.raises((http.client.HTTPException, OSError)):  # closed by stop(), not left serving
        kept.request("GET", "/api/status")
        kept.getresponse()
    assert hook_dicts(model) == reference  # only the plain hooks are left
    h1.remove(), h2.remove()
    assert hook_dicts(model) == before
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1)


def test_keys_and_graph() -> None:
    model = _model()
    x = torch.randn(2, 8)
    with fwdtrace.serve(model, example_inputs=x, port=0) as server:
        status, keys = request(server, "GET", "/api/keys")
        assert [k["key"] for k in keys] == fwdtrace.module_keys(model)
        by_key = {k["key"]: k for k in keys}
        assert by_key["body.0.Linear"]["params"] == 8 * 16 + 16
        assert by_key["Net"]["params"] == sum(p.numel() for p in model.parameters())
        assert by_key["body.2.Linear"]["shapes"] == {"input": [[2, 16]], "output": [[2, 4]]}
        assert by_key["body.2.Linear"]["class"] == "Linear"

        status, text = request(server, "GET", "/api/graph", raw=True)
        assert fwdtrace.Graph.from_json(text.decode()) == fwdtrace.trace(model, x)

        status, svg = request(server, "GET", "/api/graph.svg")
        svg = svg.decode()
        leaves = {k for k in fwdtrace.module_keys(model) if k.count(".") == 2}
        node_keys = re.findall(r'class="node" data-key="([^"]+)"', svg)
        assert sorted(node_keys) == sorted(leaves)
        assert re.findall(r'class="cluster" data-key="([^"]+)"', svg) == ["body.Sequential"]
        status, svg = request(server, "GET", "/api/graph.svg?depth=1")
        assert re.findall(r'class="node" data-key="([^"]+)"', svg.decode()) == ["body.Sequential"]


class Scale(nn.Module):
    """A layer written with functions (as transformers' ``Conv1D``): one closed box on the page."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + 0.5


class Recur(nn.Module):
    """The same layer called four times in one forward: the draw pass folds iterations 2 to 4."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            h = torch.tanh(self.cell(h))
        return h


class KeyNet(nn.Module):
    """What the draw pass folds: position arithmetic (a side box), a loop, identical sibling blocks,
    a leaf layer written with functions and called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.pos = nn.Embedding(4, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)])
        self.recur = Recur()
        self.scale = Scale(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]).unsqueeze(0))
        for block in self.blocks:
            h = block(h)
        return self.head(self.scale(self.scale(self.recur(h))))


def module_calls(model: nn.Module, *inputs: torch.Tensor) -> tuple[list[str], list[str]]:
    """The module keys of the calls ``model`` makes, by plain hooks: (calls that call no other
    module, calls that do), the root's own call left out."""
    path2key = {m: fwdtrace.instrument.keys.module_key(path, m) for path, m in model.named_modules()}
    stack: list[list[Any]] = []  # [key, called another module]
    leaves: list[str] = []
    outer: list[str] = []

    def pre(m: nn.Module, args: Any) -> None:
        if stack:
            stack[-1][1] = True
        stack.append([path2key[m], False])

    def post(m: nn.Module, args: Any, out: Any) -> None:
        key, parent = stack.pop()
        if m is not model:
            (outer if parent else leaves).append(key)

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    zoo.run_hooked(model, handles, *inputs)
    return leaves, outer


SVG = "{http://www.w3.org/2000/svg}"


def svg_boxes(svg: str) -> list[tuple[str, str, str | None, str]]:
    """Each box and cluster of a live SVG: (node or cluster, data-kind, data-key, first tooltip line)."""
    import xml.etree.ElementTree as ET

    boxes = []
    for g in ET.fromstring(svg).iter(f"{SVG}g"):
        if g.get("class") in ("node", "cluster"):
            a = g.find(f".//{SVG}a")
            tooltip = "" if a is None else a.get("{http://www.w3.org/1999/xlink}title", "")
            boxes.append((g.get("class", ""), g.get("data-kind", ""), g.get("data-key"), tooltip.split("\n")[0]))
    return boxes


def test_every_box_of_a_module_carries_its_key_as_hooks_see_the_calls() -> None:
    from fwdtrace.live.svg import graph_svg

    model, x = KeyNet().eval(), torch.randn(2, 4, 8)
    graph = fwdtrace.trace(model, x)
    leaves, outer = module_calls(model, x)
    boxes = svg_boxes(graph_svg(graph))
    node_keys = [key for element, _, key, _ in boxes if element == "node" and key]
    # One box per leaf call, but the loop's iterations 2 to 4, which share one box with no key.
    assert leaves.count("recur.cell.Linear") == 4
    assert sorted(node_keys) == sorted([k for k in leaves if k != "recur.cell.Linear"] + ["recur.cell.Linear"])
    assert node_keys.count("scale.Scale") == 2  # the leaf layer drawn closed, once per call
    assert {key for element, _, key, _ in boxes if element == "cluster"} == set(outer)
    kinds = {kind for element, kind, key, _ in boxes if element == "node" and not key}
    assert {"side", "loop"} <= kinds <= {"side", "loop", "input", "output", "function"}
    for _, _, key, tooltip in boxes:  # each key sits on its own module's box
        if key:
            path = key.rsplit(".", 1)[0]
            assert tooltip.startswith(path + " "), (key, tooltip)


@pytest.mark.parametrize("depth", [None, 0, 1, 2, 3])
def test_every_key_of_the_live_svg_is_a_module_key(depth: int | None) -> None:
    from fwdtrace.live.svg import graph_svg

    model, x = KeyNet().eval(), torch.randn(2, 4, 8)
    graph = fwdtrace.trace(model, x)
    boxes = svg_boxes(graph_svg(graph, depth))
    keys = {key for _, _, key, _ in boxes if key}
    assert keys <= set(fwdtrace.module_keys(model))
    assert keys or depth == 0  # the whole model as one box: the graph does not know the root's class
    groups = [key for _, kind, key, _ in boxes if kind in ("group", "layer")]
    if depth == 0:
        assert groups == [None]
    else:  # each collapsed module call, and each call of the leaf layer, is one box that carries its key
        collapsed = {n.scope[depth - 1] for n in graph.nodes if depth and len(n.scope) >= depth}
        collapsed |= {n.scope[-1] for n in graph.nodes if n.scope and n.scope[-1].class_name == "Scale"}
        assert sorted(groups) == sorted(f"{s.module_path}.{s.class_name}" for s in collapsed)


BAD = [
    ("GET", "/api/samples?key=body.2.Linea&kind=forward", None, {}, 404, r"^unknown module key or path 'body.2.Linea'"),
    ("GET", "/api/samples?key=body.1.ReLU&kind=forward", None, {}, 404, r"^'body.1.ReLU' was never armed for forward"),
    ("GET", "/api/samples?kind=forward", None, {}, 400, r"^expected a module key or path as \?key=KEY"),
    ("GET", "/api/samples?key=body.1.ReLU&kind=both", None, {}, 400, r"^expected kind=forward\|grad\|weight\|weight_grad\|health, got 'both'"),
    ("GET", "/api/stats?key=body.1.ReLU&which=output", None, {}, 400, r"^expected which= one of forward_input, "),
    ("GET", "/api/nothing", None, {}, 404, r"^no such path '/api/nothing'"),
    ("PUT", "/api/sample", None, {}, 501, None),
    ("GET", "/api/sample", None, {}, 405, r"^GET is not allowed on /api/sample"),
    ("POST", "/api/sample", b"{not json", {"Content-Type": "application/json"}, 400, r"^expected a JSON object like \{"),
    ("POST", "/api/sample", [1, 2], {}, 400, r"^expected a JSON object like .*, got a JSON list"),
    ("POST", "/api/sample", {"key": "body.1.ReLU", "when": 1}, {}, 400, r"^expected a JSON object like .*, got unexpected fields \['when'\]"),
    ("POST", "/api/sample", {"key": "body.1.ReLU", "kind": "backward"}, {}, 400, r'^expected "kind" as one of forward, grad, weight, weight_grad, health, got \'backward\''),
    ("POST", "/api/sample", {"key": "body.1.ReLU", "every": 0}, {}, 400, r'^expected "every" as a positive integer, got int 0'),
    ("POST", "/api/sample", {"key": "body.1.ReLU", "count": "2"}, {}, 400, r'^expected "count" as a positive integer or null'),
    ("POST", "/api/sample", {"key": "body.*.Conv2d"}, {}, 404, r"^'body.\*.Conv2d' matches no module key"),
    ("POST", "/api/sample", b'{"key": "body.1.ReLU"}', {"Content-Type": "text/plain"}, 415, r"^expected Content-Type: application/json"),
    ("POST", "/api/sample", b"x" * (64 * 1024 + 1), {"Content-Type": "application/json"}, 413, r"^expected a body of at most 65536 bytes"),
    ("DELETE", "/api/sample?key=nope", None, {}, 404, r"^'nope' matches no module key"),
]


@pytest.mark.parametrize("method, path, body, headers, status, message", BAD, ids=[f"{b[0]} {b[1][:40]}" for b in BAD])
def test_bad_requests_say_what_was_expected(method: str, path: str, body: Any, headers: dict, status: int,
                                            message: str | None) -> None:
    model = _model()
    with fwdtrace.serve(model, port=0) as server:
        got, answer = request(server, method, path, body, headers)
        assert got == status, answer
        if message is not None:
            assert re.match(message, answer["error"]), answer["error"]
            assert answer["status"] == status
        if status == 404 and "key" in path and "matches no" not in message and "never" not in message:
            assert answer["closest"][0] == "body.2.Linear"
        # The server still answers after a bad request.
        assert request(server, "GET", "/api/status")[0] == 200


def test_host_header_must_name_the_bound_address() -> None:
    with fwdtrace.serve(_model(), port=0) as server:
        for host in ("evil.example:%d", "127.0.0.1:1", "localhost"):
            status, answer = request(server, "GET", "/api/keys", headers={"Host": host.replace("%d", str(server.port))})
            assert status == 403 and answer["error"].startswith("expected the Host header to be one of")
        for host in ("127.0.0.1:%d", "localhost:%d", "LOCALHOST:%d"):
            assert request(server, "GET", "/api/keys", headers={"Host": host % server.port})[0] == 200


def test_beyond_loopback_a_token_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FwdtraceError, match=r"^serve\(\) expected token as a str of at least 8 characters or None, got 'abc'"):
        fwdtrace.serve(_model(), host="0.0.0.0", port=0, token="abc")
    model = _model()
    before = hook_dicts(model)
    with fwdtrace.serve(model, host="0.0.0.0", port=0) as server:
        assert server.token and server.token in capsys.readouterr().err  # generated and printed
        status, answer = request(server, "GET", "/api/keys")
        assert status == 401 and answer["error"].startswith("expected the token as 'Authorization: Bearer TOKEN'")
        assert request(server, "GET", "/api/keys", headers={"Authorization": "Bearer wrong-token"})[0] == 401
        assert request(server, "GET", "/api/keys", headers={"Authorization": f"Bearer {server.token}"})[0] == 200
        assert request(server, "GET", f"/?token={server.token}")[0] == 200
        assert request(server, "GET", "/")[0] == 401
    with fwdtrace.serve(model, port=0, token="a-token-on-loopback") as server:  # a given token is checked on loopback too
        assert request(server, "GET", "/api/status")[0] == 401
        assert request(server, "GET", "/api/status?token=a-token-on-loopback")[0] == 200
    assert hook_dicts(model) == before


def test_ring_buffer_keeps_the_newest_and_counts_drops() -> None:
    model = _model()
    with fwdtrace.serve(model, port=0, ring=3) as server:
        request(server, "POST", "/api/sample", {"key": "body.1.ReLU", "kind": "forward"})
        train_steps(model, 5)
        status, answer = request(server, "GET", "/api/samples?key=body.1.ReLU&kind=forward")
        assert (answer["taken"], answer["dropped"], answer["ring"]) == (5, 2, 3)
        assert [s["call"] for s in answer["samples"]] == [3, 4, 5]
        assert [s["seq"] for s in answer["samples"]] == [2, 3, 4]
        status, answer = request(server, "GET", "/api/samples?key=body.1.ReLU&kind=forward&since=3")
        assert [s["call"] for s in answer["samples"]] == [5]
        status, svg = request(server, "GET", "/api/chart.svg?key=body.1.ReLU&kind=forward&role=output")
        assert b'data-samples="3"' in svg and svg.count(b"<polyline") == 1



def _run_with_history(logdir: Path, steps: int = 7) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """``steps`` training steps served with ring=2 and logdir (retention=5), body.2.Linear's forward armed;
    the outputs a plain hook saw, and what the API answered before stop()."""
    model = _model()
    outputs: list[torch.Tensor] = []
    model.body[2].register_forward_hook(
        lambda m, a, out: outputs.append(out.detach().clone()) if torch.is_grad_enabled() else None)
    seen: dict[str, Any] = {}
    with fwdtrace.serve(model, port=0, ring=2, logdir=logdir, retention=5) as server:
        request(server, "POST", "/api/sample", {"key": "body.2.Linear", "kind": "forward"})
        train_steps(model, steps)
        seen["ring"] = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward")[1]
        seen["older"] = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward&before=6&limit=3")[1]
        seen["all"] = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward&before=100&limit=100")[1]
        seen["history"] = request(server, "GET", "/api/history")[1]
        seen["chart"] = request(server, "GET", "/api/chart.svg?key=body.2.Linear&kind=forward&role=output&before=5")[1]
        seen["status"] = request(server, "GET", "/api/status")[1]
    return outputs, seen


def _assert_output_stats(samples: list[dict[str, Any]], outputs: list[torch.Tensor]) -> None:
    """Each sample's output summary is the statistics torch computes of the output at that step."""
    for sample in samples:
        ref = outputs[sample["step"] - 1].double()
        out = [t for t in sample["tensors"] if t["role"] == "output"][0]
        assert_moments(out["mean"], None, None, ref, dtype=torch.float32)
        assert_moments(None, out["std"], None, ref, dtype=torch.float32)
        assert (out["min"], out["max"]) == (pytest.approx(float(ref.min())), pytest.approx(float(ref.max())))
        assert np.histogram(ref.numpy(), bins=out["bin_edges"])[0].tolist() == out["histogram"]
        assert out["numel"] == ref.numel() and (out["nan"], out["inf"]) == (0, 0)


def test_history_on_disk_reaches_back_beyond_the_ring_and_reopens_without_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fwdtrace.cli import main
    from fwdtrace.live import reopen

    outputs, seen = _run_with_history(tmp_path / "run")
    assert len(outputs) == 7
    assert [s["step"] for s in seen["ring"]["samples"]] == [6, 7]  # the ring holds 2
    older = seen["older"]
    assert older["source"] == "history" and [s["step"] for s in older["samples"]] == [3, 4, 5]
    _assert_output_stats(older["samples"], outputs)
    assert [[t["role"] for t in s["tensors"]] for s in older["samples"]] == [["input", "output"]] * 3
    assert [s["step"] for s in seen["all"]["samples"]] == [3, 4, 5, 6, 7]  # retention=5: steps 1 and 2 dropped
    series = {(s["role"]): (s["rows"], s["appended"], s["first_step"], s["last_step"]) for s in seen["history"]["series"]}
    assert series == {"input": (5, 7, 3, 7), "output": (5, 7, 3, 7)}
    assert b'data-samples="2"' in seen["chart"] and b"step 3" in seen["chart"]  # steps 3 and 4, from disk
    assert seen["status"]["history"] == {"logdir": str(tmp_path / "run"), "retention": 5}

    # The finished run, reopened from its directory as `fwdtrace serve --logdir` does: graph, keys, history.
    with reopen(tmp_path / "run", port=0) as server:
        status, answer = request(server, "GET", "/api/status")
        assert (answer["read_only"], answer["model"], answer["step"], answer["graph"]) == (True, "Net", 7, "ready")
        assert [(a["key"], a["kind"], a["samples"], a["taken"]) for a in answer["arms"]] == [
            ("body.2.Linear", "forward", 5, 7)]
        status, text = request(server, "GET", "/api/graph", raw=True)
        assert fwdtrace.Graph.from_json(text.decode()) == fwdtrace.trace(_model(), torch.randn(5, 8))
        assert [k["key"] for k in request(server, "GET", "/api/keys")[1]] == fwdtrace.module_keys(_model())
        status, answer = request(server, "GET", "/api/samples?key=body.2&kind=forward&before=6&limit=3")
        assert answer["samples"] == older["samples"]  # by path, as a live service answers
        status, answer = request(server, "GET", "/api/stats?key=body.2.Linear&which=forward_output")
        kept = torch.cat([outputs[i].reshape(-1) for i in range(2, 7)]).double()
        assert answer["stats"]["count"] == kept.numel()
        assert_moments(answer["stats"]["mean"], None, None, kept, dtype=torch.float32)
        assert_moments(None, answer["stats"]["std"], None, kept, dtype=torch.float32)
        assert (answer["stats"]["min"], answer["stats"]["max"]) == (float(kept.min()), float(kept.max()))
        status, answer = request(server, "POST", "/api/sample", {"key": "body.0.Linear", "kind": "forward"})
        assert status == 409 and answer["error"].startswith("this is a finished run reopened read-only from")
        status, answer = request(server, "DELETE", "/api/sample?key=body.2.Linear")
        assert status == 409
        status, answer = request(server, "GET", "/api/samples?key=body.0.Linear&kind=forward")
        assert status == 404 and answer["error"] == "'body.0.Linear' was never armed for forward sampling; the run kept none of it"
    with pytest.raises(FwdtraceError, match=r"^reopen\(\) expected logdir as the directory of a fwdtrace live run "
                                            r"\(holding history.h5\), got '.*', which has no history.h5"):
        reopen(tmp_path, port=0)
    assert main(["serve", "--logdir", str(tmp_path / "none"), "--port", "0"]) == 2  # what the CLI calls, refusing
    assert capsys.readouterr().err.startswith("fwdtrace serve: error: reopen() expected logdir as the directory of")
    assert main(["serve", "--port", "0"]) == 2
    assert "expected a model factory ('pkg.module:function') or --logdir DIR" in capsys.readouterr().err
    with pytest.raises(FwdtraceError, match=r"^serve\(\) expected logdir as a new or empty directory, or a fwdtrace"):
        fwdtrace.serve(_model(), port=0, logdir=TESTS)
    with pytest.raises(FwdtraceError, match=r"^serve\(\) expected retention only with logdir="):
        fwdtrace.serve(_model(), port=0, retention=3)

def test_several_threads_calling_the_model() -> None:
    model = _model()
    calls = []
    model.body[1].register_forward_hook(lambda m, a, out: calls.append(1))
    # The graph is traced up front: tracing the first forward patches layers process-wide, which
    # other threads calling the model at that moment would run into (until the per-thread core lands).
    with fwdtrace.serve(model, example_inputs=torch.randn(1, 8), port=0, ring=1000, pending=1000) as server:
        request(server, "POST", "/api/sample", {"key": "body.1.ReLU", "kind": "forward"})

        def work() -> None:
            with torch.no_grad():
                for _ in range(25):
                    model(torch.randn(3, 8))

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        status, answer = request(server, "GET", "/api/samples?key=body.1.ReLU&kind=forward")
    assert answer["taken"] == answer["calls"] == len(answer["samples"]) == len(calls) - 1 == 100  # not the trace's call
    assert sorted(s["call"] for s in answer["samples"]) == list(range(1, 101))


def test_serve_rejects_bad_arguments() -> None:
    with pytest.raises(FwdtraceError, match=r"^serve\(\) expected a torch.nn.Module as model, got str"):
        fwdtrace.serve("model")  # type: ignore[arg-type]
    with pytest.raises(FwdtraceError, match=r"^serve\(\) expected port as an int in 0..65535"):
        fwdtrace.serve(_model(), port=70000)
    model = _model()
    before = hook_dicts(model)
    with pytest.raises(FwdtraceError, match=r"^serve\(\) expected ring as a positive int, got 0"):
        fwdtrace.serve(model, port=0, ring=0)
    with fwdtrace.serve(model, port=0) as server:
        with pytest.raises(FwdtraceError, match=rf"^serve\(\) could not listen on 127.0.0.1:{server.port}"):
            fwdtrace.serve(model, port=server.port)
    assert hook_dicts(model) == before  # nothing left hooked by the failed starts


def test_cli_serves_a_model_without_a_training_loop() -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    command = [sys.executable, "-m", "fwdtrace.cli", "serve", "zoo:ResNetish", "--input-shape", "1,3,16,16", "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.match(r"^serving ResNetish at (http://127.0.0.1:(\d+)/)", line)
        assert match, line + (proc.stderr.read() if proc.stderr else "")

        class At:
            port = int(match.group(2))

        status, svg = request(At, "GET", "/api/graph.svg?depth=1")
        assert status == 200 and b'data-key="blocks.Sequential"' in svg
    finally:
        proc.terminate()
        proc.wait(timeout=30)


DDP_WORKER = """
import json, os, sys, urllib.request
import torch, torch.distributed as dist
import fwdtrace
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
with fwdtrace.serve(model, port=int(sys.argv[1])) as server:
    urllib.request.urlopen(urllib.request.Request(server.url + "api/sample", method="POST",
        data=json.dumps({"key": "module.0.Linear", "kind": "grad"}).encode(),
        headers={"Content-Type": "application/json"}))
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
    dist.barrier()
    other = f"http://127.0.0.1:{int(sys.argv[1]) + 1 - rank}/"
    answer = json.load(urllib.request.urlopen(other + "api/samples?key=module.0.Linear&kind=grad"))
    status = json.load(urllib.request.urlopen(server.url + "api/status"))
    row = {"rank": rank, "port": server.port, "other_ranks": sorted({s["rank"] for s in answer["samples"]}),
           "other_taken": answer["taken"], "status": [status["rank"], status["world_size"]]}
    with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:  # not stdout: the ranks share it
        json.dump(row, f)
    dist.barrier()
dist.destroy_process_group()
"""


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two free consecutive ports")


def test_torch_distributed_each_rank_serves_on_port_plus_rank(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(DDP_WORKER)
    port = _free_port_pair()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port_pair() + 2), str(script), str(port), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_in_session(command, 240, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (each rank writes its own file: printed lines of two ranks can interleave on the shared stdout)
    rows = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["port"]) for r in rows] == [(0, port), (1, port + 1)]
    assert [r["other_ranks"] for r in rows] == [[1], [0]]  # each rank's samples carry its rank
    assert [r["other_taken"] for r in rows] == [3, 3]
    assert [r["status"] for r in rows] == [[0, 2], [1, 2]]


def test_a_full_summariser_queue_skips_samples_without_waiting() -> None:
    from fwdtrace.live.sampler import Sampler

    model = _model()
    sampler = Sampler(model, pending=1)
    entered, release = threading.Event(), threading.Event()
    record = sampler._record

    def slow_record(*args: Any) -> None:  # the summariser stuck on the first sample
        entered.set()
        release.wait(10)
        record(*args)

    sampler._record = slow_record  # type: ignore[method-assign]
    try:
        sampler.arm("body.1.ReLU", "forward")
        with torch.no_grad():
            model(torch.randn(2, 8))
            assert entered.wait(10)
            for _ in range(3):  # one waits in the queue, two find it full: none of these calls blocks
                model(torch.randn(2, 8))
        info = sampler.arms[("body.1.ReLU", "forward")].info()
        assert (info["calls"], info["taken"], info["skipped"]) == (4, 4, 2)
        release.set()
        assert [s["call"] for s in sampler.samples("body.1.ReLU", "forward")] == [1, 2]
    finally:
        release.set()
        sampler.close()


def test_raw_values_stay_under_the_cap() -> None:
    model = _model()
    with fwdtrace.serve(model, port=0, raw_cap=16) as server:
        request(server, "POST", "/api/sample", {"key": "body.2.Linear", "kind": "forward", "raw": True})
        with torch.no_grad():
            x = torch.randn(2, 8)
            out = model(x)
        status, data = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward&format=npy&index=1", raw=True)
        assert status == 200  # the output, 2 x 4 = 8 elements, is kept
        np.testing.assert_array_equal(np.load(io.BytesIO(data), allow_pickle=False), out.numpy())
        status, answer = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward&format=npy&index=0")
        assert status == 409 and answer["error"].startswith("no raw values kept for tensor 0 of 'body.2.Linear': it has 32 elements, over the cap of 16")
        status, answer = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward&format=npy&index=5")
        assert status == 404 and answer["error"].startswith("no tensor index=5 in sample=-1")
        status, answer = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward&format=csv")
        assert status == 400 and answer["error"].startswith("expected format=json or format=npy, got 'csv'")


# -- hostile clients, in-place models, stop() races, layout, memory (issue 24) ------------------------------
def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wait_for(condition: Any, what: str, timeout: float = 120.0) -> None:
    """Wait for ``condition()`` to hold; the timeout is only a backstop against a hang, never the measure."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_hundreds_of_idle_and_slow_clients_leave_training_and_the_owner_unaffected() -> None:
    model = _model()
    stop = threading.Event()
    steps = [0]

    def training() -> None:
        while not stop.is_set():
            train_steps(model, 1)
            steps[0] += 1

    with fwdtrace.serve(model, example_inputs=torch.randn(1, 8), port=0) as server:  # the defaults
        cap = 32  # serve()'s default max_connections
        base_threads, base_fds = threading.active_count(), _fd_count()
        trainer = threading.Thread(target=training, daemon=True)
        trainer.start()
        clients: list[socket.socket] = []
        try:
            for i in range(400):  # 300 connect and say nothing, 100 send the start of a request and trickle
                c = socket.create_connection(("127.0.0.1", server.port), timeout=30)
                clients.append(c)
                if i % 4 == 3:
                    try:
                        c.sendall(b"GET /api/status HTTP/1.1\r\nHo")
                    except OSError:
                        pass  # closed by the server already
            for _ in range(3):
                for c in clients[3::4]:
                    try:
                        c.send(b"s")
                    except OSError:
                        pass  # closed by the server to make room: what it should do
            # Every thread and descriptor the server holds is bounded by the cap, not by the clients.
            _wait_for(lambda: threading.active_count() <= base_threads + 1 + cap, "the server's threads to stay bounded")
            assert _fd_count() <= base_fds + len(clients) + 2 * cap
            # The owner's page and API still answer, and the training loop still steps.
            before = steps[0]
            assert request(server, "GET", "/")[0] == 200
            status, answer = request(server, "GET", "/api/status")
            assert status == 200 and answer["step"] >= before > 0, answer
            _wait_for(lambda: steps[0] > before + 2, "the training loop to step on")
            assert server.httpd.replaced >= len(clients) - cap
        finally:
            stop.set()
            for c in clients:
                c.close()
            trainer.join()


def test_a_connection_beyond_the_cap_is_refused_at_once_when_all_are_answering() -> None:
    with fwdtrace.serve(_model(), port=0, max_connections=1, timeout=600) as server:
        busy = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        # A POST whose body never comes: its connection is answering a request, never closed to make room.
        busy.sendall(b"POST /api/sample HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10\r\n\r\n" % server.port)
        _wait_for(lambda: any(c.busy for c in list(server.httpd.connections.values())), "the POST to be read")
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        answer = extra.recv(4096)  # no request sent: the refusal comes by itself
        assert answer.startswith(b"HTTP/1.1 503 ") and b"too many connections (at most 1, all answering)" in answer
        extra.close()
        busy.sendall(b'{"key":1}\n')
        answer = b""
        while chunk := busy.recv(4096):  # to the end: a failed POST closes its connection, freeing the place
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 ")
        busy.close()
        assert request(server, "GET", "/api/status")[0] == 200


def test_a_connection_that_sends_no_whole_request_is_closed_after_the_timeout() -> None:
    with fwdtrace.serve(_model(), port=0, timeout=0.5) as server:
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        slow.sendall(b"GET /api/status HTTP/1.1\r\n")
        for s in (idle, slow):  # the server hangs up: the read ends with no data, well before 60 s
            assert s.recv(4096) == b""
            s.close()


def test_without_the_token_nothing_more_is_read() -> None:
    with fwdtrace.serve(_model(), port=0, token="the-owners-token") as server:
        c = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        # A body announced but never sent: the 401 comes at once, without waiting for it.
        c.sendall(b"POST /api/sample HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 60000\r\n\r\n" % server.port)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = c.recv(4096)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 401 ") and b"Connection: close" in answer
        assert c.recv(4096) == b""  # and the connection is closed
        c.close()


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softmax(self.q(x), dim=-1)


def test_function_keys_probe_takes_are_listed_armed_and_boxed_with_the_same_strings() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Attn(), _Attn())
    fwdtrace.register_atomic("torch.nn.functional.softmax")
    x = torch.randn(3, 4)
    outputs: list[torch.Tensor] = []  # the reference: each block's output is its softmax's
    model[0].register_forward_hook(lambda m, i, o: outputs.append(o.detach()))
    with fwdtrace.serve(model, example_inputs=(x,), port=0) as server:
        status, rows = request(server, "GET", "/api/keys")
        functions = [r for r in rows if "function" in r]
        assert [(r["key"], r["path"], r["function"], r["shapes"]) for r in functions] == [
            (f"{i}.softmax", str(i), "torch.nn.functional.softmax", {"input": [[3, 4]], "output": [[3, 4]]})
            for i in range(2)
        ]
        with fwdtrace.Probe(model) as probe:  # the same key strings as Probe's
            assert [list(probe.select(r["key"])) for r in functions] == [[r["key"]] for r in functions]
        status, svg = request(server, "GET", "/api/graph.svg", raw=True)
        assert b'data-key="0.softmax"' in svg and b'data-key="1.softmax"' in svg
        status, answer = request(server, "POST", "/api/sample", {"key": "0.softmax"})
        assert (status, answer["armed"]) == (200, ["0.softmax"])
        status, answer = request(server, "POST", "/api/sample", {"key": "0.softmax", "kind": "weight"})
        assert status == 400 and re.match(r"^arm\(\) samples a function key \('0.softmax'\) by its calls only",
                                          answer["error"])
        outputs.clear()
        for _ in range(2):
            model(x)
        server.sampler.drain()
        status, answer = request(server, "GET", "/api/samples?key=0.softmax&kind=forward")
    assert (answer["taken"], answer["error"], len(answer["samples"])) == (2, None, 2)
    for sample, want in zip(answer["samples"], outputs, strict=True):
        out = next(t for t in sample["tensors"] if t["role"] == "output")
        assert_moments(out["mean"], None, None, want, dtype=torch.float32)
        assert_moments(None, out["std"], None, want, dtype=torch.float32)


def test_grad_sampling_works_beside_in_place_ops() -> None:
    torch.manual_seed(0)
    model = InPlace()
    # The reference: the same weights without in-place, torch's own full backward hooks.
    reference = Net()
    reference.load_state_dict(model.state_dict())
    seen: dict[str, list[tuple]] = {"body.0.Linear": [], "body.1.ReLU": []}
    for key, index in (("body.0.Linear", 0), ("body.1.ReLU", 1)):
        reference.body[index].register_full_backward_hook(lambda m, gi, go, key=key: seen[key].append((gi, go)))
    x = torch.randn(5, 8, requires_grad=True)
    with fwdtrace.serve(model, port=0) as server:
        for key in seen:
            status, answer = request(server, "POST", "/api/sample", {"key": key, "kind": "grad"})
            assert (status, answer["armed"]) == (200, [key])
        for _ in range(2):
            model(x).pow(2).mean().backward()  # raised RuntimeError from BackwardHookFunction before
            reference(x).pow(2).mean().backward()
        assert torch.equal(model.body[0].weight.grad, reference.body[0].weight.grad)
        for key, refs in seen.items():
            status, answer = request(server, "GET", f"/api/samples?key={key}&kind=grad")
            assert (answer["taken"], answer["error"], len(answer["samples"])) == (2, None, 2)
            for sample, (gi, go) in zip(answer["samples"], refs, strict=True):
                by_role = {t["role"]: t for t in sample["tensors"]}
                assert_moments(by_role["grad_output"]["mean"], None, None, go[0], dtype=torch.float32)
                assert_moments(None, by_role["grad_output"]["std"], None, go[0], dtype=torch.float32)
                # body.0.Linear's input is x, a leaf: its hook is gone once it fired (none piles up on x)
                assert not x._backward_hooks
                assert_moments(by_role["grad_input"]["mean"], None, None, gi[0], dtype=torch.float32)


def test_an_error_inside_a_sampling_hook_disarms_the_key_and_never_reaches_training() -> None:
    model = _model()
    before = hook_dicts(model)
    with fwdtrace.serve(model, port=0) as server:
        request(server, "POST", "/api/sample", {"key": "body.2.Linear", "kind": "forward"})
        request(server, "POST", "/api/sample", {"key": "body.0.Linear", "kind": "grad"})

        def broken(*args: Any) -> None:
            raise MemoryError("no room for the copy")

        server.sampler._submit = broken  # type: ignore[method-assign]
        train_steps(model, 2)  # no exception here
        status, answer = request(server, "GET", "/api/status")
        arms = {a["key"]: a for a in answer["arms"]}
        assert arms["body.2.Linear"]["armed"] is False and arms["body.0.Linear"]["armed"] is False
        assert arms["body.2.Linear"]["error"] == "disarmed: the forward hook raised MemoryError: no room for the copy"
        assert arms["body.0.Linear"]["error"] == "disarmed: a gradient hook raised MemoryError: no room for the copy"
        assert hook_dicts(model) != before  # only the step counter is left
    assert hook_dicts(model) == before


def _arm_and_disarm(server: Any, kind: str, started: threading.Event, done: threading.Event) -> None:
    for i in range(200):  # bounded: ends by itself when the server is gone
        if done.is_set():
            return
        try:
            if i % 3 == 2:
                request(server, "DELETE", f"/api/sample?key=body.*&kind={kind}")
            else:
                request(server, "POST", "/api/sample", {"key": "body.*", "kind": kind})
        except (OSError, http.client.HTTPException):  # the server went away mid-request
            return
        started.set()


def test_stop_under_concurrent_arms_leaves_no_hook() -> None:
    original_call = torch.nn.Module._call_impl
    model = _model()
    before = hook_dicts(model)
    for _ in range(25):
        server = fwdtrace.serve(model, port=0)
        started, done = threading.Event(), threading.Event()
        threads = [threading.Thread(target=_arm_and_disarm, args=(server, k, started, done))
                   for k in ("forward", "grad", "forward", "grad")]
        for t in threads:
            t.start()
        assert started.wait(60)
        server.stop()
        done.set()
        for t in threads:
            t.join()
        assert hook_dicts(model) == before
        assert torch.nn.Module._call_impl is original_call
        with pytest.raises(FwdtraceError, match=r"^the live service is stopped"):
            server.sampler.arm("body.*", "forward")
        assert hook_dicts(model) == before


def test_graph_layout_runs_in_a_child_process_and_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from fwdtrace.passes import draw

    def in_this_process(*args: Any) -> bytes:
        raise AssertionError("laid out in the training process")

    monkeypatch.setattr(draw, "layout_bytes", in_this_process)
    model = _model()
    with fwdtrace.serve(model, example_inputs=torch.randn(2, 8), port=0) as server:
        status, svg = request(server, "GET", "/api/graph.svg?depth=1")
        assert status == 200 and re.findall(r'class="node" data-key="([^"]+)"', svg.decode()) == ["body.Sequential"]
        from fwdtrace.live.server import SVG_CACHE

        child = server._layouts.proc
        assert child.pid != os.getpid() and child.poll() is None
        for depth in range(3 * SVG_CACHE):
            assert request(server, "GET", f"/api/graph.svg?depth={depth}")[0] == 200
        assert len(server._svg_cache) == SVG_CACHE
        assert list(server._svg_cache) == list(range(2 * SVG_CACHE, 3 * SVG_CACHE))  # the latest kept
    assert child.wait(60) is not None  # stop() ended it


def test_retained_samples_stay_under_the_memory_budget() -> None:
    budget = 40_000
    model = _model()
    with fwdtrace.serve(model, port=0, memory=budget) as server:
        status, answer = request(server, "POST", "/api/sample", {"key": "*", "raw": True})
        assert status == 200 and len(answer["armed"]) == 5
        train_steps(model, 30)
        status, answer = request(server, "GET", "/api/status")
        memory = answer["memory"]
        held = 0
        for arm in server.sampler.arms.values():  # what the buffers really hold, counted here
            for _, raws in arm.buffer:
                held += sum(r.numel() * r.element_size() for r in raws if r is not None)
        assert memory["budget"] == budget and held <= memory["retained"] <= budget
        assert sum(a["over_budget"] for a in answer["arms"]) > 0
        refused = []
        for arm in answer["arms"]:
            samples = request(server, "GET", f"/api/samples?key={arm['key']}&kind=forward")[1]["samples"]
            refused += [(arm["key"], i - len(samples), t["index"]) for i, s in enumerate(samples)
                        for t in s["tensors"] if not t["raw"] and "memory budget" in t.get("raw_note", "")]
        assert refused
        key, sample, index = refused[0]
        status, answer = request(server, "GET", f"/api/samples?key={key}&kind=forward&format=npy&index={index}&sample={sample}")
        assert status == 409 and "memory budget (40000 bytes)" in answer["error"]


BAD_BODIES = [
    ("a 5000-digit integer", b'{"key": "body.1.ReLU", "every": ' + b"9" * 5000 + b"}"),
    ("nesting 30000 deep", b"[" * 30000 + b"]" * 30000),
]


@pytest.mark.parametrize("body", [b for _, b in BAD_BODIES], ids=[n for n, _ in BAD_BODIES])
def test_hostile_json_answers_400(body: bytes) -> None:
    with fwdtrace.serve(_model(), port=0) as server:
        status, answer = request(server, "POST", "/api/sample", body, {"Content-Type": "application/json"})
        assert status == 400 and answer["error"].startswith("expected a JSON object like {")


def test_clients_that_hang_up_print_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    import struct

    with fwdtrace.serve(_model(), example_inputs=torch.randn(1, 8), port=0) as server:
        for _ in range(20):
            c = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            c.sendall(b"GET /api/graph HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % server.port)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            c.close()
        assert request(server, "GET", "/api/status")[0] == 200
    assert capfd.readouterr().err == ""


def test_port_plus_rank_beyond_65535_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from fwdtrace.live import sampler

    monkeypatch.setattr(sampler, "distributed_rank", lambda: (3, 4))
    model = _model()
    before = hook_dicts(model)
    with pytest.raises(FwdtraceError, match=r"^serve\(\) cannot listen on port 65534 \+ rank 3 = 65537"):
        fwdtrace.serve(model, port=65534)
    assert hook_dicts(model) == before


# -- weights, steady bins, one series per tensor (issue 23) --------------------------------------------------
def test_weight_and_weight_grad_are_each_parameter_read_after_backward() -> None:
    model = _model()
    seen: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []  # body.0's parameters and .grad, read after each backward
    with fwdtrace.serve(model, port=0) as server:
        status, answer = request(server, "POST", "/api/sample", {"key": "body.0", "kind": "weight", "every": 2})
        assert (status, answer["armed"]) == (200, ["body.0.Linear"])
        status, answer = request(server, "POST", "/api/sample", {"key": "body.0.Linear", "kind": "weight_grad"})
        assert status == 200
        for _ in range(4):
            model.zero_grad()
            model(torch.randn(5, 8)).pow(2).mean().backward()
            seen.append({n: (p.detach().clone(), p.grad.clone()) for n, p in model.body[0].named_parameters()})
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        for kind, which, steps in (("weight", 0, (0, 2)), ("weight_grad", 1, (0, 1, 2, 3))):
            status, answer = request(server, "GET", f"/api/samples?key=body.0.Linear&kind={kind}")
            assert (answer["calls"], answer["taken"], answer["roles"]) == (4, len(steps), ["weight", "bias"])
            for name in ("weight", "bias"):
                tensors = [t for s in answer["samples"] for t in s["tensors"] if t["role"] == name]
                assert len(tensors) == len(steps)
                for t, i in zip(tensors, steps, strict=True):
                    ref = seen[i][name][which].double()
                    assert t["shape"] == list(ref.shape)
                    assert_moments(t["mean"], None, None, ref, dtype=torch.float32)
                    assert (t["min"], t["max"]) == (pytest.approx(float(ref.min())), pytest.approx(float(ref.max())))
                    assert t["histogram"] == np.histogram(ref.numpy(), bins=t["bin_edges"])[0].tolist()
            status, answer = request(server, "GET", f"/api/stats?key=body.0&kind={kind}&role=bias")
            every = torch.cat([seen[i]["bias"][which] for i in steps]).double()
            assert answer["stats"]["count"] == every.numel() == 16 * len(steps)
            assert_moments(answer["stats"]["mean"], None, None, every, dtype=torch.float32)
            assert_moments(None, answer["stats"]["std"], None, every, dtype=torch.float32)
            status, svg = request(server, "GET", f"/api/chart.svg?key=body.0.Linear&kind={kind}&role=weight")
            assert status == 200 and f'data-samples="{len(steps)}"' in svg.decode()
        status, answer = request(server, "GET", "/api/stats?key=body.0.Linear&kind=weight&role=running_mean")
        assert status == 404 and answer["roles"] == ["weight", "bias"]


def test_a_parameter_kind_keeps_one_sample_per_backward_with_every_parameter() -> None:
    from fwdtrace.live.sampler import Sampler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))  # four parameters under the root
    grads = []
    sampler = Sampler(model, ring=2, pending=1)
    try:
        sampler.arm("Sequential", "weight_grad")
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(5, 3)).pow(2).sum().backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
            sampler.drain()
        info = sampler.arm_of("Sequential", "weight_grad").info()
        assert (info["calls"], info["taken"], info["dropped"], info["skipped"]) == (3, 3, 1, 0)
        samples = sampler.samples("Sequential", "weight_grad")
        assert [s["step"] for s in samples] == [2, 3]  # a ring of 2 keeps two steps, not two parameters
        for sample, ref in zip(samples, grads[1:], strict=True):
            assert [t["role"] for t in sample["tensors"]] == list(ref)
            for t in sample["tensors"]:
                assert_moments(t["mean"], None, None, ref[t["role"]], dtype=torch.float32)
    finally:
        sampler.close()


def test_a_parameter_kind_counts_every_backward_that_reaches_the_module_and_samples_every_nth() -> None:
    # Two backwards of one forward, a backward of the layer alone (no step), one that never
    # reaches it: the hooks count backwards, not steps, and read .grad at the sampled ones' end.
    from fwdtrace.live.sampler import Sampler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    sampler = Sampler(model)
    grads = []  # 0.Linear's weight .grad after each backward reaching it

    def backward(loss: torch.Tensor, **kwargs: bool) -> None:
        loss.backward(**kwargs)
        grads.append(model[0].weight.grad.clone())

    try:
        sampler.arm("0.Linear", "weight_grad", every=3)
        for i in range(3):
            model.zero_grad()
            loss = model(x).pow(2).sum()
            backward(loss, retain_graph=True)
            backward(loss)
            model[1](torch.randn(2, 4)).sum().backward()  # does not reach 0.Linear
            if i < 2:
                backward(model[0](x).sum())
        info = sampler.arm_of("0.Linear", "weight_grad").info()
        assert (info["calls"], info["taken"]) == (len(grads), 3) == (8, 3)
        samples = sampler.samples("0.Linear", "weight_grad")
        assert [s["call"] for s in samples] == [1, 4, 7]
        for sample, ref in zip(samples, (grads[0], grads[3], grads[6]), strict=True):
            t = next(t for t in sample["tensors"] if t["role"] == "weight")
            assert_moments(t["mean"], None, None, ref, dtype=torch.float32)
            assert (t["min"], t["max"]) == (pytest.approx(float(ref.min())), pytest.approx(float(ref.max())))
    finally:
        sampler.close()


def test_bins_hold_while_the_range_grows_inside_and_are_the_recorders_edges() -> None:
    from fwdtrace.live.sampler import Sampler
    from fwdtrace.recorder import views

    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity())
    sampler = Sampler(model, bins=32)
    canvas = views.FrameCanvas(bins=32)
    try:
        sampler.arm("0.Identity", "forward")
        base = torch.randn(2, 500)
        series = [base, base * 0.5, base * 0.8, base * 1.0, base * 3 + 2, base]  # grows inside, then leaves
        recorder_edges = []
        for x in series:
            model(x)
            canvas.draw("k", views.reduce(x, ("histogram",)), ("histogram",))
            recorder_edges.append(canvas.panels["histogram"].artist.get_data().edges.tolist())
        samples = sampler.samples("0.Identity", "forward")
        edges = [s["tensors"][1]["bin_edges"] for s in samples]
        assert edges == recorder_edges  # the page's bins are the video's
        assert edges[0] == edges[1] == edges[2] == edges[3] and edges[4] == edges[5] != edges[0]
        for s, x in zip(samples, series, strict=True):
            assert s["tensors"][1]["histogram"] == np.histogram(x.double().numpy(), bins=s["tensors"][1]["bin_edges"])[0].tolist()
        stats = sampler.stats("0.Identity", "forward", "output")
        assert stats["rebins"] == 1 and stats["bin_edges"] == edges[-1]  # every sample, re-binned onto the grown edges
        assert stats["histogram"] == np.histogram(torch.cat(series).double().numpy(), bins=edges[-1])[0].tolist()
        # Edges the user sets are kept; what falls outside is counted.
        sampler.arm("0.Identity", "forward", bins=[-1.0, 0.0, 1.0])
        model(torch.tensor([-2.0, -0.5, 0.5, 0.7, 3.0]))
        [t] = [t for t in sampler.samples("0.Identity", "forward")[0]["tensors"] if t["role"] == "output"]
        assert (t["bin_edges"], t["histogram"], t["underflow"], t["overflow"]) == ([-1.0, 0.0, 1.0], [1, 2], 1, 1)
    finally:
        sampler.close()


def test_a_layer_with_several_outputs_has_one_series_per_tensor() -> None:
    from fwdtrace.live.sampler import Sampler

    torch.manual_seed(0)
    lstm = nn.LSTM(4, 3)
    model = nn.Sequential(lstm)
    outputs: list[Any] = []
    lstm.register_forward_hook(lambda m, a, out: outputs.append((out[0].detach(), out[1][0].detach(), out[1][1].detach())))
    sampler = Sampler(model)
    try:
        sampler.arm("0.LSTM", "forward")
        for _ in range(2):
            model(torch.randn(5, 2, 4) * 3)
        roles = ["output[0]", "output[1][0]", "output[1][1]"]
        assert sampler.arm_of("0.LSTM", "forward").roles() == ["input", *roles]
        for sample, refs in zip(sampler.samples("0.LSTM", "forward"), outputs, strict=True):
            by_role = {t["role"]: t for t in sample["tensors"]}
            for role, ref in zip(roles, refs, strict=True):
                assert by_role[role]["shape"] == list(ref.shape)
                assert_moments(by_role[role]["mean"], None, None, ref, dtype=torch.float32)
                assert_moments(None, by_role[role]["std"], None, ref, dtype=torch.float32)
        for role, i in zip(roles, range(3), strict=True):  # running statistics per tensor, not merged
            every = torch.cat([refs[i].reshape(-1) for refs in outputs]).double()
            stats = sampler.stats("0.LSTM", "forward", role)
            assert stats["count"] == every.numel()
            assert_moments(stats["mean"], None, None, every, dtype=torch.float32)
    finally:
        sampler.close()


def test_chart_titles_give_each_bins_count_and_each_steps_statistics() -> None:
    import xml.etree.ElementTree as ET

    from fwdtrace.live.sampler import Sampler
    from fwdtrace.live.svg import histogram_svg

    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity())
    sampler = Sampler(model, bins=16)
    try:
        sampler.arm("0.Identity", "forward", every=2)
        inputs = [torch.randn(300) * (1 + i) for i in range(7)]
        for x in inputs:
            model(x)
        samples = sampler.samples("0.Identity", "forward")
    finally:
        sampler.close()
    root = ET.fromstring(histogram_svg(samples, "output"))
    by_step = {s["step"]: x for s, x in zip(samples, inputs[::2], strict=True)}
    bins = [(r.get("class"), r.findtext(f"{SVG}title")) for r in root.iter(f"{SVG}rect") if r.get("class") == "bin"]
    seen = 0
    for _, title in bins:  # "step 3: 41 in [-0.5, 0)": the count numpy gives for that step's values in that bin
        step, count, low, high = re.fullmatch(r"step (\d+): (\d+) in \[(\S+), (\S+)\)", title or "").groups()
        x = by_step[int(step)].double()
        assert int(count) == int(((x >= float(low)) & (x < float(high))).sum()) > 0
        seen += int(count)
    assert seen == sum(x.numel() for x in by_step.values())  # every value is in one titled bin
    points = [c.findtext(f"{SVG}title") for c in root.iter(f"{SVG}circle")]
    assert len(points) == len(samples)
    for title, (step, x) in zip(points, by_step.items(), strict=True):
        got = dict(kv.split("=") for kv in re.fullmatch(rf"step {step}: (.*)", title or "").group(1).split())
        x = x.double()
        for name, ref in (("mean", x.mean()), ("std", x.std(correction=0)), ("min", x.min()), ("max", x.max())):
            assert float(got[name]) == pytest.approx(float(ref), rel=1e-5, abs=1e-12), name
    yticks = [float(t.text or "") for t in root.iter(f"{SVG}text") if t.get("class") == "ytick"]
    edges = samples[-1]["tensors"][1]["bin_edges"]
    assert len(yticks) >= 3 and all(edges[0] <= v <= edges[-1] for v in yticks)
    xticks = [int(t.text or "") for t in root.iter(f"{SVG}text") if t.get("class") == "xtick"]
    assert xticks == [s["step"] for s in samples]  # four samples: each named


def health_step(model: nn.Module, x: torch.Tensor, poisoned: bool = False,
                inf_in: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[float, int, int]]:
    """One backward of ``model(x).pow(2).mean()`` (``x[0, 0]`` NaN when ``poisoned``: NaN in every gradient; an Inf
    at index 1 of the gradient of the parameter ``inf_in``) and the health of the gradients as torch computes it:
    total norm (``get_total_norm``), NaN and Inf counts."""
    model.zero_grad()
    if poisoned:
        x = x.clone()
        x[0, 0] = float("nan")
    handle = None if inf_in is None else inf_in.register_hook(
        lambda g: g.index_fill(0, torch.tensor([1]), float("inf")))
    loss = model(x).pow(2).mean()
    loss.backward()
    if handle is not None:
        handle.remove()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return loss, (float(torch.nn.utils.get_total_norm(grads)), sum(int(torch.isnan(g).sum()) for g in grads),
                  sum(int(torch.isinf(g).sum()) for g in grads))


def test_log_scalar_and_health_scalars_reach_the_api_as_torch_computes_them() -> None:
    from fwdtrace.live import log_scalar, scalars

    model = _model()
    log_scalar("loss", 1.0)  # no service running: nothing kept, nothing raised
    references = []
    with fwdtrace.serve(model, port=0) as server:
        assert scalars._logs == (server.sampler.scalars,)
        root = request(server, "GET", "/api/status")[1]["root"]
        assert root == "Net"
        assert request(server, "POST", "/api/sample", {"key": root, "kind": "health"})[0] == 200
        for i in range(4):
            # step 1: NaN in every gradient; step 2: Inf in one gradient and no NaN anywhere (the sampler
            # counts only when the norm is not finite)
            loss, reference = health_step(model, torch.randn(5, 8), poisoned=i == 1,
                                          inf_in=model.body[2].bias if i == 2 else None)
            references.append(reference)
            log_scalar("loss", loss)  # a 0-d tensor that requires grad
            log_scalar("lr", 0.1, step=100 + i)
        assert references[1][1] > 0 and references[0][1] == 0
        assert (references[2][1:], references[2][0]) == ((0, 1), float("inf"))
        threads = [threading.Thread(target=lambda t=t: [log_scalar(f"thread{t}", float(k)) for k in range(300)])
                   for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        status, answer = request(server, "GET", "/api/scalars")
        health = [f"{root}/grad_inf", f"{root}/grad_nan", f"{root}/grad_norm"]
        assert answer["names"] == sorted([*health, "loss", "lr", *(f"thread{t}" for t in range(4))])
        got = answer["scalars"]
        assert got[f"{root}/grad_norm"]["steps"] == [1, 2, 3, 4]
        norms = got[f"{root}/grad_norm"]["values"]
        assert norms[1] is None and norms[2] is None and np.isnan(references[1][0])  # NaN and Inf go out as JSON null
        assert [norms[0], norms[3]] == pytest.approx([references[0][0], references[3][0]], rel=1e-6)
        assert got[f"{root}/grad_nan"]["values"] == [r[1] for r in references]
        assert got[f"{root}/grad_inf"]["values"] == [r[2] for r in references]
        assert got["lr"] == {"steps": [100, 101, 102, 103], "values": [0.1] * 4, "seq": got["lr"]["seq"]}
        assert got["loss"]["steps"] == [1, 2, 3, 4] and got["loss"]["values"][1] is None
        for t in range(4):  # every point of every thread, in order
            assert got[f"thread{t}"]["values"] == [float(k) for k in range(300)]
        since = got["lr"]["seq"]
        later = request(server, "GET", f"/api/scalars?since={since}")[1]["scalars"]
        assert "lr" not in later and len(later["thread0"]["values"]) <= 300
        status, svg = request(server, "GET", "/api/scalar.svg?name=lr")
        assert status == 200 and "<title>step 101: lr=0.1</title>" in svg.decode()
        status, answer = request(server, "GET", "/api/scalar.svg?name=los")
        assert status == 404 and "loss" in answer["names"]
        with pytest.raises(FwdtraceError, match=r"^log_scalar\(\) expected value as a number or a one-element real tensor"):
            log_scalar("x", torch.ones(2))
        with pytest.raises(FwdtraceError, match=r"^log_scalar\(\) expected name as a non-empty str"):
            log_scalar(3, 1.0)  # type: ignore[arg-type]
    assert scalars._logs == ()


def test_a_live_arm_keeps_every_sample_of_a_run_that_diverges() -> None:
    from fwdtrace.live.sampler import Sampler

    model = Net()
    sampler = Sampler(model)
    try:
        sampler.arm("body.0.Linear", "forward")
        with torch.no_grad():
            for step in range(6):
                if step == 3:
                    model.body[0].weight.mul_(1e20)  # the outputs jump from about 1 to about 1e20
                model(torch.randn(2, 8))
        sampler.drain()
        arm = sampler.arms[("body.0.Linear", "forward")]
        assert arm.error is None and arm.armed
        samples = sampler.samples("body.0.Linear", "forward")
        assert [s["call"] for s in samples] == [1, 2, 3, 4, 5, 6]
        out = [t for t in samples[-1]["tensors"] if t["role"] == "output"][0]
        assert sum(out["histogram"]) + out["underflow"] + out["overflow"] == out["numel"] == 32
    finally:
        sampler.close()


def test_a_sparse_gradient_is_summarised_and_counted_in_health_as_its_dense_gradient() -> None:
    from fwdtrace.live.sampler import Sampler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 2))
    sampler = Sampler(model)
    try:
        sampler.arm("Sequential", "health")
        sampler.arm("0.Embedding", "weight_grad")
        model(torch.tensor([[1, 1]])).pow(2).sum().backward()  # one row used twice: duplicates to sum
        sampler.drain()
        assert all(arm.error is None and arm.armed for arm in sampler.arms.values())
        dense = [p.grad.to_dense() for p in model.parameters()]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in dense]).double()))
        assert sampler.scalars.read()["Sequential/grad_norm"]["values"] == pytest.approx([norm])
        [tensor] = sampler.samples("0.Embedding", "weight_grad")[0]["tensors"]
        weight_grad = dense[0].double()
        assert sum(tensor["histogram"]) == weight_grad.numel() == 40
        assert tensor["mean"] == pytest.approx(float(weight_grad.mean()))
        assert tensor["zero_fraction"] == pytest.approx(float((weight_grad == 0).double().mean()))
    finally:
        sampler.close()
