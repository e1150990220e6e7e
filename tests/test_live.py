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
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError

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
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
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
        loss = model(torch.randn(batch, 8)).pow(2).mean()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad


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
        for sample, ref in zip(answer["samples"], [outputs[i] for i in (0, 2, 4)], strict=True):
            out = [t for t in sample["tensors"] if t["role"] == "output"][0]
            assert out["shape"] == [5, 4] and out["dtype"] == "float32" and sample["rank"] == 0
            assert out["mean"] == pytest.approx(float(ref.double().mean()), rel=1e-9)
            assert out["std"] == pytest.approx(float(ref.double().std(correction=0)), rel=1e-9)
            assert (out["min"], out["max"]) == (pytest.approx(float(ref.min())), pytest.approx(float(ref.max())))
            assert sum(out["histogram"]) + out["underflow"] + out["overflow"] == 20 and (out["nan"], out["inf"]) == (0, 0)
            assert out["bin_edges"] == answer["samples"][0]["tensors"][1]["bin_edges"]  # the arm's bins
            assert np.histogram(ref.double().numpy(), bins=out["bin_edges"])[0].tolist() == out["histogram"]
            assert out["overflow"] == int((ref.double() > out["bin_edges"][-1]).sum())

        status, answer = request(server, "GET", "/api/stats?key=body.2.Linear&which=forward_output")
        sampled = torch.cat([outputs[i].reshape(-1) for i in (0, 2, 4)]).double()
        assert answer["stats"]["count"] == 60
        assert answer["stats"]["mean"] == pytest.approx(float(sampled.mean()), rel=1e-9)
        assert answer["stats"]["std"] == pytest.approx(float(sampled.std(correction=0)), rel=1e-9)

        status, answer = request(server, "GET", "/api/samples?key=body.0.Linear&kind=grad")
        assert (answer["calls"], answer["taken"]) == (6, 2)  # count=2: two samples, the calls still counted
        for sample, ref in zip(answer["samples"], grads[:2], strict=True):
            gout = [t for t in sample["tensors"] if t["role"] == "grad_output"][0]
            assert gout["mean"] == pytest.approx(float(ref.double().mean()), rel=1e-9)
        status, answer = request(server, "GET", "/api/stats?key=body.0.Linear&which=grad_output")
        assert answer["stats"]["count"] == 2 * 5 * 16

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


BAD = [
    ("GET", "/api/samples?key=body.2.Linea&kind=forward", None, {}, 404, r"^unknown module key 'body.2.Linea'"),
    ("GET", "/api/samples?key=body.1.ReLU&kind=forward", None, {}, 404, r"^'body.1.ReLU' was never armed for forward"),
    ("GET", "/api/samples?kind=forward", None, {}, 400, r"^expected a module key as \?key=KEY"),
    ("GET", "/api/samples?key=body.1.ReLU&kind=both", None, {}, 400, r"^expected kind=forward or kind=grad, got 'both'"),
    ("GET", "/api/stats?key=body.1.ReLU&which=output", None, {}, 400, r"^expected which= one of forward_input, "),
    ("GET", "/api/nothing", None, {}, 404, r"^no such path '/api/nothing'"),
    ("PUT", "/api/sample", None, {}, 501, None),
    ("GET", "/api/sample", None, {}, 405, r"^GET is not allowed on /api/sample"),
    ("POST", "/api/sample", b"{not json", {"Content-Type": "application/json"}, 400, r"^expected a JSON object like \{"),
    ("POST", "/api/sample", [1, 2], {}, 400, r"^expected a JSON object like .*, got a JSON list"),
    ("POST", "/api/sample", {"key": "body.1.ReLU", "when": 1}, {}, 400, r"^expected a JSON object like .*, got unexpected fields \['when'\]"),
    ("POST", "/api/sample", {"key": "body.1.ReLU", "kind": "backward"}, {}, 400, r'^expected "kind" as "forward" or "grad"'),
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
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
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
