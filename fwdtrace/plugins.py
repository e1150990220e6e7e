"""Plugins: third-party packages that register callbacks, atomic layers and ONNX equivalences.

A package declares an entry point in the group ``fwdtrace.plugins``; its target is a module
(importing it runs its ``@hook_forward`` / ``register_atomic`` decorators) or a callable
taking no arguments. Plugins load once, lazily, on the first trace, install or ONNX check.
A plugin that fails to load gives a warning naming it; tracing goes on without it.
"""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points

__all__ = ["load_plugins", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "fwdtrace.plugins"
_loaded: list[str] | None = None


def load_plugins(reload: bool = False) -> list[str]:
    """Load every ``fwdtrace.plugins`` entry point once; return the names that loaded.

    >>> from fwdtrace.plugins import load_plugins
    >>> isinstance(load_plugins(), list)
    True
    """
    global _loaded
    if _loaded is not None and not reload:
        return _loaded
    _loaded = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type):
                obj()
        except Exception as e:  # a broken plugin must not break tracing
            warnings.warn(
                f"fwdtrace plugin {ep.name!r} ({ep.value}) failed to load and is skipped: "
                f"{type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        _loaded.append(ep.name)
    return _loaded
