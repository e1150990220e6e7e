"""The SVG the live page shows: the graph drawing with module keys, and histograms over steps.

Graph drawings are laid out in a child process (:class:`LayoutProcess`): Graphviz holds the GIL.

Charts are drawn here, on the server, rather than by a JavaScript charting library:
the page stays a few hundred lines of plain JS with no third-party code to pin and
audit, it works offline, and the drawing is plain Python that the tests read.
"""

from __future__ import annotations

import html
import math
import os
import re
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from ..errors import FwdtraceError
from ..graph import Graph

__all__ = ["graph_svg", "histogram_svg", "scalar_svg", "LayoutProcess"]

# Graphviz writes each box and cluster as <g id=".." class="node|cluster <what draw.py wrote>">.
_BOX = re.compile(r'<g id="([^"]*)" class="(node|cluster)((?: [^" ]+)*)">')


def graph_svg(graph: Graph, depth: int | None = None) -> str:
    """The graph drawn as SVG, each box and cluster of a module carrying ``data-key="<module key>"``.

    >>> import torch, fwdtrace
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
    >>> 'data-key="0.Linear"' in graph_svg(g)
    True

    The keys are those the draw pass wrote into each box's ``class`` (see :func:`fwdtrace.passes.draw.to_dot`),
    moved into ``data-key`` for the page; ``data-kind`` says what the box is (``module``,
    ``layer``, ``group`` for a collapsed module call, ``side``, ``loop``...). Repeated blocks
    are drawn in full so every block can be clicked; a leaf layer is one box, keyed by its layer.
    """
    from ..passes.draw import KEY_CLASS, layout_bytes, to_dot

    dot = to_dot(graph, depth=depth, collapse_repeats=False)
    svg = layout_bytes(dot.source, "svg", caller="the live page").decode()

    def keyed(m: re.Match[str]) -> str:
        element, words = m.group(2), html.unescape(m.group(3)).split()
        key = next((unquote(w[len(KEY_CLASS):]) for w in words if w.startswith(KEY_CLASS)), None)
        kinds = [w for w in words if not w.startswith(KEY_CLASS)]
        attrs = f' data-key="{html.escape(key)}"' if key else ""
        attrs += f' data-kind="{html.escape(kinds[0])}"' if kinds else ""
        return f'<g id="{m.group(1)}" class="{element}"{attrs}>'

    return _BOX.sub(keyed, svg)


def _number(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _exact(x: float | None) -> str:
    """A number as a hover title gives it: enough digits to read it back (six significant)."""
    return "-" if x is None else f"{x:.6g}" if math.isfinite(x) else str(x)


def _ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """Round values between ``lo`` and ``hi`` for an axis: at most ``most``, 1, 2 or 5 times a power of ten apart.

    >>> _ticks(-0.7, 1.3)
    [-0.5, 0.0, 0.5, 1.0]
    """
    span = hi - lo
    if not (span > 0 and math.isfinite(span)):
        return [lo] if math.isfinite(lo) else []
    power = 10.0 ** math.floor(math.log10(span / most))
    step = next(power * m for m in (1, 2, 5, 10) if span / (power * m) <= most)
    first = math.ceil(lo / step)
    return [round(i * step, 12) for i in range(first, math.floor(hi / step) + 1)]


def _x_labels(steps: list[int], most: int = 6) -> list[int]:
    """The indices of the columns whose step an axis names: evenly spread, the last included."""
    every = max(1, math.ceil(len(steps) / most))
    return sorted({*range(0, len(steps), every), len(steps) - 1})


def _axes(left: float, top: float, plot_w: float, plot_h: float, height: float, y: Any, lo: float, hi: float,
          xs: list[tuple[float, int]]) -> list[str]:
    """Tick marks and labels: round values on the y axis, the steps of some columns on the x axis."""
    parts = []
    for v in _ticks(lo, hi):
        parts.append(f'<line class="tick" x1="{left - 3}" x2="{left + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     f'stroke="#000" stroke-opacity="0.08"/>')
        parts.append(f'<text class="ytick" x="{left - 5}" y="{y(v) + 3:.1f}" text-anchor="end">{_number(v)}</text>')
    for x, step in xs:
        parts.append(f'<text class="xtick" x="{x:.1f}" y="{height - 5}" text-anchor="middle">{step}</text>')
    parts.append(f'<text x="{left - 5}" y="{height - 5}" text-anchor="end">step</text>')
    return parts


def histogram_svg(samples: list[dict[str, Any]], role: str, width: int = 440, height: int = 150) -> str:
    """Histograms over steps as an SVG heat map: one column per sample, darker where values are denser.

    >>> s = {"step": 1, "tensors": [{"role": "output", "index": 0, "numeric": True, "mean": 0.5,
    ...       "min": 0.0, "max": 1.0, "histogram": [1, 3], "bin_edges": [0.0, 0.5, 1.0]}]}
    >>> histogram_svg([s], "output").count("<rect class=\\"bin\\"")
    2

    Each sample's tensor of ``role`` is drawn with its bins on one value axis (the y axis); a
    line follows the mean, red marks at the top or bottom edge say values fell beyond fixed bins.
    The x axis runs from the oldest sample in the buffer to the newest. Hovering shows titles:
    a bin's step, value range and count; a mean point's step and statistics.
    """
    columns = []
    for s in samples:
        t = next((t for t in s["tensors"] if t["role"] == role and t.get("numeric") and t.get("bin_edges")), None)
        if t is not None:
            columns.append((s["step"], t))
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="fw-hist" data-role="{html.escape(role)}" '
            f'data-samples="{len(columns)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">')
    if not columns:
        return head + f'<text x="8" y="20" class="empty">no {html.escape(role)} samples yet</text></svg>'
    lo = min(t["bin_edges"][0] for _, t in columns)
    hi = max(t["bin_edges"][-1] for _, t in columns)
    if not hi > lo:
        lo, hi = lo - 0.5, hi + 0.5
    left, right, top, bottom = 52, 8, 8, 20
    plot_w, plot_h = width - left - right, height - top - bottom
    col_w = plot_w / len(columns)

    def y(v: float) -> float:
        return top + plot_h * (hi - v) / (hi - lo)

    parts = [head, f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#f6f7f9" stroke="#ccc"/>']
    mean_points, points = [], []
    for i, (step, t) in enumerate(columns):
        x = left + i * col_w
        peak = max(t["histogram"]) or 1
        edges = t["bin_edges"]
        for b, c in enumerate(t["histogram"]):
            if c:
                y0, y1 = y(edges[b + 1]), y(edges[b])
                parts.append(f'<rect class="bin" x="{x:.1f}" y="{y0:.1f}" width="{col_w:.1f}" '
                             f'height="{max(y1 - y0, 0.5):.1f}" fill="#1f5fa8" fill-opacity="{0.1 + 0.9 * c / peak:.2f}">'
                             f'<title>step {step}: {c} in [{_exact(edges[b])}, {_exact(edges[b + 1])})</title></rect>')
        for edge, name in ((top, "overflow"), (top + plot_h - 2, "underflow")):
            if t.get(name):  # values beyond fixed bins: a red mark at the edge they left by
                parts.append(f'<rect class="outside" x="{x:.1f}" y="{edge:.1f}" width="{col_w:.1f}" height="2" '
                             f'fill="#c0392b"><title>step {step}: {t[name]} {name}</title></rect>')
        if t["mean"] is not None and math.isfinite(t["mean"]):
            cx, cy = x + col_w / 2, y(t["mean"])
            mean_points.append(f"{cx:.1f},{cy:.1f}")
            stats = " ".join(f"{k}={_exact(t.get(k))}" for k in ("mean", "std", "min", "max"))
            nonfinite = f" nan={t.get('nan', 0)} inf={t.get('inf', 0)}" if t.get("nan") or t.get("inf") else ""
            points.append(f'<circle class="point" cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="#d35400">'
                          f'<title>step {step}: {stats}{nonfinite}</title></circle>')
    if mean_points:
        parts.append(f'<polyline class="mean" points="{" ".join(mean_points)}" fill="none" stroke="#d35400" stroke-width="1.5"/>')
    parts += points
    steps = [step for step, _ in columns]
    parts += _axes(left, top, plot_w, plot_h, height, y, lo, hi,
                   [(left + (i + 0.5) * col_w, steps[i]) for i in _x_labels(steps)])
    parts.append("</svg>")
    return "".join(parts)


def scalar_svg(name: str, points: list[tuple[int, float]], width: int = 440, height: int = 150) -> str:
    """A scalar over steps as an SVG line chart; each point's title gives its step and value.

    >>> svg = scalar_svg("loss", [(1, 2.0), (2, 1.5)])
    >>> svg.count('<circle class="point"'), "<title>step 2: loss=1.5</title>" in svg
    (2, True)

    NaN and infinite values are not on the line: red marks at the top say where they were.
    """
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="fw-scalar" data-name="{html.escape(name)}" '
            f'data-points="{len(points)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">')
    finite = [v for _, v in points if math.isfinite(v)]
    if not points:
        return head + f'<text x="8" y="20" class="empty">no {html.escape(name)} values yet</text></svg>'
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if not hi > lo:
        lo, hi = lo - 0.5, hi + 0.5
    lo, hi = lo - (hi - lo) * 0.05, hi + (hi - lo) * 0.05
    left, right, top, bottom = 52, 8, 8, 20
    plot_w, plot_h = width - left - right, height - top - bottom
    first, last = points[0][0], points[-1][0]
    span = (last - first) or 1

    def x(step: int) -> float:
        return left + plot_w * ((step - first) / span if last > first else 0.5)

    def y(v: float) -> float:
        return top + plot_h * (hi - v) / (hi - lo)

    parts = [head, f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#f6f7f9" stroke="#ccc"/>']
    line = [f"{x(s):.1f},{y(v):.1f}" for s, v in points if math.isfinite(v)]
    if line:
        parts.append(f'<polyline class="line" points="{" ".join(line)}" fill="none" stroke="#1f5fa8" stroke-width="1.5"/>')
    label = html.escape(name)
    for s, v in points:
        cy, colour = (y(v), "#1f5fa8") if math.isfinite(v) else (top + 2, "#c0392b")
        parts.append(f'<circle class="point" cx="{x(s):.1f}" cy="{cy:.1f}" r="2" fill="{colour}">'
                     f'<title>step {s}: {label}={_exact(v)}</title></circle>')
    steps = [s for s, _ in points]
    parts += _axes(left, top, plot_w, plot_h, height, y, lo, hi, [(x(steps[i]), steps[i]) for i in _x_labels(steps)])
    parts.append("</svg>")
    return "".join(parts)


# -- layout in a child process ---------------------------------------------------------------------------
class LayoutProcess:
    """Lays graphs out in a child Python process, so Graphviz never holds the training process's GIL.

    >>> import torch, fwdtrace
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
    >>> with LayoutProcess(g.to_json(indent=None)) as layouts:
    ...     'data-key="0.Linear"' in layouts.svg(None)
    True

    pygraphviz lays out without releasing the GIL: in a thread of the training process, one
    drawing stretched a training step from 3.4 ms to 180-270 ms. The child is started at
    the first drawing, is given the graph's JSON once, then answers one depth at a time
    (``python -m fwdtrace.live.svg`` speaks length-prefixed frames on stdin and stdout);
    it exits when its stdin closes, so a training process that dies takes it along.
    """

    def __init__(self, graph_json: str, timeout: float = 120.0) -> None:
        self.graph_json = graph_json
        self.timeout = timeout
        self.proc: Any = None
        self.closed = False
        self._lock = threading.Lock()

    def svg(self, depth: int | None) -> str:
        """The keyed SVG drawing at ``depth`` (None: all), laid out by the child."""
        with self._lock:
            if self.closed:  # a request still in flight when the service stopped starts no new child
                raise FwdtraceError("the layout process is closed")
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            try:
                _write_frame(self.proc.stdin, b"all" if depth is None else str(depth).encode())
                status, _, payload = _read_frame(self.proc.stdout, self.timeout).partition(b" ")
            except (OSError, TimeoutError, EOFError) as e:
                self._stop()  # a child that hangs or died is replaced at the next drawing
                raise FwdtraceError(f"laying out the graph at depth {depth} failed: {type(e).__name__}: {e}") from None
        if status != b"ok":
            raise FwdtraceError(f"laying out the graph at depth {depth} failed: {payload.decode(errors='replace')}")
        return payload.decode()

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # the same fwdtrace as this process
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "fwdtrace.live.svg"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        _write_frame(self.proc.stdin, self.graph_json.encode())

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """End the child (it exits when its stdin closes; killed after 5 s)."""
        with self._lock:
            self.closed = True
            self._stop()

    def __enter__(self) -> LayoutProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_frame(stream: Any, data: bytes) -> None:
    stream.write(b"%d\n" % len(data) + data)
    stream.flush()


def _read_frame(stream: Any, timeout: float | None = None) -> bytes:
    # Each answer is read whole, so nothing waits in the reader's buffer when select() is asked.
    if timeout is not None and not select.select([stream], [], [], timeout)[0]:
        raise TimeoutError(f"no answer in {timeout:g} s")
    header = stream.readline()
    if not header.endswith(b"\n"):
        raise EOFError("the layout process ended")
    data = stream.read(int(header))
    if len(data) != int(header):
        raise EOFError("the layout process ended mid-answer")
    return data


def _serve_layouts() -> None:
    """The child's loop: the graph's JSON, then one depth per frame; each answered "ok" + SVG or "error" + why."""
    if hasattr(os, "nice"):
        os.nice(10)  # a drawing never competes with training for a core
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    try:
        graph = Graph.from_json(_read_frame(stdin).decode())
        while True:
            request = _read_frame(stdin).decode()
            try:
                answer = b"ok " + graph_svg(graph, None if request == "all" else int(request)).encode()
            except Exception as e:
                answer = f"error {type(e).__name__}: {e}".encode()
            _write_frame(stdout, answer)
    except (EOFError, BrokenPipeError):
        return


if __name__ == "__main__":
    _serve_layouts()
