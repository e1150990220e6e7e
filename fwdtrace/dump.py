"""HDF5 dumps of every module call in one training step, and their comparison.

Layout (one file per registration): ``{directory}/{epoch}-epoch_{step}-step_dump.hdf5``
(``..._rank{r}_dump.hdf5`` under ``torch.distributed``), one group per module call named
``{NNN}_{ClassName}`` in call order, holding datasets ``input0``, ``output0``,
``grad_input0``, ``grad_output0``, ... A call of a function hooked by path (``hook_forward``,
``register_atomic``) is a group of its own, ``{NNN}_{function_name}``, keyed as its graph node
(``module_key`` ``"model.layers.0.self_attn.eager_attention_forward"``, ``function`` its path). Each tensor is written when its hook fires, never
gathered in memory first. A statistics dump instead keeps its step's vectors (a few hundred bytes
each) and writes them when it closes as one matrix, ``statistics`` (a row per tensor, in the order
written), and one JSON index, ``statistics_index`` (the calls with their attributes, the rows'
group, tensor name, shape and dtype); the reader shows them as the groups and datasets above.
h5py is imported only here, when a dump is made or read.

A dump is written under a temporary name in its folder (``{name}.partial-{random}``) and
renamed when it is closed; its attributes say whether the step completed (``complete``,
``forward_finished``, ``backward_finished``, ``status``), so a cut-short dump never reads as whole.
Reading treats every file as untrusted: only plain datasets inside the file are read.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import difflib
import fnmatch
import itertools
import json
import math
import operator
import os
import re
import sys
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ._files import AtomicFile, not_a_regular_file
from ._hdf5 import check_dataset, check_link
from ._host import HostCopy, host, to_numpy
from ._tree import dtype_name, iter_tensors, tensors_of
from .errors import FwdtraceError, describe, one_line
from .graph import Graph
from .instrument.attach import Attachment
from .instrument.calls import ModelCalls
from .instrument.compiled import compiled_in_place, compiled_parts, eager_module, graph_routable
from .instrument.grads import GradCall
from .instrument.ingraph import Slot
from .instrument.keys import key2module, key_path
from .machinery import model_class
from .node import Node, Scope
from .passes.align import align
from .patching import (
    InterruptGuard,
    add_call_handler,
    critical,
    guarded_enter,
    guarded_exit,
    remove_call_handler,
)
from .precision import Agreement, math_record, pair_precision, rounding_explains
from .summary import BINS, FIELDS, SAMPLES, as_dict, compared, sample_positions, summarize, summarize_blocks
from .tracer import Tracer, active_tracer

if TYPE_CHECKING:  # NumPy is torch's to import: ``import fwdtrace`` needs only torch
    import numpy as np

    from .passes.model_explorer import ModelExplorerFiles

__all__ = ["Dumper", "read_dump", "compare_dumps", "DumpReport", "DumpRow", "run_cli"]

FORMAT_ATTR = "fwdtrace_dump"
FORMAT_VERSION = 4  # 2: completeness attributes, sanitized group names; 3: statistics dumps; 4: packed statistics
VALUES = ("tensors", "statistics")  # what a dump stores per tensor (the file's "values" attribute)
CALLS = ("modules", "functions", "all")  # which calls a dump records (the file's "calls" attribute)
ORDER_DATASET = "execution_order"
GRAPH_DATASET = "trace_graph"  # the step's trace (Graph.to_json) in a dump that records function calls
# A statistics dump's step: every statistics vector as a row of one matrix, in the order written, and one JSON
# table of its calls (group name, attributes) and rows (group, tensor name, shape, dtype)
STATISTICS_DATASET = "statistics"
STATISTICS_INDEX = "statistics_index"
MAX_TENSOR_BYTES = 1 << 32  # the default cap on one tensor read from a dump (4 GiB)
COMPARE_BLOCK_ELEMENTS = 1 << 16  # compare_dumps reads and compares this many elements at a time
MAX_CHUNK_BYTES = 1 << 26  # HDF5 decompresses a whole chunk to read any of it: larger chunks are refused
MATH_PREFIX = "math_"  # the file attributes of how the run computed (see fwdtrace.precision.math_record)
WRITING = "being written"  # the status of a dump until it is closed: what a killed writer leaves
_GROUP_RE = re.compile(r"^(\d+)_(\w+)$", re.ASCII)
_DATASET_RE = re.compile(r"^\w+$", re.ASCII)
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"

# dtypes HDF5 has no type for: stored as the integer bit pattern of the same size.
_BITS_AS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BITS_AS[getattr(torch, _name)] = torch.uint8
_STR2DTYPE = {dtype_name(d): d for d in _BITS_AS}


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - h5py is a dependency
        raise FwdtraceError("HDF5 dumps need h5py: pip install h5py") from e
    return h5py


def group_name(call_number: int, class_name: str) -> str:
    """``"007_Conv2d"``: a call's group name; a class name cannot nest groups or escape the pattern.

    >>> group_name(7, "Block/../../x")
    '007_Block_______x'
    """
    return f"{call_number:03d}_{re.sub(r'[^A-Za-z0-9_]', '_', class_name) or 'Module'}"


def _non_negative_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise FwdtraceError(f"Dumper.register() expected {what} as a non-negative int, got {describe(value)} {value!r}")
    number = operator.index(value)
    if number < 0:
        raise FwdtraceError(f"Dumper.register() expected {what} as a non-negative int, got {number}")
    return number


@dataclass
class _Call:
    """One module call's group, with its name (asking HDF5 for a group's name is slow)."""

    name: str
    recorded: bool  # False: a call seen but not recorded (the root's, one outside the selection): no group
    grads: GradCall | None = None  # its gradients' hooks, from the forward pre-hook on
    ends_scope: bool = False  # the selection's scope ends with this call


@dataclass
class _Kept:
    """What a Dumper keeps across its registrations so that dumping a compiled model every step compiles once:
    the in-graph slot of each hooked module (the compiled copy's hooks append to it), and the copies compiled."""

    slots: dict[tuple[int, str, bool, bool], Slot] = field(default_factory=dict)  # (id(owner), key, statistics, wanted)
    copies: dict[int, dict[frozenset[int], Any]] = field(default_factory=dict)  # GraphRoute's kept


@dataclass
class _Taken:
    """A call's tensors as the in-graph hooks took them inside compiled code, handed over after the graph:
    per tensor (in :func:`~fwdtrace._tree.iter_tensors` order) a detached copy, or for a statistics dump of a
    tensor off the CPU its ``(summary, shape, dtype name)``; and the notes on what of an output was no tensor."""

    tensors: list[Any]
    notes: list[str] = field(default_factory=list)


def _skipped_notes(output: Any) -> list[str]:
    """What of a call's result gets no dataset (None, ints, strings), as the ``skipped`` attribute says it."""
    parts = list(enumerate(output)) if isinstance(output, (tuple, list)) else [(None, output)]
    return [
        f"output{'' if j is None else f'[{j}]'}: {describe(part)}"
        for j, part in parts
        if part is not None and not isinstance(part, torch.Tensor) and not any(True for _ in iter_tensors(part))
    ] + [f"output[{j}]: None" for j, part in parts if part is None]


def _in_graph_hooks(slot: Slot, statistics: bool, wanted: bool) -> tuple[Callable[..., None], Callable[..., None]]:
    """A dump's pre-hook and hook for a module inside compiled code: traced by dynamo without a break (tensor
    ops, and the list append :class:`~fwdtrace.instrument.ingraph.Slot` makes), so the part keeps running
    compiled; what they take is written after the graph. ``wanted=False``: a call the selection never keeps."""

    def take(obj: Any, prefix: str) -> list[Any]:
        if not wanted:
            return []
        # A copy (the model may change the tensor in place later in the step); a statistics dump's CPU tensor
        # too, summarised after the graph by the CPU's own route, an order of magnitude faster there than
        # the loops inductor generates for it. Another device's is summarised inside the graph.
        return [(summarize(t), list(t.shape), dtype_name(t.dtype)) if statistics and t.device.type != "cpu"
                else t.detach().clone() for _, t in iter_tensors(obj, prefix)]

    def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        slot.put(("pre", take((args, kwargs) if kwargs else args, "input")))

    def post(module: torch.nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
        slot.put(("post", take(result, "output"), _skipped_notes(result)))

    return pre, post


@dataclass
class _Selection:
    """Which calls a dump records: keys matching a glob (a call's key or module path), within a scope
    that begins with the first call matching ``scope[0]`` and ends after the first call matching
    ``scope[1]`` from there (its inner calls included)."""

    keys: tuple[str, ...] | None = None
    scope: tuple[str, str] | None = None
    state: str = "before"  # of the scope: "before", "in", "after"

    @property
    def filtered(self) -> bool:
        return self.keys is not None or self.scope is not None

    def enter(self, key: str, path: str) -> tuple[bool, bool]:
        """At a call's beginning: (whether it is recorded, whether the scope ends with it)."""
        ends = False
        if self.scope is not None:
            if self.state == "before" and fnmatch.fnmatchcase(key, self.scope[0]):
                self.state = "in"
            if self.state != "in":
                return False, False
            ends = fnmatch.fnmatchcase(key, self.scope[1])
        wanted = self.keys is None or any(fnmatch.fnmatchcase(key, g) or fnmatch.fnmatchcase(path, g) for g in self.keys)
        return wanted, ends

    def leave(self, call: _Call) -> None:
        if call.ends_scope and self.state == "in":
            self.state = "after"


class _Recording:
    """One registration: the open (temporary) file, the hooks, and the call bookkeeping.

    The step begins with the root module's forward: calls of submodules before it (or
    outside it) are not recorded. A root forward that raises is kept only until the next
    root forward begins, which replaces it (a training loop that caught a failed batch);
    the file's ``discarded_forwards`` counts them.
    """

    def __init__(
        self, path: Path, model: torch.nn.Module, epoch: int, step: int, rank: int | None, grads: bool,
        overwrite: bool, values: str = "tensors", calls: str = "modules", selection: _Selection | None = None,
        writer: _Writer | None = None, kept: _Kept | None = None,
    ) -> None:
        h5py = _h5py()
        self.path = path
        self.writer = writer
        self.kept = kept or _Kept()
        self.atomic = AtomicFile(path, "Dumper.register()", overwrite=overwrite, partial_name=True)
        try:
            self.atomic.check_target()
            self.file = h5py.File(self.atomic.tmp, "w", track_order=True, libver=("v110", "latest"))
            self.file.attrs[FORMAT_ATTR] = FORMAT_VERSION
            self.file.attrs["model"] = type(eager_module(model)).__name__
            self.file.attrs.update({"epoch": epoch, "step": step, "values": values, "calls": calls})
            if rank is not None:
                self.file.attrs["rank"] = rank
            self.file.attrs["complete"] = False
            self.file.attrs["status"] = WRITING
        except BaseException:
            self.atomic.discard()
            raise
        self.grads = grads
        self.statistics = values == "statistics"
        self.record_modules = calls != "functions"
        self.record_functions = calls != "modules"
        self.selection = selection or _Selection()
        self.order: list[str] = []  # "group/dataset" of every tensor, in the order written
        self.calls = 0
        self.root_calls = 0
        self.key2calls: dict[str, int] = {}
        # per id() of a module or a function site: its calls running
        self.open_calls: dict[int, list[_Call]] = {}
        self.skipped: list[str] = []
        self.forward_handles: list[Any] = []
        self.grad_calls: list[GradCall] = []  # of the calls recorded, to take their leaf hooks off at the end
        self.root_calls_in_backward = 0  # root calls whose gradients have not all been written
        self.root_depth = 0  # > 0 while the root module's forward runs
        self.forward_done = False
        self.failed: str | None = None  # why the last root forward did not finish
        self.discarded = 0
        self.backward_expected = False
        self.backward_done = False
        self.closed = False
        self.graph: Graph | None = None  # the step's trace, when function calls are recorded
        # id() of a tensor summarised in this step -> (a weak reference to it, its version, its statistics)
        self.summaries: dict[int, tuple[weakref.ref[torch.Tensor], int, np.ndarray | HostCopy]] = {}
        self.packed = _Packed() if self.statistics else None
        try:
            self._register(model, grads)
        except BaseException:
            self._remove_hooks()
            self.file.close()
            self.atomic.discard()
            raise

    def _route(self, model: torch.nn.Module, root: torch.nn.Module, grads: bool, sites: bool) -> str:
        """How a compiled model runs while dumped: ``"graph"`` (the forward's tensors taken inside its compiled
        code) or ``"eager"`` (its compiled parts run eagerly); said in the file's ``compiled`` attribute."""
        if not compiled_parts(model):
            return "eager"
        why = (
            "gradients are taken by hooks outside compiled code (register(grads=False) dumps the forward "
            "inside it)" if grads else
            "function calls are recorded by a trace" if self.record_functions else
            "hooked functions' calls run outside compiled graphs" if sites else
            "the root module was compiled in place (its own hooks would run inside its compiled code)"
            if compiled_in_place(root) else
            "fwdtrace cannot tell how a compiled part was compiled" if not graph_routable(model) else None
        )
        if why is None:
            self.file.attrs["compiled"] = "compiled: the forward's tensors were taken inside the compiled code"
            return "graph"
        self.file.attrs["compiled"] = f"eager: the compiled parts ran eagerly while dumped, as {why}"
        warnings.warn(f"fwdtrace: Dumper.register() runs the model's compiled parts eagerly for this dump: {why}",
                      UserWarning, stacklevel=5)
        return "eager"

    def _register(self, model: torch.nn.Module, grads: bool) -> None:
        root = eager_module(model)
        # (key, what takes the hooks, its module path, the group's class name, the function's path)
        hooked: list[tuple[str, Any, str, str, str | None]] = [
            (key, module, key_path(key, module), model_class(type(module)).__name__, None)
            for key, module in key2module(model).items()
        ]
        self.layers = len(hooked) > 1  # a model with submodules: a step that records none of them is not complete
        sites = ModelCalls(model).registered_sites() if not self.record_functions else {}
        route = self._route(model, root, grads, bool(sites))
        # Until the file is closed, a compiled model's compiled parts run eagerly, so the hooks run; or,
        # on the graph route, the hooks of the modules inside them run in compiled copies of them.
        on = Attachment(model, "Dumper.register()", route, self.kept.copies)
        self.forward_handles.append(on)
        if self.record_functions:
            # Function calls as the trace sees them: the step's forward runs inside a Tracer, which hands
            # each function node over as it is made (hooked functions' calls among them).
            on.add(_TracedRoot(self, root))
        else:
            # Hooked functions' calls take the same hooks through their function sites (a site's hooks
            # get the calling module as their first argument: the bookkeeping is by site, not by module).
            hooked += [
                (key, site, site.module_path, site.target.name, site.target.path) for key, site in sites.items()
            ]
        if not self.record_modules and self.selection.scope is None:
            hooked = [h for h in hooked if h[1] is root]  # the root's hooks still mark the step's beginning and end
        traced: list[tuple[torch.nn.Module, Slot, Callable[..., None], Callable[..., None]]] = []
        for key, owner, path, class_name, function in hooked:
            is_root = owner is root
            if route == "graph" and is_root:
                owner = model  # a torch.compile wrapper's own hooks run outside its compiled code
            if route == "graph" and on.inside_compiled(owner):
                pre, post = self._pre_hook(key, path, id(owner), class_name, function, is_root), self._post_hook(id(owner), is_root)
                wanted = self.selection.scope is not None or self.selection.enter(key, path)[0]

                def consume(event: tuple, pre: Any = pre, post: Any = post) -> None:
                    # after the graph: the hooks' bodies, as they would have run, on what was taken in it
                    if event[0] == "pre":
                        pre(None, _Taken(event[1]), {})
                    else:
                        post(None, (), {}, _Taken(event[1], event[2]))

                # the slot its hooks had at the Dumper's last registration: the copy compiled then runs again
                slot = self.kept.slots.get((id(owner), key, self.statistics, wanted))
                if slot is None or slot.bound:
                    slot = self.kept.slots[(id(owner), key, self.statistics, wanted)] = Slot(consume)
                else:
                    slot.bind(consume)
                traced_pre, traced_post = _in_graph_hooks(slot, self.statistics, wanted)
                traced.append((owner, slot, traced_post, traced_pre))
                continue
            on.forward_pre(owner, self._pre_hook(key, path, id(owner), class_name, function, is_root), with_kwargs=True)
            # always_call: torch runs the hook when the forward raises too, so a failed call is seen
            on.forward(owner, self._post_hook(id(owner), is_root), with_kwargs=True, always_call=True)
        on.traced(traced)

    def _remove_hooks(self) -> None:
        for h in self.forward_handles:
            h.remove()
        self.forward_handles.clear()

    def _cancel_grads(self) -> None:
        while self.grad_calls:
            self.grad_calls.pop().cancel()

    def _fail(self, exc: BaseException, where: str) -> FwdtraceError:
        """A write failed (disk full...): remove every hook, drop the file, say which file."""
        self._remove_hooks()
        self._cancel_grads()
        self.closed = True
        if self.writer is not None:
            self.writer.finish()
        try:
            self.file.close()
        except Exception:  # noqa: S110 - the file is being dropped; the first error is the one to report
            pass
        self.atomic.discard()
        # HDF5's own text runs over several lines; the errno says it in a few words
        reason = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else one_line(exc)
        return FwdtraceError(
            f"Dumper could not write {str(self.path)!r} ({where}): {reason}; the dump was dropped and its hooks removed"
        )

    def _write(self, call: _Call, name: str, t: torch.Tensor) -> None:
        where = f"{call.name}/{name}"
        if self.packed is not None:
            try:
                if isinstance(t, tuple):  # summarised inside the compiled graph: (vector, shape, dtype)
                    summary, shape, dtype = t
                    self.packed.add(call.name, name, to_numpy(summary), list(shape), dtype)
                else:
                    self.packed.add(call.name, name, self._summary(t), list(t.shape), dtype_name(t.dtype))
            except Exception as e:
                raise self._fail(e, where) from e
            self.order.append(where)
            return
        try:
            attrs: dict[str, Any] = {}
            data: np.ndarray | HostCopy
            if self.statistics:
                if isinstance(t, tuple):  # summarised inside the compiled graph: (vector, shape, dtype)
                    summary, shape, dtype = t
                    data = to_numpy(summary)
                    attrs = {"tensor_shape": shape, "tensor_dtype": dtype}
                else:
                    data = self._summary(t)
                    attrs = {"tensor_shape": list(t.shape), "tensor_dtype": dtype_name(t.dtype)}
            else:
                t = host(t)
                store_as = _BITS_AS.get(t.dtype)
                data = to_numpy(t.contiguous().view(store_as)) if store_as is not None else to_numpy(t)
                if store_as is not None:
                    # Lossless: the raw bits; read_dump/compare_dumps view them back as this dtype.
                    attrs = {"torch_dtype": dtype_name(t.dtype)}
                if self.writer is not None:
                    data = data.copy()  # a CPU tensor's array shares its memory: the model may write into it before the thread
        except Exception as e:
            raise self._fail(e, where) from e

        def create() -> None:
            arr = data.array() if isinstance(data, HostCopy) else data
            self.file[call.name].create_dataset(name, data=arr).attrs.update(attrs)

        if self._file_op(create, data.nbytes, where):
            self.order.append(where)

    def _summary(self, t: torch.Tensor) -> np.ndarray | HostCopy:
        """``t``'s statistics vector on its way to the host: computed on ``t``'s device once per tensor and
        version (a layer's output is the next layer's input, one gradient two calls'), one host copy each.

        A CUDA tensor's vector is copied without waiting when a writer thread takes it (it waits for the
        copy); else the copy is made here.
        """
        try:
            version: int | None = t._version
        except RuntimeError:  # an inference tensor keeps no version counter: summarised at every use
            version = None
        found = self.summaries.get(id(t)) if version is not None else None
        if found is not None and found[0]() is t and found[1] == version:
            return found[2]
        vector = summarize(t)
        values: np.ndarray | HostCopy = HostCopy(vector) if vector.is_cuda and self.writer is not None \
            else to_numpy(vector)
        if version is not None:
            self.summaries[id(t)] = (weakref.ref(t), version, values)
        return values

    def _file_op(self, op: Callable[[], None], nbytes: int, where: str) -> bool:
        """Run ``op`` on the file now, or queue it for the writer thread; False when the queue was full and the
        Dumper drops (counted)."""
        if self.writer is None:
            try:
                op()
            except Exception as e:
                raise self._fail(e, where) from e
            return True
        if self.writer.error is not None:
            raise self._fail(self.writer.error, self.writer.where)
        return self.writer.put(op, nbytes, where)

    def _write_all(self, call: _Call, prefix: str, obj: Any) -> None:
        tensors = obj.tensors if isinstance(obj, _Taken) else (t for _, t in iter_tensors(obj, prefix))
        for i, t in enumerate(tensors):
            self._write(call, f"{prefix}{i}", t)

    def _note_skipped(self, call: _Call, output: Any) -> None:
        # Non-tensor results (None, ints, strings) get no dataset: say so in the attributes.
        notes = output.notes if isinstance(output, _Taken) else _skipped_notes(output)
        if notes:
            text = "; ".join(notes)
            if self.packed is not None:
                self.packed.calls[call.name]["skipped"] = text
            else:
                self._file_op(lambda: self.file[call.name].attrs.__setitem__("skipped", text), 0, call.name)
            self.skipped += [f"{call.name} {n}" for n in notes]

    def _restart(self) -> None:
        """Drop the calls of a root forward that raised: the step begins again."""
        written = {o.split("/", 1)[0] for o in self.order}

        def drop() -> None:
            for name in written | {n for n in self.file if _GROUP_RE.match(n)}:
                del self.file[name]

        if self.packed is not None:
            self.packed = _Packed()  # nothing of the step is in the file yet
        else:
            self._file_op(drop, 0, "dropping a failed forward")
        self.order.clear()
        self.summaries.clear()
        self.calls = self.root_calls = 0
        self.key2calls.clear()
        self.open_calls.clear()
        self._cancel_grads()
        self.root_calls_in_backward = 0
        self.skipped.clear()
        self.discarded += 1
        self.failed = None
        self.selection.state = "before"

    def _record_math(self, model: torch.nn.Module, args: tuple) -> None:
        """How the step computes, as the file's ``math_*`` attributes: read as the root forward begins,
        inside the caller's autocast region if any (see :func:`fwdtrace.precision.math_record`)."""
        record = {MATH_PREFIX + name: value for name, value in math_record(model, args).items()}
        self._file_op(lambda: self.file.attrs.update(record), 0, "math record")

    def _pre_hook(self, key: str, path: str, owner: int, class_name: str, function: str | None, is_root: bool) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self.forward_done or self.closed:
                return
            if is_root:
                if self.failed is not None and self.root_depth == 0:
                    self._restart()
                if self.root_depth == 0:
                    self._record_math(module, args)
                self.root_depth += 1
                self.root_calls += 1
            elif self.root_depth == 0:
                return  # a submodule called on its own, before the step's forward
            inputs = (args, kwargs) if kwargs else args
            wanted, ends_scope = self.selection.enter(key, path)
            with self._unseen():
                if self.record_modules and wanted:
                    call = self._begin_call(key, path, class_name, function, inputs, is_root)
                else:
                    self._next_call_index(key)
                    call = _Call("", False)
                    if is_root and self.grads and torch.is_grad_enabled():
                        # the root's call without a group still marks the step's end and its backward's
                        call.grads = GradCall(tensors_of(inputs), self._grad_writer(call, is_root))
                        self.grad_calls.append(call.grads)
            call.ends_scope = ends_scope
            self.open_calls.setdefault(owner, []).append(call)

        return hook

    def _unseen(self) -> contextlib.AbstractContextManager[Any]:
        """Where the step runs inside a trace (function calls recorded), the dump's own ops are not part of it."""
        return torch._C.DisableTorchFunction() if self.record_functions else contextlib.nullcontext()

    def _next_call_index(self, key: str) -> int:
        """Counted for every call, recorded or not: a filtered dump's call indices are the whole run's."""
        call_index = self.key2calls.get(key, 0)
        self.key2calls[key] = call_index + 1
        return call_index

    def _begin_call(self, key: str, path: str, class_name: str, function: str | None, inputs: Any,
                    is_root: bool) -> _Call:
        """A call's group, with its inputs written and its gradients' hooks on."""
        call_index = self._next_call_index(key)
        name = group_name(self.calls, class_name)
        try:
            call = _Call(name, True)
            attrs = {"module_key": key, "module_path": path, "call_index": call_index, "class_name": class_name,
                     **({"function": function} if function else {})}
        except Exception as e:
            raise self._fail(e, name) from e

        def create() -> None:
            self.file.create_group(name, track_order=True).attrs.update(attrs)

        if self.packed is not None:
            self.packed.calls[name] = attrs
        else:
            self._file_op(create, 0, name)
        self.calls += 1
        self._write_all(call, "input", inputs)
        if self.grads and torch.is_grad_enabled():
            # Tensor hooks, not a module backward hook: safe beside in-place ops (fwdtrace.instrument.grads);
            # grad_inputN is the gradient of inputN, grad_outputN of outputN.
            call.grads = GradCall(tensors_of(inputs), self._grad_writer(call, is_root))
            self.grad_calls.append(call.grads)
        return call

    def _end_call(self, call: _Call, result: Any, is_root: bool) -> None:
        if call.recorded:
            self._write_all(call, "output", result)
            self._note_skipped(call, result)
        if call.grads is not None:
            # Every tensor of the result, a ModelOutput's or a dict's too (torch's module
            # backward hook sees only a tensor or a tuple's tensors).
            call.grads.hook_outputs(tensors_of(result))
            self.root_calls_in_backward += is_root

    def function_call(self, node: Node, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                      in_place: bool) -> None:
        """One function node of the step's trace, with the tensors it read and made, as the tracer files it."""
        if self.forward_done or self.closed or self.root_depth == 0:
            return
        key = node.key or node.name
        wanted, ends_scope = self.selection.enter(key, node.module_path)
        if ends_scope:
            self.selection.state = "after"  # a function call holds no calls of its own: the scope ends here
        if not wanted:
            self._next_call_index(key)
            return
        with torch._C.DisableTorchFunction():
            # an in-place op's inputs are read after its write: they are not dumped, nor its gradients
            grads, self.grads = self.grads, self.grads and not in_place
            try:
                call = self._begin_call(key, node.module_path, node.class_name, node.target,
                                        [] if in_place else inputs, False)
            finally:
                self.grads = grads
            self._end_call(call, outputs[0] if len(outputs) == 1 else tuple(outputs), False)

    def _post_hook(self, owner: int, is_root: bool) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
            stack = self.open_calls.get(owner)
            if self.forward_done or self.closed or not stack:
                return
            call = stack.pop()
            exc = sys.exc_info()[1]
            if exc is not None and result is None:
                # torch runs always_call hooks while the forward's exception propagates
                if call.grads is not None:
                    call.grads.cancel()
                if self.failed is None:
                    self.failed = f"the forward raised in {call.name or 'the model'}: {one_line(exc)}"
                if is_root:
                    self.root_depth -= 1
                return
            with self._unseen():
                self._end_call(call, result, is_root)
            self.selection.leave(call)
            if is_root:
                self.root_depth -= 1
                if self.root_depth == 0:
                    # The step's forward is over. The gradient hooks of the calls recorded stay
                    # attached to their autograd graph; later forwards get none.
                    self.forward_done = True
                    self.backward_expected = self.grads and any(t.requires_grad for t in tensors_of(result))
                    self._remove_hooks()

        return hook

    def _grad_writer(self, call: _Call, is_root: bool) -> Any:
        def write(grad_input: list[torch.Tensor | None], grad_output: list[torch.Tensor | None]) -> None:
            if self.closed:
                return
            for prefix, grads in (("grad_output", grad_output), ("grad_input", grad_input)) if call.recorded \
                    else ():
                for index, g in enumerate(grads):
                    if g is not None:
                        self._write(call, f"{prefix}{index}", g)
            if is_root:
                self.root_calls_in_backward -= 1
                self.backward_done = self.root_calls_in_backward == 0

        return write

    def _status(self, exc: BaseException | None) -> tuple[bool, str]:
        """Whether the step is complete, and if not, why."""
        raised = f"; the step raised {one_line(exc)}" if exc is not None else ""
        if self.failed is not None:  # the exception leaving the with block is this one, named already
            return False, self.failed
        if self.root_calls == 0:
            return False, "the model's forward did not run" + raised
        if self.layers and self.record_modules and not self.selection.filtered and self.calls == self.root_calls:
            return False, "no call of the model's layers was recorded, only the root's" + raised
        if not self.forward_done:
            return False, "the forward did not finish" + raised
        if self.backward_expected and not self.backward_done:
            return False, "the backward did not run" + raised
        if self.writer is not None and self.writer.dropped:
            return False, f"{self.writer.dropped} tensors dropped: the write queue was full (when_full='drop')" + raised
        return True, "complete"

    def close(self, exc: BaseException | None = None) -> Path | None:
        """Record the completeness, close the file and rename it; None when it was dropped."""
        self._remove_hooks()
        self._cancel_grads()
        self.summaries.clear()
        if self.closed:
            return None
        self.closed = True
        packed = self.packed
        if packed is not None:
            self._file_op(lambda: packed.write(self.file), 0, "the statistics")  # on the writer thread if any
        if self.writer is not None:
            self.writer.finish()
            if self.writer.error is not None:
                raise self._fail(self.writer.error, self.writer.where)
        complete, status = self._status(exc)
        try:
            attrs = self.file.attrs
            if self.writer is not None:
                attrs["dropped"] = self.writer.dropped
            attrs["calls"] = self.calls
            attrs["complete"] = complete
            attrs["status"] = status
            attrs["forward_finished"] = self.forward_done
            attrs["backward_finished"] = self.backward_done
            attrs["stopped_after"] = self.order[-1].split("/", 1)[0] if self.order else ""
            attrs["discarded_forwards"] = self.discarded
            # One dataset at the end instead of an attribute per tensor: attributes cost more
            # than small datasets. Without it (a file never closed) group order is used.
            if packed is None:  # a packed dump's rows are in the order written
                self.file.create_dataset(ORDER_DATASET, data=self.order, dtype=_h5py().string_dtype())
            if self.graph is not None:
                _create_text(self.file, GRAPH_DATASET, self.graph.to_json(indent=None))
            if self.skipped:
                attrs["skipped"] = "\n".join(self.skipped)
            self.file.close()
        except Exception as e:
            self.closed = False
            raise self._fail(e, "closing the file") from e
        self.atomic.commit()
        return self.path


def _int_set(value: Any, name: str, every: bool) -> int | frozenset[int] | None:
    """None, a positive int (``every``: every Nth), or a list of non-negative ints, checked."""
    if value is None:
        return None
    if every and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, (list, tuple, set, frozenset, range)) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return frozenset(value)
    what = "a positive int (every Nth) or a list of non-negative ints" if every else "a list of non-negative ints"
    raise FwdtraceError(f"Dumper expected {name} as {what}, got {describe(value)} {value!r}")


def _rank() -> int:
    """This process's rank: torch.distributed's once initialised, else the ``RANK`` environment variable, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else 0


class _Packed:
    """A statistics dump's step, kept until the file closes and then written as two datasets: HDF5's cost per
    object (a group per call, a dataset and its attributes per tensor) is paid twice per step."""

    WIDTH = len(FIELDS) + BINS + SAMPLES

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, Any]] = {}  # group name -> its attributes, in call order
        self.rows: list[tuple[str, str, list[int], str]] = []  # (group, tensor name, shape, dtype), in write order
        self.vectors: list[np.ndarray | HostCopy] = []

    def add(self, group: str, name: str, vector: np.ndarray | HostCopy, shape: list[int], dtype: str) -> None:
        self.rows.append((group, name, shape, dtype))
        self.vectors.append(vector)

    def write(self, file: Any) -> None:
        import numpy as np

        # a tensor of fewer than SAMPLES values has fewer samples: the rest of its row is NaN
        matrix = np.full((len(self.vectors), self.WIDTH), np.nan)
        for row, vector in zip(matrix, self.vectors, strict=True):
            values = vector.array() if isinstance(vector, HostCopy) else vector
            row[:values.size] = values
        # float64, shuffled and deflated: the counts and the histograms compress well, the rest a little
        options = {"shuffle": True, "compression": "gzip"} if len(matrix) else {}
        file.create_dataset(STATISTICS_DATASET, data=matrix, **options)
        index = {"calls": [[name, attrs] for name, attrs in self.calls.items()], "rows": [list(r) for r in self.rows]}
        _create_text(file, STATISTICS_INDEX, json.dumps(index, separators=(",", ":")))


def _create_text(file: Any, name: str, text: str) -> None:
    """``text`` as a dataset of its UTF-8 bytes, deflated: a dump's names, keys and JSON repeat themselves, and
    stored as one HDF5 string they were most of a statistics dump's file."""
    import numpy as np

    data = np.frombuffer(text.encode(), dtype=np.uint8)
    file.create_dataset(name, data=data, **({"compression": "gzip"} if data.size else {}))


class _Writer:
    """A thread that runs a dump's file operations in order, with at most ``max_bytes`` of tensors queued.

    A tensor that would go over waits for room (``when_full="wait"``) or is dropped and counted
    (``"drop"``); one alone in the queue is always taken. An operation that raises stops the
    writing: the ones after it are skipped and the error is raised on the training thread.
    """

    def __init__(self, max_bytes: int, when_full: str) -> None:
        self.max_bytes, self.when_full = max_bytes, when_full
        self.queue: collections.deque[tuple[Callable[[], None], int, str]] = collections.deque()
        self.cond = threading.Condition()
        self.queued_bytes = 0
        self.dropped = 0
        self.error: BaseException | None = None
        self.where = ""
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="fwdtrace-dump-writer", daemon=True)
        self.thread.start()

    def put(self, op: Callable[[], None], nbytes: int, where: str) -> bool:
        with self.cond:
            if nbytes and self.queued_bytes and self.queued_bytes + nbytes > self.max_bytes:
                if self.when_full == "drop":
                    self.dropped += 1
                    return False
                while self.queued_bytes and self.queued_bytes + nbytes > self.max_bytes and self.error is None:
                    self.cond.wait()
            self.queue.append((op, nbytes, where))
            self.queued_bytes += nbytes
            self.cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if not self.queue:
                    return
                op, nbytes, where = self.queue[0]
            if self.error is None:
                try:
                    op()
                except Exception as e:
                    self.error, self.where = e, where
            with self.cond:
                self.queue.popleft()
                self.queued_bytes -= nbytes
                self.cond.notify_all()

    def finish(self) -> None:
        """Wait for every queued operation; the thread ends."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()


class _TracedRoot:
    """Runs the step's forward inside a :class:`Tracer` that hands each function node to the recording:
    function calls keyed as the trace keys them, by the trace's one way of seeing them."""

    def __init__(self, recording: _Recording, root: torch.nn.Module) -> None:
        self.recording = recording
        self.root = root
        self.tracing = threading.local()
        self.handle: Any = add_call_handler(self._on_call, all_threads=True)

    def _on_call(self, call: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        recording = self.recording
        if module is not self.root or recording.forward_done or recording.closed or \
                getattr(self.tracing, "on", False) or active_tracer() is not None:
            return call(module, *args, **kwargs)
        self.tracing.on = True
        try:
            with _CallTracer(recording) as tracer:
                # called again, inside the trace: the tracer sees the model's own call as its root
                out = module(*args, **kwargs)
        finally:
            self.tracing.on = False
        recording.graph = tracer.graph
        return out

    def remove(self) -> None:
        if self.handle is not None:
            remove_call_handler(self.handle)
            self.handle = None


class _CallTracer(Tracer):
    """A trace that gives the dump each function node where the tracer files its tensors."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording

    def _track_aliases(self, node_id: int, in_tensors: list[torch.Tensor], out_tensors: list[torch.Tensor],
                       out_refs: Any, in_place: bool) -> None:
        super()._track_aliases(node_id, in_tensors, out_tensors, out_refs, in_place)
        node = self.graph.nodes[node_id]
        if node.kind == "function":
            self._quiet += 1
            try:
                self.recording.function_call(node, in_tensors, out_tensors, in_place)
            finally:
                self._quiet -= 1


class Dumper:
    """Dump every module call's inputs, outputs and gradients of one training step to HDF5.

    >>> import tempfile, torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> with fwdtrace.Dumper(tempfile.mkdtemp()) as dumper:
    ...     dumper.register(model, epoch=0, step=3)
    ...     model(torch.ones(1, 2)).sum().backward()
    >>> [p.name for p in dumper.paths]
    ['0-epoch_3-step_dump.hdf5']

    The next forward after :meth:`register` and its backward are dumped; later
    forwards are not. Leaving the ``with`` block (or :meth:`remove`) takes the hooks off,
    closes the files and gives them their names; until then a dump has a temporary name.
    A dump records whether its step completed: a forward that raised, a backward that did
    not run, an exception leaving the ``with`` block. An existing file is an error unless
    ``overwrite=True``. A write that fails (a full disk) raises :class:`FwdtraceError`
    naming the file, with every hook removed and the partial file deleted. Gradients of a
    module called several times are matched to its calls last first, the order backward
    visits them. The calls of functions registered with ``hook_forward``/``register_atomic``
    (when :meth:`register` runs) are groups of their own, keyed as in a trace's graph.

    ``values="statistics"`` stores per tensor, instead of the tensor, its count, NaN and Inf
    counts, mean, std, min, max, L2 norm, a 16-bin histogram and 8 sampled values
    (:mod:`fwdtrace.summary`): computed on the tensor's device, a few hundred bytes per tensor
    whatever its size, the step's written as one matrix when the file closes. :func:`read_dump` shows them under ``"statistics"``;
    :func:`compare_dumps` compares them, against a full dump too.

    ``calls="functions"`` dumps the torch functions called between layers instead of the
    modules, ``calls="all"`` both, in execution order: the step's forward runs inside a
    :class:`~fwdtrace.Tracer`, and each function node it records is a group keyed as that node
    (``"blocks.0.attn.softmax"``), its ``function`` the node's target. An in-place op's inputs
    are not dumped (they are read after its write). A step that is traced already (inside
    ``with fwdtrace.Tracer()``) records module calls only.

    Filters: ``keys`` (a glob or a list of them) keeps the calls whose key or module path
    matches one; ``scope=(first, last)`` keeps the calls from the first whose key matches
    ``first`` to the end of the first, from there, whose key matches ``last`` (its inner calls
    included); ``steps`` (every Nth step, or a list of steps) and ``ranks`` (a list; the rank
    is torch.distributed's once initialised, else the ``RANK`` environment variable, else 0) make
    :meth:`register` of other steps and ranks a no-op. Call indices
    count every call, recorded or not, as in an unfiltered dump.

    ``background=True`` writes on a thread of its own: each tensor is copied to the host in the
    hook and queued, at most ``queue_bytes`` of them; past that a tensor waits for room
    (``when_full="wait"``) or is dropped (``"drop"``), counted in the file's ``dropped`` attribute
    and making the dump incomplete. A statistics dump's vectors are kept, not queued, and the
    thread writes them when the dump closes. A write that fails there is raised on the training
    thread, at the next tensor or when the dump closes.
    """

    def __init__(self, directory: str | os.PathLike[str], overwrite: bool = False, values: str = "tensors",
                 calls: str = "modules", *, keys: str | list[str] | tuple[str, ...] | None = None,
                 scope: tuple[str, str] | None = None, steps: int | list[int] | tuple[int, ...] | None = None,
                 ranks: list[int] | tuple[int, ...] | None = None, background: bool = False,
                 queue_bytes: int = 1 << 28, when_full: str = "wait") -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise FwdtraceError(f"Dumper expected a directory path, got {describe(directory)}")
        if not isinstance(overwrite, bool):
            raise FwdtraceError(f"Dumper expected overwrite as a bool, got {describe(overwrite)}")
        if values not in VALUES:
            raise FwdtraceError(f"Dumper expected values as one of {', '.join(map(repr, VALUES))}, got {values!r}")
        if calls not in CALLS:
            raise FwdtraceError(f"Dumper expected calls as one of {', '.join(map(repr, CALLS))}, got {calls!r}")
        self.values = values
        self.calls = calls
        if isinstance(keys, str):
            keys = (keys,)
        if keys is not None and not (isinstance(keys, (list, tuple)) and keys and all(isinstance(k, str) for k in keys)):
            raise FwdtraceError(f"Dumper expected keys as a glob or a non-empty list of globs, got {describe(keys)} {keys!r}")
        self.keys = None if keys is None else tuple(keys)
        if scope is not None and not (isinstance(scope, (list, tuple)) and len(scope) == 2
                                      and all(isinstance(k, str) for k in scope)):
            raise FwdtraceError(f"Dumper expected scope as (first key, last key) globs, got {describe(scope)} {scope!r}")
        self.scope = None if scope is None else (scope[0], scope[1])
        self.steps = _int_set(steps, "steps", every=True)
        self.ranks = _int_set(ranks, "ranks", every=False)
        if not isinstance(background, bool):
            raise FwdtraceError(f"Dumper expected background as a bool, got {describe(background)}")
        if isinstance(queue_bytes, bool) or not isinstance(queue_bytes, int) or queue_bytes < 1:
            raise FwdtraceError(f"Dumper expected queue_bytes as a positive int, got {describe(queue_bytes)} {queue_bytes!r}")
        if when_full not in ("wait", "drop"):
            raise FwdtraceError(f"Dumper expected when_full as 'wait' or 'drop', got {when_full!r}")
        self.background, self.queue_bytes, self.when_full = background, queue_bytes, when_full
        self.directory = Path(directory)
        self.overwrite = overwrite
        self._recordings: list[_Recording] = []
        self._kept = _Kept()
        self._written: list[Path] = []
        self._guard: InterruptGuard | None = None

    @property
    def paths(self) -> list[Path]:
        """The dumps this dumper has finished so far."""
        return list(self._written)

    def register(self, model: torch.nn.Module, epoch: int = 0, step: int = 0, grads: bool = True) -> None:
        """Hook ``model`` so its next forward and backward are written to this step's file.

        ``epoch`` and ``step`` are non-negative ints (they name the file).
        Gradients come from tensor hooks on each call's inputs and outputs
        (:mod:`fwdtrace.instrument.grads`), so in-place ops (``ReLU(inplace=True)``) and outputs such as a
        ``ModelOutput`` or a dict are fine: ``grad_outputN`` is the gradient of ``outputN``,
        ``grad_inputN`` of ``inputN`` (over all its uses, where that tensor also feeds another branch).
        A step or a rank outside the Dumper's ``steps`` or ``ranks`` is not dumped: nothing is hooked.
        """
        if not isinstance(model, torch.nn.Module):
            raise FwdtraceError(f"Dumper.register() expected a torch.nn.Module, got {describe(model)}")
        epoch = _non_negative_int(epoch, "epoch")
        step = _non_negative_int(step, "step")
        if not isinstance(grads, bool):
            raise FwdtraceError(f"Dumper.register() expected grads as a bool, got {describe(grads)}")
        if isinstance(self.steps, int) and step % self.steps or isinstance(self.steps, frozenset) and step not in self.steps:
            return
        if isinstance(self.ranks, frozenset) and _rank() not in self.ranks:
            return
        rank = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        suffix = f"_rank{rank}" if rank is not None else ""
        path = self.directory / f"{epoch}-epoch_{step}-step{suffix}_dump.hdf5"
        self._check_writable()
        if any(r.path == path for r in self._recordings):
            raise FwdtraceError(f"Dumper.register() expected a new epoch/step, got {path.name} which is still open")
        try:
            writer = _Writer(self.queue_bytes, self.when_full) if self.background else None
            try:
                with critical():  # a Ctrl-C waits: hooks are never on without the recording that removes them
                    self._recordings.append(_Recording(path, model, epoch, step, rank, grads, self.overwrite, self.values,
                                                       self.calls, _Selection(self.keys, self.scope), writer,
                                                       self._kept))
            except BaseException:
                if writer is not None:
                    writer.finish()
                raise
        except OSError as e:
            raise FwdtraceError(f"Dumper.register() could not create {path}: {e.strerror or e}") from e

    def _check_writable(self) -> None:
        # Fail here, before a training step runs, rather than in the middle of a hook.
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as e:
            raise FwdtraceError(
                f"Dumper.register() expected a writable directory, got {str(self.directory)!r}: {e.strerror or e}"
            ) from e

    def remove(self) -> list[Path]:
        """Remove the hooks, close and name the files, and return the paths written (by this dumper, so far)."""
        return self._close(None)

    def _close(self, exc: BaseException | None) -> list[Path]:
        first_error: FwdtraceError | None = None
        while self._recordings:
            recording = self._recordings.pop(0)
            try:
                path = recording.close(exc)
            except FwdtraceError as e:  # close the others all the same
                first_error = first_error or e
                continue
            if path is not None:
                self._written.append(path)
        if first_error is not None:
            raise first_error
        return list(self._written)

    # Ctrl-C is held back as in a trace: a signal on __exit__'s first instruction cannot skip the clean-up.
    def __enter__(self) -> Dumper:
        self._guard = guarded_enter(_DUMPER_CODE, lambda: None, lambda: None)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        guard, self._guard = self._guard, None
        guarded_exit(guard, lambda: self._close(exc))


_DUMPER_CODE = (Dumper.__enter__.__code__, Dumper.__exit__.__code__)


# -- reading --------------------------------------------------------------------------------------
class _Reader:
    """An open dump, checked as a file from elsewhere: plain groups and datasets inside it only.

    External links, soft links, external storage and virtual datasets are refused (reading
    them would open other files); each tensor's size is checked against the cap and against
    what the file really stores before anything is allocated.
    """

    def __init__(self, path: Any, caller: str, max_bytes: int) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise FwdtraceError(f"{caller} expected a dump file path (str or os.PathLike), got {describe(path)}")
        h5py = self.h5py = _h5py()
        self.path = Path(path)
        self.caller = caller
        self.max_bytes = max_bytes
        p = self.path
        what = not_a_regular_file(p)
        if what is not None:
            raise FwdtraceError(f"{caller} expected an HDF5 dump file, got {str(p)!r}, {what}")
        try:
            self.file = h5py.File(p, "r")
        except OSError as e:
            raise FwdtraceError(
                f"{caller} expected an HDF5 dump file, got {str(p)!r}, which HDF5 cannot open{self._cut_short()}: {e}"
            ) from e
        try:
            self._check()
        except BaseException:
            self.file.close()
            raise

    def _cut_short(self) -> str:
        """Why an HDF5 file (by its signature) does not open: written by a process that did not finish."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(_HDF5_SIGNATURE))
        except OSError:
            return ""
        if head != _HDF5_SIGNATURE and ".partial-" not in self.path.name:
            return ""
        return " (incomplete: it was cut short while being written, by a killed process or a full disk)"

    def error(self, what: str) -> FwdtraceError:
        return FwdtraceError(f"{self.caller} expected a self-contained fwdtrace dump, got {str(self.path)!r}, {what}")

    def _link(self, parent: Any, name: str, where: str) -> None:
        check_link(self.h5py, parent, name, where, self.error)

    def _dataset(self, ds: Any, where: str) -> None:
        check_dataset(self.h5py, ds, where, self.error)

    def _check(self) -> None:
        f = self.file
        try:
            names = list(f)
            if not any(_GROUP_RE.match(name) for name in names) and FORMAT_ATTR not in f.attrs:
                raise FwdtraceError(
                    f"{self.caller} expected a dump with groups named NNN_ClassName, got {str(self.path)!r}, an HDF5 file "
                    "in another layout"
                )
            self.groups: list[tuple[str, Any]] = []
            for name in names:
                self._link(f, name, repr(name))
                if name in (ORDER_DATASET, GRAPH_DATASET, STATISTICS_DATASET, STATISTICS_INDEX):
                    self._dataset(f[name], repr(name))
                if not _GROUP_RE.match(name):
                    continue
                group = f[name]
                if not isinstance(group, self.h5py.Group):
                    raise self.error(f"where {name!r} is a {type(group).__name__}, not a group")
                for dname in group:
                    self._link(group, dname, f"'{name}/{dname}'")
                    self._dataset(group[dname], f"'{name}/{dname}'")
                self.groups.append((name, group))
            self.packed: list[tuple[str, str]] | None = None  # a packed statistics dump's rows
            if STATISTICS_INDEX in names or STATISTICS_DATASET in names:
                self._read_index()
            # call order is the numeric prefix; the name alone sorts wrong past 999
            self.groups.sort(key=lambda item: int(item[0].split("_", 1)[0]))
            self.name2group = dict(self.groups)
            self.attrs = {k: _attr(v) for k, v in f.attrs.items()}
            self.status = self._status()
        except FwdtraceError:
            raise
        except Exception as e:
            raise self.damaged(e) from e

    def _read_index(self) -> None:
        """A packed statistics dump's calls and rows, from its index, each checked, as groups of tensors."""
        for name in (STATISTICS_INDEX, STATISTICS_DATASET):
            if name not in self.file:
                raise self.error(f"with {(STATISTICS_INDEX if name == STATISTICS_DATASET else STATISTICS_DATASET)!r} "
                                 f"but no {name!r}")
        try:
            index = json.loads(self.text(STATISTICS_INDEX))
        except ValueError as e:
            raise self.error(f"whose {STATISTICS_INDEX!r} is not JSON: {one_line(e)}") from e
        matrix = self.file[STATISTICS_DATASET]
        bad = _bad_index(index)
        if bad is not None:
            raise self.error(f"whose {STATISTICS_INDEX!r} {bad}")
        if matrix.dtype.kind != "f" or matrix.ndim != 2 or matrix.shape[0] != len(index["rows"]) \
                or matrix.shape[1] < len(FIELDS) + BINS + SAMPLES:
            raise self.error(f"whose {STATISTICS_DATASET!r} is a {matrix.dtype} array of shape {matrix.shape}, not "
                             f"{len(index['rows'])} rows of statistics")
        groups = {name: _PackedGroup(attrs) for name, attrs in index["calls"]}
        self.packed = []
        for i, (gname, dname, shape, dtype) in enumerate(index["rows"]):
            group = groups.get(gname)
            if group is None or dname in group.datasets:
                raise self.error(f"whose {STATISTICS_INDEX!r} puts '{gname}/{dname}' in no call or twice")
            group.datasets[dname] = _PackedTensor(i, shape, dtype)
            self.packed.append((gname, dname))
        self.groups += list(groups.items())
        self.matrix: torch.Tensor | None = None

    def damaged(self, e: BaseException) -> FwdtraceError:
        return FwdtraceError(
            f"{self.caller} could not read {str(self.path)!r}{self._cut_short()}: {one_line(e)}"
        )

    def _status(self) -> str:
        """``"complete"``, or ``"incomplete: stopped after NNN_Class (reason)"``."""
        attrs = self.attrs
        if "complete" in attrs:
            if attrs["complete"] is True or attrs["complete"] == 1:
                return "complete"
            reason = str(attrs.get("status", "")) or "the file does not say why"
            if reason == WRITING:
                reason = "the file was never closed: the writing process was killed or failed"
        elif ORDER_DATASET in self.file:
            return "complete"  # a version-1 dump: closed, nothing more recorded
        else:
            reason = "the file was never closed: the writing process was killed or failed"
        if not self.groups:
            return f"incomplete: no module call recorded ({reason})"
        return f"incomplete: stopped after {self.groups[-1][0]} ({reason})"

    def order(self) -> list[tuple[str, str]]:
        """(group, dataset) of every tensor in the order the run wrote them."""
        if self.packed is not None:
            return list(self.packed)
        group_names = {name for name, _ in self.groups}
        if ORDER_DATASET not in self.file:
            return [(gname, dname) for gname, group in self.groups for dname in group]
        ds = self.file[ORDER_DATASET]
        if ds.dtype.kind not in "OS" or ds.ndim != 1 or ds.shape[0] > sum(len(g) for _, g in self.groups):
            raise self.error(f"whose {ORDER_DATASET!r} is a {ds.dtype} array of shape {ds.shape}, not one name per tensor")
        out = []
        try:
            entries = ds[()]
        except Exception as e:
            raise self.damaged(e) from e
        for entry in entries:
            text = entry.decode(errors="replace") if isinstance(entry, bytes) else str(entry)
            gname, _, dname = text.partition("/")
            if gname not in group_names or dname not in self.file[gname]:
                raise self.error(f"whose {ORDER_DATASET!r} names {text!r}, which is not in the file")
            out.append((gname, dname))
        return out

    @property
    def statistics(self) -> bool:
        """Whether the dump holds each tensor's statistics (``Dumper(values="statistics")``), not the tensor."""
        return self.attrs.get("values") == "statistics"

    def graph(self) -> Graph | None:
        """The step's trace, stored by a dump that records function calls; None in one without it."""
        if GRAPH_DATASET not in self.file:
            return None
        text = self.text(GRAPH_DATASET)
        try:
            return Graph.from_json(text)
        except FwdtraceError:
            raise
        except Exception as e:
            raise self.damaged(e) from e

    def text(self, name: str) -> str:
        """A text the dump stores: as UTF-8 bytes (deflated), or as one HDF5 string (dumps written before)."""
        ds = self.file[name]
        if ds.dtype.kind == "u" and ds.dtype.itemsize == 1 and ds.ndim == 1:
            data: Any = bytes(to_numpy(self.read(self._checked(ds, repr(name)), repr(name))))
        elif ds.dtype.kind in "OS" and ds.shape == ():
            try:
                data = ds[()]
            except Exception as e:
                raise self.damaged(e) from e
        else:
            raise self.error(f"whose {name!r} is a {ds.dtype} array of shape {ds.shape}, not one text")
        return data.decode(errors="replace") if isinstance(data, bytes) else str(data)

    def shape(self, gname: str, dname: str) -> list[int]:
        ds = self.name2group[gname][dname]
        if self.statistics:
            return [int(n) for n in _attr(ds.attrs.get("tensor_shape", []))]
        return list(ds.shape)

    def dtype(self, gname: str, dname: str) -> str:
        ds = self.name2group[gname][dname]
        if self.statistics:
            return str(_attr(ds.attrs.get("tensor_dtype", "")))
        return str(_attr(ds.attrs.get("torch_dtype", ds.dtype)))

    def summary(self, gname: str, dname: str) -> torch.Tensor:
        """The tensor's statistics vector (:mod:`fwdtrace.summary`): stored in a statistics dump, computed
        block by block from a full one."""
        tensor = self.name2group[gname][dname]
        if isinstance(tensor, _PackedTensor):
            if self.matrix is None:  # read once, on the first vector asked for
                where = repr(STATISTICS_DATASET)
                self.matrix = self.read(self._checked(self.file[STATISTICS_DATASET], where), where).to(torch.float64)
            count = math.prod(tensor.shape) * (2 if tensor.dtype.startswith("complex") else 1)
            return self.matrix[tensor.row, :len(FIELDS) + BINS + len(sample_positions(count))]
        if self.statistics:
            vector = self.load(gname, dname).to(torch.float64).reshape(-1)
            if vector.numel() < len(FIELDS) + BINS:
                raise self.error(f"where '{gname}/{dname}' holds {vector.numel()} numbers, not a statistics vector")
            return vector
        count = math.prod(self.shape(gname, dname)) * (2 if self.dtype(gname, dname).startswith("complex") else 1)
        return summarize_blocks(lambda: self.blocks(gname, dname), count)

    @property
    def math(self) -> dict[str, Any] | None:
        """The run's math record (see :func:`fwdtrace.precision.math_record`); None in a dump written without one."""
        record = {k.removeprefix(MATH_PREFIX): v for k, v in self.attrs.items() if k.startswith(MATH_PREFIX)}
        return record or None

    def checked(self, gname: str, dname: str) -> Any:
        """The dataset, once its size is within the cap and backed by what the file really stores."""
        return self._checked(self.file[gname][dname], f"'{gname}/{dname}'")

    def _checked(self, ds: Any, where: str) -> Any:
        import numpy as np

        if ds.dtype.kind not in "biufc":
            raise self.error(f"where {where} holds {ds.dtype}, not numbers")
        nbytes = int(np.prod(ds.shape, dtype=object)) * ds.dtype.itemsize
        if nbytes > self.max_bytes:
            raise self.error(f"where {where} holds {nbytes} bytes, over the cap of {self.max_bytes} (max_bytes=)")
        if not nbytes:
            return ds
        try:
            if ds.chunks is None:  # contiguous (never compressed): every byte is in the file
                stored = ds.id.get_storage_size()
                if stored < nbytes:
                    raise self.error(f"where {where} declares {nbytes} bytes but stores {stored} in the file")
                return ds
            # Chunked, maybe compressed: a chunk never written reads as fill values, from nothing
            # (a few kB of file declaring GiBs), so every chunk of the grid must be in the file.
            # fwdtrace writes contiguous datasets; this is a file from elsewhere (h5repack, crafted).
            chunk_bytes = int(np.prod(ds.chunks, dtype=object)) * ds.dtype.itemsize
            if chunk_bytes > MAX_CHUNK_BYTES:
                raise self.error(f"where {where} has chunks of {chunk_bytes} bytes, over the {MAX_CHUNK_BYTES} read at once")
            grid = 1
            for size, chunk in zip(ds.shape, ds.chunks, strict=True):
                grid *= -(-size // chunk)
            written = ds.id.get_num_chunks()
        except FwdtraceError:
            raise
        except Exception as e:
            raise self.damaged(e) from e
        if written < grid:
            raise self.error(
                f"where {where} declares {nbytes} bytes in {grid} chunks but stores {written} of them: "
                "a crafted or incomplete file"
            )
        return ds

    def read(self, ds: Any, where: str, index: tuple = ()) -> torch.Tensor:
        """``ds[index]`` as a tensor, in the dtype the dump recorded (bfloat16 from its bits)."""
        import numpy as np

        try:
            arr = np.asarray(ds[index])
        except Exception as e:
            raise self.damaged(e) from e
        t = torch.from_numpy(arr.copy()) if arr.ndim else torch.tensor(arr)
        name = str(_attr(ds.attrs.get("torch_dtype", "")))
        dtype = _STR2DTYPE.get(name)
        if dtype is None:
            return t
        if t.dtype != _BITS_AS[dtype]:
            raise self.error(f"where {where} is marked {name} but holds {arr.dtype}")
        return t.view(dtype)

    def load(self, gname: str, dname: str) -> torch.Tensor:
        return self.read(self.checked(gname, dname), f"'{gname}/{dname}'")

    def blocks(self, gname: str, dname: str) -> Iterator[torch.Tensor]:
        """The tensor in pieces of at most ``COMPARE_BLOCK_ELEMENTS`` elements, in C order, flattened."""
        ds = self.checked(gname, dname)
        for index in _blocks(tuple(ds.shape), COMPARE_BLOCK_ELEMENTS):
            yield self.read(ds, f"'{gname}/{dname}'", index).reshape(-1)

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


class _PackedTensor:
    """A tensor of a packed statistics dump: its row of the matrix, its shape and dtype (as attributes too, where
    a statistics dataset of the unpacked layout keeps them)."""

    def __init__(self, row: int, shape: list[int], dtype: str) -> None:
        self.row, self.shape, self.dtype = row, shape, dtype
        self.attrs = {"tensor_shape": shape, "tensor_dtype": dtype}


class _PackedGroup:
    """A call of a packed statistics dump, read as an HDF5 group is: its attributes, its tensors by name."""

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs
        self.datasets: dict[str, _PackedTensor] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.datasets)

    def __len__(self) -> int:
        return len(self.datasets)

    def __contains__(self, name: object) -> bool:
        return name in self.datasets

    def __getitem__(self, name: str) -> _PackedTensor:
        return self.datasets[name]


def _bad_index(index: Any) -> str | None:
    """What is wrong with a packed statistics dump's index (a file from elsewhere), or None."""
    if not isinstance(index, dict) or not isinstance(index.get("calls"), list) or not isinstance(index.get("rows"), list):
        return "is not an object of 'calls' and 'rows' lists"
    names = set()
    for call in index["calls"]:
        if not (isinstance(call, list) and len(call) == 2 and isinstance(call[0], str) and _GROUP_RE.match(call[0])
                and isinstance(call[1], dict)
                and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in call[1].values())):
            return f"has a call {str(call)[:80]!r}, not [NNN_ClassName, {{attribute: str or int}}]"
        if call[0] in names:
            return f"has the call {call[0]!r} twice"
        names.add(call[0])
    for row in index["rows"]:
        if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and isinstance(row[1], str)
                and _DATASET_RE.match(row[1]) and isinstance(row[2], list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in row[2])
                and isinstance(row[3], str)):
            return f"has a row {str(row)[:80]!r}, not [group, tensor name, shape, dtype]"
    return None


def _attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if hasattr(value, "ndim") and value.ndim:
        return value.tolist()
    return value.item() if hasattr(value, "item") else value


def _max_bytes(value: Any, caller: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FwdtraceError(f"{caller} expected max_bytes as a non-negative int, got {value!r}")
    return value


def read_dump(
    path: str | os.PathLike[str], show: bool = True, values: bool = False, max_bytes: int = MAX_TENSOR_BYTES
) -> dict[str, Any]:
    """Print the tree of a dump and return it as a dict.

    >>> import tempfile, torch, fwdtrace
    >>> d = fwdtrace.Dumper(tempfile.mkdtemp()); model = torch.nn.Linear(2, 1)
    >>> d.register(model, grads=False); _ = model(torch.ones(1, 2))
    >>> tree = fwdtrace.read_dump(d.remove()[0], show=False)
    >>> tree["groups"]["000_Linear"]["datasets"]["output0"], tree["status"]
    ({'shape': [1, 1], 'dtype': 'float32'}, 'complete')

    ``{"status": ..., "attrs": {...}, "groups": {name: {"attrs": {...}, "datasets": {name: {"shape", "dtype"}}}}}``;
    with ``values=True`` each dataset also holds its tensor under ``"value"`` (each at most
    ``max_bytes``). ``status`` is ``"complete"`` or ``"incomplete: stopped after NNN_Class
    (reason)"``. Files from elsewhere are safe to read: links and storage outside the
    file are refused with a :class:`FwdtraceError` naming them.
    """
    max_bytes = _max_bytes(max_bytes, "read_dump()")
    with _Reader(path, "read_dump()", max_bytes) as r:
        tree: dict[str, Any] = {"status": r.status, "attrs": r.attrs, "groups": {}}
        lines = [f"{r.path.name}: {len(r.groups)} module calls"]
        if r.status != "complete":
            lines[0] += f"; {r.status}"
        try:
            for name, group in r.groups:
                datasets: dict[str, Any] = {}
                for dname in group:
                    entry: dict[str, Any] = {"shape": r.shape(name, dname), "dtype": r.dtype(name, dname)}
                    if r.statistics:
                        entry["statistics"] = as_dict(r.summary(name, dname))
                    elif values:
                        entry["value"] = r.load(name, dname)
                    datasets[dname] = entry
                attrs = {k: _attr(v) for k, v in group.attrs.items()}
                tree["groups"][name] = {"attrs": attrs, "datasets": datasets}
                lines.append(f"{name}  {attrs.get('module_key', '')}")
                lines += [f"    {d:<14} {e['dtype']}{e['shape']}" for d, e in datasets.items()]
        except FwdtraceError:
            raise
        except Exception as e:
            raise r.damaged(e) from e
    if show:
        print("\n".join(lines))
    return tree


# -- comparing ------------------------------------------------------------------------------------
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


@dataclass
class DumpReport:
    """The rows of :func:`compare_dumps`, in execution order, and where the runs first differ."""

    path_a: str
    path_b: str
    rtol: float
    atol: float
    rows: list[DumpRow] = field(default_factory=list)
    first_divergence: str | None = None
    incomplete: dict[str, str] = field(default_factory=dict)  # path -> "incomplete: stopped after ..."
    # path -> how that run computed (see fwdtrace.precision.math_record), None for a dump written without it
    math: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # the graph of run a's step (of b's where a has none), stored by a dump of function calls
    graph: Graph | None = field(default=None, repr=False)
    # the dumps that hold no graph (of module calls only): calls were matched by key and call order only
    without_graph: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """Every tensor of either dump is in the other and allclose, and both dumps are complete."""
        return not self.incomplete and all(r.allclose for r in self.rows)

    @property
    def agree(self) -> bool:
        """Both dumps are complete and every tensor is allclose or differs by what the runs' rounding explains."""
        return not self.incomplete and all(r.allclose or r.rounding for r in self.rows)

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
        within a hundredth of ``rtol``, within tolerance (or what rounding explains), beyond. A
        box's tooltip gives its call's worst output error. ``depth`` and ``options`` are
        :meth:`fwdtrace.Graph.render`'s. Needs a dump that holds its run's graph: one of
        ``Dumper(..., calls="functions")`` or ``calls="all"``, whose step runs inside a trace (a
        dump of module calls only runs no trace, so it has none). Returns the path written.
        """
        from .onnx.compare import error_color

        graph, worst = self._worst_by_node("DumpReport.render()")
        fills = {n: error_color(r.max_rel if r.max_rel is not None else math.inf, self.rtol, r.allclose or bool(r.rounding))
                 for n, r in worst.items()}
        notes = {n: f"max rel err {_num(r.max_rel)}, cosine {_num(r.cosine)}"
                 + (f", within {r.rounding} rounding" if r.rounding else "" if r.allclose else ", diverges")
                 for n, r in worst.items()}
        first = [n for n, r in worst.items() if _call_name(r) == self.first_divergence][:1]
        return graph.render(path, depth, fills=fills, notes=notes, highlight=first, **options)

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
        from .passes.model_explorer import CallErrors, errors_to_model_explorer

        caller = "DumpReport.to_model_explorer()"
        graph, worst = self._worst_by_node(caller)
        errors = {n: CallErrors(r.cosine, r.norm_rel, r.max_abs, r.max_rel, 0 if r.allclose else 1 if r.rounding else 2)
                  for n, r in worst.items()}
        first = [n for n, r in worst.items() if _call_name(r) == self.first_divergence][:1]
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

    def _one_sided(self, note: str) -> list[str]:
        groups = {r.group: r.key for r in self.rows if r.one_sided and r.note == note}
        return list(groups.values())

    def to_text(self, only_diverged: bool = False) -> str:
        """The table the ``fwdtrace dump-diff`` command prints."""
        header = ("#", "group", "key", "name", "shape", "cosine", "max_abs", "max_rel", "norm_rel", "allclose")
        body = []
        for i, r in enumerate(self.rows):
            if only_diverged and (r.allclose or r.rounding):
                continue
            verdict = "yes" if r.allclose else f"within {r.rounding} rounding" if r.rounding else "NO"
            body.append((
                str(i), r.group, r.key + (f" (b: {r.key_b})" if r.key_b else ""), r.name, "x".join(map(str, r.shape)) or "scalar", _num(r.cosine),
                _num(r.max_abs), _num(r.max_rel), _num(r.norm_rel), verdict + (f" ({r.note})" if r.note else ""),
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
        elif all(r.allclose or r.rounding for r in self.rows) and self.incomplete:
            lines.append(f"not comparable as whole runs: {len(self.rows)} tensors agree, but a dump is incomplete")
        elif self.agree:
            labels = ", ".join(dict.fromkeys(str(r.rounding) for r in explained))
            lines.append(f"agree: {len(self.rows) - len(explained)} tensors allclose (rtol={self.rtol:g}, "
                         f"atol={self.atol:g}), {len(explained)} within what {labels} rounding explains")
        else:
            bad = sum(not (r.allclose or r.rounding) for r in self.rows)
            within = f" ({len(explained)} more within rounding)" if explained else ""
            lines.append(f"{bad} of {len(self.rows)} tensors differ{within}; first divergence: {self.first_divergence}")
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
    rank = 0 if row.allclose else 1 if row.rounding else 2
    return rank, row.max_rel if row.max_rel is not None and not math.isnan(row.max_rel) else math.inf


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _blocks(shape: tuple[int, ...], per_block: int) -> Iterator[tuple[Any, ...]]:
    """Indices that cover ``shape`` in C order, each at most ``per_block`` elements (or one element).

    >>> list(_blocks((2, 3), 4))  # one row of 3 at a time
    [(slice(0, 1, None),), (slice(1, 2, None),)]
    >>> list(_blocks((1, 5), 2))  # a row over the budget is read in parts
    [(0, slice(0, 2, None)), (0, slice(2, 4, None)), (0, slice(4, 5, None))]
    """
    if not shape or 0 in shape:
        yield ()
        return
    axis, inner = len(shape) - 1, 1  # inner: the elements of one index along axis
    while axis > 0 and inner * shape[axis] <= per_block:
        inner *= shape[axis]
        axis -= 1
    step = max(1, per_block // inner)
    for outer in itertools.product(*(range(n) for n in shape[:axis])):
        for start in range(0, shape[axis], step):
            yield (*outer, slice(start, min(start + step, shape[axis])))


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
    """Compare two statistics vectors into ``agreement``: their counts exactly, their moments, extremes, norm
    and samples by value (the histograms, whose edges move with min and max, are not compared)."""
    da, db = as_dict(a), as_dict(b)
    counts = [f"{name} {da[name]:g} vs {db[name]:g}" for name in ("count", "nans", "infs") if da[name] != db[name]]
    ca, cb = compared(a), compared(b)
    if len(ca) == len(cb):
        agreement.add(torch.tensor(ca, dtype=torch.float64), torch.tensor(cb, dtype=torch.float64))
    else:
        counts.append(f"{len(da['samples'])} vs {len(db['samples'])} samples")
    if counts:
        agreement.close = False
    return "by statistics" + "".join(f"; {c}" for c in counts)


def _match_calls(ra: _Reader, graph_a: Graph | None, rb: _Reader) -> dict[str, str]:
    """Group of ``a`` -> group of ``b`` holding the same call: the two runs' calls aligned in call order
    (difflib's longest matching runs) by key and the shapes of their inputs and outputs, the roots with
    each other, so a call one run makes more (a cast, an added layer) is left out of the pairs, not
    shifting them. Where both dumps hold their run's graph, the calls left are paired through the two
    graphs (:mod:`fwdtrace.passes.align`): a renamed layer pairs with its new name."""
    def calls(reader: _Reader) -> tuple[list[str], list[tuple]]:
        names, tokens = [], []
        for gname, group in reader.groups:
            key = _attr(group.attrs.get("module_key", gname))
            if _attr(group.attrs.get("module_path")) == "" and "function" not in group.attrs:
                key = ""  # the root, keyed by its class name: the two runs' models may be of two classes
            shapes = tuple((d, tuple(reader.shape(gname, d))) for d in group if not d.startswith("grad_"))
            names.append(gname)
            tokens.append((str(key), shapes))
        return names, tokens

    names_a, tokens_a = calls(ra)
    names_b, tokens_b = calls(rb)
    pairs = {}
    for block in difflib.SequenceMatcher(None, tokens_a, tokens_b, autojunk=False).get_matching_blocks():
        for i in range(block.size):
            pairs[names_a[block.a + i]] = names_b[block.b + i]
    # b's graph is read only when calls are left on both sides (the same model twice leaves none)
    graph_b = rb.graph() if graph_a is not None and len(pairs) < min(len(names_a), len(names_b)) else None
    if graph_a is not None and graph_b is not None:
        shapes = {("a", n): t[1] for n, t in zip(names_a, tokens_a, strict=True)}
        shapes.update({("b", n): t[1] for n, t in zip(names_b, tokens_b, strict=True)})
        _match_through_graphs(_GraphCalls(ra, graph_a), _GraphCalls(rb, graph_b), pairs,
                              lambda ga, gb: shapes["a", ga] == shapes["b", gb])
    return pairs


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
        for gname, group in reader.groups:
            attrs = group.attrs
            key, call_index = str(_attr(attrs.get("module_key", ""))), int(_attr(attrs.get("call_index", 0)))
            path, class_name = str(_attr(attrs.get("module_path", ""))), str(_attr(attrs.get("class_name", "")))
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


def _compare_row(row: DumpRow, ra: _Reader, ga: str, rb: _Reader, gb: str, dname: str, rtol: float,
                 atol: float) -> None:
    """One tensor of a call in both dumps, by value or by statistics, into ``row``."""
    shape_b = rb.shape(gb, dname)
    if row.shape != shape_b:
        row.note = f"shape {shape_b} in b"
        return
    agreement = Agreement(rtol, atol)
    if ra.statistics or rb.statistics:
        row.note = _by_statistics(agreement, ra.summary(ga, dname), rb.summary(gb, dname))
    else:
        # block by block: memory stays bounded whatever the tensors' size
        for block_a, block_b in zip(ra.blocks(ga, dname), rb.blocks(gb, dname), strict=True):
            agreement.add(block_a, block_b)
    row.cosine, row.max_abs, row.max_rel, row.allclose = (
        agreement.cosine, agreement.max_abs, agreement.max_rel, agreement.close)
    row.norm_rel = agreement.norm_rel
    row.precision = pair_precision(ra.dtype(ga, dname), ra.math, rb.dtype(gb, dname), rb.math)
    if ra.math is not None and rb.math is not None and not row.allclose:
        # without both records, no difference is put down to rounding
        row.rounding = rounding_explains(row.norm_rel, row.cosine, row.precision)


def _call_name(row: DumpRow) -> str:
    """How ``first_divergence`` names a row's call: a module by its path, a function call by its key."""
    return row.key if row.function else row.module_path or row.key


def _first_divergence(rows: list[DumpRow]) -> str | None:
    """The earliest call in both runs whose inputs agree and whose outputs do not, as the numeric ONNX
    check finds it (earliest to finish: a layer before the block around it); else the first whose outputs
    differ, else the first whose gradients differ."""
    name = _call_name

    def agree(row: DumpRow) -> bool:
        return row.allclose or row.rounding is not None

    by_call: dict[str, list[DumpRow]] = {}
    finished: dict[str, int] = {}  # a call's first output row: rows are in the order the run wrote them
    for i, row in enumerate(rows):
        if not row.one_sided:
            by_call.setdefault(row.group, []).append(row)
            if row.name.startswith("output"):
                finished.setdefault(row.group, i)
    for group in sorted(finished, key=finished.__getitem__):
        call_rows = by_call[group]
        inputs = [r for r in call_rows if r.name.startswith("input")]
        outputs = [r for r in call_rows if r.name.startswith("output")]
        if inputs and all(agree(r) for r in inputs) and not all(agree(r) for r in outputs):
            return name(outputs[0])
    for prefix in ("output", "grad_input", ""):
        found = next((r for r in rows if not agree(r) and not r.one_sided and r.name.startswith(prefix)), None)
        if found is not None:
            return name(found)
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
    The comparison runs torch on one intra-op thread (the caller's setting is restored after): block
    by block, that reads at disk speed on a busy machine, where a thread pool's wake-ups per block
    would not.
    """
    rtol, atol = _tolerance(rtol, "rtol"), _tolerance(atol, "atol")
    max_bytes = _max_bytes(max_bytes, "compare_dumps()")
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
        b2a = {gb: ga for ga, gb in a2b.items()}
        order_a, order_b = ra.order(), rb.order()
        in_a, in_b = set(order_a), set(order_b)
        for reader, order in ((ra, order_a), (rb, order_b)):
            for gname, dname in order:
                if reader is rb and (b2a.get(gname), dname) in in_a:
                    continue  # compared already
                group = reader.name2group[gname]
                key = str(_attr(group.attrs.get("module_key", gname)))
                path = str(_attr(group.attrs.get("module_path", "")))
                row = DumpRow(gname, key, path, dname, reader.shape(gname, dname), None, None, None, False,
                              function=str(_attr(group.attrs.get("function", ""))),
                              call_index=int(_attr(group.attrs.get("call_index", 0))))
                ga, gb = (gname, a2b.get(gname)) if reader is ra else (b2a.get(gname), gname)
                if ga is None or gb is None or (ga, dname) not in in_a or (gb, dname) not in in_b:
                    row.note = "missing in b" if reader is ra else "missing in a"
                    row.one_sided = ga is None or gb is None
                else:
                    _compare_row(row, ra, ga, rb, gb, dname, rtol, atol)
                if reader is ra and gb is not None:
                    key_b = str(_attr(rb.name2group[gb].attrs.get("module_key", gb)))
                    row.key_b = key_b if key_b != key and (path or row.function) else ""  # a root's key: its class
                report.rows.append(row)
    report.first_divergence = _first_divergence(report.rows)
    return report


# -- command line ---------------------------------------------------------------------------------
def run_cli(args: argparse.Namespace) -> int:
    """Print the comparison table; 0 when the dumps agree (allclose, or within what the runs' rounding
    explains), 1 when they differ, FwdtraceError (exit 2) when a dump is incomplete or unreadable: a
    cut-short run is not a difference between runs."""
    report = compare_dumps(args.a, args.b, rtol=args.rtol, atol=args.atol)
    print(report.to_text(only_diverged=args.only_diverged))
    if args.picture is not None:
        print(f"picture: {report.render(args.picture)}")
    if args.model_explorer is not None:
        files = report.to_model_explorer(args.model_explorer)
        print(f"Model Explorer: {files.graph}, node data {', '.join(files.node_data.values())}")
    if report.incomplete:
        raise FwdtraceError("; ".join(f"{p} is {status}" for p, status in report.incomplete.items()))
    return 0 if report.agree else 1
