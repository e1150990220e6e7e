"""The decorator registry: which layer classes and functions become nodes, and which callbacks run after them.

``@hook_forward("torch.nn.Conv2d.forward")`` registers a callback; every leaf layer class
of ``torch.nn`` is atomic (one node per call) with no user code. Nothing is patched
here: traces and :func:`fwdtrace.install` read the registry at each module call, from
fwdtrace's one dispatch point of ``nn.Module.__call__`` (:mod:`fwdtrace.patching`).

A target that is a plain function or a method (``"transformers.models.llama.modeling_llama.
apply_rotary_pos_emb"``, ``"pkg.Class.method"``) is a :class:`FunctionTarget`: the attribute
that holds it, which traces, probes and ``install()`` patch while they need it (one
dispatch point per attribute, :func:`fwdtrace.patching.add_function_handler`). Where
patching the attribute cannot reach every call, registering says so once, with the reason.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from .errors import FwdtraceError, check_callback, describe

__all__ = [
    "hook_forward", "register_atomic", "remove_hook", "clear_hooks", "REGISTRY", "qualified_name", "FunctionTarget",
]

Callback = Callable[[torch.nn.Module, tuple[Any, ...], Any], Any]
FunctionCallback = Callable[[tuple[Any, ...], dict[str, Any], Any], Any]  # (inputs, kwargs, output)
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
    """Every leaf layer class that ``torch.nn`` exports (Conv*, Linear, norms, activations, RNNs, ...),
    and the layers ``quantize_dynamic`` puts in their place (``torch.ao.nn.quantized.dynamic``)."""
    out = []
    for name in sorted(dir(torch.nn)):
        obj = getattr(torch.nn, name)
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and name not in _NOT_LEAF:
            if has_forward(obj):
                out.append(obj)  # abstract bases such as RNNBase have no forward to run
    # A dynamically quantized Linear or LSTM is still that layer: one node, not the packed kernel
    # (quantized.linear_dynamic) it calls. `import torch` imports this package already.
    dynamic = torch.ao.nn.quantized.dynamic
    for name in sorted(dir(dynamic)):
        obj = getattr(dynamic, name)
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and has_forward(obj):
            out.append(obj)
    return out


# Functions every trace records as one call, once their module is imported (never imported here):
# each takes a route that depends on the values in eager mode and another when exported, for one
# result. torchvision's batched_nms loops over the classes present (over 1000 boxes on CPU) and
# offsets each class's boxes apart when exported: traced through, the trace holds the loop, which
# no export has, and its length is the example's number of classes.
BATCHED_NMS = "torchvision.ops.boxes.batched_nms"
WHOLE_FUNCTIONS = (BATCHED_NMS,)
_WHOLE_TARGETS: dict[str, FunctionTarget] = {}  # kept, so their holders are looked for once per new import


def whole_functions() -> tuple[FunctionTarget, ...]:
    """The :data:`WHOLE_FUNCTIONS` whose module is imported, each as an atomic target patched everywhere."""
    out = []
    for path in WHOLE_FUNCTIONS:
        module, _, name = path.rpartition(".")
        owner = sys.modules.get(module)
        if owner is None or not callable(vars(owner).get(name)):
            continue
        target = _WHOLE_TARGETS.get(path)
        if target is None or target.owner is not owner:
            target = _WHOLE_TARGETS[path] = FunctionTarget(path, owner, name, atomic=True, everywhere=True)
        out.append(target)
    return tuple(out)


def function_targets(extra: tuple[FunctionTarget, ...] = ()) -> list[FunctionTarget]:
    """Every function a trace patches: the registered ones, then :data:`WHOLE_FUNCTIONS` and ``extra``
    where not registered already (a registration keeps its own callbacks and atomicity)."""
    registered = REGISTRY.functions
    added = {t.path: t for t in (*whole_functions(), *extra) if t.path not in registered}
    return [*registered.values(), *added.values()]


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


@dataclass(eq=False)
class FunctionTarget:
    """A function or method hooked by path: the attribute that holds it, its callbacks, whether it is one node.

    ``path`` is where it is defined (``"pkg.mod.f"``, ``"pkg.mod.Class.method"``), the
    ``target`` of its nodes; ``owner.__dict__[name]`` holds it. With ``everywhere`` the
    other module globals holding the same object (``from pkg.mod import f``) are patched too.
    """

    path: str
    owner: Any
    name: str
    callbacks: list[FunctionCallback] = field(default_factory=list)
    atomic: bool = False
    everywhere: bool = False
    _holders: list[tuple[Any, str]] = field(default_factory=list)
    _scanned_modules: int = -1  # len(sys.modules) when _holders was found

    def attributes(self) -> list[tuple[Any, str]]:
        """``(owner, name)`` of every attribute to patch: its own, and with ``everywhere`` each other holder."""
        if not self.everywhere:
            return [(self.owner, self.name)]
        if self._scanned_modules != len(sys.modules):  # modules imported since may hold it too
            self._holders = _find_holders(vars(self.owner)[self.name], self.owner, self.name)[0]
            self._scanned_modules = len(sys.modules)
        return [(self.owner, self.name), *self._holders]


@dataclass
class Registry:
    """Callbacks by class, in registration order, the set of atomic classes, and the hooked functions by path."""

    callbacks: list[tuple[type, Callback]] = field(default_factory=list)
    atomic: set[type] = field(default_factory=lambda: set(default_atomic_classes()))
    functions: dict[str, FunctionTarget] = field(default_factory=dict)
    # Called with each function target registered (install() patches it in every thread).
    listeners: list[Callable[[FunctionTarget], None]] = field(default_factory=list)
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

    def add_function(self, target: FunctionTarget, fn: FunctionCallback | None = None, atomic: bool = False) -> None:
        known = self.functions.get(target.path)
        if known is None:
            known = self.functions[target.path] = target
            for listener in list(self.listeners):
                listener(known)
        known.everywhere = known.everywhere or target.everywhere
        known.atomic = known.atomic or atomic
        if fn is not None:
            known.callbacks = [f for f in known.callbacks if not _same_function(f, fn)] + [fn]
        self.version += 1

    def remove(self, fn: Callable[..., Any]) -> int:
        before = len(self.callbacks)
        self.callbacks = [(c, f) for c, f in self.callbacks if f is not fn]
        removed = before - len(self.callbacks)
        for target in self.functions.values():
            kept = [f for f in target.callbacks if f is not fn]
            removed += len(target.callbacks) - len(kept)
            target.callbacks = kept
        self.drop_unused_functions()
        return removed

    def drop_unused_functions(self) -> None:
        """Unregister the functions with no callback that are not atomic: nothing asks for them, so they
        have no keys (module_keys, probes) and later traces, probes and install() leave them unpatched."""
        for path, target in list(self.functions.items()):
            if not target.callbacks and not target.atomic:
                del self.functions[path]
        self.version += 1

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
    found = resolve_any(target, caller)
    if isinstance(found, FunctionTarget):
        raise FwdtraceError(
            f"{caller} expected a torch.nn.Module subclass or its forward method "
            f"(a class, 'torch.nn.Conv2d' or 'torch.nn.Conv2d.forward'), got {target!r}, a function"
        )
    return found


_EXPECTED = (
    "a torch.nn.Module subclass or its forward method ('torch.nn.Conv2d.forward'), or a function or method "
    "('pkg.module.function', 'pkg.Class.method', the function itself)"
)


def resolve_any(target: Any, caller: str = "hook_forward()") -> type[torch.nn.Module] | FunctionTarget:
    """The layer class ``target`` names, or the :class:`FunctionTarget` of the function or method it names."""
    if isinstance(target, str):
        obj, owner = _resolve_dotted(target)
    elif inspect.ismethod(target) and isinstance(target.__self__, type):  # Class.a_classmethod
        return resolve_any(target.__func__, caller)
    elif inspect.ismethod(target):
        raise FwdtraceError(
            f"{caller} expected {_EXPECTED}, got the bound method {target.__qualname__} of an instance; "
            "pass the class's method (Class.method) or its path"
        )
    elif callable(target) and not isinstance(target, type) and not (
        inspect.isfunction(target) and target.__qualname__.endswith(".forward")
    ):
        return _function_by_object(target, caller)
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
    if callable(obj) and not isinstance(obj, type):
        return _function_target(target, obj, owner, caller)
    raise FwdtraceError(f"{caller} expected {_EXPECTED}, got {target!r} ({describe(obj)})")


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


# -- functions and methods ---------------------------------------------------------------------------
def _function_target(target: Any, obj: Any, owner: Any, caller: str) -> FunctionTarget:
    """The attribute that holds ``obj``, reached as ``owner.<last part of target>``."""
    name = target.rsplit(".", 1)[-1] if isinstance(target, str) else getattr(obj, "__name__", "")
    if isinstance(owner, types.ModuleType):
        if vars(owner).get(name) is not obj:  # a lazy attribute (module __getattr__): patching cannot hold it
            raise FwdtraceError(
                f"{caller} expected a function held in its module's namespace, got {target!r}, which "
                f"{owner.__name__} hands out lazily; pass the path where it is defined"
                + (f" ({obj.__module__}.{obj.__qualname__})" if hasattr(obj, "__qualname__") else "")
            )
        return FunctionTarget(f"{owner.__name__}.{name}", owner, name)
    if isinstance(owner, type):
        # Patched on the class whose __dict__ defines it: an inherited method lives there.
        klass = next(k for k in owner.__mro__ if name in vars(k))
        raw = vars(klass)[name]
        if not (callable(raw) or isinstance(raw, (staticmethod, classmethod))):
            raise FwdtraceError(f"{caller} expected {_EXPECTED}, got {target!r}, a {type(raw).__name__} of the class")
        return FunctionTarget(f"{klass.__module__}.{klass.__qualname__}.{name}", klass, name)
    raise FwdtraceError(
        f"{caller} expected {_EXPECTED}, got {target!r}, an attribute of {describe(owner)} "
        "(only functions held by a module or a class can be patched)"
    )


def _function_by_object(fn: Any, caller: str) -> FunctionTarget:
    """Find a function object where it lives, by its ``__module__`` and ``__qualname__``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    where = f"{module}.{qualname}"
    hint = "pass its dotted path ('pkg.module.function') where it is held"
    if not module or not qualname or "<" in qualname:
        raise FwdtraceError(f"{caller} could not find where {where} lives (a local function or a lambda); {hint}")
    try:
        obj, owner = _resolve_dotted(where)
    except FwdtraceError as e:
        raise FwdtraceError(f"{caller} could not find {where} by its path ({e}); {hint}") from None
    if obj is not fn and getattr(obj, "__func__", None) is not fn:
        raise FwdtraceError(
            f"{caller} found another object than the function given at {where} (a decorator replaced it?); {hint}"
        )
    return _function_target(where, obj, owner, caller)


_BUILTIN_TYPES = (
    types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
    types.ClassMethodDescriptorType, types.MethodWrapperType,
)
_MAX_SCANNED_DICT = 100_000  # larger module-level dicts are tables, not registries of functions


def _find_holders(obj: Any, home: Any, name: str) -> tuple[list[tuple[Any, str]], list[str]]:
    """Other module globals holding ``obj`` (``from x import f``), and the registry dicts holding it.

    Dicts are module globals, or the dict attributes of a mapping object that is one
    (transformers' ``ALL_ATTENTION_FUNCTIONS``, an ``AttentionInterface``, keeps its functions
    in ``_global_mapping``): their items are never read through ``__getitem__``, which may import.
    """
    holders: list[tuple[Any, str]] = []
    registries: dict[int, str] = {}

    def scan_dict(d: dict, where: str) -> None:
        if id(d) in registries or len(d) > _MAX_SCANNED_DICT:
            return
        for key, value in list(d.items()):
            if value is obj:
                registries[id(d)] = f"{where}[{key!r}]"
                return

    for module_name, module in sorted((k, m) for k, m in list(sys.modules.items()) if isinstance(m, types.ModuleType)):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is obj:
                if module is not home or attr != name:
                    holders.append((module, attr))
            elif type(value) is dict:
                scan_dict(value, f"{module_name}.{attr}")
            elif Mapping in type(value).__mro__:  # not isinstance: no __class__ lookup on odd objects
                for inner_name, inner in [*vars(type(value)).items(), *getattr(value, "__dict__", {}).items()]:
                    if type(inner) is dict:
                        scan_dict(inner, f"{module_name}.{attr}.{inner_name}")
    return holders, sorted(registries.values())


_WARNED: set[tuple[str, bool]] = set()  # (path, everywhere) already warned about


def _warn_unreachable(target: FunctionTarget, caller: str) -> None:
    """Say once why patching ``target``'s attribute cannot reach every call, if it cannot."""
    if (target.path, target.everywhere) in _WARNED:
        return
    _WARNED.add((target.path, target.everywhere))
    raw = vars(target.owner)[target.name]
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    reasons = []
    if isinstance(function, _BUILTIN_TYPES):
        reasons.append("it is a builtin (C) function: calls from C code do not pass through the attribute")
    if isinstance(function, torch.jit.ScriptFunction):
        reasons.append("it is a torch.jit scripted function: scripted callers call it without the attribute")
    holders, registries = _find_holders(raw, target.owner, target.name)
    if holders and not target.everywhere:
        names = ", ".join(f"{m.__name__}.{a}" for m, a in holders)
        reasons.append(
            f"it was imported by value into other modules, whose calls through these names run the original: "
            f"{names} (everywhere=True patches those too)"
        )
    if registries:
        reasons.append(
            f"it is stored in registry dicts, and callers that look it up there get the original: {', '.join(registries)}"
        )
    if reasons:
        warnings.warn(f"fwdtrace: {caller} on {target.path} cannot see every call: {'; '.join(reasons)}", stacklevel=4)


def hook_forward(target: Any, *, atomic: bool = False, everywhere: bool = False) -> Callable[[F], F]:
    """Run the decorated callback after every call of a layer class, or of a function or method.

    >>> import torch, fwdtrace
    >>> @fwdtrace.hook_forward("torch.nn.ReLU.forward")
    ... def show(module, inputs, output):
    ...     print(type(module).__name__, fwdtrace.obj_id(inputs[0]), "->", fwdtrace.obj_id(output))
    >>> _ = fwdtrace.trace(torch.nn.Sequential(torch.nn.ReLU()), torch.ones(1))
    ReLU 0 -> 1
    >>> @fwdtrace.hook_forward("torch.nn.functional.silu")
    ... def seen(inputs, kwargs, output):
    ...     print("silu", tuple(inputs[0].shape), "->", tuple(output.shape))
    >>> _ = fwdtrace.trace(torch.nn.Sequential(torch.nn.SiLU()), torch.ones(2))
    silu (2,) -> (2,)
    >>> fwdtrace.remove_hook(show), fwdtrace.remove_hook(seen)
    (1, 1)

    ``target`` is a layer class, or a dotted path to it or to its ``forward`` (resolved with
    importlib and getattr); subclasses are included. The callback ``fn(module, inputs, output)``
    runs once per ``module(...)`` call, after the layer's forward and its own torch hooks, on
    what the call returned (a subclass's whole ``forward``, ``super().forward()`` included).
    Like torch's forward hooks, a direct ``module.forward(...)`` call is not seen. With
    ``atomic=True`` the class also becomes one node per call in traced graphs (a user's own
    layer), from this call on, decorating or not.

    Any other function or method (``"pkg.module.function"``, ``"pkg.Class.method"``, or the
    function itself) gets ``fn(inputs, kwargs, output)`` after each call: ``inputs`` are the
    positional arguments as the function received them (``self`` first for a method). Its
    attribute (the module global, or the class attribute of the class that defines it) is
    replaced with ``setattr`` while a trace, a probe or :func:`fwdtrace.install` needs it, and
    the very same object put back after. ``atomic=True`` makes each call one ``"function"``
    node named by its path, its tensor inputs and outputs as edges, what it computes inside
    hidden. Where patching the attribute cannot reach every call (imported by value into
    other modules, stored in a registry dict, a builtin, a torch.jit function), a warning
    says so once; ``everywhere=True`` also patches the other module globals holding it.

    For both, a non-None return value replaces the output; the decorated function is
    returned unchanged. Callbacks run in the thread of an active trace or probe, or in
    every thread after :func:`fwdtrace.install`.
    """
    found = resolve_any(target)
    if isinstance(found, FunctionTarget):
        found.everywhere = bool(everywhere)
        _warn_unreachable(found, "hook_forward()")
        if atomic:  # at the call: hook_forward(f, atomic=True) alone, not decorating, registers it too
            REGISTRY.add_function(found, atomic=True)
    else:
        if everywhere:
            raise FwdtraceError(
                f"hook_forward() expected everywhere=True only with a function or method, got the layer class {found.__qualname__}"
            )
        if atomic:
            REGISTRY.add_atomic(found)

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise FwdtraceError(f"@hook_forward({target!r}) expected a function, got {describe(fn)}")
        signature = "(inputs, kwargs, output)" if isinstance(found, FunctionTarget) else "(module, inputs, output)"
        check_callback(fn, f"@hook_forward({target!r})", signature)
        if isinstance(found, FunctionTarget):
            REGISTRY.add_function(found, fn)
        else:
            REGISTRY.add_callback(found, fn)
        return fn

    return decorate


def register_atomic(target: T, *, everywhere: bool = False) -> T:
    """Make a layer class, a function or a method one node per call in traced graphs; usable as a decorator.

    >>> import torch, fwdtrace
    >>> @fwdtrace.register_atomic
    ... class Block(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * 2 + 1
    >>> [n.kind for n in fwdtrace.trace(Block(), torch.ones(1)).nodes]
    ['input', 'module', 'output']

    A function or method (by path or itself) becomes a ``"function"`` node named by its path,
    as with ``hook_forward(target, atomic=True)``.
    """
    found = resolve_any(target, "register_atomic()")
    if isinstance(found, FunctionTarget):
        found.everywhere = bool(everywhere)
        _warn_unreachable(found, "register_atomic()")
        REGISTRY.add_function(found, atomic=True)
    else:
        REGISTRY.add_atomic(found)
    return target


def remove_hook(fn: Callable[..., Any]) -> int:
    """Unregister a callback added with :func:`hook_forward`; returns how many entries went.

    A function or method left with no callback is unregistered too, unless it is atomic.
    """
    return REGISTRY.remove(fn)


def clear_hooks() -> None:
    """Unregister every callback (atomic classes and functions stay)."""
    REGISTRY.callbacks = []
    for target in REGISTRY.functions.values():
        target.callbacks = []
    REGISTRY.drop_unused_functions()
