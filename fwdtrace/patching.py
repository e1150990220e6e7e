"""All of fwdtrace's patching: one dispatch point for module calls, and a :class:`Patcher`.

Traces, layer notes (probes, analysis) and :func:`fwdtrace.install` all need to see module
calls. They share **one** wrapper of ``torch.nn.Module._call_impl`` (what ``module(...)`` runs:
hooks, then forward), installed when the first of
them starts and removed (the original object put back) when the last one leaves, in any
order. Which handlers a call goes through is decided per thread, at the call: a thread with
no handler of its own goes straight to the original, so a trace in one thread never sees,
slows or breaks the forwards of another (OpenTelemetry's instrumentors and torch's own
``TorchFunctionMode`` stack work the same way).

Installing, removing and the bookkeeping around them run under a lock and cannot be cut
short by a signal: a SIGINT (or a timeout's SIGALRM whose handler raises) that arrives
meanwhile is held back and handled when the critical section ends (:class:`critical`).

:class:`Patcher` replaces attributes of one object (an exporter's ``forward`` of one
instance) and puts each original back, in reverse order, exceptions included, as torch.fx's
``_Patcher`` does.
"""

from __future__ import annotations

import _signal  # signal's C functions: without the enum wrapping, several times faster
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

__all__ = ["Patcher", "critical", "InterruptGuard", "add_call_handler", "remove_call_handler", "CallHandler", "call_dispatch_active"]

_MISSING = object()

# A handler gets ``(call, module, args, kwargs)`` and returns the call's result; ``call(module,
# *args, **kwargs)`` runs the rest of the chain (inner handlers, then the original _call_impl).
CallHandler = Callable[[Callable[..., Any], torch.nn.Module, tuple, dict], Any]


# -- critical sections -----------------------------------------------------------------------------
_LOCK = threading.RLock()
_MAIN_THREAD = threading.main_thread().ident
_MAIN_DEPTH = [0]  # critical sections open in the main thread
_GUARDS: list[InterruptGuard] = []  # the main thread's guards holding signals now, innermost last
_SIGNALS = tuple(sorted(int(s) for s in signal.valid_signals()))


class critical:
    """Hold the patching lock and hold back signal handlers (Ctrl-C included) until the block ends.

    >>> from fwdtrace.patching import critical
    >>> with critical():
    ...     pass  # a SIGINT here would be raised on leaving the block, not inside it

    In the main thread, every signal with a Python handler (SIGINT's ``KeyboardInterrupt``,
    a ``SIGALRM`` timeout that raises, ...) is held back while the block runs; on leaving it
    the handlers are put back and called with what arrived. Inside a trace its
    :class:`InterruptGuard` already holds them: the section only marks itself, and the guard
    delivers at its next safe point. Other threads never run Python signal handlers, so for
    them this is just the lock. Sections nest.
    """

    __slots__ = ("_guard", "_main")

    def __enter__(self) -> critical:
        self._guard: InterruptGuard | None = None
        self._main = threading.get_ident() == _MAIN_THREAD
        # The handlers first, then the lock: an interrupt before they are held leaves nothing held.
        if self._main:
            if not _GUARDS:
                guard = InterruptGuard(())
                try:
                    guard.start()
                except BaseException:  # a handler not yet held ran and raised: put back the others
                    guard.stop()
                    raise
                self._guard = guard
            _MAIN_DEPTH[0] += 1
        _LOCK.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        _LOCK.release()
        if self._main:
            _MAIN_DEPTH[0] -= 1
            if self._guard is not None:
                self._guard.stop()


class InterruptGuard:
    """For the length of a trace: a signal that lands in fwdtrace's own set-up or clean-up waits.

    >>> from fwdtrace.patching import InterruptGuard
    >>> guard = InterruptGuard(protected=())
    >>> guard.start(); guard.stop()  # a SIGINT in between, in protected code, is raised by stop()

    Every signal with a Python handler when :meth:`start` runs is routed through this guard:
    Ctrl-C, and also a ``SIGALRM`` timeout whose handler raises (as ``signal.setitimer``
    timeouts and test runners do). A ``with`` statement cannot protect the first instruction
    of ``__exit__`` (CPython runs signal handlers on entering any function), so a handler
    that only defers inside critical sections would let a signal skip the whole clean-up.
    This one looks where the signal landed: inside a :class:`critical` section, in this
    module's functions or in a ``protected`` code object it records the signal
    (``pending``); anywhere else (the model's code) it calls the original handler at once.
    :meth:`raise_pending` handles held signals at the next safe point; :meth:`stop` puts
    every original handler back (one set since stays) and then handles them. Each held
    signal's handler runs once; the first exception they raise is raised. Main thread only
    (Python runs signal handlers there); elsewhere it does nothing.
    """

    __slots__ = ("_protected", "_previous", "_handlers", "_on_signal", "pending")

    def __init__(self, protected: tuple[Any, ...]) -> None:
        self._protected = frozenset(protected)
        self._previous: dict[int, Any] = {}  # signals still routed here -> their handler before start()
        self._handlers: dict[int, Any] = {}  # every signal routed here -> that handler, to deliver to
        self._on_signal = self._handler  # one bound method, so getsignal() can be compared with it
        self.pending: dict[int, FrameType | None] = {}  # held back, in arrival order, once each (as the OS does)

    def start(self) -> None:
        # Not inside critical(): that starts a guard itself. A handler that runs before the swap
        # and raises leaves the signals swapped so far recorded: stop() puts them back.
        if threading.get_ident() != _MAIN_THREAD:
            return
        _GUARDS.append(self)
        for signum in _SIGNALS:
            handler = _signal.getsignal(signum)
            if callable(handler):
                self._previous[signum] = self._handlers[signum] = handler  # recorded before the swap
                _signal.signal(signum, self._on_signal)  # runs signals already pending first

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if _MAIN_DEPTH[0] or (frame is not None and (frame.f_globals is _GLOBALS or frame.f_code in self._protected)):
            if signum not in self.pending:
                self.pending[signum] = frame
            return
        self._handlers[signum](signum, frame)

    def raise_pending(self) -> None:
        _handle(self.pending, self._handlers, None)

    def stop(self) -> None:
        if self in _GUARDS:
            _GUARDS.remove(self)
        first: BaseException | None = None
        previous = self._previous
        # Once a handler is back, its signal may run it (and raise) at any instruction: catch that,
        # put back the rest, raise it after. The outer loop only repeats after an exception.
        while previous:
            try:
                while previous:
                    signum = next(iter(previous))
                    if _signal.getsignal(signum) is self._on_signal:  # a handler set since stays
                        _signal.signal(signum, previous[signum])
                    del previous[signum]
            except BaseException as e:
                if first is None:
                    first = e
        _handle(self.pending, self._handlers, first)


def _handle(pending: dict[int, FrameType | None], handlers: dict[int, Any], first: BaseException | None) -> None:
    """Run each held signal's handler, in arrival order; raise the first exception (``first`` if given)."""
    while pending:
        signum = next(iter(pending))
        frame = pending.pop(signum)
        try:
            handlers[signum](signum, frame)  # default_int_handler raises KeyboardInterrupt here
        except BaseException as e:
            if first is None:
                first = e
    if first is not None:
        raise first


_GLOBALS = globals()


# -- the one dispatch point of nn.Module.__call__ ---------------------------------------------------
# ``Module.__call__`` is ``_wrapped_call_impl``, which calls ``self._call_impl`` (hooks, then forward)
# unless the module was ``.compile()``d. Patching ``_call_impl`` sees the same calls, hooks included,
# for a fraction of the cost: setting a dunder such as ``__call__`` on a class makes CPython
# rewrite the call slot of every subclass (about 1 ms with transformers imported, per setattr).
PATCHED = "_call_impl"
@dataclass(eq=False)
class _Handle:
    handler: CallHandler
    thread: _ThreadHandlers | None  # None: every thread (install())


class _ThreadHandlers:
    """One thread's handlers, outermost first, and the chain built from them."""

    __slots__ = ("handlers", "version", "chain")

    def __init__(self) -> None:
        self.handlers: list[_Handle] = []
        self.version = -1  # the _Dispatch.version the chain was built for; -1: rebuild
        self.chain: Callable[..., Any] | None = None


_local = threading.local()


def _thread_handlers() -> _ThreadHandlers:
    try:
        return _local.handlers
    except AttributeError:
        state = _local.handlers = _ThreadHandlers()
        return state


class _Dispatch:
    """The wrapper of ``nn.Module._call_impl`` and who is using it."""

    def __init__(self) -> None:
        self.original: Callable[..., Any] | None = None
        self.users = 0
        self.global_handlers: list[_Handle] = []
        self.version = 0  # bumped whenever the global handlers change

    def chain(self) -> Callable[..., Any] | None:
        local = _thread_handlers()
        if local.version != self.version:
            local.chain = _build_chain(self.global_handlers + local.handlers, self.original)
            local.version = self.version
        return local.chain

    def add(self, handle: _Handle) -> None:
        with critical():
            if self.users == 0:
                self._install()
            self.users += 1
            if handle.thread is None:
                self.global_handlers.insert(0, handle)
                self.version += 1
            else:
                handle.thread.handlers.insert(0, handle)  # the newest is outermost
                handle.thread.version = -1

    def remove(self, handle: _Handle) -> bool:
        with critical():
            handlers = self.global_handlers if handle.thread is None else handle.thread.handlers
            if not any(h is handle for h in handlers):
                return False
            handlers[:] = [h for h in handlers if h is not handle]
            if handle.thread is None:
                self.version += 1
            else:
                handle.thread.version = -1
            self.users -= 1
            if self.users == 0:
                self._uninstall()
            return True

    def _install(self) -> None:
        current = torch.nn.Module.__dict__[PATCHED]
        self.original = current
        _dispatching_call.__wrapped__ = current  # type: ignore[attr-defined]
        setattr(torch.nn.Module, PATCHED, _dispatching_call)
        self.version += 1

    def _uninstall(self) -> None:
        # Put back what was there, unless someone patched over us since: theirs stays.
        if torch.nn.Module.__dict__.get(PATCHED) is _dispatching_call:
            setattr(torch.nn.Module, PATCHED, self.original)
        self.version += 1


def _build_chain(handles: list[_Handle], original: Callable[..., Any] | None) -> Callable[..., Any] | None:
    if not handles or original is None:
        return None
    call: Callable[..., Any] = original
    for handle in reversed(handles):
        call = _link(handle.handler, call)
    return call


def _link(handler: CallHandler, inner: Callable[..., Any]) -> Callable[..., Any]:
    def link(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return handler(inner, module, args, kwargs)

    return link


_DISPATCH = _Dispatch()
_is_compiling = torch.compiler.is_compiling


def _dispatching_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module._call_impl`` while fwdtrace is in use: this thread's handlers, else the original."""
    if _is_compiling():  # dynamo tracing a compiled model: it must see the plain call
        return _DISPATCH.original(self, *args, **kwargs)  # type: ignore[misc]
    chain = _DISPATCH.chain()
    if chain is None:
        return _DISPATCH.original(self, *args, **kwargs)  # type: ignore[misc]
    return chain(self, *args, **kwargs)


def add_call_handler(handler: CallHandler, *, all_threads: bool = False) -> _Handle:
    """Send module calls of this thread (or of every thread) through ``handler``; returns a handle.

    >>> import torch
    >>> from fwdtrace.patching import add_call_handler, remove_call_handler
    >>> seen = []
    >>> def note(call, module, args, kwargs):
    ...     seen.append(type(module).__name__)
    ...     return call(module, *args, **kwargs)
    >>> handle = add_call_handler(note)
    >>> _ = torch.nn.ReLU()(torch.ones(1))
    >>> remove_call_handler(handle), seen
    (True, ['ReLU'])
    >>> torch.nn.Module.__dict__["_call_impl"] is torch.nn.modules.module.Module._call_impl  # the original is back
    True

    The newest handler is the outermost. Remove handles in any order; the last removal puts
    the original ``_call_impl`` back.
    """
    handle = _Handle(handler, None if all_threads else _thread_handlers())
    _DISPATCH.add(handle)
    return handle


def remove_call_handler(handle: _Handle) -> bool:
    """Remove a handler added with :func:`add_call_handler`; False when it was already gone."""
    return _DISPATCH.remove(handle)


def call_dispatch_active() -> bool:
    """Whether fwdtrace's wrapper of ``nn.Module._call_impl`` is installed now."""
    return _DISPATCH.users > 0


# -- patching one object ---------------------------------------------------------------------------
@dataclass
class _Patch:
    owner: Any
    name: str
    previous: Any  # what owner.__dict__ held, or _MISSING when the attribute was inherited


class Patcher:
    """Replace attributes and restore the very same originals later.

    >>> import torch
    >>> from fwdtrace.patching import Patcher
    >>> original = torch.nn.ReLU.__dict__["forward"]
    >>> with Patcher() as p:
    ...     p.patch(torch.nn.ReLU, "forward", lambda self, x: x)
    >>> torch.nn.ReLU.__dict__["forward"] is original
    True

    Patching and restoring are critical sections (:class:`critical`): Ctrl-C cannot leave
    half of them done.
    """

    def __init__(self) -> None:
        self._patches: list[_Patch] = []

    def patch(self, owner: Any, name: str, value: Any) -> None:
        with critical():
            previous = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
            setattr(owner, name, value)
            self._patches.append(_Patch(owner, name, previous))

    def restore(self) -> None:
        """Undo every patch, newest first. Safe to call twice; one failing undo does not stop the others."""
        errors: list[BaseException] = []
        with critical():
            while self._patches:
                p = self._patches.pop()
                try:
                    if p.previous is _MISSING:
                        if p.name in getattr(p.owner, "__dict__", {}):
                            delattr(p.owner, p.name)
                    else:
                        setattr(p.owner, p.name, p.previous)
                except Exception as e:  # keep undoing the rest; report the first failure after
                    errors.append(e)
        if errors:
            raise errors[0]

    def __len__(self) -> int:
        return len(self._patches)

    def __enter__(self) -> Patcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
