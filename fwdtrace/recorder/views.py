"""Pictures of one tensor: heatmap, histogram and 2D PCA frames, drawn with matplotlib's Agg backend.

Two halves, run in two processes: :func:`reduce` runs in the training process and cuts a
tensor down to what the views draw (a 2D slice, a flat sample, sampled rows), as numpy
arrays; :func:`draw_frame` runs in a worker and turns them into an RGB frame. Frames have a
fixed size (640x480, a multiple of 16 as video encoders want) so every frame of a video matches.
A histogram keeps its bins from frame to frame (:class:`~fwdtrace.instrument.bins.SteadyBins`, the live
page's bins too): its x axis moves only when a value leaves the bins, so a video shows drift.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..instrument.bins import DEFAULT_BINS, SteadyBins
from ..statistics.rule import as_dict

__all__ = ["VIEWS", "FRAME_SIZE", "resolve_view", "reduce", "draw_frame", "FrameCanvas"]

VIEWS = ("auto", "heatmap", "histogram", "pca")
FRAME_SIZE = (640, 480)  # width, height in pixels

# Caps on what crosses to a worker: a picture shows no more than this anyway.
HEATMAP_MAX = 256  # rows and columns of a heatmap
HISTOGRAM_BINS = DEFAULT_BINS  # the live page bins the same way
PCA_ROWS_MAX = 512  # points of a PCA scatter (the seed's PCA of every row took seconds)
PCA_FEATURES_MAX = 1024


def resolve_view(view: str, shape: tuple[int, ...]) -> str:
    """``"auto"`` by shape, as pytorch_inspector chose: a heatmap for 2D and ``[1, H, W]``, else a histogram.

    >>> resolve_view("auto", (1, 8, 8)), resolve_view("auto", (4, 3, 8, 8)), resolve_view("pca", (4, 3))
    ('heatmap', 'histogram', 'pca')
    """
    if view != "auto":
        return view
    if len(shape) == 2 or (len(shape) == 3 and shape[0] == 1):
        return "heatmap"
    return "histogram"


def _strided(n: int, cap: int) -> slice:
    return slice(None, None, max(1, -(-n // cap)))


def reduce(tensor: Any, views: tuple[str, ...], bins: int | Sequence[float] = DEFAULT_BINS) -> dict[str, Any]:
    """What the views of ``tensor`` need, as numpy arrays, plus its shape and value range; for a histogram the
    tensor's :mod:`fwdtrace.statistics` summary with ``bins`` bins (or on those edges), which the worker moves
    onto the bins it keeps.

    Runs in the training process on a detached CPU tensor; every result is small (capped).

    >>> import torch
    >>> out = reduce(torch.arange(6.0).reshape(2, 3), ("auto",))
    >>> out["heatmap"].shape, out["shape"], out["range"]
    ((2, 3), [2, 3], (0.0, 5.0))
    """
    import torch  # here: the worker, which imports this module to draw, never imports torch

    from .._host import host, to_numpy

    t = host(tensor)  # copied here, in the training process: no CUDA tensor is ever shared with a worker
    if not t.is_floating_point():
        t = t.float()
    shape = list(t.shape)
    payload: dict[str, Any] = {"shape": shape}
    if t.numel() == 0:
        payload["range"] = (0.0, 0.0)
        return payload
    lo, hi = torch.aminmax(t)
    payload["range"] = (float(lo), float(hi))
    for view in {resolve_view(v, tuple(shape)) for v in views}:
        if view == "heatmap":
            m = t
            while m.dim() > 2:  # [1, H, W] -> [H, W]; beyond that, the first 2D slice ([0, 0, :, :])
                m = m[0]
            if m.dim() < 2:
                m = m.reshape(1, -1)
            m = m[_strided(m.shape[0], HEATMAP_MAX), _strided(m.shape[1], HEATMAP_MAX)]
            payload["heatmap"] = to_numpy(m, torch.float32).copy()
        elif view == "histogram":  # its summary (fwdtrace.statistics), on the bins the worker keeps
            from ..statistics.engine import summarize

            count = bins if isinstance(bins, int) else len(bins) - 1
            payload["histogram"] = to_numpy(summarize(t, count, None if isinstance(bins, int) else list(bins)))
        elif view == "pca":
            if t.dim() == 4:  # [N, C, H, W]: each pixel a point with C features
                rows = t.movedim(1, -1).reshape(-1, t.shape[1])
            else:
                rows = t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)
            rows = rows[_strided(rows.shape[0], PCA_ROWS_MAX), _strided(rows.shape[1], PCA_FEATURES_MAX)]
            payload["pca"] = to_numpy(rows, torch.float32).copy()
    return payload


def _range_text(lo: float, hi: float) -> str:
    return f"values {lo:.4g} .. {hi:.4g}"


class FrameCanvas:
    """One matplotlib figure per video, its artists made once and updated for each frame.

    No pyplot (no global state) and no re-layout per frame: updating the data of an image,
    a histogram outline and a scatter is a fraction of the cost of drawing a figure anew.
    """

    def __init__(self, bins: int | Sequence[float] = HISTOGRAM_BINS) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        w, h = FRAME_SIZE
        self.figure = Figure(figsize=(w / 100, h / 100), dpi=100)
        self.canvas = FigureCanvasAgg(self.figure)
        self.title = self.figure.suptitle("", fontsize=11, y=0.975)
        self.panels: dict[str, _Panel] = {}
        self.bins = bins

    def draw(self, title: str, payload: dict[str, Any], views: tuple[str, ...]) -> np.ndarray:
        """An RGB ``uint8`` frame of shape ``[480, 640, 3]``: one panel per view under a title."""
        shape = payload["shape"]
        lo, hi = payload["range"]
        self.title.set_text(f"{title}\n{shape}  {_range_text(lo, hi)}")
        names = list(dict.fromkeys(resolve_view(v, tuple(shape)) for v in views))
        if list(self.panels) != names:  # first frame, or "auto" chose another view for a new shape
            self.figure.clear()
            self.title = self.figure.suptitle(self.title.get_text(), fontsize=11, y=0.975)
            slot = 0.98 / len(names)  # each panel's share of the width: y labels left, a colorbar right
            self.panels = {
                name: _Panel(
                    self.figure,
                    name,
                    self.bins,
                    (0.02 + i * slot + 0.09, 0.11, slot - 0.09 - (0.11 if name == "heatmap" else 0.03), 0.72),
                )
                for i, name in enumerate(names)
            }
        for name, panel in self.panels.items():
            panel.update(payload.get(name), (lo, hi))
        self.canvas.draw()
        return np.asarray(self.canvas.buffer_rgba())[..., :3].copy()


class _Panel:
    """The axes of one view and the artists whose data each frame replaces."""

    def __init__(self, figure: Any, view: str, bins: int | Sequence[float], box: tuple[float, float, float, float]) -> None:
        self.view = view
        self.bins = SteadyBins(bins)  # the histogram's, kept across frames
        self.peak = 1  # the histogram's highest count so far: its y axis only grows, as its x axis
        self.ax = ax = figure.add_axes(box)
        self.note = ax.text(0.5, 0.5, "", ha="center", va="center", transform=ax.transAxes)
        if view == "heatmap":
            self.artist = ax.imshow(np.zeros((1, 1)), aspect="auto", cmap="viridis", interpolation="nearest")
            left, bottom, width, height = box
            colorbar = figure.colorbar(self.artist, cax=figure.add_axes((left + width + 0.015, bottom, 0.02, height)))
            colorbar.formatter.set_powerlimits((-2, 3))  # gradients: "1e-4" above, short tick labels
        elif view == "histogram":
            self.artist = ax.stairs([0.0], [0.0, 1.0], fill=True, color="tab:blue")
            ax.set_xlabel("value")
        else:
            self.artist = ax.scatter([0.0], [0.0], s=6, alpha=0.6)
        if view != "heatmap":
            ax.ticklabel_format(style="sci", scilimits=(-2, 3))

    def update(self, data: np.ndarray | None, value_range: tuple[float, float] = (0.0, 0.0)) -> None:
        if data is None or data.size == 0:
            self.artist.set_visible(False)
            self.note.set_text("empty tensor")
            return
        self.artist.set_visible(True)
        self.note.set_text("")
        if self.view == "heatmap":
            self._heatmap(data)
        elif self.view == "histogram":
            self._histogram(data, value_range)
        else:
            self._pca(data)

    def _heatmap(self, data: np.ndarray) -> None:
        rows, cols = data.shape
        finite = data[np.isfinite(data)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        self.artist.set_data(data)
        self.artist.set_extent((-0.5, cols - 0.5, rows - 0.5, -0.5))
        self.artist.set_clim(lo, hi if hi > lo else lo + 1e-12)
        self.ax.set_xlim(-0.5, cols - 0.5)
        self.ax.set_ylim(rows - 0.5, -0.5)
        self.ax.set_xlabel(f"column ({cols} shown)")
        self.ax.set_ylabel(f"row ({rows} shown)")

    def _histogram(self, vector: np.ndarray, value_range: tuple[float, float]) -> None:
        d = as_dict(vector, self.bins.bins)
        if d["finite"]:
            # The whole tensor's range: its extremes stay on the axis.
            self.bins.fit(min(value_range[0], d["min"]), max(value_range[1], d["max"]))
        if self.bins.range is None:  # nothing finite seen yet
            self.bins.fit(0.0, 1.0)
        counts, under, over = self.bins.counts_of(vector)
        edges = self.bins.edges
        self.artist.set_data(counts, edges)
        self.ax.set_xlim(edges[0], edges[-1])
        self.peak = max(self.peak, int(counts.max()))
        self.ax.set_ylim(0, self.peak * 1.05)
        self.ax.set_ylabel("count")
        count, bad = int(d["count"]), int(d["nans"] + d["infs"])
        binned = int(counts.sum()) + under + over
        text = f"{count} values" + (f", {binned} binned" if binned < count - bad else "")
        text += f", {bad} NaN/Inf left out" if bad else ""
        text += f", {under + over} outside the bins" if under + over else ""  # fixed edges only
        self.ax.set_title(text, fontsize=9, color="tab:red" if bad or under + over else "black")

    def _pca(self, rows: np.ndarray) -> None:
        rows = rows[np.isfinite(rows).all(axis=1)]
        if rows.ndim != 2 or rows.shape[0] < 2 or rows.shape[1] < 2:
            self.artist.set_visible(False)
            self.note.set_text("PCA needs 2+ rows and features")
            return
        centred = rows - rows.mean(axis=0)
        _, s, vt = np.linalg.svd(centred, full_matrices=False)
        # An SVD's signs are arbitrary; fix them so a steady activation does not flip frame to frame.
        signs = np.sign(vt[:2][np.arange(2), np.abs(vt[:2]).argmax(axis=1)])
        points = centred @ (vt[:2].T * signs)
        var = s**2 / max(float((s**2).sum()), 1e-30)
        self.artist.set_offsets(points)
        (x0, y0), (x1, y1) = points.min(axis=0), points.max(axis=0)
        pad_x, pad_y = max(1e-12, 0.05 * (x1 - x0)), max(1e-12, 0.05 * (y1 - y0))
        self.ax.set_xlim(x0 - pad_x, x1 + pad_x)
        self.ax.set_ylim(y0 - pad_y, y1 + pad_y)
        self.ax.set_xlabel(f"PC1 ({100 * var[0]:.0f}% var.)", loc="left")  # leaves room for an offset ("1e-4") right
        self.ax.set_ylabel(f"PC2 ({100 * var[1]:.0f}% var.)")
        self.ax.set_title(f"{rows.shape[0]} points, {rows.shape[1]} features", fontsize=9)


def draw_frame(title: str, payload: dict[str, Any], views: tuple[str, ...]) -> np.ndarray:
    """An RGB frame for one payload of :func:`reduce` (a new figure; workers keep one per video).

    >>> import torch
    >>> frame = draw_frame("0.Linear forward, step 0", reduce(torch.eye(4), ("heatmap",)), ("heatmap",))
    >>> frame.shape, frame.dtype
    ((480, 640, 3), dtype('uint8'))
    """
    return FrameCanvas().draw(title, payload, views)
