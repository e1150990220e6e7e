"""Compiled models: what ``torch.compile`` wrapped, and running it eagerly while a tool is attached.

Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): a
hook added after a compiled model's first call never runs, and one present when the model is
compiled is compiled in, broken up wherever it locks, writes a file or reads a clock, and that
broken-up code stays cached after the hook is gone. So while any fwdtrace tool is attached to a
model, every compiled part of it runs its eager module instead: an ``OptimizedModule``
(``torch.compile(module)``) calls its ``_orig_mod``, a ``module.compile()``'d module its plain
``_call_impl``, and a wrapper made around one of the model's modules that fwdtrace was not shown
(``torch.compile(model)`` after ``Probe(model)``) is sent to that module by fwdtrace's one dispatch
point (:func:`fwdtrace.patching.add_eager_modules`, installed while any route is held). The tools then see exactly the eager values,
nothing they do enters dynamo's cache, and when the last of them leaves, in any order, every
attribute is put back and the model runs the compiled code it had, without recompiling.

Keys see through the wrappers too: :func:`eager_module` and :func:`eager_path` are how
:func:`fwdtrace.instrument.keys.key2module` names ``torch.compile(model)``'s layers ``0.Linear``, not
``_orig_mod.0.Linear``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..errors import FwdtraceError
from ..patching import Patcher, add_eager_modules, critical, remove_eager_modules

__all__ = [
    "CALL_KINDS", "is_compile_wrapper", "compiled_in_place", "eager_module", "eager_path", "compiled_parts", "EagerRoute",
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


@dataclass
class _Routed:
    """One compiled module running eagerly: the patch that does it, and how many attachments want it."""

    patcher: Patcher
    users: int = 0


_ROUTED: dict[int, _Routed] = {}  # id() of a compiled module -> its eager route


@dataclass
class EagerRoute:
    """One tool's attachment to a model: while it is held, the model's compiled parts run eagerly.

    >>> import torch
    >>> from fwdtrace.instrument.compiled import EagerRoute
    >>> compiled = torch.compile(torch.nn.Linear(2, 2))
    >>> with EagerRoute(compiled, "Probe"):
    ...     compiled.forward == compiled._orig_mod.__call__
    True

    Counted per compiled module: the last attachment to leave (in any order, exceptions and
    Ctrl-C included: each step is a :class:`~fwdtrace.patching.critical` section) puts back
    the very objects that were there. :meth:`release` twice is harmless. A model whose
    ``forward`` attribute is itself a compiled function (``model.forward = torch.compile(...)``)
    has no eager module fwdtrace could run: ``caller`` raises :class:`FwdtraceError`.
    """

    model: torch.nn.Module
    caller: str
    _modules: list[torch.nn.Module] = field(default_factory=list)
    _compiled: list[torch.nn.Module] = field(default_factory=list)
    held: bool = False

    def __post_init__(self) -> None:
        self.acquire()

    def acquire(self) -> EagerRoute:
        if self.held:
            return self
        walked = list(_walk(self.model))
        for path, module in walked:
            if _compiled_forward(module) and not is_compile_wrapper(module):
                raise FwdtraceError(
                    f"{self.caller} cannot reach into module {path or '<root>'!r} ({type(module).__name__}): its "
                    "forward is a torch.compile'd function, which fwdtrace cannot run eagerly; compile the module "
                    "instead (torch.compile(module) or module.compile()), whose layers fwdtrace runs eagerly while attached"
                )
        wrapped = {id(m._orig_mod) for _, m in walked if is_compile_wrapper(m)}
        with critical():
            self._compiled = [  # what another attachment routes already is compiled too
                m for _, m in walked
                if id(m) in _ROUTED or is_compile_wrapper(m) or getattr(m, "_compiled_call_impl", None) is not None
            ]
            for module in self._compiled:
                routed = _ROUTED.get(id(module))
                if routed is None:
                    routed = _ROUTED[id(module)] = _Routed(Patcher())
                    if is_compile_wrapper(module):  # its hooks still run, around the eager module
                        routed.patcher.patch(module, "forward", cast("torch.nn.Module", module._orig_mod).__call__)
                    else:
                        routed.patcher.patch(module, "_compiled_call_impl", None)
                routed.users += 1
            # A wrapper made later, where fwdtrace cannot see it (torch.compile(model) after Probe(model)), is
            # sent to its module by the dispatch point: installed for as long as this route is held.
            self._modules = [m for _, m in walked if not is_compile_wrapper(m) and id(m) not in wrapped]
            add_eager_modules(self._modules)
            self.held = True
        return self

    def release(self) -> None:
        with critical():
            if not self.held:
                return
            self.held = False
            remove_eager_modules(self._modules)
            errors = []
            for module in reversed(self._compiled):
                routed = _ROUTED[id(module)]
                routed.users -= 1
                if routed.users == 0:
                    del _ROUTED[id(module)]
                    try:
                        routed.patcher.restore()
                    except Exception as e:  # put back the others all the same
                        errors.append(e)
            self._compiled, self._modules = [], []
        if errors:
            raise errors[0]

    remove = release  # as a torch hook handle, among a tool's hook handles

    def __enter__(self) -> EagerRoute:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

