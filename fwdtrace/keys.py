"""Module keys: the names every probe, dump and analysis row is addressed by.

A key is ``"{module_path}.{ClassName}"``, the root model being its class name alone.
"""

from __future__ import annotations

import torch

from .errors import FwdtraceError, describe

__all__ = ["module_keys", "module_key", "key2module"]


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
