"""Pictures and videos of layer activations and gradients over training, drawn in worker processes.

``recorder.py`` is the training side (hooks, per-file drop-oldest queues served in turn, the
watch that restarts a dead worker), ``worker.py`` the worker process (its parent watchdog,
files renamed into place when finished), ``views.py`` the frames
(heatmap, histogram, PCA). Only the worker imports matplotlib.
"""

from .recorder import Recorder

__all__ = ["Recorder"]
