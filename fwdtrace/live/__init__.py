"""Live sampler service and web inspector: arm sampling by module key while a model trains, watch it in a browser.

``sampler.py`` holds the training side (plain torch hooks appending to ring buffers),
``server.py`` the HTTP side (its endpoints), on ``httpd.py``, the one server core that
:func:`fwdtrace.view`'s server (``explorer.py``) shares: connection cap, read timeout, Host and
token checks, malformed requests,
``svg.py`` the drawings the page shows, ``static/`` the page itself (plain JS, no CDN),
``scalars.py`` the scalar curves the training loop logs (:func:`log_scalar`), ``history.py``
the run's history on disk (``serve(..., logdir=DIR)``), ``reopen.py`` a finished run served from
it without the model.
"""

from __future__ import annotations

from .reopen import ReopenedServer, reopen
from .scalars import log_scalar
from .server import Server, serve

__all__ = ["serve", "Server", "log_scalar", "reopen", "ReopenedServer"]
