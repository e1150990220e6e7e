"""One HTTP server core for fwdtrace's services: :func:`fwdtrace.serve` (and a reopened run) and :func:`fwdtrace.view`.

stdlib only (``http.server.ThreadingHTTPServer``): each connection runs in its own daemon
thread. What every service gets from here, so no service can lack one of them: at most
``max_connections`` connections open and each closed after ``timeout`` seconds without a
whole request (:class:`_HTTPServer`); loopback by default and a token beyond it, checked on
every request before anything else is read; the ``Host`` header must name the bound address
(DNS rebinding); every request answered over HTTP, malformed ones included (a request line
over 64 KiB 414, more than 100 headers or a header line over 64 KiB 431, more than 64 query
fields 400), and no traceback printed into the user's process. A service is an
:class:`HTTPService` subclass that answers ``handle(method, path, query, body)``.
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import socket
import sys
import threading
import time
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..errors import FwdtraceError, describe

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_WILDCARD = ("0.0.0.0", "::", "")
MAX_BODY = 64 * 1024
MAX_QUERY_FIELDS = 64
JOIN_TIMEOUT = 10.0  # stop() waits this long in all for the request threads to finish


class _Reply(Exception):
    """An HTTP error answer: status, message and extra JSON fields."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.extra = status, extra


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None: JSON has no NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _allowed_hosts(host: str, port: int) -> set[str]:
    names = {"127.0.0.1", "localhost", "[::1]"} if host in _LOOPBACK else {f"[{host}]" if ":" in host else host}
    return {f"{n}:{port}".lower() for n in names}


class _Connection:
    """One open connection: the thread serving it, and whether it is answering a request or waiting for one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.busy = False  # answering a request; never closed to make room
        self.since = time.monotonic()  # when it last started waiting for a request
        self.authorized = False  # has sent a request that passed the token and Host checks
        self.closing = False
        self.thread: threading.Thread | None = None

    def close(self) -> None:
        """End it from another thread: its thread's read returns at once, and the thread exits."""
        self.closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: %d\r\n\r\n%s")


class _HTTPServer(ThreadingHTTPServer):
    """Connections bounded in number and time, so idle or slow clients cannot exhaust threads or descriptors.

    At most ``max_connections`` are open. A new one beyond that replaces the connection that
    has waited longest for a request (one that never passed the token check first); when
    every connection is answering a request, the new one is refused at once with 503, from
    the accepting thread, without a thread of its own. A connection that goes ``timeout``
    seconds without sending a whole request (idle keep-alive, or trickling bytes) is closed.
    """

    daemon_threads = True
    request_queue_size = 128  # the listen backlog; at socketserver's 5, a burst of connects waits 1 s for SYN retries
    app: HTTPService

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int, timeout: float) -> None:
        self.connections: dict[socket.socket, _Connection] = {}  # with threads alive, closing ones included
        self.connections_lock = threading.Lock()
        self.max_connections, self.request_timeout = max_connections, timeout
        self.refused = self.replaced = self.timed_out = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        connection = _Connection(request)
        self._wait_for_closing()
        with self.connections_lock:
            open_ = [c for c in self.connections.values() if not c.closing]
            accept = len(open_) < self.max_connections
            if not accept:
                waiting = [c for c in open_ if not c.busy]
                if waiting:
                    min(waiting, key=lambda c: (c.authorized, c.since)).close()
                    self.replaced += 1
                    accept = True
                else:
                    self.refused += 1
            if accept:
                self.connections[request] = connection
                connection.thread = threading.Thread(target=self.process_request_thread,
                                                     args=(request, client_address),
                                                     name=f"{self.app.thread_name}-request", daemon=True)
        if accept:
            connection.thread.start()  # type: ignore[union-attr]
        else:
            self._refuse(request)

    def _wait_for_closing(self, timeout: float = 5.0) -> None:
        """Keep threads under twice the cap: connections closed to make room hold theirs until it
        sees the close. Waits here, in the accepting thread (new connections queue in the backlog)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.connections_lock:
                if len(self.connections) < 2 * self.max_connections:
                    return
                closing = [c.thread for c in self.connections.values() if c.closing and c.thread is not None]
            if not closing or time.monotonic() > deadline:
                return
            closing[0].join(max(0.0, deadline - time.monotonic()))

    def _refuse(self, request: socket.socket) -> None:
        body = json.dumps({"error": f"too many connections (at most {self.max_connections}, all answering); "
                                    "try again", "status": 503}).encode()
        try:
            request.setblocking(False)  # never wait on a client that does not read
            request.send(_BUSY % (len(body), body))
        except OSError:
            pass
        self.shutdown_request(request)

    def connection(self, request: Any) -> _Connection | None:
        with self.connections_lock:
            return self.connections.get(request)

    def service_actions(self) -> None:
        """Between accepts (every poll interval): close connections waiting too long for a whole request."""
        now = time.monotonic()
        with self.connections_lock:
            late = [c for c in self.connections.values()
                    if not c.busy and not c.closing and now - c.since > self.request_timeout]
            for c in late:
                c.close()
            self.timed_out += len(late)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up or time out are normal; socketserver's default prints a traceback,
        # which would land in the training script's (or the notebook's) stderr.
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            print(f"{self.app.caller}: a request from {client_address[0]} failed: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)

    def close_connections(self) -> None:
        with self.connections_lock:
            connections = list(self.connections.values())
        for connection in connections:
            connection.close()

    def join_handlers(self, timeout: float) -> None:
        """Wait, ``timeout`` seconds in all, for the threads of the connections closed by close_connections()."""
        deadline = time.monotonic() + timeout
        with self.connections_lock:
            threads = [c.thread for c in self.connections.values() if c.thread is not None]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def server_bind(self) -> None:
        if ":" in self.server_address[0]:
            self.address_family = socket.AF_INET6
            self.socket = socket.socket(self.address_family, self.socket_type)
        super().server_bind()


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive: a polling page reuses its connection
    # Headers and body go out in two writes; with Nagle's algorithm the body waits for the
    # client's delayed ACK, 40 ms on Linux, on every keep-alive request.
    disable_nagle_algorithm = True
    server_version = "fwdtrace"
    # A request line that does not parse leaves this version: at the stdlib's HTTP/0.9 its error
    # answer would be a bare body, with no status line a client could read.
    default_request_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: this runs inside a training script
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's answers to malformed requests (400, 414, 431, 501...), as JSON like every other answer."""
        self.close_connection = True
        short = self.responses.get(code, ("error",))[0]
        body = json.dumps({"error": message or short, "status": code}).encode()
        self.send_response(code, short)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def setup(self) -> None:
        self.connection_state = self.server.connection(self.request)
        super().setup()
        self.connection.settimeout(self.server.request_timeout)  # each read; the server times the whole request

    def _serve(self, method: str) -> None:
        app, state = self.server.app, self.connection_state
        if state is not None:
            state.busy = True
        try:
            self._answer(app, method)
        finally:
            if state is not None:
                state.since, state.busy = time.monotonic(), False

    def _answer(self, app: HTTPService, method: str) -> None:
        extra: dict[str, str] = {}
        try:
            url = urlsplit(self.path)
            try:
                query = {k: v[-1] for k, v in parse_qs(url.query, max_num_fields=MAX_QUERY_FIELDS).items()}
            except ValueError as e:
                self.close_connection = True
                raise _Reply(400, f"expected a URL with at most {MAX_QUERY_FIELDS} query fields ({e})") from None
            try:
                app.check_request(self.headers.get("Host"), app.request_token(self.headers, query))
            except _Reply:
                self.close_connection = True  # nothing more is read from a client that failed the checks
                raise
            if self.connection_state is not None:
                self.connection_state.authorized = True
            extra = app.reply_headers(query)
            body = self._body() if method == "POST" and app.takes_body else None
            status, ctype, payload = app.handle(method, url.path, query, body)
        except _Reply as e:
            status, ctype = e.status, "application/json"
            payload = json.dumps(_finite({"error": str(e), "status": e.status, **e.extra})).encode()
        except Exception as e:  # a bug of ours answers 500 and keeps the server (and training) going
            status, ctype = 500, "application/json"
            payload = json.dumps({"error": f"{type(e).__name__}: {e}", "status": 500}).encode()
        if method == "POST" and status >= 400:
            self.close_connection = True  # the body may be unread: it would be taken for the next request
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for name, value in extra.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def _body(self) -> bytes:
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        length = self.headers.get("Content-Length")
        if not length or not length.isdigit():
            self.close_connection = True
            raise _Reply(411, "expected a Content-Length header with the JSON body")
        if int(length) > MAX_BODY:
            self.close_connection = True  # the unread body would be taken for the next request
            raise _Reply(413, f"expected a body of at most {MAX_BODY} bytes, got {length}")
        body = self.rfile.read(int(length))
        if ctype != "application/json":
            raise _Reply(415, f"expected Content-Type: application/json, got {ctype or 'none'!r}")
        return body


class HTTPService:
    """What the server core asks of a service, and what it gives it: listening, Host and token checks, stopping.

    >>> import urllib.request
    >>> from fwdtrace.live.httpd import HTTPService
    >>> class Hello(HTTPService):
    ...     def handle(self, method, path, query, body):
    ...         return 200, "text/plain", b"hello"
    >>> service = Hello()
    >>> service.serve_http("127.0.0.1", 0, None, max_connections=4, timeout=5.0)
    >>> urllib.request.urlopen(service.url).read()
    b'hello'
    >>> service.stop_http()

    A subclass answers :meth:`handle` (raising :class:`_Reply` for an error answer) and may say
    where a request's token comes from (:meth:`request_token`), which headers an accepted
    request's answer carries (:meth:`reply_headers`) and whether a POST's body is read
    (``takes_body``).
    """

    caller = "fwdtrace"  # what the user called, in messages
    thread_name = "fwdtrace-http"
    takes_body = True
    token: str | None = None
    _hosts: set[str] | None = None

    def handle(self, method: str, path: str, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        """``(status, content type, payload)`` for one request that passed the checks."""
        raise _Reply(404, f"no such path {path!r}")

    def request_token(self, headers: Message, query: dict[str, str]) -> str | None:
        """The token a request carries: ``Authorization: Bearer TOKEN`` or ``?token=TOKEN``."""
        return headers.get("Authorization", "").removeprefix("Bearer ").strip() or query.get("token")

    def reply_headers(self, query: dict[str, str]) -> dict[str, str]:
        """Headers added to the answer of a request that passed the checks."""
        return {}

    def check_request(self, host_header: str | None, token: str | None) -> None:
        """Refuse a request whose Host header or token is wrong; the first thing done with a request."""
        if self._hosts is not None and (host_header or "").lower() not in self._hosts:
            raise _Reply(403, f"expected the Host header to be one of {sorted(self._hosts)}, got {host_header!r}")
        if self.token is not None and not (token and hmac.compare_digest(token.encode(), self.token.encode())):
            raise _Reply(401, "expected the token as 'Authorization: Bearer TOKEN' or ?token=TOKEN")

    def listen(self, host: str, port: int, max_connections: int, timeout: float, caller: str | None = None) -> None:
        """Bind ``host:port`` (a FwdtraceError naming ``caller`` when it cannot); nothing served yet."""
        self.host = host
        try:
            self.httpd = _HTTPServer((host, port), _Handler, max_connections, timeout)
        except OSError as e:
            raise FwdtraceError(f"{caller or self.caller} could not listen on {host}:{port} ({e.strerror or e}); "
                                "pass port=0 for a free port") from None
        self.httpd.app = self

    def start_serving(self, token: str | None, any_host: bool = False) -> None:
        """Serve from a daemon thread. ``any_host`` leaves the ``Host`` check out (a notebook's proxy names its own)."""
        host = self.host
        self.port: int = self.httpd.server_address[1]
        self.token = token
        hostname = "127.0.0.1" if host in _WILDCARD else host
        self._hosts = None if host in _WILDCARD or any_host else _allowed_hosts(host, self.port)
        self.url = f"http://{'[' + hostname + ']' if ':' in hostname else hostname}:{self.port}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"{self.thread_name}-{self.port}", daemon=True)
        self._thread.start()

    def serve_http(self, host: str, port: int, token: str | None, max_connections: int, timeout: float,
                   any_host: bool = False) -> None:
        """:meth:`listen`, then :meth:`start_serving`."""
        self.listen(host, port, max_connections, timeout)
        self.start_serving(token, any_host)

    def stop_http(self) -> None:
        """Stop accepting, close every connection (a browser's keep-alive one would outlive the server), join their threads."""
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()
        self.httpd.close_connections()
        self.httpd.join_handlers(JOIN_TIMEOUT)


def check_network(host: Any, port: Any, token: Any, max_connections: Any, timeout: Any, caller: str = "serve()"
                  ) -> str | None:
    """Check what a service takes about the network; the token to use (one made and printed beyond loopback)."""
    if not isinstance(host, str):
        raise FwdtraceError(f"{caller} expected host as a str such as '127.0.0.1', got {describe(host)}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise FwdtraceError(f"{caller} expected port as an int in 0..65535 (0 picks a free one), got {port!r}")
    if token is not None and (not isinstance(token, str) or len(token) < 8):
        raise FwdtraceError(f"{caller} expected token as a str of at least 8 characters or None, got {token!r}")
    if not isinstance(max_connections, int) or isinstance(max_connections, bool) or max_connections < 1:
        raise FwdtraceError(f"{caller} expected max_connections as a positive int, got {max_connections!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise FwdtraceError(f"{caller} expected timeout as a positive number of seconds, got {timeout!r}")
    if host not in _LOOPBACK and token is None:
        token = secrets.token_urlsafe(16)
        print(f"fwdtrace live: serving {host} beyond loopback; token {token}", file=sys.stderr, flush=True)
    return token


