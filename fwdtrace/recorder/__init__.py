"""Pictures and videos of layer activations and gradients over training, drawn in worker processes.

``recorder.py`` is the training side (hooks, per-file drop-oldest queues served in turn, the
watch that restarts a dead worker), ``worker.py`` the worker process, an interpreter of its own
started as ``python -m fwdtrace.recorder`` (``__main__.py``; its parent watchdog, files renamed
into place when finished), ``views.py`` the frames (heatmap, histogram on steady bins, PCA).
Only the worker imports matplotlib, and it never imports torch (``Recorder`` is loaded on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Recorder"]


def __getattr__(name: str) -> Any:
    if name == "Recorder":
        from .recorder import Recorder

        return Recorder
    raise AttributeError(f"module 'fwdtrace.recorder' has no attribute {name!r}")


if TYPE_CHECKING:
    from .recorder import Recorder as Recorder
