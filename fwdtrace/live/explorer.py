"""The server :func:`fwdtrace.view` opens: Model Explorer's page and the files written for it, nothing else.

Model Explorer's own server (``model_explorer.visualize_from_config``) answers any ``Host``
header, reads any file a client names (``/api/v1/read_text_file?path=/etc/passwd``), converts
any path with its adapters and takes uploads: any web page the user opens could read their
files through it (DNS rebinding), and ``host="0.0.0.0"`` gave them to the network. This one
serves the page's static files from the installed package, the graph and node-data files
``view()`` wrote (those exact paths, nothing else), and the one extension the page needs
(its JSON reader, which runs in the browser). Every other endpoint answers 404.

The rules are :func:`fwdtrace.serve`'s: loopback by default; any other bind gets a token
(made and printed when none is given), checked on every request before anything else
(``Authorization: Bearer``, ``?token=``, or the cookie the first page load with ``?token=``
sets, since the page's own requests carry no token); the ``Host`` header must name the bound
address. stdlib only: one daemon thread per connection, stopped by :meth:`ExplorerServer.stop`.
"""

from __future__ import annotations

import hmac
import json
import mimetypes
import os
import socket
import threading
from collections.abc import Iterable
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from ..errors import FwdtraceError
from .server import _WILDCARD, _allowed_hosts, check_network

__all__ = ["ExplorerServer"]

_COOKIE = "fwdtrace_view_token"
# What Model Explorer's server lists for a page without Python extensions: the JSON reader, which runs in the browser.
_EXTENSIONS = [{"fileExts": ["json"], "type": "adapter", "id": "builtin_json", "name": "JSON adapter",
                "description": "Convert graphs json data file or tfjs model."}]


class ExplorerServer:
    """Serve Model Explorer's page and the files ``paths``, under fwdtrace's Host and token checks.

    >>> import json, tempfile, urllib.request
    >>> from pathlib import Path
    >>> from fwdtrace.live.explorer import ExplorerServer
    >>> graph = Path(tempfile.mkdtemp()) / "graph.json"; _ = graph.write_text("{}")
    >>> server = ExplorerServer(Path(tempfile.mkdtemp()), [graph], port=0)
    >>> url = server.url + "api/v1/read_text_file?path=" + str(graph)
    >>> json.load(urllib.request.urlopen(url))
    {'content': '{}'}
    >>> server.stop()

    ``web_app`` is the folder of the page's static files (Model Explorer's ``web_app``).
    ``any_host`` leaves the ``Host`` check out, for a port reached only through a notebook's proxy.
    ``page_url(data)`` is the address to open, with the page's ``?data=`` (the models and
    node data to load) and the token when there is one.
    """

    def __init__(self, web_app: Path, paths: Iterable[str | os.PathLike[str]], host: str = "127.0.0.1",
                 port: int = 8080, token: str | None = None, caller: str = "fwdtrace.view()",
                 any_host: bool = False) -> None:
        self.token = check_network(host, port, token, 64, 60.0, caller)
        self.web_app = Path(web_app).resolve()
        self.paths = {os.path.abspath(os.path.expanduser(os.fspath(p))) for p in paths}
        try:
            self.httpd = _HTTPServer((host, port), _Handler)
        except OSError as e:
            raise FwdtraceError(f"{caller} could not listen on {host}:{port} ({e.strerror or e}); "
                                "pass port=0 for a free port") from None
        self.httpd.app = self
        self.host = host
        self.port: int = self.httpd.server_address[1]
        # any_host: requests come through a notebook's proxy (Colab), which names its own host.
        self._hosts = None if host in _WILDCARD or any_host else _allowed_hosts(host, self.port)
        name = "127.0.0.1" if host in _WILDCARD else host
        self.url = f"http://{'[' + name + ']' if ':' in name else name}:{self.port}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"fwdtrace-view-{self.port}", daemon=True)
        self._thread.start()

    def page_url(self, data: str) -> str:
        token = f"&token={quote(self.token)}" if self.token else ""
        return f"{self.url}?data={data}{token}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)

    # -- one request ------------------------------------------------------------------------------
    def check(self, host_header: str | None, token: str | None) -> int:
        """0 when the request may be answered, else the HTTP status refusing it."""
        if self._hosts is not None and (host_header or "").lower() not in self._hosts:
            return 403
        if self.token is not None and not (token and hmac.compare_digest(token.encode(), self.token.encode())):
            return 401
        return 0

    def answer(self, path: str, query: dict[str, str]) -> tuple[int, str, bytes]:
        if path == "/api/v1/read_text_file":
            wanted = query.get("path", "")
            if os.path.abspath(os.path.expanduser(wanted)) not in self.paths:
                return _json(403, {"error": "only the files fwdtrace.view() wrote are served"})
            try:
                return _json(200, {"content": Path(wanted).expanduser().read_text(encoding="utf-8")})
            except (OSError, UnicodeDecodeError) as e:
                return _json(404, {"error": f"{type(e).__name__}: {e}"})
        if path == "/api/v1/get_extensions":
            return _json(200, _EXTENSIONS)
        if path == "/api/v1/check_new_version":
            return _json(200, {})
        if path == "/check_health":
            return 200, "text/plain", b"model_explorer_ok"
        if path.startswith("/api"):
            return _json(404, {"error": f"{path} is not served by fwdtrace.view()"})
        return self._static(path)

    def _static(self, path: str) -> tuple[int, str, bytes]:
        relative = path.lstrip("/") or "index.html"
        target = (self.web_app / relative).resolve()
        if not target.is_relative_to(self.web_app) or not target.is_file():
            return _json(404, {"error": f"no such file: {path}"})
        ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        return 200, ctype, target.read_bytes()


def _json(status: int, obj: Any) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(obj).encode()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: ExplorerServer

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        if ":" in address[0]:  # an IPv6 address ("::", "::1")
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "fwdtrace-view"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        app = self.server.app
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, max_num_fields=64).items()}
        cookies = SimpleCookie(self.headers.get("Cookie", ""))
        token = (self.headers.get("Authorization", "").removeprefix("Bearer ").strip() or query.get("token")
                 or (cookies[_COOKIE].value if _COOKIE in cookies else None))
        refused = app.check(self.headers.get("Host"), token)
        if refused:
            status, ctype, payload = _json(refused, {"error": "wrong Host header" if refused == 403 else
                                                     "expected the token as ?token=TOKEN or 'Authorization: Bearer TOKEN'"})
        else:
            status, ctype, payload = app.answer(url.path, query)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        if not refused and app.token is not None and "token" in query:  # the page's own requests send the cookie
            self.send_header("Set-Cookie", f"{_COOKIE}={app.token}; HttpOnly; SameSite=Strict; Path=/")
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:  # uploads, commands, config changes: none of them here
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
