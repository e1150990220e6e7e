"""A finished live run reopened from its directory: the same page and API, read-only, without the model.

What ``serve(model, logdir=DIR)`` wrote (the history, the graph, the key table; see
:mod:`fwdtrace.live.history`) is served as the live service serves it, so the page shows the
graph and scrolls over every series and scalar kept. Arming and disarming answer 409: there is no model.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..graph import Graph
from ..instrument.stats import RunningStats
from .history import GRAPH_FILE, History
from .server import Server, _curve, _int, _json, _Reply, check_network

__all__ = ["reopen", "ReopenedServer"]


class ReopenedServer(Server):
    """The live service over a finished run's directory; see :func:`reopen`."""

    read_only = True

    def __init__(self, logdir: str | os.PathLike[str], host: str, port: int, token: str | None,
                 max_connections: int, timeout: float) -> None:
        self._init_state()
        self.history = History(logdir, read_only=True, caller="reopen()")
        try:
            self.logdir = self.history.logdir
            self._key_rows = self.history.keys()
            text = self.history.graph_json()
            if text is not None:
                self.graph, self._graph_json = Graph.from_json(text, str(self.logdir / GRAPH_FILE)), text
            else:
                self.graph_error = f"no graph in the run {str(self.logdir)!r} (the model was never traced)"
            self.listen(host, port, max_connections, timeout, caller="reopen()")
        except BaseException:
            self.history.close()
            raise
        self.start_serving(token)

    def _unhook(self) -> None:
        if self.history is not None:
            self.history.close()

    def _new_layouts(self) -> _LayoutsHere:
        return _LayoutsHere(self.graph)

    def __repr__(self) -> str:
        return f"ReopenedServer({str(self.logdir)!r}, {self.url})"

    def _refuse(self) -> _Reply:
        return _Reply(409, f"this is a finished run reopened read-only from {str(self.logdir)!r}: nothing can be "
                           "armed or disarmed (serve the model to sample it)")

    # -- what the sampler answered in a live service -------------------------------------------------
    def key_rows(self) -> list[dict[str, Any]]:
        return self._key_rows

    def _known_keys(self) -> set[str]:
        return {row["key"] for row in self._key_rows} | {s["key"] for s in self._series()}

    def _path2key(self) -> dict[str, str]:
        return {row.get("path") or row["key"]: row["key"] for row in self._key_rows}

    def _sampled(self, kind: str) -> tuple[list[str], str]:
        return sorted({s["key"] for s in self._series() if s["kind"] == kind}), "the run kept none of it"

    def _roles(self, key: str, kind: str) -> list[str]:
        return [s["role"] for s in self._series() if (s["key"], s["kind"]) == (key, kind)]

    def _series(self) -> list[dict[str, Any]]:
        assert self.history is not None
        return self.history.series()

    def _arms(self) -> list[dict[str, Any]]:
        """One entry per sampled ``(key, kind)``, as a live service's ``arms``: samples kept and taken, steps."""
        arms: dict[tuple[str, str], dict[str, Any]] = {}
        for s in self._series():
            arm = arms.setdefault((s["key"], s["kind"]), {
                "key": s["key"], "kind": s["kind"], "armed": False, "every": None, "count": None, "raw": False,
                "calls": None, "taken": 0, "samples": 0, "dropped": 0, "skipped": 0, "over_budget": 0, "ring": None,
                "error": None, "first_step": s["first_step"], "last_step": s["last_step"], "roles": []})
            arm["roles"].append(s["role"])
            arm["samples"], arm["taken"] = max(arm["samples"], s["rows"]), max(arm["taken"], s["appended"])
            arm["dropped"] = arm["taken"] - arm["samples"]
            for end, pick in (("first_step", min), ("last_step", max)):
                if s[end] is not None:
                    arm[end] = pick(x for x in (arm[end], s[end]) if x is not None)
        return list(arms.values())

    # -- routes ---------------------------------------------------------------------------------------
    def status(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        arms = self._arms()
        root = next((row for row in self._key_rows if not row.get("path")), {"class": "", "key": ""})
        steps = [a["last_step"] for a in arms if a["last_step"] is not None]
        return _json({"step": max(steps, default=0), "rank": 0, "world_size": 1, "model": root["class"], "root": root["key"],
                      "graph": "ready" if self.graph is not None else self.graph_error, "arms": arms,
                      "history": self._history_info(), "read_only": True})

    def arm(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        raise self._refuse()

    def disarm(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        raise self._refuse()

    def samples(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        kind = self._kind(query)
        key = self._key(query, armed_kind=kind)
        if query.get("format", "json") != "json":
            raise _Reply(409, f"expected format=json: a run's history keeps summaries, no raw values "
                              f"(got format={query['format']!r})")
        info = next(a for a in self._arms() if (a["key"], a["kind"]) == (key, kind))
        # since= asks a live service for samples newer than those seen: a finished run has none
        newer = "since" in query and "before" not in query and "limit" not in query
        return _json({**info, "rank": 0, "source": "history", "samples": [] if newer else self._older(key, kind, query)})

    def stats(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        kind, asked = self._which(query)
        key = self._key(query, armed_kind=kind)
        role = self._role(key, kind, asked)
        assert self.history is not None
        rows = self.history.rows(key, kind, role, _int(query, "before", None))
        info = next(a for a in self._arms() if (a["key"], a["kind"]) == (key, kind))
        return _json({**info, "which": f"{kind}_{role}", "role": role, "stats": pooled(rows),
                      "over": "the rows kept in the history"})

    def scalars(self, query: dict[str, str], body: bytes | None) -> tuple[int, str, bytes]:
        if "before" in query or "limit" in query:
            return super().scalars(query, body)
        assert self.history is not None
        names = self._scalar_names()
        newer = "since" in query  # a finished run has no points newer than those a client saw
        series = {} if newer else {n: _curve([(p["step"], p["value"]) for p in self.history.scalars(n)]) for n in names}
        return _json({"names": names, "scalars": series, "seq": None, "refused": 0})

    def _scalar_names(self) -> list[str]:
        assert self.history is not None
        return sorted(self.history.scalar_names())  # as a live service lists them


class _LayoutsHere:
    """Lays the graph out in this process. A live service lays out in a child process, so that Graphviz, which
    holds the GIL, never stalls training; a reopened run has no training, and a child interpreter (importing
    torch) takes seconds to start."""

    def __init__(self, graph: Graph | None) -> None:
        self.graph = graph
        self._lock = threading.Lock()

    def svg(self, depth: int | None) -> str:
        from .svg import graph_svg

        assert self.graph is not None
        with self._lock:  # one layout at a time, as the child answers them
            return graph_svg(self.graph, depth)

    def close(self) -> None:
        pass


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The statistics of the union of the tensors ``rows`` summarise, merged from their per-row statistics.

    >>> pooled([{"numel": 2, "nan": 0, "inf": 0, "mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0},
    ...         {"numel": 2, "nan": 0, "inf": 0, "mean": 3.0, "std": 0.0, "min": 3.0, "max": 3.0}])["std"]
    1.0
    """
    total = RunningStats(histogram=False)
    for r in rows:
        total.merge(RunningStats.from_summary(**{k: r[k] for k in ("numel", "nan", "inf", "mean", "std", "min", "max")}))
    d = total.to_dict()
    return {name: d[name] for name in ("count", "mean", "std", "min", "max", "nan", "inf")}


def reopen(logdir: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
           max_connections: int = 32, timeout: float = 10.0) -> ReopenedServer:
    """Serve a finished run's directory (``serve(model, logdir=DIR)``) read-only: its graph and history, no model.

    >>> import tempfile, torch, fwdtrace, urllib.request, json
    >>> from fwdtrace.live import reopen
    >>> run = tempfile.mkdtemp()
    >>> with fwdtrace.serve(torch.nn.Sequential(torch.nn.ReLU()), port=0, logdir=run):
    ...     pass
    >>> with reopen(run, port=0) as server:
    ...     json.load(urllib.request.urlopen(server.url + "api/status"))["read_only"]
    True

    What :func:`~fwdtrace.live.server.serve` takes about the network (``host``, ``port``,
    ``token``, ``max_connections``, ``timeout``) means the same here; POST and DELETE on
    ``/api/sample`` answer 409.
    """
    token = check_network(host, port, token, max_connections, timeout, caller="reopen()")
    return ReopenedServer(logdir, host, port, token, max_connections, float(timeout))
