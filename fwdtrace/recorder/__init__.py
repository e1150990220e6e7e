"""Pictures and videos of layer activations and gradients over training, drawn in worker processes.

``recorder.py`` is the training side (hooks, the bounded drop-oldest queue), ``worker.py``
the worker process (its parent watchdog, file finalising), ``views.py`` the frames
(heatmap, histogram, PCA). Only the worker imports matplotlib.
"""

from .recorder import Recorder

__all__ = ["Recorder"]
