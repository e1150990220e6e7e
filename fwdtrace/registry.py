"""The decorator registry: which layer classes become nodes, and which callbacks run after them.

``@hook_forward("torch.nn.Conv2d.forward")`` registers a callback; every leaf layer class
of ``torch.nn`` is atomic (one node per call) with no user code. Nothing is patched
here: traces and :func:`fwdtrace.install` read the registry at each module call, from
fwdtrace's one dispatch point of ``nn.Module.__call__`` (:mod:`fwdtrace.patching`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from .errors import FwdtraceError, describe

__all__ = ["hook_forward", "register_atomic", "remove_hook", "clear_hooks", "REGISTRY", "qualified_name"]

Callback = Callable[[torch.nn.Module, tuple[Any, ...], Any], Any]
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# torch.nn classes that hold other layers: their insides are what people want to see.
_NOT_LEAF = {
    "Module", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Container",
    "Transformer", "TransformerEncoder", "TransformerDecoder", "TransformerEncoderLayer",
    "TransformerDecoderLayer", "DataParallel",
}


def has_forward(cls: type) -> bool:
    """Whether ``cls`` defines or inherits a ``forward`` other than ``torch.nn.Module``'s placeholder."""
    return any("forward" in k.__dict__ for k in cls.__mro__ if k is not torch.nn.Module)


def default_atomic_classes() -> list[type[torch.nn.Module]]:
    """Every leaf layer class that ``torch.nn`` exports (Conv*, Linear, norms, activations, RNNs, ...)."""
    out = []
    for name in sorted(dir(torch.nn)):
        obj = getattr(torch.nn, name)
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and name not in _NOT_LEAF:
            if has_forward(obj):
                out.append(obj)  # abstract bases such as RNNBase have no forward to run
    return out


def qualified_name(cls: type) -> str:
    """``torch.nn.Conv2d`` for torch's own layers, ``module.QualName`` otherwise."""
    if getattr(torch.nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def forward_owner(cls: type) -> type[torch.nn.Module]:
    """The class in ``cls``'s MRO whose ``__dict__`` holds the ``forward`` that ``cls`` runs."""
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            if klass is torch.nn.Module:
                break
            return cast("type[torch.nn.Module]", klass)
    raise FwdtraceError(f"{qualified_name(cls)} has no forward() of its own or inherited to hook")


@dataclass
class Registry:
    """Callbacks by class, in registration order, and the set of atomic classes."""

    callbacks: list[tuple[type, Callback]] = field(default_factory=list)
    atomic: set[type] = field(default_factory=lambda: set(default_atomic_classes()))
    version: int = 0  # bumped on every change

    def add_callback(self, cls: type, fn: Callback) -> None:
        # Re-running a notebook cell makes a new function with the same name: replace it.
        self.callbacks = [
            (c, f) for c, f in self.callbacks if not (c is cls and _same_function(f, fn))
        ] + [(cls, fn)]
        self.version += 1

    def add_atomic(self, cls: type) -> None:
        self.atomic.add(cls)
        self.version += 1

    def remove(self, fn: Callback) -> int:
        before = len(self.callbacks)
        self.callbacks = [(c, f) for c, f in self.callbacks if f is not fn]
        self.version += 1
        return before - len(self.callbacks)

    def callbacks_for(self, module_type: type) -> list[Callback]:
        return [f for c, f in self.callbacks if issubclass(module_type, c)]

    def is_atomic(self, module_type: type) -> bool:
        return any(issubclass(module_type, c) for c in self.atomic)


REGISTRY = Registry()


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def resolve_target(target: Any, caller: str = "hook_forward()") -> type[torch.nn.Module]:
    """The layer class that ``target`` names: a class, ``"pkg.Class"`` or ``"pkg.Class.forward"``."""
    if isinstance(target, str):
        obj, owner = _resolve_dotted(target)
    elif inspect.isfunction(target) and target.__qualname__.endswith(".forward"):
        cls_path = f"{target.__module__}.{target.__qualname__.rsplit('.', 1)[0]}"
        try:
            obj, owner = target, _resolve_dotted(cls_path)[0]
        except FwdtraceError:  # a class defined inside a function: say what to pass instead
            raise FwdtraceError(
                f"{caller} could not find the class of {target.__qualname__} by its path "
                f"{cls_path!r}; pass the class itself"
            ) from None
    else:
        obj, owner = target, None
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        return obj
    if (
        callable(obj)
        and getattr(obj, "__name__", None) == "forward"
        and isinstance(owner, type)
        and issubclass(owner, torch.nn.Module)
    ):
        return owner
    raise FwdtraceError(
        f"{caller} expected a torch.nn.Module subclass or its forward method "
        f"(a class, 'torch.nn.Conv2d' or 'torch.nn.Conv2d.forward'), got {target!r} ({describe(obj)})"
    )


def _resolve_dotted(path: str) -> tuple[Any, Any]:
    """Import the longest importable prefix of ``path``, then getattr the rest (never eval)."""
    parts = path.split(".")
    if not path or not all(p.isidentifier() for p in parts):
        raise FwdtraceError(f"expected a dotted path such as 'torch.nn.Conv2d.forward', got {path!r}")
    obj: Any = None
    i = len(parts)
    while i > 0:
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
            break
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise FwdtraceError(f"{name}: importing it failed: {e}") from e
            i -= 1
    if obj is None:
        raise FwdtraceError(f"{parts[0]}: No module named '{parts[0]}'")
    owner = None
    for j in range(i, len(parts)):
        owner = obj
        try:
            obj = getattr(obj, parts[j])
        except AttributeError as e:
            raise FwdtraceError(f"{'.'.join(parts[: j + 1])}: {e}") from None
    return obj, owner


def hook_forward(target: Any, *, atomic: bool = False) -> Callable[[F], F]:
    """Run the decorated ``fn(module, inputs, output)`` after every call of a layer class.

    >>> import torch, fwdtrace
    >>> @fwdtrace.hook_forward("torch.nn.ReLU.forward")
    ... def show(module, inputs, output):
    ...     print(type(module).__name__, fwdtrace.obj_id(inputs[0]), "->", fwdtrace.obj_id(output))
    >>> _ = fwdtrace.trace(torch.nn.Sequential(torch.nn.ReLU()), torch.ones(1))
    ReLU 0 -> 1
    >>> fwdtrace.remove_hook(show)
    1

    ``target`` is a class, or a dotted path to it or to its ``forward`` (resolved with
    importlib and getattr); subclasses are included. The callback runs once per
    ``module(...)`` call, after the layer's forward and its own torch hooks, on what the
    call returned (a subclass's whole ``forward``, ``super().forward()`` included); a
    non-None return value replaces the output. Like torch's forward hooks, a direct
    ``module.forward(...)`` call is not seen. With ``atomic=True`` the class also becomes
    one node per call in traced graphs (a user's own layer). The function is returned
    unchanged. Callbacks run in the thread of an active trace, or in every thread after
    :func:`fwdtrace.install`.
    """
    cls = resolve_target(target)

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise FwdtraceError(f"@hook_forward({target!r}) expected a function, got {describe(fn)}")
        REGISTRY.add_callback(cls, fn)
        if atomic:
            REGISTRY.add_atomic(cls)
        return fn

    return decorate


def register_atomic(target: T) -> T:
    """Make a layer class one node per call in traced graphs; usable as a class decorator.

    >>> import torch, fwdtrace
    >>> @fwdtrace.register_atomic
    ... class Block(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * 2 + 1
    >>> [n.kind for n in fwdtrace.trace(Block(), torch.ones(1)).nodes]
    ['input', 'module', 'output']
    """
    REGISTRY.add_atomic(resolve_target(target, "register_atomic()"))
    return target


def remove_hook(fn: Callable[..., Any]) -> int:
    """Unregister a callback added with :func:`hook_forward`; returns how many entries went."""
    return REGISTRY.remove(fn)


def clear_hooks() -> None:
    """Unregister every callback (atomic classes stay)."""
    REGISTRY.callbacks = []
    REGISTRY.version += 1
