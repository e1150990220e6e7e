"""The SVG the live page shows: the graph drawing with module keys, and histograms over steps.

Charts are drawn here, on the server, rather than by a JavaScript charting library:
the page stays a few hundred lines of plain JS with no third-party code to pin and
audit, it works offline, and the drawing is plain Python that the tests read.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

from ..graph import Graph

__all__ = ["graph_svg", "histogram_svg"]

_NODE = re.compile(r'<g id="([^"]+)" class="node">\s*<title>([^<]*)</title>')
_CLUSTER = re.compile(r'(<g id="[^"]+" class="cluster")(>\s*<title>[^<]*</title>.*?<text[^>]*>([^<]*)</text>)', re.S)
_SCOPE_LABEL = re.compile(r"^(.+) \((\w+)\)(?: call \d+)?$")


def _unit_keys(graph: Graph, depth: int | None) -> tuple[int, dict[int, str]]:
    """How many boxes ``to_dot(graph, depth, collapse_repeats=False, open_leaf_layers=True)`` draws,
    and the module key of each.

    The draw pass makes one box per node, or per module call deeper than ``depth``, in
    the order the nodes come; box ``i`` is named ``u{i}`` in the DOT source.
    """
    unit_ids: dict[Any, int] = {}
    keys: dict[int, str] = {}
    for n in graph.nodes:
        unit: tuple[Any, ...]
        key: str | None
        if depth is not None and depth <= 0 and n.kind in ("module", "function"):
            unit, key = ("model",), None
        elif depth is not None and len(n.scope) >= depth:
            s = n.scope[depth - 1]
            unit, key = ("g", s.module_path, s.call_index), f"{s.module_path}.{s.class_name}"
        else:
            unit, key = ("n", n.id), (n.module_key if n.kind == "module" else None)
        if unit not in unit_ids:
            unit_ids[unit] = len(unit_ids)
            if key is not None:
                keys[unit_ids[unit]] = key
    return len(unit_ids), keys


def graph_svg(graph: Graph, depth: int | None = None) -> str:
    """The graph drawn as SVG, each module box and cluster carrying ``data-key="<module key>"``.

    >>> import torch, fwdtrace
    >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
    >>> 'data-key="0.Linear"' in graph_svg(g)
    True

    Repeated blocks and leaf layers are drawn in full so every block can be clicked.
    """
    from ..passes.draw import layout_bytes, to_dot

    dot = to_dot(graph, depth=depth, collapse_repeats=False, open_leaf_layers=True)
    svg = layout_bytes(dot.source, "svg").decode()
    count, keys = _unit_keys(graph, depth)
    found = _NODE.findall(svg)
    # The box order is the draw pass's; if it ever changes, boxes lose their keys rather
    # than get wrong ones (clusters keep theirs, read from their labels).
    if len(found) == count and {name for _, name in found} == {f"u{i}" for i in range(count)}:

        def node(m: re.Match[str]) -> str:
            key = keys.get(int(m.group(2)[1:]))
            attr = f' data-key="{html.escape(key)}"' if key else ""
            return f'<g id="{m.group(1)}" class="node"{attr}>' + m.group(0).split(">", 1)[1]

        svg = _NODE.sub(node, svg)

    def cluster(m: re.Match[str]) -> str:
        label = _SCOPE_LABEL.match(html.unescape(m.group(3)))
        attr = f' data-key="{html.escape(label.group(1) + "." + label.group(2))}"' if label else ""
        return m.group(1) + attr + m.group(2)

    return _CLUSTER.sub(cluster, svg)


def _number(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def histogram_svg(samples: list[dict[str, Any]], role: str, width: int = 440, height: int = 150) -> str:
    """Histograms over steps as an SVG heat map: one column per sample, darker where values are denser.

    >>> s = {"step": 1, "tensors": [{"role": "output", "index": 0, "numeric": True, "mean": 0.5,
    ...       "min": 0.0, "max": 1.0, "histogram": [1, 3], "bin_edges": [0.0, 0.5, 1.0]}]}
    >>> histogram_svg([s], "output").count("<rect class=\\"bin\\"")
    2

    Each sample's first tensor of ``role`` is drawn with its bins on one value axis (the
    y axis); a line follows the mean, red marks at the top or bottom edge say values fell
    beyond the bins. The x axis runs from the oldest sample in the buffer to the newest.
    """
    columns = []
    for s in samples:
        t = next((t for t in s["tensors"] if t["role"] == role and t.get("numeric") and t.get("bin_edges")), None)
        if t is not None:
            columns.append((s["step"], t))
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="fw-hist" data-role="{role}" '
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
    mean_points = []
    for i, (_, t) in enumerate(columns):
        x = left + i * col_w
        peak = max(t["histogram"]) or 1
        edges = t["bin_edges"]
        for b, c in enumerate(t["histogram"]):
            if c:
                y0, y1 = y(edges[b + 1]), y(edges[b])
                parts.append(f'<rect class="bin" x="{x:.1f}" y="{y0:.1f}" width="{col_w:.1f}" '
                             f'height="{max(y1 - y0, 0.5):.1f}" fill="#1f5fa8" fill-opacity="{0.1 + 0.9 * c / peak:.2f}"/>')
        for edge, count in ((top, t.get("overflow")), (top + plot_h - 2, t.get("underflow"))):
            if count:  # values beyond the arm's bins: a red mark at the edge they left by
                parts.append(f'<rect class="outside" x="{x:.1f}" y="{edge:.1f}" width="{col_w:.1f}" height="2" fill="#c0392b"/>')
        if t["mean"] is not None and math.isfinite(t["mean"]):
            mean_points.append(f"{x + col_w / 2:.1f},{y(t['mean']):.1f}")
    if mean_points:
        parts.append(f'<polyline class="mean" points="{" ".join(mean_points)}" fill="none" stroke="#d35400" stroke-width="1.5"/>')
    first, last = columns[0][0], columns[-1][0]
    parts += [
        f'<text x="{left - 4}" y="{top + 9}" text-anchor="end">{_number(hi)}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">{_number(lo)}</text>',
        f'<text x="{left}" y="{height - 5}">step {first}</text>',
        f'<text x="{width - right}" y="{height - 5}" text-anchor="end">step {last}</text>',
        "</svg>",
    ]
    return "".join(parts)
