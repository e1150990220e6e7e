"""Keys: the names every probe, dump and analysis row is addressed by.

A module's key is ``"{module_path}.{ClassName}"``, the root model being its class name alone.
A call of a function hooked by path (:func:`fwdtrace.hook_forward`, :func:`fwdtrace.register_atomic`)
is keyed ``"{module_path}.{function_name}"`` by the module whose forward made it
(``"model.layers.0.self_attn.eager_attention_forward"``), its name alone when the root's forward
made it: the ``module_key`` of its node in a trace. Function keys exist once the model runs, so
:func:`module_keys` lists them when given inputs.

Selectors take a module's path too, the name ``model.named_modules()`` and the graph show
(``"res.c1"`` for the key ``"res.c1.Conv1d"``; ``""`` is the root): one name for a layer, whichever
a user has at hand.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from ..errors import FwdtraceError, describe
from ..machinery import model_class
from ..registry import REGISTRY, resolve_any
from .compiled import eager_module, eager_path

__all__ = [
    "module_keys", "module_key", "function_key", "key_path", "key2module", "select_modules", "select_keys",
    "closest_keys", "closest_names", "Selector",
]

Selector = str | type | Iterable[Any]


def module_key(module_path: str, module: torch.nn.Module) -> str:
    """``module_key("seq.0", nn.Conv2d(...)) == "seq.0.Conv2d"``; the root (path ``""``) is its class name."""
    name = model_class(type(module)).__name__
    return f"{module_path}.{name}" if module_path else name


def function_key(module_path: str, name: str) -> str:
    """``function_key("model.layers.0.self_attn", "eager_attention_forward")``: a hooked function's call
    made in that module's forward; the root's own calls (path ``""``) are keyed by the name alone."""
    return f"{module_path}.{name}" if module_path else name


def key_path(key: str, module: torch.nn.Module) -> str:
    """The module path a module key was made from: ``key_path("seq.0.Conv2d", conv) == "seq.0"``,
    ``""`` for the root (whose key is its class name alone)."""
    name = model_class(type(module)).__name__
    return key[: -len(name) - 1] if len(key) > len(name) else ""


def key2module(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every module of ``model`` by its key, children before their parents, the root last.

    A module reachable under two paths (shared) is listed once, under its first path,
    as ``named_modules()`` does. Compilation is transparent to keys: a ``torch.compile``
    wrapper (of the model or of a submodule) is keyed as the module it wraps, at its path,
    so ``torch.compile(model)``'s first layer is ``0.Linear`` as on the eager model.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"module_keys() expected a torch.nn.Module, got {describe(model)}")
    out: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()

    def visit(path: str, module: torch.nn.Module) -> None:
        seen.add(id(module))
        for name, child in module.named_children():
            child = eager_module(child)
            if id(child) not in seen:
                visit(f"{path}.{name}" if path else name, child)
        out[module_key(path, module)] = module

    visit("", eager_module(model))
    return out


def module_keys(model: torch.nn.Module, *inputs: Any, **kwargs: Any) -> list[str]:
    """The module keys of ``model``, children before their parents, the root last.

    >>> import torch, fwdtrace
    >>> class TestModel(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.seq = torch.nn.ModuleList([torch.nn.Conv2d(1, 1, 1) for _ in range(2)])
    >>> fwdtrace.module_keys(TestModel())
    ['seq.0.Conv2d', 'seq.1.Conv2d', 'seq.ModuleList', 'TestModel']

    Given inputs, the model runs once (without grad) and the keys of the hooked functions it
    called (``hook_forward``/``register_atomic`` on a function or method) are listed too, each
    module's after its children's and before its own key, in first-call order:

    >>> fwdtrace.register_atomic("torch.nn.functional.silu")
    'torch.nn.functional.silu'
    >>> fwdtrace.module_keys(torch.nn.Sequential(torch.nn.SiLU()), torch.ones(1))
    ['0.silu', '0.SiLU', 'Sequential']
    >>> _ = fwdtrace.registry.REGISTRY.functions.pop("torch.nn.functional.silu")  # the example undone
    """
    keys = key2module(model)
    if not inputs and not kwargs:
        return list(keys)
    from .calls import called_keys  # calls imports this module

    called = called_keys(model, inputs, kwargs)
    out: list[str] = []
    for key, module in keys.items():
        out += called.get(key_path(key, module), [])
        out.append(key)
    return out


def closest_keys(name: str, keys: Iterable[str], n: int = 5) -> list[str]:
    """The keys most like ``name`` (difflib's ratio), best first: what an unknown key's error suggests.

    >>> closest_keys("seq.1.Conv", ["seq.0.Conv2d", "seq.1.Conv2d", "fc.Linear"])
    ['seq.1.Conv2d', 'seq.0.Conv2d']
    """
    return difflib.get_close_matches(name, list(keys), n=n, cutoff=0.3)


def closest_names(name: str, keys: Iterable[str], paths: Iterable[str], n: int = 5) -> str:
    """What an unknown selector's error suggests: the closest keys and the closest module paths.

    >>> closest_names("seq.1.Conv", ["seq.0.Conv2d", "seq.1.Conv2d"], ["seq.0", "seq.1"], n=1)
    "closest keys: 'seq.1.Conv2d'; closest module paths: 'seq.1'"
    """
    keys, paths = list(keys), [p for p in paths if p]
    parts = []
    for what, names in (("keys", keys), ("module paths", paths)):
        close = closest_keys(name, names, n)
        if close:
            parts.append(f"closest {what}: {', '.join(repr(k) for k in close)}")
    return "; ".join(parts) or f"keys: {keys[:8]}"


class FunctionSites(Protocol):
    """What selecting function keys needs of a model (:class:`fwdtrace.instrument.calls.ModelCalls`)."""

    def registered_sites(self) -> dict[str, Any]: ...

    def sites(self, target: Any) -> dict[str, Any]: ...


def select_modules(
    key2module: dict[str, torch.nn.Module], selector: Selector, what: str, model_name: str
) -> dict[str, torch.nn.Module]:
    """The modules a selector names, by key: a key or a module path, a glob of either
    (``"seq.*.Conv2d"``, ``"seq.*"``), a class, or a list of them.

    >>> import torch
    >>> k2m = key2module(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> list(select_modules(k2m, "*.Linear", "Probe", "Sequential")), list(select_modules(k2m, "1", "Probe", "Sequential"))
    (['0.Linear'], ['1.ReLU'])

    A key wins over a path spelled the same; a glob selects what it matches among the keys and
    among the paths, in key order. An unknown name raises :class:`FwdtraceError` naming the
    closest keys and paths; ``what`` (the caller, ``"Probe"``) and ``model_name`` start the message.
    """
    return select_keys(key2module, selector, what, model_name)


def select_keys(
    key2module: dict[str, torch.nn.Module], selector: Selector, what: str, model_name: str,
    functions: FunctionSites | None = None,
) -> dict[str, Any]:
    """The modules and function sites a selector names, by key (:func:`select_modules`, and function keys).

    >>> import torch, fwdtrace
    >>> from fwdtrace.instrument.calls import ModelCalls
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.SiLU())
    >>> calls = ModelCalls(model)
    >>> list(select_keys(key2module(model), ["0.Linear", torch.nn.functional.silu], "Probe", "Sequential", calls))
    ['0.Linear', '0.silu', '1.silu', 'silu']

    With ``functions``, a key or glob also matches the function keys of every function
    registered with ``hook_forward``/``register_atomic`` (``"{module path}.{name}"`` for every
    module path of the model, where it may be called), its registered path selects all its keys,
    and a function or method itself (registered or not) selects all of its keys too.
    """
    if isinstance(selector, str):
        selector = eager_path(selector)  # a key or path as a torch.compile wrapper's named_modules() spell it
        if selector in key2module:
            return {selector: key2module[selector]}
        path2key = {key_path(k, m): k for k, m in key2module.items()}
        if selector in path2key:
            key = path2key[selector]
            return {key: key2module[key]}
        sites = functions.registered_sites() if functions is not None else {}
        if selector in sites:
            return {selector: sites[selector]}
        if any(c in selector for c in "*?["):
            found = {k: m for k, m in key2module.items() if fnmatch.fnmatchcase(k, selector)}
            found.update((k, key2module[k]) for p, k in path2key.items() if fnmatch.fnmatchcase(p, selector))
            found.update((k, s) for k, s in sites.items() if fnmatch.fnmatchcase(k, selector))
            if found:  # in key order, whichever name matched
                return {k: found[k] for k in [*key2module, *sites] if k in found}
        registered = REGISTRY.functions.get(selector) if functions is not None else None
        if registered is not None:
            return dict(functions.sites(registered))  # type: ignore[union-attr]
        hint = closest_names(selector, [*key2module, *sites], path2key)
        if functions is not None:
            hint += (
                "; a function's keys are '{module path}.{name}' once it is registered with hook_forward or "
                "register_atomic, or pass the function itself"
            )
        raise FwdtraceError(
            f"{what} expected a module key or path, a glob or a class of {model_name}, got "
            f"{selector!r}, which matches no key or path; {hint}"
        )
    if isinstance(selector, type) and issubclass(selector, torch.nn.Module):
        found = {k: m for k, m in key2module.items() if isinstance(m, selector)}
        if not found:
            classes = sorted({model_class(type(m)).__name__ for m in key2module.values()})
            raise FwdtraceError(
                f"{what} expected a module key or path, a glob or a class of {model_name}, got "
                f"{selector.__name__}, of which the model has no instance; its classes: {', '.join(classes)}"
            )
        return found
    if isinstance(selector, (list, tuple, set)):
        out: dict[str, Any] = {}
        for s in selector:
            out.update(select_keys(key2module, s, what, model_name, functions))
        return out
    if functions is not None and callable(selector) and not isinstance(selector, type):
        found_target = resolve_any(selector, what)
        if isinstance(found_target, type):  # a layer's forward names its class
            return select_keys(key2module, found_target, what, model_name, functions)
        return dict(functions.sites(found_target))
    functions_too = ", a function key, a function or method" if functions is not None else ""
    raise FwdtraceError(
        f"{what} expected a selector (a module key or path, a glob such as 'seq.*.Conv2d' or 'seq.*', a torch.nn.Module "
        f"subclass{functions_too} or a list of them), got {describe(selector)}"
    )

