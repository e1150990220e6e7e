"""Module keys: the names every probe, dump and analysis row is addressed by.

A key is ``"{module_path}.{ClassName}"``, the root model being its class name alone.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable
from typing import Any

import torch

from .errors import FwdtraceError, describe

__all__ = ["module_keys", "module_key", "key2module", "select_modules", "closest_keys", "Selector"]

Selector = str | type | Iterable[Any]


def module_key(module_path: str, module: torch.nn.Module) -> str:
    """``module_key("seq.0", nn.Conv2d(...)) == "seq.0.Conv2d"``; the root (path ``""``) is its class name."""
    name = type(module).__name__
    return f"{module_path}.{name}" if module_path else name


def key2module(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every module of ``model`` by its key, children before their parents, the root last.

    A module reachable under two paths (shared) is listed once, under its first path,
    as ``named_modules()`` does.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"module_keys() expected a torch.nn.Module, got {describe(model)}")
    out: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()

    def visit(path: str, module: torch.nn.Module) -> None:
        seen.add(id(module))
        for name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{path}.{name}" if path else name, child)
        out[module_key(path, module)] = module

    visit("", model)
    return out


def module_keys(model: torch.nn.Module) -> list[str]:
    """The module keys of ``model``, children before their parents, the root last.

    >>> import torch, fwdtrace
    >>> class TestModel(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.seq = torch.nn.ModuleList([torch.nn.Conv2d(1, 1, 1) for _ in range(2)])
    >>> fwdtrace.module_keys(TestModel())
    ['seq.0.Conv2d', 'seq.1.Conv2d', 'seq.ModuleList', 'TestModel']
    """
    return list(key2module(model))


def closest_keys(name: str, keys: Iterable[str], n: int = 5) -> list[str]:
    """The keys most like ``name`` (difflib's ratio), best first: what an unknown key's error suggests.

    >>> closest_keys("seq.1.Conv", ["seq.0.Conv2d", "seq.1.Conv2d", "fc.Linear"])
    ['seq.1.Conv2d', 'seq.0.Conv2d']
    """
    return difflib.get_close_matches(name, list(keys), n=n, cutoff=0.3)


def select_modules(
    key2module: dict[str, torch.nn.Module], selector: Selector, what: str, model_name: str
) -> dict[str, torch.nn.Module]:
    """The modules a selector names, by key: a key, a glob (``"seq.*.Conv2d"``), a class, or a list of them.

    >>> import torch
    >>> k2m = key2module(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> list(select_modules(k2m, "*.Linear", "Probe", "Sequential"))
    ['0.Linear']

    An unknown key raises :class:`FwdtraceError` naming the closest keys; ``what`` (the
    caller, ``"Probe"``) and ``model_name`` start the message.
    """
    if isinstance(selector, str):
        if selector in key2module:
            return {selector: key2module[selector]}
        if any(c in selector for c in "*?["):
            found = {k: m for k, m in key2module.items() if fnmatch.fnmatchcase(k, selector)}
            if found:
                return found
        close = closest_keys(selector, key2module)
        hint = f"closest keys: {', '.join(repr(k) for k in close)}" if close else f"keys: {list(key2module)[:8]}"
        raise FwdtraceError(
            f"{what} expected a module key, a glob or a class of {model_name}, got "
            f"{selector!r}, which matches no key; {hint}"
        )
    if isinstance(selector, type) and issubclass(selector, torch.nn.Module):
        found = {k: m for k, m in key2module.items() if isinstance(m, selector)}
        if not found:
            classes = sorted({type(m).__name__ for m in key2module.values()})
            raise FwdtraceError(
                f"{what} expected a module key, a glob or a class of {model_name}, got "
                f"{selector.__name__}, of which the model has no instance; its classes: {', '.join(classes)}"
            )
        return found
    if isinstance(selector, (list, tuple, set)):
        out: dict[str, torch.nn.Module] = {}
        for s in selector:
            out.update(select_modules(key2module, s, what, model_name))
        return out
    raise FwdtraceError(
        f"{what} expected a selector (a module key, a glob such as 'seq.*.Conv2d', a torch.nn.Module "
        f"subclass or a list of them), got {describe(selector)}"
    )
