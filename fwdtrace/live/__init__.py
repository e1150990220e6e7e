"""Live sampler service and web inspector: arm sampling by module key while a model trains, watch it in a browser.

``sampler.py`` holds the training side (plain torch hooks appending to ring buffers),
``server.py`` the HTTP side (stdlib ``ThreadingHTTPServer`` in a daemon thread),
``svg.py`` the drawings the page shows, ``static/`` the page itself (plain JS, no CDN),
``scalars.py`` the scalar curves the training loop logs (:func:`log_scalar`).
"""

from __future__ import annotations

from .scalars import log_scalar
from .server import Server, serve

__all__ = ["serve", "Server", "log_scalar"]
