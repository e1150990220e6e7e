"""All of fwdtrace's patching: one dispatch point for module calls, one per hooked function, and a :class:`Patcher`.

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

A function or method hooked by path (``@hook_forward("pkg.mod.f")``) gets a dispatch point of
its own, the same class with the same rules: :func:`add_function_handler` puts one wrapper in the
attribute that holds it (a module global, a class attribute) while any handler is in, and the
very same object back when the last one leaves.

:class:`Patcher` replaces attributes of one object (an exporter's ``forward`` of one
instance) and puts each original back, in reverse order, exceptions included, as torch.fx's
``_Patcher`` does.
"""

from __future__ import annotations

import _signal  # signal's C functions: without the enum wrapping, several times faster
import contextlib
import signal
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from .errors import FwdtraceError

__all__ = [
    "Patcher", "critical", "InterruptGuard", "add_call_handler", "remove_call_handler", "CallHandler",
    "call_dispatch_active", "add_function_handler", "FunctionHandler", "patched_functions",
    "add_eager_modules", "remove_eager_modules",
    "guarded_enter", "guarded_exit",
]

_MISSING = object()

# A handler gets ``(call, module, args, kwargs)`` and returns the call's result; ``call(module,
# *args, **kwargs)`` runs the rest of the chain (inner handlers, then the original _call_impl).
CallHandler = Callable[[Callable[..., Any], torch.nn.Module, tuple, dict], Any]
# A function handler gets ``(call, args, kwargs)``; ``call(*args, **kwargs)`` runs the rest of the chain.
FunctionHandler = Callable[[Callable[..., Any], tuple, dict], Any]


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
            elif not _MAIN_DEPTH[0] and _GUARDS and _GUARDS[-1]._until_critical_ends:
                _GUARDS[-1].raise_pending()  # a tool's guard: what waited for this section is handled now


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

    A tool that stays entered while the user's code runs (``with Probe(model):`` around a
    training loop) uses ``until_critical_ends=True``: a signal held in a critical section is
    handled as soon as the outermost section ends, not at the end of the block. Guards may
    be stopped in any order: one stopped under another is unlinked from the chain of handlers.
    """

    __slots__ = ("_protected", "_previous", "_handlers", "_on_signal", "_until_critical_ends", "pending")

    def __init__(self, protected: tuple[Any, ...], *, until_critical_ends: bool = False) -> None:
        self._protected = frozenset(protected)
        self._until_critical_ends = until_critical_ends
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
                    else:  # a guard started later routes to this one: it now routes to what this one did
                        for later in _GUARDS:
                            if later._previous.get(signum) is self._on_signal:
                                later._previous[signum] = later._handlers[signum] = previous[signum]
                    del previous[signum]
            except BaseException as e:
                if first is None:
                    first = e
        _handle(self.pending, self._handlers, first)


def guarded_enter(protected: tuple[Any, ...], setup: Callable[[], object], undo: Callable[[], object]) -> InterruptGuard:
    """Begin a tool's ``with`` block: a guard for its lifetime, then ``setup()`` whole or not at all.

    >>> from fwdtrace.patching import guarded_enter, guarded_exit
    >>> done = []
    >>> guard = guarded_enter((), lambda: done.append("on"), done.clear)
    >>> guarded_exit(guard, lambda: done.append("off")); done
    ['on', 'off']

    ``protected`` holds the code objects of the tool's ``__enter__`` and ``__exit__``: a Ctrl-C
    that lands on their first instruction waits (CPython runs signal handlers on entering any
    function, which would skip the clean-up). ``setup`` and ``undo`` run as critical sections;
    an exception (a Ctrl-C held back included) raised by ``setup`` runs ``undo``, stops the
    guard and is raised: the ``with`` statement runs no ``__exit__`` after a failed ``__enter__``.
    """
    guard = InterruptGuard(protected, until_critical_ends=True)
    try:
        guard.start()
    except BaseException:  # a handler not yet held ran and raised: put back the others
        guard.stop()
        raise
    try:
        with critical():
            setup()
    except BaseException:
        try:
            with critical():
                undo()
        finally:
            guard.stop()
        raise
    return guard


def guarded_exit(guard: InterruptGuard | None, cleanup: Callable[[], object]) -> None:
    """End a tool's ``with`` block begun with :func:`guarded_enter`: ``cleanup()`` whole, then the guard's signals."""
    try:
        with critical():
            cleanup()
    finally:
        if guard is not None:
            guard.stop()  # raises a Ctrl-C held back meanwhile


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


# -- patching one object ---------------------------------------------------------------------------
@dataclass
class _Patch:
    owner: Any
    name: str
    previous: Any  # what owner.__dict__ held, or _MISSING when the attribute was inherited
    value: Any = _MISSING  # what this patch set: restore leaves a value someone set since alone


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
    half of them done. An attribute someone else set after this patcher's patch is left
    as they set it (restoring ours would undo theirs); the dispatch points rely on that.
    """

    def __init__(self) -> None:
        self._patches: list[_Patch] = []

    def patch(self, owner: Any, name: str, value: Any) -> None:
        with critical():
            previous = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
            setattr(owner, name, value)
            self._patches.append(_Patch(owner, name, previous, value))

    def restore(self) -> None:
        """Undo every patch, newest first. Safe to call twice; one failing undo does not stop the others."""
        errors: list[BaseException] = []
        with critical():
            while self._patches:
                p = self._patches.pop()
                try:
                    if p.value is not _MISSING and getattr(p.owner, "__dict__", {}).get(p.name, _MISSING) is not p.value:
                        continue  # someone patched over us since: theirs stays
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


# -- dispatch points: nn.Module.__call__, and every hooked function attribute --------------------
# ``Module.__call__`` is ``_wrapped_call_impl``, which calls ``self._call_impl`` (hooks, then forward)
# unless the module was ``.compile()``d. Patching ``_call_impl`` sees the same calls, hooks included,
# for a fraction of the cost: setting a dunder such as ``__call__`` on a class makes CPython
# rewrite the call slot of every subclass (about 1 ms with transformers imported, per setattr).
PATCHED = "_call_impl"


@dataclass(eq=False)
class _Handle:
    handler: Callable[..., Any]
    thread: _ThreadHandlers | None  # None: every thread (install())
    dispatch: _Dispatch


class _ThreadHandlers:
    """One thread's handlers of one dispatch point, outermost first, and the chain built from them."""

    __slots__ = ("handlers", "version", "chain")

    def __init__(self) -> None:
        self.handlers: list[_Handle] = []
        self.version = -1  # the _Dispatch.version the chain was built for; -1: rebuild
        self.chain: Callable[..., Any] | None = None


class _Dispatch:
    """One patched attribute: the wrapper that stands in it while in use, the original, and who uses it.

    The wrapper is set with :class:`Patcher` when the first handler arrives and the original
    object put back when the last one leaves. ``call`` is what the wrapper runs for a thread
    with no handler: the original, unwrapped from its ``staticmethod``/``classmethod``.
    """

    def __init__(self, owner: Any, name: str, link: Callable[..., Callable[..., Any]]) -> None:
        self.owner = owner
        self.name = name
        self.link = link  # (handler, inner) -> one link of the chain
        self.wrapper: Callable[..., Any] | None = None  # the plain function the attribute's value runs
        self.call: Callable[..., Any] | None = None
        self.users = 0
        self.global_handlers: list[_Handle] = []
        self.version = 0  # bumped whenever the global handlers change
        self._local = threading.local()
        self._patcher = Patcher()

    def thread_handlers(self) -> _ThreadHandlers:
        try:
            return self._local.handlers
        except AttributeError:
            state = self._local.handlers = _ThreadHandlers()
            return state

    def chain(self) -> Callable[..., Any] | None:
        local = self.thread_handlers()
        if local.version != self.version:
            local.chain = _build_chain(self.global_handlers + local.handlers, self.call, self.link)
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
        current = vars(self.owner)[self.name]
        # A staticmethod or classmethod stays one, around the wrapper: bound by the same descriptor rules.
        kind = type(current) if isinstance(current, (staticmethod, classmethod)) else None
        self.call = current.__func__ if kind is not None else current
        assert self.wrapper is not None
        self.wrapper.__wrapped__ = self.call  # type: ignore[attr-defined]
        self._patcher.patch(self.owner, self.name, kind(self.wrapper) if kind is not None else self.wrapper)
        self.version += 1

    def _uninstall(self) -> None:
        # Puts back what was there, unless someone patched over us since: theirs stays (see Patcher.restore).
        self._patcher.restore()
        self.version += 1


def _build_chain(
    handles: list[_Handle], original: Callable[..., Any] | None, link: Callable[..., Callable[..., Any]]
) -> Callable[..., Any] | None:
    if not handles or original is None:
        return None
    call: Callable[..., Any] = original
    for handle in reversed(handles):
        call = link(handle.handler, call)
    return call


def _link_module_call(handler: CallHandler, inner: Callable[..., Any]) -> Callable[..., Any]:
    def link(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return handler(inner, module, args, kwargs)

    return link


def _link_function_call(handler: FunctionHandler, inner: Callable[..., Any]) -> Callable[..., Any]:
    def link(*args: Any, **kwargs: Any) -> Any:
        return handler(inner, args, kwargs)

    return link


_DISPATCH = _Dispatch(torch.nn.Module, PATCHED, _link_module_call)
_is_compiling = torch.compiler.is_compiling


# id() of a module a fwdtrace tool is attached to -> how many attachments: a ``torch.compile`` wrapper
# around it that fwdtrace was not shown (``torch.compile(model)`` after ``Probe(model)``) runs it eagerly.
_EAGER_MODULES: dict[int, int] = {}


def _dispatching_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module._call_impl`` while fwdtrace is in use: this thread's handlers, else the original."""
    if _is_compiling():  # dynamo tracing a compiled model: it must see the plain call
        return _DISPATCH.call(self, *args, **kwargs)  # type: ignore[misc]
    if _EAGER_MODULES and type(self).__name__ == "OptimizedModule":
        inner: Any = self._orig_mod
        if id(inner) in _EAGER_MODULES:
            return inner(*args, **kwargs)
    chain = _DISPATCH.chain()
    if chain is None:
        return _DISPATCH.call(self, *args, **kwargs)  # type: ignore[misc]
    return chain(self, *args, **kwargs)


_DISPATCH.wrapper = _dispatching_call


def _not_a_compiled_frame(code: Any) -> None:
    """Dynamo starts compiling at the first frame outside torch's own code that a compiled call
    meets: while patched, that would be a dispatch point's wrapper, a new cache entry (one more
    graph, then "recompile limit" warnings) for every model compiled under it. Marked as skipped
    (this frame only, not what it calls), dynamo starts where it does without fwdtrace."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # a torch without dynamo's frame evaluation
        return
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


_not_a_compiled_frame(_dispatching_call.__code__)
for _make_link in (_link_module_call, _link_function_call):  # the links of every chain they build
    for _code in _make_link.__code__.co_consts:
        if isinstance(_code, types.CodeType):
            _not_a_compiled_frame(_code)


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
    _skip_handler_frame(handler)
    handle = _Handle(handler, None if all_threads else _DISPATCH.thread_handlers(), _DISPATCH)
    _DISPATCH.add(handle)
    return handle


def _skip_handler_frame(handler: Callable[..., Any]) -> None:
    """A handler is a frame between the dispatch point and the module's forward: not one for dynamo to start at."""
    code = getattr(getattr(handler, "__func__", handler), "__code__", None)
    if code is not None:
        _not_a_compiled_frame(code)


def remove_call_handler(handle: _Handle) -> bool:
    """Remove a handler added with :func:`add_call_handler` or :func:`add_function_handler`; False when already gone."""
    return handle.dispatch.remove(handle)


def add_eager_modules(modules: list[torch.nn.Module]) -> None:
    """Run ``torch.compile`` wrappers around these modules eagerly (each call goes to the module) until
    :func:`remove_eager_modules`; the dispatch point stays installed meanwhile. Counted: add and remove in pairs."""
    with critical():
        if _DISPATCH.users == 0:
            _DISPATCH._install()
        _DISPATCH.users += 1
        for m in modules:
            _EAGER_MODULES[id(m)] = _EAGER_MODULES.get(id(m), 0) + 1


def remove_eager_modules(modules: list[torch.nn.Module]) -> None:
    """Undo one :func:`add_eager_modules` of the same modules."""
    with critical():
        for m in modules:
            left = _EAGER_MODULES.pop(id(m), 0) - 1
            if left > 0:
                _EAGER_MODULES[id(m)] = left
        _DISPATCH.users -= 1
        if _DISPATCH.users == 0:
            _DISPATCH._uninstall()


def call_dispatch_active() -> bool:
    """Whether fwdtrace's wrapper of ``nn.Module._call_impl`` is installed now."""
    return _DISPATCH.users > 0


# One dispatch point per patched function attribute, kept once made: (id(owner), name) -> it.
_ATTRIBUTE2DISPATCH: dict[tuple[int, str], _Dispatch] = {}


def _function_dispatch(owner: Any, name: str) -> _Dispatch:
    with critical():
        dispatch = _ATTRIBUTE2DISPATCH.get((id(owner), name))
        if dispatch is None:
            dispatch = _Dispatch(owner, name, _link_function_call)

            def dispatching(*args: Any, **kwargs: Any) -> Any:
                if _is_compiling():
                    return dispatch.call(*args, **kwargs)  # type: ignore[misc]
                chain = dispatch.chain()
                if chain is None:
                    return dispatch.call(*args, **kwargs)  # type: ignore[misc]
                return chain(*args, **kwargs)

            original = vars(owner)[name]
            original = getattr(original, "__func__", original)
            for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(dispatching, attr, getattr(original, attr))
            dispatch.wrapper = dispatching
            _not_a_compiled_frame(dispatching.__code__)
            _ATTRIBUTE2DISPATCH[(id(owner), name)] = dispatch
        return dispatch


def add_function_handler(owner: Any, name: str, handler: FunctionHandler, *, all_threads: bool = False) -> _Handle:
    """Send the calls of ``owner.name`` (a module's function, a class's method) through ``handler``.

    >>> import math
    >>> from fwdtrace.patching import add_function_handler, remove_call_handler
    >>> original = math.hypot
    >>> def twice(call, args, kwargs):
    ...     return 2 * call(*args, **kwargs)
    >>> handle = add_function_handler(math, "hypot", twice)
    >>> math.hypot(3, 4)
    10.0
    >>> remove_call_handler(handle), math.hypot is original
    (True, True)

    ``handler(call, args, kwargs)`` returns the call's result; ``call(*args, **kwargs)`` runs
    the rest of the chain. The attribute is replaced with ``setattr`` (one wrapper per
    attribute, shared by every user, deciding per thread as module calls do) while any
    handler is in, and the very same object put back when the last one leaves. A
    ``staticmethod`` or ``classmethod`` stays one; a method gets ``self`` as ``args[0]``.
    """
    if name not in getattr(owner, "__dict__", {}):
        raise FwdtraceError(f"add_function_handler() expected an attribute held in {owner!r}'s own namespace, got {name!r}")
    dispatch = _function_dispatch(owner, name)
    _skip_handler_frame(handler)
    handle = _Handle(handler, None if all_threads else dispatch.thread_handlers(), dispatch)
    dispatch.add(handle)
    return handle


def patched_functions() -> list[tuple[Any, str]]:
    """The function attributes fwdtrace's wrappers stand in now, as ``(owner, name)``."""
    return [(d.owner, d.name) for d in _ATTRIBUTE2DISPATCH.values() if d.users > 0]
