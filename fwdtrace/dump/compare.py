"""Comparing two dumps call by call: ``compare_dumps``, matching calls by key and through the recorded graphs."""

from __future__ import annotations

import bisect
import contextlib
import difflib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import FwdtraceError
from ..graph import Graph
from ..node import Node, Scope, TensorRef
from ..passes.align import align
from ..precision import (
    PRECISIONS,
    Agreement,
    added_bound,
    added_error,
    condition,
    explains,
    follows_dtype,
    pair_precision,
)
from ..statistics import BINS, COMPARED, FIELDS, SAMPLES
from .layout import GRAPH_DATASET, MAX_TENSOR_BYTES
from .reader import _max_bytes, _Reader
from .report import Divergence, DumpReport, DumpRow, _call_name


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """torch on one intra-op thread while comparing, the caller's setting restored after.

    A comparison goes block by block (bounded memory), each block a few dozen small ops: waking
    the pool's idle workers for each costs more than the block, and on a machine whose cores
    other processes keep busy a woken worker waits for a core (a comparison 20x slower). One
    thread reads and compares at disk speed. Under OpenMP (torch's CPU builds) the setting is the
    calling thread's own.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tolerance(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise FwdtraceError(f"compare_dumps() expected {name} as a finite number >= 0, got {value!r}")
    return float(value)


def _by_statistics(agreement: Agreement, a: torch.Tensor, b: torch.Tensor) -> str:
    """Compare two statistics vectors into ``agreement``, as :func:`_by_statistics_rows` compares one row."""
    import numpy as np

    return _by_statistics_rows([agreement], np.array([a.tolist()], dtype=np.float64),
                               np.array([b.tolist()], dtype=np.float64))[0]


_AT = {name: i for i, name in enumerate(FIELDS)}
_COMPARED_AT = [_AT[name] for name in COMPARED]


def _by_statistics_rows(agreements: list[Agreement], a: Any, b: Any) -> list[str]:
    """Compare row ``i`` of ``a`` with row ``i`` of ``b`` (statistics vectors, float64, one row per tensor) into
    ``agreements[i]``: their counts exactly, their moments, extremes, norm and samples by value (the histograms,
    whose edges move with min and max, are not compared), each row as :func:`fwdtrace.statistics.compared` reads
    it; each row's note returned. A statistics dump's matrix is compared in one pass, not row by row: rows whose
    samples and agreements' settings match are gathered together (:meth:`Agreement.add_rows`)."""
    import numpy as np

    heads_a, heads_b = a[:, :len(FIELDS)].tolist(), b[:, :len(FIELDS)].tolist()
    first_sample = len(FIELDS) + BINS
    # which columns hold the samples, sliced as as_dict slices them (a count not finite: none)
    samples: list[tuple[range, range]] = []
    together: dict[tuple, list[int]] = {}
    for i, (head_a, head_b) in enumerate(zip(heads_a, heads_b, strict=True)):
        ranges = tuple(range(width)[first_sample:first_sample + min(SAMPLES, int(c) if math.isfinite(c) else 0)]
                       for c, width in ((head_a[_AT["count"]], a.shape[1]), (head_b[_AT["count"]], b.shape[1])))
        samples.append(ranges)  # type: ignore[arg-type]
        if len(ranges[0]) == len(ranges[1]):
            g = agreements[i]
            together.setdefault((ranges[0].start, ranges[0].stop, ranges[1].start, ranges[1].stop,
                                 g.rtol, g.atol, g.equivalent), []).append(i)
    for (start_a, stop_a, start_b, stop_b, *_), rows in together.items():
        Agreement.add_rows([agreements[i] for i in rows], a[np.ix_(rows, _COMPARED_AT + list(range(start_a, stop_a)))],
                           b[np.ix_(rows, _COMPARED_AT + list(range(start_b, stop_b)))])
    notes = []
    for agreement, head_a, head_b, (samples_a, samples_b) in zip(agreements, heads_a, heads_b, samples, strict=True):
        counts = [f"{name} {head_a[_AT[name]]:g} vs {head_b[_AT[name]]:g}" for name in ("count", "nans", "infs")
                  if head_a[_AT[name]] != head_b[_AT[name]]]
        if len(samples_a) != len(samples_b):
            counts.append(f"{len(samples_a)} vs {len(samples_b)} samples")
        if counts:
            agreement.close = False
        # by statistics, which elements are inf or NaN is not known: the counts say where one side has more
        nonfinite_a = int(head_a[_AT["nans"]] + head_a[_AT["infs"]])
        nonfinite_b = int(head_b[_AT["nans"]] + head_b[_AT["infs"]])
        agreement.nonfinite_a, agreement.nonfinite_b = nonfinite_a, nonfinite_b
        agreement.only_a, agreement.only_b = max(nonfinite_a - nonfinite_b, 0), max(nonfinite_b - nonfinite_a, 0)
        extremes = [abs(head[_AT[name]]) for head in (head_a, head_b) for name in ("min", "max")
                    if math.isfinite(head[_AT[name]])]
        agreement.magnitude = max(extremes, default=0.0)
        notes.append("by statistics" + "".join(f"; {c}" for c in counts))
    return notes


def _match_calls(ra: _Reader, graph_a: Graph | None, rb: _Reader) -> dict[str, str]:
    """Group of ``a`` -> group of ``b`` holding the same call: the two runs' calls aligned in call order
    (difflib's longest matching runs) by key and the shapes of their inputs and outputs, the roots with
    each other, so a call one run makes more (a cast, an added layer) is left out of the pairs, not
    shifting them. Where both dumps hold their run's graph, the calls left are paired through the two
    graphs (:mod:`fwdtrace.passes.align`): a renamed layer pairs with its new name."""
    def calls(reader: _Reader) -> tuple[list[str], list[tuple]]:
        names, tokens = [], []
        for gname, group in reader.groups:
            attrs = reader.group_attrs(gname)
            key = attrs.get("module_key", gname)
            if attrs.get("module_path") == "" and "function" not in attrs:
                key = ""  # the root, keyed by its class name: the two runs' models may be of two classes
            shapes = tuple((d, tuple(reader.shape(gname, d))) for d in group if not d.startswith("grad_"))
            names.append(gname)
            tokens.append((str(key), shapes))
        return names, tokens

    names_a, tokens_a = calls(ra)
    names_b, tokens_b = calls(rb)
    pairs = {names_a[i]: names_b[j] for i, j in _matching(tokens_a, tokens_b)}
    # b's graph is read only when calls are left on both sides (the same model twice leaves none)
    graph_b = rb.graph() if graph_a is not None and len(pairs) < min(len(names_a), len(names_b)) else None
    if graph_a is not None and graph_b is not None:
        shapes = {("a", n): t[1] for n, t in zip(names_a, tokens_a, strict=True)}
        shapes.update({("b", n): t[1] for n, t in zip(names_b, tokens_b, strict=True)})
        _match_through_graphs(_GraphCalls(ra, graph_a), _GraphCalls(rb, graph_b), pairs,
                              lambda ga, gb: shapes["a", ga] == shapes["b", gb])
    return pairs


_WHOLE_DIFF = 400  # calls a side up to which difflib aligns the two runs whole
_WINDOW = 128  # calls of each side difflib aligns at once past that


def _matching(a: list, b: list) -> Iterator[tuple[int, int]]:
    """Index pairs of ``a`` and ``b`` holding the same token, in order, as difflib's matching blocks.

    difflib looks at every place a token recurs: a step of a long loop repeats the same calls hundreds of
    times, and a whole-run diff of a 500-iteration loop took a minute. Past ``_WHOLE_DIFF`` calls, the runs
    are walked together: equal calls pair as they come, and where they part, difflib aligns the next
    ``_WINDOW`` calls of each side (a window 4 times larger each time it finds nothing) and the pairs in its
    first half are kept, so each difference costs a window, not the run.

    >>> list(_matching(list("abxcd"), list("abcyd")))
    [(0, 0), (1, 1), (3, 2), (4, 4)]
    """
    if len(a) <= _WHOLE_DIFF or len(b) <= _WHOLE_DIFF:
        for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
            for k in range(block.size):
                yield block.a + k, block.b + k
        return
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            yield i, j
            i, j = i + 1, j + 1
            continue
        window = _WINDOW
        while True:
            blocks = [m for m in difflib.SequenceMatcher(None, a[i:i + window], b[j:j + window],
                                                         autojunk=False).get_matching_blocks() if m.size]
            if blocks or (i + window >= len(a) and j + window >= len(b)):
                break
            window *= 4
        if not blocks:
            return
        whole = i + window >= len(a) and j + window >= len(b)
        kept = blocks if whole else [m for m in blocks if max(m.a, m.b) + m.size <= window // 2] or blocks[:1]
        for m in kept:
            for k in range(m.size):
                yield i + m.a + k, j + m.b + k
        i, j = i + kept[-1].a + kept[-1].size, j + kept[-1].b + kept[-1].size


class _GraphCalls:
    """A dump's groups as its graph's nodes: a call's group by its node, a container module's group (no node:
    the calls inside it are) by the nodes inside its call."""

    def __init__(self, reader: _Reader, graph: Graph) -> None:
        call2node = {(n.key, n.call_index): n.id for n in graph.nodes if n.kind in ("module", "function")}
        scope2nodes: dict[Scope, set[int]] = {}
        for n in graph.nodes:
            for s in n.scope:
                scope2nodes.setdefault(s, set()).add(n.id)
        self.graph = graph
        self.node2group: dict[int, str] = {}
        self.containers: dict[str, tuple[str, set[int]]] = {}  # group -> (its class, the nodes inside its call)
        for gname, _ in reader.groups:
            attrs = reader.group_attrs(gname)
            key, call_index = str(attrs.get("module_key", "")), int(attrs.get("call_index", 0))
            path, class_name = str(attrs.get("module_path", "")), str(attrs.get("class_name", ""))
            node = call2node.get((key, call_index))
            if node is not None:
                self.node2group[node] = gname
            elif path and "function" not in attrs:
                self.containers[gname] = class_name, scope2nodes.get(Scope(path, class_name, call_index), set())
        self.group2node = {g: n for n, g in self.node2group.items()}


def _match_through_graphs(a: _GraphCalls, b: _GraphCalls, pairs: dict[str, str],
                          same_shapes: Callable[[str, str], bool]) -> None:
    """Add to ``pairs`` the calls the two graphs align: each call by its node, then each container
    module's call with the one of the same class holding the same aligned calls."""
    seed = {a.group2node[ga]: b.group2node[gb] for ga, gb in pairs.items()
            if ga in a.group2node and gb in b.group2node}
    a2b = align(a.graph, b.graph, seed)
    taken, aligned_b = set(pairs.values()), set(a2b.values())
    for na, nb in a2b.items():
        ga, gb = a.node2group.get(na), b.node2group.get(nb)
        if ga is not None and gb is not None and ga not in pairs and gb not in taken and same_shapes(ga, gb):
            pairs[ga] = gb
            taken.add(gb)
    for ga, (class_name, inside_a) in a.containers.items():
        image = {a2b[n] for n in inside_a if n in a2b}
        if ga in pairs or not image:
            continue
        gb = next((gb for gb, (cls, inside_b) in b.containers.items() if gb not in taken and cls == class_name
                   and inside_b & aligned_b == image and same_shapes(ga, gb)),
                  None)
        if gb is not None:
            pairs[ga] = gb
            taken.add(gb)


def _arguments(reader: _Reader, gname: str) -> str:
    """A function call's non-tensor arguments as its dump recorded them (JSON), "" for none or a module call."""
    return str(reader.group_attrs(gname).get("arguments", ""))


def _differing_arguments(text_a: str, text_b: str) -> list[tuple[str, Any, Any, str | None]]:
    """The arguments two calls were given differently: (which, in a, in b, how it follows the dtype or None)."""
    try:
        args_a, args_b = json.loads(text_a or "{}"), json.loads(text_b or "{}")
    except ValueError:
        return [("arguments", text_a, text_b, None)]
    flat_a, flat_b = _flat_arguments(args_a), _flat_arguments(args_b)
    return [(name, flat_a.get(name), flat_b.get(name), follows_dtype(flat_a.get(name), flat_b.get(name)))
            for name in dict.fromkeys([*flat_a, *flat_b]) if flat_a.get(name) != flat_b.get(name)]


def _flat_arguments(args: Any) -> dict[str, Any]:
    out = {}
    for name, value in (args.items() if isinstance(args, dict) else ()):
        for i, v in enumerate(value) if name == "args" and isinstance(value, list) else [(None, value)]:
            out[name if i is None else f"args[{i}]"] = v
    return out


@dataclass
class _RowCompared:
    """A row whose tensors are being compared: its agreement gathered, then judged (:func:`_judge_row`)."""

    row: DumpRow
    agreement: Agreement
    ga: str
    gb: str
    dname: str
    differing: list[tuple[str, Any, Any, str | None]]


def _compare_row(row: DumpRow, ra: _Reader, ga: str, rb: _Reader, gb: str, dname: str, rtol: float,
                 atol: float, precisions: dict[tuple[str, str, bool], str],
                 by_matrix: list[_RowCompared] | None = None) -> None:
    """One tensor of a call in both dumps, by value or by statistics, into ``row``: judged by the verdict
    engine (:mod:`fwdtrace.precision`). A parameter (``row.parameter``) by its dtypes alone: the runs' math
    computed none of its values. With ``by_matrix``, a row of two packed statistics dumps is put there instead,
    to be compared with the others in one pass (:func:`_compare_by_matrix`)."""
    shape_b = rb.shape(gb, dname)
    if row.shape != shape_b:
        row.note = f"shape {shape_b} in b"
        return
    agreement = Agreement(rtol, atol)
    differing: list[tuple[str, Any, Any, str | None]] = []
    if row.function and dname.startswith("output"):  # only function calls record their arguments
        text_a, text_b = _arguments(ra, ga), _arguments(rb, gb)
        if text_a != text_b:
            differing = _differing_arguments(text_a, text_b)
            # a fill value that follows the dtype (finfo.min) counts as equal where each run holds its own
            agreement.equivalent = tuple((float(va), float(vb)) for _, va, vb, follows in differing
                                         if follows and not isinstance(va, str))
    compared = _RowCompared(row, agreement, ga, gb, dname, differing)
    if by_matrix is not None:
        by_matrix.append(compared)
        return
    if ra.statistics or rb.statistics:
        row.note = _by_statistics(agreement, ra.summary(ga, dname), rb.summary(gb, dname))
    else:
        # block by block: memory stays bounded whatever the tensors' size
        for block_a, block_b in zip(ra.blocks(ga, dname, numpy=True), rb.blocks(gb, dname, numpy=True), strict=True):
            agreement.add(block_a, block_b)
    _judge_row(compared, ra, rb, rtol, precisions)


def _compare_by_matrix(rows: list[_RowCompared], ra: _Reader, rb: _Reader, rtol: float,
                       precisions: dict[tuple[str, str, bool], str]) -> None:
    """The rows of two packed statistics dumps, compared in one pass over their matrices and judged."""
    matrix_a, matrix_b = ra.statistics_matrix(), rb.statistics_matrix()
    assert matrix_a is not None and matrix_b is not None
    notes = _by_statistics_rows([r.agreement for r in rows], matrix_a[[ra.packed_row(r.ga, r.dname) for r in rows]],
                                matrix_b[[rb.packed_row(r.gb, r.dname) for r in rows]])
    for compared, note in zip(rows, notes, strict=True):
        compared.row.note = note
        _judge_row(compared, ra, rb, rtol, precisions)


def _judge_row(compared: _RowCompared, ra: _Reader, rb: _Reader, rtol: float,
               precisions: dict[tuple[str, str, bool], str]) -> None:
    """A row's verdict from its gathered agreement (:mod:`fwdtrace.precision`): its numbers, the arithmetic it is
    judged in, what rounding explains, and the arguments its calls were given differently. ``precisions``: the
    arithmetic of each pair of dtypes (and whether the value is stored) between these two dumps, found so far."""
    row, agreement, differing = compared.row, compared.agreement, compared.differing
    row.cosine, row.max_abs, row.max_rel, row.allclose = (
        agreement.cosine, agreement.max_abs, agreement.max_rel, agreement.close)
    row.norm_rel = agreement.norm_rel
    row.one_thousandth, row.five_thousandths = agreement.ratios
    row.nonfinite_a, row.nonfinite_b, row.only_a, row.only_b = (
        agreement.nonfinite_a, agreement.nonfinite_b, agreement.only_a, agreement.only_b)
    row.magnitude = agreement.magnitude
    stored = row.parameter != ""
    pair = (ra.dtype(compared.ga, compared.dname), rb.dtype(compared.gb, compared.dname), stored)
    row.precision = precisions.get(pair) or precisions.setdefault(pair, pair_precision(
        pair[0], None if stored else ra.math, pair[1], None if stored else rb.math))
    if ra.math is not None and rb.math is not None and not row.allclose:
        # without both records, no difference is put down to rounding
        row.rounding = explains(row.norm_rel, row.cosine, row.precision, rtol)
    if differing:
        said = "; ".join(f"{name} {va!r} vs {vb!r}" + (f" ({follows}: follows the dtype)" if follows else "")
                         for name, va, vb, follows in differing)
        row.note = "; ".join(n for n in (row.note, f"arguments differ: {said}") if n)
        if not row.agrees and all(f for *_, f in differing) and (ra.statistics or rb.statistics):
            # by statistics the constant's elements cannot be set apart from the rest: the dtype explains the row
            row.explained = "a constant that follows the dtype"


@dataclass
class _NotHeld:
    """A call of the run's graph the dump does not hold whose outputs it does hold, as the inputs of the calls that
    take them in (a ``Linear`` in a dump of function calls), with the calls not held before it whose outputs only it
    reads (the ``LayerNorm`` before that ``Linear``): judged as one call, from the held tensors they read to its
    outputs, so a difference that starts inside it is found there, not at the next call the dump holds."""

    node: Node
    before: list[Node]  # in the order they ran
    inputs: list[DumpRow] | None  # the held tensors they read; None where one is not held (the model's input)
    reduction: int  # the longest last dimension of a floating tensor any of them reads


def _tensor_ref(node: Node | None, name: str) -> TensorRef | None:
    """The graph's tensor a call's dumped ``input{i}`` or ``output{i}`` is."""
    for prefix, refs in (("input", node.inputs if node else []), ("output", node.outputs if node else [])):
        index = name[len(prefix):]
        if name.startswith(prefix) and index.isdigit():
            return refs[int(index)] if int(index) < len(refs) else None
    return None


def _parameters(graph: Graph | None) -> dict[tuple[str, int, str], str]:
    """(key, call index, ``input{i}``) -> the parameter or buffer that input of that call is."""
    return {(str(n.key), n.call_index, f"input{i}"): ref.param for n in (graph.nodes if graph else [])
            for i, ref in enumerate(n.inputs) if ref.param}


def _read_not_held(rows: list[DumpRow], graph: Graph) -> tuple[list[DumpRow], dict[tuple[str, int], _NotHeld]]:
    """``rows`` with a row for each output of a call the dump does not hold that a held call takes in, read as
    that held input (placed before the first call that takes it in), and those calls by (key, call index)."""
    calls = [n for n in graph.nodes if n.kind in ("module", "function")]
    call2node = {(str(n.key), n.call_index): n for n in calls}
    held = {(r.key, r.call_index) for r in rows}
    writer = {ref.obj_id: n for n in calls for ref in n.outputs}  # the call that wrote each tensor
    obj2row: dict[int, DumpRow] = {}  # a tensor the dump holds: the first row that holds it
    group2first: dict[str, int] = {}
    for i, row in enumerate(rows):
        group2first.setdefault(row.group, i)
        ref = _tensor_ref(call2node.get((row.key, row.call_index)), row.name)
        if ref is not None and not row.one_sided:
            obj2row.setdefault(ref.obj_id, row)
    not_held: dict[tuple[str, int], _NotHeld] = {}
    inserts: dict[int, list[DumpRow]] = {}
    for node in calls:
        outputs = [(j, obj2row[ref.obj_id]) for j, ref in enumerate(node.outputs) if ref.obj_id in obj2row]
        if (str(node.key), node.call_index) in held or not outputs:
            continue
        region, inputs = _not_held_before(node, obj2row, writer, held)
        reduction = max((ref.shape[-1] for n in region for ref in n.inputs if ref.shape and ref.dtype in PRECISIONS),
                        default=1)
        not_held[str(node.key), node.call_index] = _NotHeld(node, region[:-1], inputs, reduction)
        after = ", ".join(f"{n.key} (call {n.call_index})" for n in region[:-1])
        for j, held_as in outputs:
            note = f"a call the dump does not hold: read as {held_as.group}/{held_as.name}" + (
                f", after {after}, not held either" if after else "")
            inserts.setdefault(group2first[held_as.group], []).append(replace(
                held_as, group="", key=str(node.key), module_path=node.module_path, name=f"output{j}",
                function=node.target if node.kind == "function" else "", call_index=node.call_index, key_b="",
                parameter="", added=None, read_as=f"{held_as.group}/{held_as.name}",
                note="; ".join(n for n in (held_as.note, note) if n)))
    if not inserts:
        return rows, not_held
    out: list[DumpRow] = []
    for i, row in enumerate(rows):
        out += inserts.get(i, [])
        out.append(row)
    return out, not_held


_NOT_HELD_CALLS = 8  # calls not held in a row past which what they read is too far from what the dump holds


def _not_held_before(node: Node, obj2row: dict[int, DumpRow], writer: dict[int, Node],
                     held: set[tuple[str, int]]) -> tuple[list[Node], list[DumpRow] | None]:
    """``node`` and the calls not held before it whose outputs the dump holds nowhere, in the order they ran, and the
    held tensors they read: None where one is held nowhere and written by no call (the model's input), or where
    more than ``_NOT_HELD_CALLS`` calls lie between (a dump of a few selected calls), whose roundings would add to a
    bound that explains anything."""
    region: dict[int, Node] = {}
    read: dict[int, DumpRow] = {}  # obj_id -> its row
    known = True
    stack = [node]
    while stack:
        n = stack.pop()
        if n.id in region:
            continue
        region[n.id] = n
        for ref in n.inputs:
            source = writer.get(ref.obj_id)
            if ref.obj_id in obj2row:
                read.setdefault(ref.obj_id, obj2row[ref.obj_id])
            elif source is not None and (str(source.key), source.call_index) not in held \
                    and len(region) < _NOT_HELD_CALLS:
                stack.append(source)
            elif ref.param is None:
                known = False
    return sorted(region.values(), key=lambda n: n.id), list(read.values()) if known else None


class _Call:
    """A call's rows in both runs (compared in both), in the order run a wrote them; for a call the dump does not
    hold, the held rows of what it read and its outputs as they were read."""

    def __init__(self, group: str, start: int, not_held: _NotHeld | None = None) -> None:
        self.group, self.start, self.finish = group, start, -1
        self.not_held = not_held
        self.inputs: list[DumpRow] = list(not_held.inputs or []) if not_held is not None else []
        self.outputs: list[DumpRow] = []
        self.inside = 0  # calls recorded inside it (a module's call around its layers')

    @property
    def known(self) -> bool:
        """Whether the dump holds all it read (a call not held may read the model's input, which it does not)."""
        return self.not_held is None or self.not_held.inputs is not None


def _calls(rows: list[DumpRow], not_held: dict[tuple[str, int], _NotHeld]) -> list[_Call]:
    """The calls compared in both runs, in the order they finished (a layer before the block around it)."""
    calls: dict[tuple[str, str, int], _Call] = {}
    for i, row in enumerate(rows):
        if row.one_sided:
            continue
        call = calls.get((row.group, row.key, row.call_index))
        if call is None:
            region = not_held.get((row.key, row.call_index)) if row.read_as else None
            call = calls[row.group, row.key, row.call_index] = _Call(row.group, i, region)
        if row.name.startswith("input"):
            call.inputs.append(row)
        elif row.name.startswith("output"):
            call.outputs.append(row)
            if call.finish < 0:
                call.finish = i
    finished = [c for c in calls.values() if c.finish >= 0]
    starts = sorted(c.start for c in calls.values())
    for c in finished:
        c.inside = max(bisect.bisect_left(starts, c.finish) - bisect.bisect_right(starts, c.start), 0)
    return sorted(finished, key=lambda c: c.finish)


def _judge_added_error(calls: list[_Call]) -> None:
    """Each call's outputs against its inputs: an output within the blanket rounding bound whose error stands
    above what the call's own rounding adds (:func:`fwdtrace.precision.added_bound`: its dtype, its reduction
    length, the calls inside it) diverges all the same. A bfloat16 run's 8% blanket would hide a 3% bug.
    An exponential (softmax over sharp logits) and a module's call that may hold one amplify both their
    inputs' error and their own rounding by their inputs' magnitude (:func:`fwdtrace.precision.condition`).
    A call the dump does not hold is judged with the calls not held before it, whose roundings add."""
    for call in calls:
        if not call.known or not call.inputs or not all(r.agrees and r.norm_rel is not None for r in call.inputs):
            continue
        errors = [r.norm_rel or 0.0 for r in call.inputs]
        magnitude = max((r.magnitude or 0.0) for r in call.inputs)
        if call.not_held is None:
            floating = [r for r in call.inputs if r.precision in PRECISIONS]
            reduction = max((r.shape[-1] for r in floating if r.shape), default=1)
            first = call.inputs[0]
            # a module's key ends with its class: "h.0.attn.Softmax"
            parts = [(first.function or first.key, call.inside > 0 or (
                not first.function and not _torch_layer(first.key, first.module_path)))]
            count = 1 + call.inside
        else:
            nodes = [*call.not_held.before, call.not_held.node]
            reduction = call.not_held.reduction
            parts = [(n.target if n.kind == "function" else str(n.key),
                      n.kind != "function" and not _torch_layer(str(n.key), n.module_path)) for n in nodes]
            count = len(nodes)
        amplified = max(condition(name, magnitude, container=container) for name, container in parts)
        for row in call.outputs:
            if row.allclose or row.rounding is None or row.norm_rel is None or row.precision not in PRECISIONS:
                continue
            row.added = added_error(row.norm_rel, errors, amplified)
            # an exponential's own rounding is amplified as its inputs' error is (softmax rounds its logits)
            bound = added_bound(row.precision, reduction, count) * amplified
            if not row.added <= bound:
                what = "the calls inside it" if call.inside else "one call" if count == 1 else f"{count} calls"
                row.note = "; ".join(n for n in (row.note, (
                    f"adds {row.added:.3g} of norm-relative error to its inputs' {max(errors):.3g}: "
                    f"{row.added / bound:.1f}x what {PRECISIONS[row.precision].label} rounding in {what} explains "
                    f"({bound:.3g})")) if n)
                row.rounding = None


def _torch_layer(key: str, module_path: str) -> bool:
    """Whether a module call is of one of torch's own leaf layers (its key's class is torch.nn's): the dump
    holds all it computes. A model's own module may compute more than the calls it records."""
    class_name = key.rsplit(".", 1)[-1]
    return isinstance(getattr(torch.nn, class_name, None), type) and bool(module_path)


def _first_divergence(rows: list[DumpRow], not_held: dict[tuple[str, int], _NotHeld]) -> Divergence | None:
    """Where the runs part, in this order: the earliest call whose inputs are finite in a run whose outputs hold
    inf or NaN where the other run's are finite (an overflow); else the earliest call in both runs whose inputs
    agree and whose outputs or parameters do not, as the numeric ONNX check finds it (earliest to finish: a layer
    before the block around it); else the first whose outputs differ, else the first whose gradients differ.
    A call the dump does not hold is among them where the dump holds what it read and wrote."""
    calls = _calls(rows, not_held)
    _judge_added_error(calls)

    def named(row: DumpRow, kind: str, reason: str) -> Divergence:
        return Divergence(_call_name(row), row.key, row.call_index, row.group, kind, reason)

    for call in calls:
        if not call.known:
            continue
        for side, other in (("a", "b"), ("b", "a")):
            if any(getattr(r, f"nonfinite_{side}") for r in call.inputs):
                continue
            overflowed = [r for r in call.outputs if getattr(r, f"only_{side}")]
            if overflowed:
                counts = ", ".join(f"{r.name} {getattr(r, f'only_{side}')} of {math.prod(r.shape)}" for r in overflowed)
                return named(overflowed[0], "overflow", f"overflow in {side}: its inputs are finite, its outputs "
                             f"hold inf/NaN where {other}'s are finite ({counts})")
    for call in calls:
        if not call.known or not call.inputs or not all(r.agrees for r in call.inputs if not r.parameter):
            continue
        # a parameter is read, not computed: where it differs, the runs part at the first call that reads it
        bad = next((r for r in call.inputs if not r.agrees), None) or next((r for r in call.outputs if not r.agrees),
                                                                            None)
        if bad is not None:
            what = f"its parameter {bad.parameter} ({bad.name})" if bad.parameter else bad.name
            return named(call.outputs[0], "values", f"its inputs agree, {what} does not"
                         + (f" ({bad.note})" if bad.note else ""))
    for prefix in ("output", "grad_input", ""):
        found = next((r for r in rows if not r.agrees and not r.one_sided and r.name.startswith(prefix)), None)
        if found is not None:
            return named(found, "values", f"{found.name} differs" + (f" ({found.note})" if found.note else ""))
    return None


def compare_dumps(
    a: str | os.PathLike[str], b: str | os.PathLike[str], rtol: float = 1e-5, atol: float = 1e-8,
    max_bytes: int = MAX_TENSOR_BYTES,
) -> DumpReport:
    """Compare two dumps tensor by tensor, in the order the first run wrote them.

    >>> import tempfile, torch, fwdtrace
    >>> paths = []
    >>> for scale in (1.0, 2.0):
    ...     d = fwdtrace.Dumper(tempfile.mkdtemp()); model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    ...     _ = torch.nn.init.constant_(model[0].weight, scale); d.register(model, grads=False)
    ...     _ = model(torch.ones(1, 1)); paths += d.remove()
    >>> fwdtrace.compare_dumps(*paths).first_divergence
    '0'

    Each tensor is judged elementwise (``allclose`` at ``rtol`` and ``atol``) and as a whole:
    its norm-relative error and cosine. Where the dumps record how their runs computed (a
    CUDA run with TF32, an autocast run: see :mod:`fwdtrace.precision`), a tensor that is not
    allclose but within what that arithmetic's rounding explains is marked so (its row's
    ``rounding``: ``"TF32"``, ``"bfloat16"``) and is no divergence. ``first_divergence`` is
    the module path of the first module whose outputs differ beyond that (the root model is
    named by its class; a function call is named by its key, ``"blocks.0.attn.softmax"``),
    else of the first whose gradients differ, else None. A dump written
    without a math record is compared elementwise only, and the report says so. Where either dump holds
    statistics (``Dumper(values="statistics")``), a tensor is judged by its statistics (a full
    dump's computed block by block): its count and NaN/Inf counts exactly, its mean, std, min,
    max, norm and sampled values as one vector, elementwise and as a whole, by the same
    rules; the row's note says ``by statistics``. Calls are matched by key and call order, so an extra call
    on one side (a cast, an added layer) shifts nothing; where both dumps hold their run's graph
    (``calls="functions"`` or ``"all"``), the calls left are matched through the two graphs
    (:mod:`fwdtrace.passes.align`), so a renamed layer pairs with its new name (``report.renamed``,
    each row's ``key_b``); ``report.without_graph`` names the dumps that hold none. The comparison is
    two-sided: a tensor in only one dump, or of another shape, is a differing row. ``incomplete`` names
    the dumps whose step did not complete (their rows are compared, but the report is not ``equal``).
    Given two folders of a distributed run's per-rank dumps, the runs are compared rank by rank
    (:func:`fwdtrace.compare_ranks`; the result a :class:`~fwdtrace.dump.ranks.RanksReport`).
    The comparison runs torch on one intra-op thread (the caller's setting is restored after): block
    by block, that reads at disk speed on a busy machine, where a thread pool's wake-ups per block
    would not.
    """
    rtol, atol = _tolerance(rtol, "rtol"), _tolerance(atol, "atol")
    max_bytes = _max_bytes(max_bytes, "compare_dumps()")
    folders = [isinstance(p, (str, os.PathLike)) and os.path.isdir(p) for p in (a, b)]
    if any(folders):
        if not all(folders):
            raise FwdtraceError(f"compare_dumps() expected two dump files or two runs' folders of per-rank dumps, got "
                                f"{str(a)!r} and {str(b)!r}, one a folder and one not")
        from .ranks import compare_ranks

        return compare_ranks(a, b, rtol=rtol, atol=atol, max_bytes=max_bytes)
    report = DumpReport(str(a), str(b), rtol, atol)
    with _one_intra_op_thread(), _Reader(a, "compare_dumps()", max_bytes) as ra, \
            _Reader(b, "compare_dumps()", max_bytes) as rb:
        for r in (ra, rb):
            if r.status != "complete":
                report.incomplete[str(r.path)] = r.status
            report.math[str(r.path)] = r.math
        # calls matched in call order by key and shapes: an extra call on one side (a cast, an added layer)
        # shifts the group numbers, not the matching; then through the graphs (a renamed layer)
        graph_a = ra.graph()
        report.graph = graph_a or rb.graph()
        report.without_graph = [str(r.path) for r in (ra, rb) if GRAPH_DATASET not in r.file]
        a2b = _match_calls(ra, graph_a, rb)
        parameters = _parameters(graph_a)
        b2a = {gb: ga for ga, gb in a2b.items()}
        order_a, order_b = ra.order(), rb.order()
        # two packed statistics dumps: their rows compared in one pass over the two matrices, after the walk
        by_matrix: list[_RowCompared] | None = [] if ra.packs_statistics and rb.packs_statistics else None
        precisions: dict[tuple[str, str, bool], str] = {}  # a dump's rows share a few dtypes: each pair's once
        in_a, in_b = set(order_a), set(order_b)
        for reader, order in ((ra, order_a), (rb, order_b)):
            for gname, dname in order:
                if reader is rb and (b2a.get(gname), dname) in in_a:
                    continue  # compared already
                attrs = reader.group_attrs(gname)
                key = str(attrs.get("module_key", gname))
                path = str(attrs.get("module_path", ""))
                call_index = int(attrs.get("call_index", 0))
                row = DumpRow(gname, key, path, dname, reader.shape(gname, dname), None, None, None, False,
                              function=str(attrs.get("function", "")), call_index=call_index,
                              parameter=parameters.get((key, call_index, dname), "") if reader is ra else "")
                ga, gb = (gname, a2b.get(gname)) if reader is ra else (b2a.get(gname), gname)
                if ga is None or gb is None or (ga, dname) not in in_a or (gb, dname) not in in_b:
                    row.note = "missing in b" if reader is ra else "missing in a"
                    row.one_sided = ga is None or gb is None
                else:
                    _compare_row(row, ra, ga, rb, gb, dname, rtol, atol, precisions, by_matrix)
                if reader is ra and gb is not None:
                    key_b = str(rb.group_attrs(gb).get("module_key", gb))
                    row.key_b = key_b if key_b != key and (path or row.function) else ""  # a root's key: its class
                report.rows.append(row)
        if by_matrix:
            _compare_by_matrix(by_matrix, ra, rb, rtol, precisions)
    not_held: dict[tuple[str, int], _NotHeld] = {}
    if graph_a is not None:
        report.rows, not_held = _read_not_held(report.rows, graph_a)
    d = report.divergence = _first_divergence(report.rows, not_held)
    report.first_divergence = d.name if d is not None else None
    if d is not None and (d.key, d.call_index) in not_held:
        report.starts_inside = (d.key, d.call_index)
    return report

