"""Plugins: third-party packages that register callbacks, atomic layers and ONNX equivalences.

A package declares an entry point in the group ``fwdtrace.plugins``, in its pyproject.toml::

    [project.entry-points."fwdtrace.plugins"]
    mylayers = "mylayers.fwdtrace_plugin"            # a module: importing it registers
    mylayers_setup = "mylayers.fwdtrace_plugin:setup"  # or a callable taking no arguments

The module's ``@fwdtrace.hook_forward`` and ``@fwdtrace.register_atomic`` decorators (and
``fwdtrace.onnx_equivalent`` calls) run when it is imported. Plugins load once, lazily, on
the first trace or install, in entry-point name order. A plugin that fails to load gives a
warning naming it and its distribution; tracing goes on without it.
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
            dist = getattr(ep, "dist", None)
            origin = f" from {dist.name} {dist.version}" if dist is not None else ""
            warnings.warn(
                f"fwdtrace plugin {ep.name!r} ({ep.value}{origin}) failed to load and is skipped: "
                f"{type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        _loaded.append(ep.name)
    return _loaded
