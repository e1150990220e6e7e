"""What the live service costs a training loop, beside other tools doing the same work, and how it answers many clients.

1. Overhead: training steps (forward, backward, SGD) of a shared bench model (``--model
   encoder``: d=128, 4 layers, 0.79 M parameters in 50 tensors, batch 8 x 64 tokens;
   ``resnet50``: 2 x 3 x 128 x 128). Each row is one tool on its own copy of the model for the
   whole phase: (0) none (the floor: what a second copy alone changes); (a) the service running,
   nothing armed; one key (the largest activation of a middle layer, ``KEYS``) sampled forward
   every step; (b) ``weight`` armed on every layer holding parameters, ``every=100``; ``weight``
   and ``weight_grad`` of the whole model; (c) TensorBoard's ``SummaryWriter.add_histogram`` of
   every parameter every 100 steps; (d) the hooks ``wandb.watch(model, log="all",
   log_freq=100)`` adds (:class:`WatchStyle`, written here without the wandb package); (e)
   ``health`` armed on the model (gradient norm, NaN and Inf counts after every backward).
   On a machine shared with other jobs the load drifts more within a minute than these tools
   cost, so the rows are timed in ``--pairs`` pairs of short segments (``--steps`` steps): the
   plain model, then the row's copy, or the reverse, cycling through the rows; the ratio of each
   pair sees the same load on both sides. Per row: the median ratio with a bootstrap 95%
   interval, on wall time and on CPU time (the training thread's plus the tool's own threads':
   summariser, HTTP server, event writer). Histograms every 100 steps fall in one segment of 20:
   those segments are left out of the medians and charged separately, from the CPU the tool
   itself spent at that step (timed inside its hooks and calls, and its threads' clocks),
   spread over the 100 steps. Each segment's work is inside its clock: the service's summaries
   drained, TensorBoard's events flushed.
2. Load: the same loop trains for a fixed time while N clients (threads of a separate
   process, each on its own keep-alive connection) poll ``/api/status``, ``/api/samples``
   (``since=`` the last seen) and ``/api/stats`` every ``--interval`` seconds; then the
   same time without clients. Reported: failed requests, p50/p99 latency, request count,
   and the training slowdown (steps per second without clients over with them, minus one).
3. Page views: median step time with no one looking, while a separate process asks for
   ``/api/graph.svg`` at depth after depth (more depths than the cache keeps: every view is a
   fresh layout, done by the service's layout process), and, for comparison, while a thread of
   the training process lays the graph out itself (``graph_svg``, what the service did before).
Run: ``.venv/bin/python benchmarks/live_cost.py [--pairs 24] [--steps 5] [--every 100] [--clients 12]
[--seconds 10] [--threads 1] [--model resnet50]``; ``--quick`` for a short run (2 pairs of 5 steps,
shorter load and page-view phases).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
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


# -- 1. overhead: the service and other tools' histograms, in the same pairs -----------------------------
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
        self.spent = 0.0  # training-thread CPU seconds making histograms
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
                start = time.thread_time()
                log(*args, *hook_args)
                self.spent += time.thread_time() - start

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
    from fwdtrace.instrument.keys import key2module

    holders = {key: m for key, m in key2module(model).items() if next(m.parameters(recurse=False), None) is not None}
    return [key for key, m in holders.items()
            if not any(m is not other and any(m is sub for sub in other.modules()) for other in holders.values())]


TARGETS = {"(a)": 0.01, "(b)": 0.02}  # issue 23: idle service under 1%, weight histograms every 100 steps under 2%


class Row:
    """One tool on its own copy of the model for the whole phase, and what each of its timed segments cost.

    ``every``: steps between the tool's histograms (1: it works every step). ``fired()``: how many
    it has made so far. ``own()``: training-thread seconds spent inside its code so far, where
    timed. ``threads``: the threads it started (its summariser, HTTP server or event writer).
    """

    def __init__(self, name: str, model: Any, every: int, threads: list[int], after: Any = None, end: Any = None,
                 fired: Any = None, own: Any = None, note: Any = None) -> None:
        self.name, self.model, self.every, self.threads = name, model, every, threads
        self.after, self.end = after, end
        self.fired = fired or (lambda: 0)
        self.own = own or (lambda: 0.0)
        self.note = note or (lambda: "")
        self.step = 0
        # per pair: (plain wall, plain CPU, row wall, row CPU, row's own CPU (hooks + threads), histograms made)
        self.pairs: list[tuple[float, float, float, float, float, int]] = []

    def threads_cpu(self) -> float:
        return sum(time.clock_gettime(time.pthread_getcpuclockid(ident)) for ident in self.threads)


def _segment(model: Any, x: Any, n: int, row: Row | None) -> tuple[float, float, float, int]:
    """``n`` steps of ``model``: wall, CPU (the training thread's and the row's threads'), the row's own CPU, histograms."""
    fired, own, threads = (row.fired(), row.own(), row.threads_cpu()) if row else (0, 0.0, 0.0)
    wall, cpu = time.perf_counter(), time.thread_time()
    after = None
    if row is not None and row.after is not None:
        after = (lambda r: lambda i: r.after(r.step + i))(row)
    train(model, x, n, after)
    if row is not None and row.end is not None:
        row.end()  # the tool's work on these steps, inside the clock: summaries drained, events flushed
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    if row is None:
        return wall, cpu, 0.0, 0
    row.step += n
    threads = row.threads_cpu() - threads
    return wall, cpu + threads, row.own() - own + threads, row.fired() - fired


class _OwnTime:
    """Training-thread CPU inside the live sampler's sampled calls: the forward hook, the end-of-backward callbacks.

    Patched into :class:`~fwdtrace.live.sampler.Sampler` for the overhead phase only. The hooks
    that run at every call or parameter only to count it are not timed: a CPU clock read costs
    about 2 us here, as much as such a hook; their cost is in the pairs' medians.
    """

    def __init__(self) -> None:
        self.ns = 0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.thread_time_ns()
            try:
                return fn(*args)
            finally:
                self.ns += time.thread_time_ns() - start

        return timed

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        from fwdtrace.live.sampler import Sampler

        saved = Sampler.__dict__["_guard"]  # the staticmethod itself
        guard = Sampler._guard

        def timed_guard(arm: Any, where: str, body: Any) -> Any:
            guarded = guard(arm, where, body)
            return guarded if where == "a parameter hook" else self.wrap(guarded)

        Sampler._guard = staticmethod(timed_guard)  # type: ignore[method-assign]
        try:
            yield
        finally:
            Sampler._guard = saved  # type: ignore[method-assign]


def overhead(model: torch.nn.Module, x: torch.Tensor, args: argparse.Namespace) -> None:
    """Pairs of short segments, plain then with one tool or the reverse, each tool on its own model copy all along."""
    import copy

    from torch.utils.tensorboard import SummaryWriter

    import fwdtrace

    every, steps = args.every, args.steps
    root = type(model).__name__
    layers = weight_keys(model)
    tensors = sum(1 for _ in model.parameters())
    own = _OwnTime()
    rows: list[Row] = []

    def started(setup: Any) -> tuple[Any, list[int]]:
        before = {t.ident for t in threading.enumerate()}
        made = setup()
        return made, [t.ident for t in threading.enumerate() if t.ident not in before and t.ident is not None]

    def service(name: str, arms: list[tuple[str, str, int]], stack: contextlib.ExitStack) -> None:
        copied = copy.deepcopy(model)
        server, threads = started(lambda: stack.enter_context(fwdtrace.serve(copied, example_inputs=x[:1], port=0)))
        for key, kind, n in arms:
            server.sampler.arm(key, kind, every=n)
        sampler = server.sampler
        rows.append(Row(name, copied, min((n for _, _, n in arms), default=1), threads, end=lambda: sampler.drain(60),
                        fired=lambda: sum(a.taken for a in sampler.arms.values()), own=lambda: own.ns * 1e-9,
                        note=lambda: _arm_counts(server)))

    def tensorboard(stack: contextlib.ExitStack) -> None:
        copied = copy.deepcopy(model)
        logdir = stack.enter_context(tempfile.TemporaryDirectory())
        writer, threads = started(lambda: SummaryWriter(logdir))
        stack.callback(writer.close)
        done, spent, flush = [0], [0.0], [False]

        def after(i: int) -> None:
            if i % every == 0:
                start = time.thread_time()
                for name, p in copied.named_parameters():
                    writer.add_histogram(name, p, i)
                    done[0] += 1
                spent[0] += time.thread_time() - start
                flush[0] = True

        def end() -> None:  # the events written before the clock stops, as the service's summaries are drained
            if flush[0]:
                start = time.thread_time()
                writer.flush()
                spent[0] += time.thread_time() - start
                flush[0] = False

        rows.append(Row(f"(c) TensorBoard add_histogram, every {every}", copied, every, threads, after, end,
                        fired=lambda: done[0], own=lambda: spent[0], note=lambda: f"{done[0]} histograms"))

    def watch_style(stack: contextlib.ExitStack) -> None:
        copied = copy.deepcopy(model)
        watch = WatchStyle(copied, every)
        stack.callback(watch.remove)
        rows.append(Row(f"(d) wandb.watch-style, log=all, every {every}", copied, every, [],
                        fired=lambda: watch.histograms, own=lambda: watch.spent, note=lambda: f"{watch.histograms} histograms"))

    load = os.getloadavg()
    with own.patched(), contextlib.ExitStack() as stack:
        rows.append(Row("(0) plain, a second copy of the model (the floor)", copy.deepcopy(model), 1, []))
        service("(a) service, nothing armed", [], stack)
        service(f"service, {KEY} forward every step", [(KEY, "forward", 1)], stack)
        service(f"(b) weight, {len(layers)} layers, every {every}", [(k, "weight", every) for k in layers], stack)
        service(f"weight + weight_grad, all {tensors}, every {every}",
                [(root, "weight", every), (root, "weight_grad", every)], stack)
        tensorboard(stack)
        watch_style(stack)
        service("(e) health every step", [(root, "health", 1)], stack)
        for cycle in range(args.pairs + 1):  # the first: warm-up, not kept
            for k, row in enumerate(rows if cycle % 2 == 0 else rows[::-1]):
                # Plain first in half the pairs, the tool first in the other half: what a segment leaves
                # behind (caches, a busy neighbour) falls on both sides alike.
                if (cycle + k) % 2 == 0:
                    plain, with_row = _segment(model, x, steps, None), _segment(row.model, x, steps, row)
                else:
                    with_row, plain = _segment(row.model, x, steps, row), _segment(model, x, steps, None)
                if cycle:
                    row.pairs.append((plain[0], plain[1], with_row[0], with_row[1], with_row[2], with_row[3]))
            if cycle:
                print(f"  pairs {cycle}/{args.pairs} done, load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        notes = {row.name: row.note() for row in rows}
    plain_cpu = _report(rows, notes, model, args, load)
    counting_hooks(model, layers, plain_cpu, args)


def counting_hooks(model: Any, layers: list[str], plain_cpu: float, args: argparse.Namespace) -> None:
    """What (b)'s hooks cost at a backward they do not sample: backwards alone, with and without them, in pairs.

    A backward of a loss that touches each parameter once (about 2 ms) instead of a training
    step (70 ms): the hooks' share of it is 30 times larger, so the pairs resolve microseconds.
    The hooks are armed with an ``every`` no backward here reaches after the first.
    """
    import copy

    from fwdtrace.live.sampler import Sampler

    copied = copy.deepcopy(model)
    sampler = Sampler(copied)
    try:
        for key in layers:
            sampler.arm(key, "weight", every=1 << 40)

        def backwards(m: Any) -> float:
            parameters = list(m.parameters())
            start = time.thread_time()
            for _ in range(args.backwards):
                sum(p.view(-1)[0] for p in parameters).backward()
            return (time.thread_time() - start) / args.backwards

        backwards(copied)  # the first backward is sampled
        sampler.drain(60)
        backwards(model)
        diffs = []
        for i in range(args.pairs * 2):
            if i % 2:
                plain, hooked = backwards(model), backwards(copied)
            else:
                hooked, plain = backwards(copied), backwards(model)
            diffs.append(hooked - plain)
    finally:
        sampler.close()
    median, low, high = _median_interval([1 + d for d in diffs])  # the median difference, its interval
    print(f"(b)'s counting hooks alone ({sum(1 for _ in model.parameters())} parameter hooks, {len(layers)} counts a "
          f"backward): {args.pairs * 2} pairs of {args.backwards} backwards, +{median * 1e6:.0f} us a backward "
          f"[{low * 1e6:.0f}, {high * 1e6:.0f}] = {median / plain_cpu:+.2%} [{low / plain_cpu:+.2%}, {high / plain_cpu:+.2%}] "
          "of the plain step's CPU")
    if "(b)" in DIRECT:
        own = DIRECT["(b)"]
        print(f"(b) by its own CPU: counting hooks {median / plain_cpu:+.2%} + threads, sampled calls and histograms "
              f"{own:+.2%} = {median / plain_cpu + own:+.2%} [{low / plain_cpu + own:+.2%}, {high / plain_cpu + own:+.2%}]"
              f" (target < 2%); (a): {DIRECT.get('(a)', math.nan):+.2%} and one forward pre-hook call a step (target < 1%)")


def _report(rows: list[Row], notes: dict[str, str], model: Any, args: argparse.Namespace,
            load: tuple[float, float, float]) -> float:
    """Per row: median pair ratios with bootstrap intervals, the tool's own CPU, an estimate against each target.

    Returns the plain step's CPU seconds."""
    steps = args.steps
    plain_cpu = statistics.median(p[1] for row in rows for p in row.pairs) / steps
    plain_wall = statistics.median(p[0] for row in rows for p in row.pairs) / steps
    print(f"overhead on the {args.model}: {args.pairs} pairs of {steps}-step segments per row (plain, then the "
          f"tool on its own copy of the model, or the reverse; torch threads: {args.threads}); plain step "
          f"{plain_wall * 1e3:.1f} ms wall, {plain_cpu * 1e3:.1f} ms CPU; load average (1, 5, 15 min) "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} before, {' '.join(f'{v:.1f}' for v in os.getloadavg())} after")
    print("  CPU: the training thread's and the tool's own threads' (summariser, HTTP server, event writer).")
    print("  per step: median of the pair ratios (pairs without a histogram when the tool makes them every N"
          " steps) [bootstrap 95% interval];")
    print("  own: CPU the tool's threads and its sampled calls (not its counting hooks) take per step, a share of the plain step's CPU;")
    print("  histogram: the tool's own CPU at a step that makes them, above its per-step own CPU, spread over"
          " `every` steps;")
    print("  estimate: per step + histogram, with the per-step interval; vs target: met (interval under it),"
          " over (interval above), or not resolved")
    print(f"  {'':52} {'pairs':>7}  {'wall per step':>24}  {'CPU per step':>24}  {'own':>6}  {'histogram':>17}"
          f"  {'estimate CPU':>24}  {'estimate wall':>24}  target")
    floor = rows[0]  # the second plain copy: how far the pairs stray with no tool at all
    floors = (_median_interval([r / p for _, p, _, r, _, _ in floor.pairs]),
              _median_interval([r / p for p, _, r, _, _, _ in floor.pairs]))
    for row in rows:
        cells, direct = _row_cells(row, plain_cpu, steps, floors)
        DIRECT[row.name[:3]] = direct
        print(f"  {row.name:52} {cells}  {notes[row.name]}")
    return plain_cpu


DIRECT: dict[str, float] = {}  # a row's own CPU per step (threads, sampled calls, histograms) as a share of the plain step


def _row_cells(row: Row, plain_cpu: float, steps: int,
               floors: tuple[tuple[float, float, float], tuple[float, float, float]]) -> tuple[str, float]:
    amortized = row.every > 1
    quiet = [p for p in row.pairs if not (amortized and p[5])]
    fired = [p for p in row.pairs if amortized and p[5]]
    wall = _median_interval([r / p for p, _, r, _, _, _ in quiet])
    cpu = _median_interval([r / p for _, p, _, r, _, _ in quiet])
    own_step = sum(p[4] for p in quiet) / (len(quiet) * steps) if quiet else math.nan
    share = 0.0
    histogram = f"{'':>17}"
    if fired:
        # A segment is shorter than `every`: it holds one step that makes histograms.
        per_firing = statistics.mean(p[4] - own_step * steps for p in fired)
        share = per_firing / (row.every * plain_cpu)
        histogram = f"{per_firing * 1e3:6.1f} ms {share:+7.2%}"
    elif amortized:
        histogram = f"{'none made':>17}"
    cpu_estimate = (cpu[0] + share, cpu[1] + share, cpu[2] + share)
    wall_estimate = (wall[0] + share, wall[1] + share, wall[2] + share)
    target = next((t for prefix, t in TARGETS.items() if row.name.startswith(prefix)), None)
    verdict = ""
    if target is not None:
        verdict = " / ".join(_verdict(e, target, f) for e, f in zip((cpu_estimate, wall_estimate), floors, strict=True))
        verdict += f" (< {target:.0%})"
    return (f"{len(quiet):3} ({len(fired)})  {_interval_text(wall)}  {_interval_text(cpu)}  "
            f"{own_step / plain_cpu:+6.2%}  {histogram}  {_interval_text(cpu_estimate)}  "
            f"{_interval_text(wall_estimate)}  {verdict}"), own_step / plain_cpu + share


def _median_interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The median of ``ratios`` minus one, and a bootstrap 95% interval of it (percentiles of resampled medians)."""
    import random

    if not ratios:
        return math.nan, math.nan, math.nan
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return (statistics.median(ratios) - 1, medians[int(0.025 * resamples)] - 1, medians[int(0.975 * resamples) - 1] - 1)


def _interval_text(v: tuple[float, float, float]) -> str:
    return f"{v[0]:+6.2%} [{v[1]:+6.2%}, {v[2]:+6.2%}]"


def _verdict(estimate: tuple[float, float, float], target: float, floor: tuple[float, float, float]) -> str:
    """Met (interval under the target), over (above it), or not resolved: the interval straddles it, or the
    floor's (a second plain copy) reaches past +-target, so an interval under the target may be luck."""
    _, low, high = estimate
    if max(abs(floor[1]), abs(floor[2])) >= target:
        return "not resolved (floor)"
    return "met" if high < target else "over" if low > target else "not resolved"


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
    parser.add_argument("--pairs", type=int, default=24, help="pairs of segments (plain, with the tool) per row")
    parser.add_argument("--steps", type=int, default=5, help="training steps per segment (under --every)")
    parser.add_argument("--backwards", type=int, default=20, help="backwards per segment timing (b)'s counting hooks")
    parser.add_argument("--every", type=int, default=100, help="steps between histograms of rows (b) to (d)")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 pairs of 5 steps, 3 s of load, 10 views")
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
        args.pairs, args.steps, args.seconds, args.views, args.backwards = 2, 5, 3.0, 10, 5
    if args.steps >= args.every:
        parser.error(f"--steps ({args.steps}) must be under --every ({args.every}): a segment holds one step of histograms at most")
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
