"""How trace time grows with the size of the forward: per op, from 1k to 64k ops, and Llama on meta.

    python benchmarks/trace_scaling.py [--repeats 3] [--max-ops 65536] [--no-llama] [--profile]

1. A forward of ``n`` multiplications by a constant (``n`` function nodes that share the base
   name ``mul``), n = 1k, 2k, ..., 64k: ``fwdtrace.trace`` against the plain forward, medians
   over repeats of wall time and of process CPU time (on a shared machine the CPU time is the
   steadier figure), and ``fwdtrace.analyze`` (its counting run). Linear growth means a flat
   time per op.
2. A Llama config (Llama-2-7B's widths) with 8, 16 and 32 layers built on the meta device
   (random weights, no memory): trace time per layer.
3. The goal: a 70B-parameter Llama config (Llama-2-70B's shape: 80 layers, width 8192) traced
   and analysed on meta in under 10 s and 2 GB. It runs in a fresh process, whose peak
   resident memory (``ru_maxrss``, Python and torch included) is the memory figure.

The Llama forwards get a prepared 4-D causal mask: transformers' 2-D mask preprocessing reads
tensor values (the packed-sequence check), which no forward on meta can do, with or without
fwdtrace. ``--profile`` prints where a 16k-op trace spends its time (cProfile, CPU clock).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from bench_models import Chain

import fwdtrace


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``fn()``."""
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(wall), statistics.median(cpu)


def op_counts(max_ops: int) -> list[int]:
    out, n = [], 1000
    while n <= max_ops:
        out.append(n)
        n *= 2
    return out


def chain_table(max_ops: int, repeats: int) -> None:
    x = torch.ones(4)
    fwdtrace.trace(Chain(100), x)  # plugins, caches
    fwdtrace.analyze(Chain(100), x, warmup=0, repeats=1)
    print("| ops | plain forward (CPU) | trace (wall) | trace (CPU) | trace CPU per op | per op vs 1k "
          "| analyze CPU per op | per op vs 1k |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    first: tuple[float, float] | None = None
    for n in op_counts(max_ops):
        model = Chain(n)
        _, plain_cpu = timed(lambda m=model: m(x), repeats)
        wall, cpu = timed(lambda m=model: fwdtrace.trace(m, x), repeats)
        _, analyze_cpu = timed(lambda m=model: fwdtrace.analyze(m, x, warmup=0, repeats=1), repeats)
        per_op = (cpu / n, (analyze_cpu - plain_cpu) / n)  # analyze's one timed repeat is a plain forward
        first = first or per_op
        print(f"| {n // 1000}k | {plain_cpu * 1e3:.0f} ms | {wall:.2f} s | {cpu:.2f} s | {per_op[0] * 1e6:.1f} µs "
              f"| {per_op[0] / first[0]:.2f} | {per_op[1] * 1e6:.1f} µs | {per_op[1] / first[1]:.2f} |", flush=True)


def llama(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=32000,
                         max_position_embeddings=4096)
    with torch.device("meta"):
        return LlamaForCausalLM(config).eval()


def llama_inputs(tokens: int = 128) -> tuple[tuple[torch.Tensor], dict[str, object]]:
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    mask = torch.ones(1, 1, tokens, tokens, dtype=torch.bool, device="meta").tril()
    return (ids,), {"attention_mask": mask, "use_cache": False}


def llama_table(repeats: int) -> None:
    args, kwargs = llama_inputs()
    print("| Llama-2-7B widths, layers | nodes | plain forward (CPU) | trace (wall) | trace (CPU) | CPU per layer |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layers in (8, 16, 32):
        model = llama(layers, 4096, 11008, 32, 32)
        _, plain_cpu = timed(lambda m=model: m(*args, **kwargs), repeats)
        graph = fwdtrace.trace(model, *args, **kwargs)
        wall, cpu = timed(lambda m=model: fwdtrace.trace(m, *args, **kwargs), repeats)
        print(f"| {layers} | {len(graph)} | {plain_cpu:.2f} s | {wall:.2f} s | {cpu:.2f} s "
              f"| {cpu / layers * 1e3:.0f} ms |", flush=True)


def llama70b_child() -> None:
    """In a fresh process: build, trace and analyse the 70B config; print JSON."""
    out: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()

    def lap(name: str) -> None:
        nonlocal wall, cpu
        out[f"{name}_s"], out[f"{name}_cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
        wall, cpu = time.perf_counter(), time.process_time()

    model = llama(80, 8192, 28672, 64, 8)  # the transformers import included
    args, kwargs = llama_inputs()
    lap("build")
    out["rss_built"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    graph = fwdtrace.trace(model, *args, **kwargs)
    lap("trace")
    analysis = fwdtrace.analyze(model, *args, **kwargs)
    lap("analyze")
    out.update(params=analysis.params, flops=analysis.flops, nodes=len(graph),
               rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(json.dumps(out))


def llama70b() -> None:
    out = subprocess.run([sys.executable, __file__, "--llama70b-child"], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Llama 70B config on meta, a fresh process: {r['params'] / 1e9:.1f} B params, "
          f"{r['flops'] / 1e12:.1f} TFLOPs for 128 tokens, {r['nodes']} nodes")
    print("| step | wall | CPU |\n| --- | --- | --- |")
    for step in ("build", "trace", "analyze"):
        print(f"| {step} | {r[step + '_s']:.2f} s | {r[step + '_cpu_s']:.2f} s |")
    print(f"| trace + analyze (goal < 10 s) | {r['trace_s'] + r['analyze_s']:.2f} s "
          f"| {r['trace_cpu_s'] + r['analyze_cpu_s']:.2f} s |")
    print(f"peak RSS {r['rss_peak'] / 2**30:.2f} GiB, {r['rss_built'] / 2**30:.2f} GiB of it after the imports and "
          f"the build (goal < 2 GB)", flush=True)


def profile(n: int = 16000) -> None:
    x, model = torch.ones(4), Chain(n)
    fwdtrace.trace(Chain(100), x)
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    fwdtrace.trace(model, x)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = sorted(((v[2], v[3], k) for k, v in stats.stats.items()), reverse=True)  # type: ignore[attr-defined]
    print(f"where a {n}-op trace spends {total:.2f} s of CPU (own time, cumulative time):")
    for own, cum, (file, line, name) in rows[:15]:
        print(f"  {own / total:6.1%} {cum / total:6.1%}  {file.rsplit('/', 2)[-1]}:{line}({name})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-ops", type=int, default=65536)
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--llama70b-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama70b_child:
        llama70b_child()
        return
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, medians of {args.repeats}\n")
    with torch.no_grad():
        chain_table(args.max_ops, args.repeats)
        if not args.no_llama:
            print()
            llama_table(args.repeats)
    if not args.no_llama:
        print()
        llama70b()
    if args.profile:
        print()
        profile()


if __name__ == "__main__":
    main()
