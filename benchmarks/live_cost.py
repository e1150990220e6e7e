"""What the live service costs a training loop, beside other tools doing the same work, and how it answers many clients.

1. Overhead: training steps (forward, backward, SGD) of a shared bench model (``--model
   encoder``: d=128, 4 layers, 0.79 M parameters in 50 tensors, batch 8 x 64 tokens;
   ``resnet50``: 2 x 3 x 128 x 128), in alternating rounds of ``--steps`` steps each, medians
   of the rounds, ratios to the plain loop: (a) the service running, nothing armed; one key
   (the largest activation of a middle layer, ``KEYS``) sampled forward every step; (b)
   ``weight`` armed on every layer holding parameters, ``every=100``; ``weight`` and
   ``weight_grad`` of the whole model; (c) TensorBoard's ``SummaryWriter.add_histogram`` of
   every parameter every 100 steps; (d) the hooks ``wandb.watch(model, log="all",
   log_freq=100)`` adds (:class:`WatchStyle`, written here without the wandb package);
   (e) ``health`` armed on the model (gradient norm, NaN and Inf counts after every backward).
   Each row does its work inside the timed steps: the service's summaries are waited for
   (``drain``) and TensorBoard's events flushed before the round's clock stops.
2. Load: the same loop trains for a fixed time while N clients (threads of a separate
   process, each on its own keep-alive connection) poll ``/api/status``, ``/api/samples``
   (``since=`` the last seen) and ``/api/stats`` every ``--interval`` seconds; then the
   same time without clients. Reported: failed requests, p50/p99 latency, request count,
   and the training slowdown (steps per second without clients over with them, minus one).
3. Page views: median step time with no one looking, while a separate process asks for
   ``/api/graph.svg`` at depth after depth (more depths than the cache keeps: every view is a
   fresh layout, done by the service's layout process), and, for comparison, while a thread of
   the training process lays the graph out itself (``graph_svg``, what the service did before).
Run: ``.venv/bin/python benchmarks/live_cost.py [--rounds 5] [--steps 300] [--every 100] [--clients 12]
[--seconds 10] [--threads 1] [--model resnet50]``; ``--quick`` for a short run (2 rounds of 120 steps,
shorter load and page-view phases).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# model -> (the key sampled: a large activation of a middle layer)
KEYS = {"encoder": "layers.1.ff.0.Linear", "resnet50": "layers.7.conv2.Conv2d"}
KEY = KEYS["encoder"]


# -- the clients (a separate process: stdlib only) -------------------------------------------------------
def run_clients(port: int, clients: int, seconds: float, interval: float) -> None:
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        since = -1
        while time.monotonic() < deadline:
            for path in ("/api/status", f"/api/samples?key={KEY}&kind=forward&since={since}",
                         f"/api/stats?key={KEY}&which=forward_output"):
                start = time.perf_counter()
                try:
                    conn.request("GET", path)
                    response = conn.getresponse()
                    body = response.read()
                    ok = response.status == 200
                    if ok and "samples?" in path:
                        samples = json.loads(body)["samples"]
                        since = samples[-1]["seq"] if samples else since
                except OSError as e:
                    ok, body = False, str(e).encode()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)
                    if not ok:
                        failures.append(f"{path}: {body[:200]!r}")
            time.sleep(interval)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"latencies": latencies, "failures": failures}))


# -- 1. overhead: the service and other tools' histograms, in the same rounds ----------------------------
def train(model: torch.nn.Module, x: torch.Tensor, n: int, after: Any = None) -> None:
    """``n`` training steps (forward, backward, SGD), ``after(i)`` after step ``i``."""
    import torch

    for i in range(n):
        loss = model(x).pow(2).mean()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
        if after is not None:
            after(i)


class WatchStyle:
    """What ``wandb.watch(model, log="all", log_freq=every)`` hooks into a model, without the wandb package.

    A forward hook on the model histograms every parameter on each ``every``-th forward; a
    tensor hook on each parameter histograms its gradient on each ``every``-th backward (its own
    counter). A histogram is wandb's: a detached copy, flattened, float32, skipped when nothing is
    finite, non-finite values dropped, ``min``/``max`` read, ``torch.histc`` with 64 bins between
    them, edges by ``linspace``, both as lists. wandb then queues them for its service process
    (``run._log(..., commit=False)``); here they are kept in a dict, so that part is not counted.
    """

    BINS = 64

    def __init__(self, model: torch.nn.Module, every: int) -> None:
        self.logged: dict[str, tuple[list[float], list[float]]] = {}
        self.histograms = 0
        self.handles = [model.register_forward_hook(self._counted(every, self._log_parameters))]
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.handles.append(p.register_hook(self._counted(every, self._log_tensor, "gradients/" + name)))

    def _counted(self, every: int, log: Any, *args: Any) -> Any:
        count = [0]

        def hook(*hook_args: Any) -> None:
            count[0] += 1
            if count[0] >= every:  # wandb's log_track: fires on the every-th call, then counts again from 0
                count[0] = 0
                log(*args, *hook_args)

        return hook

    def _log_parameters(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        for name, p in module.named_parameters():
            self._log_tensor("parameters/" + name, p.data.cpu())

    def _log_tensor(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        flat = tensor.detach().clone().reshape(-1)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        finite = torch.isfinite(flat)
        if flat.numel() == 0 or not bool(finite.any()):
            return
        if not bool(finite.all()):
            flat = flat[finite]
        low, high = flat.min().item(), flat.max().item()
        if low == high:
            counts, edges = torch.tensor([float(flat.numel())]), torch.tensor([low, high])
        else:
            counts = flat.histc(bins=self.BINS, min=low, max=high).cpu().detach().clone()
            edges = torch.linspace(low, high, steps=self.BINS + 1)
        self.logged[name] = (counts.tolist(), edges.tolist())
        self.histograms += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def weight_keys(model: torch.nn.Module) -> list[str]:
    """The key of every layer holding parameters, each parameter under one key (a layer inside an armed one is left out).

    The encoder's: per block its two LayerNorms, the attention (in_proj and out_proj) and the
    feed-forward's two Linears, and the final norm; what a user arms by clicking each box.
    """
    from fwdtrace.keys import key2module

    holders = {key: m for key, m in key2module(model).items() if next(m.parameters(recurse=False), None) is not None}
    return [key for key, m in holders.items()
            if not any(m is not other and any(m is sub for sub in other.modules()) for other in holders.values())]


def overhead(model: torch.nn.Module, x: torch.Tensor, args: argparse.Namespace) -> None:
    import contextlib
    import tempfile

    from torch.utils.tensorboard import SummaryWriter

    import fwdtrace

    every = args.every
    root = type(model).__name__
    layers = weight_keys(model)
    tensors = sum(1 for _ in model.parameters())

    @contextlib.contextmanager
    def plain() -> Iterator[tuple[Any, Any]]:
        yield None, lambda: ""

    @contextlib.contextmanager
    def service(arms: list[tuple[str, str, int]]) -> Iterator[tuple[Any, Any]]:
        with fwdtrace.serve(model, example_inputs=x[:1], port=0) as server:  # traced here, outside the timing
            for key, kind, n in arms:
                server.sampler.arm(key, kind, every=n)
            # the summaries of the last samples are part of the cost: drain() is inside the timing
            yield (lambda i: server.sampler.drain(60) if i == args.steps - 1 else None), lambda: _arm_counts(server)

    @contextlib.contextmanager
    def tensorboard() -> Iterator[tuple[Any, Any]]:
        with tempfile.TemporaryDirectory() as logdir:
            writer = SummaryWriter(logdir)
            done = [0]

            def after(i: int) -> None:
                if i % every == 0:
                    for name, p in model.named_parameters():
                        writer.add_histogram(name, p, i)
                        done[0] += 1
                if i == args.steps - 1:
                    writer.flush()

            yield after, lambda: f"{done[0]} histograms"
            writer.close()

    @contextlib.contextmanager
    def watch_style() -> Iterator[tuple[Any, Any]]:
        watch = WatchStyle(model, every)
        yield None, lambda: f"{watch.histograms} histograms"
        watch.remove()

    rows: list[tuple[str, Any]] = [
        ("plain loop", plain),
        ("(a) service, nothing armed", lambda: service([])),
        (f"service, {KEY} forward every step", lambda: service([(KEY, "forward", 1)])),
        (f"(b) weight, {len(layers)} layers, every {every}", lambda: service([(k, "weight", every) for k in layers])),
        (f"weight + weight_grad, all {tensors}, every {every}",
         lambda: service([(root, "weight", every), (root, "weight_grad", every)])),
        (f"(c) TensorBoard add_histogram, every {every}", tensorboard),
        (f"(d) wandb.watch-style, log=all, every {every}", watch_style),
        ("(e) health every step", lambda: service([(root, "health", 1)])),
    ]
    train(model, x, 2)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in rows}
    notes: dict[str, str] = {}
    for r in range(args.rounds):  # alternate, so slow phases of a busy machine hit every row
        for name, setup in (rows if r % 2 == 0 else rows[::-1]):
            with setup() as (after, note):
                wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
                train(model, x, args.steps, after)
                times[name].append(((time.perf_counter() - wall) / args.steps, (time.thread_time() - thread) / args.steps,
                                    (time.process_time() - process) / args.steps))
                notes[name] = note()
        print(f"  round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    print(f"training step of the {args.model}: median of {args.rounds} alternating rounds of {args.steps} steps "
          f"(torch threads: {args.threads}; load average {os.getloadavg()[0]:.1f} at the end)")
    print("  (thread CPU: the training thread's; process CPU: every thread's, the summariser's and writers' included)")
    print(f"  {'':46} {'wall':>9} {'ratio':>7}  {'thread CPU':>10} {'ratio':>7}  {'proc CPU':>9} {'ratio':>7}  in the last round")
    base = [statistics.median(t[i] for t in times[rows[0][0]]) for i in range(3)]
    for name, _ in rows:
        med = [statistics.median(t[i] for t in times[name]) for i in range(3)]
        cells = "  ".join(f"{m * 1e3:7.1f} ms {m / b - 1:+7.1%}" for m, b in zip(med, base, strict=True))
        print(f"  {name:46} {cells}  {notes[name]}")


def _arm_counts(server: Any) -> str:
    info = server.sampler.status()["arms"]
    if not info:
        return ""
    taken, skipped = sum(a["taken"] for a in info), sum(a["skipped"] + a["over_budget"] for a in info)
    scalars = sum(len(s["values"]) for s in server.sampler.scalars.read().values())
    return f"{taken} samples, {skipped} skipped" + (f", {scalars} scalar points" if scalars else "")


# -- the training side -----------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="training steps per round and row")
    parser.add_argument("--every", type=int, default=100, help="steps between histograms of rows (b) to (d)")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 rounds of 120 steps, 3 s of load, 10 views")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds each client waits between polls")
    parser.add_argument("--model", choices=sorted(KEYS), default="encoder")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    parser.add_argument("--views", type=int, default=40, help="training steps timed in each page-view phase")
    parser.add_argument("--client-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--view-graph", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.seconds, args.views = 2, 120, 3.0, 10
    global KEY
    KEY = KEYS[args.model]
    if args.client_port and args.view_graph:
        view_graph(args.client_port)
        return
    if args.client_port:
        run_clients(args.client_port, args.clients, args.seconds, args.interval)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fwdtrace, not an installed one
    import torch
    from bench_models import ResNet50, TransformerEncoder

    import fwdtrace

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model == "encoder":
        model, x = TransformerEncoder(d=128, layers=4, heads=8), torch.randn(8, 64, 128)
    else:
        model, x = ResNet50(), torch.randn(2, 3, 128, 128)

    def steps(n: int) -> None:
        train(model, x, n)

    overhead(model, x, args)

    with fwdtrace.serve(model, example_inputs=x[:1], port=0) as server:
        server.sampler.arm(KEY, "forward", every=1)
        rate_alone = _steps_per_second(steps, args.seconds)
        command = [sys.executable, __file__, "--client-port", str(server.port), "--model", args.model,
                   "--clients", str(args.clients),
                   "--seconds", str(args.seconds), "--interval", str(args.interval)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the client process starting (stdlib only) is not part of the measure
        rate_loaded = _steps_per_second(steps, args.seconds - 1)
        out, _ = proc.communicate(timeout=args.seconds + 60)
    result = json.loads(out)
    lat = sorted(result["latencies"])
    q = statistics.quantiles(lat, n=100)
    print(f"load: {args.clients} clients polling 3 endpoints every {args.interval} s for {args.seconds:g} s, "
          f"one key sampled every step")
    print(f"  requests {len(lat)}, failed {len(result['failures'])}, "
          f"latency p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms")
    print(f"  training {rate_alone:.1f} steps/s alone, {rate_loaded:.1f} with clients: "
          f"slowdown {rate_alone / rate_loaded - 1:+.1%}")
    for failure in result["failures"][:5]:
        print("  failed:", failure)
    page_views(model, x, steps, args)


def view_graph(port: int) -> None:
    """A page that keeps changing the depth: one drawing after another, each not yet cached, until killed."""
    import itertools
    import urllib.request

    for depth in itertools.cycle(range(12)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/graph.svg?depth={depth}", timeout=300).read()
        print(depth, flush=True)


def page_views(model: object, x: object, steps: object, args: argparse.Namespace) -> None:
    import fwdtrace
    from fwdtrace.live.svg import graph_svg

    def step_times(n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            steps(1)  # type: ignore[operator]
            times.append(time.perf_counter() - start)
        return times

    rows = []
    with fwdtrace.serve(model, example_inputs=x[:1], port=0) as server:  # type: ignore[arg-type, index]
        rows.append(("no page views", step_times(args.views), 0))
        command = [sys.executable, __file__, "--client-port", str(server.port), "--view-graph"]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # the layout process is up and the first drawing made
        times = step_times(args.views)
        proc.kill()
        views = len(proc.communicate()[0].split())
        rows.append(("views, laid out in the service's child", times, views))
        graph = server.graph
    stop, drawn = threading.Event(), [0]

    def in_process() -> None:
        depth = 0
        while not stop.is_set():
            graph_svg(graph, depth % 12)  # type: ignore[arg-type]
            depth += 1
            drawn[0] += 1

    thread = threading.Thread(target=in_process)
    thread.start()
    times = step_times(args.views)
    stop.set()
    thread.join()
    rows.append(("views, laid out in a training thread", times, drawn[0]))
    print(f"page views: {args.views} training steps each, graph.svg at a new depth each view")
    for name, times, views in rows:
        print(f"  {name:40} median {statistics.median(times) * 1e3:6.1f} ms  max {max(times) * 1e3:6.1f} ms"
              f"  ({views} drawings meanwhile)")


def _steps_per_second(steps: object, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps(1)  # type: ignore[operator]
        n += 1
    return n / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
