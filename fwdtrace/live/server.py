"""The HTTP half of the live service: JSON endpoints and the page, in a daemon thread of the training process.

stdlib only (``http.server.ThreadingHTTPServer``): each connection runs in its own thread
and reads what the :class:`~fwdtrace.live.sampler.Sampler` keeps under short locks.
Security: loopback by default; any other bind needs a token, checked on every request
before anything else is read; the ``Host`` header must name the bound address (DNS
rebinding); JSON in and out, never pickle; request bodies are size-limited; POST needs
``Content-Type: application/json``, which a cross-site form cannot send without a CORS
preflight this server never grants. Connections, timeouts and malformed requests are the
server core's (:mod:`fwdtrace.live.httpd`), which :func:`fwdtrace.view`'s server shares.
"""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from .._host import to_numpy
from ..errors import FwdtraceError, describe
from ..graph import Graph
from ..instrument.attach import attach
from ..instrument.bins import DEFAULT_BINS, check_bins_spec
from ..instrument.compiled import eager_module
from ..instrument.keys import closest_keys, key_path
from ..machinery import model_class
from .history import History
from .httpd import HTTPService, _finite, _Reply, check_network
from .sampler import KINDS, ROLES, KindRefused, Sampler, SamplerClosed, check_positive

__all__ = ["Server", "serve"]

STATIC = Path(__file__).parent / "static"
MAX_LIMIT = 10_000  # samples or scalar points one read of the history may return
MAX_POINTS = 20_000  # scalar points one /api/scalars?before= answer holds, all names together: then it pages
# Points a scalar chart shows, the newest or those before the step scrolled to: about one per pixel of
# its 440-pixel plot, so scrolling moves a window of a steady width rather than zooming out.
SCALAR_WINDOW = 512
SVG_CACHE = 8  # graph drawings kept, one per depth, the least recently shown dropped first
_ARM_EXAMPLE = '{"key": "0.Linear", "kind": "forward", "every": 1, "count": null, "raw": false}'
_WHICH = tuple(f"{kind}_{role.removeprefix('grad_')}" for kind in ROLES for role in ROLES[kind])
_KIND_LIST = "|".join(KINDS)


class Server(HTTPService):
    """A running live service, what :func:`serve` returns. Stop it with ``stop()`` or by leaving ``with``.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> with fwdtrace.serve(model, port=0) as server:
    ...     server.url.startswith("http://127.0.0.1:"), server.sampler.arm("0.Linear", "forward")
    (True, ['0.Linear'])

    ``url`` is the page's address (with its token, if any); ``sampler`` is the model's
    :class:`~fwdtrace.live.sampler.Sampler`, which arms layers from code as a click on the page
    does; ``history`` is the run's :class:`~fwdtrace.live.history.History` on disk with
    ``serve(logdir=...)``, else None.
    """

    caller = "fwdtrace live"
    thread_name = "fwdtrace-live"

    read_only = False  # a finished run reopened from its history (fwdtrace.live.reopen), no model
    history: History | None  # the run's history on disk, with serve(logdir=...)
    _graph_handle: Any

    def __init__(self, model: torch.nn.Module, example_inputs: Any, host: str, port: int, token: str | None,
                 ring: int, bins: int | Sequence[float], raw_cap: int, pending: int, memory: int = 256 << 20,
                 max_connections: int = 32, timeout: float = 10.0, logdir: str | Path | None = None,
                 retention: int | None = None) -> None:
        self.model = model
        self.sampler = Sampler(model, ring=ring, bins=bins, raw_cap=raw_cap, pending=pending, memory=memory)
        self._init_state()
        try:
            if logdir is not None:  # under torch.distributed each rank keeps its own history
                rank, world_size = self.sampler.rank, self.sampler.world_size
                folder = Path(logdir) / f"rank{rank}" if world_size > 1 else logdir
                self.history = History(folder, retention, caller="serve()")
                self.sampler.sinks.append(self.history.append_sample)
                self.sampler.add_scalar_sink(self.history.append_scalars)
            if example_inputs is not None:
                self._trace(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,), {})
            else:
                self._graph_handle = attach(model, {"": model}, caller="serve()", pre=lambda k, m: self._first_forward,
                                            with_kwargs=True, route="none")
                self._save_run()
            bind_port = port + self.sampler.rank if port else 0  # under torch.distributed: rank r serves on port + r
            if bind_port > 65535:
                raise FwdtraceError(f"serve() cannot listen on port {port} + rank {self.sampler.rank} = {bind_port}: "
                                    f"expected a port of at most {65535 - self.sampler.rank} for rank "
                                    f"{self.sampler.rank} (each rank serves on port + rank), or port=0")
            self.listen(host, bind_port, max_connections, timeout, caller="serve()")
        except BaseException:
            self._unhook()
            raise
        self.start_serving(token)

    def _init_state(self) -> None:
        self.history = None
        self.graph: Graph | None = None
        self.graph_error: str | None = None
        self.trace_exception: BaseException | None = None  # why the graph's trace failed, for `fwdtrace serve`
        self._graph_json: str | None = None
        self._graph_handle = None
        self._svg_cache: OrderedDict[int | None, str] = OrderedDict()
        self._layouts: Any = None
        self._lock = threading.Lock()
        self.closed = False


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
        self._save_run()

    def _save_run(self) -> None:
        """Write the graph and the key table beside the history, so the run reopens without the model."""
        if self.history is not None:
            self.history.write_run(self.graph_json() if self.graph is not None else None, self.key_rows())

    def _first_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        with self._lock:
            if self._graph_handle is None:
                return
            self._graph_handle.remove()
            self._graph_handle = None
        self._trace(args, kwargs)

    def graph_svg(self, depth: int | None) -> str:
        """The keyed drawing at ``depth``, laid out by a child process (Graphviz holds the GIL) and cached."""
        assert self.graph is not None
        with self._lock:
            if self.closed:
                raise _Reply(503, "the live service is stopped")
            svg = self._svg_cache.get(depth)
            if svg is not None:
                self._svg_cache.move_to_end(depth)
                return svg
            if self._layouts is None:
                from ..passes.draw import layout_missing

                # nothing here lays out (a container without Graphviz's libraries): the page lists the
                # layers instead, and asks no more (layout=false)
                missing = layout_missing("the live page")
                if missing is not None:
                    raise _Reply(501, missing, layout=False)
                self._layouts = self._new_layouts()
            layouts = self._layouts
        try:
            svg = layouts.svg(depth)
        except FwdtraceError as e:
            raise _Reply(503, str(e)) from None
        with self._lock:
            self._svg_cache[depth] = svg
            while len(self._svg_cache) > SVG_CACHE:
                self._svg_cache.popitem(last=False)
        return svg

    def _new_layouts(self) -> Any:
        """What lays the graph out: ``svg(depth)`` and ``close()``."""
        from .svg import LayoutProcess

        return LayoutProcess(self.graph_json())

    def graph_json(self) -> str:
        assert self.graph is not None
        if self._graph_json is None:  # once: the graph does not change, and the layout child reads it too
            self._graph_json = self.graph.to_json(indent=None)
        return self._graph_json

    # -- lifetime ---------------------------------------------------------------------------------
    def _unhook(self) -> None:
        with self._lock:
            handle, self._graph_handle = self._graph_handle, None
        if handle is not None:
            handle.remove()
        self.sampler.close()
        if self.history is not None:  # after the summariser, its writer, has stopped
            self.history.close()

    def stop(self) -> None:
        """Stop serving, join the server's threads and take every hook off the model; calling it twice is harmless.

        Arms still in flight either finish before the hooks are taken off (and are taken off
        with them) or are refused: the sampler is closed first, under the lock arms take.
        """
        with self._lock:
            self.closed = True
            layouts, self._layouts = self._layouts, None
        self._unhook()
        self.stop_http()
        if layouts is not None:
            layouts.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "serving" if self._thread.is_alive() else "stopped"
        return f"Server({type(eager_module(self.model)).__name__}, {self.url}, {state})"

    # -- requests ---------------------------------------------------------------------------------
    def _closest(self, name: str) -> list[str]:
        """The module keys and paths most like an unknown ``name``, best first."""
        return closest_keys(name, [*self._known_keys(), *self._path2key()])

    def _known_keys(self) -> Collection[str]:
        """Module keys, and the function keys of functions hooked by path (as Probe and Dumper take them)."""
        return {**self.sampler.key2module, **self.sampler.calls.registered_sites()}

    def _path2key(self) -> dict[str, str]:
        """Each module's path (``res.c1``, as in the graph and ``named_modules()``) to its key."""
        key2module = self.sampler.key2module
        return {key_path(k, m) or k: k for k, m in key2module.items()}

    def _sampled(self, kind: str) -> tuple[list[str], str]:
        """The keys with samples of ``kind`` to read, and what to do about another one."""
        return sorted(k for k, kd in self.sampler.arms if kd == kind), "POST /api/sample first"

    def _key(self, query: dict[str, str], armed_kind: str | None = None) -> str:
        key = query.get("key")
        if not key:
            raise _Reply(400, "expected a module key or path as ?key=KEY (GET /api/keys lists them)")
        known = self._known_keys()
        if key not in known:
            key = self._path2key().get(key, key)
        if key not in known:
            raise _Reply(404, f"unknown module key or path {key!r}", closest=self._closest(key))
        if armed_kind is not None:
            armed, hint = self._sampled(armed_kind)
            if key not in armed:
                raise _Reply(404, f"{key!r} was never armed for {armed_kind} sampling; {hint}",
                             armed=armed, closest=closest_keys(key, armed))
        return key

    def _which(self, query: dict[str, str]) -> tuple[str, str | None]:
        """The kind and the series /api/stats asks for: ``which=forward_output`` (as before series had names)
        or ``kind=&role=``; None: the arm's output series."""
        if "which" in query or "kind" not in query:
            which = query.get("which", "forward_output")
            if which not in _WHICH:
                raise _Reply(400, f"expected which= one of {', '.join(_WHICH)} (or kind=&role=), got {which!r}")
            kind, _, group = which.partition("_")
            return kind, group if kind == "forward" else f"grad_{group}"
        return self._kind(query), query.get("role")

    def _kind(self, query: dict[str, str]) -> str:
        kind = query.get("kind", "forward")
        if kind not in KINDS:
            raise _Reply(400, f"expected kind={_KIND_LIST}, got {kind!r}")
        return kind

    def _roles(self, key: str, kind: str) -> list[str]:
        return self.sampler.arm_of(key, kind).roles()

    def _role(self, key: str, kind: str, role: str | None, unseen_groups: bool = False) -> str:
        """``role`` if the arm has that series (or, with ``unseen_groups``, is a group it may still
        see); None: the arm's output (or first) series."""
        roles = self._roles(key, kind)
        if role is None:
            role = next((r for r in roles if r.startswith(("output", "grad_output"))),
                        roles[0] if roles else ROLES.get(kind, ("",))[-1])
        if role not in roles and not (unseen_groups and role in ROLES.get(kind, ())):
            raise _Reply(404, f"{key!r} ({kind}) has no series role={role!r} (yet)", roles=roles)
        return role

    def handle(self, method: str, path: str, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        route = _ROUTES.get((method, path))
        if route is None:
            if any(p == path for _, p in _ROUTES):
                raise _Reply(405, f"{method} is not allowed on {path}")
            raise _Reply(404, f"no such path {path!r}", paths=sorted({p for _, p in _ROUTES}))
        return getattr(self, route.__name__)(query, body)  # a subclass's override (a reopened run) answers

    def page(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        # One self-contained page (script and style inlined), so only this request needs ?token=.
        text = (STATIC / "index.html").read_text(encoding="utf-8")
        text = text.replace("/*STYLE*/", (STATIC / "style.css").read_text(encoding="utf-8"))
        text = text.replace("/*SCRIPT*/", (STATIC / "app.js").read_text(encoding="utf-8"))
        return 200, "text/html; charset=utf-8", text.encode()

    def keys(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        return _json(self.key_rows())

    def key_rows(self) -> list[dict[str, Any]]:
        """Each module key with its path, class, parameter count and (once traced) the shapes of its first call."""
        shapes: dict[str, dict[str, list[list[int]]]] = {}
        if self.graph is not None:
            for n in self.graph.nodes:
                if n.kind == "module" and n.module_key not in shapes:
                    shapes[n.module_key] = {"input": [list(r.shape) for r in n.inputs],
                                            "output": [list(r.shape) for r in n.outputs]}
        rows = [{"key": k, "path": key_path(k, m), "class": model_class(type(m)).__name__,
                 "params": sum(p.numel() for p in m.parameters()), "shapes": shapes.get(k)}
                for k, m in self.sampler.key2module.items()]
        # A hooked function has a key in every module that may call it: listed are those the traced
        # forward called (and those armed), each once, in the order of their first call.
        sites = self.sampler.calls.registered_sites()
        called = [n.key for n in self.graph.nodes if n.kind == "function"] if self.graph is not None else []
        listed = dict.fromkeys([k for k in called if k in sites] + sorted(k for k, _ in self.sampler.arms if k in sites))
        for k in listed:
            site = sites[k]
            node = next((n for n in self.graph.nodes if n.kind == "function" and n.key == k), None) \
                if self.graph is not None else None
            rows.append({"key": k, "path": site.module_path, "class": site.target.name, "function": site.target.path,
                         "params": 0, "shapes": None if node is None else {
                             "input": [list(r.shape) for r in node.inputs], "output": [list(r.shape) for r in node.outputs]}})
        return rows

    def status(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        graph = "ready" if self.graph is not None else (self.graph_error or "waiting for the first forward")
        return _json({**self.sampler.status(), "model": type(eager_module(self.model)).__name__, "graph": graph,
                      "history": self._history_info(), "read_only": False})

    def _history_info(self) -> dict[str, Any] | None:
        history = self.history
        return None if history is None else {"logdir": str(history.logdir), "retention": history.retention}

    def history_series(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        if self.history is None:
            raise _Reply(404, "this service keeps no history on disk: serve(model, logdir=DIR) keeps one")
        return _json({**(self._history_info() or {}), "series": self.history.series(),
                      "scalars": self.history.scalar_series()})

    def _older(self, key: str, kind: str, query: dict[str, str]) -> list[dict[str, Any]]:
        """The newest ``limit`` samples with step below ``before``: from the history on disk when there is one,
        which reaches back beyond the ring, else from the ring."""
        before, limit = _int(query, "before", None), _limit(query, 64 if self.read_only else self.sampler.ring)
        if self.history is not None:
            return self.history.samples(key, kind, before, limit)
        return [s for s in self.sampler.samples(key, kind) if before is None or s["step"] < before][-limit:]

    def arm(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        try:
            request = json.loads(body or b"")
        except (ValueError, RecursionError) as e:  # also: integers over 4300 digits, nesting too deep
            raise _Reply(400, f"expected a JSON object like {_ARM_EXAMPLE}, got invalid JSON ({e})") from None
        if not isinstance(request, dict):
            raise _Reply(400, f"expected a JSON object like {_ARM_EXAMPLE}, got a JSON {type(request).__name__}")
        unknown = sorted(set(request) - {"key", "kind", "every", "count", "raw", "bins"})
        if unknown or not isinstance(request.get("key"), str):
            got = f"unexpected fields {unknown}" if unknown else f"key={request.get('key')!r}"
            raise _Reply(400, f"expected a JSON object like {_ARM_EXAMPLE}, got {got}")
        kind = request.get("kind", "forward")
        if kind not in KINDS:
            raise _Reply(400, f"expected \"kind\" as one of {', '.join(KINDS)}, got {kind!r}")
        raw = request.get("raw", False)
        if not isinstance(raw, bool):
            raise _Reply(400, f"expected \"raw\" as true or false, got {raw!r}")
        try:
            every = check_positive('"every"', request.get("every", 1))
            count = check_positive('"count"', request.get("count"), optional=True)
            bins = None if request.get("bins") is None else check_bins_spec(request["bins"], '"bins"')
        except FwdtraceError as e:
            raise _Reply(400, str(e)) from None
        key = request["key"]
        try:
            keys = self.sampler.arm(key, kind, every=every or 1, count=count, raw=raw, bins=bins)
        except SamplerClosed as e:
            raise _Reply(503, str(e)) from None
        except KindRefused as e:
            raise _Reply(400, str(e)) from None
        except FwdtraceError:
            raise _Reply(404, f"{key!r} matches no module key, function key or path", closest=self._closest(key)) from None
        arms = [self.sampler.arms.get((k, kind)) for k in keys[:1]]
        # "compiled" or "eager": how a compiled model runs while armed (None: an eager model)
        runs = arms[0].runs if arms and arms[0] is not None else None
        return _json({"armed": keys, "kind": kind, "every": every, "count": count, "raw": raw,
                      "bins": self.sampler.bins if bins is None else bins, "runs": runs})

    def disarm(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        key = query.get("key")
        if not key:
            raise _Reply(400, f"expected ?key=KEY_OR_GLOB&kind={_KIND_LIST}")
        kind = query.get("kind")
        if kind is not None and kind not in KINDS:
            raise _Reply(400, f"expected kind={_KIND_LIST}, got {kind!r}")
        try:
            keys = self.sampler.disarm(key, kind)
        except FwdtraceError:
            raise _Reply(404, f"{key!r} matches no module key, function key or path", closest=self._closest(key)) from None
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
        if "before" in query or "limit" in query:
            return _json({**arm.info(), "rank": self.sampler.rank, "samples": self._older(key, kind, query),
                          "source": "history" if self.history is not None else "ring"})
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
                   if summary["numel"] > self.sampler.raw_cap else
                   f"{summary['raw_note']} ({self.sampler.memory} bytes)" if "raw_note" in summary else
                   'it was armed without "raw": true')
            raise _Reply(409, f"no raw values kept for tensor {index} of {key!r}: {why}")
        buffer = io.BytesIO()
        np.save(buffer, to_numpy(raw), allow_pickle=False)
        return 200, "application/octet-stream", buffer.getvalue()

    def stats(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        kind, asked = self._which(query)
        key = self._key(query, armed_kind=kind)
        role = self._role(key, kind, asked)
        arm = self.sampler.arm_of(key, kind)
        return _json({**arm.info(), "which": f"{kind}_{role}", "role": role,
                      "stats": self.sampler.stats(key, kind, role)})

    def chart(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        from .svg import histogram_svg

        kind = self._kind(query)
        key = self._key(query, armed_kind=kind)
        role = self._role(key, kind, query.get("role"), unseen_groups=True)
        older = "before" in query or "limit" in query or self.read_only
        svg = histogram_svg(self._older(key, kind, query) if older else self.sampler.samples(key, kind), role)
        return 200, "image/svg+xml", svg.encode()

    def scalars(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        if "before" in query or "limit" in query:  # every scalar's window, as its chart shows it, a page of names at a time
            names = self._scalar_names()
            offset = _int(query, "offset", 0)
            if offset < 0:
                raise _Reply(400, f"expected offset= an integer >= 0 (the first name of the page), got {offset}")
            page = names[offset:offset + max(1, MAX_POINTS // _limit(query, SCALAR_WINDOW))]
            after = offset + len(page)
            return _json({"names": names, "scalars": {n: _curve(self._scalar_window(n, query)) for n in page},
                          "seq": None, "offset": offset, "next_offset": after if after < len(names) else None})
        log = self.sampler.scalars
        series = log.read(_int(query, "since", -1))
        return _json({"names": log.names(), "scalars": series, "seq": log.seq - 1, "refused": log.refused,
                      **({"lost": log.lost, "write_error": log.write_error} if self.history is not None else {})})

    def scalar_chart(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        """``?name=N&before=STEP&limit=K``: the chart of the newest ``K`` points (:data:`SCALAR_WINDOW`, 512, by
        default) of scalar ``N`` with step below ``STEP`` (without ``before``: the newest points)."""
        from .svg import scalar_svg

        name = query.get("name") or ""
        names = self._scalar_names()
        if name not in names:
            raise _Reply(404, f"no scalar named {name!r} {'in the run' if self.read_only else '(yet)'}", names=names)
        return 200, "image/svg+xml", scalar_svg(name, self._scalar_window(name, query)).encode()

    def _scalar_names(self) -> list[str]:
        """The scalars to show: those logged since the service started and (a continued run) those on disk."""
        names = self.sampler.scalars.names()
        return names if self.history is None else sorted({*names, *self.history.scalar_names()})

    def _scalar_window(self, name: str, query: dict[str, str]) -> list[tuple[int, float]]:
        """The newest ``limit`` points (:data:`SCALAR_WINDOW` by default) of scalar ``name`` with step below ``before``.

        Scrolled back (``before=``), they come from the history on disk when there is one, which reaches
        back beyond the in-memory log; the newest come from memory, which holds the points logged since the
        writer's last pass (about a second) that the disk has not got yet.
        """
        before, limit = _int(query, "before", None), _limit(query, SCALAR_WINDOW)
        series = None if self.read_only else self.sampler.scalars.read().get(name)
        if self.history is not None and (before is not None or series is None):
            return [(p["step"], p["value"]) for p in self.history.scalars(name, before, limit)]
        if series is None:
            return []
        points = list(zip(series["steps"], series["values"], strict=True))
        return [p for p in points if before is None or p[0] < before][-limit:]

    def graph_text(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        self._ready_graph()
        return 200, "application/json", self.graph_json().encode()

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
    ("GET", "/api/scalars"): Server.scalars,
    ("GET", "/api/scalar.svg"): Server.scalar_chart,
    ("GET", "/api/graph"): Server.graph_text,
    ("GET", "/api/graph.svg"): Server.graph_drawing,
    ("GET", "/api/history"): Server.history_series,
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


def _limit(query: dict[str, str], default: int) -> int:
    """``limit=``: how many samples or points one read returns, checked against :data:`MAX_LIMIT`."""
    limit: int = _int(query, "limit", default)
    if not 1 <= limit <= MAX_LIMIT:
        raise _Reply(400, f"expected limit= an integer in 1..{MAX_LIMIT}, got {limit}")
    return limit


def _curve(points: list[tuple[int, float]]) -> dict[str, Any]:
    """A scalar's points as ``/api/scalars`` answers them: ``{"steps", "values", "seq"}`` (no seq: read back).

    >>> _curve([(3, 0.5), (4, 0.25)])
    {'steps': [3, 4], 'values': [0.5, 0.25], 'seq': None}
    """
    return {"steps": [s for s, _ in points], "values": [v for _, v in points], "seq": None}


def serve(model: torch.nn.Module, *, example_inputs: Any = None, host: str = "127.0.0.1", port: int = 8765,
          token: str | None = None, ring: int = 64, bins: int | Sequence[float] = DEFAULT_BINS, raw_cap: int = 1 << 22,
          pending: int = 32, memory: int = 256 << 20, max_connections: int = 32, timeout: float = 10.0,
          logdir: str | Path | None = None, retention: int | None = None) -> Server:
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
    ``ring`` samples are kept per key and kind, histograms have ``bins`` bins from a running
    range that doubles when a value leaves it (:class:`~fwdtrace.instrument.bins.SteadyBins`, as the
    recorder's), or ``bins`` is a list of fixed edges; raw values
    (armed with ``"raw": true``) are kept for tensors of at most ``raw_cap`` elements. A
    sampled call's tensors are copied and summarised in a background thread; when
    ``pending`` calls already wait for it, the call is skipped (and counted) rather than waited for.
    Everything the sampler holds stays under ``memory`` bytes (256 MiB): beyond it samples or
    their raw values are refused and counted (``over_budget``). At most ``max_connections``
    connections are open (beyond, the one waiting longest for a request is closed, or the new
    one refused with 503 when all are answering); each is closed after ``timeout`` seconds
    without a whole request. ``stop()`` (or leaving ``with``) joins the threads and takes
    every hook off the model.

    ``logdir`` keeps the run's history on disk (:class:`~fwdtrace.live.history.History`):
    every summarised sample and scalar, ``retention`` rows per series (10 000 by default), the
    oldest dropped first, beside the graph. Scalars (:func:`~fwdtrace.live.log_scalar`, the
    health arms' gradient norms and counts) are written by the summariser thread about once a
    second and at ``stop()``, never by the thread logging them. ``/api/samples?before=STEP&limit=N`` reads back
    beyond the ring, ``/api/scalar.svg?name=NAME&before=STEP&limit=N`` (and ``/api/scalars``) beyond the
    in-memory log of 4096 points per scalar: a scalar chart shows a window of 512 points
    (``SCALAR_WINDOW``), the newest or those before the step scrolled to. ``fwdtrace serve --logdir DIR``
    (:func:`~fwdtrace.live.reopen.reopen`) shows the run after the process has ended. A logdir holding
    a run continues it.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"serve() expected a torch.nn.Module as model, got {describe(model)}")
    token = check_network(host, port, token, max_connections, timeout)
    if logdir is None and retention is not None:
        raise FwdtraceError(f"serve() expected retention only with logdir= (it bounds the history on disk), got "
                            f"retention={retention!r} without a logdir")
    return Server(model, example_inputs, host, port, token, ring, bins, raw_cap, pending, memory, max_connections,
                  float(timeout), logdir, retention)


# -- the `fwdtrace serve` subcommand ---------------------------------------------------------------------
def run_cli(args: argparse.Namespace) -> int:
    """Run ``fwdtrace serve`` until Ctrl-C; exit 2 (naming the layer) when the example inputs do not trace."""
    from ..cli import forward_failed, load_factory, make_inputs

    if args.factory is None:
        if args.logdir is None:
            raise FwdtraceError("fwdtrace serve expected a model factory ('pkg.module:function') or --logdir DIR "
                                "of a finished run, got neither")
        from .reopen import reopen

        if args.retention is not None:
            raise FwdtraceError("fwdtrace serve expected --retention only with a model factory (it bounds a new "
                                f"history); the run in {args.logdir} keeps the retention it was written with, "
                                f"got --retention {args.retention}")
        with reopen(args.logdir, host=args.host, port=args.port, token=args.token) as reopened:
            return _serve_until_interrupted(reopened, f"the run in {args.logdir} (read-only)")
    if not args.input_shape:
        raise FwdtraceError(f"fwdtrace serve expected --input-shape with the factory {args.factory!r}, got none")
    model = load_factory(args.factory)
    inputs = make_inputs(args)
    with serve(model, example_inputs=tuple(inputs), host=args.host, port=args.port, token=args.token,
               logdir=args.logdir, retention=args.retention) as server:
        if server.trace_exception is not None:  # a page with no graph helps nobody: stop here, as the other commands do
            raise forward_failed(args.factory, inputs, server.trace_exception) from server.trace_exception
        return _serve_until_interrupted(server, type(model).__name__)


def _serve_until_interrupted(server: Server, what: str) -> int:
    query = f"?token={server.token}" if server.token else ""
    print(f"serving {what} at {server.url}{query}  (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    return 0
