"""The server :func:`fwdtrace.view` opens: Model Explorer's page and the files written for it, nothing else.

Model Explorer's own server (``model_explorer.visualize_from_config``) answers any ``Host``
header, reads any file a client names (``/api/v1/read_text_file?path=/etc/passwd``), converts
any path with its adapters and takes uploads: any web page the user opens could read their
files through it (DNS rebinding), and ``host="0.0.0.0"`` gave them to the network. This one
serves the page's static files from the installed package, the graph and node-data files
``view()`` wrote (those exact paths, nothing else), and the one extension the page needs
(its JSON reader, which runs in the browser). Every other endpoint answers 404.

The server core is :func:`fwdtrace.serve`'s (:mod:`fwdtrace.live.httpd`): loopback by default;
any other bind gets a token (made and printed when none is given), checked on every request
before anything else (``Authorization: Bearer``, ``?token=``, or the cookie the first page
load with ``?token=`` sets, since the page's own requests carry no token); the ``Host`` header
must name the bound address; connections capped in number and time; every request answered.
"""

from __future__ import annotations

import json
import mimetypes
import os
from collections.abc import Iterable
from email.message import Message
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .httpd import HTTPService, _Reply, check_network

__all__ = ["ExplorerServer"]

_COOKIE = "fwdtrace_view_token"
# What Model Explorer's server lists for a page without Python extensions: the JSON reader, which runs in the browser.
_EXTENSIONS = [{"fileExts": ["json"], "type": "adapter", "id": "builtin_json", "name": "JSON adapter",
                "description": "Convert graphs json data file or tfjs model."}]


class ExplorerServer(HTTPService):
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
    ``max_connections`` and ``timeout`` bound the connections as :func:`fwdtrace.serve`'s do.
    ``page_url(data)`` is the address to open, with the page's ``?data=`` (the models and
    node data to load) and the token when there is one.
    """

    caller = "fwdtrace.view()"
    thread_name = "fwdtrace-view"
    takes_body = False  # uploads, commands, config changes: none of them here

    def __init__(self, web_app: Path, paths: Iterable[str | os.PathLike[str]], host: str = "127.0.0.1",
                 port: int = 8080, token: str | None = None, caller: str = "fwdtrace.view()",
                 any_host: bool = False, max_connections: int = 32, timeout: float = 10.0) -> None:
        self.caller = caller
        token = check_network(host, port, token, max_connections, timeout, caller)
        self.web_app = Path(web_app).resolve()
        self.paths = {os.path.abspath(os.path.expanduser(os.fspath(p))) for p in paths}
        # any_host: requests come through a notebook's proxy (Colab), which names its own host.
        self.serve_http(host, port, token, max_connections, float(timeout), any_host=any_host)

    def page_url(self, data: str) -> str:
        token = f"&token={quote(self.token)}" if self.token else ""
        return f"{self.url}?data={data}{token}"

    def stop(self) -> None:
        self.stop_http()

    # -- one request ------------------------------------------------------------------------------
    def request_token(self, headers: Message, query: dict[str, str]) -> str | None:
        cookies = SimpleCookie(headers.get("Cookie", ""))
        return super().request_token(headers, query) or (cookies[_COOKIE].value if _COOKIE in cookies else None)

    def reply_headers(self, query: dict[str, str]) -> dict[str, str]:
        if self.token is not None and "token" in query:  # the page's own requests send the cookie
            return {"Set-Cookie": f"{_COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"}
        return {}

    def handle(self, method: str, path: str, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        if method != "GET":
            raise _Reply(404, f"{method} {path} is not served by {self.caller}")
        return self.answer(path, query)

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
