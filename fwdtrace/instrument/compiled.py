"""Compiled models: what ``torch.compile`` wrapped, and how it runs while a tool is attached.

Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): a
hook added after a compiled model's first call never runs, and one present when the model is
compiled is compiled in, broken up wherever it locks, writes a file or reads a clock, and that
broken-up code stays cached after the hook is gone. So a tool never lets a part's own compiled graphs
see its hooks; while it is attached, the compiled parts run one of two routes.

Hooks that dynamo traces without a break (:mod:`fwdtrace.instrument.ingraph`: forward statistics and
copies) take the :class:`GraphRoute`: a ``torch.compile`` wrapper, or a module compiled in place, runs a
compiled copy of its module made with those hooks in place and its own backend and options (found in
dynamo's context), once per armed set for as long as the module lives.

Every other hook takes the :class:`EagerRoute`: every compiled part runs its eager module instead. An
``OptimizedModule`` (``torch.compile(module)``) calls its ``_orig_mod``, a ``module.compile()``'d module
its plain ``_call_impl``, and a wrapper made around one of the model's modules that fwdtrace was not
shown (``torch.compile(model)`` after ``Probe(model)``) is sent to that module by fwdtrace's one
dispatch point (:func:`fwdtrace.patching.add_eager_modules`, installed while any route is held). The
tools then see exactly the eager values and nothing they do enters dynamo's cache.

Either way, when the last tool leaves, in any order, every attribute is put back and the model runs
the compiled code it had, without recompiling.

Keys see through the wrappers too: :func:`eager_module` and :func:`eager_path` are how
:func:`fwdtrace.instrument.keys.key2module` names ``torch.compile(model)``'s layers ``0.Linear``, not
``_orig_mod.0.Linear``.
"""

from __future__ import annotations

import copy
import re
import sys
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..errors import FwdtraceError, FwdtraceWarning
from ..patching import Patcher, add_eager_modules, critical, remove_eager_modules
from .ingraph import drain, received, slot_key

__all__ = [
    "CALL_KINDS", "is_compile_wrapper", "compiled_in_place", "eager_module", "eager_path", "compiled_parts", "EagerRoute",
    "GraphRoute", "graph_routable", "inside_compiled_parts",
]

# What the tools sample through module hooks, which dynamo's compiled code skips: these need the eager route.
# Parameter kinds (``weight``, ``weight_grad``, ``health``) hook the parameters' gradient accumulation, which
# autograd runs outside compiled graphs: they sample a compiled model as it runs, compiled.
CALL_KINDS = ("forward", "grad")

_ORIG_MOD = re.compile(r"(?:^|\.)_orig_mod(?=\.|$)")


def is_compile_wrapper(module: Any) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (dynamo's ``OptimizedModule``)."""
    cls = type(module)
    return cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")


def eager_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` wrapper wraps (through any number of them); any other module itself."""
    while is_compile_wrapper(module):
        module = cast("torch.nn.Module", module._orig_mod)
    return module


def eager_path(name: str) -> str:
    """A module path or key without the ``_orig_mod`` steps ``torch.compile`` wrappers add to ``named_modules()``.

    >>> eager_path("_orig_mod.0.Linear"), eager_path("block._orig_mod.l1"), eager_path("_orig_mod")
    ('0.Linear', 'block.l1', '')
    """
    return _ORIG_MOD.sub("", name).lstrip(".") if "_orig_mod" in name else name


def _compiled_forward(module: torch.nn.Module) -> bool:
    forward = vars(module).get("forward")
    return forward is not None and hasattr(forward, "_torchdynamo_orig_callable")


def _walk(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Every module under ``model``, wrappers included, once each, with its eager path."""
    seen: set[int] = set()
    todo = [("", model)]
    while todo:
        path, module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield path, module
        for name, child in reversed(list(module._modules.items())):
            if child is not None:
                step = path if name == "_orig_mod" and is_compile_wrapper(module) else f"{path}.{name}" if path else name
                todo.append((step, child))


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` compiled ``module`` itself (its own hooks then run inside compiled code)."""
    return (id(module) in _ROUTED and not is_compile_wrapper(module)) or getattr(module, "_compiled_call_impl", None) is not None


def compiled_parts(model: torch.nn.Module) -> list[tuple[str, str]]:
    """The compiled parts of ``model``: ``(eager module path, how)``, how being ``"torch.compile"``
    (a wrapper) or ``"module.compile"`` (compiled in place). Empty for an eager model."""
    out = []
    for path, module in _walk(model):
        if is_compile_wrapper(module):
            out.append((path, "torch.compile"))
        elif compiled_in_place(module):
            out.append((path, "module.compile"))  # (set aside while a tool is attached)
    return out


def inside_compiled_parts(model: torch.nn.Module) -> set[int]:
    """``id()`` of every module whose hooks run inside a compiled part of ``model`` (a wrapper's eager module
    and everything below it, a module compiled in place and everything below it); a wrapper itself is not."""
    inside: set[int] = set()
    for _, module in _walk(model):
        if is_compile_wrapper(module) or compiled_in_place(module):
            inside.update(id(m) for m in eager_module(module).modules())
    return inside


@dataclass
class _Routed:
    """One compiled module while tools are attached: the patch that routes its calls, how many attachments
    want it eager, and (a ``torch.compile`` wrapper only) the in-graph statistics slots armed under it, with
    a compiled copy of its module per armed set."""

    patcher: Patcher
    users: int = 0
    slots: dict[int, int] = field(default_factory=dict)  # slot id -> how many GraphRoutes hold it
    graphs: dict[frozenset[int], Any] = field(default_factory=dict)  # armed slot ids -> compiled call
    context: Any = None  # dynamo's context that compiled the module (its backend and options), if known
    missing: set[int] = field(default_factory=set)  # armed slots a routed call ran without handing a value to
    eager_why: str | None = None  # why the in-graph hooks run eagerly (a graph break, a failed compile), if they do

    def idle(self) -> bool:
        return self.users == 0 and not self.slots


_ROUTED: dict[int, _Routed] = {}  # id() of a compiled module -> its route


def _checked_walk(model: torch.nn.Module, caller: str) -> list[tuple[str, torch.nn.Module]]:
    walked = list(_walk(model))
    for path, module in walked:
        if _compiled_forward(module) and not is_compile_wrapper(module):
            raise FwdtraceError(
                f"{caller} cannot reach into module {path or '<root>'!r} ({type(module).__name__}): its "
                "forward is a torch.compile'd function, which fwdtrace cannot run eagerly; compile the module "
                "instead (torch.compile(module) or module.compile()), whose layers fwdtrace runs eagerly while attached"
            )
    return walked


def _unseen_wrapper_targets(walked: list[tuple[str, torch.nn.Module]]) -> list[torch.nn.Module]:
    """The modules a ``torch.compile`` wrapper made later, where fwdtrace cannot see it (``torch.compile(model)``
    after ``Probe(model)``), must be sent to by the dispatch point while a route is held: every module not
    already behind a wrapper fwdtrace routes."""
    wrapped = {id(m._orig_mod) for _, m in walked if is_compile_wrapper(m)}
    return [m for _, m in walked if not is_compile_wrapper(m) and id(m) not in wrapped]


def _dynamo_context(module: torch.nn.Module) -> Any:
    """What compiled ``module`` (dynamo's context: its backend and options), or None where it cannot be found."""
    if is_compile_wrapper(module):
        return module.dynamo_ctx
    compiled = getattr(module, "_compiled_call_impl", None)  # torch.compile(self._call_impl): the context is in its closure
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if type(value).__name__ == "OptimizeContext" and type(value).__module__.startswith("torch._dynamo"):
            return value
    return None


def _compile_again(context: Any, inner: Any) -> Any:
    """``inner`` compiled anew, with ``context``'s backend and options, in a cache of its own, whole: a graph
    break raises (dynamo's ``Unsupported``) before anything runs, instead of splitting the call into frames."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    # Dynamo keeps compiled code per code object and does not guard on module hooks: a copy of this code
    # object per armed set is compiled with exactly that set's hooks, and never reuses the module's own graphs.
    # Whole, because the frames a graph break leaves (the rest of a forward, a submodule's forward) are the
    # model's own code objects, whose compiled code dynamo already holds without the hooks: hooks there never run.
    call.__code__ = call.__code__.replace()
    whole = copy.copy(context)
    if not getattr(whole, "fullgraph", False):
        whole.error_on_graph_break = True
    return whole(call)


def _break_reason(error: Exception) -> str | None:
    """The first line of why dynamo broke the graph, when ``error`` is a graph break a whole compile refused."""
    dynamo_exc = sys.modules.get("torch._dynamo.exc")
    if dynamo_exc is None or not isinstance(error, dynamo_exc.Unsupported):
        return None
    return (str(error).strip().splitlines() or ["a graph break"])[0]


# Compiled modules whose code breaks its graph: their in-graph hooks run eagerly, without trying to compile
# again, for as long as the module lives (a graph break is the model's own code, whatever the hooks).
_BREAKS: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_WARNED: weakref.WeakKeyDictionary[torch.nn.Module, set[str]] = weakref.WeakKeyDictionary()  # what was said, once


def _say_once(module: torch.nn.Module, keys: list[str], text: str, stacklevel: int = 3) -> None:
    said = _WARNED.setdefault(module, set())
    if text not in said:
        said.add(text)
        warnings.warn(text, FwdtraceWarning, stacklevel=stacklevel)


def _keys_of(slot_ids: Any) -> list[str]:
    return sorted({slot_key(s) for s in slot_ids})


def _routing_call(module: torch.nn.Module, routed: _Routed) -> Any:
    """What a compiled module's calls go to while routed: its eager module (or plain ``_call_impl``) while
    an eager route is held, else a compiled copy made with the in-graph hooks armed under it."""
    if is_compile_wrapper(module):
        inner = cast("torch.nn.Module", module._orig_mod).__call__
    else:

        def inner(*args: Any, **kwargs: Any) -> Any:  # looked up at each call: fwdtrace's dispatch point patches it
            return module._call_impl(*args, **kwargs)

    context = routed.context
    name = type(eager_module(module)).__name__

    def forward(*args: Any, **kwargs: Any) -> Any:
        if routed.users or not routed.slots:  # a tool that needs the eager route is attached
            return inner(*args, **kwargs)
        armed = frozenset(routed.slots)
        call = routed.graphs.get(armed)
        if call is None:
            broken = _BREAKS.get(module)
            if broken is not None:
                call = routed.graphs[armed] = _Eager(f"{name} breaks its graph: {broken}")
                _say_once(module, _keys_of(armed), _eager_text(name, _keys_of(armed), broken))
            else:
                call = routed.graphs[armed] = _compile_again(context, inner)
        before = received(armed)
        try:
            if isinstance(call, _Eager):
                routed.eager_why = call.why
                return inner(*args, **kwargs)
            try:
                return call(*args, **kwargs)
            except Exception as e:
                # Training is never broken by a tool: what dynamo or the backend could not compile with the
                # hooks runs eagerly while they are attached (an error of the model's own is raised there again).
                if not _from_dynamo(e):
                    raise
                reason = _break_reason(e)
                if reason is not None:  # the model's own graph break: its hooks would miss every call past it
                    _BREAKS[module] = reason
                    routed.eager_why = f"{name} breaks its graph: {reason}"
                    _say_once(module, _keys_of(armed), _eager_text(name, _keys_of(armed), reason), stacklevel=2)
                else:
                    first_line = (str(e).strip().splitlines() or [""])[0]
                    routed.eager_why = f"compiling {name} with the hooks failed: {type(e).__name__}"
                    warnings.warn(
                        f"fwdtrace: compiling {name} with the hooks of the tools attached "
                        f"failed ({type(e).__name__}: {first_line}); it runs eagerly while they are attached",
                        RuntimeWarning, stacklevel=2,
                    )
                routed.graphs[armed] = _Eager(routed.eager_why)
                return inner(*args, **kwargs)
        finally:
            drain()
            after = received(armed)
            missing = [s for s in armed if after[s] == before[s]]
            if missing:
                routed.missing.update(missing)
                keys = _keys_of(missing)
                _say_once(module, keys, f"fwdtrace: no value for {', '.join(keys)} in a call of compiled {name}: "
                          "not called in it, or not reached by its compiled code", stacklevel=2)

    return forward


@dataclass(frozen=True)
class _Eager:
    """In place of a compiled copy: the armed set runs its module eagerly, for this reason."""

    why: str


def _eager_text(name: str, keys: list[str], reason: str) -> str:
    return (f"fwdtrace: {name} runs eagerly while the hooks on {', '.join(keys)} are attached: its compiled code breaks "
            f"the graph "
            f"({reason}), and the frames after a break run code compiled without the tools' hooks")


def _from_dynamo(error: Exception) -> bool:
    dynamo_exc = sys.modules.get("torch._dynamo.exc")
    return dynamo_exc is not None and isinstance(error, dynamo_exc.TorchDynamoException)


# The compiled copies each compiled module ran with in-graph hooks, per armed set of slots, for as long as the
# module lives: the same hooks armed again (they take the same slot ids) run their copy again, uncompiled.
_COPIES: weakref.WeakKeyDictionary[torch.nn.Module, dict[frozenset[int], Any]] = weakref.WeakKeyDictionary()
_COPIES_KEPT = 32  # armed sets kept per compiled module, the oldest dropped first


def _routed(module: torch.nn.Module) -> _Routed:
    routed = _ROUTED.get(id(module))
    if routed is None:
        routed = _ROUTED[id(module)] = _Routed(Patcher(), context=_dynamo_context(module),
                                               graphs=_COPIES.setdefault(module, {}))
        if is_compile_wrapper(module):  # its own hooks still run, around the routed call
            routed.patcher.patch(module, "forward", _routing_call(module, routed))
        elif routed.context is not None:  # compiled in place: nn.Module.__call__ calls this instead
            routed.patcher.patch(module, "_compiled_call_impl", _routing_call(module, routed))
        else:
            routed.patcher.patch(module, "_compiled_call_impl", None)
    return routed


def _put_back_if_idle(module: torch.nn.Module, routed: _Routed, errors: list[Exception]) -> None:
    if routed.idle():
        del _ROUTED[id(module)]
        try:
            routed.patcher.restore()
        except Exception as e:  # put back the others all the same
            errors.append(e)


class _Route:
    """What :class:`EagerRoute` and :class:`GraphRoute` share: held from construction until :meth:`release`
    (twice is harmless), each step a :class:`~fwdtrace.patching.critical` section; a wrapper made later around
    the model's modules is sent to them meanwhile. Subclasses say what they take and give back per route."""

    def __init__(self, model: torch.nn.Module, caller: str) -> None:
        self.model, self.caller = model, caller
        self.held = False
        self._modules: list[torch.nn.Module] = []
        self.acquire()

    def _take(self, walked: list[tuple[str, torch.nn.Module]]) -> None:
        raise NotImplementedError

    def _give_back(self, errors: list[Exception]) -> None:
        raise NotImplementedError

    def acquire(self) -> _Route:
        if self.held:
            return self
        walked = _checked_walk(self.model, self.caller)
        with critical():
            self._take(walked)
            self._modules = _unseen_wrapper_targets(walked)
            add_eager_modules(self._modules)
            self.held = True
        return self

    def release(self) -> None:
        with critical():
            if not self.held:
                return
            self.held = False
            remove_eager_modules(self._modules)
            self._modules = []
            errors: list[Exception] = []
            self._give_back(errors)
        if errors:
            raise errors[0]

    remove = release  # as a torch hook handle, among a tool's hook handles

    def __enter__(self) -> _Route:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class EagerRoute(_Route):
    """One tool's attachment to a model: while it is held, the model's compiled parts run eagerly.

    >>> import torch
    >>> from fwdtrace.instrument.compiled import EagerRoute
    >>> compiled = torch.compile(torch.nn.Linear(2, 2))
    >>> before = compiled.forward
    >>> with EagerRoute(compiled, "Probe"):
    ...     compiled.forward is before
    False
    >>> compiled.forward is before
    True

    Counted per compiled module: the last attachment to leave (in any order, exceptions and
    Ctrl-C included: each step is a :class:`~fwdtrace.patching.critical` section) puts back
    the very objects that were there. :meth:`release` twice is harmless. A model whose
    ``forward`` attribute is itself a compiled function (``model.forward = torch.compile(...)``)
    has no eager module fwdtrace could run: ``caller`` raises :class:`FwdtraceError`.
    """


    def _take(self, walked: list[tuple[str, torch.nn.Module]]) -> None:
        self._compiled = [  # what another attachment routes already is compiled too
            m for _, m in walked
            if id(m) in _ROUTED or is_compile_wrapper(m) or getattr(m, "_compiled_call_impl", None) is not None
        ]
        for module in self._compiled:
            _routed(module).users += 1

    def _give_back(self, errors: list[Exception]) -> None:
        for module in reversed(self._compiled):
            routed = _ROUTED[id(module)]
            routed.users -= 1
            _put_back_if_idle(module, routed, errors)
        self._compiled = []


def _compiled_context(module: torch.nn.Module) -> Any:
    routed = _ROUTED.get(id(module))
    return routed.context if routed is not None else _dynamo_context(module)


def graph_routable(model: torch.nn.Module) -> bool:
    """Whether in-graph hooks (:mod:`fwdtrace.instrument.ingraph`) can sample ``model`` as it runs compiled:
    it has compiled parts, and fwdtrace knows how each was compiled (a ``torch.compile`` wrapper, or a module
    compiled in place whose compiled call holds dynamo's context), so that it can compile a copy alike."""
    compiled = [m for _, m in _walk(model) if is_compile_wrapper(m) or compiled_in_place(m)]
    return bool(compiled) and all(_compiled_context(m) is not None for m in compiled)


class GraphRoute(_Route):
    """One tool's in-graph hooks on a model: while held, each compiled part with any of them below it (a
    ``torch.compile`` wrapper, a module compiled in place) runs a compiled copy of its module made with those
    hooks in place, with the part's backend and options.

    The copy is compiled once per armed set of slots for as long as the part lives (arming a key set for the
    first time costs one compilation; the same hooks armed again take the same slot ids, see
    :class:`~fwdtrace.instrument.ingraph.Slot`'s ``reuse``, and run the copy made then; the part's own graphs
    are set aside, not changed, so disarming costs none). A part whose code breaks its graph runs eagerly
    instead (said once). While an :class:`EagerRoute` is also held on a part, the part runs eagerly and the
    hooks run there. ``modules`` pairs each in-graph slot id with the module whose hook feeds it.
    """

    def __init__(self, model: torch.nn.Module, caller: str, modules: list[tuple[int, torch.nn.Module]]) -> None:
        self.modules = modules
        self._armed: list[tuple[torch.nn.Module, list[int]]] = []
        super().__init__(model, caller)

    def _take(self, walked: list[tuple[str, torch.nn.Module]]) -> None:
        for _, wrapper in walked:
            if not (is_compile_wrapper(wrapper) or compiled_in_place(wrapper)):
                continue
            inside = {id(m) for m in eager_module(wrapper).modules()}
            slot_ids = [slot_id for slot_id, module in self.modules if id(module) in inside]
            if slot_ids:
                routed = _routed(wrapper)
                for slot_id in slot_ids:
                    routed.slots[slot_id] = routed.slots.get(slot_id, 0) + 1
                self._armed.append((wrapper, slot_ids))

    def eager_why(self) -> list[str]:
        """Why the compiled parts these hooks are in run eagerly instead (a graph break, a compile that failed):
        empty while every such part runs its compiled copy, or has not been called yet."""
        why = []
        for wrapper, _ in self._armed:
            routed = _ROUTED.get(id(wrapper))
            found = routed.eager_why if routed is not None else None
            if found is None and routed is not None and routed.users:
                found = f"{type(eager_module(wrapper)).__name__} runs eagerly for a tool that needs it"
            if found is None and wrapper in _BREAKS:
                found = f"{type(eager_module(wrapper)).__name__} breaks its graph: {_BREAKS[wrapper]}"
            if found is not None:
                why.append(found)
        return why

    def missing(self) -> list[str]:
        """The keys of these hooks' slots that a call of their compiled part ran without a value for."""
        gone: set[int] = set()
        for wrapper, slot_ids in self._armed:
            routed = _ROUTED.get(id(wrapper))
            if routed is not None:
                gone.update(s for s in slot_ids if s in routed.missing)
        return _keys_of(gone)

    def _give_back(self, errors: list[Exception]) -> None:
        for wrapper, slot_ids in reversed(self._armed):
            routed = _ROUTED[id(wrapper)]
            for slot_id in slot_ids:
                routed.slots[slot_id] -= 1
                if routed.slots[slot_id] == 0:
                    del routed.slots[slot_id]
                    while len(routed.graphs) > _COPIES_KEPT:  # the copies compiled with it stay, for it armed again
                        del routed.graphs[next(iter(routed.graphs))]
            _put_back_if_idle(wrapper, routed, errors)
        self._armed = []
