"""All of fwdtrace's patching goes through one :class:`Patcher`.

It records every attribute it replaces and puts each original back, in reverse order,
on exit, exceptions included (torch.fx's ``_Patcher`` does the same: reverse order
keeps duplicates correct).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MISSING = object()

# Every wrapper fwdtrace installs carries the function it wraps under this attribute,
# so a second patcher (a trace inside ``install()``) can reach the true original.
ORIGINAL_ATTR = "__fwdtrace_original__"


@dataclass
class _Patch:
    owner: type
    name: str
    previous: Any  # what owner.__dict__ held, or _MISSING when the attribute was inherited


class Patcher:
    """Replace class attributes and restore the very same originals later.

    >>> import torch
    >>> from fwdtrace.patching import Patcher
    >>> original = torch.nn.ReLU.__dict__["forward"]
    >>> with Patcher() as p:
    ...     p.patch(torch.nn.ReLU, "forward", lambda self, x: x)
    >>> torch.nn.ReLU.__dict__["forward"] is original
    True
    """

    def __init__(self) -> None:
        self._patches: list[_Patch] = []

    def patch(self, owner: type, name: str, value: Any) -> None:
        self._patches.append(_Patch(owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def restore(self) -> None:
        """Undo every patch, newest first. Safe to call twice."""
        while self._patches:
            p = self._patches.pop()
            if p.previous is _MISSING:
                delattr(p.owner, p.name)
            else:
                setattr(p.owner, p.name, p.previous)

    def __len__(self) -> int:
        return len(self._patches)

    def __enter__(self) -> Patcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def unwrap(fn: Any) -> Any:
    """The function under any fwdtrace wrappers around ``fn``."""
    while hasattr(fn, ORIGINAL_ATTR):
        fn = getattr(fn, ORIGINAL_ATTR)
    return fn
