"""Cross-check a traced graph against its ONNX export: which ops match, which are missing, which edges moved.

The comparison walks the trace in execution order. For each traced call it looks, next
to where the call's inputs landed in the ONNX graph, for ONNX nodes the call may have
become (:mod:`fwdtrace.onnx.ops`): one op (``Conv``), or a region of several (``MatMul``
then ``Add`` for a Linear, a whole decomposed attention) whose only way in is through the
call's inputs. Views, transposes and casts are wiring on both sides; constants, shape
arithmetic and new tensors shaped like an input (``zeros_like``) are left out. An in-place
write through a view feeds the tensor viewed, and is its op plus the scatter that puts the
slice back. Calls an exporter may simplify away (``relu(relu(x))``, ``x + 0``, a call
repeated on the same values, by value numbers that follow every call and write) are elided
when no op stands right where their inputs are. Module scopes the exporter recorded (dynamo's
``pkg.torch.onnx.name_scopes``, TorchScript's node names) rank the candidates when
present; without them the dataflow, op types, attributes and sizes decide.

Then connectivity, not counts: every trace edge between matched calls must be a path in
the ONNX graph between their partners through no other matched op, and every such ONNX
path must be a trace edge. A Conv fed by the wrong tensor is a rewired edge.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._files import not_a_regular_file
from ..errors import FwdtraceError, describe
from ..graph import Graph
from ..node import Node, TensorRef
from ..registry import qualified_name
from .export import EXPORTERS, _export, onnx_graph
from .ops import (
    COPY_FUNCTIONS,
    FILL_FUNCTIONS,
    NEW_TENSOR_FUNCTIONS,
    ONNX_WIRING_OPS,
    OVERWRITE_FUNCTIONS,
    PAD_FUNCTIONS,
    QUANTIZED_OPS,
    SETITEM_FUNCTIONS,
    SHAPE_ONLY_AFTER_FIRST,
    Equivalence,
    canonical_target,
    copied_into_a_fill,
    equivalence_for,
    note_classes,
    rule_target,
    scattered_per_dimension,
    written_through_a_view,
)

# check_onnx's exporters: torch's two and fwdtrace's own (to_onnx)
CHECK_EXPORTERS = (*EXPORTERS, "fwdtrace")

if TYPE_CHECKING:
    import onnx

    from .numeric import NumericResult, ValueRow

__all__ = ["TopologyReport", "ReportIds", "compare_onnx", "check_onnx", "render_side_by_side", "run_cli"]

# At most this many unexplained ONNX ops may sit between a call's inputs and its partner
# (an inserted op is reported as extra instead of derailing the rest of the match).
MAX_SKIPPED = 2
# ...and this many after a layer the graph does not open, whose ONNX ops are unknown.
_UNOPENED_SKIPPED = 64
# A region gives up past this many nodes per input of the call: each input has its own wiring
# to the call (SSD's cat of 90 per-class results reaches them through 540 view ops).
_REGION_PER_INPUT = 400
# Trace attributes and the ONNX attributes that must agree with them when both exist.
_ATTR_PAIRS = (("kernel_size", "kernel_shape"), ("stride", "strides"), ("groups", "group"), ("dilation", "dilations"))
_OUTPUT_GROUP = -1
# Ops an exporter may merge when one is applied to the other's result.
_IDEMPOTENT_OPS = frozenset({"Relu", "Clip", "Abs", "Floor", "Ceil", "Round", "Sign"})
# The scalar that makes a binary op a no-op (``x + 0``, ``x * 1``), which exporters drop.
_NEUTRAL: dict[str, float] = {"Add": 0, "Sub": 0, "Mul": 1, "Div": 1, "Pow": 1}
# ONNX ops that carry a layer's weights.
_WEIGHTED_OPS = frozenset({
    "Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "LayerNormalization", "GroupNormalization",
    "InstanceNormalization", "RMSNormalization", "Gather", "LSTM", "GRU", "RNN", "PRelu", "Attention",
})
_GATHERS = frozenset({"Gather", "GatherND", "GatherElements"})
_SCATTERS = frozenset({"ScatterND", "ScatterElements"})
_INDEX_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Mod", "Concat", "Unsqueeze", "Reshape", "Cast", "Expand",
                        "Range", "Where", "Less"})
_CATS = frozenset({"torch.cat", "torch.concat", "torch.concatenate"})
# Calls whose index argument the trace may not keep (``x[:, t]``): without it, no two are alike.
_INDEXING = frozenset({"torch.Tensor.__getitem__", "torch.Tensor.__setitem__"})
_RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})
# Ops whose results their branches or bodies compute: their sizes, where stated at all, are not the example's.
_CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})
# Random draws besides dropout and rand*: two on the same input are two draws.
_SAMPLERS = frozenset({"bernoulli", "multinomial", "normal", "uniform", "exponential", "poisson", "cauchy",
                       "geometric", "log_normal", "rrelu", "gumbel_softmax"})
_VALUE_FREE_OPS = frozenset({"RandomNormalLike", "RandomUniformLike", "EyeLike", "ConstantOfShape"})
# ONNX ops whose result depends on the order of their inputs and that take them in the
# order of the torch call: Concat all of them (constants too), the others their data inputs
# (torch.addmm puts the bias first, Gemm last; masked_fill and Where differ alike).
_ORDERED_OPS = frozenset({"Concat", "Sub", "Div", "Pow", "MatMul", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"})


@dataclass
class ReportIds:
    """A report's lists by node id: ``matched`` pairs a trace node id with its ONNX graph node ids
    (in the order of ``TopologyReport.matched``), ``missing`` trace node ids, ``extra`` ONNX ones."""

    matched: list[tuple[int, tuple[int, ...]]]
    missing: list[int]
    extra: list[int]


@dataclass
class TopologyReport:
    """The diff between a traced graph and an ONNX model.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    >>> report = fwdtrace.check_onnx(model, torch.ones(1, 3, 8, 8), exporter="torchscript")
    >>> report.ok, report.matched
    (True, [('0 (Conv2d)', ('/0/Conv',)), ('1 (ReLU)', ('/1/Relu',))])

    ``matched`` pairs each trace call with the ONNX nodes that implement it; ``missing``
    lists trace calls with no ONNX counterpart, ``extra`` ONNX nodes with no trace
    counterpart, ``rewired`` edges present on one side only. ``elided`` lists calls the
    exporter may drop (dropout in eval, views), fold (BatchNorm into Conv) or simplify
    (``relu(relu(x))``, ``x + 0``, a call repeated on the same values), with how.
    ``opened`` names the layer classes no rule knows, which :func:`check_onnx` compared as
    the torch calls they make. ``not_opened`` lists the calls of such layers that
    :func:`compare_onnx`, given a graph alone, could not open: the ONNX ops between their
    inputs and their readers are theirs, unchecked. ``undecided`` pairs the calls a graph alone
    cannot decide with why: a layer repeating another of its class on the same inputs that the
    export computes once, right only if their weights are equal (LeViT's two heads, fresh from
    their initialiser), which only the model shows; or a function call no rule knows
    (``torch.nn.functional.cosine_similarity``), whose ONNX ops between its inputs and its
    readers are taken as its, unchecked, while the calls after it are compared as any other.
    ``status`` is ``'ok'``, ``'mismatch'``
    (something missing, extra or rewired) or ``'incomplete'`` (only layers not opened or calls
    undecided: neither ok nor a mismatch; ``check_onnx(model, x, onnx=proto)`` decides the layers,
    ``numeric=True`` the calls no rule knows by the values after them); ``ok`` is
    ``status == 'ok'``. ``left_out`` names the outputs of the model the ONNX model does not
    return (a transformers cache exported without it: ``cache.layers[0].conv_states[0]``),
    by their paths in what the model returned; the others are compared. With ``numeric=True``
    the numbers settle what the structure cannot: ``status`` is ``'diverges'`` when a value is out of tolerance and ``'rewritten'`` when the
    structure differs but the values after every difference agree, ``'incomplete'`` when values after a
    random draw differ (eager and onnxruntime draw different numbers; none of them can be compared);
    ``ok`` is then ``status in ('ok', 'rewritten')``. ``str(report)`` is ``report.text`` (led by the numbers'
    answer with ``numeric=True``).
    """

    ok: bool
    matched: list[tuple[str, tuple[str, ...]]]
    missing: list[str]
    extra: list[str]
    rewired: list[str]
    elided: list[tuple[str, str]]
    text: str
    exporter: str | None = None
    opened: list[str] = field(default_factory=list)
    not_opened: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    undecided: list[tuple[str, str]] = field(default_factory=list)
    # check_onnx(numeric=True): every matched call's output against its ONNX value (fwdtrace.onnx.numeric)
    numeric: NumericResult | None = field(default=None, repr=False)
    # What the lists above name, by node id, and the two graphs compared (the trace with the
    # layers no rule knows opened; the ONNX graph pruned): for exports that place the report
    # on the graphs (Model Explorer's pair) without matching again.
    ids: ReportIds = field(default_factory=lambda: ReportIds([], [], []), repr=False, compare=False)
    trace: Graph | None = field(default=None, repr=False, compare=False)
    onnx_graph: Graph | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        if self.numeric is None:
            return self.text
        return "\n".join([self.numeric.lead(), *self.numeric.table(), self.text])

    @property
    def first_divergence(self) -> ValueRow | None:
        """The earliest call whose ONNX value is out of tolerance while its inputs agree (``numeric=True``)."""
        return self._numbers("first_divergence").first_divergence

    @property
    def worst(self) -> list[ValueRow]:
        """The compared calls, largest relative error first (``numeric=True``)."""
        return self._numbers("worst").worst

    def save_repro(self, directory: str | os.PathLike[str]) -> dict[str, str]:
        """Write the first divergence's ONNX subgraph, its input values and the eager result (``numeric=True``).

        See :func:`fwdtrace.onnx.numeric.save_repro`; returns the paths written.
        """
        from .numeric import save_repro

        return save_repro(self._numbers("save_repro()"), directory)

    def _numbers(self, what: str) -> NumericResult:
        if self.numeric is None:
            raise FwdtraceError(f"report.{what} needs values: check_onnx(model, x, numeric=True), "
                                "got a report of the structure only")
        return self.numeric

    def to_model_explorer(self, folder: str | os.PathLike[str]) -> Any:
        """Both graphs and the matches as Model Explorer files in ``folder`` (made if its parent
        exists); see :func:`fwdtrace.passes.model_explorer.onnx_pair_to_model_explorer`."""
        from ..passes.model_explorer import onnx_pair_to_model_explorer

        return onnx_pair_to_model_explorer(self, folder, caller="TopologyReport.to_model_explorer()")

    @property
    def status(self) -> str:
        """``'ok'``, ``'mismatch'`` or ``'incomplete'`` (layers a graph alone cannot open, calls it cannot decide); with numbers
        (``numeric=True``) also ``'diverges'`` and ``'rewritten'``.

        ``'diverges'``: a value is out of tolerance, or a structural mismatch has a value
        after it that differs. ``'rewritten'``: the structure differs, and after every
        mismatch the values agree: the exporter rewrote those parts and they compute the same.
        A mismatch with no compared value after it stays ``'mismatch'``. Values after a random draw
        (dropout in training, ``randn_like``) that differ cannot be compared: ``'incomplete'``.
        """
        numbers = self.numeric.status if self.numeric is not None else None
        if numbers == "diverges":
            return "diverges"
        # every structural mismatch settled by the numbers, only values after random draws left unsettled
        settled = self.numeric is not None and all(m.compared for m in self.numeric.mismatches)
        if self.missing or self.extra or self.rewired:
            return ("rewritten" if numbers == "rewritten" else "incomplete" if numbers == "unchecked" and settled
                    else "mismatch")
        if numbers == "rewritten":  # the calls undecided compute the same
            return "rewritten"
        return "incomplete" if self.not_opened or self.undecided or numbers == "unchecked" else "ok"

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-friendly data."""
        return {
            "ok": self.ok,
            "status": self.status,
            "exporter": self.exporter,
            "matched": [{"trace": t, "onnx": list(o)} for t, o in self.matched],
            "missing": list(self.missing),
            "extra": list(self.extra),
            "rewired": list(self.rewired),
            "elided": [{"trace": t, "how": how} for t, how in self.elided],
            "opened": list(self.opened),
            "not_opened": list(self.not_opened),
            "undecided": [{"trace": t, "why": why} for t, why in self.undecided],
            "left_out": list(self.left_out),
            **({"numeric": self.numeric.to_dict()} if self.numeric is not None else {}),
        }


@dataclass
class _Group:
    """ONNX nodes that implement one trace call (or a graph input or the outputs)."""

    gid: int
    onodes: set[int]
    key: int | None
    trace_ids: list[int] = field(default_factory=list)


@dataclass
class _Result:
    groups: dict[int, _Group]
    missing: list[int]  # trace node ids
    extra: list[int]  # ONNX graph node ids
    elided: list[tuple[int, str]]
    rewired: list[tuple[str, int, int]]  # ("trace" | "onnx" | "order", src gid, dst gid)
    unmatched_inputs: tuple[list[int], list[int]]  # (trace input ids, onnx input ids)
    reqs: dict[int, list[frozenset[int]]]  # trace node id -> the groups that fed each input
    # gid -> where each input comes from, in trace and in ONNX order, for calls whose order differs
    reordered: dict[int, tuple[list[int | None], list[int | None]]] = field(default_factory=dict)
    # layers no rule knows that the graph does not open (trace node id -> the ONNX nodes between)
    unopened: dict[int, list[int]] = field(default_factory=dict)
    outputs_fed: dict[int, list[str]] = field(default_factory=dict)  # gid -> the trace outputs it feeds
    left_out: list[str] = field(default_factory=list)  # cache outputs the export does not return
    undecided: list[tuple[int, str]] = field(default_factory=list)  # trace node id -> why a graph alone cannot tell
    ruleless: list[int] = field(default_factory=list)  # trace node ids of function calls no rule knows


class _Matcher:
    def __init__(self, trace: Graph, og: Graph, model: Any = None) -> None:
        self.t = trace
        self.o = og
        self.tnodes = trace.nodes
        self.onodes = og.nodes
        _scopes_as_called(trace, og)
        self.op_types = [str(n.meta.get("op_type", n.target.rsplit(".", 1)[-1])) for n in og.nodes]
        self.op_types = [QUANTIZED_OPS.get(op, op) for op in self.op_types]  # MatMulInteger is a MatMul
        # ONNX side: og is pruned, so every node is data; a value with a producer is data
        self.producer: dict[int, int] = {}
        self.consumers: dict[int, list[int]] = {}
        for n in og.nodes:
            for r in n.outputs:
                self.producer[r.obj_id] = n.id
        # Ops that read only the shape of their data (RandomNormalLike), and what is computed
        # from them alone, are constants to the comparison, as new tensors are on the trace side.
        self.value_free: set[int] = set()
        for n in og.nodes:  # ONNX node order is topological
            fed = [self.producer[r.obj_id] for r in n.inputs if r.obj_id in self.producer]
            if n.kind == "function" and (
                n.meta.get("op_type") in _VALUE_FREE_OPS or (fed and all(p in self.value_free for p in fed))
            ):
                self.value_free.add(n.id)
        for n in og.nodes:
            if n.id in self.value_free:
                for r in n.outputs:
                    del self.producer[r.obj_id]
        for n in og.nodes:
            for r in n.inputs:
                if r.obj_id in self.producer:
                    self.consumers.setdefault(r.obj_id, []).append(n.id)
        # The sizes an exporter states for what an If computes, and for what follows, are not the
        # example's (TorchScript gives torchvision's batched_nms If the empty branch's [0]).
        self.sized_by_branches: set[int] = set()
        for n in og.nodes:
            if self.op_types[n.id] in _CONTROL_FLOW_OPS or any(
                self.producer.get(r.obj_id, -1) in self.sized_by_branches for r in n.inputs
            ):
                self.sized_by_branches.add(n.id)
        self.wiring = {n.id for n in og.nodes if n.kind == "function" and self._is_wiring(n)}
        self.wiring |= self._index_arithmetic() | self._quantization_scaling()
        for oid in self.wiring:
            og.nodes[oid].meta["wiring"] = True  # for the report and the picture
        self.matched: dict[int, int] = {}  # ONNX node id -> gid
        self.groups: dict[int, _Group] = {}
        self.tensor_groups: dict[int, frozenset[int]] = {}
        self.reqs: dict[int, list[frozenset[int]]] = {}  # trace node id -> input requirements
        self.missing: list[int] = []
        self.missing_producer: dict[int, int] = {}  # obj_id -> missing trace node that wrote it
        self.elided: list[tuple[int, str]] = []
        self.undecided: list[tuple[int, str]] = []  # calls a graph alone cannot decide, and why
        self.written_by: dict[int, int] = {}  # trace obj_id -> the node that last wrote it
        # Value numbers: two tensors with one number hold the same values, made by the same
        # calls from the same inputs (dynamo computes DeBERTa's padding mask once for all layers).
        self.values: dict[int, int] = {}  # trace obj_id -> its value number, as last written
        self.out_values: dict[int, list[int]] = {}  # trace node id -> the value numbers it made
        self.n_values = 0
        self.calls: dict[tuple[Any, ...], list[int]] = {}  # (target, input values, attrs) -> such trace nodes
        self.out_groups: dict[int, list[frozenset[int]]] = {}  # trace node id -> what its outputs stood for
        self.masks: dict[tuple[Any, ...], int] = {}  # a mask's key (_mask_key) -> the first such call matched
        # with the model, layers of one class with equal weights are one computation too
        self.path2module: dict[str, torch.nn.Module] | None = (
            dict(model.named_modules()) if isinstance(model, torch.nn.Module) else None
        )
        self.also_written, self.partial_writes = self._writes_through_views()
        self.made_by: dict[int, int] = {}  # trace obj_id -> the node that first returned it
        for n in trace.nodes:
            for r in n.outputs:
                self.made_by.setdefault(r.obj_id, n.id)
        self.fill_copies: set[int] = set()  # copies into a tensor still holding one value: pads
        self.computed_once: set[int] = set()  # ONNX nodes of one call's region another call is too
        self.trace_succ: dict[int, list[int]] = {}
        for e in trace.edges:
            self.trace_succ.setdefault(e.src, []).append(e.dst)
        self.unopened: list[int] = []  # layers no rule knows, which a graph alone cannot open
        self.ruleless: list[int] = []  # function calls no rule knows, whose ONNX ops are unknown too
        self.unopened_values: set[int] = set()  # trace obj_ids computed through one of them
        self.ruleless_values: set[int] = set()  # those computed through a function call no rule knows
        # the groups such layers read: whether they read a value or only its shape (OPT's positional
        # embedding, the attention mask), a graph alone cannot tell, so no edge from them is required
        self.read_by_unopened: set[int] = set()
        self.after_unopened: set[int] = set()  # trace calls reading a value computed through one of them
        self.out_nodes, self.left_out = self._compared_outputs()
        # to_onnx's provenance: the ONNX nodes it emitted for a call the trace records as one node
        # (batched_nms's loop over the classes), by the call's "<target>#<k>" (fwdtrace.onnx.export.CALL_KEY)
        self.emitted_for: dict[str, list[int]] = {}
        for n in og.nodes:
            if call := n.meta.get("call"):
                self.emitted_for.setdefault(str(call), []).append(n.id)
        self.call_tags: dict[int, str] = {}  # trace node id -> its tag, where the ONNX graph has it
        calls_of: Counter[str] = Counter()
        for tn in trace.nodes if self.emitted_for else ():
            if tn.kind == "function":
                tag = f"{tn.target}#{calls_of[tn.target]}"
                calls_of[tn.target] += 1
                if tag in self.emitted_for:
                    self.call_tags[tn.id] = tag

    # -- ONNX helpers -----------------------------------------------------------------------------
    def op(self, oid: int) -> str:
        return self.op_types[oid]

    def _data_inputs(self, n: Node) -> list[int]:
        return [r.obj_id for r in n.inputs if r.obj_id in self.producer]

    def _is_wiring(self, n: Node) -> bool:
        op = str(n.meta.get("op_type", ""))
        if op in ONNX_WIRING_OPS or n.meta.get("shape_only"):  # shape arithmetic computes no value of the model's
            return True
        data = self._data_inputs(n)
        if op in ("Gather", "GatherND"):  # select/index is wiring; Gather from a weight is an Embedding
            # indexing a tensor made in forward from shapes alone (torchvision's anchor levels, class
            # labels: torch.full, arange().expand_as) is wiring too, as it is on the trace side
            return bool(n.inputs) and (n.inputs[0].obj_id in self.producer or not n.inputs[0].param)
        if op == "Concat":  # of one tensor, or with empty ones (a key/value cache's first step)
            return len(data) == 1 and all(0 in r.shape for r in n.inputs if r.obj_id not in self.producer)
        return False

    def _index_arithmetic(self) -> set[int]:
        """Ops that only compute where a Gather reads (``h[arange(B), ids.argmax(-1)]`` flattened to one index).

        On the trace side indexing is wiring, whatever the index; the exporter's Add, Mul
        or Concat that turn an index tensor into a flat one are wiring too.
        """
        found: set[int] = set()
        for n in reversed(self.onodes):  # consumers before producers
            if n.kind != "function" or self.op(n.id) not in _INDEX_OPS:
                continue
            readers = [
                (c, [r.obj_id for r in self.onodes[c].inputs].index(out.obj_id))
                for out in n.outputs for c in self.consumers.get(out.obj_id, ())
            ]
            if readers and all(c in found or (self.op(c) in _GATHERS and k >= 1) for c, k in readers):
                found.add(n.id)
        return found

    def _quantization_scaling(self) -> set[int]:
        """The arithmetic of quantization's scales: their products, and the Muls that rescale an integer result.

        quantize_dynamic writes a Linear as DynamicQuantizeLinear (the input's int8 data, scale
        and zero point), MatMulInteger, Cast, a Mul of the two scales and a Mul of the result by
        it. Like the quantizing ops, the scale arithmetic retypes data; it is not a computation
        of the model's, so it is wiring. A Mul with no scale among its inputs stays what it is.
        """
        scales: set[int] = set()  # value ids computed from scales alone
        found: set[int] = set()
        for n in self.onodes:  # ONNX node order is topological
            if n.kind != "function":
                continue
            if self.op(n.id) == "DynamicQuantizeLinear":
                scales.update(r.obj_id for r in n.outputs[1:])
                continue
            data = self._data_inputs(n)
            if not data or not any(v in scales for v in data):
                continue
            if all(v in scales for v in data):
                found.add(n.id)
                scales.update(r.obj_id for r in n.outputs)
            elif self.op(n.id) == "Mul":
                found.add(n.id)
        return found

    def _out_values(self, gid: int) -> list[int]:
        return [r.obj_id for oid in sorted(self.groups[gid].onodes) for r in self.onodes[oid].outputs]

    # -- the walk ---------------------------------------------------------------------------------
    def run(self) -> _Result:
        tdata: set[int] = set()
        t_inputs = [n for n in self.tnodes if n.kind == "input"]
        o_inputs = [n for n in self.onodes if n.kind == "input"]
        # an input nothing reads may be dropped by an exporter (TorchScript does) or kept
        live = self._reaches_an_output()
        pairs, lone_t, lone_o = _pair_inputs(
            t_inputs, o_inputs, lambda tn: tn.id in live,
            lambda on: any(r.obj_id in self.consumers for r in on.outputs))
        for tn in [n for n in lone_t if n.id not in live]:
            self.elided.append((tn.id, "unused input"))
            lone_t.remove(tn)
        lone_o = [n for n in lone_o if any(r.obj_id in self.consumers for r in n.outputs)]
        for tn, on in pairs:
            self._new_group(tn.id, {on.id}, on.id)
            for r in tn.outputs:
                self.tensor_groups[r.obj_id] = frozenset({tn.id})
        for tn in t_inputs:
            tdata.update(r.obj_id for r in tn.outputs)
        for tn in self.tnodes:
            if tn.kind in ("input", "output"):
                continue
            if tn.id not in live:  # read only by Python (`if mask.all():`): exporters drop it
                self.elided.append((tn.id, "unused result"))
                continue
            reads = tn.inputs[:1] if canonical_target(tn.target) in SHAPE_ONLY_AFTER_FIRST else tn.inputs
            data_in = [r for r in reads if r.obj_id in tdata]
            # computed from no model input (exporters fold it to a constant), or from none of
            # its values (zeros_like(x) reads only x's shape, y.zero_() overwrites all of y)
            if not data_in or self._makes_a_constant(tn):
                self.elided.append((tn.id, "constant"))
                tdata.difference_update(r.obj_id for r in tn.outputs)  # what it wrote in place is constant now
                tdata.difference_update(self.also_written.get(tn.id, ()))
                continue
            if self._copies_into_a_fill(tn, tdata):  # before the write makes its buffer data
                self.fill_copies.add(tn.id)
            tdata.update(r.obj_id for r in tn.outputs)
            reqs = list(dict.fromkeys(self.tensor_groups[r.obj_id] for r in data_in if r.obj_id in self.tensor_groups))
            self.reqs[tn.id] = reqs
            self._match(tn, reqs, data_in)
            # the tensor a view of it was written through holds the write now (a buffer made
            # with new_full and filled with copy_ is the model's data from then on)
            for obj in self.also_written.get(tn.id, ()):
                tdata.add(obj)
                self.tensor_groups[obj] = self.tensor_groups[tn.outputs[0].obj_id]
                self.written_by[obj] = tn.id
                self.values[obj] = self._fresh_value()
        # the trace has an output node per returned tensor, the ONNX graph one for all
        out_nodes = self.out_nodes
        o_out = next((n for n in self.onodes if n.kind == "output"), None)
        if out_nodes and o_out is not None:
            self.reqs[_OUTPUT_GROUP] = list(dict.fromkeys(
                self.tensor_groups[r.obj_id] for n in out_nodes for r in n.inputs if r.obj_id in self.tensor_groups
            ))
            self._new_group(_OUTPUT_GROUP, {o_out.id}, o_out.id)
            self.groups[_OUTPUT_GROUP].trace_ids.extend(n.id for n in out_nodes)
        self._absorb_merges()
        self._constants_indexed()
        extra = [
            n.id for n in self.onodes
            if n.kind == "function" and n.id not in self.matched and n.id not in self.wiring
            and n.id not in self.value_free
        ]
        unopened = self._inside_unopened(extra, self.unopened)
        inside = {oid for oids in unopened.values() for oid in oids}
        extra = [oid for oid in extra if oid not in inside]
        for tid, oids in self._inside_unopened(extra, self.ruleless).items():
            if not oids:  # nothing of it in the export
                self._add_missing(self.tnodes[tid])
                continue
            self.undecided.append((tid, f"no ONNX rule knows {self.tnodes[tid].target}: "
                                        f"{', '.join(_onnx_name(self.onodes[o]) for o in oids)} between its inputs "
                                        "and its readers taken as its, unchecked (fwdtrace.onnx_equivalent declares "
                                        "a rule; numeric=True compares the values after it)"))
            extra = [oid for oid in extra if oid not in oids]
        for tn in [n for n in lone_t if n.id in self.trace_succ and set(self.trace_succ[n.id]) <= set(self.unopened)]:
            # read by layers not opened alone, perhaps for its shape (TorchScript then drops it from the file)
            self.elided.append((tn.id, "read only by layers not opened, perhaps for its shape"))
            lone_t.remove(tn)
        reordered = self._reordered()
        rewired = self._rewired() + [("order", gid, gid) for gid in reordered]
        outputs_fed: dict[int, list[str]] = {}
        for n in out_nodes:
            for gid in sorted(self.tensor_groups.get(n.inputs[0].obj_id, ())) if n.inputs else ():
                outputs_fed.setdefault(gid, []).append(_output_label(n))
        return _Result(self.groups, sorted(self.missing), extra, self.elided, rewired,
                       ([n.id for n in lone_t], [n.id for n in lone_o]), self.reqs, reordered, unopened,
                       outputs_fed, [_output_label(n) for n in self.left_out], self.undecided, self.ruleless)

    def _constants_indexed(self) -> None:
        """A Gather from a constant by a computed index that no call took as its op is wiring.

        Gather from a weight is an Embedding while an embedding call matches it; otherwise it
        is indexing, which is wiring on the trace side whatever it reads: a detector's anchors,
        made from shapes alone and folded to a constant, read at the top-scoring places
        (``anchors[top]``).
        """
        for n in self.onodes:
            if (n.kind == "function" and n.id not in self.matched and n.id not in self.wiring
                    and self.op(n.id) in ("Gather", "GatherND") and self._data_inputs(n)):
                self.wiring.add(n.id)
                n.meta["wiring"] = True

    def _compared_outputs(self) -> tuple[list[Node], list[Node]]:
        """The trace outputs the export returns too, and the KV cache outputs it leaves out.

        The trace's outputs include a returned cache's tensors; an export may return them
        (fwdtrace's to_onnx, the dynamo exporter) or not (a file exported without them). Only
        when the ONNX graph has exactly the other outputs are the cache's left out.
        """
        outs = [n for n in self.tnodes if n.kind == "output"]
        cached = [n for n in outs if n.meta.get("cache")]
        o_out = next((n for n in self.onodes if n.kind == "output"), None)
        if cached and o_out is not None and len(o_out.inputs) == len(outs) - len(cached):
            return [n for n in outs if not n.meta.get("cache")], cached
        return outs, []

    def _inside_unopened(self, extra: list[int], calls: list[int]) -> dict[int, list[int]]:
        """The extra ONNX nodes each layer not opened may have become.

        Those reached from the layer's inputs through unmatched ops only, within the layer's
        scope where the export names one: they are the layer's, unchecked, not extra.
        """
        found: dict[int, list[int]] = {}
        extra_set = set(extra)
        taken: set[int] = set()
        for tid in calls:
            tn = self.tnodes[tid]
            sources = frozenset().union(*self.reqs.get(tid, [])) if self.reqs.get(tid) else frozenset()
            seen: set[int] = set()
            queue = deque(c for gid in sorted(sources) for v in self._out_values(gid) for c in self.consumers.get(v, ()))
            while queue:
                oid = queue.popleft()
                if oid in seen or oid in self.matched or self.onodes[oid].kind != "function":
                    continue
                seen.add(oid)
                for r in self.onodes[oid].outputs:
                    queue.extend(self.consumers.get(r.obj_id, ()))
            scope = tn.module_path

            def in_scope(oid: int, scope: str = scope) -> bool:
                s = self.onodes[oid].meta.get("scope")
                return s is None or not scope or s == scope or str(s).startswith(scope + ".")

            mine = [oid for oid in sorted(seen) if oid in extra_set and oid not in taken and in_scope(oid)]
            # and the extra ops of its scope feeding those: an attention function's softmax sits
            # between its scores (reached from q and k) and the product with v
            stack = list(mine)
            while stack:
                for p in (self.producer[v] for v in self._data_inputs(self.onodes[stack.pop()])):
                    if p in extra_set and p not in taken and p not in mine and in_scope(p) and \
                            self.onodes[p].meta.get("scope") is not None:
                        mine.append(p)
                        stack.append(p)
            mine.sort()
            taken.update(mine)
            found[tid] = mine
        return found

    def _absorb_merges(self) -> None:
        """An unmatched op fed from inside one call's region, as its rule allows, is that call's.

        The walk builds a region backwards from its last op, so it misses side outputs: the
        Concat stacking a multi-layer GRU's final states, the ReduceMean averaging a
        MultiheadAttention's weights. An op fed by the call's result alone comes after the
        call and stays extra.
        """
        for n in self.onodes:
            if n.kind != "function" or n.id in self.matched or n.id in self.wiring or n.id in self.value_free:
                continue
            feeders: set[int] = set()
            wires: set[int] = set()
            stack = list(self._data_inputs(n))
            blocked = False
            while stack and not blocked:
                p = self.producer[stack.pop()]
                if p in self.matched:
                    feeders.add(p)
                elif p not in self.wiring:
                    blocked = True  # fed by another unmatched op: not a merge of one region
                elif p not in wires:
                    wires.add(p)
                    stack.extend(self._data_inputs(self.onodes[p]))
            if blocked or len(owners := {self.matched[p] for p in feeders}) != 1:
                continue
            group = self.groups[owners.pop()]
            if feeders <= {group.key}:  # fed by the call's result alone: an op after the call
                continue
            if not any(self.consumers.get(r.obj_id) for r in n.outputs):
                continue  # a dead end (a tampered call's orphaned input) stays extra
            tn = self.tnodes[group.gid] if group.gid >= 0 else None
            eq = equivalence_for(tn) if tn is not None and tn.kind in ("module", "function") else None
            counts = Counter(self.op(o) for o in group.onodes if o not in self.wiring) + Counter([self.op(n.id)])
            if eq is not None and group.key is not None and any(
                p.admits(counts, self.op(group.key)) for p in eq.patterns
            ):
                for oid in {n.id} | wires:
                    group.onodes.add(oid)
                    self.matched[oid] = group.gid

    def _makes_a_constant(self, tn: Node) -> bool:
        """Whether a call reads none of its input's values: ``zeros_like(x)``, ``y.zero_()`` (not ``y[:2].zero_()``)."""
        target = canonical_target(tn.target)
        return target in NEW_TENSOR_FUNCTIONS or (
            target in OVERWRITE_FUNCTIONS and len(tn.inputs) == 1 and tn.id not in self.partial_writes
        )

    def _copies_into_a_fill(self, tn: Node, tdata: set[int]) -> bool:
        """Whether ``tn`` copies data into (a view of) a new tensor that holds one value yet: a constant pad.

        ``img.new_full(size, 0)[0, :c, :h, :w].copy_(img)`` is ``F.pad(img, ...)`` written
        out, as torchvision's ``batch_images`` does eagerly and pads when traced.
        """
        if canonical_target(tn.target) not in COPY_FUNCTIONS or not tn.inputs or tn.inputs[0].obj_id in tdata:
            return False
        written = [tn.inputs[0].obj_id, *self.also_written.get(tn.id, ())]
        return any(
            (maker := self.made_by.get(obj)) is not None and canonical_target(self.tnodes[maker].target) in FILL_FUNCTIONS
            for obj in written
        )

    def _written_rank(self, tn: Node) -> int | None:
        """The rank of the largest tensor a call wrote through a view (``buf`` of ``buf[0].copy_(img)``)."""
        also = set(self.also_written.get(tn.id, ()))
        return max((len(e.shape) for e in self.t.edges if e.src == tn.id and e.obj_id in also), default=None)

    def _writes_through_views(self) -> tuple[dict[int, list[int]], dict[int, tuple[int, ...]]]:
        """Tensors that in-place calls wrote besides the ones they returned, and the calls that wrote part of one.

        ``buf[0, :h].copy_(img)`` returns the view and writes ``buf``: the trace wires later
        reads of ``buf`` to the copy, an edge carrying a tensor the call did not return.
        Returns node id -> such tensors, and node id -> the shape of the largest, for calls
        that wrote into a larger tensor (the export scatters the write back into it).
        """
        also: dict[int, dict[int, None]] = {}
        partial: dict[int, tuple[int, ...]] = {}
        for e in self.t.edges:
            src = self.tnodes[e.src]
            if src.kind != "function" or not src.outputs or any(r.obj_id == e.obj_id for r in src.outputs):
                continue
            also.setdefault(e.src, {})[e.obj_id] = None
            if _numel(e.shape) > _numel(partial.get(e.src, src.outputs[0].shape)):
                partial[e.src] = e.shape
        # an earlier write through the same view wrote into the same tensor, though nothing read it
        # before this one wrote again (``v = y[1:]; v[:, 0] = a; v[:, 1] = b``): the export puts each back
        for nid in sorted(partial, reverse=True):
            view = self.tnodes[nid].outputs[0].obj_id
            if self.tnodes[nid].inputs[:1] and self.tnodes[nid].inputs[0].obj_id != view:
                continue
            for earlier in reversed(self.tnodes[:nid]):
                if earlier.kind != "function" or not earlier.outputs or earlier.outputs[0].obj_id != view:
                    continue
                if not earlier.inputs or earlier.inputs[0].obj_id != view or earlier.id in partial:
                    break  # what made the view, or a write already known
                partial[earlier.id] = partial[nid]
                also.setdefault(earlier.id, {}).update(dict.fromkeys(also.get(nid, {})))
        return {nid: list(objs) for nid, objs in also.items()}, partial

    def _reaches_an_output(self) -> set[int]:
        """Trace nodes some output depends on."""
        preds: dict[int, list[int]] = {}
        for e in self.t.edges:
            target = canonical_target(self.tnodes[e.dst].target)
            # a new tensor shaped like its input (zeros_like) needs none of its values, nor
            # y.reshape_as(x) those of x
            if self._makes_a_constant(self.tnodes[e.dst]) or (
                target in SHAPE_ONLY_AFTER_FIRST and e.obj_id != self.tnodes[e.dst].inputs[0].obj_id
            ):
                continue
            preds.setdefault(e.dst, []).append(e.src)
        live: set[int] = set()
        stack = [n.id for n in self.out_nodes]
        if not stack:
            return {n.id for n in self.tnodes}
        while stack:
            nid = stack.pop()
            if nid not in live:
                live.add(nid)
                stack.extend(preds.get(nid, ()))
        return live

    def _add_missing(self, tn: Node) -> None:
        self.missing.append(tn.id)
        for r in tn.outputs:
            self.missing_producer[r.obj_id] = tn.id

    def _new_group(self, gid: int, onodes: set[int], key: int | None) -> None:
        self.groups[gid] = _Group(gid, set(onodes), key, [gid] if gid >= 0 else [])
        for oid in onodes:
            self.matched[oid] = gid

    def _match(self, tn: Node, reqs: list[frozenset[int]], data_in: list[TensorRef]) -> None:
        eq = equivalence_for(tn)
        if tn.id in self.fill_copies:  # a pad written out: a Pad, or the write put back
            eq = copied_into_a_fill(eq, len(self.partial_writes[tn.id]) if tn.id in self.partial_writes else None,
                                    self._written_rank(tn))
        elif tn.id in self.partial_writes:  # y[:, :2].mul_(2): the Mul, then a scatter into y
            eq = written_through_a_view(eq, len(self.partial_writes[tn.id]))
        elif eq is not None and canonical_target(tn.target) in SETITEM_FUNCTIONS and len(tn.inputs) == 2:
            eq = scattered_per_dimension(eq, _indexed_dims(tn.inputs[0].shape, tn.inputs[1].shape))
        call_key = self._call_key(tn)
        earlier = self._earlier_call(tn, call_key)
        mask_key = self._mask_key(tn, data_in) if earlier is None else None
        same_mask = self.masks.get(mask_key) if mask_key is not None else None
        twin = self._twin_of_unknown_weights(tn, call_key) if earlier is None and same_mask is None else None
        passthrough = frozenset().union(*reqs) if reqs else frozenset()
        # a BatchNorm after a Conv that is missing would have been folded into it
        missing_feeder = self.missing_producer.get(data_in[0].obj_id) if len(data_in) == 1 else None
        outs: list[frozenset[int]] | None = None
        through_unopened = any(r.obj_id in self.unopened_values for r in data_in)
        through_ruleless = any(r.obj_id in self.ruleless_values for r in data_in)
        if through_unopened:
            self.after_unopened.add(tn.id)
        emitted = self._emitted(tn)
        if emitted is not None:  # the exporter says which ops it wrote for this call: all of them
            self._new_group(tn.id, emitted[1], emitted[0])
            tn_out = frozenset({tn.id})
        elif eq is None and (tn.kind == "module" or tn.attrs.get("atomic")):
            # a layer or an atomic function no rule knows: a graph alone cannot open it
            self.unopened.append(tn.id)
            through_unopened = True
            tn_out = passthrough
            self.read_by_unopened.update(passthrough)
        elif eq is None:
            # a call no rule knows (Tensor.std): which ONNX ops it became is unknown, as for a
            # layer not opened, so the calls reading its result may stand behind them
            self.ruleless.append(tn.id)
            through_unopened = through_ruleless = True
            tn_out = passthrough
            self.read_by_unopened.update(passthrough)
        else:
            single = next(iter(reqs[0])) if len(reqs) == 1 and len(reqs[0]) == 1 else None
            feeder = self.groups.get(single) if single is not None else None
            can_fold = bool(
                eq.folds_into and feeder is not None and feeder.key is not None
                and self.op(feeder.key) in eq.folds_into
            )
            simpler = self._simplification(tn, eq, data_in, earlier, same_mask, twin)
            # an op right where the inputs are, or none at all (not one further on, named by its scope)
            strict = can_fold or simpler is not None
            skipped = 0 if strict else _UNOPENED_SKIPPED if through_unopened else MAX_SKIPPED
            found = self._find(tn, eq, reqs, max_skipped=skipped, anchored=simpler is None) if eq.patterns else None
            if found is None and through_unopened and eq.patterns:
                # what a layer not opened passed on it may have read for its shape alone (a positional
                # embedding sized by the mask: a constant in the file), so the call may stand on the rest
                known = list(dict.fromkeys(self.tensor_groups[r.obj_id] for r in data_in if r.obj_id in self.tensor_groups
                                           and r.obj_id not in self.unopened_values - self.ruleless_values))
                if known and len(known) < len(reqs):
                    found = self._find(tn, eq, known, max_skipped=skipped, anchored=simpler is None)
            if found is not None:
                key, region = found
                self._new_group(tn.id, region, key)
                tn_out = frozenset({tn.id})
                # the calls whose op it shares (computed once) feed it in ONNX: so in the trace
                shared = sorted({self.matched[p] for o in region for v in self._data_inputs(self.onodes[o])
                                 if (p := self.producer[v]) in self.matched and self.matched[p] not in passthrough
                                 and self.matched[p] != tn.id and p not in self.computed_once
                                 and self.op(p) in eq.op_types
                                 and self._computed_once_with(self.matched[p], p, passthrough)})
                self.reqs[tn.id] = reqs = [*reqs, *(frozenset({g}) for g in shared)]
            elif simpler is not None:
                how, outs = simpler
                (self.undecided if twin is not None else self.elided).append((tn.id, how))
                tn_out = passthrough
            elif can_fold and feeder is not None and feeder.key is not None:
                feeder.trace_ids.append(tn.id)
                self.elided.append((tn.id, f"folded into {self.onodes[feeder.key].meta.get('onnx_name')}"))
                tn_out = frozenset({feeder.gid})
            elif (
                eq.folds_into and missing_feeder is not None
                and eq.folds_into & (equivalence_for(self.tnodes[missing_feeder]) or Equivalence()).op_types
            ):
                self.elided.append((tn.id, f"would fold into {_trace_label(self.tnodes[missing_feeder])}, missing"))
                tn_out = passthrough
            elif (inside := self._inside_another(eq, reqs)) is not None:
                self.elided.append((tn.id, f"simplified: computed once, as {_onnx_name(self.onodes[inside[1]])} "
                                           f"of {_trace_label(self.tnodes[inside[0]])}"))
                self.computed_once.add(inside[1])
                tn_out = passthrough
            elif eq.optional:
                wiring = not eq.patterns or tn.id in self.fill_copies  # a copy filling all of the buffer
                self.elided.append((tn.id, "wiring" if wiring else "removed by the exporter"))
                tn_out = passthrough
            else:
                self._add_missing(tn)
                tn_out = passthrough
        if earlier is None and tn.id not in self.groups and outs is not None:
            # elided as the mask or the layer computed once: the same values from here on
            earlier = same_mask if same_mask is not None else twin
        if mask_key is not None and tn.id in self.groups:
            self.masks.setdefault(mask_key, tn.id)
        values = self.out_values[earlier] if earlier is not None else [self._fresh_value() for _ in tn.outputs]
        self.out_values[tn.id] = values
        for i, r in enumerate(tn.outputs):
            self.tensor_groups[r.obj_id] = outs[i] if outs is not None and i < len(outs) else tn_out
            self.written_by[r.obj_id] = tn.id
            self.values[r.obj_id] = values[i]
        self.out_groups[tn.id] = [self.tensor_groups[r.obj_id] for r in tn.outputs]
        if through_unopened and tn.id not in self.groups:  # passed on, still behind the unknown ops
            self.unopened_values.update(r.obj_id for r in tn.outputs)
            if through_ruleless and outs is None:  # not an earlier call's values again
                self.ruleless_values.update(r.obj_id for r in tn.outputs)
        self.calls.setdefault(call_key, []).append(tn.id)

    def _emitted(self, tn: Node) -> tuple[int, set[int]] | None:
        """The ONNX ops to_onnx emitted for this call, by their provenance, and the last whose result leaves them.

        A call recorded as one node may run a loop whose length the example decides (the
        classes batched_nms meets): no pattern counts its ops, but the emitter knows them.
        None where the ONNX graph does not say, or holds none of the call's ops (an export
        that dropped them: the call is then missing as any other).
        """
        tag = self.call_tags.get(tn.id)
        if tag is None:
            return None
        region = {oid for oid in self.emitted_for[tag] if oid not in self.matched and oid not in self.value_free}
        ops = [oid for oid in region if oid not in self.wiring]
        if not ops:
            return None
        leaving = [
            oid for oid in ops
            if any(c not in region for r in self.onodes[oid].outputs for c in self.consumers.get(r.obj_id, ()))
        ]
        return max(leaving or ops), region

    def _final_states(self, region: set[int]) -> set[int]:
        """The Concats that stack a multi-layer recurrent call's per-layer final states (its h_n, c_n).

        They read the layers' Y_h and Y_c, downstream of the last layer (the region's key),
        so the walk up from the key does not reach them.
        """
        layers = {oid for oid in region if self.op(oid) in _RECURRENT_OPS}
        if len(layers) < 2:
            return set()
        found: set[int] = set()
        for oid in layers:
            for r in self.onodes[oid].outputs:
                for c in self.consumers.get(r.obj_id, ()):
                    feeders = {self.producer[v] for v in self._data_inputs(self.onodes[c])}
                    if self.op(c) == "Concat" and c not in self.matched and feeders == layers:
                        found.add(c)
        return found

    def _fresh_value(self) -> int:
        self.n_values += 1
        return self.n_values

    def _value(self, obj_id: int) -> int:
        """The value number of a tensor; one first seen (an input, a weight) is a value of its own."""
        if obj_id not in self.values:
            self.values[obj_id] = self._fresh_value()
        return self.values[obj_id]

    def _call_key(self, tn: Node) -> tuple[Any, ...]:
        """What makes two calls the same computation: target, the values of their inputs, arguments.

        A layer's weights are not among its inputs: :meth:`_same_weights` decides for layers.
        """
        inputs = tuple(self._value(r.obj_id) for r in tn.inputs)
        return (canonical_target(tn.target), inputs, repr(sorted(tn.attrs.items())))

    def _earlier_call(self, tn: Node, call_key: tuple[Any, ...]) -> int | None:
        """An earlier call that computed what ``tn`` computes, if any.

        Not for an index the trace could not keep (``x[:, t]`` would make every step look the
        same), nor anything random.
        """
        target = canonical_target(tn.target)
        args = tn.attrs.get("args")
        if None in (args or ()) or (args is None and target in _INDEXING) or draws_random(tn):
            return None
        return next((e for e in self.calls.get(call_key, ()) if self._same_weights(self.tnodes[e], tn)), None)

    def _mask_key(self, tn: Node, data_in: list[TensorRef]) -> tuple[Any, ...] | None:
        """What makes two mask computations alike where their values cannot be told apart: None for other calls.

        transformers builds a padding mask per stack from the same attention mask by indexing
        it with tensors made from shapes (BART's encoder and its decoder's cross-attention); the
        trace keeps no index, so their values are not known equal, yet an exporter that folds
        the constants sees they are and computes the mask once. Boolean results only: the target,
        its arguments, the groups the data inputs stand for and every shape must agree.
        """
        if not tn.outputs or any(r.dtype != "bool" for r in tn.outputs) or draws_random(tn):
            return None
        data = {r.obj_id for r in data_in}
        reads = tuple(
            (self.tensor_groups.get(r.obj_id), r.shape) if r.obj_id in data else ("constant", r.shape, r.dtype)
            for r in tn.inputs
        )
        return (canonical_target(tn.target), reads, tuple(r.shape for r in tn.outputs), repr(sorted(tn.attrs.items())))

    def _twin_of_unknown_weights(self, tn: Node, call_key: tuple[Any, ...]) -> int | None:
        """An earlier layer of the same class on the same inputs, where there is no model to compare weights.

        Given a graph alone, LeViT's two heads (fresh from their initialiser, so equal) that the
        dynamo exporter computes once cannot be told from an export that dropped a layer.
        """
        if self.path2module is not None or tn.kind != "module" or not _has_weights(tn) or draws_random(tn):
            return None
        return next((e for e in self.calls.get(call_key, ()) if self.tnodes[e].module_path != tn.module_path), None)

    def _same_weights(self, first: Node, tn: Node) -> bool:
        """Whether two calls of one target use the same weights: one layer, or a layer whose ONNX form has none.

        Two layers with equal weights (LeViT's two heads' BatchNorms, fresh from their
        initialiser) are too, where the model is at hand to compare their values.
        """
        if tn.kind != "module" or first.module_path == tn.module_path or not _has_weights(tn):
            return True  # a function, one layer, or layers without weights (two MaxPools alike)
        if self.path2module is None:
            return False
        return _equal_layers(self.path2module.get(first.module_path), self.path2module.get(tn.module_path))

    def _simplification(
        self, tn: Node, eq: Equivalence, data_in: list[TensorRef], earlier: int | None, same_mask: int | None = None,
        twin: int | None = None,
    ) -> tuple[str, list[frozenset[int]] | None] | None:
        """Why an exporter may drop this call without changing the result, and what stands for it.

        A call repeated on the same inputs is computed once (common subexpressions, also
        across layers: a padding mask inverted by each), as is a layer with the same weights
        as one already applied to the same input; an idempotent op applied to its own
        result (``relu(relu(x))``) is merged, and ``x + 0``, ``x * 1`` are nothing. Returns
        None for any other call.
        """
        if earlier is not None and eq.patterns and not eq.optional:
            first = self.tnodes[earlier]
            twin = tn.kind == "module" and first.module_path != tn.module_path and _has_weights(tn)
            return (f"simplified: repeats {_trace_label(first)} on the same inputs"
                    f"{' with equal weights' if twin else ''}, computed once"), self.out_groups[earlier]
        if twin is not None and eq.patterns and not eq.optional:
            return (f"repeats {_trace_label(self.tnodes[twin])} on the same inputs, which the export computes once: "
                    "right if their weights are equal, which a graph alone does not show"), self.out_groups[twin]
        if same_mask is not None and eq.patterns and not eq.optional:
            return (f"simplified: repeats {_trace_label(self.tnodes[same_mask])}, the same mask from the same "
                    "inputs, computed once"), self.out_groups[same_mask]
        target = canonical_target(tn.target)
        succs = [self.tnodes[s] for s in self.trace_succ.get(tn.id, ())]
        if target in _CATS and succs and all(
            canonical_target(s.target) in _CATS and s.attrs == tn.attrs for s in succs
        ):
            return "simplified: merged into the concatenation it feeds", None
        if len(data_in) != 1 or not eq.patterns or len(eq.patterns[0].ops) != 1:
            return None
        op = eq.patterns[0].ops[0][0]
        if op in _IDEMPOTENT_OPS:
            prev_id = self.written_by.get(data_in[0].obj_id)
            prev = self.tnodes[prev_id] if prev_id is not None else None
            prev_eq = equivalence_for(prev) if prev is not None else None
            if prev is not None and prev_eq is not None and prev_eq.patterns == eq.patterns and prev.attrs == tn.attrs:
                return f"simplified: repeats {_trace_label(prev)} on its own result (idempotent), merged", None
        scalars = [a for a in tn.attrs.get("args", []) if a is not None]
        neutral = _NEUTRAL.get(op)
        reflected = ".__r" in tn.target or "rsub" in tn.target
        if neutral is not None and not reflected and len(tn.inputs) == 1 and scalars == [neutral]:
            return f"simplified: {op} by {neutral}, a no-op", None
        return None

    # -- finding a partner ------------------------------------------------------------------------
    def _find(
        self, tn: Node, eq: Equivalence, reqs: list[frozenset[int]], max_skipped: int, anchored: bool = True
    ) -> tuple[int, set[int]] | None:
        sources = frozenset().union(*reqs) if reqs else frozenset()
        ops = eq.op_types
        budget: Counter[str] = Counter()
        for p in eq.patterns:
            for op, n in p.ops:
                budget[op] = max(budget[op], n)
        scopes = self._trace_scopes(tn)
        params = {r.param for r in tn.inputs if r.param}
        if tn.kind == "module":  # a layer's own weights are not inputs: match them by their path
            params |= {f"{s}." for s in scopes if s}
        # after a call that is missing, its op may stand between the inputs and the partner: of the
        # candidates, the one that reads what the call read (by shape) is the call's, not one skipping less
        # (TorchScript drops the write-back of ``y = x[0]; y[:] = 1; y.mean()``: the mean reads the slice)
        after_missing = {r.shape for r in tn.inputs if r.obj_id in self.missing_producer}
        # behind a call no rule knows, the value it became is one of its ops' results, which only
        # the shape tells from the others (see _reads_shaped)
        behind = {r.shape for r in tn.inputs if r.obj_id in self.ruleless_values}
        reads: dict[int, frozenset[int]] = {}  # candidate -> the values shaped so that it reads
        best: tuple[tuple[Any, ...], int, set[int]] | None = None
        for cand, _cost in self._reachable(sources, ops, max_skipped):
            if not self._compatible(tn, cand):
                continue
            region = self._region(cand, sources, reqs, ops, budget, eq, max_skipped)
            if region is None:
                continue
            nodes, skipped, touched = region
            results = {cand} | (self._final_states(nodes) if self.op(cand) in _RECURRENT_OPS else set())
            nodes |= results
            size = sum(1 for oid in nodes if oid not in self.wiring)
            # After the scope and the ops skipped: the region reached from more of the calls behind
            # the inputs (a call the trace elided passes both its inputs on: SSD's box[idxs] stands
            # for box and topk, and a Concat of the topks alone is the scores', not the boxes');
            # then one whose own work nothing outside reads, for a larger region may have taken in
            # the next call's op (a box decoder's Sub, reached through the anchors' Gather by the
            # index); then the larger; then, of two alike but for wiring, the one that ends the call
            # (floor division's Where after its And, where its Div, Sub and Where only index).
            leaks = len(self._read_outside(results, nodes))
            reads_alike = bool(after_missing) and after_missing <= {r.shape for r in self.onodes[cand].inputs}
            # and, of writes, one that does not take the next write's scatter in
            in_turn = self._writes_in_turn(nodes)
            score = (self._anchor(cand, nodes, scopes, params), reads_alike, -len(skipped), len(touched), -in_turn,
                     -leaks, size, len(nodes), -cand)
            if behind:
                reads[cand] = self._reads_shaped(cand, behind)
                if not reads[cand]:
                    continue
            if best is None or score > best[0]:
                best = (score, cand, nodes)
        if best is not None and len({vs for vs in reads.values() if vs}) > 1:
            return None  # the call's partner reads one of several of the unknown call's values: which, no rule says
        if best is None and anchored:
            best = self._anchored_fallback(tn, eq, ops, budget, scopes, params)
        return None if best is None else (best[1], best[2])

    def _inside_another(self, eq: Equivalence, reqs: list[frozenset[int]]) -> tuple[int, int] | None:
        """A one-op call's op that an earlier call's region holds, read from just what the call reads.

        The other side of :meth:`_computed_once_with`: AdaIN's ``x - x.mean()`` is the Sub
        inside the dynamo exporter's ``x.std()``. Returns (that call's group, the ONNX node).
        """
        ones = {p.ops[0][0] for p in eq.patterns if p.ops == ((p.ops[0][0], 1),)}
        sources = frozenset().union(*reqs) if reqs else frozenset()
        if not ones or len(reqs) < 2:
            return None
        for n in self.onodes:
            gid = self.matched.get(n.id)
            if gid is None or gid < 0 or n.id == self.groups[gid].key or self.op(n.id) not in ones:
                continue
            behind = [self._groups_behind(self.producer[v]) for v in self._data_inputs(n)]
            if set().union(*behind) == sources and all(len(b) == 1 for b in behind):
                return gid, n.id
        return None

    def _computed_once_with(self, gid: int, oid: int, sources: frozenset[int]) -> bool:
        """Whether ONNX node ``oid``, all of call ``gid``'s work, may be shared with a call reading ``sources``.

        An exporter computes a subexpression once: the dynamo exporter's ``x.std()`` reads the
        ReduceMean of the ``x.mean()`` before it (AdaIN). Only a call computed from those same
        inputs alone, and of one op, may be an op of the call after it too.
        """
        group = self.groups.get(gid)
        if gid < 0 or group is None or group.key != oid or self.tnodes[gid].kind != "function":
            return False
        if any(o != oid and o not in self.wiring for o in group.onodes):
            return False
        read = frozenset().union(*self.reqs.get(gid, [])) if self.reqs.get(gid) else frozenset()
        return bool(read) and read <= sources

    def _reads_shaped(self, oid: int, shapes: set[tuple[int, ...]]) -> frozenset[int]:
        """The values shaped as ``shapes`` that an ONNX node reads, each as the result of an unmatched op before any wiring.

        After a call no rule knows (``Tensor.std``), the op that reads its result reads a value
        of its shape, made by one of its ops. Several such values, read by candidates alike
        (``std(x) * 2``: the Mul by N inside the std, the Mul after its Sqrt), leave the pairing
        undecided rather than wrong.
        """
        found = set()
        for r in self.onodes[oid].inputs:
            if r.obj_id not in self.producer or not _may_be_shaped(r.shape, shapes):
                continue
            v = r.obj_id
            while (p := self.producer.get(v)) is not None and p in self.wiring and len(self._data_inputs(self.onodes[p])) == 1:
                v = self._data_inputs(self.onodes[p])[0]
            if self.producer.get(v) not in self.matched:
                found.add(v)
        return frozenset(found)

    def _writes_in_turn(self, region: set[int]) -> bool:
        """Whether a scatter of the region writes into what another scatter of it wrote: two writes, not one.

        One write through a view nests its scatters, each putting the one inside back into the
        larger tensor (its update); a later write scatters into the result (its data):
        ``x[1:3, 2:4].zero_()`` then ``x[0].fill_(2)``, dynamo's two slice scatters then a select scatter.
        """
        for oid in region:
            if self.op(oid) not in _SCATTERS or not self.onodes[oid].inputs:
                continue
            data = self.onodes[oid].inputs[0].obj_id
            seen: set[int] = set()
            while data in self.producer and (p := self.producer[data]) not in seen:
                seen.add(p)
                if self.op(p) in _SCATTERS:
                    if p in region:
                        return True
                    break
                if p not in self.wiring or not self._data_inputs(self.onodes[p]):
                    break
                data = self._data_inputs(self.onodes[p])[0]
        return False

    def _read_outside(self, results: set[int], region: set[int]) -> set[int]:
        """The region's nodes besides ``results`` that compute from its own work and are read outside it.

        A call's results leave through its last op (and a recurrent call's stacked final
        states); what its other ops compute is its own. What the region computes from the
        call's inputs alone may be shared (an exporter computes one attention mask's additive
        form for every layer: :meth:`_prelude`).
        """
        found = set()
        for oid in region:
            if oid in results or not any(self.producer[v] in region for v in self._data_inputs(self.onodes[oid])):
                continue
            if any(c not in region for r in self.onodes[oid].outputs for c in self.consumers.get(r.obj_id, ())):
                found.add(oid)
        return found

    def _reachable(self, sources: frozenset[int], ops: frozenset[str], max_skipped: int) -> list[tuple[int, int]]:
        """Unmatched ONNX nodes of the wanted op types downstream of ``sources``, with skip counts."""
        cost: dict[int, int] = {}
        queue: deque[tuple[int, int]] = deque()
        for gid in sorted(sources):
            for v in self._out_values(gid):
                for c in self.consumers.get(v, ()):
                    queue.append((c, 0))
        while queue and len(cost) < 2000:
            oid, c = queue.popleft()
            if oid in self.matched or (oid in cost and cost[oid] <= c) or self.onodes[oid].kind != "function":
                continue
            cost[oid] = c
            nxt = c if (oid in self.wiring or self.op(oid) in ops) else c + 1
            if nxt > max_skipped:
                continue
            for r in self.onodes[oid].outputs:
                for d in self.consumers.get(r.obj_id, ()):
                    if nxt == c:
                        queue.appendleft((d, nxt))
                    else:
                        queue.append((d, nxt))
        return sorted(((oid, c) for oid, c in cost.items() if self.op(oid) in ops), key=lambda x: (x[1], x[0]))

    def _region(
        self,
        key: int,
        sources: frozenset[int],
        reqs: list[frozenset[int]],
        ops: frozenset[str],
        budget: Counter[str],
        eq: Equivalence,
        max_skipped: int,
    ) -> tuple[set[int], set[int], set[int]] | None:
        """The ONNX nodes between the sources and ``key`` that implement the call, the ops skipped, the groups reached; or None."""
        region = {key}
        counts: Counter[str] = Counter({self.op(key): 1})
        skipped: set[int] = set()
        touched: set[int] = set()
        stack = [key]
        while stack:
            oid = stack.pop()
            for v in self._data_inputs(self.onodes[oid]):
                p = self.producer[v]
                if p in self.matched:
                    g = self.matched[p]
                    if p in self.computed_once and g not in sources:  # another call's op, and ours too
                        behind = set().union(*(self._groups_behind(self.producer[v])
                                               for v in self._data_inputs(self.onodes[p])))
                        if not behind <= sources:
                            return None
                        touched |= behind
                        continue
                    if g not in sources:
                        if not self._computed_once_with(g, p, sources) or not (
                            self.op(p) in ops and counts[self.op(p)] < budget[self.op(p)]
                        ):
                            return None  # the candidate also depends on some other matched call
                        counts[self.op(p)] += 1  # one of its own ops, which the export shares with g
                    touched.add(g)
                    continue
                if p in region or p in skipped:
                    continue
                op = self.op(p)
                if p in self.wiring:
                    region.add(p)
                elif op in ops and counts[op] < budget[op] and (
                    max_skipped <= MAX_SKIPPED or _fits_a_pattern(eq, counts + Counter([op]))
                ):
                    # behind unknown ops, an op of the call's kind is the call's only while one of its
                    # patterns still holds them all: the Mul inside a std is no part of a Div after it
                    region.add(p)
                    counts[op] += 1
                else:
                    skipped.add(p)
                    if len(skipped) > max_skipped:
                        return None
                if len(region) > _REGION_PER_INPUT * max(1, len(reqs)):
                    return None
                stack.append(p)
        if not all(req & touched for req in reqs):
            return None
        # Views in front of the call belong to the wiring between calls, not to the call.
        trimmed = True
        while trimmed:
            trimmed = False
            for oid in sorted(region):
                if oid != key and oid in self.wiring and not any(
                    self.producer[v] in region for v in self._data_inputs(self.onodes[oid])
                ):
                    region.discard(oid)
                    trimmed = True
        if not any(p.admits(counts, self.op(key)) for p in eq.patterns):
            return None
        return region, skipped, touched

    def _anchored_fallback(
        self, tn: Node, eq: Equivalence, ops: frozenset[str], budget: Counter[str], scopes: set[str], params: set[str]
    ) -> tuple[tuple[Any, ...], int, set[int]] | None:
        """A partner away from where the inputs landed, but named by its scope or weights: rewired.

        The model's own scope names nothing: every op of the top-level ``forward`` has it, so
        a write whose scatter is gone would take the next write's.
        """
        best: tuple[tuple[Any, ...], int, set[int]] | None = None
        scopes = scopes - {""}
        for n in self.onodes:
            if n.kind != "function" or n.id in self.matched or n.id in self.wiring or self.op(n.id) not in ops:
                continue
            if n.id in self.value_free:
                continue
            if not self._compatible(tn, n.id):
                continue
            anchor = self._anchor(n.id, {n.id}, scopes, params)
            if anchor < 1:
                continue
            region = {n.id}
            counts: Counter[str] = Counter({self.op(n.id): 1})
            stack = [n.id]
            while stack:
                for v in self._data_inputs(self.onodes[stack.pop()]):
                    p = self.producer[v]
                    if p in self.matched or p in region:
                        continue
                    op = self.op(p)
                    if p in self.wiring or (op in ops and counts[op] < budget[op]):
                        region.add(p)
                        counts[op] += 0 if p in self.wiring else 1
                        stack.append(p)
            if not any(p.admits(counts, self.op(n.id)) for p in eq.patterns):
                continue  # a written-out pattern short of an op (a pool that sums, no Div) is not that call
            score = (anchor, 0, len(region), -n.id)
            if best is None or score > best[0]:
                best = (score, n.id, region)
        return best

    def _trace_scopes(self, tn: Node) -> set[str]:
        scopes = {tn.module_path}
        if tn.call_index:
            scopes.add(f"{tn.module_path}_{tn.call_index}")
        for s in self.trace_succ.get(tn.id, ()):
            succ = self.tnodes[s]
            eq = equivalence_for(succ) if succ.kind in ("module", "function") else None
            if eq is not None and eq.folds_into:
                scopes.add(succ.module_path)
        return scopes

    def _anchor(self, key: int, region: Iterable[int], scopes: set[str], params: set[str]) -> int:
        scope = self.onodes[key].meta.get("scope")
        score = 2 if scope is not None and scope in scopes else 0
        if params and any(
            r.param in params or r.param.startswith(tuple(p for p in params if p.endswith(".")))
            for oid in region
            for r in self.onodes[oid].inputs
            if r.param
        ):
            score += 1
        return score

    def _compatible(self, tn: Node, oid: int) -> bool:
        """Attributes and output sizes that must agree, where both sides state them."""
        on = self.onodes[oid]
        for t_name, o_name in _ATTR_PAIRS:
            tv, ov = tn.attrs.get(t_name), on.attrs.get(o_name)
            if tv is None or ov is None:
                continue
            ovl = list(ov) if isinstance(ov, list) else [ov]
            tvl = list(tv) if isinstance(tv, list) else [tv] * len(ovl)
            if tvl != ovl:
                return False
        if tn.outputs and on.outputs and oid not in self.sized_by_branches and 0 not in on.meta.get("unknown_rank", ()):
            # a write through a view makes the whole tensor viewed
            t_shape, o_shape = self.partial_writes.get(tn.id, tn.outputs[0].shape), on.outputs[0].shape
            # an LSTM fed a PackedSequence returns the packed steps, no padding: as many features
            packed = self.op(oid) in _RECURRENT_OPS and len(o_shape) == 4 and t_shape[-1:] == (o_shape[1] * o_shape[3],)
            if all(d >= 0 for d in o_shape) and _numel(t_shape) != _numel(o_shape) and not packed:
                return False
        return True

    # -- connectivity -----------------------------------------------------------------------------
    def input_order(self, gid: int) -> tuple[list[int | None], list[int | None]] | None:
        """Where each input of a one-op call comes from (a group, None for a constant), in trace and ONNX order."""
        group = self.groups[gid]
        tn = self.tnodes[gid] if gid >= 0 else None
        if tn is None or tn.kind != "function" or group.key is None or self.op(group.key) not in _ORDERED_OPS:
            return None
        if ".__r" in tn.target or "rsub" in tn.target:  # reflected: b - a for rsub(a, b)
            return None
        if sum(1 for oid in group.onodes if oid not in self.wiring) != 1:
            return None
        trace_side: list[int | None] = []
        for r in tn.inputs:
            groups = self.tensor_groups.get(r.obj_id)
            if groups is not None and len(groups) != 1:
                return None
            trace_side.append(next(iter(groups)) if groups else None)
        onnx_side: list[int | None] = []
        for r in self.onodes[group.key].inputs:
            behind = self._groups_behind(self.producer[r.obj_id]) if r.obj_id in self.producer else set()
            if len(behind) > 1:
                return None
            onnx_side.append(next(iter(behind)) if behind else None)
        if self.op(group.key) != "Concat":
            return [g for g in trace_side if g is not None], [g for g in onnx_side if g is not None]
        return trace_side, onnx_side

    def _reordered(self) -> dict[int, tuple[list[int | None], list[int | None]]]:
        """One-op calls whose inputs arrive in another order (``cat([b, a])`` for ``cat([a, b])``)."""
        out = {}
        for gid in sorted(self.groups):
            orders = self.input_order(gid)
            if orders is None:
                continue
            t, o = orders
            if len(t) == len(o) and t != o and Counter(t) == Counter(o):
                out[gid] = orders
        return out

    def _prelude(self, gid: int) -> set[int]:
        """Nodes of a call's region computed from its inputs alone, before any of its own work.

        An exporter may compute such a node once for several calls (the ``Where`` that turns
        one attention mask into additive form, shared by every layer): for connectivity it
        passes the call's inputs on rather than standing for the call.
        """
        group = self.groups[gid]
        # region node -> the groups it is computed from, for nodes not fed by the call's own work
        from_inputs: dict[int, set[int]] = {}
        for oid in sorted(group.onodes):  # ONNX node order is topological
            feeds: set[int] = set()
            for v in self._data_inputs(self.onodes[oid]):
                p = self.producer[v]
                if p in from_inputs:
                    feeds |= from_inputs[p]
                elif p in group.onodes:
                    break
                else:
                    feeds |= self._groups_behind(p)
            else:
                if oid != group.key:
                    from_inputs[oid] = feeds
        every_source = set().union(*from_inputs.values()) if from_inputs else set()
        # only what some of the call's inputs make (a mask turned additive), not all of them
        shared = {
            oid for oid, feeds in from_inputs.items()
            if feeds < every_source and self._feeds_another_group(oid, gid)
        }
        # with what they are computed from inside the region
        stack = list(shared)
        while stack:
            for v in self._data_inputs(self.onodes[stack.pop()]):
                p = self.producer[v]
                if p in from_inputs and p not in shared:
                    shared.add(p)
                    stack.append(p)
        return shared

    def _groups_behind(self, oid: int) -> set[int]:
        """The matched groups an ONNX node is, or is reached from through unmatched wiring."""
        found: set[int] = set()
        stack, seen = [oid], {oid}
        while stack:
            cur = stack.pop()
            if cur in self.matched:
                found.add(self.matched[cur])
            elif cur in self.wiring:
                for v in self._data_inputs(self.onodes[cur]):
                    if (p := self.producer[v]) not in seen:
                        seen.add(p)
                        stack.append(p)
        return found

    def _feeds_another_group(self, oid: int, gid: int) -> bool:
        stack = [oid]
        seen: set[int] = set()
        while stack:
            for r in self.onodes[stack.pop()].outputs:
                for c in self.consumers.get(r.obj_id, ()):
                    h = self.matched.get(c)
                    if h is not None and h != gid:
                        return True
                    if h is None and c in self.wiring and c not in seen:
                        seen.add(c)
                        stack.append(c)
        return False

    def _rewired(self) -> list[tuple[str, int, int]]:
        trace_edges: set[tuple[int, int]] = set()
        for dst, reqs in self.reqs.items():
            if dst not in self.groups:
                continue
            for req in reqs:
                trace_edges.update((g, dst) for g in req if g != dst)
        onnx_edges: set[tuple[int, int]] = set()
        prelude = {oid for gid in self.groups for oid in self._prelude(gid)} | self.computed_once
        for gid in self.groups:
            seen: set[int] = set()
            queue = deque(
                c for oid in sorted(self.groups[gid].onodes - prelude)
                for r in self.onodes[oid].outputs for c in self.consumers.get(r.obj_id, ())
            )
            while queue:
                oid = queue.popleft()
                if oid in seen:
                    continue
                seen.add(oid)
                h = self.matched.get(oid)
                if h is not None:
                    if h != gid:
                        onnx_edges.add((gid, h))
                    if oid not in prelude:
                        continue
                for r in self.onodes[oid].outputs:
                    queue.extend(self.consumers.get(r.obj_id, ()))
        trace_only, onnx_only = trace_edges - onnx_edges, onnx_edges - trace_edges
        trace_only = {(s, d) for s, d in trace_only if s not in self.read_by_unopened or d not in self.after_unopened}
        for s, d, feeders in self._pads_taken(trace_only, onnx_only):
            trace_only.discard((s, d))
            onnx_only -= {(f, d) for f in feeders}
        return sorted(
            [("trace", s, d) for s, d in trace_only] + [("onnx", s, d) for s, d in onnx_only],
            key=lambda x: (x[1], x[2], x[0]),
        )

    def _pads_taken(
        self, trace_only: set[tuple[int, int]], onnx_only: set[tuple[int, int]]
    ) -> list[tuple[int, int, set[int]]]:
        """Zero pads an exporter kept as a Pad for some readers and took into the pads of others.

        ``F.pad(x, (0, 1, 0, 1))`` read by a Conv and a MaxPool: dynamo gives the Conv
        ``pads`` one larger and feeds it ``x``, and keeps the Pad for the MaxPool (whose
        padding is -inf, not zero). The trace edge pad -> Conv then has no ONNX path, and
        ONNX has x -> Conv instead: one simplification, elided, when the Conv's ONNX pads
        are its own padding plus the pad's. Returns (pad gid, reader gid, the pad's feeders).
        """
        taken = []
        for s, d in sorted(trace_only):
            if s < 0 or d < 0 or (amounts := _zero_pad_amounts(self.tnodes[s])) is None:
                continue
            feeders = set().union(*self.reqs.get(s, []))
            key = self.groups[d].key
            if not feeders or any((f, d) not in onnx_only for f in feeders) or key is None:
                continue
            if _pads_with(self.tnodes[d], self.onodes[key], self.op(key), amounts):
                taken.append((s, d, feeders))
                self.elided.append((s, f"folded in part: into the pads of {_onnx_name(self.onodes[key])} for "
                                       f"{_trace_label(self.tnodes[d])}, a Pad for its other readers"))
        return taken


def _scopes_as_called(trace: Graph, og: Graph) -> None:
    """Give the ONNX nodes of a layer called through a container that is never called the layer's path.

    TorchScript names scopes by calls: poolformer's head, an ``nn.Sequential`` whose children
    are called one by one (``self.head.norm(x)``), is no call, so ``head.norm``'s ops are
    ``/norm/...``, as if ``norm`` hung from the caller. The dynamo exporter states full paths.
    """
    paths = {n.module_path for n in trace.nodes if n.kind == "module"}
    called_as: dict[str, str] = {}  # the name the exporter gives -> the layer's path
    for n in trace.nodes:
        if n.kind != "module" or "." not in n.module_path:
            continue
        caller = n.scope[-1].module_path if n.scope else ""
        parent, last = n.module_path.rsplit(".", 1)
        alias = f"{caller}.{last}" if caller else last
        if parent != caller and alias not in paths:
            called_as.setdefault(alias, n.module_path)
    if not called_as:
        return
    for on in og.nodes:
        scope = on.meta.get("scope")
        if not scope or not str(on.meta.get("onnx_name", "")).startswith("/"):  # scoped by TorchScript's names
            continue
        for alias, path in called_as.items():
            if scope == alias or scope.startswith(alias + "."):
                on.meta["scope"] = on.module_path = path + scope[len(alias):]
                break


def _fits_a_pattern(eq: Equivalence, counts: Counter[str]) -> bool:
    """Whether one of the rule's patterns holds all of these ops."""
    return any(all(n <= dict(p.ops).get(op, 0) for op, n in counts.items()) for p in eq.patterns)


def _has_weights(tn: Node) -> bool:
    """Whether a layer may carry weights: its ONNX form has ops that take them, or no rule says."""
    eq = equivalence_for(tn)
    return not (eq is not None and eq.patterns and not eq.op_types & _WEIGHTED_OPS)


def _equal_layers(a: torch.nn.Module | None, b: torch.nn.Module | None) -> bool:
    """Whether two layers compute alike: one class, equal settings, equal weights and buffers."""
    if a is None or b is None or type(a) is not type(b):
        return False
    settings = [{k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, (int, float, str, tuple))}
                for m in (a, b)]
    if settings[0] != settings[1]:
        return False
    ta, tb = ({**dict(m.named_parameters()), **dict(m.named_buffers())} for m in (a, b))
    return ta.keys() == tb.keys() and all(
        x.shape == y.shape and x.dtype == y.dtype and not x.is_meta and not y.is_meta and torch.equal(x, y)
        for x, y in ((ta[k], tb[k]) for k in ta)
    )


def _zero_pad_amounts(tn: Node) -> list[int] | None:
    """The amounts of ``F.pad(x, pad)`` with constant zeros (ZeroPad2d, ConstantPad2d(p, 0.0)), else None."""
    if canonical_target(tn.target) not in PAD_FUNCTIONS:
        return None
    args = tn.attrs.get("args", [])
    amounts = args[0] if args else tn.attrs.get("pad")
    mode = args[1] if len(args) > 1 else tn.attrs.get("mode", "constant")
    value = args[2] if len(args) > 2 else tn.attrs.get("value")
    if not isinstance(amounts, list) or mode != "constant" or value not in (None, 0):
        return None
    return amounts if all(isinstance(a, int) and a >= 0 for a in amounts) else None


def _pads_with(reader: Node, on: Node, op: str, amounts: list[int]) -> bool:
    """Whether an ONNX Conv pads as the traced reader plus ``amounts``.

    ``amounts`` are ``F.pad``'s: (before, after) pairs from the last dimension backwards;
    ONNX ``pads`` are all the spatial dimensions' befores, then their afters. Only a Conv:
    a MaxPool pads with -inf, and an AveragePool given such pads by hand did not reproduce
    torch in onnxruntime (asymmetric pads, count_include_pad=1).
    """
    pads = on.attrs.get("pads")
    if op != "Conv" or not isinstance(pads, list) or len(amounts) > len(pads):
        return False
    n = len(pads) // 2
    own = reader.attrs.get("padding", 0)
    own = [0] * n if own == "valid" else [own] * n if isinstance(own, int) else own
    if not isinstance(own, list) or len(own) != n:
        return False  # "same", or a functional call whose padding the trace did not keep by name
    extra = amounts + [0] * (2 * n - len(amounts))
    before = [own[i] + extra[2 * (n - 1 - i)] for i in range(n)]
    after = [own[i] + extra[2 * (n - 1 - i) + 1] for i in range(n)]
    return pads == before + after


def _indexed_dims(written: tuple[int, ...], value: tuple[int, ...]) -> int:
    """How many dimensions of ``written`` a write of ``value`` into part of it indexes, at least.

    >>> _indexed_dims((10, 10), (3, 4)), _indexed_dims((10, 10), (10,)), _indexed_dims((2, 5), (1, 5))
    (2, 1, 1)

    ``im[2:5, 3:7] = m`` indexes two (each a ``slice_scatter`` when recorded functionally),
    ``im[:, 1] = v`` one: the dimensions, aligned from the right as broadcasting does, where
    the value is smaller or missing.
    """
    padded = (1,) * (len(written) - len(value)) + tuple(value[-len(written):]) if written else ()
    return sum(1 for w, v in zip(written, padded, strict=True) if v != w)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _pair_inputs(
    t_inputs: list[Node], o_inputs: list[Node], t_read: Callable[[Node], bool], o_read: Callable[[Node], bool],
) -> tuple[list[tuple[Node, Node]], list[Node], list[Node]]:
    """Trace inputs with ONNX graph inputs: by name where names agree, then in order.

    In order: the ONNX graph's inputs are the flattened tensor arguments the model was
    exported with, under the exporter's own names when none were given (TorchScript's
    ``input.1``, ``onnx::Gemm_0``). TorchScript leaves out an argument nothing reads: when
    the counts left differ, the inputs each side reads (``t_read``, ``o_read``) pair in order.
    """
    by_name = {n.name: n for n in o_inputs}
    pairs: list[tuple[Node, Node]] = []
    rest_t: list[Node] = []
    used: set[int] = set()
    for tn in t_inputs:
        on = by_name.get(tn.name)
        if on is not None and on.id not in used:
            pairs.append((tn, on))
            used.add(on.id)
        else:
            rest_t.append(tn)
    rest_o = [n for n in o_inputs if n.id not in used]
    unread_t: list[Node] = []
    unread_o: list[Node] = []
    if len(rest_t) != len(rest_o):
        unread_t, rest_t = [n for n in rest_t if not t_read(n)], [n for n in rest_t if t_read(n)]
        unread_o, rest_o = [n for n in rest_o if not o_read(n)], [n for n in rest_o if o_read(n)]
    k = min(len(rest_t), len(rest_o))
    return pairs + list(zip(rest_t, rest_o, strict=False)), rest_t[k:] + unread_t, rest_o[k:] + unread_o


# -- the report -----------------------------------------------------------------------------------
def _output_label(n: Node) -> str:
    """``logits``, ``cache.layers[0].keys``: which of the model's outputs a trace output node is."""
    return str(n.meta.get("cache") or n.name.removeprefix("output_").removeprefix("output"))


def draws_random(n: Node) -> bool:
    """Whether a trace call draws random numbers (``randn_like``, ``rand``, dropout, a sampler).

    Eager PyTorch and an ONNX runtime draw different numbers, so what it feeds differs by nature.
    """
    target = canonical_target(n.target)
    short = target.rsplit(".", 1)[-1].strip("_").lower()
    return "dropout" in short or "rand" in short or short in _SAMPLERS


def _trace_label(n: Node) -> str:
    if n.kind == "input":
        return f"input {n.name}"
    if n.kind == "output":
        return "output"
    if n.kind == "module":
        call = f"#{n.call_index}" if n.call_index else ""
        return f"{n.module_path or '<root>'}{call} ({n.class_name})"
    where = f" in {n.module_path}" if n.module_path else ""
    return f"{n.name} = {n.target}{where}"


def _onnx_name(n: Node) -> str:
    return str(n.meta.get("onnx_name", n.name))


class _Texts:
    def __init__(self, trace: Graph, og: Graph, result: _Result) -> None:
        self.t, self.o, self.r = trace, og, result

    def group(self, gid: int) -> str:
        if gid == _OUTPUT_GROUP:
            return "output"
        return _trace_label(self.t.nodes[gid])

    def group_onnx(self, gid: int) -> str:
        g = self.r.groups[gid]
        if g.key is None:
            return "?"
        n = self.o.nodes[g.key]
        return "the graph outputs" if n.kind == "output" else f"'{_onnx_name(n)}'"

    def onnx_node(self, oid: int) -> str:
        n = self.o.nodes[oid]
        scope = n.meta.get("scope")
        return f"'{_onnx_name(n)}' [{n.meta.get('op_type')}]" + (f" in {scope or '<root>'}" if scope is not None else "")

    def outputs_of(self, side: str, gid: int) -> str:
        """`` (cache.layers[0].keys, ...)``: which graph outputs a group feeds, on one side."""
        if side == "trace":
            names = self.r.outputs_fed.get(gid, [])
        else:
            out = next((n for n in self.o.nodes if n.kind == "output"), None)
            labels = list(out.meta.get("names", [])) if out is not None else []
            position = {r.obj_id: i for i, r in enumerate(out.inputs)} if out is not None else {}
            matched = {o for g in self.r.groups.values() for o in g.onodes}
            consumers: dict[int, list[int]] = {}
            for n in self.o.nodes:
                for r in n.inputs:
                    consumers.setdefault(r.obj_id, []).append(n.id)
            names, seen = [], set()
            queue = deque(r.obj_id for oid in sorted(self.r.groups[gid].onodes) for r in self.o.nodes[oid].outputs)
            while queue:
                v = queue.popleft()
                if v in seen:
                    continue
                seen.add(v)
                if v in position and position[v] < len(labels):
                    names.append(labels[position[v]])
                for c in consumers.get(v, ()):
                    if c not in matched and self.o.nodes[c].kind == "function":
                        queue.extend(r.obj_id for r in self.o.nodes[c].outputs)
        names = [n for n in dict.fromkeys(names) if n]
        if not names:
            return ""
        return f" ({', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''})"

    def onnx_neighbours(self, oid: int, forward: bool) -> list[str]:
        """Labels of the nearest matched calls before (or after) an ONNX node."""
        m = {o: g for g in self.r.groups.values() for o in g.onodes}
        producer = {r.obj_id: n.id for n in self.o.nodes for r in n.outputs}
        consumers: dict[int, list[int]] = {}
        for n in self.o.nodes:
            for r in n.inputs:
                consumers.setdefault(r.obj_id, []).append(n.id)
        found: list[str] = []
        seen = {oid}
        queue = deque([oid])
        while queue:
            cur = self.o.nodes[queue.popleft()]
            nxt = (
                [c for r in cur.outputs for c in consumers.get(r.obj_id, ())]
                if forward
                else [producer[r.obj_id] for r in cur.inputs if r.obj_id in producer]
            )
            for x in nxt:
                if x in seen:
                    continue
                seen.add(x)
                if x in m:
                    label = self.group(m[x].gid)
                    if label not in found:
                        found.append(label)
                else:
                    queue.append(x)
        return found


def _build_report(
    trace: Graph, og: Graph, result: _Result, exporter: str | None, opened: list[str] | None = None,
    source: str | None = None,
) -> TopologyReport:
    tx = _Texts(trace, og, result)
    wiring = {n.id for n in og.nodes if n.kind == "function" and n.meta.get("wiring")}
    ids = ReportIds(
        [(g.gid, tuple(o for o in sorted(g.onodes) if o not in wiring))
         for g in sorted(result.groups.values(), key=lambda g: g.gid)
         if g.gid >= 0 and trace.nodes[g.gid].kind not in ("input", "output")],
        result.missing + result.unmatched_inputs[0],
        result.extra + result.unmatched_inputs[1],
    )
    matched = [(_trace_label(trace.nodes[t]), tuple(_onnx_name(og.nodes[o]) for o in onnx_ids)) for t, onnx_ids in ids.matched]
    missing = [_trace_label(trace.nodes[i]) for i in ids.missing]
    extra = [_onnx_name(og.nodes[i]) for i in ids.extra]
    rewired: list[str] = []
    for side, s, d in result.rewired:
        into = tx.outputs_of(side, s) if d == _OUTPUT_GROUP else ""  # which outputs: a cache's, say
        if side == "trace":
            rewired.append(
                f"trace edge {tx.group(s)} -> {tx.group(d)}{into} has no ONNX path from {tx.group_onnx(s)} "
                f"to {tx.group_onnx(d)} that avoids other matched ops"
            )
        elif side == "onnx":
            rewired.append(
                f"ONNX connects {tx.group_onnx(s)} -> {tx.group_onnx(d)}{into} ({tx.group(s)} -> {tx.group(d)}), "
                "an edge the trace does not have"
            )
        else:
            t_order, o_order = result.reordered[s]

            def names(order: list[int | None]) -> str:
                return ", ".join("a constant" if g is None else tx.group(g) for g in order)

            rewired.append(
                f"{tx.group(s)} takes its inputs in another order in ONNX ({tx.group_onnx(s)}): "
                f"trace ({names(t_order)}), ONNX ({names(o_order)})"
            )
    elided = [(_trace_label(trace.nodes[i]), how) for i, how in result.elided]
    not_opened = [_trace_label(trace.nodes[i]) for i in result.unopened]
    undecided = [(_trace_label(trace.nodes[i]), why) for i, why in result.undecided]
    ok = not (missing or extra or rewired or not_opened or undecided)
    unsure = [f"{len(not_opened)} layer call{'s' if len(not_opened) > 1 else ''} not opened"] if not_opened else []
    unsure += [f"{len(undecided)} call{'s' if len(undecided) > 1 else ''} undecided"] if undecided else []
    verdict = (
        "the export has the topology of the trace" if ok
        else "the export DIFFERS from the trace" if missing or extra or rewired
        else f"INCOMPLETE: {', '.join(unsure)}"
    )

    kinds = Counter(
        how.split()[0].rstrip(":") if how.startswith(("folded", "simplified"))
        else how if how in ("wiring", "constant", "unused input", "unused result") else "removed"
        for _, how in elided
    )
    how_elided = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    what = f" ({exporter} exporter)" if exporter else f" ({source})" if source else ""
    lines = [
        f"ONNX cross-check{what}: {verdict}",
        f"  {len(matched)} traced calls matched to {sum(len(o) for _, o in matched)} ONNX nodes; "
        f"{len(elided)} elided{f' ({how_elided})' if how_elided else ''}; "
        f"{len(missing)} missing, {len(extra)} extra, {len(rewired)} rewired"
        + (f", {len(not_opened)} not opened" if not_opened else "")
        + (f", {len(undecided)} undecided" if undecided else ""),
    ]
    if opened:
        lines.append(f"  compared as the calls they make (no ONNX rule): {', '.join(opened)}")
    if result.left_out:
        lines.append(f"  outputs the export does not return, left out: {', '.join(result.left_out)}")
    if not_opened:
        lines.append("not opened (layers no ONNX rule knows, with a forward of their own: a graph alone does not "
                     "show what they call; pass the model to open them, fwdtrace.check_onnx(model, x, onnx=proto), "
                     "or declare them with fwdtrace.onnx_equivalent):")
        for i in result.unopened:
            ops = [_onnx_name(og.nodes[o]) for o in result.unopened[i]]
            lines.append(f"  - {_trace_label(trace.nodes[i])}" + (f", unchecked: {', '.join(ops)}" if ops else ""))
    if undecided:
        lines.append("undecided (the structure alone cannot tell"
                     + ("; pass the model, fwdtrace.check_onnx(model, x, onnx=proto)" if any(
                         i not in result.ruleless for i, _ in result.undecided) else "") + "):")
        lines += [f"  - {label}: {why}" for label, why in undecided]
    if result.missing or result.unmatched_inputs[0]:
        lines.append("missing (in the trace, not in the ONNX graph):")
        for i in result.missing + result.unmatched_inputs[0]:
            n = trace.nodes[i]
            feeds = [tx.group(g) for req in result.reqs.get(i, []) for g in sorted(req)]
            after = f", after {', '.join(dict.fromkeys(feeds))}" if feeds else ""
            hint = "" if equivalence_for(n) is not None or n.kind == "input" else (
                f" (no ONNX equivalence is registered for {n.target}; see fwdtrace.onnx_equivalent)"
            )
            lines.append(f"  - {_trace_label(n)}{after}{hint}")
    if result.extra or result.unmatched_inputs[1]:
        lines.append("extra (in the ONNX graph, not in the trace):")
        for i in result.extra + result.unmatched_inputs[1]:
            before = tx.onnx_neighbours(i, forward=False)
            after_ = tx.onnx_neighbours(i, forward=True)
            where = (f", after {', '.join(before)}" if before else "") + (f", before {', '.join(after_)}" if after_ else "")
            lines.append(f"  - {tx.onnx_node(i)}{where}")
    if rewired:
        lines.append("rewired (edges on one side only):")
        lines += [f"  - {r}" for r in rewired]
    if matched:
        lines.append("matched:")
        folded = [(lbl, how) for lbl, how in elided if how.startswith("folded")]
        width = max(len(t) for t, _ in matched + folded)
        for t, o in matched:
            lines.append(f"  {t.ljust(width)}  <->  {', '.join(o)}")
        for lbl, how in folded:
            lines.append(f"  {lbl.ljust(width)}  <->  {how}")
    return TopologyReport(ok, matched, missing, extra, rewired, elided, "\n".join(lines), exporter, list(opened or []),
                          not_opened, list(result.left_out), undecided, ids=ids, trace=trace, onnx_graph=og)


def _load_onnx_file(path: str | os.PathLike[str], caller: str) -> Any:
    """A .onnx file as a ModelProto, or a FwdtraceError saying what is wrong with the file.

    Weights in an external-data file stay there: only the few small tensors shape inference
    reads are loaded (the comparison needs the topology, not the weights).
    """
    import onnx
    from google.protobuf.message import DecodeError

    from .export import _load_small_external_data

    where = str(path)
    what = not_a_regular_file(path)  # before opening: a FIFO blocks, /dev/zero never ends
    if what is not None:
        raise FwdtraceError(f"{caller} expected a .onnx file, got {where!r}, {what}")
    try:
        proto = onnx.load(os.fspath(path), load_external_data=False)
        _load_small_external_data(proto, os.path.dirname(os.path.abspath(path)))
    except FileNotFoundError:
        raise FwdtraceError(f"{caller} expected a .onnx file, got {where!r}, which does not exist") from None
    except (DecodeError, ValueError, OSError, RuntimeError, onnx.checker.ValidationError) as e:
        # ValidationError: an external tensor whose file lies outside the model's folder (onnx reads nothing)
        raise FwdtraceError(f"{caller} expected a .onnx file, got {where!r}, which onnx cannot read: {type(e).__name__}: {e}") from e
    if not proto.graph.node and not proto.graph.output:
        raise FwdtraceError(f"{caller} expected a .onnx file with a graph, got {where!r}, which holds none (empty or not ONNX)")
    return proto


def _compare(graph: Graph, proto: Any, caller: str = "compare_onnx()", model: Any = None) -> tuple[Graph, _Result]:
    if not isinstance(graph, Graph):
        raise FwdtraceError(f"{caller} expected a fwdtrace.Graph (from fwdtrace.trace) as graph, got {describe(graph)}")
    proto = _onnx_model(proto, caller)
    og = onnx_graph(proto, prune=True)
    matcher = _Matcher(graph, og, model)
    return og, matcher.run()


def _onnx_model(proto: Any, caller: str, what: str = "the ONNX model") -> Any:
    """``proto`` as a ModelProto: read from a path (without its external weights), or checked."""
    if isinstance(proto, (str, os.PathLike)):
        return _load_onnx_file(proto, caller)
    import onnx

    if not isinstance(proto, onnx.ModelProto):
        raise FwdtraceError(f"{caller} expected {what} as an onnx.ModelProto or a path to a .onnx file, "
                            f"got {describe(proto)}")
    return proto


def compare_onnx(graph: Graph, proto: onnx.ModelProto | str | os.PathLike[str]) -> TopologyReport:
    """Diff a traced graph against an ONNX model (a ModelProto or a path to a .onnx file).

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 2)).eval()
    >>> x = torch.ones(1, 4)
    >>> report = fwdtrace.compare_onnx(fwdtrace.trace(model, x), fwdtrace.export_onnx(model, x, exporter="torchscript"))
    >>> report.ok, len(report.matched)
    (True, 3)

    See :class:`TopologyReport` for what it returns and the module docstring for how it matches.
    A graph alone cannot show what a layer no ONNX rule knows calls inside (a custom layer
    with a ``forward`` of its own, timm's ``LayerNorm2d``): such calls are reported apart as
    ``not_opened`` and the report's ``status`` is ``'incomplete'`` (``ok`` False, but no
    mismatch), with the hint to pass the model: ``check_onnx(model, x, onnx=proto)`` opens them.
    """
    og, result = _compare(graph, proto)
    return _build_report(graph, og, result, None, source=str(proto) if isinstance(proto, (str, os.PathLike)) else None)


def check_onnx(
    model: Any, *args: Any, exporter: str | None = None, onnx: Any = None, verbose: bool = False,
    numeric: bool = False, inputs: list[Any] | None = None, tolerances: dict[str, tuple[float, float]] | None = None,
    isolate: bool = False, **kwargs: Any,
) -> TopologyReport:
    """Trace ``model(*args, **kwargs)`` and diff it with its ONNX export, or with a given ONNX model.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    >>> report = fwdtrace.check_onnx(model, torch.ones(1, 3, 8, 8), exporter="torchscript")
    >>> report.ok, report.elided
    (True, [('1 (BatchNorm2d)', 'folded into /0/Conv')])

    ``onnx`` checks a given ONNX model instead of exporting one: a path to a ``.onnx`` file
    (external-data weights are not read) or an ``onnx.ModelProto``. That is how to check a
    file a pipeline produced: ``check_onnx(model, x, onnx="model.onnx")``, with the inputs
    it was exported for; its inputs take the tensor arguments by name, else in order (a
    TorchScript export's own names, ``input.1``). Otherwise ``exporter`` is one of torch's, ``"dynamo"`` (the
    default) or ``"torchscript"``, or ``"fwdtrace"``: fwdtrace's own emission
    (:func:`fwdtrace.to_onnx`), checked against the trace; ``exporter`` and ``onnx``
    together are an error.
    Put the model in eval mode first if that is how you deploy it: exporters fold
    BatchNorm and drop dropout only in eval mode, and the trace runs the model as it is.
    Layers no ONNX rule knows (a custom layer with a forward of its own) are traced again
    as the torch calls they make and compared as those; ``report.opened`` names them.
    A returned transformers cache (``cache``; ``past_key_values`` before transformers 5.24) is compared
    when the ONNX model returns its tensors, and left out (said in the report) when it returns the other
    outputs only.
    The exporters' own warnings and prints are kept quiet (see :func:`fwdtrace.export_onnx`);
    ``verbose=True`` shows them. ``isolate=True`` runs torch's exporter in a child process, so that
    a crash in torch's own code is an error naming the exporter and the signal, not the end of
    your process (see :func:`fwdtrace.export_onnx`).

    ``numeric=True`` also compares numbers: the model runs eagerly and the ONNX model in
    onnxruntime on the same inputs (the example inputs, or each batch of ``inputs=[...]``),
    and every matched call's output is compared with the ONNX value that carries it
    (:mod:`fwdtrace.onnx.numeric`). ``report.first_divergence`` is the earliest call out of
    tolerance whose inputs agree, ``report.worst`` ranks them, ``str(report)`` leads with the
    answer and ``report.save_repro(folder)`` writes the diverging ONNX subgraph with its inputs.
    ``tolerances={"float16": (rtol, atol)}`` overrides the defaults by dtype
    (:data:`fwdtrace.onnx.numeric.DEFAULT_TOLERANCES`).
    """
    if exporter is not None and onnx is not None:
        raise FwdtraceError(
            f"check_onnx() expected exporter= (export the model) or onnx= (check a given ONNX model), not both: "
            f"got exporter={exporter!r} and onnx={describe(onnx) if not isinstance(onnx, (str, os.PathLike)) else str(onnx)!r}"
        )
    if onnx is not None:
        proto = _onnx_model(onnx, "check_onnx()", "onnx=")  # read before the model runs: a bad path fails fast
        graph, opened = _trace_opening_ruleless_layers(model, args, kwargs, _emitted_functions(proto))
        og, result = _compare(graph, proto, "check_onnx()", model=model)
        source = str(onnx) if isinstance(onnx, (str, os.PathLike)) else "the given ONNX model"
        report = _build_report(graph, og, result, None, opened, source=source)
        if numeric:
            folder = os.path.dirname(os.path.abspath(onnx)) if isinstance(onnx, (str, os.PathLike)) else None
            report = _add_numbers(report, model, args, kwargs, graph, og, result, proto, folder, opened, inputs,
                                  tolerances, _emitted_functions(proto), source)
        return report
    exporter = "dynamo" if exporter is None else exporter
    if exporter not in CHECK_EXPORTERS:
        raise FwdtraceError(f"check_onnx() expected exporter 'dynamo', 'torchscript' or 'fwdtrace', got {exporter!r}")
    # to_onnx emits an atomic function's ops tagged with its call: compared as they are, not opened
    graph, opened = _trace_opening_ruleless_layers(model, args, kwargs, None if exporter == "fwdtrace" else frozenset())
    if exporter == "fwdtrace":
        from .emit import to_onnx

        proto = to_onnx(model, *args, verbose=verbose, **kwargs)
    else:  # a large model's weights stay on disk, unless onnxruntime is to run it
        proto = _export(model, args, kwargs, exporter, None, None, weights=numeric, verbose=verbose, isolate=isolate,
                        caller="check_onnx()")
    og, result = _compare(graph, proto, "check_onnx()", model=model)
    report = _build_report(graph, og, result, exporter, opened)
    if numeric:
        report = _add_numbers(report, model, args, kwargs, graph, og, result, proto, None, opened, inputs, tolerances,
                              None if exporter == "fwdtrace" else frozenset(), None)
    return report


def _add_numbers(report: TopologyReport, model: Any, args: tuple, kwargs: dict, graph: Graph, og: Graph,
                 result: _Result, proto: Any, folder: str | None, opened: list[str], inputs: Any,
                 tolerances: Any, emitted: frozenset[str] | None, source: str | None) -> TopologyReport:
    """Compare the values too; the numbers then say whether the report is ok (see ``TopologyReport.status``).

    A model that sets itself up on its first call (a fresh torchvision R-CNN, a layer built from
    its first input's shape) runs other calls in the trace than in every call after it, the
    export's and the value runs' among them: when the first batch runs other calls, the model is
    traced again, set up, and the structure compared on that trace. ``emitted`` is as for
    :func:`_trace_opening_ruleless_layers`, ``source`` as for :func:`_build_report`.
    """
    from .numeric import OtherCalls, compare_values

    try:
        report.numeric = compare_values(model, args, kwargs, graph, og, result, proto, folder, opened, inputs,
                                        tolerances)
    except OtherCalls as e:
        if e.batch != 0:
            raise
        again, opened_again = _trace_opening_ruleless_layers(model, args, kwargs, emitted)
        if [n.target for n in again.nodes] == [n.target for n in graph.nodes]:
            raise  # the model runs the same calls again: the inputs take another path
        first_calls = len(graph.nodes)
        graph, opened = again, opened_again
        og, result = _compare(graph, proto, "check_onnx()", model=model)
        report = _build_report(graph, og, result, report.exporter, opened, source=source)
        report.text = (f"the model set itself up on its first call ({first_calls} nodes traced, {len(graph.nodes)} "
                       f"on the next): checked as it runs from its second call on\n{report.text}")
        report.numeric = compare_values(model, args, kwargs, graph, og, result, proto, folder, opened, inputs,
                                        tolerances)
    report.ok = report.status in ("ok", "rewritten")
    return report


def _emitted_functions(proto: onnx.ModelProto) -> frozenset[str] | None:
    """The functions whose calls an ONNX model's nodes are tagged with (to_onnx's provenance);
    None for a model to_onnx wrote, which emits every atomic call as one."""
    from .export import CALL_KEY

    if proto.producer_name == "fwdtrace":
        return None
    return frozenset(p.value.rsplit("#", 1)[0] for n in proto.graph.node for p in n.metadata_props
                     if p.key == CALL_KEY)


def _trace_opening_ruleless_layers(
    model: Any, args: tuple, kwargs: dict, emitted: frozenset[str] | None = frozenset(),
) -> tuple[Graph, list[str]]:
    """The trace, with every layer no ONNX rule knows recorded as the torch calls it makes.

    Atomic functions no rule knows are too, except those the ONNX model tags its nodes with
    (``emitted``; None: all of them, for an export by to_onnx).

    A custom layer is what it calls: timm's ``LayerNorm2d`` (an ``nn.LayerNorm`` with a
    forward of its own) is a permute, a ``layer_norm`` and a permute, which rules know.
    The model runs once more per level of such layers inside each other.
    """
    from ..tracer import Tracer, trace

    graph = trace(model, *args, **kwargs)
    path2module = dict(model.named_modules()) if isinstance(model, torch.nn.Module) else {}
    note_classes(type(m) for m in path2module.values())
    opened: dict[type, None] = {}
    functions: dict[str, None] = {}  # atomic functions no rule knows (register_atomic's), by path
    for _ in range(4):
        ruleless = {
            type(m): None for n in graph.nodes
            if n.kind == "module" and rule_target(n.target) is None
            and (m := path2module.get(n.module_path)) is not None and type(m) not in opened
        }
        ruleless_functions = {
            n.target: None for n in graph.nodes
            if n.kind == "function" and n.attrs.get("atomic") and n.target not in functions
            and emitted is not None and n.target not in emitted and rule_target(n.target) is None
        }
        if not ruleless and not ruleless_functions:
            break
        opened.update(ruleless)
        functions.update(ruleless_functions)
        # this trace only: other threads, and the user's registrations, are not affected
        with Tracer(through=tuple(opened), through_functions=tuple(functions)) as tracer:
            model(*args, **kwargs)
        graph = tracer.graph
    return graph, [qualified_name(c) for c in opened] + list(functions)


def render_side_by_side(
    graph: Graph, proto: onnx.ModelProto | str | os.PathLike[str], path: str | os.PathLike[str],
    depth: int | str | None = "auto", report: TopologyReport | None = None,
) -> str:
    """Draw the trace and the ONNX graph in one picture (PNG, SVG or PDF by suffix), differences in red.

    >>> import torch, fwdtrace, tempfile, os
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    >>> x = torch.ones(1, 4)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     out = fwdtrace.render_side_by_side(fwdtrace.trace(model, x),
    ...                                        fwdtrace.export_onnx(model, x, exporter="torchscript"),
    ...                                        os.path.join(d, "both.svg"))
    ...     os.path.getsize(out) > 0
    True

    Each side is drawn at the depth :func:`fwdtrace.render` would choose for it alone (``"auto"``,
    with its caption), so that a large model stays readable and lays out in seconds; an explicit
    ``depth`` (``None``: full detail) draws both sides at it.
    Missing trace calls, extra ONNX nodes and both ends of rewired edges are highlighted.
    With ``report`` from ``check_onnx(..., numeric=True)`` on the same model and file, matched
    boxes on both sides are coloured by their relative error (:data:`ERROR_COLORS`, from
    the report's numbers, not computed again) and their tooltips give it. An ONNX op fed by
    data whose results are read only as shapes is shape arithmetic; its tooltip says so.
    Returns the path written.
    """
    from ..passes.draw import Digraph, check_draw_options, render_digraph, to_dot

    check_draw_options("render_side_by_side()", depth)
    og, result = _compare(graph, proto, "render_side_by_side()")
    bad_groups = {g for _, s, d in result.rewired for g in (s, d)}
    trace_hl = set(result.missing) | {tid for g in bad_groups if g in result.groups for tid in result.groups[g].trace_ids}
    onnx_hl = set(result.extra) | {
        k for g in bad_groups if g in result.groups and (k := result.groups[g].key) is not None
    }
    t_fills: dict[int, str] = {}
    o_fills: dict[int, str] = {}
    t_notes: dict[int, str] = {}
    o_notes: dict[int, str] = {n.id: n.meta["shape_only"] for n in og.nodes if n.meta.get("shape_only")}
    if report is not None:
        if report.numeric is None:
            raise FwdtraceError("render_side_by_side() expected report= from check_onnx(..., numeric=True), "
                                "got a report of the structure only")
        label2node = {_trace_label(n): n.id for n in graph.nodes}
        name2onode = {_onnx_name(n): n.id for n in og.nodes}
        for row in report.numeric.worst:  # worst first: a box holding several takes the worst colour
            color = error_color(row.max_rel, report.numeric.tolerances.get(row.dtype, (0.0, 0.0))[0], row.ok)
            note = f"max rel err {row.max_rel:.1e} ({row.dtype}){'' if row.ok else ', out of tolerance'}"
            for label in row.call.split(" + "):
                if label in label2node:
                    t_fills[label2node[label]], t_notes[label2node[label]] = color, note
            if row.onnx_node in name2onode:
                o_fills[name2onode[row.onnx_node]], o_notes[name2onode[row.onnx_node]] = color, note
    outer = Digraph(name="side_by_side")
    outer.attr(rankdir="TB", compound="true")
    outer.subgraph(to_dot(graph, depth, highlight=trace_hl, name_prefix="t_", cluster_name="cluster_trace",
                          title="traced (PyTorch eager)", fills=t_fills, notes=t_notes))
    outer.subgraph(to_dot(og, depth, highlight=onnx_hl, name_prefix="o_", cluster_name="cluster_onnx",
                          title="exported (ONNX)", fills=o_fills, notes=o_notes))
    return render_digraph(outer, path, caller="render_side_by_side()")


# Fill colours by relative error: within 1% of the tolerance, within it, and out of it.
# "nonfinite": an error that is inf or NaN (an overflow in one run), the saturated end of the scale
ERROR_COLORS = {"exact": "#cfe8cf", "within": "#f7e7a1", "diverges": "#f3a683", "nonfinite": "#b2182b"}


def error_legend(rtol: float) -> list[tuple[str, str]]:
    """What :func:`error_color`'s colours mean, as a picture's legend: ``(colour, text)`` pairs.

    >>> error_legend(1e-5)[0]
    ('#cfe8cf', 'max rel err <= 1e-07')
    """
    return [(ERROR_COLORS["exact"], f"max rel err <= {rtol / 100:g}"),
            (ERROR_COLORS["within"], "within tolerance or rounding"),
            (ERROR_COLORS["diverges"], "diverges"),
            (ERROR_COLORS["nonfinite"], "inf or NaN where the other run is finite")]


def error_color(max_rel: float, rtol: float, ok: bool) -> str:
    """The fill of a box whose value has relative error ``max_rel`` under tolerance ``rtol`` (:data:`ERROR_COLORS`).

    >>> error_color(1e-7, 1e-4, True), error_color(1e-5, 1e-4, True), error_color(1e-2, 1e-4, False)
    ('#cfe8cf', '#f7e7a1', '#f3a683')
    >>> error_color(float("inf"), 1e-4, False)
    '#b2182b'
    """
    if not ok:
        return ERROR_COLORS["nonfinite"] if not math.isfinite(max_rel) else ERROR_COLORS["diverges"]
    return ERROR_COLORS["exact"] if max_rel <= rtol / 100 else ERROR_COLORS["within"]


# -- command line ---------------------------------------------------------------------------------
def run_cli(args: argparse.Namespace) -> int:
    """Run ``fwdtrace check-onnx``: 0 when the export agrees with the trace, 1 when it does not.

    With ``--numeric``, 1 when a value diverges (``report.ok``: a structural difference whose
    values agree is a rewrite, 0). The model is put in eval mode and fed the seeded inputs of
    ``--input-shape``/``--dtype``, made as ``fwdtrace analyze`` makes them.
    """
    from ..cli import forward_failed, load_factory, make_inputs

    if args.onnx is not None and args.exporter is not None:
        raise FwdtraceError(f"check-onnx expected --exporter (export the model) or --onnx (check a given file), "
                            f"not both: got --exporter {args.exporter} and --onnx {args.onnx}")
    source = {"onnx": args.onnx} if args.onnx is not None else {"exporter": args.exporter or "dynamo"}
    inputs = make_inputs(args)
    model = load_factory(args.factory).eval()
    try:
        report = check_onnx(model, *inputs, numeric=args.numeric, isolate=args.isolate, **source)
    except FwdtraceError:
        raise
    except Exception as e:
        raise forward_failed(args.factory, inputs, e) from e
    print(json.dumps(report.to_dict(), indent=1) if args.json else str(report))
    return 0 if report.ok else 1


def _may_be_shaped(shape: tuple[int, ...] | None, shapes: set[tuple[int, ...]]) -> bool:
    """Whether an ONNX value of ``shape`` may have one of ``shapes``: a dimension ONNX could not infer (-1, as for a
    custom-domain op's result) may be any.

    >>> _may_be_shaped((-1, 4), {(2, 4)}), _may_be_shaped((3, 4), {(2, 4)}), _may_be_shaped(None, {(2,)})
    (True, False, True)
    """
    if shape is None:
        return True
    return any(len(s) == len(shape) and all(a < 0 or a == b for a, b in zip(shape, s, strict=True)) for s in shapes)
