"""Numbers beside the structure: where an ONNX model stops computing what eager PyTorch computes.

A pass over a finished structural comparison (:mod:`fwdtrace.onnx.compare`): each matched
call already names the ONNX node that computes its result, so the ONNX value holding that
result is read from the match, never guessed. The model runs eagerly, once per batch,
keeping a copy of every matched call's output as it was made (a later in-place write, a
``ReLU(inplace=True)`` after a BatchNorm, does not change it); onnxruntime runs the ONNX
model with those values added as extra graph outputs (the standard technique; a file's
external weights are read by onnxruntime from the file's folder, not loaded twice). Each
pair is compared: max absolute error, max relative error (to the eager tensor's largest
magnitude, so values near zero do not blow it up), and whether it is within the tolerance
of the lower-precision dtype of the two; the norm-relative error, cosine and one- and
five-in-a-thousand ratios come from the verdict engine :func:`fwdtrace.compare_dumps` uses
(:class:`fwdtrace.precision.Agreement`), as does the max absolute error.

The first divergence is the earliest call, in execution order, out of tolerance while every
matched call feeding it agrees: where the file starts computing something else.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._host import to_numpy
from .._tree import iter_tensors
from ..errors import FwdtraceError, describe
from ..graph import Graph
from ..precision import Agreement, least_precise, math_record, rounding_explains, value_precision
from ..tracer import Tracer, _named_inputs

if TYPE_CHECKING:
    from ..node import Node
    from .compare import _Result

__all__ = ["ValueRow", "NumericResult", "DEFAULT_TOLERANCES"]

# (rtol, atol) by dtype: an ONNX value agrees when max|onnx - eager| <= atol + rtol * max|eager|.
# float32 allows for the reassociation of sums an ONNX runtime's kernels do (a deep model's
# exports differ from eager by 1e-6..1e-5 relative); float16 and bfloat16 for their 11 and 8
# bits of mantissa after a few accumulations; integers and booleans must be exact.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}
_EXACT = (0.0, 0.0)
_MISMATCH_KINDS = ("missing", "extra", "rewired", "undecided")
_AFTER_RANDOM = "after the random draw "  # a row's note when a value computed from a random draw differs
_INSIDE = "compared at "  # a row's note when its value is found inside its ONNX ops, not where they end
# rows placed where a difference starts and measured by the values after them
_PLACED_KINDS = (*_MISMATCH_KINDS, "random")
# the floating dtypes a value may have (a pair's tolerance is that of its least precise side: least_precise)
_PRECISION = ("bfloat16", "float16", "float32", "float64")
_ORT2DTYPE = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
    "tensor(bfloat16)": "bfloat16", "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8",
    "tensor(uint8)": "uint8", "tensor(bool)": "bool", "tensor(int16)": "int16",
}


@dataclass
class ValueRow:
    """One matched call's output against the ONNX value that carries it.

    ``call`` is the trace label (``encoder.layer.0.output.LayerNorm (LayerNorm)``), ``target``
    the layer class or torch function; ``onnx_node`` and ``onnx_value`` where the ONNX model
    computes it. ``max_abs`` and ``max_rel`` are the largest errors over every batch
    (``max_rel`` relative to the eager tensor's largest magnitude); ``inputs_rel`` the largest
    ``max_rel`` of the calls feeding it (0.0 for the model's inputs, None when none was
    compared). ``compared`` is False, with the reason in ``note``, when the two sides could
    not be set against each other (a value of another rank). ``shape_differs``: the two sides
    hold different counts along an axis (an NMS keeping 316 boxes eagerly and 318 in
    onnxruntime): a divergence, with errors of ``inf`` and the shapes in ``note``.
    """

    order: int  # the trace node id: execution order
    call: str
    module_path: str
    target: str
    onnx_node: str
    onnx_value: str
    shape: tuple[int, ...]
    dtype: str  # the less precise of the two sides', which sets the tolerance
    max_abs: float = 0.0
    max_rel: float = 0.0
    ok: bool = True
    compared: bool = True
    inputs_rel: float | None = None
    note: str = ""
    # over every batch: the largest |onnx - eager| / max(|onnx|, |eager|) over the whole value, the least
    # cosine; the arithmetic the pair is judged by (the eager run's math applied to dtype, see
    # fwdtrace.precision); out of tolerance, but within what that rounding explains ("TF32")
    norm_rel: float = 0.0
    cosine: float = 1.0
    precision: str = ""
    rounding: str | None = None
    # the largest over the batches of the share of elements whose relative error (to the larger magnitude of the
    # two) exceeds one and five thousandths: msprobe's ratios, as compare_dumps reports them (one Agreement)
    one_thousandth: float = 0.0
    five_thousandths: float = 0.0
    # the trace node's: "module", "function", "output" for the model's outputs; for a structural
    # mismatch (NumericResult.mismatches) "missing", "extra", "rewired" or "undecided" (no rule knows it)
    kind: str = "module"
    shape_differs: bool = False
    # the dtype of the worst compared call feeding it, whose tolerance says whether the inputs
    # agree (an int64 nonzero reads float32 values that may differ by rounding)
    inputs_dtype: str = ""
    # out of tolerance after a ranking's order of near-ties (its note names which): the same values
    # at other positions, not where the file computes something else
    follows_ties: bool = False
    # within tolerance as a whole, but where the values start to part: some elements off, relative to their own
    # magnitude, far beyond rounding, and they are the elements on which the first call out of tolerance after it
    # is off (the box widths whose small boxes a log2 then sets apart); what and where, in words
    parts: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "order": self.order, "call": self.call, "module_path": self.module_path, "target": self.target,
            "onnx_node": self.onnx_node, "onnx_value": self.onnx_value, "shape": list(self.shape),
            "dtype": self.dtype, "max_abs": _finite_or_str(self.max_abs), "max_rel": _finite_or_str(self.max_rel),
            "ok": self.ok, "compared": self.compared,
            "inputs_rel": None if self.inputs_rel is None else _finite_or_str(self.inputs_rel), "note": self.note,
            "kind": self.kind, "norm_rel": _finite_or_str(self.norm_rel), "cosine": _finite_or_str(self.cosine),
            "precision": self.precision, "rounding": self.rounding, "shape_differs": self.shape_differs,
            "follows_ties": self.follows_ties, "one_thousandth": _finite_or_str(self.one_thousandth),
            "five_thousandths": _finite_or_str(self.five_thousandths), "parts": self.parts,
        }


@dataclass
class NumericResult:
    """Every compared call of a check, and what a repro needs (see :meth:`fwdtrace.TopologyReport.save_repro`)."""

    rows: list[ValueRow]
    batches: int
    tolerances: dict[str, tuple[float, float]]
    math: dict[str, Any] | None = None  # how the eager run computed (see fwdtrace.precision.math_record)
    # for save_repro: the ONNX model, the folder of its external data, the first batch's feeds
    # and the eager values of the first divergence
    proto: Any = field(default=None, repr=False)
    folder: str | None = None
    feeds: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    eager: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    # ONNX node name -> the data values it reads from outside, for the repro's subgraph
    region_inputs: dict[int, list[str]] = field(default_factory=dict, repr=False)
    # one row per structural mismatch (kind "missing", "extra", "rewired" or "undecided"), judged by the
    # compared values right after it: ok when they agree (the exporter rewrote that part and it
    # computes the same), not ok when they differ, not compared when none after it was
    mismatches: list[ValueRow] = field(default_factory=list)
    # one row (kind "random", not compared) per call that draws random numbers (randn_like, gumbel_softmax,
    # dropout in training) with values after it that differ: eager and onnxruntime draw different numbers,
    # so those values are left uncompared (their notes name the draw) and the status is 'unchecked'
    random: list[ValueRow] = field(default_factory=list)
    # the file's outputs paired with none of the model's (its outputs outnumber the trace's, alike ones left
    # unpaired where which is which cannot be told)
    unpaired_outputs: list[str] = field(default_factory=list)

    @property
    def rewritten(self) -> list[ValueRow]:
        """Structural mismatches whose values downstream agree: rewritten by the exporter, computing the same."""
        return [m for m in self.mismatches if m.compared and m.ok]

    @property
    def divergent(self) -> list[ValueRow]:
        """Rows out of tolerance beyond what rounding explains, and structural mismatches whose downstream values differ."""
        return [r for r in self.rows + self.mismatches + self.random
                if r.compared and (r.parts or not r.ok and not r.rounding and not r.follows_ties)]

    @property
    def rounded(self) -> list[ValueRow]:
        """Rows out of tolerance by what the eager run's TF32, bfloat16 or float16 rounding explains."""
        return [r for r in self.rows if r.compared and not r.ok and r.rounding]

    @property
    def first_divergence(self) -> ValueRow | None:
        """The earliest call out of tolerance whose inputs still agree (else the earliest out of tolerance).

        A structural mismatch whose downstream values differ counts at its place in the
        trace, before the calls it feeds: a call the export dropped is where it went wrong.
        A call within tolerance as a whole whose values part elementwise, on the elements the
        call out of tolerance after it is off on (``parts``), counts at its own place: the
        difference starts there, not where a tolerance is first crossed.
        """
        bad = self.divergent
        if not bad:
            return None
        clean = [r for r in bad if r.inputs_rel is not None and _within_inputs(r, self)]
        return min(clean or bad, key=lambda r: (r.order, r.kind not in _PLACED_KINDS))

    @property
    def status(self) -> str:
        """``'diverges'`` (a value out of tolerance), ``'rewritten'`` (every structural mismatch computes
        the same), ``'unchecked'`` (a mismatch with no compared value after it, or values after a random
        draw that differ: no comparison can say whether the file computes them), else ``'ok'``."""
        if self.divergent:
            return "diverges"
        if self.random or any(not m.compared for m in self.mismatches):
            return "unchecked"
        return "rewritten" if self.mismatches else "ok"

    @property
    def worst(self) -> list[ValueRow]:
        """Compared rows, largest relative error first."""
        return sorted((r for r in self.rows if r.compared), key=lambda r: (-_sortable(r.max_rel), r.order))

    def lead(self) -> str:
        """The answer in one line."""
        first = self.first_divergence
        batches = f" over {self.batches} batches" if self.batches > 1 else ""
        compared = sum(1 for r in self.rows if r.compared)
        if first is None:
            worst = self.worst
            at = f"; largest max rel err {_num(worst[0].max_rel)} at {worst[0].call}" if worst else ""
            rewrote = (f"; the structure differs in {len(self.mismatches)} place"
                       f"{'s' if len(self.mismatches) > 1 else ''}: "
                       + ("the exporter rewrote those parts and they compute the same" if self.status == "rewritten"
                          else "not every one has a compared value after it") if self.mismatches else "")
            rounded = self.rounded
            labels = ", ".join(dict.fromkeys(str(r.rounding) for r in rounded))
            within = f"; {len(rounded)} within what {labels} rounding explains" if rounded else ""
            ties = sum(1 for r in self.rows if r.compared and r.note.startswith(_TIES))
            after = sum(1 for r in self.rows if r.follows_ties)
            tied = (f"; {ties} ranking{'s' if ties > 1 else ''} differ{'' if ties > 1 else 's'} in the {_TIES}"
                    + (f", {after} value{'s' if after > 1 else ''} after {'them' if ties > 1 else 'it'} "
                       "in that order" if after else "") if ties else "")
            return (f"no divergence: {compared} matched values agree with eager{batches}{within}{tied}{at}{rewrote}"
                    f"{self._drawn()}")
        inputs = (
            "at the model's inputs" if first.inputs_rel == 0.0
            else f"inputs agree to {_num(first.inputs_rel)}" if first.inputs_rel is not None and _within_inputs(first, self)
            else f"inputs already off by {_num(first.inputs_rel)}" if first.inputs_rel is not None
            else "inputs not compared"
        )
        if first.kind in _MISMATCH_KINDS:
            return (f"first divergence: {first.module_path or '<root>'}, {first.note}: max rel err "
                    f"{_num(first.max_rel)} ({first.dtype}), {inputs}{batches}{self._drawn()}")
        where = first.module_path if first.kind == "module" and first.module_path else first.call
        err = first.note if first.shape_differs else first.parts or f"max rel err {_num(first.max_rel)}"
        return f"first divergence: {where}, {err} ({first.dtype}), {inputs}{batches}{self._drawn()}"

    def _drawn(self) -> str:
        """The lead's clauses on what no comparison settles: outputs left unpaired, values after random draws."""
        unpaired = [r for r in self.rows if r.kind == "output" and not r.compared and not r.onnx_value]
        outputs = (f"; {len(unpaired)} output{'s' if len(unpaired) > 1 else ''} of the model paired with none of "
                   f"the file's ({', '.join(r.call.removeprefix('output ') for r in unpaired[:3])}"
                   f"{' ...' if len(unpaired) > 3 else ''}), not compared" if unpaired else "")
        return outputs + self._after_draws()

    def _after_draws(self) -> str:
        if not self.random:
            return ""
        after = sum(1 for r in self.rows if not r.compared and r.note.startswith(_AFTER_RANDOM))
        draws = ", ".join(r.call for r in self.random[:3]) + (f" and {len(self.random) - 3} more"
                                                              if len(self.random) > 3 else "")
        return (f"; {after} value{'s' if after != 1 else ''} after {draws}, which draw{'s' if len(self.random) == 1 else ''} "
                "random numbers, not compared: eager PyTorch and onnxruntime draw different ones (not an export "
                "error; check the file in eval mode or without the draw to compare them)")

    def table(self, limit: int = 8) -> list[str]:
        """The worst rows, with the first divergence, as aligned lines."""
        first = self.first_divergence
        shown = self.worst[:limit]
        if first is not None and first not in shown and first.kind not in _PLACED_KINDS:
            shown.append(first)
        skipped = [r for r in self.rows if not r.compared and not r.note.startswith(_AFTER_RANDOM)]
        ties = [r for r in self.rows if r.compared and r.note.startswith(_TIES)]
        partly = [r for r in self.rows if r.compared and r.note and not r.shape_differs
                  and not r.note.startswith((_INSIDE, _TIES)) and not r.follows_ties]
        inside = [r for r in self.rows if r.compared and r.note.startswith(_INSIDE)]  # an LSTM whose h_n and c_n the export left out
        lines = []
        if shown:
            width = max(len(r.call) for r in shown)
            owidth = max(len(r.onnx_value) for r in shown)
            # the verdict engine's columns after the check's own, as compare_dumps's table shows them
            lines.append(f"  {'call'.ljust(width)}  {'ONNX value'.ljust(owidth)}  {'dtype':8}  {'max abs':>9}  "
                         f"{'max rel':>9}  {'norm rel':>9}  {'cosine':>9}  {'>1e-3':>9}  {'>5e-3':>9}  ")
            for r in shown:
                flag = (f"  DIVERGES{' (first)' if r is first else ''}: {r.parts}" if r.parts
                        else "" if r.ok else f"  within {r.rounding} rounding" if r.rounding
                        else f"  {r.note}" if r.follows_ties
                        else "  DIVERGES" + (" (first)" if r is first else "") + (
                            f": {r.note}" if r.shape_differs else ""))
                # "-" where the engine judged nothing: booleans, a value of another count along an axis
                engine = [_num(r.norm_rel), f"{r.cosine:.6g}", f"{r.one_thousandth:.3g}", f"{r.five_thousandths:.3g}"
                          ] if r.precision else ["-"] * 4
                lines.append(f"  {r.call.ljust(width)}  {r.onnx_value.ljust(owidth)}  {r.dtype:8}  "
                             f"{_num(r.max_abs):>9}  {_num(r.max_rel):>9}  " + "  ".join(f"{e:>9}" for e in engine)
                             + flag)
        if skipped:
            lines.append(f"  not compared: {', '.join(f'{r.call} ({r.note})' for r in skipped[:4])}"
                         + (f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""))
        if inside:
            lines.append(f"  compared inside their ONNX ops: {', '.join(f'{r.call} ({r.note})' for r in inside[:4])}"
                         + (f" and {len(inside) - 4} more" if len(inside) > 4 else ""))
        if partly:
            lines.append(f"  compared in part: {', '.join(f'{r.call} ({r.note})' for r in partly[:4])}"
                         + (f" and {len(partly) - 4} more" if len(partly) > 4 else ""))
        for r in ties:
            lines.append(f"  {r.call}: {r.note}")
        for r in self.random:
            lines.append(f"  random: {r.call} {r.note}")
        if self.unpaired_outputs:
            lines.append(f"  outputs of the file paired with no output of the model: {', '.join(self.unpaired_outputs)}")
        for m in self.mismatches:
            verdict = ("rewritten by the exporter, computes the same" if m.compared and m.ok
                       else "DIVERGES" + (" (first)" if m is first else "") if m.compared
                       else "no compared value after it")
            lines.append(f"  structure: {m.kind} {m.call}: {verdict}"
                         + (f" (max rel err {_num(m.max_rel)} at {m.onnx_value})" if m.compared else ""))
        return lines

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "lead": self.lead(),
            "batches": self.batches,
            "tolerances": {k: list(v) for k, v in self.tolerances.items()},
            "math": self.math,
            "first_divergence": None if first is None else first.to_dict(),
            "status": self.status,
            "worst": [r.call for r in self.worst[:10]],
            "values": [r.to_dict() for r in self.rows],
            "mismatches": [r.to_dict() for r in self.mismatches],
            "random": [r.to_dict() for r in self.random],
            "unpaired_outputs": list(self.unpaired_outputs),
        }


class OtherCalls(FwdtraceError):
    """A batch made the model run other calls than the trace the structure was compared on (``batch``: which)."""

    def __init__(self, message: str, batch: int) -> None:
        super().__init__(message)
        self.batch = batch


def _signature(value: Any) -> tuple[str, tuple[int, ...]] | None:
    """What tells one output from another without its name: its kind of number and its shape."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        kind = "bool" if value.dtype == torch.bool else "float" if value.is_floating_point() or value.is_complex() \
            else "int"
        return kind, tuple(value.shape)
    array = np.asarray(value)
    kind = "bool" if array.dtype == np.bool_ else "int" if np.issubdtype(array.dtype, np.integer) else "float"
    return kind, tuple(array.shape)


def _pair_outputs(eager: list[Any], onnx: list[Any]) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
    """Pair two lists of output signatures in order, where the pairing is certain.

    The file's outputs are the model's flattened in order, with some left out or added (a cache
    layer whose state TorchScript flattens into two int64 scalars where eager has one). Of the
    in-order pairings of alike signatures that pair the most, an output is paired when every one
    pairs it, and with the same output of the file. Returns the (eager, onnx) index pairs and, for
    each eager output left unpaired, the outputs of the file it could be.
    """
    n, m = len(eager), len(onnx)

    def same(i: int, j: int) -> bool:
        return eager[i] is not None and eager[i] == onnx[j]

    # before[i][j]: the most pairs of eager[:i] with onnx[:j]; after[i][j]: of eager[i:] with onnx[j:]
    before = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n):
        for j in range(m):
            before[i + 1][j + 1] = max(before[i][j + 1], before[i + 1][j], before[i][j] + same(i, j))
    after = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            after[i][j] = max(after[i + 1][j], after[i][j + 1], after[i + 1][j + 1] + same(i, j))
    best = before[n][m]
    pairs: list[tuple[int, int]] = []
    alike: dict[int, list[int]] = {}
    for i in range(n):
        # the onnx outputs eager[i] pairs with in some pairing of the most pairs
        could = [j for j in range(m) if same(i, j) and before[i][j] + 1 + after[i + 1][j + 1] == best]
        # and whether some pairing of the most pairs leaves eager[i] unpaired
        skipped = any(before[i][j] + after[i + 1][j] == best for j in range(m + 1))
        if len(could) == 1 and not skipped:
            pairs.append((i, could[0]))
        else:
            alike[i] = [j for j in range(m) if same(i, j)]
    return pairs, alike


def _within_inputs(row: ValueRow, result: NumericResult) -> bool:
    """Whether a row's inputs agree: within the tolerance of its dtype, relative to scale."""
    rtol, atol = result.tolerances.get(row.inputs_dtype or row.dtype, _EXACT)
    return row.inputs_rel is not None and row.inputs_rel <= rtol + atol


def _sortable(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return "0" if x == 0 else f"{x:.1e}"


def _finite_or_str(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


class _ValueTracer(Tracer):
    """A trace that keeps a copy of the outputs of the calls asked for, as each call made them.

    The copy is taken where the tracer files a call's outputs (``_track_aliases``, right after
    the node is appended), so an in-place write later in the model does not reach it.
    """

    def __init__(self, wanted: set[int], through: tuple[type, ...], through_functions: tuple[str, ...],
                 ranking: frozenset[int] = frozenset()) -> None:
        super().__init__(through=through, through_functions=through_functions)
        self.wanted = wanted
        self.ranking = ranking  # calls that rank values: their inputs are kept too, to tell ties apart
        self.values: dict[int, list[torch.Tensor]] = {}
        self.ranked: dict[int, list[torch.Tensor]] = {}
        self.inputs: dict[int, torch.Tensor] = {}  # obj_id -> the model input's value

    def _begin_root(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        super()._begin_root(model, args, kwargs)
        with torch._C.DisableTorchFunction():
            for _, t in _named_inputs(model, args, kwargs):
                self.inputs[self.obj_id(t)] = t.detach().clone()

    def _track_aliases(self, node_id: int, in_tensors: list[torch.Tensor], out_tensors: list[torch.Tensor],
                       out_refs: Any, in_place: bool) -> None:
        super()._track_aliases(node_id, in_tensors, out_tensors, out_refs, in_place)
        if node_id in self.wanted:
            with torch._C.DisableTorchFunction():
                self.values[node_id] = [t.detach().clone() for t in out_tensors]
                if node_id in self.ranking:
                    self.ranked[node_id] = [t.detach().clone() for t in in_tensors]


def _as_batches(inputs: Any, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    if inputs is None:
        return [(args, kwargs)]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise FwdtraceError(f"check_onnx() expected inputs as a non-empty list of batches (a tensor or a tuple of "
                            f"the model's positional arguments each), got {describe(inputs)}")
    out: list[tuple[tuple, dict]] = []
    for i, b in enumerate(inputs):
        if isinstance(b, torch.Tensor):
            out.append(((b,), kwargs))
        elif isinstance(b, tuple) and all(isinstance(x, torch.Tensor) for x in b):
            out.append((b, kwargs))
        elif isinstance(b, dict):
            out.append(((), b))
        else:
            raise FwdtraceError(f"check_onnx() expected each batch in inputs as a tensor, a tuple of tensors or a "
                                f"dict of keyword arguments, got {describe(b)} at inputs[{i}]")
    return out


def _check_tolerances(tolerances: Any) -> dict[str, tuple[float, float]]:
    """The defaults with the given ``{dtype: (rtol, atol)}`` over them."""
    merged = dict(DEFAULT_TOLERANCES)
    if tolerances is None:
        return merged
    if not isinstance(tolerances, dict):
        raise FwdtraceError(f"check_onnx() expected tolerances as a dict {{dtype name: (rtol, atol)}}, "
                            f"got {describe(tolerances)}")
    for k, v in tolerances.items():
        if (not isinstance(k, str) or not isinstance(v, (tuple, list)) or len(v) != 2
                or not all(isinstance(x, (int, float)) and x >= 0 for x in v)):
            raise FwdtraceError(f"check_onnx() expected tolerances as {{dtype name: (rtol, atol)}} with "
                                f"non-negative numbers, got {k!r}: {v!r}")
        merged[k] = (float(v[0]), float(v[1]))
    return merged


def compare_values(
    model: torch.nn.Module, args: tuple, kwargs: dict, trace: Graph, og: Graph, result: _Result, proto: Any,
    folder: str | None, opened: list[str], inputs: Any = None, tolerances: Any = None,
) -> NumericResult:
    """Run ``model`` eagerly and ``proto`` in onnxruntime on each batch; compare every matched call's output.

    ``trace``, ``og`` and ``result`` are the structural comparison's: which ONNX node stands
    for which call comes from ``result.groups``. ``folder`` is where the file's external data
    lives (None for a model held in memory whole). ``opened`` names the layer classes the
    structural trace recorded as the calls they make; the value runs do the same.
    """
    from ..registry import REGISTRY, qualified_name
    from .compare import _OUTPUT_GROUP, _RECURRENT_OPS, _onnx_name, _trace_label

    tols = _check_tolerances(tolerances)
    batches = _as_batches(inputs, args, kwargs)
    through = tuple(dict.fromkeys(
        type(m) for m in model.modules() if qualified_name(type(m)) in set(opened)
    )) if isinstance(model, torch.nn.Module) else ()
    through_functions = tuple(name for name in opened if name in REGISTRY.functions)  # register_atomic's

    # which eager tensor each ONNX value stands for: (row, trace node, output index, ONNX value name)
    rows: dict[int, ValueRow] = {}
    pairs: list[tuple[int, int, int, str]] = []
    readers: dict[int, list[int]] = {}  # ONNX obj_id -> the nodes reading it
    for n in og.nodes:
        for r in n.inputs:
            readers.setdefault(r.obj_id, []).append(n.id)
    slot_of: dict[str, int] | None = None  # ONNX value -> its place among its node's outputs, gaps counted
    # gid -> a row per other value of the call's region shaped like its output: the matcher may
    # end a region one op late (a norm's ReduceL2 then the Pow of the square that reads it), and
    # the value the call returns is then inside it
    inner: dict[int, dict[str, ValueRow]] = {}
    missing = set(result.missing)  # only there: a region that reads as missing the call after it
    feeds_missing = {e.src for e in trace.edges if e.dst in missing}
    calls_of: _CallsOf | None = None  # made for the first call with more outputs than its ONNX key node
    for gid in sorted(result.groups):
        group = result.groups[gid]
        if gid < 0 or group.key is None or trace.nodes[gid].kind not in ("module", "function"):
            continue
        tn = trace.nodes[gid]
        last = trace.nodes[group.trace_ids[-1]]  # a BatchNorm folded into this Conv: the Conv's value is the BN's
        on = og.nodes[group.key]
        names = list(on.meta.get("output_names", []))
        label = _trace_label(tn) + "".join(f" + {_trace_label(trace.nodes[t])}" for t in group.trace_ids[1:])
        row = ValueRow(gid, label, tn.module_path, tn.class_name if tn.kind == "module" else tn.target,
                       str(on.meta.get("onnx_name", on.name)), ", ".join(names), (), "", kind=tn.kind)
        rows[gid] = row
        t_outs = last.outputs
        if on.meta.get("op_type") in _RECURRENT_OPS:
            if slot_of is None:
                slot_of = {o: k for node in proto.graph.node for k, o in enumerate(node.output) if o}
            chosen = _recurrent_carriers(og, readers, group, t_outs, slot_of)
            left = [str(i) for i in range(len(t_outs)) if i not in {i for i, _ in chosen}]
            if not chosen:
                row.compared, row.note = False, f"{len(t_outs)} outputs, none of them an output of the ONNX {on.target}"
                continue
            if left:
                row.note = f"output{'s' if len(left) > 1 else ''} {', '.join(left)} not computed by the ONNX model"
        elif len(names) == len(t_outs):
            chosen = [(i, _carrier(og, readers, group.key, i, t_outs[i].shape)) for i in range(len(names))]
        elif len(t_outs) == 1 and names:
            chosen = [(0, _carrier(og, readers, group.key, 0, t_outs[0].shape))]
        else:
            calls_of = calls_of or _CallsOf(trace, og, result, readers)
            chosen = _carriers_by_readers(calls_of, group, gid, last, t_outs)
            if not chosen:
                row.compared, row.note = False, f"{len(t_outs)} outputs against {len(names)} ONNX values"
                continue
            left = [str(i) for i in range(len(t_outs)) if i not in {i for i, _ in chosen}]
            if left:
                row.note = (f"output{'s' if len(left) > 1 else ''} {', '.join(left)} not compared: read by no later "
                            "call, or by calls that read no one value of the file's region alone")
        row.onnx_value = ", ".join(n for _, n in chosen)
        pairs.extend((gid, last.id, i, n) for i, n in chosen)
        if len(chosen) == 1 and len(t_outs) == 1 and last.id in feeds_missing:
            inside = _inner_values(og, group.onodes, group.key, t_outs[0].shape)
            if inside:
                inner[gid] = {n: ValueRow(gid, label, tn.module_path, row.target, row.onnx_node, n, (), "",
                                          kind=tn.kind) for n in inside}
    out_group = result.groups.get(_OUTPUT_GROUP)
    o_out = og.nodes[out_group.key] if out_group is not None and out_group.key is not None else None
    out_names = list(o_out.meta.get("names", [])) if o_out is not None else []
    t_out_nodes = [trace.nodes[t] for t in out_group.trace_ids] if out_group is not None else []
    # the call each model output comes from, whose row its own row follows (dtype, inputs)
    call2gid = {t: gid for gid in rows for t in result.groups[gid].trace_ids}
    out_feeder = {e.dst: call2gid[e.src] for e in trace.edges if e.src in call2gid}
    input_nodes = [n for n in trace.nodes if n.kind == "input"]
    onnx_inputs: dict[int, str] = {}  # trace input node -> the ONNX input it feeds, as the structure paired them
    by_position = False  # some paired in order, not by name (a TorchScript export's input.1): counts must agree
    for n in input_nodes:
        g = result.groups.get(n.id)
        if g is not None and g.key is not None:
            onnx_inputs[n.id] = _onnx_name(og.nodes[g.key])
            by_position = by_position or og.nodes[g.key].name != n.name
    unpaired = [trace.nodes[t].name for t in result.unmatched_inputs[0]] if by_position else []

    # the axes of each ONNX value whose length the file leaves to its data (a NonZero's, an NMS's count)
    free_axes = {name: tuple(a for a, d in enumerate(ref.shape) if d == -1)
                 for n in og.nodes for name, ref in zip(n.meta.get("output_names", []), n.outputs, strict=False)}
    session, extra = _session(proto, folder, [n for *_, n in pairs] + [n for rs in inner.values() for n in rs],
                              out_names)
    expected = [(i.name, _ORT2DTYPE.get(i.type, i.type), i.shape) for i in session.get_inputs()]
    ort_inputs = {name: dtype for name, dtype, _ in expected}
    wanted = {t for _, t, _, _ in pairs}
    ranking = frozenset(t for t in wanted if _ranked_at(trace.nodes[t]) is not None)
    numeric = NumericResult(list(rows.values()), len(batches), tols, proto=proto, folder=folder)
    # ONNX computes in full float32 (see providers()): only the eager run's math can explain a rounding
    numeric.math = math_record(model if isinstance(model, torch.nn.Module) else None, args)
    out_rows: list[ValueRow] = []
    out_pairs: list[tuple[Node, str]] = []  # (trace output node, the file's output it is compared with)
    kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # ONNX value -> (eager, onnx) of the first batch, if small
    for b, (bargs, bkwargs) in enumerate(batches):
        tracer = _ValueTracer(wanted, through, through_functions, ranking)
        with torch.no_grad(), tracer:
            out = model(*bargs, **bkwargs)
        got = tracer.graph
        if len(got.nodes) != len(trace.nodes) or any(got.nodes[t].target != trace.nodes[t].target for t in wanted):
            raise OtherCalls(
                f"check_onnx(numeric=True): batch {b} of inputs made the model run other calls than when it was "
                f"traced ({len(got.nodes)} nodes against {len(trace.nodes)}): the ONNX model was made for one path "
                "through the model. Pass inputs that take the example's path (inputs=[...]), or, for a model "
                "that changes itself per call, one that does not", b)
        given = [(n, tracer.inputs[n.outputs[0].obj_id]) for n in input_nodes
                 if n.outputs and n.outputs[0].obj_id in tracer.inputs]
        _check_feeds(expected, [(n.name, onnx_inputs.get(n.id), t) for n, t in given], unpaired,
                     b if inputs is not None else None)
        feeds = {onnx_inputs[n.id]: _to_numpy(t, ort_inputs[onnx_inputs[n.id]]) for n, t in given
                 if onnx_inputs.get(n.id) in ort_inputs}
        try:
            values = dict(zip(extra, session.run(extra, feeds), strict=True))
        except Exception as e:
            raise FwdtraceError(f"check_onnx(numeric=True): onnxruntime could not run the ONNX model on batch {b} "
                                f"(inputs {', '.join(f'{k} {v.dtype}{list(v.shape)}' for k, v in feeds.items())}): "
                                f"{type(e).__name__}: {e}") from e
        if b == 0:
            numeric.feeds = feeds
        for gid, tid, i, name in pairs:
            eager = tracer.values.get(tid)
            row = rows[gid]
            if eager is None or i >= len(eager) or name not in values:
                row.compared, row.note = False, "no eager value" if eager is None else "no ONNX value"
                continue
            if tid in tracer.ranked and _order_of_ties(row, trace.nodes[tid], tracer.ranked[tid], eager[i],
                                                       values[name], tols):
                continue
            _compare_into(row, eager[i], values[name], tols, record=numeric.math, free=free_axes.get(name, ()))
            for other, other_row in inner.get(gid, {}).items():
                if other in values:
                    _compare_into(other_row, eager[i], values[other], tols, record=numeric.math)
            if b == 0 and row.compared:
                numeric.eager[name] = to_numpy(eager[i], torch.float32 if eager[i].is_floating_point() else None)
                if eager[i].is_floating_point() and 0 < eager[i].numel() <= _KEPT:
                    # the copies there are (float32 holds a float16 or bfloat16 value exactly; float64 its own)
                    kept[name] = (to_numpy(eager[i]) if eager[i].dtype == torch.float64 else numeric.eager[name],
                                  values[name])
        # the model's outputs, paired by position (an export that leaves a cache out has fewer), or, where the
        # file flattens them otherwise (TorchScript's cache layers with a state more), by what can be told apart
        eager_outs = [t for _, t in iter_tensors(out, "output", caches=True)]
        outs_by_node = [n for n in trace.nodes if n.kind == "output"]
        if b == 0:
            if len(t_out_nodes) == len(out_names):
                out_pairs = list(zip(t_out_nodes, out_names, strict=True))
            else:
                at, alike = _pair_outputs(
                    [_signature(eager_outs[outs_by_node.index(t)]) if outs_by_node.index(t) < len(eager_outs)
                     else None for t in t_out_nodes], [_signature(values.get(n)) for n in out_names])
                out_pairs = [(t_out_nodes[i], out_names[j]) for i, j in at]
                paired = {t.id for t, _ in out_pairs}
                for i, tnode in enumerate(t_out_nodes):
                    if tnode.id not in paired:
                        names = [out_names[j] for j in alike.get(i, [])]
                        out_rows.append(ValueRow(
                            len(trace.nodes) + len(t_out_nodes) + i, f"output {tnode.name}", "", "output",
                            "graph output", "", (), "", compared=False, kind="output",
                            note=(f"{len(names)} outputs of the file alike ({', '.join(names)}): which is it cannot "
                                  "be told" if len(names) > 1 else "no output of the file alike")))
                numeric.unpaired_outputs = [n for n in out_names if n not in {name for _, name in out_pairs}]
            out_rows[:0] = [ValueRow(len(trace.nodes) + k, f"output {tnode.name}", "", "output", "graph output",
                                     name, (), "", kind="output") for k, (tnode, name) in enumerate(out_pairs)]
        for k, (tnode, name) in enumerate(out_pairs):
            j = outs_by_node.index(tnode)
            feeder = rows.get(out_feeder.get(tnode.id, -1))
            if j < len(eager_outs) and name in values:
                _compare_into(out_rows[k], eager_outs[j], values[name], tols,
                              feeder.dtype if feeder is not None and feeder.compared else None, numeric.math)
            if feeder is not None and feeder.compared:
                out_rows[k].inputs_rel = feeder.max_rel
    for gid, others in inner.items():
        row = rows[gid]
        found = next((r for r in others.values() if r.compared and r.ok), None)
        if row.compared and not row.ok and found is not None:
            row.note = (f"{_INSIDE}{found.onnx_value} inside its ONNX ops; {row.onnx_value}, where they end, "
                        f"differs by max rel err {_num(row.max_rel)}: a later call's op taken in")
            row.onnx_value, row.max_abs, row.max_rel, row.ok = found.onnx_value, found.max_abs, found.max_rel, True
            row.shape, row.dtype = found.shape, found.dtype
    for row in rows.values():
        rels: list[tuple[float, str]] = []
        for req in result.reqs.get(row.order, []):
            for fed_by in req:
                if fed_by in rows and rows[fed_by].compared:
                    rels.append((rows[fed_by].max_rel, rows[fed_by].dtype))
                elif fed_by >= 0 and trace.nodes[fed_by].kind == "input":
                    rels.append((0.0, ""))
        if rels:
            row.inputs_rel, row.inputs_dtype = max(rels, key=lambda r: _sortable(r[0]))
    numeric.rows = sorted(rows.values(), key=lambda r: r.order) + out_rows
    for row in numeric.rows:
        if row.compared and not row.ok:
            row.rounding = rounding_explains(row.norm_rel, row.cosine, row.precision)
    out_by_node = {t.id: r for (t, _), r in zip(out_pairs, out_rows, strict=False)}
    # a Dropout in eval mode (or of p=0) returns its input: it draws nothing, and cannot be where a difference starts
    idle = {p for p, m in model.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)
            and (not m.training or m.p == 0)} if isinstance(model, torch.nn.Module) else set()
    numeric.random = _after_random_draws(trace, result, rows, out_by_node, idle)
    _unpair_past_missing(trace, result, rows, out_by_node)
    _follow_ties(numeric.rows, result.reqs)
    numeric.mismatches = _judge_mismatches(trace, og, result, rows, out_by_node, readers)
    numeric.region_inputs = {gid: _region_inputs(og, result.groups[gid].onodes) for gid in rows}
    _place_parting(numeric, rows, result.reqs, kept)
    return numeric


# the values kept to tell where elements start to part (the first batch's, eager and onnxruntime's, as the check
# holds them already): a value of up to this many elements (a detector's boxes, scores and levels, not a
# backbone's feature maps)
_KEPT = 1 << 18
# an element parts when its error, relative to its own magnitude, is this many times the dtype's rtol (float32:
# 1e-3, some 16,000 units in the last place): no rounding of a few ops gives that, only an error carried from
# elsewhere and laid bare, as a small box's width is by the subtraction of two coordinates of some hundred pixels
_FAR = 10.0


def _wide(pair: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """An eager value and its onnxruntime one in float64, where the errors between them are taken."""
    return np.asarray(pair[0], dtype=np.float64), np.asarray(pair[1], dtype=np.float64)


def _place_parting(numeric: NumericResult, rows: dict[int, ValueRow], reqs: dict[int, list[frozenset[int]]],
                   kept: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Where the values of the first divergence start to part, if before it: mark that row's ``parts``.

    The first divergence is the first call out of tolerance whose inputs agree as a whole. A call
    such as ``log2`` or a division turns an error that is small next to its input's largest element,
    but large next to the element's own magnitude, into a large one: it is then exact on its
    onnxruntime input, and the difference starts upstream. From the first divergence, on the
    elements it is out of tolerance on, this walks back through the calls feeding it that hold as
    many elements alike (elementwise: a width, an area, its square root): while such a call,
    within tolerance as a whole, is off on most of those elements by more than :data:`_FAR` times
    its rtol relative to each element's own magnitude, the difference was already there. The
    earliest such call is where the values start to part. Only values of the first batch small
    enough to keep (:data:`_KEPT`) are walked; nothing here makes a value diverge that did not.
    """
    first = numeric.first_divergence
    if first is None or first.kind not in ("module", "function") or first.shape_differs or first.parts \
            or not _within_inputs(first, numeric) or first.onnx_value not in kept:
        return
    want, got = _wide(kept[first.onnx_value])
    rtol, atol = numeric.tolerances.get(first.dtype, _EXACT)
    finite = np.abs(want[np.isfinite(want)])
    scale = float(finite.max()) if finite.size else 0.0
    with np.errstate(all="ignore"):
        on = np.abs(got - want) > atol + rtol * scale  # the elements the first divergence is out of tolerance on
        on = on | (np.isnan(got) != np.isnan(want))
    if not on.any():
        return
    shape = tuple(d for d in want.shape if d != 1)
    at, off, far = first, on.reshape(-1), 0.0
    while True:
        best: tuple[float, ValueRow, np.ndarray, float] | None = None
        for req in reqs.get(at.order, []):
            for gid in req:
                row = rows.get(gid)
                if row is None or row is at or not row.compared or not row.ok or row.onnx_value not in kept:
                    continue
                e, o = _wide(kept[row.onnx_value])
                if tuple(d for d in e.shape if d != 1) != shape or row.dtype not in _PRECISION:
                    continue
                with np.errstate(all="ignore"):
                    rel = np.abs(o - e).reshape(-1) / np.maximum(np.abs(o), np.abs(e)).reshape(-1)
                parted = np.nan_to_num(rel, nan=0.0) > _FAR * numeric.tolerances.get(row.dtype, _EXACT)[0]
                share = float(parted[off].mean())
                if share >= 0.5 and (best is None or share > best[0]):
                    best = (share, row, off & parted, float(np.nan_to_num(rel[off & parted], nan=0.0).max()))
        if best is None:
            break
        _, at, off, far = best
    if at is first:
        return
    at.parts = (f"{int(off.sum())} of {off.size} elements off by up to {_num(far)} of their own magnitude, where "
                f"{first.call} is out of tolerance after it (max rel err {_num(first.max_rel)}); max rel err "
                f"{_num(at.max_rel)} as a whole")


# ops whose integer output says which of the values they read come first, or are kept: op -> the
# position among the call's tensors of the values ranked (an NMS ranks its boxes by their scores)
_RANKING = {"topk": 0, "sort": 0, "argsort": 0, "argmax": 0, "argmin": 0, "nms": 1, "batched_nms": 1}
_TIES = "order of near-ties"  # a row's note when its indices differ only where the values ranked tie


def _ranked_at(node: Node) -> int | None:
    """Where a ranking call's ranked values are among its tensors, or None for any other call."""
    return _RANKING.get(node.target.rsplit(".", 1)[-1]) if node.kind == "function" else None


def _ranked_dim(node: Node, ndim: int) -> int | None:
    """The axis a ranking call ranks along, from its recorded arguments; None: the values flattened."""
    op = node.target.rsplit(".", 1)[-1]
    if op in ("nms", "batched_nms"):
        return 0
    args = [a for a in node.attrs.get("args", []) if not isinstance(a, bool)]
    position = 1 if op == "topk" else 0  # topk(x, k, dim), sort(x, dim), argmax(x, dim)
    dim = node.attrs.get("dim", args[position] if len(args) > position else (None if op in ("argmax", "argmin")
                                                                                 else -1))
    return None if dim is None else int(dim) % max(ndim, 1)


def _order_of_ties(row: ValueRow, node: Node, ranked_inputs: list[torch.Tensor], eager: torch.Tensor,
                   onnx_value: Any, tols: dict[str, tuple[float, float]]) -> bool:
    """Whether the ONNX indices of a ranking call differ from eager's only in the order of near-ties.

    Values that agree within the tolerance of their dtype may be ranked either way by two runs
    whose inputs differ by rounding (two boxes' scores equal to float32's last bits): the
    indices then differ, but the values they pick agree. So the indices are a tie's order when,
    gathered from the eager values ranked, the ONNX indices pick values within tolerance of
    those eager's pick, and pick no value twice. Then the row is ok, with a note; any other
    index difference is compared as usual, a divergence.
    """
    at = _ranked_at(node)
    got = np.asarray(onnx_value)
    if at is None or at >= len(ranked_inputs) or eager.is_floating_point() or eager.dtype == torch.bool:
        return False
    x = ranked_inputs[at].detach().to("cpu", torch.float64)
    want = eager.detach().to("cpu", torch.int64)
    if got.size != want.numel() or not np.issubdtype(got.dtype, np.integer) or np.array_equal(
            got.reshape(want.shape), to_numpy(want)):
        return False
    io = torch.from_numpy(got.astype(np.int64).reshape(want.shape))
    dim = _ranked_dim(node, x.ndim)
    if dim is None:
        x, dim = x.reshape(-1), 0
    if want.ndim < x.ndim:  # argmax without keepdim
        want, io = want.unsqueeze(dim), io.unsqueeze(dim)
    if want.ndim != x.ndim or x.numel() == 0 or bool(((io < 0) | (io >= x.shape[dim])).any()):
        return False
    twice = io.sort(dim).values.diff(dim=dim) == 0
    if bool(twice.any()):
        return False
    rtol, atol = tols.get(str(ranked_inputs[at].dtype).removeprefix("torch."), _EXACT)
    finite = x[torch.isfinite(x)].abs()
    scale = float(finite.max()) if finite.numel() else 0.0
    picked_eager, picked_onnx = x.gather(dim, want), x.gather(dim, io)
    if not bool(((picked_eager - picked_onnx).abs() <= atol + rtol * scale).all()):
        return False
    differ = int((io != want).sum())
    if not row.dtype:  # an argmax: its one output
        row.shape, row.dtype = tuple(eager.shape), str(eager.dtype).removeprefix("torch.")
    note = f"{_TIES}: {differ} of {want.numel()} indices differ where the values ranked agree within tolerance"
    if not row.note.startswith(_TIES):
        row.note = note
    return True


def _follow_ties(rows: list[ValueRow], reqs: dict[int, list[frozenset[int]]]) -> None:
    """Mark the calls out of tolerance because a ranking before them ordered near-ties otherwise.

    Indices in another order move the same values to other positions (the boxes a top-k keeps,
    offset, gathered and clipped), so the calls reading them differ position by position until
    an op that does not depend on the order (an NMS that sorts by score again, a sum). Such a
    call is fed by a ranking in the order of near-ties, or by a call marked so, and is itself out
    of tolerance. The model's outputs are never marked: an output that differs is a divergence.
    """
    by_order = {r.order: r for r in rows if r.kind != "output"}
    # call -> the ranking whose order it follows
    tied = {r.order: r.call for r in by_order.values() if r.compared and r.note.startswith(_TIES)}
    for row in sorted(by_order.values(), key=lambda r: r.order):
        if not row.compared or row.ok or row.order in tied:
            continue
        after = sorted({g for req in reqs.get(row.order, []) for g in req} & tied.keys())
        if after:
            tied[row.order] = tied[after[0]]
            row.follows_ties, row.note = True, f"follows the {_TIES} of {tied[row.order]}"


def _successors(trace: Graph) -> dict[int, list[int]]:
    """Each trace node's readers, by id."""
    succ: dict[int, list[int]] = {}
    for e in trace.edges:
        succ.setdefault(e.src, []).append(e.dst)
    return succ


def _compared_by_node(result: _Result, rows: dict[int, ValueRow], out_by_node: dict[int, ValueRow],
                      leaving: Iterable[int] = ()) -> dict[int, ValueRow]:
    """The compared row of each trace node (its region's, or the output's), regions in ``leaving`` left out."""
    left = set(leaving)
    node2row = {t: rows[g] for g in rows if rows[g].compared and g not in left for t in result.groups[g].trace_ids}
    node2row.update({t: r for t, r in out_by_node.items() if r.compared})
    return node2row


def _after_random_draws(trace: Graph, result: _Result, rows: dict[int, ValueRow], out_by_node: dict[int, ValueRow],
                        idle_dropouts: set[str]) -> list[ValueRow]:
    """A row (kind ``"random"``) per call that draws random numbers and the values after it that differ.

    Eager PyTorch and onnxruntime draw different numbers, so every value computed from a draw
    may differ without the file computing anything else, and none of them can be compared: each
    such row that differs is left uncompared, its note naming the draw. A value the draw does not
    reach is compared as usual, so a divergence before it or beside it is still found.
    """
    from .compare import _trace_label, draws_random

    succ = _successors(trace)
    node2rows: dict[int, list[ValueRow]] = {}
    for g, row in rows.items():
        for t in result.groups[g].trace_ids:
            node2rows.setdefault(t, []).append(row)
    for t, row in out_by_node.items():
        node2rows.setdefault(t, []).append(row)
    random: list[ValueRow] = []
    for tn in trace.nodes:
        if tn.kind not in ("module", "function") or not draws_random(tn):
            continue
        if (tn.kind == "module" and tn.module_path in idle_dropouts) or tn.attrs.get("training") is False \
                or tn.attrs.get("p") == 0:
            continue  # a dropout that returns its input (eval mode, p=0) draws nothing
        reached, seen, stack = [], {tn.id}, [tn.id]
        while stack:  # every value computed from the draw, not only the nearest: all of them may differ
            n = stack.pop()
            reached += node2rows.get(n, [])
            for d in succ.get(n, ()):
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        label = _trace_label(tn)
        bad = sorted({id(r): r for r in reached if r.compared and not r.ok}.values(), key=lambda r: r.order)
        if not bad:
            continue  # a draw whose values nothing compared reads, or that changes nothing compared
        worst = max(bad, key=lambda r: (_sortable(r.max_rel), -r.order))
        random.append(ValueRow(tn.id, label, tn.module_path, tn.target, "", worst.call, worst.shape,
                               worst.dtype, worst.max_abs, worst.max_rel, ok=False, compared=False, kind="random",
                               note=f"draws random numbers: {len(bad)} value{'s' if len(bad) > 1 else ''} after it "
                                    f"not compared ({', '.join(r.call for r in bad[:3])}"
                                    f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''})"))
        for r in bad:
            r.compared, r.note = False, f"{_AFTER_RANDOM}{label}: eager and onnxruntime draw different numbers"
    return random


def _unpair_past_missing(trace: Graph, result: _Result, rows: dict[int, ValueRow],
                         out_by_node: dict[int, ValueRow]) -> None:
    """Leave uncompared a call paired past a missing call whose value differs while the values after it agree.

    A call that reads a missing call's result is paired by reachability from its other
    inputs, past ONNX ops no call claims: ``x / x.std()`` under dynamo, the std written as
    seven ops no rule knows, had its ``div`` paired with the ``Mul`` squaring ``x - mean``
    inside the std. Such a pairing is a guess; a difference there is the guess's when every
    compared value after it agrees (had the file computed something else there, the values
    it feeds would differ too). The row is then not compared, with why, and the missing call
    is judged by the values after it.
    """
    from .compare import _trace_label

    missing = set(result.missing)
    fed_by_missing = {e.dst for e in trace.edges if e.src in missing}
    unsure = {gid: [t for t in result.groups[gid].trace_ids if t in fed_by_missing] for gid in rows}
    unsure = {gid: ts for gid, ts in unsure.items() if ts}
    if not unsure:
        return
    succ = _successors(trace)
    node2row = _compared_by_node(result, rows, out_by_node, leaving=unsure.keys())
    for gid, past in unsure.items():
        row = rows[gid]
        if not row.compared or row.ok or row.rounding:
            continue
        after = _nearest_rows(result.groups[gid].trace_ids, lambda n: succ.get(n, ()), node2row.get)
        if not after or not all(r.ok or r.rounding for r in after):
            continue
        names = ", ".join(r.call for r in sorted(after, key=lambda r: r.order)[:3])
        missed = sorted({e.src for e in trace.edges if e.dst in past and e.src in missing})
        row.compared = False
        row.note = (f"paired with {row.onnx_value} past the missing {_trace_label(trace.nodes[missed[0]])}, "
                    f"which differs by max rel err {_num(row.max_rel)} while {names} after it agree: "
                    "not its value")


def _check_feeds(expected: list[tuple[str, str, list[Any]]], given: list[tuple[str, str | None, torch.Tensor]],
                 unpaired: list[str], batch: int | None) -> None:
    """Raise unless every input of the ONNX model gets a tensor of its shape and dtype.

    ``expected``: (name, dtype, shape) of the ONNX model's inputs, a dimension a string or
    None where the file leaves it free; ``given``: (trace input, the ONNX input it pairs with,
    its tensor); ``unpaired``: traced inputs read by the model and left over when inputs
    paired in order (the counts differ: feeding by position would be a guess). A float
    tensor feeds any float input (a float16 file takes the float32 values, cast).
    """
    fed = {onnx_name: (name, t) for name, onnx_name, t in given if onnx_name is not None}
    problems = [f"the file's {name} pairs with no traced input" for name, _, _ in expected if name not in fed]
    problems += [f"{name} pairs with no input of the file" for name in unpaired]
    for name, dtype, shape in expected:
        if name not in fed:
            continue
        tname, t = fed[name]
        dims = list(t.shape)
        floats = t.is_floating_point() and dtype in _PRECISION
        if not floats and _dtype_name(t) != dtype:
            problems.append(f"{name} takes {dtype}, {tname} is {_dtype_name(t)}")
        if len(shape) != len(dims) or any(isinstance(d, int) and d != g for d, g in zip(shape, dims, strict=False)):
            problems.append(f"{name} is shaped {_dims(shape)}, {tname} {dims}")
    if not problems:
        return
    where = f" on batch {batch} of inputs" if batch is not None else ""
    raise FwdtraceError(
        f"check_onnx(numeric=True) cannot feed the ONNX model{where}: "
        f"it expects {', '.join(f'{n} {d}{_dims(s)}' for n, d, s in expected) or 'no inputs'}; "
        f"got {', '.join(f'{n} {_dtype_name(t)}{list(t.shape)}' for n, _, t in given) or 'no tensors'} "
        f"(paired by name, else in order): {'; '.join(problems)}. Pass tensors the file was made for as "
        f"inputs=[batch, ...] (each batch a tensor, or a tuple of forward's tensor arguments in order), "
        f"e.g. check_onnx(model, x, onnx=..., numeric=True, inputs=[x_for_the_file]) "
        f"(fwdtrace check-onnx: --input-shape the file's)")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dims(shape: list[Any]) -> str:
    """An ONNX input's shape as ``[1, 3, batch, 16]``: a free dimension by its name, or ``?``."""
    return "[" + ", ".join(str(d) if isinstance(d, (int, str)) else "?" for d in shape) + "]"


def _judge_mismatches(
    trace: Graph, og: Graph, result: _Result, rows: dict[int, ValueRow], out_by_node: dict[int, ValueRow],
    readers: dict[int, list[int]],
) -> list[ValueRow]:
    """A row per structural mismatch, judged by the nearest compared values after it.

    Where the trace and the ONNX graph differ in structure, the values that flow out of the
    difference settle it: when every nearest compared value downstream agrees, the exporter
    rewrote that part and it computes the same; when one differs, the difference is a real
    divergence, placed where the mismatch is (a call the export dropped, before the call that
    reads its result). Nearest: a path stops at its first compared value, so a divergence
    further on, with causes of its own, is not charged to this mismatch.
    """
    from .compare import _OUTPUT_GROUP, _onnx_name, _trace_label

    node2row = _compared_by_node(result, rows, out_by_node)
    onode2row = {o: rows[g] for g in rows if rows[g].compared for o in result.groups[g].onodes}
    name2out = {r.onnx_value: r for r in out_by_node.values() if r.compared}
    succ = _successors(trace)

    def after_in_trace(starts: list[int]) -> list[ValueRow]:
        return _nearest_rows(starts, lambda n: succ.get(n, ()), node2row.get)

    def after_in_onnx(start: int) -> list[ValueRow]:
        def readers_of(n: int) -> list[int]:
            return [c for ref in og.nodes[n].outputs for c in readers.get(ref.obj_id, ())]

        def graph_outputs(n: int) -> list[ValueRow]:  # a graph output: the model's output row measures it
            return [name2out[name] for name in og.nodes[n].meta.get("output_names", []) if name in name2out]

        return _nearest_rows([start], readers_of, onode2row.get, graph_outputs)

    def inputs_of(gid: int) -> float | None:
        rels = [rows[f].max_rel if f in rows and rows[f].compared else 0.0
                for req in result.reqs.get(gid, []) for f in req
                if (f in rows and rows[f].compared) or (f >= 0 and trace.nodes[f].kind == "input")]
        return max(rels, key=_sortable) if rels else None

    out: list[ValueRow] = []

    def judge(row: ValueRow, after: list[ValueRow], what: str) -> None:
        if not after:
            row.compared, row.note = False, f"{what}: no compared value after it"
            out.append(row)
            return
        worst = max(after, key=lambda r: (_sortable(r.max_rel), -r.order))
        row.max_abs, row.max_rel, row.dtype = worst.max_abs, worst.max_rel, worst.dtype
        row.shape, row.onnx_value = worst.shape, worst.call
        row.ok = all(r.ok or r.rounding for r in after)
        names = ", ".join(r.call for r in sorted(after, key=lambda r: r.order)[:3])
        row.note = (f"{what}: the exporter rewrote it and {names} after it agree" if row.ok
                    else f"{what}, and {worst.call} after it differs")
        out.append(row)

    for m in result.missing:
        tn = trace.nodes[m]
        row = ValueRow(m, _trace_label(tn), tn.module_path, tn.class_name if tn.kind == "module" else tn.target,
                       "", "", (), "", kind="missing", inputs_rel=inputs_of(m))
        judge(row, after_in_trace([m]), f"{_trace_label(tn)} is not in the ONNX model")
    for u, _why in result.undecided:  # no ONNX rule knows it (Tensor.std): the values after it settle it
        tn = trace.nodes[u]
        row = ValueRow(u, _trace_label(tn), tn.module_path, tn.class_name if tn.kind == "module" else tn.target,
                       "", "", (), "", kind="undecided", inputs_rel=inputs_of(u))
        judge(row, after_in_trace([u]), f"{_trace_label(tn)} is unchecked in the ONNX model")
    for o in result.extra:
        on = og.nodes[o]
        after = after_in_onnx(o)
        first = min(after, key=lambda r: r.order) if after else None
        row = ValueRow(first.order if first else len(trace.nodes), _onnx_name(on),
                       first.module_path if first else "", str(on.target), _onnx_name(on), "", (), "",
                       kind="extra", inputs_rel=first.inputs_rel if first else None)
        judge(row, after, f"ONNX node {_onnx_name(on)} is not in the trace")
    for side, src, dst in result.rewired:
        def label(g: int) -> str:
            return "output" if g == _OUTPUT_GROUP else _trace_label(trace.nodes[g])

        edge = f"{label(src)} -> {label(dst)}"
        if dst == _OUTPUT_GROUP:
            after = list(name2out.values())
        elif dst in rows and rows[dst].compared:
            after = [rows[dst]]
        else:
            after = after_in_trace(result.groups[dst].trace_ids if dst in result.groups else [dst])
        first = min(after, key=lambda r: r.order) if after else None
        where = trace.nodes[dst].module_path if dst >= 0 else ""
        row = ValueRow(first.order if first else len(trace.nodes), edge, where, "rewired", "", "", (), "",
                       kind="rewired", inputs_rel=inputs_of(dst) if dst >= 0 else None)
        on_side = {"trace": "in the trace only", "onnx": "in ONNX only"}.get(side, "inputs taken in another order")
        judge(row, after, f"edge {edge} ({on_side})")
    return sorted(out, key=lambda r: r.order)


def _carrier(og: Graph, readers: dict[int, list[int]], key: int, index: int, shape: tuple[int, ...]) -> str:
    """The ONNX value holding a call's output ``index``: the key node's, or one wiring op on.

    A region ends at its last real op; the tensor the call returned may be a reshape or
    transpose further (a Linear on a 3-d input emitted as a 2-d Gemm then a Reshape, an
    attention's output projection before the batch-first transpose). The nearest value
    shaped like the eager output, reached through wiring ops only, is the call's output.
    """
    on = og.nodes[key]
    names = on.meta.get("output_names", [])
    start = on.outputs[index]
    if not _shaped_other(start.shape, shape):
        return _last_alike_view(og, readers, key, index, shape) if _a_view(on) else str(names[index])
    frontier = [(key, index)]
    unsure: str | None = None  # the first value on the way whose inferred shape leaves some lengths unknown
    for _ in range(4):  # a few views, not a walk into the next call
        nxt = []
        for nid, i in frontier:
            for c in readers.get(og.nodes[nid].outputs[i].obj_id, ()):
                cn = og.nodes[c]
                if cn.kind != "function" or not cn.meta.get("wiring") or not cn.outputs:
                    continue
                if not _shaped_other(cn.outputs[0].shape, shape):
                    if -1 not in cn.outputs[0].shape:
                        return str(cn.meta["output_names"][0])
                    # a Reshape to lengths computed in the graph (to_onnx's LSTM: [seq, batch, hidden] before
                    # its batch-first Transpose): taken only if no value further on is known to be shaped alike
                    unsure = unsure or str(cn.meta["output_names"][0])
                nxt.append((c, 0))
        frontier = nxt
    return unsure or str(names[index])


class _CallsOf:
    """Which calls read what, on both sides, for :func:`_carriers_by_readers`: made once per check."""

    def __init__(self, trace: Graph, og: Graph, result: Any, readers: dict[int, list[int]]) -> None:
        self.og, self.readers = og, readers
        group_of = {t: g for g, grp in result.groups.items() if g >= 0 for t in grp.trace_ids}
        self.trace_readers: dict[tuple[int, int], set[int]] = {}  # (trace node, tensor) -> the calls reading it
        for e in trace.edges:
            if e.dst in group_of:
                self.trace_readers.setdefault((e.src, e.obj_id), set()).add(group_of[e.dst])
        self.region_of = {o: g for g, grp in result.groups.items() for o in grp.onodes}

    def reaching(self, obj_id: int) -> set[int]:
        """The calls whose ONNX nodes read a value, through wiring no call holds (an Unsqueeze before a Concat)."""
        calls: set[int] = set()
        frontier = list(self.readers.get(obj_id, ()))
        for _ in range(4):
            following = []
            for r in frontier:
                if r in self.region_of:
                    calls.add(self.region_of[r])
                elif self.og.nodes[r].meta.get("wiring"):
                    following += [c for v in self.og.nodes[r].outputs for c in self.readers.get(v.obj_id, ())]
            frontier = following
        return calls


def _carriers_by_readers(calls_of: _CallsOf, group: Any, gid: int, last: Node, t_outs: list[Any]
                         ) -> list[tuple[int, str]]:
    """The ONNX values holding the outputs of a call with more outputs than its key node has (an ``LSTMCell``'s
    ``h`` and ``c``, of which the file's region ends at ``h``'s ``Mul``): for each output, the values of the
    call's region shaped like it that the ONNX nodes of every call reading that output read; a value one
    output alone can be is that output's, and no longer another's. An output no later call reads, or left
    with several values or none, is not paired."""
    og = calls_of.og
    values = [(str(og.nodes[o].meta.get("output_names", [])[k]), tuple(v.shape), calls_of.reaching(v.obj_id))
              for o in group.onodes for k, v in enumerate(og.nodes[o].outputs)]
    candidates: list[set[str]] = []
    for out in t_outs:
        reading = calls_of.trace_readers.get((last.id, out.obj_id), set()) - {gid}
        candidates.append({name for name, shape, calls in values
                           if shape == tuple(out.shape) and reading and reading <= calls})
    chosen: dict[int, str] = {}
    while True:
        fixed = {i: next(iter(c)) for i, c in enumerate(candidates) if len(c) == 1 and i not in chosen}
        if not fixed:
            break
        chosen.update(fixed)
        for i, c in enumerate(candidates):
            if i not in chosen:
                c -= set(fixed.values())
    return sorted(chosen.items()) if len(set(chosen.values())) == len(chosen) else []


# ONNX ops that only move or select values: the ops a view-only call (Tensor.unfold) is emitted as
_VIEW_OPS = frozenset({"Gather", "GatherElements", "GatherND", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Slice",
                       "Expand", "Flatten", "Identity"})


def _a_view(on: Node) -> bool:
    """Whether ONNX node ``on`` is wiring that only moves or selects values (not int64 index arithmetic)."""
    return bool(on.meta.get("wiring")) and on.meta.get("op_type") in _VIEW_OPS


def _last_alike_view(og: Graph, readers: dict[int, list[int]], key: int, index: int, shape: tuple[int, ...]) -> str:
    """The last value shaped like the eager output along the views that alone read a view call's key.

    A call that is views only (``x.unfold(3, 3, 2)``: a Gather, then a Transpose of the two
    last axes) may hold the eager shape before its last view: the Gather's square windows are
    not yet the windows torch returns.
    """
    nid, i = key, index
    for _ in range(4):
        reading = readers.get(og.nodes[nid].outputs[i].obj_id, [])
        if len(reading) != 1:
            break
        cn = og.nodes[reading[0]]
        if cn.kind != "function" or not _a_view(cn) or not cn.outputs or _shaped_other(cn.outputs[0].shape, shape):
            break
        nid, i = cn.id, 0
    return str(og.nodes[nid].meta["output_names"][i])


def _recurrent_carriers(og: Graph, readers: dict[int, list[int]], group: Any, t_outs: list[Any],
                        slot_of: dict[str, int]) -> list[tuple[int, str]]:
    """(trace output index, ONNX value) of an LSTM, GRU or RNN call, paired by the ONNX op's output slots.

    ONNX's Y, Y_h (and Y_c) are torch's output, h_n (and c_n), in that order. An exporter leaves
    out the states nothing reads (dynamo keeps only Y when the model drops h_n and c_n), so
    the slot, not the place among the names left, says which is which. A call of several
    layers stacks its layers' Y_h (Y_c) with a Concat, which the structural match put in the
    call's region; its Y is the last layer's (the region's key).
    """
    from .compare import _RECURRENT_OPS

    key = og.nodes[group.key]
    layers = {o for o in group.onodes if og.nodes[o].meta.get("op_type") in _RECURRENT_OPS}
    made_by = {name: o for o in group.onodes for name in og.nodes[o].meta.get("output_names", [])}
    pairs: list[tuple[int, str]] = []
    for index, name in enumerate(key.meta.get("output_names", [])):
        slot = slot_of.get(name)
        if slot is None or slot >= len(t_outs):
            continue
        if slot == 0 or len(layers) < 2:
            pairs.append((slot, _carrier(og, readers, group.key, index, t_outs[slot].shape)))
            continue
        for o in sorted(group.onodes):
            on = og.nodes[o]
            ins = on.meta.get("input_names", [])
            if on.meta.get("op_type") == "Concat" and ins and all(
                    slot_of.get(n) == slot and made_by.get(n) in layers for n in ins):
                pairs.append((slot, str(on.meta["output_names"][0])))
                break
    return pairs


def _inner_values(og: Graph, onodes: Iterable[int], key: int, shape: tuple[int, ...], limit: int = 3) -> list[str]:
    """Values of a call's ONNX ops other than its key's, shaped like the eager output (at most ``limit``, latest first)."""
    found: list[str] = []
    for o in sorted(onodes, reverse=True):
        n = og.nodes[o]
        if o == key or n.kind != "function" or n.meta.get("wiring"):
            continue
        for name, ref in zip(n.meta.get("output_names", []), n.outputs, strict=False):
            if name and ref.shape and not _shaped_other(ref.shape, shape):
                found.append(str(name))
        if len(found) >= limit:
            break
    return found[:limit]


def _shaped_other(onnx_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether shape inference says the ONNX value is shaped unlike the eager tensor (unknown: no)."""
    if not onnx_shape and shape:
        return False  # no inferred shape
    return len(onnx_shape) != len(shape) or any(o not in (-1, s) for o, s in zip(onnx_shape, shape, strict=True))


def _region_inputs(og: Graph, onodes: set[int]) -> list[str]:
    """The data values a call's ONNX nodes read from outside them (not initializers), by name."""
    made = {name for o in onodes for name in og.nodes[o].meta.get("output_names", [])}
    read: list[str] = []
    for o in sorted(onodes):
        for name, ref in zip(og.nodes[o].meta.get("input_names", []), og.nodes[o].inputs, strict=False):
            if ref.param is None and name not in made and name not in read:  # weights stay in the subgraph
                read.append(name)
    return read


def _to_numpy(t: torch.Tensor, ort_dtype: str) -> np.ndarray:
    """An input for onnxruntime: on the host, in the dtype the ONNX input takes."""
    if ort_dtype == "float16":
        return to_numpy(t, torch.float16)
    return to_numpy(t, torch.float32 if ort_dtype == "float32" and t.is_floating_point() else None)


def _pair_dtype(eager: torch.Tensor, onnx_value: np.ndarray, floor: str | None) -> str:
    """The dtype a pair is judged in: the least precise of the two sides' (and ``floor``'s), as the verdict engine
    orders them (:func:`fwdtrace.precision.least_precise`); the eager side's where none is floating."""
    return least_precise([str(eager.dtype).removeprefix("torch."), "bfloat16" if onnx_value.dtype.name == "bfloat16"
                          else onnx_value.dtype.name, *([floor] if floor else [])])


def _compare_into(row: ValueRow, eager: torch.Tensor, onnx_value: Any, tols: dict[str, tuple[float, float]],
                  floor: str | None = None, record: dict[str, Any] | None = None,
                  free: tuple[int, ...] = ()) -> None:
    """Fold one batch's errors into ``row`` (the maximum over batches; the least cosine).

    ``floor`` is a dtype the value was computed in before a cast (a float16 model's output
    cast back to float32): the tolerance is that of the least precise. ``record`` is the eager
    run's math record: the arithmetic the pair is judged by when it is out of tolerance.
    ``free``: the axes whose length the ONNX file leaves to the data; lengths that differ there
    are a divergence, elsewhere a pairing of two different values, not compared.
    """
    got = np.asarray(onnx_value)
    want = to_numpy(eager, torch.float64 if eager.dtype != torch.bool else None)  # one copy to the host
    row.shape, row.dtype = tuple(eager.shape), _pair_dtype(eager, got, floor)
    if got.shape != want.shape:
        if got.size == want.size and tuple(d for d in got.shape if d != 1) == tuple(d for d in want.shape if d != 1):
            got = got.reshape(want.shape)  # only size-1 axes differ: the same elements in the same order
        elif got.ndim == want.ndim and all(a in free for a in range(got.ndim) if got.shape[a] != want.shape[a]):
            # the same value with another count along an axis (boxes an NMS keeps, a mask's
            # nonzeros): the ONNX model computed something else here, whatever comes after
            row.ok, row.shape_differs = False, True
            row.max_abs = row.max_rel = math.inf
            row.note = f"ONNX value shaped {list(got.shape)}, eager {list(want.shape)}"
            return
        else:
            row.compared = False
            row.note = f"ONNX value shaped {list(got.shape)}, eager {list(want.shape)}"
            return
    if got.dtype == np.bool_ or want.dtype == np.bool_:
        differ = float(np.count_nonzero(got.astype(bool) != want.astype(bool)))
        row.max_abs = max(row.max_abs, differ)
        row.max_rel = max(row.max_rel, differ / max(want.size, 1))
        row.ok = row.ok and differ == 0
        return
    g = got.astype(np.float64)
    # the numbers from the verdict engine the dump comparison uses (fwdtrace.precision): one pass gives the max
    # abs error (equal infinities and NaNs agree), the norm-relative error, the cosine and msprobe's ratios,
    # computed the same way in both
    whole = Agreement()
    whole.add(g, want)
    max_abs = math.inf if math.isnan(whole.max_abs) else whole.max_abs  # NaN against a number: no bound holds
    # relative to the eager value's largest magnitude (not elementwise, as the engine's max_rel): values near
    # zero do not blow it up, and the tolerance below is of that scale
    finite = np.abs(want[np.isfinite(want)])
    scale = float(finite.max()) if finite.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    rtol, atol = tols.get(row.dtype, _EXACT)
    row.norm_rel = max(row.norm_rel, whole.norm_rel, key=_sortable)
    row.cosine = min(row.cosine, whole.cosine, key=lambda c: -math.inf if math.isnan(c) else c)
    one_thousandth, five_thousandths = whole.ratios
    row.one_thousandth = max(row.one_thousandth, one_thousandth, key=_sortable)
    row.five_thousandths = max(row.five_thousandths, five_thousandths, key=_sortable)
    row.precision = value_precision(row.dtype, record)
    row.max_abs = max(row.max_abs, max_abs)
    row.max_rel = max(row.max_rel, max_rel, key=_sortable)
    row.ok = row.ok and max_abs <= atol + rtol * scale


def _session(proto: Any, folder: str | None, values: list[str], out_names: list[str]) -> tuple[Any, list[str]]:
    """An onnxruntime session of ``proto`` with ``values`` as extra outputs, and the outputs it returns.

    The outputs are added to ``proto`` only while it is serialized: the caller's model is
    left as it was, and no copy of the weights is made besides the bytes onnxruntime reads.
    """
    import onnx
    import onnxruntime as ort

    graph = proto.graph
    existing = {o.name for o in graph.output}
    added = [v for v in dict.fromkeys(values) if v and v not in existing]
    n = len(graph.output)
    graph.output.extend([onnx.ValueInfoProto(name=v) for v in added])
    try:
        data = proto.SerializeToString()
    finally:
        del graph.output[n:]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # the graph as written: a fusion would compute a value other than the one exposed and read next
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if folder is not None:  # external weights: read from the file's folder, not loaded by us
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    try:
        session = ort.InferenceSession(data, options, providers=providers(ort))
    except Exception as e:
        missing = re.search(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'", str(e))
        if missing:
            op, opset, node = missing.groups()
            dtype = _input_dtype(proto, node)
            raise FwdtraceError(
                f"check_onnx(numeric=True): onnxruntime's CPU provider has no kernel for {op} (opset {opset})"
                f"{f' in {dtype}' if dtype else ''}, the ONNX node {node!r}: the file cannot run there to be "
                f"compared. Check a float32 export's numbers (no autocast), or the structure alone "
                f"(numeric=False)") from e
        external = folder is None and any(
            i.data_location == onnx.TensorProto.EXTERNAL for i in graph.initializer)
        raise FwdtraceError(f"check_onnx(numeric=True): onnxruntime could not load the ONNX model"
                            f"{' (external data: pass the path of the .onnx file, onnx=path)' if external else ''}"
                            f": {type(e).__name__}: {e}") from e
    return session, [*out_names, *added]


def providers(ort: Any) -> list[Any]:
    """The onnxruntime execution providers a check runs on: CUDA's where this onnxruntime has it, else the CPU's.

    CUDA's runs without TF32 (onnxruntime's default uses it): the ONNX side computes in full
    float32, so that a difference TF32 explains comes from the eager run, whose math its
    record says.
    """
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _input_dtype(proto: Any, node_name: str) -> str:
    """The element type of the first input of ONNX node ``node_name`` (``bfloat16``), or "" where unknown."""
    import onnx

    graph = proto.graph
    node = next((n for n in graph.node if n.name == node_name), None)
    if node is None or not node.input:
        return ""
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    types.update({i.name: i.data_type for i in graph.initializer})
    if node.input[0] not in types:  # a value in between: its type from shape inference
        inferred = onnx.shape_inference.infer_shapes(proto).graph
        types.update({v.name: v.type.tensor_type.elem_type for v in inferred.value_info})
    elem = types.get(node.input[0], 0)
    return str(onnx.TensorProto.DataType.Name(elem)).lower() if elem else ""


def save_repro(numeric: NumericResult, directory: str | os.PathLike[str]) -> dict[str, str]:
    """Write the ONNX subgraph of the first divergence, the values reaching it and the eager result.

    Returns the paths written by role: ``model`` (``subgraph.onnx``), ``inputs``
    (``inputs.npz``, one array per subgraph input, by ONNX name) and ``expected``
    (``expected.npz``, the eager value of each subgraph output).
    """
    import onnx

    first = numeric.first_divergence
    if first is None:
        raise FwdtraceError("save_repro() expected a report with a divergence, got one whose values all agree")
    if numeric.proto is None:
        raise FwdtraceError("save_repro() needs the ONNX model the values were compared on; this report has none")
    os.makedirs(directory, exist_ok=True)
    inputs = numeric.region_inputs.get(first.order, [])
    outputs = [v.strip() for v in first.onnx_value.split(",") if v.strip()]
    session, names = _session(numeric.proto, numeric.folder, inputs, [])
    values = dict(zip(names, session.run(names, numeric.feeds), strict=True))
    values.update({k: v for k, v in numeric.feeds.items() if k in inputs})
    full = onnx.ModelProto()
    full.CopyFrom(numeric.proto)
    if numeric.folder is not None:
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(full, numeric.folder)
    # the extractor wants every value typed; inferred types are enough
    full = onnx.shape_inference.infer_shapes(full)
    sub = onnx.utils.Extractor(full).extract_model(inputs, outputs)
    paths = {
        "model": os.path.join(os.fspath(directory), "subgraph.onnx"),
        "inputs": os.path.join(os.fspath(directory), "inputs.npz"),
        "expected": os.path.join(os.fspath(directory), "expected.npz"),
    }
    onnx.save(sub, paths["model"])
    np.savez(paths["inputs"], **{k: values[k] for k in inputs})
    np.savez(paths["expected"], **{k: numeric.eager[k] for k in outputs if k in numeric.eager})  # type: ignore[arg-type]
    return paths


def _nearest_rows(
    starts: list[int], successors: Callable[[int], Iterable[int]], row_of: Callable[[int], ValueRow | None],
    rows_at: Callable[[int], Iterable[ValueRow]] = lambda n: (),
) -> list[ValueRow]:
    """The compared rows first reached from ``starts`` along ``successors``: a walk stops at a node
    with a row (``row_of``); ``rows_at`` adds rows a node on the way measures (graph outputs)."""
    found: dict[int, ValueRow] = {}
    seen, stack = set(starts), list(starts)
    while stack:
        n = stack.pop()
        for row in rows_at(n):
            found[id(row)] = row
        for d in successors(n):
            if d in seen:
                continue
            seen.add(d)
            reached = row_of(d)
            if reached is not None:
                found[id(reached)] = reached
            else:
                stack.append(d)
    return list(found.values())
