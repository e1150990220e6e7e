"""Recording one training step into a dump: the ``Dumper``, its selection of calls and its hooks."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import operator
import os
import sys
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._files import AtomicFile, QuietWrites
from .._host import HostCopy, host, to_numpy
from .._tree import dtype_name, iter_tensors, tensors_of
from ..errors import FwdtraceError, describe, one_line
from ..graph import Graph
from ..instrument.attach import Attachment
from ..instrument.calls import ModelCalls
from ..instrument.compiled import compiled_in_place, compiled_parts, eager_module, graph_routable
from ..instrument.grads import GradCall
from ..instrument.ingraph import Slot
from ..instrument.keys import key2module, key_path
from ..machinery import model_class
from ..node import Node
from ..patching import (
    InterruptGuard,
    add_call_handler,
    critical,
    guarded_enter,
    guarded_exit,
    remove_call_handler,
)
from ..precision import math_record
from ..statistics import summarize
from ..statistics.engine import Pending, summarize_later
from ..tracer import Tracer, active_tracer

if TYPE_CHECKING:  # NumPy is torch's to import: ``import fwdtrace`` needs only torch
    import numpy as np

from .layout import (
    _BITS_AS,
    _GROUP_RE,
    CALLS,
    FORMAT_ATTR,
    FORMAT_VERSION,
    GRAPH_DATASET,
    MATH_PREFIX,
    ORDER_DATASET,
    VALUES,
    WRITING,
    _create_text,
    _h5py,
    group_name,
)
from .packed import _Packed
from .writer import _Writer


def _non_negative_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise FwdtraceError(f"Dumper.register() expected {what} as a non-negative int, got {describe(value)} {value!r}")
    number = operator.index(value)
    if number < 0:
        raise FwdtraceError(f"Dumper.register() expected {what} as a non-negative int, got {number}")
    return number


@dataclass(slots=True)
class _Call:
    """One module call's group, with its name (asking HDF5 for a group's name is slow)."""

    name: str
    recorded: bool  # False: a call seen but not recorded (the root's, one outside the selection): no group
    # the HDF5 group once created (on the writer thread, if any, before the call's datasets): looking a group
    # up by name for each dataset cost more than writing a small dataset
    group: Any = None
    grads: GradCall | None = None  # its gradients' hooks, from the forward pre-hook on
    ends_scope: bool = False  # the selection's scope ends with this call
    recording: Any = None  # the recording its gradients are written to (the call is its GradCall's on_grads)
    is_root: bool = False
    grads_written: bool = False  # by the first backward through the call (a second, retain_graph, is not dumped)

    def __call__(self, grad_input: list[torch.Tensor | None], grad_output: list[torch.Tensor | None]) -> None:
        """Its gradients arrived (the call itself is the callback: no object more per call through the step)."""
        self.recording._write_grads(self, grad_input, grad_output)


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
        writer: _Writer | None = None,
    ) -> None:
        h5py = _h5py()
        self.path = path
        self.writer = writer
        self.atomic = AtomicFile(path, "Dumper.register()", overwrite=overwrite, partial_name=True)
        self.file: Any = None
        self.disk: QuietWrites | None = None
        self.raw_dcpl: Any = None  # the creation properties of a dataset whose bytes are written by _create_dataset
        try:
            self.atomic.check_target()
            self.disk = QuietWrites(self.atomic.tmp)
            self.file = h5py.File(self.disk, "w", track_order=True, libver=("v110", "latest"))
            self.file.attrs[FORMAT_ATTR] = FORMAT_VERSION
            self.file.attrs["model"] = type(eager_module(model)).__name__
            self.file.attrs.update({"epoch": epoch, "step": step, "values": values, "calls": calls})
            if rank is not None:
                self.file.attrs["rank"] = rank
            self.file.attrs["complete"] = False
            self.file.attrs["status"] = WRITING
            self.file.flush()  # the file reads back as one being written if the process dies from here on
            self._check_disk()
        except BaseException:
            self._close_file()
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
        # keys the compiled code ran without handing a value to (the graph route): a part compiled with the hooks
        # is one whole graph (else it runs eagerly), so these are layers it does not call, nor would an eager run
        self.missing: list[str] = []
        self.eager_why: list[str] = []  # why its compiled parts ran eagerly instead (the graph route)
        self.graph: Graph | None = None  # the step's trace, when function calls are recorded
        # the values a tensor summarised in this step holds (_values_key) -> (a weak reference to their storage, its
        # version, their statistics)
        self.summaries: dict[tuple[Any, ...], tuple[weakref.ref[Any], int, np.ndarray | HostCopy | Pending]] = {}
        self.packed = _Packed() if self.statistics else None
        try:
            self._register(model, grads)
        except BaseException:
            self._remove_hooks()
            self._close_file()
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
        on = Attachment(model, "Dumper.register()", route)
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

                # the slot id these hooks had at an earlier registration: the copy compiled then runs again
                slot = Slot(consume, key, reuse=("dump", id(owner), key, self.statistics, wanted))
                traced_pre, traced_post = _in_graph_hooks(slot, self.statistics, wanted)
                traced.append((owner, slot, traced_post, traced_pre))
                continue
            on.forward_pre(owner, self._pre_hook(key, path, id(owner), class_name, function, is_root), with_kwargs=True)
            # always_call: torch runs the hook when the forward raises too, so a failed call is seen
            on.forward(owner, self._post_hook(id(owner), is_root), with_kwargs=True, always_call=True)
        on.traced(traced)

    def _remove_hooks(self) -> None:
        # what the compiled code ran without (the graph route), read before its hooks go
        attached = [h for h in self.forward_handles if isinstance(h, Attachment)]
        self.missing = sorted({*self.missing, *(key for h in attached for key in h.missing())})
        self.eager_why = list(dict.fromkeys([*self.eager_why, *(why for h in attached for why in h.eager_why())]))
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
        self._close_file()
        self.atomic.discard()
        # HDF5's own text runs over several lines; the errno says it in a few words
        reason = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else one_line(exc)
        return FwdtraceError(
            f"Dumper could not write {str(self.path)!r} ({where}): {reason}; the dump was dropped and its hooks removed"
        )

    def _check_disk(self) -> None:
        """Raise the first write the system refused (HDF5 itself was told it went through)."""
        if self.disk is not None and self.disk.error is not None:
            raise self.disk.error

    def _close_file(self) -> None:
        """Close the HDF5 file and its descriptor, for a file being dropped: errors are not the first to report."""
        with critical(), contextlib.suppress(Exception):
            if self.file is not None:
                self.file.close()
        if self.disk is not None:
            self.disk.close()

    def _write(self, call: _Call, name: str, t: torch.Tensor) -> None:
        where = f"{call.name}/{name}"
        if self.packed is not None:
            try:
                if isinstance(t, tuple):  # summarised inside the compiled graph: (vector, shape, dtype)
                    summary, shape, dtype = t
                    self.packed.add(call.name, name, HostCopy(summary) if summary.is_cuda else to_numpy(summary),
                                    tuple(shape), dtype)
                else:
                    self.packed.add(call.name, name, self._summary(t), tuple(t.shape), dtype_name(t.dtype))
            except Exception as e:
                raise self._fail(e, where) from e
            self.order.append(where)
            return
        try:  # a tensor dump's (a statistics dump's step is packed, above)
            attrs: dict[str, Any] = {}
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
            dataset = self._create_dataset(call.group, name, data)
            if attrs:
                dataset.attrs.update(attrs)

        if self._file_op(create, data.nbytes, where):
            self.order.append(where)

    def _create_dataset(self, group: Any, name: str, arr: np.ndarray) -> Any:
        """``group[name] = arr``, its bytes written straight to the file where HDF5 placed the dataset: through
        h5py's ``fileobj`` driver each write would be copied once more (a tensor dump is mostly raw bytes)."""
        import numpy as np

        if self.raw_dcpl is None:
            h5py = _h5py()
            self.raw_dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            self.raw_dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # placed now, at an offset the file knows
            self.raw_dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # not filled first: every byte is written below
        ds = group.create_dataset(name, shape=arr.shape, dtype=arr.dtype, dcpl=self.raw_dcpl)
        offset = ds.id.get_offset()
        if offset is None or self.disk is None:  # no contiguous storage (a scalar, no values): HDF5 writes it
            if arr.size:
                ds[()] = arr
        else:
            self.disk.write_at(offset, np.ascontiguousarray(arr))
        return ds

    def _summary(self, t: torch.Tensor) -> np.ndarray | HostCopy | Pending:
        """``t``'s statistics vector on its way to the host: computed on ``t``'s device once per value (a layer's
        output is the next layer's input; one gradient is two calls', each hook handed its own tensor object; a
        ``view`` holds its base's values), one host copy each.

        A CUDA tensor's vector is copied without waiting (the step's packed matrix, written at its end or by a
        writer thread, waits for the copy).
        """
        known = _values_key(t)
        if known is not None:
            key, storage, version = known
            found = self.summaries.get(key)
            if found is not None and found[0]() is storage and found[1] == version:
                return found[2]
        vector = summarize_later(t)
        values: np.ndarray | HostCopy | Pending
        if isinstance(vector, Pending):  # a CPU tensor's: its histogram binned with the step's others
            values = vector
        else:  # a CUDA vector's copy starts now, waited for when the step's matrix is written: no sync per tensor
            values = HostCopy(vector) if vector.is_cuda else to_numpy(vector)
        if known is not None:
            self.summaries[key] = (weakref.ref(storage), version, values)
        return values

    def _file_op(self, op: Callable[[], None], nbytes: int, where: str) -> bool:
        """Run ``op`` on the file now, or queue it for the writer thread; False when the queue was full and the
        Dumper drops (counted)."""
        def checked() -> None:
            op()
            self._check_disk()

        if self.writer is None:
            try:
                with critical():  # a Ctrl-C inside HDF5's call of QuietWrites would be a failed write to HDF5
                    checked()
            except Exception as e:
                raise self._fail(e, where) from e
            return True
        if self.writer.error is not None:
            raise self._fail(self.writer.error, self.writer.where)
        return self.writer.put(checked, nbytes, where)

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
                self._file_op(lambda: call.group.attrs.__setitem__("skipped", text), 0, call.name)
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
                    is_root: bool, arguments: str = "") -> _Call:
        """A call's group, with its inputs written and its gradients' hooks on; ``arguments`` its non-tensor
        arguments as JSON (a function call's scalars, fill values, dtypes and shapes), compared with the other
        run's."""
        call_index = self._next_call_index(key)
        name = group_name(self.calls, class_name)
        try:
            call = _Call(name, True)
            attrs = {"module_key": key, "module_path": path, "call_index": call_index, "class_name": class_name,
                     **({"function": function} if function else {}), **({"arguments": arguments} if arguments else {})}
        except Exception as e:
            raise self._fail(e, name) from e

        def create() -> None:
            call.group = self.file.create_group(name, track_order=True)
            call.group.attrs.update(attrs)

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
                                        [] if in_place else inputs, False, _arguments_json(node.attrs))
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

    def _grad_writer(self, call: _Call, is_root: bool) -> _Call:
        # the call itself, not a closure: fewer objects alive through the step per call (see GradCall)
        call.recording, call.is_root = self, is_root
        return call

    def _write_grads(self, call: _Call, grad_input: list[torch.Tensor | None],
                     grad_output: list[torch.Tensor | None]) -> None:
        # The step's backward is the first through each call: a second through the same graph (retain_graph=True,
        # a second loss) would write the call's gradients twice
        if self.closed or call.grads_written:
            return
        call.grads_written = True
        for prefix, grads in (("grad_output", grad_output), ("grad_input", grad_input)) if call.recorded else ():
            for index, g in enumerate(grads):
                if g is not None:
                    self._write(call, f"{prefix}{index}", g)
        if call.is_root:
            self.root_calls_in_backward -= 1
            if self.root_calls_in_backward == 0:
                # done when this backward ends (the root's gradients may come first: inputs that need none), and
                # not if it raises before then
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
                except RuntimeError:  # not inside a backward
                    self._backward_ended()

    def _backward_ended(self) -> None:
        self.backward_done = True

    @property
    def finished(self) -> bool:
        """Whether nothing more will be written: the forward finished and its backward too (where one is expected),
        or the dump was dropped."""
        return self.closed or self.forward_done and not (self.backward_expected and not self.backward_done)

    @property
    def writing(self) -> bool:
        """Whether a writer thread still has this dump's operations queued (closing would wait for them)."""
        return self.writer is not None and not self.writer.idle

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

    def abandon(self) -> None:
        """Drop the dump at once (a Ctrl-C while it closes): hooks off, the writer stopped, the partial file removed."""
        self._remove_hooks()
        self._cancel_grads()
        self.closed = True
        if self.writer is not None:
            self.writer.finish(skip=True)
        self._close_file()
        self.atomic.discard()

    def close(self, exc: BaseException | None = None) -> Path | None:
        """Record the completeness, close the file and rename it; None when it was dropped."""
        try:
            return self._close(exc)
        except FwdtraceError:
            raise
        except BaseException:  # a Ctrl-C: the dump is dropped whole
            with critical():
                self.abandon()
            raise

    def _close(self, exc: BaseException | None) -> Path | None:
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
            with critical():  # HDF5 calls QuietWrites: a Ctrl-C inside would be a failed write to HDF5
                self._finish_file(complete, status, packed)
        except Exception as e:
            self.closed = False
            raise self._fail(e, "closing the file") from e
        self.atomic.commit()
        return self.path

    def _finish_file(self, complete: bool, status: str, packed: _Packed | None) -> None:
        """The completeness attributes and the step's tables written, the file closed."""
        attrs = self.file.attrs
        if self.writer is not None:
            attrs["dropped"] = self.writer.dropped
        attrs["calls"] = self.calls
        attrs["complete"] = complete
        attrs["status"] = status
        if self.missing:
            attrs["not_called"] = "\n".join(self.missing)
        if self.eager_why:
            attrs["compiled"] = f"eager: the compiled parts ran eagerly while dumped, as {'; '.join(self.eager_why)}"
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
        self._check_disk()
        self._close_file()


def _arguments_json(attrs: dict[str, Any]) -> str:
    """A function node's non-tensor arguments (the tracer's ``attrs``: ``args`` and keywords) as compact JSON."""
    if not attrs:
        return ""
    try:
        return json.dumps(attrs, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError):
        return ""


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
    forwards are not; nor is a second backward through the step's graph (``retain_graph=True``).
    The next :meth:`register` first closes the files of the steps that are over (their forward
    and backward ran) and gives them their names, raising what failed in them; a dump of every
    step holds one file open (two while ``background=True``'s writer finishes the step before,
    beside the next). Leaving the ``with`` block (or :meth:`remove`) takes the hooks off and
    closes the rest. Until it is closed a dump has a temporary name.
    A dump records whether its step completed: a forward that raised, a backward that did
    not run, an exception leaving the ``with`` block. An existing file is an error unless
    ``overwrite=True``. A write that fails (a full disk) raises :class:`FwdtraceError`
    naming the file, with every hook removed and the partial file deleted; the process runs
    on, and the next dump is written whole once space returns. Gradients of a
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
        # Refused here, not at register(): each step's file is named inside the folder
        # (an existing folder is a folder, whatever its name)
        exists = Path(directory).exists()
        if (exists and not Path(directory).is_dir()) or (not exists and Path(directory).suffix in (".hdf5", ".h5")):
            what = "an existing file" if exists else "a file name"
            raise FwdtraceError(f"Dumper expected a folder path for its dumps (each step's file is named inside "
                                f"it), got {str(directory)!r}, {what}")
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
        self._written: list[Path] = []
        self._writable = False  # the directory was checked
        self._guard: InterruptGuard | None = None

    def __repr__(self) -> str:
        settings = {"values": self.values, "calls": self.calls, "keys": self.keys, "scope": self.scope,
                    "steps": sorted(self.steps) if isinstance(self.steps, frozenset) else self.steps,
                    "ranks": sorted(self.ranks) if isinstance(self.ranks, frozenset) else self.ranks,
                    "background": self.background or None, "overwrite": self.overwrite or None}
        shown = "".join(f", {k}={v!r}" for k, v in settings.items() if v is not None)
        return f"Dumper({str(self.directory)!r}{shown}, {len(self._written)} written, {len(self._recordings)} open)"

    @property
    def paths(self) -> list[Path]:
        """The dumps this dumper has finished so far."""
        return list(self._written)

    def register(self, model: torch.nn.Module, epoch: int = 0, step: int = 0, grads: bool = True) -> None:
        """Hook ``model`` so its next forward and backward are written to this step's file, after closing the files
        of the steps before that are over (raising what failed in them).

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
        # the steps finished are closed first: a dump of every step holds one file open, not every step's so far;
        # the last one's background writes may go on beside the next step (closing would wait for them)
        finished = [r for r in self._recordings if r.finished]
        self._close(None, finished[:-1] + [r for r in finished[-1:] if not r.writing])
        if isinstance(self.steps, int) and step % self.steps or isinstance(self.steps, frozenset) and step not in self.steps:
            return
        if isinstance(self.ranks, frozenset) and _rank() not in self.ranks:
            return
        rank = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        suffix = f"_rank{rank}" if rank is not None else ""
        path = self.directory / f"{epoch}-epoch_{step}-step{suffix}_dump.hdf5"
        if not self._writable:  # once: a directory that goes later is named by the file's creation below
            self._check_writable()
            self._writable = True
        if any(r.path == path for r in self._recordings):
            raise FwdtraceError(f"Dumper.register() expected a new epoch/step, got {path.name} which is still open")
        try:
            # A Ctrl-C waits: the writer thread and the hooks are never on without the listed recording that
            # takes them off
            with critical():
                writer = _Writer(self.queue_bytes, self.when_full) if self.background else None
                try:
                    self._recordings.append(_Recording(path, model, epoch, step, rank, grads, self.overwrite,
                                                       self.values, self.calls, _Selection(self.keys, self.scope),
                                                       writer))
                except BaseException:
                    if writer is not None:
                        writer.finish()
                    raise
        except OSError as e:
            raise FwdtraceError(f"Dumper.register() could not create {str(path)!r}: {e.strerror or e}") from e

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

    def _close(self, exc: BaseException | None, recordings: list[_Recording] | None = None) -> list[Path]:
        """Close ``recordings`` (all the open ones by default), in the order registered."""
        first_error: FwdtraceError | None = None
        closing = list(self._recordings) if recordings is None else recordings
        try:
            while closing:
                try:
                    path = closing[0].close(exc)
                except FwdtraceError as e:  # close the others all the same
                    first_error = first_error or e
                    path = None
                self._recordings.remove(closing.pop(0))
                if path is not None:
                    self._written.append(path)
        except BaseException:  # Ctrl-C while closing: the dumps not closed yet are dropped, nothing left running
            with critical():
                while closing:
                    recording = closing.pop()
                    self._recordings.remove(recording)
                    recording.abandon()
            raise
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


def _values_key(t: torch.Tensor) -> tuple[tuple[Any, ...], Any, int] | None:
    """``(key, storage, version)``: the key is equal for two tensors that read the same memory in the same flat
    order (a tensor, its ``detach()``, a contiguous ``view`` or ``reshape`` of it); they hold the same values while
    that storage is alive (checked by identity: PyTorch keeps one Python object per storage) and its version
    counter, which views and ``detach()`` share, has not moved. None where there is no such proof: an inference
    tensor (no version counter), a quantized or sparse one, a tensor subclass without storage."""
    if t.is_quantized or t.layout != torch.strided:
        return None
    try:
        version = t._version
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    layout: tuple[Any, ...] = (t.numel(),) if t.is_contiguous() else (tuple(t.shape), t.stride())
    return (t.data_ptr(), t.dtype, t.is_conj(), t.is_neg(), *layout), storage, version
