"""Traces in real processes: other threads, concurrent traces, Ctrl-C at any moment, any exit order.

The reference is always a quiet trace of the same model in the same process: a trace that
shares its process with any of these must give exactly that graph, and leave nothing behind.
"""

from __future__ import annotations

import itertools
import random
import signal
import sys
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import zoo
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.patching import call_dispatch_active, patched_functions
from fwdtrace.tracer import active_tracer

ORIGINAL_CALL = nn.modules.module.Module._wrapped_call_impl
ORIGINAL_IMPL = nn.modules.module.Module._call_impl


def assert_nothing_left() -> None:
    assert nn.Module.__dict__["__call__"] is ORIGINAL_CALL and nn.Module.__dict__["_call_impl"] is ORIGINAL_IMPL
    assert not call_dispatch_active()
    assert _get_current_function_mode_stack() == []
    assert active_tracer() is None
    assert patched_functions() == []


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


# -- one signal per trace, at a random moment --------------------------------------------------------
TRACES = 300


class Timeout(Exception):
    """What a SIGALRM-based timeout raises (``signal.setitimer`` recipes, pytest-timeout's signal method)."""


def small_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.ones(1, 4)


def trace_under_fire(send: Any, raised: type[BaseException], fired: list[bool]) -> None:
    """TRACES traces of a small model, each with one signal sent ``send(delay)`` after its start.

    The signal's handler sets ``fired[0]`` and raises ``raised``. Whatever moment it lands in,
    afterwards every handler is the one installed before, nothing is patched, and the next
    trace works. The delay adapts so that about half the signals land inside the trace
    (mostly in its set-up and clean-up: the model is tiny) and half just after it.
    """
    model, x = small_model()
    reference = fwdtrace.trace(model, x)
    under_fire(lambda: fwdtrace.trace(model, x), reference, send, raised, fired)


def under_fire(
    run: Any, reference: Any, send: Any, raised: type[BaseException], fired: list[bool], runs: int = TRACES
) -> None:
    """``runs`` runs of ``run()``, each with one signal sent ``send(delay)`` after its start (see trace_under_fire).

    A run that finishes returns ``reference``; whether it finished or not, nothing is left behind.
    """
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGALRM)}
    rng = random.Random(0)
    latest = 1e-3  # seconds after the run starts
    inside, after, others = 0, 0, []
    for _ in range(runs):
        fired[0] = False
        result = None
        try:
            try:
                send(rng.uniform(0.0, latest))
                result = run()
            finally:
                deadline = time.monotonic() + 60
                while not fired[0] and time.monotonic() < deadline:  # the signal is handled inside this try
                    time.sleep(0)
        except raised:
            pass
        except BaseException as e:  # noqa: BLE001 - anything else fails, "a Tracer is already active" first
            others.append(repr(e))
        assert fired[0], "the signal never came"
        if result is None:
            inside += 1
            latest *= 1.1
        else:
            after += 1
            latest *= 0.9
            assert result == reference
        assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
        assert_nothing_left()
    assert others == []
    assert inside > runs // 10 and after > runs // 10, (inside, after)
    assert run() == reference


@pytest.mark.parametrize("sender", ["timer", "thread"])
def test_a_sigint_at_a_random_moment_of_each_trace_leaves_the_handler_and_nothing_patched(sender: str) -> None:
    """Ctrl-C as a real SIGINT: sent by a ``signal.setitimer`` timer's handler, or by another thread."""
    fired = [False]

    def on_sigint(signum: int, frame: Any) -> None:
        fired[0] = True
        raise KeyboardInterrupt

    main_id = threading.main_thread().ident
    assert main_id is not None and threading.current_thread() is threading.main_thread()
    go, stop, delay = threading.Event(), threading.Event(), [0.0]

    def timer_thread() -> None:
        while not stop.is_set():
            if go.wait(timeout=0.1):
                go.clear()
                time.sleep(delay[0])
                signal.pthread_kill(main_id, signal.SIGINT)

    def send(seconds: float) -> None:
        if sender == "timer":
            signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-6))
        else:
            delay[0] = seconds
            go.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    previous_alarm = signal.signal(signal.SIGALRM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the timer thread gets the GIL within microseconds, not 5 ms
    thread = threading.Thread(target=timer_thread, daemon=True)
    try:
        thread.start()
        trace_under_fire(send, KeyboardInterrupt, fired)
    finally:
        stop.set()
        thread.join(timeout=30)
        sys.setswitchinterval(switch)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        signal.signal(signal.SIGINT, previous)


def sigint_from_a_timer(run: Any, reference: Any, runs: int = TRACES) -> None:
    """``under_fire`` with Ctrl-C as a real SIGINT raised by a ``signal.setitimer`` timer's handler."""
    fired = [False]

    def on_sigint(signum: int, frame: Any) -> None:
        fired[0] = True
        raise KeyboardInterrupt

    def send(seconds: float) -> None:
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-6))

    previous = signal.signal(signal.SIGINT, on_sigint)
    previous_alarm = signal.signal(signal.SIGALRM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    try:
        under_fire(run, reference, send, KeyboardInterrupt, fired, runs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("dotted", [False, True], ids=["module-hooks", "dotted-path-hooks"])
# A signal that lands in a weakref callback of importlib's (resolving the dotted path) is printed
# and dropped by Python itself; the run then finishes and is checked like any other.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigint_at_a_random_moment_of_a_probe_block_leaves_nothing_patched_or_hooked(dotted: bool) -> None:
    """A notebook interrupt inside ``with Probe(model)``: the hooks, the layer notes and the patched function go."""
    model, x = small_model()
    with torch.no_grad():  # the reference, from torch alone: ReLU's output doubled, the last Linear's plus one
        hidden = torch.relu(model[0](x)) * (2 if dotted else 1)
        reference = tuple((model[2](hidden) + 1).flatten().tolist())

    def run() -> tuple[float, ...]:
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
        with fwdtrace.Probe(model) as probe:
            if dotted:
                probe.hook_function("torch.nn.functional.relu", lambda inputs, kwargs, output: output * 2)
            probe.replace_output("2.Linear", lambda module, inputs, output: output + 1)
            out = model(x)  # with grad: torch.no_grad() itself is not safe against an interrupt
        return tuple(out.detach().flatten().tolist())

    sigint_from_a_timer(run, reference)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as for probes
def test_a_sigint_at_a_random_moment_of_a_dumper_block_leaves_no_hook(tmp_path: Any) -> None:
    """Ctrl-C inside ``with Dumper(...)``: the hooks go, and a step that finished was written."""
    model, x = small_model()

    def run() -> int:
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
        with fwdtrace.Dumper(tmp_path, overwrite=True) as dumper:
            dumper.register(model)
            model(x).sum().backward()
        return len(dumper.paths)

    sigint_from_a_timer(run, 1, runs=100)  # each run writes a file


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as for probes
def test_a_sigint_at_a_random_moment_of_probe_shapes_leaves_nothing_patched() -> None:
    """A one-call tool (its own with-blocks inside): layer notes and module-call handlers go too."""
    model, x = small_model()
    reference = {k: v["output_shape"] for k, v in fwdtrace.Probe(model).shapes(x).items()}

    def run() -> dict[str, Any]:
        torch.set_grad_enabled(True)  # torch.no_grad() inside shapes() is not safe against an interrupt itself
        return {k: v["output_shape"] for k, v in fwdtrace.Probe(model).shapes(x).items()}

    try:
        sigint_from_a_timer(run, reference)
    finally:
        torch.set_grad_enabled(True)


def test_a_timeout_raised_by_sigalrm_at_a_random_moment_never_leaves_a_tracer_active() -> None:
    """A SIGALRM handler that raises, as timeouts built on ``signal.setitimer`` do."""
    fired = [False]

    def on_alarm(signum: int, frame: Any) -> None:
        fired[0] = True
        raise Timeout

    def send(seconds: float) -> None:
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-6))

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        trace_under_fire(send, Timeout, fired)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_trace_whose_exit_never_ran_does_not_block_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler installed after a trace started is not held back: its exception can land on the first
    instruction of ``__exit__``, which then does nothing. Simulated here by an ``__exit__`` that raises."""
    model, x = small_model()
    reference = fwdtrace.trace(model, x)

    def cut_short(self: fwdtrace.Tracer, *exc: object) -> None:
        raise Timeout

    sigint = signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as patch:
        patch.setattr(fwdtrace.Tracer, "__exit__", cut_short)
        with pytest.raises(Timeout):
            fwdtrace.trace(model, x)
    assert active_tracer() is not None and call_dispatch_active()  # left behind, as described
    assert signal.getsignal(signal.SIGINT) is not sigint  # its guard too
    with pytest.warns(UserWarning, match=r"^fwdtrace: the previous trace in this thread was left active"):
        assert fwdtrace.trace(model, x) == reference  # the trace() call that entered it has returned
    assert_nothing_left()
    assert signal.getsignal(signal.SIGINT) is sigint

    graphs, left = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for attempt in range(2):  # a loop that catches the timeout and enters the same with statement again
            with monkeypatch.context() as patch:
                if attempt == 0:
                    patch.setattr(fwdtrace.Tracer, "__exit__", cut_short)
                try:
                    with fwdtrace.Tracer() as tracer:
                        model(x)
                    graphs.append(tracer.graph)
                except Timeout:
                    left.append(active_tracer() is not None)
    assert left == [True] and graphs == [reference] and signal.getsignal(signal.SIGINT) is sigint
    assert [str(w.message).startswith("fwdtrace: the previous trace in this thread was left active") for w in caught] == [True]
    assert_nothing_left()
    tracer = fwdtrace.Tracer()
    tracer.__enter__()  # entered elsewhere (an ExitStack, a fixture): still in use, nesting stays an error
    try:
        with pytest.raises(FwdtraceError, match=r"^a fwdtrace Tracer is already active"):
            fwdtrace.trace(model, x)
    finally:
        tracer.__exit__(None, None, None)
    assert_nothing_left()


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
