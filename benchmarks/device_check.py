"""Every fwdtrace path on a GPU, in one run: a table of what works there, for the docs.

    python benchmarks/device_check.py [--device cuda] [--out docs/device-check.md]
    python benchmarks/device_check.py --device cpu --out /tmp/device-check.md   # smoke run, no GPU

On the device (under 5 minutes on one GPU), against the CPU or plain torch as reference:

- ``trace``: the trace of a small CNN and a small transformer on the device equals the CPU's,
  node for node and edge for edge (shapes and dtypes included);
- ``trace overhead``: a trace's time over a plain forward (synchronised), at a launch-bound size
  (batch 1, small layers: the trace's CPU time per op shows) and a GPU-bound one;
- ``probe``: ``Probe.running_stats`` against a plain hook's statistics computed in float64;
- ``dump``: a training step dumped on the CPU and on the device, ``compare_dumps`` with the
  runs' math records (TF32 explained, first divergence none), and again with TF32 off;
- ``analyze``: peak memory (``torch.cuda.max_memory_allocated`` on CUDA) and latency;
- ``check_onnx``: ``numeric=True`` on the device model (values copied to the host once each);
- ``to_onnx``: the file from a device run against eager in onnxruntime;
- ``live``: ``serve`` arms a layer's forward on the device model and samples it; ``log_scalar``
  takes a device tensor;
- ``recorder``: ``Recorder.track`` on the device model writes its files;
- ``autocast``: a trace under autocast shows the low-precision edges, and a dump keeps them with
  its math record saying autocast;
- ``compiled``: ``model.compile()`` (a counting backend: no C++ compiler needed) probed as eager;
- ``statistics``: the statistics engine on the device gives the CPU's summaries, with no
  synchronisation per tensor (CUDA's sync debug mode), and a statistics dump's cost against a plain step.

Each row is pass or FAIL with what was measured; the script exits 1 if any failed. With
``--device cpu`` every path runs on the CPU at tiny sizes: it proves the script, not the GPU,
and says so. Asked for CUDA where there is none, it says so and exits 0 without writing.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import http.client
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fwdtrace

Row = tuple[str, bool, str]


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])


def _image(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _signature(graph: fwdtrace.Graph) -> tuple[list[Any], list[Any]]:
    nodes = [(n.kind, n.target, n.module_path, [(r.shape, r.dtype) for r in n.outputs]) for n in graph.nodes]
    return nodes, [(e.src, e.dst, e.shape, e.dtype) for e in graph.edges]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: kernels chosen, caches filled
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- the checks -------------------------------------------------------------------------------------
def check_trace(device: torch.device, smoke: bool) -> Row:
    details, ok = [], True
    for name, make, x in (("cnn", cnn, _image()), ("transformer", transformer, torch.randn(2, 8, 32))):
        model = make().eval()
        want = _signature(fwdtrace.trace(model, x))
        got = _signature(fwdtrace.trace(model.to(device), x.to(device)))
        same = got == want
        ok = ok and same
        details.append(f"{name}: {len(want[0])} nodes, {len(want[1])} edges, {'equal' if same else 'DIFFERENT'}")
    return "trace equals the CPU's", ok, "; ".join(details)


def check_overhead(device: torch.device, smoke: bool) -> Row:
    sizes = [("launch-bound", 64, 12, 1), ("GPU-bound", 4096, 12, 512)] if not smoke else \
        [("launch-bound", 16, 4, 1), ("GPU-bound", 64, 4, 8)]
    details = []
    for label, width, depth, batch in sizes:
        model = mlp(width, depth).to(device).eval()
        x = torch.randn(batch, width, device=device)
        with torch.no_grad():
            plain = _median_time(lambda: model(x), device, 3 if smoke else 20)  # noqa: B023
            traced = _median_time(lambda: fwdtrace.trace(model, x), device, 3 if smoke else 20)  # noqa: B023
        details.append(f"{label} ({batch}x{width}, {2 * depth} layers): plain {plain * 1e3:.3g} ms, "
                       f"trace {traced * 1e3:.3g} ms, {traced / plain:.2g}x")
    return "trace overhead", True, "; ".join(details)


def check_probe(device: torch.device, smoke: bool) -> Row:
    model = cnn().to(device).train()
    seen: list[torch.Tensor] = []
    handle = model[3].register_forward_hook(lambda m, i, o: seen.append(o.detach().to("cpu", torch.float64)))
    with fwdtrace.Probe(model) as probe:
        stats = probe.running_stats("3.Conv2d", of="output")
        for _ in range(3):
            model(_image().to(device))
        got = stats.stats["3.Conv2d"]
    handle.remove()
    values = torch.cat([s.reshape(-1) for s in seen])
    want_mean, want_std = float(values.mean()), float(values.std(correction=0))  # RunningStats': population
    ok = abs(got.mean - want_mean) <= 1e-6 * max(1.0, abs(want_mean)) and abs(got.std - want_std) <= 1e-5 * want_std
    return "probe statistics equal a plain hook's", ok, (f"mean {got.mean:.6g} against {want_mean:.6g}, "
                                                          f"std {got.std:.6g} against {want_std:.6g}")


def _dump_step(model: nn.Module, x: torch.Tensor, folder: Path) -> Path:
    dumper = fwdtrace.Dumper(folder)
    dumper.register(model)
    model(x).logsumexp(1).sum().backward()
    (path,) = dumper.remove()
    return path


def check_dump(device: torch.device, smoke: bool, folder: Path) -> Row:
    model = cnn().train()
    twin = copy.deepcopy(model).to(device)
    cpu = _dump_step(model, _image(), folder / "cpu")
    dev = _dump_step(twin, _image().to(device), folder / "device")
    report = fwdtrace.compare_dumps(cpu, dev, rtol=3e-2, atol=1e-3)
    rounded = sorted({str(r.rounding) for r in report.rows if not r.allclose and r.rounding})
    details = [f"{len(report.rows)} tensors, {sum(r.allclose for r in report.rows)} allclose at 3e-2/1e-3"
               + (f", the rest within {' and '.join(rounded)} rounding" if rounded else "")
               + f", first divergence {report.first_divergence}"]
    ok = report.agree and report.first_divergence is None
    if device.type == "cuda":  # the same with TF32 off: elementwise equal, as on the H100 box
        saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        try:
            strict = fwdtrace.compare_dumps(cpu, _dump_step(copy.deepcopy(model).to(device), _image().to(device),
                                                            folder / "no_tf32"), rtol=3e-2, atol=1e-3)
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
        details.append(f"TF32 off: {'all allclose' if strict.equal else 'first divergence ' + str(strict.first_divergence)}")
        ok = ok and strict.equal
    return "dump CPU against device", ok, "; ".join(details)


def check_analyze(device: torch.device, smoke: bool) -> Row:
    model = cnn().to(device).eval()
    a = fwdtrace.analyze(model, _image(8).to(device), repeats=3)
    ok = a.peak_memory_bytes > 0 and a.flops > 0
    return "analyze", ok, f"peak memory {a.peak_memory_bytes / 2**20:.3g} MiB, latency {a.latency_ms:.3g} ms, {a.flops} FLOPs"


def check_numeric(device: torch.device, smoke: bool) -> Row:
    model = cnn().to(device).eval()
    report = fwdtrace.check_onnx(model, _image().to(device), numeric=True)
    numeric = report.numeric
    lead = numeric.lead() if numeric is not None else "no numeric result"
    return "check_onnx(numeric=True)", report.first_divergence is None and numeric is not None, lead


def check_to_onnx(device: torch.device, smoke: bool) -> Row:
    import onnxruntime as ort

    from fwdtrace.onnx.numeric import providers

    model = transformer().to(device)
    x = torch.randn(2, 8, 32, device=device)
    proto = fwdtrace.to_onnx(model, x)
    session = ort.InferenceSession(proto.SerializeToString(), providers=providers(ort))
    (got,) = session.run(None, {proto.graph.input[0].name: x.cpu().numpy()})
    with torch.no_grad():
        want = model(x).cpu()
    error = float((torch.from_numpy(got) - want).abs().max())
    return "to_onnx against eager", error <= 1e-3, f"max abs error {error:.3g} ({session.get_providers()[0]})"


def check_live(device: torch.device, smoke: bool) -> Row:
    from fwdtrace.live import log_scalar

    model = cnn().to(device).eval()
    x = _image().to(device)
    with fwdtrace.serve(model, example_inputs=x, port=0) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request("POST", "/api/sample", body=json.dumps({"key": "3.Conv2d", "kind": "forward"}),
                         headers={"Content-Type": "application/json"})
            armed = conn.getresponse().status
            conn.close()
            for step in range(3):
                model(x)
                log_scalar("loss", torch.tensor(1.0 / (step + 1), device=device), step=step)
            deadline = time.monotonic() + 30
            taken = 0
            while time.monotonic() < deadline and taken < 3:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                conn.request("GET", "/api/status")
                status = json.loads(conn.getresponse().read())
                conn.close()
                taken = sum(a.get("taken", 0) for a in status["arms"] if a["key"] == "3.Conv2d")
                time.sleep(0.1)
        finally:
            conn.close()
    return "live service arms", armed == 200 and taken >= 3, f"arm answered {armed}, {taken} samples taken"


def check_recorder(device: torch.device, smoke: bool, folder: Path) -> Row:
    model = cnn().to(device).eval()
    with fwdtrace.Recorder(folder / "recorder") as rec:
        rec.track(model, "3.Conv2d")
        for _ in range(3):
            model(_image().to(device))
    files = rec.stop()
    sizes = [p.stat().st_size for p in files]
    return "recorder", bool(files) and all(sizes), f"{len(files)} files, {sum(sizes)} bytes"


def check_autocast(device: torch.device, smoke: bool, folder: Path) -> Row:
    low = torch.float16 if device.type == "cuda" else torch.bfloat16
    model = cnn().to(device).eval()
    x = _image().to(device)
    with torch.autocast(device.type, dtype=low):
        graph = fwdtrace.trace(model, x)
    name = str(low).removeprefix("torch.")
    edges = sum(e.dtype == name for e in graph.edges)
    dumper = fwdtrace.Dumper(folder / "autocast")
    dumper.register(model, grads=False)
    with torch.autocast(device.type, dtype=low), torch.no_grad():
        model(x)
    (path,) = dumper.remove()
    tree = fwdtrace.read_dump(path, show=False)
    kept = tree["groups"]["001_Conv2d"]["datasets"]["output0"]["dtype"]
    record = tree["attrs"].get("math_autocast")
    ok = edges > 0 and kept == name and record == name
    return "autocast", ok, f"{edges} {name} edges in the trace; dump keeps {kept}, its math record says autocast {record}"


def check_compiled(device: torch.device, smoke: bool) -> Row:
    calls = [0]

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            calls[0] += 1
            return gm.forward(*args)

        return run

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = cnn().to(device).eval(), cnn().to(device).eval()
    compiled.compile(backend=counting)
    x = _image().to(device)
    means = []
    for model in (eager, compiled):
        with fwdtrace.Probe(model) as probe:
            stats = probe.running_stats("3.Conv2d", of="output")
            model(x)
            means.append(stats.stats["3.Conv2d"].mean)
    ok = calls[0] > 0 and abs(means[0] - means[1]) <= 1e-5 * max(1.0, abs(means[0]))
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"].get("unique_graphs", 0)
    torch._dynamo.reset()
    return "compiled model probed", ok, (f"{graphs} graphs compiled, {breaks} graph breaks, called {calls[0]} times; "
                                         f"mean {means[1]:.6g} against eager {means[0]:.6g}")


def check_statistics(device: torch.device, smoke: bool, folder: Path) -> Row:
    """The statistics engine on the device: the CPU's summary (counts, extremes, bins exactly, moments to the
    tensor's rounding), no synchronisation per tensor, and a statistics dump's cost against a plain step."""
    from fwdtrace.statistics import as_dict, summarize

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300_000, generator=g), torch.tensor([1.0, float("nan"), float("inf"), 0.0, -2.0]),
               (torch.randn(5000, generator=g) * 1e3).half(), torch.randn(70_000, generator=g).bfloat16(),
               torch.randn(4000, generator=g) * 1e-3 + 1]
    same = True
    for t in tensors:
        cpu, dev = as_dict(summarize(t)), as_dict(summarize(t.to(device)).cpu())
        exact = ("count", "finite", "nans", "infs", "zeros", "min", "max", "histogram", "bin_edges", "samples")
        close = all(abs(cpu[k] - dev[k]) <= 1e-5 * (abs(cpu[k]) + cpu["std"]) for k in ("mean", "std", "norm")
                    if cpu["finite"])
        same = same and close and all(str(cpu[k]) == str(dev[k]) for k in exact)
    details = [f"{len(tensors)} tensors: {'the CPU summaries' if same else 'NOT the CPU summaries'}"]
    synced = "not checked (no CUDA)"
    if device.type == "cuda":
        moved = [t.to(device) for t in tensors]
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            vectors = [summarize(t) for t in moved]
            synced = "no synchronisation"
        except RuntimeError as e:
            synced, same = f"SYNCHRONISED: {e}", False
        finally:
            torch.cuda.set_sync_debug_mode(0)
        del vectors
    details.append(synced)
    model = transformer().to(device).train()
    x = torch.randn(8, 64, 32, device=device) if not smoke else torch.randn(2, 8, 32, device=device)

    def plain() -> None:
        model(x).square().mean().backward()

    def dumped() -> None:
        with fwdtrace.Dumper(folder / "stats", values="statistics", overwrite=True) as dumper:
            dumper.register(model)
            model(x).square().mean().backward()

    repeats = 3 if smoke else 10
    base, cost = _median_time(plain, device, repeats), _median_time(dumped, device, repeats)
    details.append(f"statistics dump of a step {cost * 1e3:.3g} ms against a plain step {base * 1e3:.3g} ms "
                   f"({cost / base:.2g}x)")
    return "statistics engine on the device", same, "; ".join(details)


CHECKS = [check_trace, check_overhead, check_probe, check_dump, check_analyze, check_numeric, check_to_onnx,
          check_live, check_recorder, check_autocast, check_compiled, check_statistics]


def run(device: torch.device, smoke: bool, only: list[str] | None = None) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for check in CHECKS:
            if only and check.__name__.removeprefix("check_") not in only:
                continue
            folder = Path(tmp) / check.__name__
            folder.mkdir()
            started = time.perf_counter()
            try:
                kwargs = {"folder": folder} if "folder" in check.__code__.co_varnames else {}
                name, ok, detail = check(device, smoke, **kwargs)
            except Exception as e:  # a check that raises is a failed row; the others still run
                name, ok, detail = check.__name__.removeprefix("check_"), False, f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append((name, ok, f"{detail} ({time.perf_counter() - started:.1f} s)"))
            print(f"{'pass' if ok else 'FAIL'}  {name}: {rows[-1][2]}", flush=True)
    return rows


def table(rows: list[Row], device: torch.device, smoke: bool) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Device check", "",
        f"`python benchmarks/device_check.py --device {device.type}` on {name}, torch {torch.__version__}, "
        f"fwdtrace {getattr(fwdtrace, '__version__', '')}, {when}."
        + (" A smoke run on the CPU: it shows the script works, not how a GPU does." if smoke else ""), "",
        "| check | result | measured |", "|---|---|---|",
    ]
    lines += [f"| {n} | {'pass' if ok else '**FAIL**'} | {d.replace('|', '/')} |" for n, ok, d in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--out", default="docs/device-check.md", help="the Markdown table written")
    parser.add_argument("--only", action="append", choices=[c.__name__.removeprefix("check_") for c in CHECKS],
                        help="run this check only (repeatable)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no GPU here (torch.cuda.is_available() is False): nothing checked, nothing written; "
              "--device cpu runs the script on the CPU as a smoke test")
        return 0
    smoke = device.type == "cpu"
    if smoke:
        print("no GPU: a smoke run on the CPU, at tiny sizes")
    rows = run(device, smoke, args.only)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table(rows, device, smoke))
    print(f"wrote {args.out}: {sum(ok for _, ok, _ in rows)} of {len(rows)} checks pass")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
