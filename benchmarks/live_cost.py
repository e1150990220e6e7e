"""What the live service costs a training loop, and how it answers many clients.

1. Overhead: training steps (forward, backward, SGD) of a shared bench model (``--model
   encoder``: d=128, 4 layers, batch 8 x 64 tokens; ``resnet50``: 2 x 3 x 128 x 128) without
   the service, with it running and nothing armed, and with one key (the largest activation
   of a middle layer, ``KEYS``) sampled forward every step, in alternating rounds; medians
   of the rounds, ratios to the plain loop.
2. Load: the same loop trains for a fixed time while N clients (threads of a separate
   process, each on its own keep-alive connection) poll ``/api/status``, ``/api/samples``
   (``since=`` the last seen) and ``/api/stats`` every ``--interval`` seconds; then the
   same time without clients. Reported: failed requests, p50/p99 latency, request count,
   and the training slowdown (steps per second without clients over with them, minus one).
3. Page views: median step time with no one looking, while a separate process asks for
   ``/api/graph.svg`` at depth after depth (more depths than the cache keeps: every view is a
   fresh layout, done by the service's layout process), and, for comparison, while a thread of
   the training process lays the graph out itself (``graph_svg``, what the service did before).
Run: ``.venv/bin/python benchmarks/live_cost.py [--rounds 7] [--clients 12] [--seconds 10] [--threads 1] [--model resnet50]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time

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


# -- the training side -----------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="training steps per round")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds each client waits between polls")
    parser.add_argument("--model", choices=sorted(KEYS), default="encoder")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    parser.add_argument("--views", type=int, default=40, help="training steps timed in each page-view phase")
    parser.add_argument("--client-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--view-graph", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global KEY
    KEY = KEYS[args.model]
    if args.client_port and args.view_graph:
        view_graph(args.client_port)
        return
    if args.client_port:
        run_clients(args.client_port, args.clients, args.seconds, args.interval)
        return

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
        for _ in range(n):
            loss = model(x).pow(2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-3 * p.grad

    def timed(n: int) -> tuple[float, float]:
        """(wall, CPU time of this thread) per step: the CPU time moves less when other programs share the cores."""
        wall, cpu = time.perf_counter(), time.thread_time()
        steps(n)
        return (time.perf_counter() - wall) / n, (time.thread_time() - cpu) / n

    steps(2)
    plain, idle, armed = [], [], []
    for _ in range(args.rounds):  # alternate, so slow phases of a busy machine hit all three
        plain.append(timed(args.steps))
        with fwdtrace.serve(model, example_inputs=x[:1], port=0):  # traced here, outside the timing
            idle.append(timed(args.steps))
        with fwdtrace.serve(model, example_inputs=x[:1], port=0) as server:
            server.sampler.arm(KEY, "forward", every=1)
            armed.append(timed(args.steps))
    print(f"training step, median of {args.rounds} rounds of {args.steps} steps (torch threads: {args.threads})")
    print(f"  {'':36} {'wall':>9} {'ratio':>7}   {'CPU':>9} {'ratio':>7}")
    p_wall, p_cpu = (statistics.median(r[i] for r in plain) for i in (0, 1))
    for name, runs in (("plain", plain), ("service, nothing armed", idle), (f"service, {KEY} every step", armed)):
        wall, cpu = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"  {name:36} {wall * 1e3:6.1f} ms {wall / p_wall - 1:+7.1%}   {cpu * 1e3:6.1f} ms {cpu / p_cpu - 1:+7.1%}")

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
