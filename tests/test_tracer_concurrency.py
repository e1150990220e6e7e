"""Traces in real processes: other threads, concurrent traces, Ctrl-C at any moment, any exit order.

The reference is always a quiet trace of the same model in the same process: a trace that
shares its process with any of these must give exactly that graph, and leave nothing behind.
"""

from __future__ import annotations

import itertools
import random
import signal
import threading
import time
from typing import Any

import pytest
import torch
import zoo
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import fwdtrace
from fwdtrace.patching import call_dispatch_active
from fwdtrace.tracer import active_tracer

ORIGINAL_CALL = nn.modules.module.Module._wrapped_call_impl
ORIGINAL_IMPL = nn.modules.module.Module._call_impl


def assert_nothing_left() -> None:
    assert nn.Module.__dict__["__call__"] is ORIGINAL_CALL and nn.Module.__dict__["_call_impl"] is ORIGINAL_IMPL
    assert not call_dispatch_active()
    assert _get_current_function_mode_stack() == []
    assert active_tracer() is None


def server_model() -> tuple[nn.Module, torch.Tensor]:
    """A different model, as an inference server thread would run."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 6, 8), nn.ReLU(), nn.Linear(8, 3))
    return model.eval(), torch.randint(0, 50, (4, 6))


def test_a_server_thread_running_forwards_during_traces_is_untouched() -> None:
    model, (x,) = zoo.resnetish()
    reference = fwdtrace.trace(model, x)
    server, request = server_model()
    with torch.no_grad():
        expected = server(request)
    stop = threading.Event()
    errors: list[BaseException] = []
    served = [0]

    def serve() -> None:
        while not stop.is_set():
            try:
                with torch.no_grad():
                    out = server(request)
                torch.testing.assert_close(out, expected)
                served[0] += 1
            except BaseException as e:  # noqa: BLE001 - every failure is the test's business
                errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        graphs = [fwdtrace.trace(model, x) for _ in range(20)]
    finally:
        stop.set()
        thread.join(timeout=30)
    assert errors == []
    assert served[0] > 0
    assert all(g == reference for g in graphs)
    assert_nothing_left()


def test_concurrent_traces_in_four_threads_each_get_the_single_thread_graph() -> None:
    models = {name: getattr(zoo, name)() for name in ("resnetish", "mobilenetish", "transformer_encoder")}
    references = {name: fwdtrace.trace(m, *inputs) for name, (m, inputs) in models.items()}
    results: list[tuple[str, Any]] = []
    barrier = threading.Barrier(4)

    def worker(seed: int) -> None:
        order = random.Random(seed).choices(list(models), k=8)
        barrier.wait()
        for name in order:
            model, inputs = models[name]
            try:
                results.append((name, fwdtrace.trace(model, *inputs)))
            except BaseException as e:  # noqa: BLE001
                results.append((name, e))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 32
    failed = [(name, r) for name, r in results if not isinstance(r, fwdtrace.Graph)]
    assert failed == []
    assert all(graph == references[name] for name, graph in results)
    assert_nothing_left()


def test_nested_tracing_in_one_thread_keeps_its_error_while_another_thread_traces() -> None:
    model, (x,) = zoo.shared_weights()
    started, release = threading.Event(), threading.Event()

    def slow_trace() -> None:
        with fwdtrace.Tracer():
            started.set()
            release.wait(30)
            model(x)

    thread = threading.Thread(target=slow_trace)
    thread.start()
    try:
        started.wait(30)
        assert fwdtrace.trace(model, x) == fwdtrace.trace(model, x)  # not "nested": another thread
        with pytest.raises(fwdtrace.FwdtraceError, match=r"^a fwdtrace Tracer is already active"):
            with fwdtrace.Tracer():
                fwdtrace.trace(model, x)
    finally:
        release.set()
        thread.join(timeout=30)
    assert_nothing_left()


def test_ctrl_c_at_random_moments_leaves_nothing_patched_and_surfaces_only_as_keyboard_interrupt() -> None:
    model, (x,) = zoo.resnetish()
    reference = fwdtrace.trace(model, x)
    armed = [False]

    def on_sigint(signum: int, frame: Any) -> None:
        if armed[0]:  # one interrupt per armed trace, never outside the loop's try
            armed[0] = False
            raise KeyboardInterrupt

    stop = threading.Event()
    main_id = threading.main_thread().ident
    assert main_id is not None and threading.current_thread() is threading.main_thread()

    def timer() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            time.sleep(rng.uniform(0.0, 0.004))
            signal.pthread_kill(main_id, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, on_sigint)
    thread = threading.Thread(target=timer, daemon=True)
    interrupted, finished, others = 0, 0, []
    try:
        thread.start()
        for _ in range(300):
            try:
                armed[0] = True
                graph = fwdtrace.trace(model, x)
                armed[0] = False
                finished += 1
                assert graph == reference
            except KeyboardInterrupt:
                interrupted += 1
            except BaseException as e:  # noqa: BLE001 - anything but KeyboardInterrupt fails
                armed[0] = False
                others.append(repr(e))
            assert_nothing_left()
    finally:
        armed[0] = False
        stop.set()
        thread.join(timeout=10)
        time.sleep(0.1)  # a signal still in flight meets the disarmed handler, not the test runner
        signal.signal(signal.SIGINT, previous)
    assert others == []
    assert interrupted > 50, (interrupted, finished)  # the signals did land, many inside traces
    assert fwdtrace.trace(model, x) == reference


EXITS = list(itertools.permutations(range(3)))


@pytest.mark.parametrize("exit_order", EXITS, ids=["".join(map(str, p)) for p in EXITS])
def test_probes_and_a_tracer_left_in_any_order(exit_order: tuple[int, ...]) -> None:
    model, (x,) = zoo.resnetish()
    reference = fwdtrace.trace(model, x)
    tracer = fwdtrace.Tracer()
    users = [fwdtrace.Probe(model), tracer, fwdtrace.Probe(model)]
    for u in users:
        u.__enter__()
    for i in exit_order:
        if users[i] is tracer:
            model(x)  # the forward runs while whatever is still entered is entered
        users[i].__exit__(None, None, None)
    assert tracer.graph == reference  # complete whatever left before it
    assert_nothing_left()
    with pytest.raises(RuntimeError) as info:  # no stale layer notes on a plain forward
        model(torch.ones(1, 5))
    assert not getattr(info.value, "__notes__", [])
