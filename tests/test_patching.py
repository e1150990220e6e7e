"""The one dispatch point and the one patcher: every original comes back, the very same object,
in any order, from any thread, exceptions and Ctrl-C included."""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest
import torch
from torch import nn

from fwdtrace.patching import Patcher, add_call_handler, call_dispatch_active, critical, remove_call_handler

ORIGINAL_IMPL = nn.modules.module.Module._call_impl


class Base:
    def greet(self) -> str:
        return "base"


class Child(Base):
    pass


def test_restore_puts_back_the_very_same_objects() -> None:
    original = nn.ReLU.__dict__["forward"]
    call = nn.Module.__dict__["__call__"]
    with Patcher() as p:
        p.patch(nn.ReLU, "forward", lambda self, x: x * 0)
        p.patch(nn.Module, "__call__", lambda self, *a: "patched")
        assert len(p) == 2
        assert nn.ReLU.__dict__["forward"] is not original
    assert nn.ReLU.__dict__["forward"] is original
    assert nn.Module.__dict__["__call__"] is call
    assert len(p) == 0


def test_the_same_attribute_patched_twice_restores_in_reverse_order() -> None:
    original = Base.__dict__["greet"]
    with Patcher() as p:
        p.patch(Base, "greet", lambda self: "one")
        p.patch(Base, "greet", lambda self: "two")
        assert Base().greet() == "two"
    assert Base.__dict__["greet"] is original


def test_an_inherited_attribute_is_removed_again() -> None:
    with Patcher() as p:
        p.patch(Child, "greet", lambda self: "child")
        assert Child().greet() == "child"
    assert "greet" not in Child.__dict__
    assert Child().greet() == "base"


def test_restore_on_exception_and_twice() -> None:
    original = Base.__dict__["greet"]
    p = Patcher()
    with pytest.raises(KeyError):
        with p:
            p.patch(Base, "greet", lambda self: "patched")
            raise KeyError("boom")
    assert Base.__dict__["greet"] is original
    p.restore()  # safe to call again
    assert Base.__dict__["greet"] is original


def test_a_failing_undo_does_not_stop_the_others() -> None:
    class Frozen:
        __slots__ = ("value",)

    original = Base.__dict__["greet"]
    frozen = Frozen()
    frozen.value = 1
    p = Patcher()
    p.patch(Base, "greet", lambda self: "patched")
    p._patches.append(type(p._patches[0])(frozen, "missing_slot", 2))  # an undo that cannot work
    with pytest.raises(AttributeError):
        p.restore()
    assert Base.__dict__["greet"] is original and len(p) == 0


# -- the dispatch point of module calls (nn.Module._call_impl) -------------------------------------
def recorder(seen: list[str], tag: str) -> Any:
    def handler(call: Any, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        seen.append(f"{tag}:{type(module).__name__}")
        return call(module, *args, **kwargs)

    return handler


def test_handlers_nest_newest_outermost_and_leave_in_any_order() -> None:
    seen: list[str] = []
    a = add_call_handler(recorder(seen, "a"))
    b = add_call_handler(recorder(seen, "b"))
    assert nn.Module.__dict__["_call_impl"] is not ORIGINAL_IMPL and call_dispatch_active()
    nn.ReLU()(torch.ones(1))
    assert seen == ["b:ReLU", "a:ReLU"]
    assert remove_call_handler(a)  # the first one leaves first
    seen.clear()
    nn.ReLU()(torch.ones(1))
    assert seen == ["b:ReLU"]
    assert remove_call_handler(b)
    assert not remove_call_handler(b)  # twice is harmless
    assert nn.Module.__dict__["_call_impl"] is ORIGINAL_IMPL and not call_dispatch_active()


def test_a_handler_sees_only_its_own_threads_calls() -> None:
    seen: list[str] = []
    other_seen: list[str] = []
    handle = add_call_handler(recorder(seen, "main"))
    try:
        def other() -> None:
            nn.Tanh()(torch.ones(1))
            other_handle = add_call_handler(recorder(other_seen, "other"))
            nn.Sigmoid()(torch.ones(1))
            remove_call_handler(other_handle)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        nn.ReLU()(torch.ones(1))
    finally:
        remove_call_handler(handle)
    assert seen == ["main:ReLU"] and other_seen == ["other:Sigmoid"]
    assert nn.Module.__dict__["_call_impl"] is ORIGINAL_IMPL


def test_a_handler_can_be_removed_from_another_thread() -> None:
    seen: list[str] = []
    handle = add_call_handler(recorder(seen, "main"))
    thread = threading.Thread(target=remove_call_handler, args=(handle,))
    thread.start()
    thread.join()
    nn.ReLU()(torch.ones(1))
    assert seen == [] and nn.Module.__dict__["_call_impl"] is ORIGINAL_IMPL


def test_every_thread_handler_runs_in_other_threads_too() -> None:
    seen: list[str] = []
    handle = add_call_handler(recorder(seen, "all"), all_threads=True)
    try:
        thread = threading.Thread(target=lambda: nn.Tanh()(torch.ones(1)))
        thread.start()
        thread.join()
        nn.ReLU()(torch.ones(1))
    finally:
        remove_call_handler(handle)
    assert seen == ["all:Tanh", "all:ReLU"]


def test_someone_elses_patch_made_after_ours_stays() -> None:
    handle = add_call_handler(recorder([], "a"))
    theirs = nn.Module.__dict__["_call_impl"]

    def their_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return theirs(self, *args, **kwargs)

    nn.Module._call_impl = their_call  # type: ignore[method-assign]
    try:
        remove_call_handler(handle)
        assert nn.Module.__dict__["_call_impl"] is their_call
    finally:
        nn.Module._call_impl = ORIGINAL_IMPL  # type: ignore[method-assign]


# -- critical sections -----------------------------------------------------------------------------
def test_ctrl_c_inside_a_critical_section_is_raised_when_it_ends() -> None:
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with critical():
            signal.raise_signal(signal.SIGINT)
            steps.append("finished the section")  # not cut short
    assert steps == ["finished the section"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_critical_sections_raise_once_at_the_outermost_end() -> None:
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with critical():
            with critical():
                signal.raise_signal(signal.SIGINT)
            steps.append("after the inner section")
    assert steps == ["after the inner section"]


def test_a_users_own_sigint_handler_is_called_after_the_section() -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with critical():
            signal.raise_signal(signal.SIGINT)
            assert calls == []
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_every_python_signal_handler_waits_for_the_section_and_each_runs_once() -> None:
    """A timeout's SIGALRM that raises is held back like Ctrl-C; two signals held: both handlers run,
    the first exception is raised, and both handlers are the user's again."""

    class Timeout(Exception):
        pass

    calls: list[str] = []

    def on_alarm(signum: int, frame: object) -> None:
        calls.append("alarm")
        raise Timeout

    def on_usr1(signum: int, frame: object) -> None:
        calls.append("usr1")

    previous = {signal.SIGALRM: signal.signal(signal.SIGALRM, on_alarm), signal.SIGUSR1: signal.signal(signal.SIGUSR1, on_usr1)}
    try:
        with pytest.raises(Timeout):
            with critical():
                signal.raise_signal(signal.SIGALRM)
                signal.raise_signal(signal.SIGUSR1)
                signal.raise_signal(signal.SIGALRM)  # pending already: once, as the OS coalesces
                calls.append("finished the section")
        assert calls == ["finished the section", "alarm", "usr1"]
        assert signal.getsignal(signal.SIGALRM) is on_alarm and signal.getsignal(signal.SIGUSR1) is on_usr1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
