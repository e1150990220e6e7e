"""fwdtrace's own layout: the draw pass's DOT drawn as SVG where Graphviz cannot lay out.

>>> import torch, fwdtrace
>>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
>>> svg = layered_svg(g.to_dot(depth=None).source)
>>> svg.count('class="node'), 'class="node module key:0.Linear"' in svg
(3, True)

What to draw is the draw pass's alone (:mod:`fwdtrace.passes.draw` decides the boxes, their
labels, colours, clusters, tooltips and classes, and writes them into the DOT); this module
reads that DOT back and only places it: boxes in ranks by longest path (the ranks the draw
pass's wrapping assumes, invisible edges included), each cluster a rectangle of its own
across the ranks it spans, edges as curves between ranks. The SVG has Graphviz's skeleton
(``<g id="node1" class="node ..."><title>name</title>...``), so what reads Graphviz's SVG (the
live page's keyed drawing) reads this one. Less compact than Graphviz's, crossings not
minimised: a picture where there would be none.
"""

from __future__ import annotations

import collections
import html
import re
from dataclasses import dataclass, field

__all__ = ["layered_svg", "parse_dot"]

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|->|--|[{}\[\]=;,:]|[^\s{}\[\]=;,:"]+', re.S)
_POINTS = 72.0  # DOT sizes are in inches


@dataclass
class _Cluster:
    name: str
    attrs: dict[str, str]
    parent: _Cluster | None
    items: list[_Cluster | str] = field(default_factory=list)  # boxes (by name) and clusters, in DOT order


@dataclass
class ParsedDot:
    """What :func:`parse_dot` read: the root graph (a cluster tree), boxes and edges with their attributes."""

    root: _Cluster
    boxes: dict[str, dict[str, str]]
    edges: list[tuple[str, str, dict[str, str]]]


def _unquote(token: str) -> str:
    if not token.startswith('"'):
        return token
    text = token[1:-1].replace("\\\n", "")
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] in "nlr" else m[1], text)


def parse_dot(source: str) -> ParsedDot:
    """The graphs, boxes and edges of DOT ``source`` (the subset :func:`fwdtrace.passes.draw.to_dot` writes).

    >>> d = parse_dot('digraph g { node [shape=box] a [label="x\\\\ny"] subgraph cluster_1 { label=c b } a -> b }')
    >>> d.boxes["a"], d.boxes["b"]["shape"], [e[:2] for e in d.edges], d.root.items[1].attrs["label"]
    ({'shape': 'box', 'label': 'x\\ny'}, 'box', [('a', 'b')], 'c')
    """
    tokens = [t for t in _TOKEN.findall(source) if not t.startswith(("//", "#"))]
    boxes: dict[str, dict[str, str]] = {}
    edges: list[tuple[str, str, dict[str, str]]] = []
    root = _Cluster("", {}, None)
    pos = 0

    def attr_list() -> dict[str, str]:
        nonlocal pos
        attrs: dict[str, str] = {}
        while pos < len(tokens) and tokens[pos] == "[":
            pos += 1
            while tokens[pos] != "]":
                if tokens[pos] in (",", ";"):
                    pos += 1
                    continue
                key = _unquote(tokens[pos])
                if tokens[pos + 1] == "=":
                    attrs[key] = _unquote(tokens[pos + 2])
                    pos += 3
                else:
                    attrs[key] = "true"
                    pos += 1
            pos += 1
        return attrs

    def node_id() -> str:
        nonlocal pos
        name = _unquote(tokens[pos])
        pos += 1
        if pos < len(tokens) and tokens[pos] == ":":  # a port: the box is the same
            pos += 2
            if pos < len(tokens) and tokens[pos] == ":":
                pos += 2
        return name

    def body(cluster: _Cluster, node_defaults: dict[str, str], edge_defaults: dict[str, str]) -> None:
        nonlocal pos
        node_defaults, edge_defaults = dict(node_defaults), dict(edge_defaults)
        while pos < len(tokens) and tokens[pos] != "}":
            token = tokens[pos]
            if token == ";":
                pos += 1
            elif token in ("graph", "node", "edge") and tokens[pos + 1] == "[":
                pos += 1
                attrs = attr_list()
                {"graph": cluster.attrs, "node": node_defaults, "edge": edge_defaults}[token].update(attrs)
            elif token == "subgraph" or token == "{":
                name = ""
                if token == "subgraph":
                    pos += 1
                    if tokens[pos] != "{":
                        name = _unquote(tokens[pos])
                        pos += 1
                pos += 1  # {
                child = _Cluster(name, {}, cluster)
                cluster.items.append(child)
                body(child, node_defaults, edge_defaults)
                pos += 1  # }
            elif pos + 1 < len(tokens) and tokens[pos + 1] == "=":
                cluster.attrs[_unquote(token)] = _unquote(tokens[pos + 2])
                pos += 3
            else:
                chain = [node_id()]
                while pos < len(tokens) and tokens[pos] in ("->", "--"):
                    pos += 1
                    chain.append(node_id())
                attrs = attr_list()
                if len(chain) == 1:
                    if chain[0] not in boxes:
                        boxes[chain[0]] = dict(node_defaults)
                        cluster.items.append(chain[0])
                    boxes[chain[0]].update(attrs)
                for u, v in zip(chain[:-1], chain[1:], strict=True):
                    for end in (u, v):
                        if end not in boxes:
                            boxes[end] = dict(node_defaults)
                            cluster.items.append(end)
                    edges.append((u, v, {**edge_defaults, **attrs}))

    while pos < len(tokens) and tokens[pos] != "{":
        pos += 1
    pos += 1
    body(root, {}, {})
    return ParsedDot(root, boxes, edges)


# -- placing -------------------------------------------------------------------------------------------
def _number(attrs: dict[str, str], key: str, default: float) -> float:
    try:
        return float(attrs.get(key, default))
    except ValueError:
        return default


def _text_width(text: str, size: float) -> float:
    return 0.6 * size * max((len(line) for line in text.split("\n")), default=0)


def _box_size(attrs: dict[str, str]) -> tuple[float, float]:
    """A box's width and height in points: its label's lines in its font, its margins, DOT's minimum size."""
    size = _number(attrs, "fontsize", 14)
    label = attrs.get("label", "")
    margin = [float(m) * _POINTS for m in (attrs.get("margin") or "0.11,0.055").split(",")] * 2
    width = max(_text_width(label, size) + 2 * margin[0], _number(attrs, "width", 0.75) * _POINTS)
    height = max(len(label.split("\n")) * size * 1.2 + 2 * margin[1], _number(attrs, "height", 0.5) * _POINTS)
    if attrs.get("shape") == "ellipse":
        width, height = width * 1.25, max(height, size * 2.2)
    return width, height


def _clusters(cluster: _Cluster) -> list[_Cluster]:
    out = []
    for item in cluster.items:
        if isinstance(item, _Cluster):
            out += [item, *_clusters(item)] if item.name.startswith("cluster") else _clusters(item)
    return out


def layered_svg(source: str) -> str:
    """DOT ``source`` (as :func:`fwdtrace.passes.draw.to_dot` writes it) laid out and drawn as SVG."""
    from .draw import _acyclic, _ranks

    dot = parse_dot(source)
    keys = list(dot.boxes)
    succ = _acyclic(keys, {(u, v) for u, v, _ in dot.edges if u != v})
    rank = _ranks(keys, succ)
    rankdir = dot.root.attrs.get("rankdir", "TB").upper()
    across = rankdir in ("LR", "RL")  # ranks run left to right: a box's extent along the ranks is its width
    sizes = {k: _box_size(a) for k, a in dot.boxes.items()}
    along = {k: (w if across else h) for k, (w, h) in sizes.items()}  # extent in the direction of the ranks
    aside = {k: (h if across else w) for k, (w, h) in sizes.items()}  # ...and across them
    nodesep = _number(dot.root.attrs, "nodesep", 0.25) * _POINTS
    ranksep = _number(dot.root.attrs, "ranksep", 0.5) * _POINTS
    labelled = any(a.get("label") and a.get("style") != "invis" for *_, a in dot.edges)
    pad, head = 8.0, 16.0  # a cluster's margin, and its margin on the side of its label

    # Each cluster spans the ranks of the boxes it holds; its nesting decides the room around it.
    spans: dict[int, tuple[int, int]] = {}
    level: dict[int, int] = {}

    def span(cluster: _Cluster) -> tuple[int, int] | None:
        ranks, inner = [], 0
        for item in cluster.items:
            if isinstance(item, _Cluster):
                s = span(item)
                if s is not None:
                    ranks += list(s)
                    if item.name.startswith("cluster"):
                        inner = max(inner, level[id(item)])
            else:
                ranks.append(rank[item])
        if not ranks:
            return None
        spans[id(cluster)], level[id(cluster)] = (min(ranks), max(ranks)), inner + 1
        return spans[id(cluster)]

    span(dot.root)
    clusters = [c for c in _clusters(dot.root) if id(c) in spans]
    top_rank = max(rank.values(), default=0)
    opens = [0] * (top_rank + 1)
    closes = [0] * (top_rank + 1)
    for c in clusters:
        lo, hi = spans[id(c)]
        opens[lo], closes[hi] = max(opens[lo], level[id(c)]), max(closes[hi], level[id(c)])
    before, after = (pad, pad) if across else (head, pad)  # room along the ranks per cluster level
    thickness = [max((along[k] for k in keys if rank[k] == r), default=0.0) for r in range(top_rank + 1)]
    start, position = [0.0] * (top_rank + 1), 0.0
    for r in range(top_rank + 1):
        position += opens[r] * before
        start[r] = position
        position += thickness[r] + closes[r] * after + ranksep + (12 if labelled else 0)

    # Across the ranks: boxes and clusters in DOT order, each past whatever its ranks already hold,
    # so that a cluster is one rectangle that no other box or cluster enters.
    frontier = [0.0] * (top_rank + 1)
    centre: dict[str, float] = {}
    extent: dict[int, tuple[float, float]] = {}
    first, last = (head, pad) if across else (pad, pad)

    inside: dict[str, list[int]] = {}  # a box's clusters, outermost first

    def place(cluster: _Cluster, boxed: bool, chain: tuple[int, ...] = ()) -> None:
        lo, hi = spans[id(cluster)]
        chain = (*chain, id(cluster)) if boxed else chain
        if boxed:
            left = max(frontier[lo:hi + 1])
            for r in range(lo, hi + 1):
                frontier[r] = left + first
        for item in cluster.items:
            if isinstance(item, _Cluster):
                if id(item) in spans:
                    place(item, item.name.startswith("cluster"), chain)
            else:
                r = rank[item]
                inside[item] = list(chain)
                centre[item] = frontier[r] + aside[item] / 2
                frontier[r] += aside[item] + nodesep
        if boxed:
            right = max(frontier[lo:hi + 1]) - nodesep + last
            extent[id(cluster)] = (left, right)
            for r in range(lo, hi + 1):
                frontier[r] = right + nodesep

    if keys:
        place(dot.root, False)
    length = position - ranksep - (12 if labelled else 0)
    breadth = max(frontier, default=0.0) - nodesep
    # A box alone in its rank, under no cluster but its own, is centred in its cluster (or the picture):
    # a chain of boxes of different widths then runs straight down.
    rank2count = collections.Counter(rank.values())
    for k in keys:
        r = rank[k]
        crossing = [i for i, (lo, hi) in spans.items() if lo <= r <= hi and i in extent]
        if rank2count[r] == 1 and set(crossing) <= set(inside[k]):
            left, right = (extent[inside[k][-1]][0] + first, extent[inside[k][-1]][1] - last) if inside[k] \
                else (0.0, breadth)
            centre[k] = (left + right) / 2
    graph_label = dot.root.attrs.get("label", "")
    graph_font = _number(dot.root.attrs, "fontsize", 14)
    label_room = (len(graph_label.split("\n")) * graph_font * 1.2 + 6) if graph_label else 0.0
    margin = 4.0
    # Edges, along the ranks (a) and across them (c): between neighbouring ranks an S-curve; an edge
    # that passes over ranks (a residual connection) bows out beside the boxes it passes, rather than
    # running behind them.
    far = [max((centre[k] + aside[k] / 2 for k in keys if rank[k] == r), default=0.0) for r in range(top_rank + 1)]
    for c in clusters:
        for r in range(spans[id(c)][0], spans[id(c)][1] + 1):
            far[r] = max(far[r], extent[id(c)][1])
    curves: list[tuple[str, str, dict[str, str], list[tuple[float, float]]]] = []
    bows = 0
    for u, v, attrs in dot.edges:
        if attrs.get("style") == "invis":
            continue
        ru, rv = rank[u], rank[v]
        top_u, top_v = start[ru] + (thickness[ru] - along[u]) / 2, start[rv] + (thickness[rv] - along[v]) / 2
        a_s, a_t = (top_u + along[u], top_v) if rv > ru else (top_u, top_v + along[v])
        c_s, c_t = centre[u], centre[v]
        if abs(rv - ru) == 1:
            mid = (a_s + a_t) / 2
            controls = [(a_s, c_s), (mid, c_s), (mid, c_t), (a_t, c_t)]
        else:  # past the boxes of the ranks between, one lane further out per such edge
            passed = range(min(ru, rv) + 1, max(ru, rv)) or range(ru, ru + 1)
            bow = max(far[r] for r in passed) + 14 + 6 * (bows % 4)
            bows += 1
            step = ranksep if a_t >= a_s else -ranksep
            controls = [(a_s, c_s), (a_s + step, bow), (a_t - step, bow), (a_t, c_t)]
            breadth = max(breadth, bow + 6)
        curves.append((u, v, attrs, controls))
    width, height = (length, breadth) if across else (breadth, length)
    x_offset = margin + max(0.0, _text_width(graph_label, graph_font) - width) / 2  # centred under a wider caption
    width = max(width, _text_width(graph_label, graph_font))
    label_top = dot.root.attrs.get("labelloc", "b") == "t"
    y_offset = margin + (label_room if label_top else 0)

    def point(a: float, c: float) -> tuple[float, float]:
        """A position along the ranks and across them as SVG x, y, in the direction ``rankdir`` says."""
        if rankdir in ("BT", "RL"):
            a = length - a
        x, y = (a, c) if across else (c, a)
        return x + x_offset, y + y_offset

    def box_rect(k: str) -> tuple[float, float, float, float]:
        a0 = start[rank[k]] + (thickness[rank[k]] - along[k]) / 2
        x, y = point(a0 + along[k] / 2, centre[k])
        w, h = sizes[k]
        return x - w / 2, y - h / 2, w, h

    total_w, total_h = width + 2 * margin, height + 2 * margin + label_room
    out = ['<?xml version="1.0" encoding="UTF-8" standalone="no"?>',
           "<!-- Drawn by fwdtrace's own layout: Graphviz could not lay out here -->",
           f'<svg width="{total_w:.0f}pt" height="{total_h:.0f}pt" viewBox="0 0 {total_w:.2f} {total_h:.2f}" '
           'xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">',
           '<defs><marker id="fwdtrace-arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
           'markerHeight="6" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="context-stroke"/>'
           "</marker></defs>",
           '<g id="graph0" class="graph">', f"<title>{_esc(dot.root.name)}</title>",
           f'<rect x="0" y="0" width="{total_w:.2f}" height="{total_h:.2f}" fill="white" stroke="none"/>']
    if graph_label:
        y = margin + graph_font if label_top else total_h - label_room + graph_font
        out.append(_text(graph_label, total_w / 2, y, graph_font, "middle", dot.root.attrs))

    for i, c in enumerate(clusters, 1):
        lo, hi = spans[id(c)]
        a0 = start[lo] - (level[id(c)]) * before
        a1 = start[hi] + thickness[hi] + level[id(c)] * after
        c0, c1 = extent[id(c)]
        (x0, y0), (x1, y1) = point(a0, c0), point(a1, c1)
        x, y, w, h = min(x0, x1), min(y0, y1), abs(x1 - x0), abs(y1 - y0)
        attrs = c.attrs
        size = _number(attrs, "fontsize", graph_font)
        out.append(f'<g id="clust{i}" class="cluster{_class(attrs)}">')
        out.append(f"<title>{_esc(c.name)}</title>")
        out.append(f'<g id="a_clust{i}"><a xlink:title="{_esc(attrs.get("tooltip", attrs.get("label", "")))}">')
        out.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}"{_stroke(attrs, rounded=True)} '
                   f'fill="{_esc(attrs.get("fillcolor", "none") if "filled" in attrs.get("style", "") else "none")}"/>')
        if attrs.get("label"):
            anchor, tx = ("start", x + 4) if attrs.get("labeljust") == "l" else ("middle", x + w / 2)
            out.append(_text(attrs["label"], tx, y + size + 2, size, anchor, attrs))
        out.append("</a></g></g>")

    for edge_no, (u, v, attrs, controls) in enumerate(curves, 1):
        (sx, sy), (c1x, c1y), (c2x, c2y), (tx, ty) = (point(a, c) for a, c in controls)
        path = f"M{sx:.2f},{sy:.2f} C{c1x:.2f},{c1y:.2f} {c2x:.2f},{c2y:.2f} {tx:.2f},{ty:.2f}"
        colour = _esc(attrs.get("color", "black"))
        dash = ' stroke-dasharray="5,2"' if "dashed" in attrs.get("style", "") else ""
        out.append(f'<g id="edge{edge_no}" class="edge">')
        out.append(f"<title>{_esc(u)}&#45;&gt;{_esc(v)}</title>")
        out.append(f'<g id="a_edge{edge_no}"><a xlink:title="{_esc(attrs.get("tooltip", ""))}">')
        out.append(f'<path fill="none" stroke="{colour}"{dash} d="{path}" marker-end="url(#fwdtrace-arrow)"/>')
        out.append("</a></g>")
        label = attrs.get("label") or attrs.get("xlabel")
        if label:  # at the curve's middle (its control points' midpoint, for a cubic through both)
            size = _number(attrs, "fontsize", 14)
            lx, ly = (sx + 3 * c1x + 3 * c2x + tx) / 8, (sy + 3 * c1y + 3 * c2y + ty) / 8
            at = (lx, ly - 4, "middle") if across else (lx + 3, ly + size / 3, "start")  # beside the line
            out.append(_text(label, at[0], at[1], size, at[2], attrs))
        out.append("</g>")

    for i, k in enumerate(keys, 1):
        attrs = dot.boxes[k]
        if attrs.get("style") == "invis":
            continue
        x, y, w, h = box_rect(k)
        style = attrs.get("style", "")
        fill = _esc(attrs.get("fillcolor", attrs.get("color", "lightgrey"))) if "filled" in style else "none"
        stroke = _stroke(attrs, rounded=False)
        shape = attrs.get("shape", "ellipse")
        out.append(f'<g id="node{i}" class="node{_class(attrs)}">')
        out.append(f"<title>{_esc(k)}</title>")
        out.append(f'<g id="a_node{i}"><a xlink:title="{_esc(attrs.get("tooltip", attrs.get("label", k)))}">')
        if shape in ("ellipse", "oval", "circle"):
            out.append(f'<ellipse cx="{x + w / 2:.2f}" cy="{y + h / 2:.2f}" rx="{w / 2:.2f}" ry="{h / 2:.2f}" '
                       f'fill="{fill}"{stroke}/>')
        else:
            if shape == "box3d":  # the box behind: a run of blocks drawn as one
                out.append(f'<rect x="{x + 3:.2f}" y="{y - 3:.2f}" width="{w:.2f}" height="{h:.2f}" '
                           f'fill="{fill}"{stroke}/>')
            rx = ' rx="5"' if "rounded" in style else ""
            out.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}"{rx} fill="{fill}"{stroke}/>')
        size = _number(attrs, "fontsize", 14)
        lines = attrs.get("label", k).split("\n")
        first_y = y + h / 2 - (len(lines) - 1) * size * 0.6 + size * 0.35
        out.append(_text("\n".join(lines), x + w / 2, first_y, size, "middle", attrs))
        out.append("</a></g></g>")
    out += ["</g>", "</svg>", ""]
    return "\n".join(out)


def _esc(text: str) -> str:
    return html.escape(text, quote=True).replace("\n", "&#10;")


def _class(attrs: dict[str, str]) -> str:
    return f" {_esc(attrs['class'])}" if attrs.get("class") else ""


def _stroke(attrs: dict[str, str], rounded: bool) -> str:
    style = attrs.get("style", "")
    parts = f' stroke="{_esc(attrs.get("color", "black"))}"'
    if attrs.get("penwidth"):
        parts += f' stroke-width="{_esc(attrs["penwidth"])}"'
    if "dashed" in style:
        parts += ' stroke-dasharray="5,2"'
    if rounded and "rounded" in style:
        parts += ' rx="6"'
    return parts


def _text(text: str, x: float, y: float, size: float, anchor: str, attrs: dict[str, str]) -> str:
    """``text``'s lines as one ``<text>`` per line, from baseline ``y`` down, as Graphviz writes them."""
    font = _esc(attrs.get("fontname", "Helvetica"))
    return "\n".join(f'<text xml:space="preserve" text-anchor="{anchor}" x="{x:.2f}" y="{y + i * size * 1.2:.2f}" '
                     f'font-family="{font},sans-Serif" font-size="{size:.2f}">{_esc(line)}</text>'
                     for i, line in enumerate(text.split("\n")))
