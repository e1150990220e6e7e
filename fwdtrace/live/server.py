"""The HTTP half of the live service: JSON endpoints and the page, in a daemon thread of the training process.

stdlib only (``http.server.ThreadingHTTPServer``): each request runs in its own thread
and reads what the :class:`~fwdtrace.live.sampler.Sampler` keeps under short locks.
Security: loopback by default; any other bind needs a token, checked on every request;
the ``Host`` header must name the bound address (DNS rebinding); JSON in and out, never
pickle; request bodies are size-limited; POST needs ``Content-Type: application/json``,
which a cross-site form cannot send without a CORS preflight this server never grants.
"""

from __future__ import annotations

import argparse
import hmac
import io
import json
import math
import secrets
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch

from ..errors import FwdtraceError, describe
from ..graph import Graph
from ..keys import closest_keys
from .sampler import KINDS, ROLES, Sampler, check_positive

__all__ = ["Server", "serve"]

STATIC = Path(__file__).parent / "static"
MAX_BODY = 64 * 1024
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_WILDCARD = ("0.0.0.0", "::", "")
_ARM_EXAMPLE = '{"key": "0.Linear", "kind": "forward", "every": 1, "count": null, "raw": false}'
_WHICH = tuple(f"{kind}_{role.removeprefix('grad_')}" for kind in KINDS for role in ROLES[kind])


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


class Server:
    """A running live service; see :func:`serve`. Stop it with ``stop()`` or by leaving ``with``."""

    def __init__(self, model: torch.nn.Module, example_inputs: Any, host: str, port: int, token: str | None,
                 ring: int, bins: int, raw_cap: int, pending: int) -> None:
        self.model = model
        self.host = host
        self.sampler = Sampler(model, ring=ring, bins=bins, raw_cap=raw_cap, pending=pending)
        self.graph: Graph | None = None
        self.graph_error: str | None = None
        self.trace_exception: BaseException | None = None  # why the graph's trace failed, for `fwdtrace serve`
        self._graph_handle: Any = None
        self._svg_cache: dict[int | None, str] = {}
        self._lock = threading.Lock()
        try:
            if example_inputs is not None:
                self._trace(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,), {})
            else:
                self._graph_handle = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)
            bind_port = port + self.sampler.rank if port else 0  # under torch.distributed: rank r serves on port + r
            try:
                self.httpd = _HTTPServer((host, bind_port), _Handler)
            except OSError as e:
                raise FwdtraceError(
                    f"serve() could not listen on {host}:{bind_port} ({e.strerror or e}); pass port=0 for a free port"
                ) from None
        except BaseException:
            self._unhook()
            raise
        self.httpd.app = self
        self.port: int = self.httpd.server_address[1]
        self.token = token
        hostname = "127.0.0.1" if host in _WILDCARD else host
        self._hosts = None if host in _WILDCARD else _allowed_hosts(host, self.port)
        self.url = f"http://{'[' + hostname + ']' if ':' in hostname else hostname}:{self.port}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"fwdtrace-live-{self.port}", daemon=True)
        self._thread.start()

    # -- the graph --------------------------------------------------------------------------------
    def _trace(self, args: tuple, kwargs: dict) -> None:
        from ..tracer import trace

        # One extra forward in eval mode under no_grad: no BatchNorm statistics updated, no
        # dropout randomness drawn, no sampling counted.
        was_training = self.model.training
        self.sampler.quiet_thread = threading.get_ident()
        try:
            self.model.eval()
            with torch.no_grad():
                self.graph = trace(self.model, *args, **kwargs)
        except Exception as e:  # the service still samples without a graph; the page says why
            self.graph_error = f"tracing the model failed: {type(e).__name__}: {e}"
            self.trace_exception = e
        finally:
            self.model.train(was_training)
            self.sampler.quiet_thread = None

    def _first_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        with self._lock:
            if self._graph_handle is None:
                return
            self._graph_handle.remove()
            self._graph_handle = None
        self._trace(args, kwargs)

    def graph_svg(self, depth: int | None) -> str:
        from .svg import graph_svg

        assert self.graph is not None
        with self._lock:
            svg = self._svg_cache.get(depth)
        if svg is None:
            svg = graph_svg(self.graph, depth)
            with self._lock:
                self._svg_cache[depth] = svg
        return svg

    # -- lifetime ---------------------------------------------------------------------------------
    def _unhook(self) -> None:
        with self._lock:
            handle, self._graph_handle = self._graph_handle, None
        if handle is not None:
            handle.remove()
        self.sampler.close()

    def stop(self) -> None:
        """Stop serving, join the server thread and take every hook off the model; calling it twice is harmless."""
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()
        self.httpd.close_connections()  # a browser's keep-alive connection would outlive the server
        self._unhook()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "serving" if self._thread.is_alive() else "stopped"
        return f"Server({type(self.model).__name__}, {self.url}, {state})"

    # -- requests ---------------------------------------------------------------------------------
    def check_request(self, host_header: str | None, token: str | None) -> None:
        if self._hosts is not None and (host_header or "").lower() not in self._hosts:
            raise _Reply(403, f"expected the Host header to be one of {sorted(self._hosts)}, got {host_header!r}")
        if self.token is not None and not (token and hmac.compare_digest(token.encode(), self.token.encode())):
            raise _Reply(401, "expected the token as 'Authorization: Bearer TOKEN' or ?token=TOKEN")

    def _key(self, query: dict[str, str], armed_kind: str | None = None) -> str:
        key = query.get("key")
        if not key:
            raise _Reply(400, "expected a module key as ?key=KEY (GET /api/keys lists them)")
        if key not in self.sampler.key2module:
            raise _Reply(404, f"unknown module key {key!r}", closest=closest_keys(key, self.sampler.key2module))
        if armed_kind is not None and (key, armed_kind) not in self.sampler.arms:
            armed = sorted(k for k, kd in self.sampler.arms if kd == armed_kind)
            raise _Reply(404, f"{key!r} was never armed for {armed_kind} sampling; POST /api/sample first",
                         armed=armed, closest=closest_keys(key, armed))
        return key

    def _kind(self, query: dict[str, str]) -> str:
        kind = query.get("kind", "forward")
        if kind not in KINDS:
            raise _Reply(400, f"expected kind=forward or kind=grad, got {kind!r}")
        return kind

    def handle(self, method: str, path: str, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        route = _ROUTES.get((method, path))
        if route is None:
            if any(p == path for _, p in _ROUTES):
                raise _Reply(405, f"{method} is not allowed on {path}")
            raise _Reply(404, f"no such path {path!r}", paths=sorted({p for _, p in _ROUTES}))
        return route(self, query, body)

    def page(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        # One self-contained page (script and style inlined), so only this request needs ?token=.
        text = (STATIC / "index.html").read_text(encoding="utf-8")
        text = text.replace("/*STYLE*/", (STATIC / "style.css").read_text(encoding="utf-8"))
        text = text.replace("/*SCRIPT*/", (STATIC / "app.js").read_text(encoding="utf-8"))
        return 200, "text/html; charset=utf-8", text.encode()

    def keys(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        shapes: dict[str, dict[str, list[list[int]]]] = {}
        if self.graph is not None:
            for n in self.graph.nodes:
                if n.kind == "module" and n.module_key not in shapes:
                    shapes[n.module_key] = {"input": [list(r.shape) for r in n.inputs],
                                            "output": [list(r.shape) for r in n.outputs]}
        rows = [{"key": k, "class": type(m).__name__, "params": sum(p.numel() for p in m.parameters()),
                 "shapes": shapes.get(k)} for k, m in self.sampler.key2module.items()]
        return _json(rows)

    def status(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        graph = "ready" if self.graph is not None else (self.graph_error or "waiting for the first forward")
        return _json({**self.sampler.status(), "model": type(self.model).__name__, "graph": graph})

    def arm(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        try:
            request = json.loads(body or b"")
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _Reply(400, f"expected a JSON object like {_ARM_EXAMPLE}, got invalid JSON ({e})") from None
        if not isinstance(request, dict):
            raise _Reply(400, f"expected a JSON object like {_ARM_EXAMPLE}, got a JSON {type(request).__name__}")
        unknown = sorted(set(request) - {"key", "kind", "every", "count", "raw"})
        if unknown or not isinstance(request.get("key"), str):
            got = f"unexpected fields {unknown}" if unknown else f"key={request.get('key')!r}"
            raise _Reply(400, f"expected a JSON object like {_ARM_EXAMPLE}, got {got}")
        kind = request.get("kind", "forward")
        if kind not in KINDS:
            raise _Reply(400, f"expected \"kind\" as \"forward\" or \"grad\", got {kind!r}")
        raw = request.get("raw", False)
        if not isinstance(raw, bool):
            raise _Reply(400, f"expected \"raw\" as true or false, got {raw!r}")
        try:
            every = check_positive('"every"', request.get("every", 1))
            count = check_positive('"count"', request.get("count"), optional=True)
        except FwdtraceError as e:
            raise _Reply(400, str(e)) from None
        key = request["key"]
        try:
            keys = self.sampler.arm(key, kind, every=every or 1, count=count, raw=raw)
        except FwdtraceError:
            raise _Reply(404, f"{key!r} matches no module key", closest=closest_keys(key, self.sampler.key2module)) from None
        return _json({"armed": keys, "kind": kind, "every": every, "count": count, "raw": raw})

    def disarm(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        key = query.get("key")
        if not key:
            raise _Reply(400, "expected ?key=KEY_OR_GLOB&kind=forward|grad")
        kind = query.get("kind")
        if kind is not None and kind not in KINDS:
            raise _Reply(400, f"expected kind=forward or kind=grad, got {kind!r}")
        try:
            keys = self.sampler.disarm(key, kind)
        except FwdtraceError:
            raise _Reply(404, f"{key!r} matches no module key", closest=closest_keys(key, self.sampler.key2module)) from None
        return _json({"disarmed": keys, "kind": kind})

    def samples(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        kind = self._kind(query)
        key = self._key(query, armed_kind=kind)
        if query.get("format", "json") == "npy":
            return self._npy(key, kind, query)
        if query.get("format", "json") != "json":
            raise _Reply(400, f"expected format=json or format=npy, got {query['format']!r}")
        since = _int(query, "since", -1)
        arm = self.sampler.arm_of(key, kind)
        return _json({**arm.info(), "rank": self.sampler.rank, "samples": self.sampler.samples(key, kind, since)})

    def _npy(self, key: str, kind: str, query: dict[str, str]) -> tuple[int, str, bytes]:
        import numpy as np

        index, sample = _int(query, "index", 0), _int(query, "sample", -1)
        try:
            summary, raw = self.sampler.raw(key, kind, sample, index)
        except IndexError:
            raise _Reply(404, f"no tensor index={index} in sample={sample} of {key!r} ({kind})") from None
        if raw is None:
            why = (f"it has {summary['numel']} elements, over the cap of {self.sampler.raw_cap}"
                   if summary["numel"] > self.sampler.raw_cap else 'it was armed without "raw": true')
            raise _Reply(409, f"no raw values kept for tensor {index} of {key!r}: {why}")
        buffer = io.BytesIO()
        np.save(buffer, raw.numpy(), allow_pickle=False)
        return 200, "application/octet-stream", buffer.getvalue()

    def stats(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        which = query.get("which", "forward_output")
        if which not in _WHICH:
            raise _Reply(400, f"expected which= one of {', '.join(_WHICH)}, got {which!r}")
        kind, _, role = which.partition("_")
        role = role if kind == "forward" else f"grad_{role}"
        key = self._key(query, armed_kind=kind)
        arm = self.sampler.arm_of(key, kind)
        return _json({**arm.info(), "which": which, "stats": self.sampler.stats(key, kind, role)})

    def chart(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        from .svg import histogram_svg

        kind = self._kind(query)
        key = self._key(query, armed_kind=kind)
        role = query.get("role", ROLES[kind][1])
        if role not in ROLES[kind]:
            raise _Reply(400, f"expected role= one of {', '.join(ROLES[kind])} for kind={kind}, got {role!r}")
        svg = histogram_svg(self.sampler.samples(key, kind), role)
        return 200, "image/svg+xml", svg.encode()

    def graph_json(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        graph = self._ready_graph()
        return 200, "application/json", graph.to_json(indent=None).encode()

    def graph_drawing(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        self._ready_graph()
        depth = _int(query, "depth", None) if query.get("depth") not in (None, "", "all") else None
        if depth is not None and depth < 0:
            raise _Reply(400, f"expected depth= an integer >= 0 or 'all', got {depth}")
        return 200, "image/svg+xml", self.graph_svg(depth).encode()

    def _ready_graph(self) -> Graph:
        if self.graph is None:
            raise _Reply(503, self.graph_error or "no graph yet: the first forward traces it (or pass example_inputs= to serve())")
        return self.graph


_ROUTES = {
    ("GET", "/"): Server.page,
    ("GET", "/api/status"): Server.status,
    ("GET", "/api/keys"): Server.keys,
    ("POST", "/api/sample"): Server.arm,
    ("DELETE", "/api/sample"): Server.disarm,
    ("GET", "/api/samples"): Server.samples,
    ("GET", "/api/stats"): Server.stats,
    ("GET", "/api/chart.svg"): Server.chart,
    ("GET", "/api/graph"): Server.graph_json,
    ("GET", "/api/graph.svg"): Server.graph_drawing,
}


def _json(obj: Any) -> tuple[int, str, bytes]:
    return 200, "application/json", json.dumps(_finite(obj), allow_nan=False).encode()


def _int(query: dict[str, str], name: str, default: Any) -> Any:
    if name not in query:
        return default
    try:
        return int(query[name])
    except ValueError:
        raise _Reply(400, f"expected {name}= an integer, got {query[name]!r}") from None


def _allowed_hosts(host: str, port: int) -> set[str]:
    names = {"127.0.0.1", "localhost", "[::1]"} if host in _LOOPBACK else {f"[{host}]" if ":" in host else host}
    return {f"{n}:{port}".lower() for n in names}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: Server

    def __init__(self, *args: Any) -> None:
        self.connections: set[Any] = set()  # open keep-alive connections, closed by stop()
        self.connections_lock = threading.Lock()
        super().__init__(*args)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        import socket

        with self.connections_lock:
            connections = list(self.connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)  # the handler thread's read ends, and it exits
            except OSError:
                pass

    def server_bind(self) -> None:
        if ":" in self.server_address[0]:
            import socket

            self.address_family = socket.AF_INET6
            self.socket = socket.socket(self.address_family, self.socket_type)
        super().server_bind()


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive: a polling page reuses its connection
    # Headers and body go out in two writes; with Nagle's algorithm the body waits for the
    # client's delayed ACK, 40 ms on Linux, on every keep-alive request.
    disable_nagle_algorithm = True
    server_version = "fwdtrace-live"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: this runs inside a training script
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        app = self.server.app
        try:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            auth = self.headers.get("Authorization", "")
            app.check_request(self.headers.get("Host"), auth.removeprefix("Bearer ").strip() or query.get("token"))
            body = self._body() if method == "POST" else None
            status, ctype, payload = app.handle(method, url.path, query, body)
        except _Reply as e:
            status, ctype = e.status, "application/json"
            payload = json.dumps(_finite({"error": str(e), "status": e.status, **e.extra})).encode()
        except Exception as e:  # a bug of ours answers 500 and keeps the server (and training) going
            status, ctype = 500, "application/json"
            payload = json.dumps({"error": f"{type(e).__name__}: {e}", "status": 500}).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
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


def serve(model: torch.nn.Module, *, example_inputs: Any = None, host: str = "127.0.0.1", port: int = 8765,
          token: str | None = None, ring: int = 64, bins: int = 32, raw_cap: int = 1 << 22,
          pending: int = 32) -> Server:
    """Serve a live view of ``model`` over HTTP from a daemon thread: arm sampling by module key, read statistics.

    >>> import torch, fwdtrace, urllib.request, json
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> with fwdtrace.serve(model, port=0) as server:
    ...     keys = json.load(urllib.request.urlopen(server.url + "api/keys"))
    >>> [k["key"] for k in keys]
    ['0.Linear', 'Sequential']

    ``example_inputs`` (a tensor or a tuple of arguments) traces the graph now; without it
    the first forward is traced (once more, in eval mode under no_grad). ``port=0`` picks
    a free port; under ``torch.distributed`` rank ``r`` serves on ``port + r``. A bind
    other than loopback needs ``token``: one is generated and printed when it is None.
    ``ring`` samples are kept per key and kind, histograms have ``bins`` bins, raw values
    (armed with ``"raw": true``) are kept for tensors of at most ``raw_cap`` elements. A
    sampled call's tensors are copied and summarised in a background thread; when
    ``pending`` calls already wait for it, the call is skipped (and counted) rather than waited for.
    ``stop()`` (or leaving ``with``) joins the thread and takes every hook off the model.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"serve() expected a torch.nn.Module as model, got {describe(model)}")
    if not isinstance(host, str):
        raise FwdtraceError(f"serve() expected host as a str such as '127.0.0.1', got {describe(host)}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise FwdtraceError(f"serve() expected port as an int in 0..65535 (0 picks a free one), got {port!r}")
    if token is not None and (not isinstance(token, str) or len(token) < 8):
        raise FwdtraceError(f"serve() expected token as a str of at least 8 characters or None, got {token!r}")
    if host not in _LOOPBACK and token is None:
        token = secrets.token_urlsafe(16)
        print(f"fwdtrace live: serving {host} beyond loopback; token {token}", file=sys.stderr, flush=True)
    return Server(model, example_inputs, host, port, token, ring, bins, raw_cap, pending)


# -- the `fwdtrace serve` subcommand ---------------------------------------------------------------------
def configure_parser(parser: argparse.ArgumentParser) -> None:
    from ..cli import add_input_arguments

    parser.add_argument("factory", help="a function returning the model, as 'pkg.module:function'")
    add_input_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    parser.add_argument("--token", default=None, help="token required on every request (generated beyond loopback)")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``fwdtrace serve`` until Ctrl-C; exit 2 (naming the layer) when the example inputs do not trace."""
    from ..cli import forward_failed, load_factory, make_inputs

    model = load_factory(args.factory)
    inputs = make_inputs(args)
    with serve(model, example_inputs=tuple(inputs), host=args.host, port=args.port, token=args.token) as server:
        if server.trace_exception is not None:  # a page with no graph helps nobody: stop here, as the other commands do
            raise forward_failed(args.factory, inputs, server.trace_exception) from server.trace_exception
        query = f"?token={server.token}" if server.token else ""
        print(f"serving {type(model).__name__} at {server.url}{query}  (Ctrl-C stops)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0
