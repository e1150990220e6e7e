"""Pictures and videos of layer activations and gradients over training, drawn in worker processes.

``recorder.py`` is the training side (hooks, per-file drop-oldest queues served in turn, the
watch that restarts a dead worker), ``worker.py`` the worker process, an interpreter of its own
started as ``python -m fwdtrace.recorder`` (``__main__.py``; its parent watchdog, files renamed
into place when finished), ``views.py`` the frames (heatmap, histogram on steady bins, PCA).
Only the worker imports matplotlib.
"""

from .recorder import Recorder

__all__ = ["Recorder"]
