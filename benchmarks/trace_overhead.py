"""What tracing costs against a plain forward, beside torchview and torchlens: time, memory, threads, install().

    python benchmarks/trace_overhead.py [--repeats 10] [--models resnet50 bert gpt2 gpt2-124m] [--no-peers]
    python benchmarks/trace_overhead.py --function-hooks   # only the row with a function hooked by path

One torch thread, everything under ``torch.no_grad()``. For each model it times, interleaved so
drift hits all alike, a plain forward, ``fwdtrace.trace()`` (the default, ``pin=False``) and
``trace(pin=True)``, and reports medians and ratios against the plain forward. "hooks only" is
the floor under any eager trace: fwdtrace's module-call dispatch and a ``TorchFunctionMode``,
both passing every call straight through and recording nothing. "minimal recorder" adds the least
any recorder written in Python does on top: a stable id per tensor, retired when the tensor dies,
and one tuple per call (no nodes, edges, names, scopes or arguments). torchview
(``draw_graph``, no rendering) and torchlens (``trace`` with nothing saved) are measured the same
way, each in a child process of this run with its own plain forward beside it: both wrap torch
functions process-wide, which would slow every later measurement here.

Peak memory is what a variant adds over the built model: on CPU the peak of live tensor storage
(counted by a dispatch mode) plus the peak of the Python heap (tracemalloc); on CUDA
``torch.cuda.max_memory_allocated``.

Two more measurements: the throughput of a thread running plain GPT-2 forwards (a server) while
another thread traces BERT (or runs it under the floors above), against the same thread while its
neighbour runs plain BERT forwards, and that thread's own CPU time per forward (what the patching
costs it, apart from sharing the GIL with a busier neighbour); and a ResNet-50 forward with
``fwdtrace.install()`` and one callback on a layer class the model does not use, in the steady
state (blocks of forwards with it installed beside blocks without, the order alternating).

A GPT-2 with eager attention is timed with ``eager_attention_forward`` hooked by its dotted path
(one node per call, its inside hidden, and a callback), in ``trace()`` and in an ``install()``'ed
forward, beside the same without the hook.

Targets: default ``trace()`` at most 1.5x a plain forward on BERT and GPT-2, at most 1.2x on
ResNet-50, within 1.1x in peak memory; a neighbour thread loses under 5% throughput;
``install()`` costs under 2% on layers it does not hook.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from bench_models import ResNet50
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fwdtrace
from fwdtrace.memory import StorageTracker
from fwdtrace.tracer import around_module_calls

torch.set_num_threads(1)


def bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                        vocab_size=1000)
    return BertModel(config), {"input_ids": torch.randint(0, 1000, (1, 128))}


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=128)
    return GPT2Model(config), {"input_ids": torch.randint(0, 1000, (1, 64))}


def gpt2_small() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """GPT-2 at its real smallest size (124M parameters, 12 layers, hidden 768), 128 tokens."""
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config()), {"input_ids": torch.randint(0, 50257, (1, 128))}


def resnet50() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return ResNet50(), {"x": torch.randn(1, 3, 224, 224)}


def gpt2_eager() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The GPT-2 above with transformers' eager attention: its eager_attention_forward runs (and can be hooked)."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=128, attn_implementation="eager")
    return GPT2Model(config), {"input_ids": torch.randint(0, 1000, (1, 64))}


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]] = {
    "resnet50": resnet50, "bert": bert, "gpt2": gpt2, "gpt2-124m": gpt2_small, "gpt2-eager": gpt2_eager,
}
DEFAULT_MODELS = ["resnet50", "bert", "gpt2"]
LABELS = {"resnet50": "ResNet-50, 1x3x224x224", "bert": "BERT 4x256, 128 tokens", "gpt2": "GPT-2 2x128, 64 tokens",
          "gpt2-124m": "GPT-2 124M, 128 tokens", "gpt2-eager": "GPT-2 2x128 eager, 64 tok"}

Variant = Callable[[nn.Module, dict[str, torch.Tensor]], object]


def _positional(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(inputs.values())


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _straight_through(call: Callable[..., Any], module: nn.Module, a: tuple, k: dict) -> Any:
    return call(module, *a, **k)


def _hooks_only(m: nn.Module, kw: dict[str, torch.Tensor]) -> object:
    """The two hooks every eager trace needs, recording nothing: the floor under trace()."""
    with around_module_calls(_straight_through), _PassThrough():
        return m(**kw)


class _MinimalRecorder(TorchFunctionMode):
    """The least any eager recorder does: a stable id per tensor (retired when it dies) and one
    tuple per call that returns tensors. No nodes, edges, names, scopes, arguments or aliases."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}
        self.log: list[tuple[Any, ...]] = []
        self.next_id = 0

    def _id(self, t: torch.Tensor) -> int:
        raw = id(t)
        entry = self.ids.get(raw)
        if entry is not None and entry[1]() is t:
            return entry[0]
        ids, oid = self.ids, self.next_id
        self.next_id += 1
        ids[raw] = (oid, weakref.ref(t, lambda _, raw=raw: ids.pop(raw, None)))
        return oid

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            outs = [out]
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            outs = [o for o in out if isinstance(o, torch.Tensor)]
        else:
            return out
        ins = [self._id(a) for a in args if isinstance(a, torch.Tensor)]
        self.log.append((func, ins, [(self._id(o), o.shape, o.dtype) for o in outs]))
        return out


def _minimal_recorder(m: nn.Module, kw: dict[str, torch.Tensor]) -> object:
    """Hooks only plus the minimal recording: the floor under any pure-Python recorder's graph."""
    mode = _MinimalRecorder()

    def on_call(call: Callable[..., Any], module: nn.Module, a: tuple, k: dict) -> Any:
        mode.log.append((module,))
        return call(module, *a, **k)

    with around_module_calls(on_call), mode:
        return m(**kw)


OURS: dict[str, Variant] = {
    "plain": lambda m, kw: m(**kw),
    "hooks only": _hooks_only,
    "minimal recorder": _minimal_recorder,
    "trace()": lambda m, kw: fwdtrace.trace(m, **kw),
    "trace(pin=True)": lambda m, kw: fwdtrace.trace(m, pin=True, **kw),
}


def _torchview(m: nn.Module, kw: dict[str, torch.Tensor]) -> object:
    from torchview import draw_graph

    return draw_graph(m, input_data=kw, device="cpu", save_graph=False)


def _torchlens(m: nn.Module, kw: dict[str, torch.Tensor]) -> object:
    import torchlens

    return torchlens.trace(m, input_args=_positional(kw), save=None)  # metadata only, no activations


PEERS: dict[str, Variant] = {"torchview": _torchview, "torchlens": _torchlens}


def build(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    return model.eval(), inputs


def time_variants(name: str, variants: dict[str, Variant], repeats: int) -> dict[str, float]:
    """Median seconds per call of each variant, interleaved."""
    model, inputs = build(name)
    times: dict[str, list[float]] = {v: [] for v in variants}
    with torch.no_grad():
        for fn in variants.values():  # warm-up: lazy imports, caches
            fn(model, inputs)
            fn(model, inputs)
        for _ in range(repeats):
            for variant, fn in variants.items():
                start = time.perf_counter()
                fn(model, inputs)
                times[variant].append(time.perf_counter() - start)
    return {v: statistics.median(t) for v, t in times.items()}


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created while active (a CPU stand-in for CUDA's peak stats)."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.tracker = StorageTracker(existing)
        self.base = self.tracker.live_bytes

    @property
    def peak(self) -> int:
        return self.tracker.peak_bytes - self.base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.tracker.add(out)
        return out


def peak_memory(name: str, fn: Variant) -> int:
    """Peak bytes a variant adds over the built model: tensor storage plus the Python heap's peak."""
    model, inputs = build(name)
    with torch.no_grad():
        fn(model, inputs)
        existing = [*inputs.values(), *model.parameters(), *model.buffers()]
        for _ in range(2):  # the first round under the mode and tracemalloc pays their own set-up
            tracemalloc.start()
            with LiveTensorBytes(existing) as tensors:
                fn(model, inputs)
            python_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return tensors.peak + python_peak


def measure(name: str, variants: dict[str, Variant], repeats: int) -> dict[str, dict[str, float]]:
    medians = time_variants(name, variants, repeats)
    peaks = {v: peak_memory(name, fn) for v, fn in variants.items()}
    return {v: {"ms": medians[v] * 1e3, "x_plain": medians[v] / medians["plain"],
                "peak_mib": peaks[v] / 2**20, "peak_x_plain": peaks[v] / peaks["plain"]} for v in variants}


def measure_peer(name: str, peer: str, repeats: int) -> dict[str, dict[str, float]] | str:
    """One peer in a child process, with its own plain forward beside it."""
    cmd = [sys.executable, __file__, "--child", name, peer, "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(__file__), timeout=1800)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"failed: {last[:120]}"
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def neighbour_throughput(seconds: float = 3.0, rounds_per_variant: int = 5) -> dict[str, dict[str, float]]:
    """Forwards per second of a thread (GPT-2, an inference server) while its neighbour runs plain
    BERT forwards, traces BERT, or runs BERT under the floors (hooks only, minimal recorder, the
    dispatch point alone). The loss is the median over cycles of each round against the plain
    round of its cycle; min and max show the spread."""
    server, server_in = build("gpt2")
    other, other_in = build("bert")

    def run(neighbour: Variant) -> tuple[float, float]:
        stop = threading.Event()
        count = [0]
        cpu = [0.0]

        def serve() -> None:
            with torch.no_grad():
                start = time.thread_time()
                while not stop.is_set():
                    server(**server_in)
                    count[0] += 1
                cpu[0] = time.thread_time() - start

        def disturb() -> None:
            with torch.no_grad():
                while not stop.is_set():
                    neighbour(other, other_in)

        threads = [threading.Thread(target=serve), threading.Thread(target=disturb)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        return count[0] / seconds, cpu[0] / max(count[0], 1)

    def dispatch_churn(m: nn.Module, kw: dict[str, torch.Tensor]) -> object:
        # fwdtrace's dispatch point installed and removed around every neighbour forward, as a
        # trace does, without the trace's own work: what the patching alone costs the server
        with around_module_calls(_straight_through):
            return m(**kw)

    neighbours: dict[str, Variant] = {
        "plain": OURS["plain"], "trace()": OURS["trace()"], "hooks only": OURS["hooks only"],
        "minimal recorder": OURS["minimal recorder"], "dispatch": dispatch_churn,
    }
    rounds: dict[str, list[tuple[float, float]]] = {v: [] for v in neighbours}
    for _ in range(rounds_per_variant):  # interleaved: each round is compared with plain's of its cycle
        for variant, fn in neighbours.items():
            rounds[variant].append(run(fn))
    out: dict[str, dict[str, float]] = {}
    for v, rs in rounds.items():
        ratios = [r[0] / p[0] for r, p in zip(rs, rounds["plain"], strict=True)]
        cpu = [r[1] / p[1] for r, p in zip(rs, rounds["plain"], strict=True)]
        out[v] = {"per_s": statistics.median(r[0] for r in rs), "loss": 1 - statistics.median(ratios),
                  "loss_min": 1 - max(ratios), "loss_max": 1 - min(ratios),
                  "cpu_ms": statistics.median(r[1] for r in rs) * 1e3, "cpu_cost": statistics.median(cpu) - 1}
    return out


def install_cost(blocks: int, per_block: int = 5) -> dict[str, float]:
    """A plain forward, without and with install() and one callback on a class the model does not use.

    The steady state: blocks of forwards with install() active, beside blocks without, the order
    alternating between pairs of blocks. The cost is the median over pairs of the ratio of the
    blocks' medians, in wall time and in this thread's CPU time."""
    model, inputs = build("resnet50")

    @fwdtrace.hook_forward(nn.Embedding)
    def unused(module: nn.Module, args: tuple, out: Any) -> None:
        pass

    wall: dict[str, list[float]] = {"plain": [], "installed": []}
    cpu: dict[str, list[float]] = {"plain": [], "installed": []}
    try:
        with torch.no_grad():
            model(**inputs)
            for i in range(blocks):
                for variant in ("plain", "installed") if i % 2 == 0 else ("installed", "plain"):
                    if variant == "installed":
                        fwdtrace.install()
                    model(**inputs)  # settle after the switch
                    w, c = [], []
                    for _ in range(per_block):
                        start, start_cpu = time.perf_counter(), time.thread_time()
                        model(**inputs)
                        c.append(time.thread_time() - start_cpu)
                        w.append(time.perf_counter() - start)
                    fwdtrace.uninstall()
                    wall[variant].append(statistics.median(w))
                    cpu[variant].append(statistics.median(c))
        per_call = _installed_cost_per_call()
        calls = _module_calls(model, inputs)
    finally:
        fwdtrace.uninstall()
        fwdtrace.remove_hook(unused)

    def cost(t: dict[str, list[float]]) -> float:
        return statistics.median(i / p for i, p in zip(t["installed"], t["plain"], strict=True)) - 1

    plain = statistics.median(wall["plain"])
    return {"plain_ms": plain * 1e3, "installed_ms": statistics.median(wall["installed"]) * 1e3,
            "cost": cost(wall), "cpu_cost": cost(cpu), "per_call_us": per_call * 1e6, "calls": calls,
            "estimate": per_call * calls / plain}


def _module_calls(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """How many module calls one forward makes (counted by a plain forward pre-hook on every module)."""
    count = [0]
    handles = [m.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1)) for m in model.modules()]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return count[0]


def _installed_cost_per_call(layers: int = 2000, repeats: int = 41) -> float:
    """Seconds install() adds to one module call of a class it does not hook: a Sequential of
    ``layers`` Identity layers with and without it, interleaved, median of the differences."""
    model = nn.Sequential(*(nn.Identity() for _ in range(layers)))
    x = torch.zeros(1)
    diffs = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.thread_time()
            model(x)
            plain = time.thread_time() - start
            fwdtrace.install()
            try:
                model(x)  # settle after the switch
                start = time.thread_time()
                model(x)
                diffs.append(time.thread_time() - start - plain)
            finally:
                fwdtrace.uninstall()
    return statistics.median(diffs) / (layers + 1)


GPT2_ATTENTION = "transformers.models.gpt2.modeling_gpt2.eager_attention_forward"


def function_hooks_cost(repeats: int) -> dict[str, float]:
    """GPT-2 (eager attention) with its ``eager_attention_forward`` hooked by path, one node per call
    and a callback: ``trace()`` and an ``install()``'ed forward against the same without the hook."""
    from fwdtrace.registry import REGISTRY, resolve_any

    target = resolve_any(GPT2_ATTENTION)
    target.atomic = True
    target.callbacks = [lambda inputs, kwargs, output: None]

    def hooked(run: Variant) -> Variant:
        def variant(m: nn.Module, kw: dict[str, torch.Tensor]) -> object:
            REGISTRY.functions[target.path] = target  # registered for this call only: the others run without
            try:
                return run(m, kw)
            finally:
                del REGISTRY.functions[target.path]

        return variant

    def installed(m: nn.Module, kw: dict[str, torch.Tensor]) -> object:
        fwdtrace.install()
        try:
            return m(**kw)
        finally:
            fwdtrace.uninstall()

    variants: dict[str, Variant] = {
        "plain": OURS["plain"], "trace()": OURS["trace()"], "trace() hooked": hooked(OURS["trace()"]),
        "installed": installed, "installed hooked": hooked(installed),
    }
    return time_variants("gpt2-eager", variants, repeats)


def print_function_hooks_cost(repeats: int) -> None:
    f = function_hooks_cost(max(20, repeats))
    print(f"{LABELS['gpt2-eager']}: trace() {f['trace()'] * 1e3:.1f} ms ({f['trace()'] / f['plain']:.2f}x plain "
          f"{f['plain'] * 1e3:.1f} ms); with eager_attention_forward hooked by path (atomic + a callback) "
          f"{f['trace() hooked'] * 1e3:.1f} ms ({f['trace() hooked'] / f['plain']:.2f}x); install()'ed forward "
          f"{f['installed'] / f['plain']:.2f}x, with the hook {f['installed hooked'] / f['plain']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--no-peers", action="store_true", help="skip torchview and torchlens")
    parser.add_argument("--function-hooks", action="store_true", help="only the GPT-2 row with its attention hooked")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "PEER"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        name, peer = args.child
        result = measure(name, {"plain": OURS["plain"], peer: PEERS[peer]}, args.repeats)
        print(json.dumps(result))
        return

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, median of {args.repeats} repeats, no_grad")
    if args.function_hooks:
        print_function_hooks_cost(args.repeats)
        return
    print(f"{'model':<24} {'variant':<17} {'median ms':>10} {'x plain':>8} {'peak MiB':>9} {'peak x plain':>13}")
    for name in args.models:
        rows = measure(name, OURS, args.repeats)
        for peer in ([] if args.no_peers else list(PEERS)):
            result = measure_peer(name, peer, args.repeats)
            if isinstance(result, str):
                print(f"{LABELS[name]:<24} {peer:<17} {result}")
                continue
            rows[peer] = result[peer]
        for v, r in rows.items():
            print(f"{LABELS[name]:<24} {v:<17} {r['ms']:>10.1f} {r['x_plain']:>8.2f} {r['peak_mib']:>9.1f} "
                  f"{r['peak_x_plain']:>13.2f}")
    print_function_hooks_cost(args.repeats)
    n = neighbour_throughput()
    plain = n["plain"]
    print(f"neighbour thread (GPT-2 forwards) beside plain BERT forwards: {plain['per_s']:.1f}/s, "
          f"CPU per forward {plain['cpu_ms']:.2f} ms; beside a thread running BERT under:")
    for v, r in n.items():
        if v != "plain":
            print(f"  {v:<17} {r['per_s']:6.1f}/s  {r['loss'] * 100:+6.1f}% lost (cycles {r['loss_min'] * 100:+.1f} to "
                  f"{r['loss_max'] * 100:+.1f}%), its CPU per forward {r['cpu_cost'] * 100:+.1f}%")
    c = install_cost(blocks=max(10, args.repeats))
    print(f"install() with one callback on a class ResNet-50 does not use: {c['installed_ms']:.1f} ms against "
          f"{c['plain_ms']:.1f} ms plain: {c['cost'] * 100:+.2f}% (steady state, median over pairs of blocks; CPU time "
          f"{c['cpu_cost'] * 100:+.2f}%); per module call it adds {c['per_call_us']:.2f} us (2000 Identity layers), "
          f"x {c['calls']} calls per forward = {c['estimate'] * 100:.2f}% of the plain forward")

if __name__ == "__main__":
    main()
