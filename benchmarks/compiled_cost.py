"""What fwdtrace's tools cost a torch.compile'd model: training step time per configuration.

A GPT-2-sized transformer encoder (four pre-norm blocks, d=256, 4 heads, batch 8 x 64 tokens; ``--width`` and
``--layers`` change it) trains with
SGD, compiled with inductor (``torch.compile(model)``, a C++ compiler on CPU) or eager. Each row
times steps (forward, backward, optimizer step) with one configuration in place:

- ``compiled``: the compiled model alone;
- ``compiled + idle service``: ``fwdtrace.serve(compiled)`` running, nothing armed;
- ``+ weight arm``: one ``weight`` arm (parameter kinds hook gradient accumulation, outside compiled graphs);
- ``+ forward arm``: one ``forward`` arm (its hook copies the layer's tensors inside a compiled copy of the
  model, made when armed);
- ``+ forward arm toggled each step``: the same key disarmed and armed again before every step, as clicks on
  the live page do (the first arming compiles the copy; every later one runs it again: no compilation);
- ``+ grad arm``: one ``grad`` arm (gradient hooks: the compiled model runs eagerly while armed);
- ``compiled + running Probe``: ``Probe.running_stats`` on the same key (statistics computed inside a
  compiled copy of the model, made when it attaches);
- ``compiled + statistics dump``: every step dumped, ``Dumper(values="statistics")`` and
  ``register(grads=False)`` before each step, the last step's dump closed (every layer's forward
  tensors taken inside a compiled copy of the model, made at the Dumper's first registration and run again
  by the later ones; on a CPU summarised after its graph); ``, background writer``: the same with ``Dumper(background=True)``,
  which writes the file on a thread of its own;
- ``eager``, ``eager + running Probe`` and ``eager + statistics dump``: the same model, not compiled, for reference.

Rows alternate over ``--rounds`` rounds and report the median step time (wall, and this
process's CPU time, which moves less when other programs share the cores), its ratio to the
compiled row of the same run, and the graph breaks and compiled graphs dynamo added per round of
the row (``torch._dynamo.utils.counters``; each round arms anew). After the tools leave, the compiled row is timed again
(``compiled, after``): it runs the graphs it had.
Run: ``.venv/bin/python benchmarks/compiled_cost.py [--rounds 3 --steps 20 --threads 1 --backend inductor]``
(``--backend aot_eager`` measures the graph counts and the arming's share of a step where inductor is too slow).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_models import TransformerEncoder
from torch import nn
from torch._dynamo.utils import counters

import fwdtrace

KEY = "layers.1.ff.0.Linear"  # the key every tool looks at (the second block's first MLP layer)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int,
                before_step: Callable[[], None] | None = None) -> tuple[float, float]:
    """Median (wall, this process's CPU) seconds per training step over ``steps`` steps (``before_step`` in each)."""
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        if before_step is not None:
            before_step()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def dynamo_state() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


# Each configuration is a context manager around the timed steps; what it yields runs before each step.
@contextlib.contextmanager
def nothing(model: nn.Module) -> Iterator[None]:
    yield


@contextlib.contextmanager
def dumped(model: nn.Module, background: bool = False) -> Iterator[Callable[[], None]]:
    with tempfile.TemporaryDirectory() as folder, \
            fwdtrace.Dumper(folder, values="statistics", background=background) as dumper:
        steps = itertools.count()

        def each_step() -> None:
            dumper.remove()  # the last step's dump closed and named
            dumper.register(model, step=next(steps), grads=False)

        yield each_step


@contextlib.contextmanager
def served(model: nn.Module, *arms: str) -> Iterator[None]:
    with fwdtrace.serve(model, port=0) as server:
        for kind in arms:
            server.sampler.arm(KEY, kind)
        yield


@contextlib.contextmanager
def toggled(model: nn.Module) -> Iterator[Callable[[], None]]:
    with fwdtrace.serve(model, port=0) as server:
        server.sampler.arm(KEY, "forward")

        def each_step() -> None:  # a click off and on again on the live page
            server.sampler.disarm(KEY)
            server.sampler.arm(KEY, "forward")

        yield each_step


@contextlib.contextmanager
def probed(model: nn.Module) -> Iterator[None]:
    with fwdtrace.Probe(model) as probe:
        probe.running_stats(KEY)
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    # One thread by default: with more threads than free cores, OpenMP's spinning waits swamp the step times.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (inductor, aot_eager, eager)")
    parser.add_argument("--width", type=int, default=256, help="the encoder's width d (GPT-2-sized: 256)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    eager = TransformerEncoder(d=args.width, layers=args.layers, heads=4)
    assert KEY in fwdtrace.module_keys(eager), fwdtrace.module_keys(eager)
    model = TransformerEncoder(d=args.width, layers=args.layers, heads=4)
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend=args.backend)
    x = torch.randn(args.batch, 64, args.width)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (eager, compiled)}
    start = time.perf_counter()
    train_steps(compiled, opts[id(compiled)], x, 3)  # compiles forward and backward
    compile_s = time.perf_counter() - start
    train_steps(eager, opts[id(eager)], x, 3)
    rows: list[tuple[str, nn.Module, Callable[[nn.Module], contextlib.AbstractContextManager[Any]]]] = [
        ("compiled", compiled, nothing),
        ("compiled + idle service", compiled, served),
        ("compiled + idle service + weight arm", compiled, lambda m: served(m, "weight")),
        ("compiled + idle service + forward arm", compiled, lambda m: served(m, "forward")),
        ("compiled + idle service + forward arm toggled each step", compiled, toggled),
        ("compiled + idle service + grad arm", compiled, lambda m: served(m, "grad")),
        ("compiled + running Probe", compiled, probed),
        ("compiled + statistics dump", compiled, dumped),
        ("compiled + statistics dump, background writer", compiled, lambda m: dumped(m, background=True)),
        ("compiled, after", compiled, nothing),
        ("eager", eager, nothing),
        ("eager + running Probe", eager, probed),
        ("eager + statistics dump", eager, dumped),
    ]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in rows}
    added: dict[str, list[int]] = {name: [0, 0] for name, _, _ in rows}
    for _ in range(args.rounds):
        for name, m, tool in rows:
            with tool(m) as each_step:
                before = dynamo_state()
                # the service's first forward traces the graph; arming compiles
                train_steps(m, opts[id(m)], x, 2, each_step)
                times[name].append(train_steps(m, opts[id(m)], x, args.steps, each_step))
                after = dynamo_state()
            added[name] = [a + (n - b) for a, n, b in zip(added[name], after, before, strict=True)]
    wall = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    out = [{"row": name, "step_ms": 1000 * wall[name], "vs_compiled": wall[name] / wall["compiled"],
            "cpu_ms": 1000 * cpu[name], "cpu_vs_compiled": cpu[name] / cpu["compiled"],
            "graphs_compiled": added[name][0] / args.rounds, "graph_breaks": added[name][1] / args.rounds}
           for name in times]
    if args.json:
        print(json.dumps({"compile_s": compile_s, "rows": out}, indent=2))
        return
    print(f"torch {torch.__version__}, backend {args.backend}, {torch.get_num_threads()} threads, "
          f"compiling took {compile_s:.1f} s; "
          f"medians of {args.rounds} rounds x {args.steps} steps")
    print("| configuration | step (wall) | vs compiled | step (CPU) | vs compiled | graphs compiled | graph breaks |")
    # (graphs compiled and graph breaks: per round, each round attaching the tool anew)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in out:
        print(f"| {r['row']} | {r['step_ms']:.1f} ms | {r['vs_compiled']:.2f}x | {r['cpu_ms']:.1f} ms | "
              f"{r['cpu_vs_compiled']:.2f}x | {r['graphs_compiled']:g} | {r['graph_breaks']:g} |")


if __name__ == "__main__":
    main()
