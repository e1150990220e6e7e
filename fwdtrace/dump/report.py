"""The result of comparing two dumps: ``DumpReport`` and its rows, as a table, a picture or Model Explorer files."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FwdtraceError
from ..graph import Graph

if TYPE_CHECKING:
    from ..passes.model_explorer import ModelExplorerFiles



@dataclass
class DumpRow:
    """One tensor of dump ``a`` against the same tensor of dump ``b``."""

    group: str
    key: str
    module_path: str
    name: str
    shape: list[int]
    cosine: float | None
    max_abs: float | None
    max_rel: float | None
    allclose: bool
    note: str = ""
    norm_rel: float | None = None  # |a - b| / max(|a|, |b|) over the whole tensor
    precision: str = ""  # the arithmetic it is judged by: the coarser of the two runs' (see fwdtrace.precision)
    rounding: str | None = None  # not allclose, but within what this rounding explains ("TF32", "bfloat16")
    function: str = ""  # a function call's function ("torch.Tensor.softmax"), "" for a module call
    one_sided: bool = False  # the call is in one run only (an extra cast, an added layer)
    call_index: int = 0  # which call of its key
    key_b: str = ""  # the call's key in run b where it differs (a renamed layer, matched through the graphs)
    # msprobe's error ratios: the share of elements whose relative error exceeds 1/1000 and 5/1000
    one_thousandth: float | None = None
    five_thousandths: float | None = None
    nonfinite_a: int = 0  # inf and NaN elements in a (by statistics: its nans + infs)
    nonfinite_b: int = 0
    only_a: int = 0  # inf or NaN in a where b is finite
    only_b: int = 0
    magnitude: float | None = None  # the largest finite |element| of either run
    # the norm-relative error the call added beyond its inputs' (fwdtrace.precision.added_error), on an output
    # row judged so; None where not judged
    added: float | None = None
    # a difference no rounding explains but the dtype does: an argument that follows it (finfo.min), by statistics
    explained: str = ""
    # the parameter or buffer an input is ("h.1.mlp.c_fc.weight"): stored, not computed, so judged by its dtypes alone
    # (a float32 weight of an autocast run is no bfloat16 value)
    parameter: str = ""
    # a call the dump does not hold (a Linear in a dump of function calls): the held tensor this output of it was
    # read as, the input of the call that took it in ("040_gelu/input0"); "" for a call the dump holds
    read_as: str = ""

    @property
    def agrees(self) -> bool:
        """Allclose, within what the runs' rounding explains, or explained by a constant that follows the dtype."""
        return self.allclose or self.rounding is not None or bool(self.explained)


@dataclass(frozen=True)
class Divergence:
    """Where two runs part: the call (its key and which call of it), and why.

    ``kind`` is ``"overflow"`` (its inputs are finite in the run that overflows, its outputs hold
    inf or NaN where the other run's are finite) or ``"values"`` (its inputs agree, its outputs do
    not, or it added more error than its math's rounding explains).
    """

    name: str  # as first_divergence names it: a module by its path, a function call by its key
    key: str
    call_index: int
    group: str  # the call's group in dump a, "" for a call the dump does not hold (DumpRow.read_as)
    kind: str
    reason: str


@dataclass
class DumpReport:
    """The rows of :func:`compare_dumps`, in execution order, and where the runs first differ."""

    path_a: str
    path_b: str
    rtol: float
    atol: float
    rows: list[DumpRow] = field(default_factory=list)
    first_divergence: str | None = None
    # the call first_divergence names, with its call index and why (an overflow with its counts)
    divergence: Divergence | None = None
    incomplete: dict[str, str] = field(default_factory=dict)  # path -> "incomplete: stopped after ..."
    # path -> how that run computed (see fwdtrace.precision.math_record), None for a dump written without it
    math: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # the graph of run a's step (of b's where a has none), stored by a dump of function calls
    graph: Graph | None = field(default=None, repr=False)
    # the dumps that hold no graph (of module calls only): calls were matched by key and call order only
    without_graph: list[str] = field(default_factory=list)
    # (key, call index) of the call first_divergence names where the dump does not hold it (a Linear in a dump of
    # function calls): the difference starts inside it, its tensors read where the held calls around it take them
    starts_inside: tuple[str, int] | None = None

    @property
    def first_call(self) -> tuple[str, int] | None:
        """The call first_divergence names, (key, call index): a key (``add``) may be shared by calls equal in
        both runs."""
        return (self.divergence.key, self.divergence.call_index) if self.divergence is not None else None

    @property
    def equal(self) -> bool:
        """Every tensor of either dump is in the other and allclose, and both dumps are complete."""
        return not self.incomplete and all(r.allclose for r in self.rows)

    @property
    def agree(self) -> bool:
        """Both dumps are complete and every tensor is allclose or differs by what the runs' rounding explains."""
        return not self.incomplete and all(r.agrees for r in self.rows)

    @property
    def only_in_a(self) -> list[str]:
        """The keys of the calls only run ``a`` made (matched by key and call order, and through the graphs
        where the dumps hold them), in its order."""
        return self._one_sided("missing in b")

    @property
    def only_in_b(self) -> list[str]:
        """The keys of the calls only run ``b`` made: an extra cast, an added layer (a renamed one too, where a
        dump holds no graph)."""
        return self._one_sided("missing in a")

    @property
    def renamed(self) -> list[tuple[str, str]]:
        """(key in ``a``, key in ``b``) of the calls matched through the graphs under another key, in ``a``'s
        order: a renamed layer (``("fc.Linear", "proj.Linear")``) and the calls inside it."""
        return list(dict.fromkeys((r.key, r.key_b) for r in self.rows if r.key_b))

    def render(self, path: str | os.PathLike[str], depth: int | str | None = "auto", **options: Any) -> str:
        """Draw the run's graph with each box coloured by its call's error and the first divergence in red.

        >>> import tempfile, torch, fwdtrace
        >>> paths = []
        >>> for scale in (1.0, 2.0):
        ...     d = fwdtrace.Dumper(tempfile.mkdtemp(), calls="all"); model = torch.nn.Sequential(torch.nn.Linear(1, 1))
        ...     _ = torch.nn.init.constant_(model[0].weight, scale); d.register(model, grads=False)
        ...     _ = model(torch.ones(1, 1)); paths += d.remove()
        >>> fwdtrace.compare_dumps(*paths).render(tempfile.mktemp(suffix=".svg")).endswith(".svg")
        True

        Colours as :func:`fwdtrace.render_side_by_side`'s (:data:`fwdtrace.onnx.compare.ERROR_COLORS`):
        within a hundredth of ``rtol``, within tolerance (or what rounding explains), beyond, and
        saturated where the error is inf or NaN (an overflow in one run); a legend says which. A
        box's tooltip gives its call's worst output error ("inf" where it is) and its inf/NaN counts.
        The red outline is on the call :attr:`divergence` names (its key and call index). ``depth`` and ``options`` are
        :meth:`fwdtrace.Graph.render`'s. Needs a dump that holds its run's graph: one of
        ``Dumper(..., calls="functions")`` or ``calls="all"``, whose step runs inside a trace (a
        dump of module calls only runs no trace, so it has none). Returns the path written.
        """
        from ..onnx.compare import error_color, error_legend
        from ..passes.draw import HIGHLIGHT_COLOR

        graph, worst = self._worst_by_node("DumpReport.render()")
        fills = {n: error_color(_worst_error(r), self.rtol, r.agrees) for n, r in worst.items()}
        notes = {n: f"max rel err {_num(_worst_error(r))}, cosine {_num(r.cosine)}"
                 + (f", {r.nonfinite_a} inf/NaN in a, {r.nonfinite_b} in b" if r.nonfinite_a or r.nonfinite_b else "")
                 + (f", within {r.rounding} rounding" if r.rounding else "" if r.allclose
                    else f", {r.explained}" if r.explained else ", diverges")
                 for n, r in worst.items()}
        first = self._first_node(graph, worst)
        legend = [*error_legend(self.rtol), (HIGHLIGHT_COLOR, f"first divergence: {self.first_divergence}")] \
            if first else error_legend(self.rtol)
        return graph.render(path, depth, fills=fills, notes=notes, highlight=first, legend=legend, **options)

    def to_model_explorer(self, folder: str | os.PathLike[str]) -> ModelExplorerFiles:
        """Write the run's graph for Model Explorer with each call's errors as node data and the first
        divergence in red: ``diff.json`` and ``diff.{cosine,norm_rel,max_abs,max_rel,verdict}.json`` in
        ``folder`` (made if its parent exists).

        >>> files = fwdtrace.compare_dumps("a.hdf5", "b.hdf5").to_model_explorer("diff")  # doctest: +SKIP
        >>> sorted(files.node_data)  # doctest: +SKIP
        ['cosine', 'max_abs', 'max_rel', 'norm_rel', 'verdict']

        A call's numbers are its worst output's, as :meth:`render` colours its box; its verdict is
        0 allclose, 1 within what the runs' rounding explains, 2 diverges (see
        :func:`fwdtrace.passes.model_explorer.errors_to_model_explorer`). Open them with
        ``model-explorer diff.json --node_data_paths=diff.max_rel.json,diff.verdict.json``. Needs
        dumps that hold their run's graph, as :meth:`render` does. Returns the files written.
        """
        from ..passes.model_explorer import CallErrors, errors_to_model_explorer

        caller = "DumpReport.to_model_explorer()"
        graph, worst = self._worst_by_node(caller)
        errors = {n: CallErrors(r.cosine, r.norm_rel, r.max_abs, _worst_error(r), 0 if r.allclose else 1 if r.agrees else 2,
                                r.only_a + r.only_b) for n, r in worst.items()}
        first = self._first_node(graph, worst)
        return errors_to_model_explorer(graph, folder, errors, highlight=first, caller=caller)

    def _worst_by_node(self, caller: str) -> tuple[Graph, dict[int, DumpRow]]:
        """The run's graph and, per node of a call compared in both runs, its worst output row."""
        if self.graph is None:
            raise FwdtraceError(f"{caller} expected dumps that hold their run's graph, written by "
                                "Dumper(..., calls=\"functions\") or calls=\"all\", got dumps of module calls only")
        call2node = {(n.key, n.call_index): n.id for n in self.graph.nodes if n.kind in ("module", "function")}
        worst: dict[int, DumpRow] = {}
        for row in self.rows:
            node = call2node.get((row.key, row.call_index))
            if node is None or row.one_sided or not row.name.startswith("output"):
                continue
            if node not in worst or _badness(row) > _badness(worst[node]):
                worst[node] = row
        return self.graph, worst

    def _first_node(self, graph: Graph, worst: dict[int, DumpRow] | None = None) -> list[int]:
        """The node of the call the report names as the first divergence, by key and call index (a key two calls
        share names neither alone), if the graph holds it; where the difference starts inside a call the dump does
        not hold, that call's node. Never a call whose values are equal in both runs."""
        d = self.divergence
        if d is None:
            return []
        call = self.starts_inside or (d.key, d.call_index)
        nodes = [n.id for n in graph.nodes if n.kind in ("module", "function") and (n.key, n.call_index) == call][:1]
        if nodes and worst is not None and nodes[0] in worst and worst[nodes[0]].allclose:
            return []
        return nodes

    def _one_sided(self, note: str) -> list[str]:
        groups = {r.group: r.key for r in self.rows if r.one_sided and r.note == note}
        return list(groups.values())

    def to_text(self, only_diverged: bool = False) -> str:
        """The table the ``fwdtrace dump-diff`` command prints."""
        header = ("#", "group", "key", "name", "shape", "cosine", "max_abs", "max_rel", "norm_rel", ">1e-3", ">5e-3",
                  "allclose")
        body = []
        for i, r in enumerate(self.rows):
            if only_diverged and r.agrees:
                continue
            verdict = "yes" if r.allclose else f"within {r.rounding} rounding" if r.rounding \
                else f"explained: {r.explained}" if r.explained else "NO"
            nonfinite = f"inf/NaN {r.nonfinite_a} in a, {r.nonfinite_b} in b" if r.nonfinite_a or r.nonfinite_b else ""
            notes = "; ".join(n for n in (r.note, nonfinite) if n)
            body.append((
                str(i), r.group or "(not held)", r.key + (f" (b: {r.key_b})" if r.key_b else ""), r.name, "x".join(map(str, r.shape)) or "scalar", _num(r.cosine),
                _num(r.max_abs), _num(r.max_rel), _num(r.norm_rel), _num(r.one_thousandth), _num(r.five_thousandths),
                verdict + (f" ({notes})" if notes else ""),
            ))
        widths = [max(len(h), *(len(row[j]) for row in body)) if body else len(h) for j, h in enumerate(header)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *body]]
        lines += [f"{Path(p).name}: {status}" for p, status in self.incomplete.items()]
        lines += [f"calls only in {side}: {', '.join(keys)}" for side, keys in (("a", self.only_in_a),
                                                                              ("b", self.only_in_b)) if keys]
        if self.without_graph and (self.only_in_a or self.only_in_b):
            sides = [side for side, p in (("a", self.path_a), ("b", self.path_b)) if p in self.without_graph]
            which = "neither dump holds a graph" if len(sides) == 2 else f"dump {sides[0]} holds no graph"
            lines.append(f"calls matched by key and call order only: {which} (a dump of module calls), so a renamed "
                         "layer is one call only in a and one only in b")
        lines += self._math_lines()
        explained = [r for r in self.rows if not r.allclose and r.rounding]
        if self.equal:
            lines.append(f"equal: {len(self.rows)} tensors allclose (rtol={self.rtol:g}, atol={self.atol:g})")
        elif all(r.agrees for r in self.rows) and self.incomplete:
            lines.append(f"not comparable as whole runs: {len(self.rows)} tensors agree, but a dump is incomplete")
        elif self.agree:
            labels = ", ".join(dict.fromkeys(str(r.rounding) for r in explained))
            by_dtype = [r for r in self.rows if not r.allclose and not r.rounding and r.explained]
            dtype_text = f", {len(by_dtype)} explained by a constant that follows the dtype" if by_dtype else ""
            rounding_text = f", {len(explained)} within what {labels} rounding explains" if explained else ""
            lines.append(f"agree: {len(self.rows) - len(explained) - len(by_dtype)} tensors allclose "
                         f"(rtol={self.rtol:g}, atol={self.atol:g}){rounding_text}{dtype_text}")
        else:
            bad = sum(not r.agrees for r in self.rows)
            within = f" ({len(explained)} more within rounding)" if explained else ""
            d = self.divergence
            why = f" (call {d.call_index} of {d.key}: {d.reason})" if d is not None else ""
            if self.starts_inside is not None:
                why += (f"; the difference starts inside {self.starts_inside[0]} (call {self.starts_inside[1]}), "
                        "a call the dump does not hold: its outputs are read where the calls after it take them in")
            lines.append(f"{bad} of {len(self.rows)} tensors differ{within}; first divergence: {self.first_divergence}{why}")
        return "\n".join(lines)

    def _math_lines(self) -> list[str]:
        """How each run computed where that matters (the runs computed differently, or a difference was put
        down to rounding), and that a dump does not say so and the tolerances are the defaults."""
        records = list(self.math.values())
        shown = any(r.rounding for r in self.rows) or any(r != records[0] for r in records)
        lines = []
        for path, record in self.math.items():
            if record is None:
                lines.append(f"{Path(path).name}: no math record (written by an older fwdtrace): elementwise "
                             "tolerances are the defaults, no difference is put down to rounding")
            elif shown:
                device = str(record.get("device"))
                tf32 = [n for n, k in (("matmul", "matmul_allow_tf32"), ("cuDNN", "cudnn_allow_tf32")) if record.get(k)]
                tf32_text = f", TF32 allowed for {' and '.join(tf32) or 'neither matmul nor cuDNN'}" \
                    if device.startswith("cuda") else ""  # the switches are torch's on any device, used on CUDA only
                lines.append(f"{Path(path).name}: {device} ({record.get('device_name')}), autocast "
                             f"{record.get('autocast')}{tf32_text}, float32 matmul precision "
                             f"{record.get('float32_matmul_precision')}, torch {record.get('torch')}")
        return lines

    def __str__(self) -> str:
        return self.to_text()


def _badness(row: DumpRow) -> tuple[int, float]:
    """How far a row is from agreeing: diverging before within rounding before allclose, then by max_rel."""
    rank = 0 if row.allclose else 1 if row.agrees else 2
    return rank, _worst_error(row)


def _worst_error(row: DumpRow) -> float:
    """A row's max relative error, inf where it is unknown or NaN (an inf against a number, NaN against NaN-free):
    the worst, so the picture colours it so and says "inf" rather than leaving it blank."""
    x = row.max_rel
    if row.only_a or row.only_b:
        return math.inf
    return x if x is not None and not math.isnan(x) else math.inf


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _call_name(row: DumpRow) -> str:
    """How ``first_divergence`` names a row's call: a module by its path, a function call by its key."""
    return row.key if row.function else row.module_path or row.key
