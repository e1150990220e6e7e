"""The training-side half of the live service: plain torch hooks that hand sampled tensors to a summariser.

Hooks run in whatever thread calls the model (the training loop, a DataLoader's
pin-memory thread, an evaluation thread). For a sampled call they copy the tensors and
put them on a bounded queue without waiting (a full queue skips the sample and counts
it); one summariser thread computes the statistics (torch releases the GIL there, so a
spare core does the work) and appends them to the arm's ring buffer under a short lock.
HTTP threads take that lock only to copy what they serve. So neither the statistics nor a
slow client hold training up.

Nor break it: every hook body runs guarded (:meth:`Sampler._guard`, ``on_error``), so an error inside one
disarms its key (the API and the page show why) and never reaches the training code.
Parameters and their gradients (kinds ``weight`` and ``weight_grad``) are read at the end of a
backward, every gradient accumulated (:mod:`fwdtrace.instrument.params`' hooks, as the recorder's, queue
autograd's callback), all of a module's in one sample.
Each tensor of a sample belongs to a series (its ``role``: ``output``, ``output[1][0]`` of a
layer returning several, ``bias`` for a parameter) whose histogram bins are
:class:`~fwdtrace.instrument.bins.SteadyBins`, the recorder's: steady while values stay inside, doubled when
one leaves them.
Gradients are taken with tensor hooks on the module's inputs and outputs (:mod:`fwdtrace.instrument.grads`),
not module full backward hooks: those wrap the output in a custom autograd function that makes
any later in-place op on it (``ReLU(inplace=True)`` after the layer) raise in the training loop.
Memory is bounded twice: ``ring`` samples per key and kind, and one ``memory`` budget in
bytes for everything the sampler holds (copies waiting for the summariser, raw values,
an estimate of the summaries), beyond which samples or their raw values are refused and counted.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch

from .._tree import dtype_name, iter_tensors
from ..errors import FwdtraceError, describe
from ..instrument.attach import Attachment
from ..instrument.bins import DEFAULT_BINS, SteadyBins, check_bins_spec
from ..instrument.calls import FunctionSite, ModelCalls
from ..instrument.compiled import CALL_KINDS, compiled_in_place, compiled_parts, eager_module, graph_routable
from ..instrument.ingraph import Slot
from ..instrument.keys import key2module, select_keys
from ..instrument.params import PARAMETER_KINDS, module_parameters, parameter_value
from ..instrument.stats import RunningStats
from ..statistics.rule import as_dict
from .scalars import ScalarLog

__all__ = ["Sampler", "SamplerClosed", "KindRefused", "Arm", "Series", "KINDS", "ROLES"]

# health: no samples, scalars per backward (gradient norm, NaN and Inf counts of the parameters' gradients).
KINDS = ("forward", "grad", *PARAMETER_KINDS, "health")
# The groups of a call's tensors; a group of one tensor is one series named after it, a group of
# several one series per tensor, named by its place (``output[1][0]``). Parameter kinds: one
# series per parameter, named as named_parameters() names it under the module (``weight``).
ROLES = {"forward": ("input", "output"), "grad": ("grad_input", "grad_output")}
SCALAR_WRITE_INTERVAL = 1.0  # seconds between the summariser's passes writing the scalars logged since the last
_SUMMARY_BYTES = 64  # a rough cost of one number of a summary kept as Python objects (a float and its slot)


def distributed_rank() -> tuple[int, int]:
    """``(rank, world_size)`` under an initialised ``torch.distributed``, else ``(0, 1)``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Series:
    """One tensor of an arm's samples over steps (a ``role``): running moments and a histogram on steady bins.

    >>> s = Series(4)
    >>> s.add(torch.tensor([0.0, 0.15, 0.3, 0.45]))["histogram"], s.add(torch.tensor([0.9]))["bin_edges"]
    ([1, 1, 1, 1], [0.0, 0.25, 0.5, 0.75, 1.0])

    Each sample's histogram is on the edges in use when it was added: the same as the running
    histogram's after it, and as a recorder video's frames for the same values.
    """

    def __init__(self, bins: int | tuple[float, ...]) -> None:
        self.lock = threading.Lock()  # the summariser writes, HTTP threads read; never the training thread
        self.moments = RunningStats(histogram=False)
        self.bins = SteadyBins(bins)

    def add(self, t: torch.Tensor) -> dict[str, Any]:
        """Add a numeric tensor; its own statistics and histogram."""
        if t.layout != torch.strided:  # a sparse gradient (Embedding(sparse=True)): the values it stands for
            t = t.to_dense()
        vector = as_dict(self.bins.summarize(t), self.bins.bins)  # once (fwdtrace.statistics): moments and bins
        sample = RunningStats(histogram=False)
        sample.add_summary(vector)
        with self.lock:
            counts, under, over = self.bins.add(t, vector)
            edges = self.bins.edges
            self.moments.merge(sample)
        d = sample.to_dict()
        return {**{name: d[name] for name in ("mean", "std", "min", "max", "nan", "inf", "zero_fraction")},
                "histogram": counts.tolist(), "bin_edges": edges.tolist(), "underflow": under, "overflow": over}

    def to_dict(self) -> dict[str, Any]:
        """Every running statistic, the histogram of all samples on the current edges included."""
        with self.lock:
            d = self.moments.to_dict()
            d.update(histogram=self.bins.counts.tolist(), bin_edges=self.bins.edges.tolist(),
                     underflow=self.bins.underflow, overflow=self.bins.overflow, rebins=self.bins.rebins)
        return d


class Arm:
    """Sampling armed on one module key for one kind: its counters, ring buffer and series."""

    def __init__(self, key: str, kind: str, every: int, count: int | None, raw: bool, ring: int,
                 bins: int | tuple[float, ...], roles: Iterable[str] = ()) -> None:
        self.key, self.kind, self.every, self.count, self.raw = key, kind, every, count, raw
        self.lock = threading.Lock()
        self.calls = 0  # calls seen since arming (backwards for the parameter kinds and health)
        self.taken = 0  # calls sampled
        self.appended = 0  # samples ever put in the buffer; the ring keeps the newest
        self.skipped = 0  # sampled calls not summarised: the summariser's queue was full
        self.over_budget = 0  # samples, or their raw values, refused for the sampler's memory budget
        self.buffer: deque[tuple[dict[str, Any], list[torch.Tensor | None]]] = deque(maxlen=ring)
        self.bins = bins
        self.series = {role: Series(bins) for role in roles}  # more appear as samples name them
        self.handles: list[Any] = []
        self.armed = True
        self.error: str | None = None
        # On a compiled model: "compiled" (its compiled code runs while armed) or "eager" (its compiled parts
        # run their eager modules while armed); None on an eager model.
        self.runs: str | None = None

    @property
    def dropped(self) -> int:
        return self.appended - len(self.buffer)

    def series_of(self, role: str) -> Series:
        with self.lock:
            series = self.series.get(role)
            if series is None:
                series = self.series[role] = Series(self.bins)
            return series

    def roles(self) -> list[str]:
        with self.lock:
            return list(self.series)

    def info(self) -> dict[str, Any]:
        with self.lock:
            return {
                "key": self.key, "kind": self.kind, "every": self.every, "count": self.count, "raw": self.raw,
                "armed": self.armed, "calls": self.calls, "taken": self.taken, "samples": len(self.buffer),
                "dropped": self.dropped, "skipped": self.skipped, "over_budget": self.over_budget,
                "ring": self.buffer.maxlen, "error": self.error, "roles": list(self.series), "runs": self.runs,
            }

    def detach(self) -> None:
        self.armed = False
        while self.handles:
            self.handles.pop().remove()

    def fail(self, where: str, error: BaseException) -> None:
        """Disarm after an error inside one of this arm's hooks, keeping why for the API and the page."""
        with self.lock:
            if self.error is None:
                self.error = f"disarmed: {where} raised {type(error).__name__}: {error}"
        self.detach()


class Sampler:
    """Arms sampling of a model's modules by key (their calls, gradients, parameters), and keeps what it samples.

    >>> import torch
    >>> from fwdtrace.live.sampler import Sampler
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> sampler = Sampler(model)
    >>> sampler.arm("0.Linear", "forward", every=1)
    ['0.Linear']
    >>> _ = model(torch.ones(3, 4)); sampler.samples("0.Linear", "forward")[0]["tensors"][1]["shape"]
    [3, 2]
    >>> sampler.close()

    ``ring`` samples are kept per key and kind, the oldest dropped first (``dropped`` counts
    them); at most ``pending`` sampled calls wait for the summariser, more are skipped
    (``skipped`` counts them). A sample keeps, per tensor, its series (``role``), shape, dtype,
    statistics and a histogram on its series' :class:`~fwdtrace.instrument.bins.SteadyBins` (``bins`` bins
    from a running range, or the edges given; with given edges values outside are counted as
    ``underflow``/``overflow``); raw values only when armed with ``raw=True`` and at most ``raw_cap`` elements. All of it
    stays under ``memory`` bytes: a sampled call whose copies do not fit is skipped, raw
    values that do not fit first release the arm's oldest raw values, then are not kept;
    ``over_budget`` counts both.
    """

    def __init__(self, model: torch.nn.Module, ring: int = 64, bins: int | Iterable[float] = DEFAULT_BINS,
                 raw_cap: int = 1 << 22, pending: int = 32, memory: int = 256 << 20) -> None:
        for name, value in (("ring", ring), ("raw_cap", raw_cap), ("pending", pending), ("memory", memory)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FwdtraceError(f"serve() expected {name} as a positive int, got {value!r}")
        self.model = model
        self.key2module = key2module(model)
        self.calls = ModelCalls(model)  # the function keys Probe and Dumper take, with the same names
        self.ring, self.raw_cap, self.memory = ring, raw_cap, memory
        self.bins = check_bins_spec(bins, "serve()")
        self.rank, self.world_size = distributed_rank()
        self.step = 0  # forwards of the root model, the page's "training step"
        self.arms: dict[tuple[str, str], Arm] = {}
        self._arms_lock = threading.Lock()
        self.closed = False
        self.quiet_thread: int | None = None  # a thread whose forwards are not sampled (the graph's trace)
        # Called as sink(key, kind, sample) in the summariser thread after each sample is kept
        # (fwdtrace.tensorboard.log_sampler adds one); a sink that raises sets the arm's error.
        self.sinks: list[Callable[[str, str, dict[str, Any]], None]] = []
        # Called as scalar_sink(points) in the summariser thread with the scalar points logged since its
        # last pass, [(name, step, time, value)], every SCALAR_WRITE_INTERVAL s and at close(): see add_scalar_sink.
        self.scalar_sinks: list[Callable[[list[tuple[str, int, float, float]]], None]] = []
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=pending)
        self._progress = threading.Condition()
        self._submitted = self._summarised = 0
        self._memory_lock = threading.Lock()
        self.retained = 0  # bytes of the samples in the ring buffers (raw values and the summaries' estimate)
        self.queued = 0  # bytes of the copies waiting for the summariser
        self._worker = threading.Thread(target=self._summarise_queued, name="fwdtrace-live-summaries", daemon=True)
        self._worker.start()
        # The root's hooks (this step count, the graph's first-forward trace) run outside compiled code, in a
        # torch.compile wrapper's call, unless the root itself was compiled in place: then it runs eagerly while served.
        self._root_route = "eager" if compiled_in_place(model) else "none"
        self._root_hooks = Attachment(model, "serve()", self._root_route)
        self._root_hooks.forward_pre(model, self._count_step)
        self.scalars = ScalarLog(lambda: self.step)  # fed by fwdtrace.live.log_scalar and health arms
        self.scalars.register()

    def add_scalar_sink(self, sink: Callable[[list[tuple[str, int, float, float]]], None]) -> None:
        """Hand every scalar point logged from now on to ``sink``, in batches, from the summariser thread only.

        The training thread only appends to a list (:meth:`~fwdtrace.live.scalars.ScalarLog.hold`);
        the summariser, already the one writer of samples, writes them too: the file keeps one writer.
        """
        self.scalars.hold()
        self.scalar_sinks.append(sink)

    def _count_step(self, module: torch.nn.Module, args: tuple) -> None:
        if self.quiet_thread != threading.get_ident():
            self.step += 1

    # -- arming -----------------------------------------------------------------------------------
    def select(self, selector: str) -> list[str]:
        """The keys a key or glob names; an unknown one raises with the closest keys."""
        return list(self._targets(selector))

    def _targets(self, selector: str) -> dict[str, torch.nn.Module | FunctionSite]:
        """The modules and function sites (keys of functions hooked by path) a key or glob names, by key."""
        return select_keys(self.key2module, selector, "serve()", type(eager_module(self.model)).__name__, self.calls)

    def arm(self, selector: str, kind: str, every: int = 1, count: int | None = None, raw: bool = False,
            bins: int | Iterable[float] | None = None) -> list[str]:
        """Sample every ``every``-th call of the selected modules (``count`` samples, then stop); returns the keys.

        Parameter kinds (``weight``, ``weight_grad``) and ``health`` count backwards instead of
        calls; a parameter kind's sample holds every parameter of the module. ``bins`` overrides the sampler's bins for these arms.
        """
        if kind not in KINDS:
            raise FwdtraceError(f"arm() expected kind as one of {', '.join(KINDS)}, got {kind!r}")
        spec = self.bins if bins is None else check_bins_spec(bins, "arm()")
        targets = self._targets(selector)
        keys = list(targets)
        functions = [k for k, t in targets.items() if isinstance(t, FunctionSite)]
        if functions and kind not in ROLES:
            raise KindRefused(f"arm() samples a function key ({functions[0]!r}) by its calls only, as "
                              f"{' or '.join(ROLES)}: a function has no parameters of its own, got kind {kind!r}")
        # Forward arms of a torch.compile'd model copy the call's tensors inside its compiled graph;
        # gradient arms hook autograd around the call, which needs the eager modules.
        # (A root compiled in place runs eagerly while served: see _root_route.)
        in_graph = kind == "forward" and self._root_route == "none" and graph_routable(self.model)
        # Hooks are added under the lock that close() takes: an arm racing stop() either lands
        # before close() (which then removes it) or finds the sampler closed; never in between.
        with self._arms_lock:
            if self.closed:
                raise SamplerClosed("the live service is stopped: nothing can be armed any more")
            for key in keys:
                module = targets[key]  # a FunctionSite takes the hooks a module takes, on its calls
                roles = [name for name, _ in module_parameters(cast("torch.nn.Module", module))] \
                    if kind in PARAMETER_KINDS else []
                arm = Arm(key, kind, every, count, raw, self.ring, spec, roles)
                if compiled_parts(self.model):
                    eager = self._root_route == "eager" or (
                        kind in CALL_KINDS and not (in_graph and isinstance(module, torch.nn.Module)))
                    arm.runs = "eager" if eager else "compiled"
                # Call kinds: in the compiled graph, or with the model's compiled parts run eagerly while armed
                # (a function key's hooks run where its function is called); parameter kinds hook gradient
                # accumulation, which runs outside compiled graphs.
                graph = in_graph and isinstance(module, torch.nn.Module)
                on = Attachment(self.model, "arm()", "graph" if graph else "eager" if kind in CALL_KINDS else "none")
                arm.handles.append(on)
                if graph:  # copies taken in the compiled graph, sampled after it
                    on.copies(cast("torch.nn.Module", module),
                              Slot(self._guard(arm, "the forward hook", self._copies_taken(arm)), key,
                                   reuse=("copies", id(module), True)))
                elif kind == "forward":
                    on.forward(module, self._forward_hook(arm), with_kwargs=True)
                elif kind == "grad":
                    self._grad_hooks(on, arm, module)
                else:
                    parameters = module_parameters(cast("torch.nn.Module", module))
                    at_end = self._health_hook if kind == "health" else self._parameter_hook
                    self._at_backward_end(on, arm, parameters, at_end(arm, parameters))
                old = self.arms.get((key, kind))
                self.arms[(key, kind)] = arm
                if old is not None:
                    old.detach()
                    with old.lock:
                        self._release(old, len(old.buffer))
                        old.buffer.clear()
        return keys

    def disarm(self, selector: str, kind: str | None = None) -> list[str]:
        """Stop sampling the selected keys (one kind, or all); their samples stay readable. Returns the keys."""
        keys = set(self.select(selector))
        done = []
        with self._arms_lock:
            arms = [a for (k, kd), a in self.arms.items() if k in keys and kind in (None, kd) and a.armed]
            for arm in arms:
                arm.detach()
                done.append(arm.key)
        return sorted(set(done))

    def close(self) -> None:
        """Take every hook of this sampler off the model; later arms are refused."""
        with self._arms_lock:
            self.closed = True
            for arm in self.arms.values():
                arm.detach()
        self._root_hooks.remove()
        self.scalars.unregister()
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()

    # -- the hooks (training side) ----------------------------------------------------------------
    def _take(self, arm: Arm) -> int | None:
        """Count a call; its number when it is to be sampled, else None."""
        if not arm.armed or self.quiet_thread == threading.get_ident():
            return None
        with arm.lock:
            arm.calls += 1
            call = arm.calls
            if (call - 1) % arm.every or (arm.count is not None and arm.taken >= arm.count):
                return None
            arm.taken += 1
            return call

    @staticmethod
    def _guard(arm: Arm, where: str, body: Any) -> Any:
        """``body`` wrapped so that an error disarms ``arm`` instead of reaching the training code."""
        def hook(*args: Any) -> None:
            try:
                body(*args)
            except Exception as e:
                arm.fail(where, e)

        return hook

    def _forward_hook(self, arm: Arm) -> Any:
        def hook(module: torch.nn.Module, args: tuple, *rest: Any) -> None:
            # (kwargs, output) when registered with_kwargs; (output,) if a hook dict changed mid-call.
            call = self._take(arm)
            if call is not None:
                kwargs = rest[0] if len(rest) == 2 else {}
                inputs = [*iter_tensors(args, "input"), *iter_tensors(kwargs, "input")]
                self._submit(arm, call, _series("input", inputs) + _series("output", list(iter_tensors(rest[-1], "output"))))

        return self._guard(arm, "the forward hook", hook)

    def _copies_taken(self, arm: Arm) -> Callable[[Any], None]:
        """What a compiled forward arm's copies go to, after the graph: every call counts, sampled ones are queued."""
        def taken(payload: tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]) -> None:
            call = self._take(arm)
            if call is not None:
                inputs, outputs = payload
                # Copied again: a compiled graph may reuse its outputs' memory at its next call (CUDA graphs).
                self._submit(arm, call, _series("input", inputs) + _series("output", outputs))

        return taken

    def _grad_hooks(self, on: Attachment, arm: Arm, module: torch.nn.Module | FunctionSite) -> Any:
        def on_grads(call: int, grad_input: tuple, grad_output: tuple) -> None:
            # grad_input: one slot per positional argument; grad_output: one per tensor of the output.
            self._submit(arm, call, _series("grad_input", [(f"grad_input[{i}]", g) for i, g in enumerate(grad_input)])
                         + _series("grad_output", [(f"grad_output[{i}]", g) for i, g in enumerate(grad_output)]))

        return on.grads(module, on_grads, begin=lambda m: self._take(arm), on_error=lambda e: arm.fail("a gradient hook", e))

    def _at_backward_end(self, on: Attachment, arm: Arm, parameters: list[tuple[str, torch.nn.Parameter]],
                         at_end: Callable[[int], None]) -> list[Any]:
        """Hooks on ``parameters`` that count each backward reaching them and run ``at_end(call)`` at the end of a sampled one.

        Autograd's queued callback runs when the whole backward is done: every gradient of the
        module is accumulated, and the optimizer has not stepped yet. The hooks run on every
        parameter of every backward, so they only compare an id until one starts a backward's
        count; the callback is queued only for a sampled backward (``every=100``: one in 100).
        A backward that raises after its sampling was decided keeps its count and loses its sample.
        """
        counted = [-1]  # the backward (autograd's graph task id) last counted

        def count(graph_task: int) -> None:
            counted[0] = graph_task
            call = self._take(arm)
            if call is not None:
                torch.autograd.Variable._execution_engine.queue_callback(
                    self._guard(arm, f"the {arm.kind} hook", lambda: at_end(call)))

        guarded = self._guard(arm, "a parameter hook", count)

        def hook(name: str, parameter: torch.Tensor) -> None:
            graph_task = torch._C._current_graph_task_id()
            if graph_task != counted[0]:
                guarded(graph_task)

        return on.after_backward(parameters, hook)

    def _parameter_hook(self, arm: Arm, parameters: list[tuple[str, torch.nn.Parameter]]) -> Any:
        """At the end of each ``every``-th backward, one sample of every parameter's value (or ``.grad``).

        One sample a backward, not one per parameter: ``ring`` keeps that many steps and
        ``pending`` that many sampled backwards, however many parameters the module has.
        """
        def at_end(call: int) -> None:
            values = [(name, parameter_value(p, arm.kind)) for name, p in parameters]
            tensors = [(name, 0, value) for name, value in values if value is not None]
            if tensors:
                self._submit(arm, call, tensors)

        return at_end

    def _health_hook(self, arm: Arm, parameters: list[tuple[str, torch.nn.Parameter]]) -> Any:
        """At the end of each ``every``-th backward, the health scalars of the parameters' gradients.

        A NaN in a gradient makes the norm NaN and an Inf makes it Inf (or NaN), so a finite
        norm means there is nothing to count: on the CPU the two counting passes over every
        gradient (ten times the norm's cost on a small transformer) run only when it is not.
        On another device that branch would wait for the device (a sync in the backward), so
        all three stay tensors there, read when a client asks.
        """
        prefix = arm.key + "/"

        def at_end(call: int) -> None:
            grads = [_stored_values(p.grad) for _, p in parameters if p.grad is not None]
            if not grads:
                return
            with torch.no_grad():
                total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double())
                values: tuple[float | torch.Tensor, ...]
                if total.device.type == "cpu":
                    norm = float(total)
                    values = (norm, 0.0, 0.0) if math.isfinite(norm) else (norm, *map(float, _count_nonfinite(grads)))
                else:
                    values = (total, *_count_nonfinite(grads))
            step = self.step
            for name, value in zip(("grad_norm", "grad_nan", "grad_inf"), values, strict=True):
                self.scalars.add(prefix + name, value, step)

        return at_end

    def _submit(self, arm: Arm, call: int, tensors: list[tuple[str, int, torch.Tensor]]) -> None:
        """Copy the tensors (the model may change them in place later) and queue them, never waiting.

        ``tensors``: ``(role, index in its group, tensor)`` for each tensor of the sample.
        """
        size = sum(t.numel() * t.element_size() for _, _, t in tensors)
        with self._memory_lock:
            fits = self.retained + self.queued + size <= self.memory
            if fits:
                self.queued += size
        if not fits:
            with arm.lock:
                arm.over_budget += 1
            return
        with torch.no_grad():
            copies = [(role, index, t.detach().clone()) for role, index, t in tensors]
        with self._progress:
            self._submitted += 1
        try:
            self._queue.put_nowait((arm, call, self.step, time.time(), copies, size))
        except queue.Full:
            with self._progress:
                self._submitted -= 1
            with self._memory_lock:
                self.queued -= size
            with arm.lock:
                arm.skipped += 1

    def _summarise_queued(self) -> None:
        due = time.monotonic() + SCALAR_WRITE_INTERVAL
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None or time.monotonic() >= due:
                self._write_scalars()  # after close()'s sentinel: the last pass, nothing is logged any more
                due = time.monotonic() + SCALAR_WRITE_INTERVAL
            if item is None:
                return
            if not item:
                continue
            size = item[-1]
            try:
                self._record(*item)
            except Exception as e:  # a bug of ours must not end the summariser; the API shows it
                item[0].error = f"{type(e).__name__}: {e}"
            finally:
                del item  # the copies go now, before the next item is awaited
                with self._memory_lock:
                    self.queued -= size
                with self._progress:
                    self._summarised += 1
                    self._progress.notify_all()

    def _write_scalars(self) -> None:
        """Hand the scalar points logged since the last pass to the scalar sinks (in the summariser thread)."""
        if not self.scalar_sinks:
            return
        points = self.scalars.take_unwritten()
        if not points:
            return
        for sink in list(self.scalar_sinks):
            try:
                sink(points)
            except Exception as e:  # a full disk must not end the summariser; /api/scalars shows it
                self.scalars.write_error = f"writing {len(points)} scalar points failed: {type(e).__name__}: {e}"

    def drain(self, timeout: float = 5.0) -> None:
        """Wait (at most ``timeout`` s) until every sample submitted so far is summarised: reads see them."""
        with self._progress:
            target = self._submitted
            self._progress.wait_for(lambda: self._summarised >= target, timeout)

    def _record(self, arm: Arm, call: int, step: int, when: float, tensors: list[tuple[str, int, torch.Tensor]],
                size: int) -> None:
        """Summarise one sampled call and keep it: the one place a sample is made (sinks get it as kept)."""
        summaries: list[dict[str, Any]] = []
        raws: list[torch.Tensor | None] = []
        with torch.no_grad():
            for role, index, t in tensors:
                summary, raw = self._summarise(arm.series_of(role), t, arm.raw)
                summaries.append({"role": role, "index": index, **summary})
                raws.append(raw)
            sample = {"step": step, "call": call, "rank": self.rank, "time": when, "tensors": summaries}
            with arm.lock:
                if self.arms.get((arm.key, arm.kind)) is not arm:  # armed again since: the old samples are gone
                    return
                if not self._make_room(arm, sample, raws, size):
                    arm.over_budget += 1
                    return
                if len(arm.buffer) == arm.buffer.maxlen:
                    self._release(arm, 1)
                sample["seq"] = arm.appended
                arm.buffer.append((sample, raws))
                arm.appended += 1
        for sink in list(self.sinks):
            sink(arm.key, arm.kind, sample)

    def _make_room(self, arm: Arm, sample: dict[str, Any], raws: list[torch.Tensor | None], size: int) -> bool:
        """Reserve the memory ``sample`` keeps (under ``arm.lock``; its copies, ``size`` bytes, are
        about to leave the queue): release this arm's oldest raw values, then refuse the new ones,
        then refuse the sample. False when it does not fit."""
        summary = _summary_bytes(sample)
        raw = sum(_nbytes(r) for r in raws)
        with self._memory_lock:
            over = self.retained + self.queued - size + summary + raw - self.memory
            if raw and over > 0:
                for old_sample, old_raws in arm.buffer:
                    over -= self._drop_raws(old_sample, old_raws, "released for the memory budget")
                    if over <= 0:
                        break
            if raw and over > 0:
                over -= self._drop_raws(sample, raws, "not kept: over the memory budget", count=False)
                arm.over_budget += 1
                raw = 0
            if over > 0:
                return False
            self.retained += summary + raw
            return True

    def _drop_raws(self, sample: dict[str, Any], raws: list[torch.Tensor | None], why: str, count: bool = True) -> int:
        """Forget a sample's raw values (under ``_memory_lock``); the bytes freed."""
        freed = 0
        for i, r in enumerate(raws):
            if r is not None:
                freed += _nbytes(r)
                raws[i] = None
                sample["tensors"][i]["raw"] = False
                sample["tensors"][i]["raw_note"] = why
        if count:
            self.retained -= freed
        return freed

    def _release(self, arm: Arm, n: int) -> None:
        """Give back the memory of ``arm``'s ``n`` oldest samples, about to leave its buffer."""
        with self._memory_lock:
            for i in range(min(n, len(arm.buffer))):
                sample, raws = arm.buffer[i]
                self.retained -= _summary_bytes(sample) + sum(_nbytes(r) for r in raws)

    def _summarise(self, series: Series, t: torch.Tensor, raw: bool) -> tuple[dict[str, Any], torch.Tensor | None]:
        out: dict[str, Any] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "numel": t.numel()}
        numeric = t.numel() > 0 and t.dtype != torch.bool and not t.is_complex()
        if numeric:
            out.update(series.add(t))
        out["numeric"] = numeric
        keep = raw and t.numel() <= self.raw_cap
        out["raw"] = keep
        return out, (t.to("cpu") if keep else None)  # t is already our own copy

    # -- reading (server side) --------------------------------------------------------------------
    def arm_of(self, key: str, kind: str) -> Arm:
        self.drain()
        arm = self.arms.get((key, kind))
        if arm is None:
            raise KeyError((key, kind))
        return arm

    def samples(self, key: str, kind: str, since: int = -1) -> list[dict[str, Any]]:
        """The buffered samples of ``key`` and ``kind`` with ``seq`` above ``since``, oldest first."""
        arm = self.arm_of(key, kind)
        with arm.lock:
            items = [s for s, _ in arm.buffer if s["seq"] > since]
        return items

    def raw(self, key: str, kind: str, sample: int, index: int) -> tuple[dict[str, Any], torch.Tensor | None]:
        """One tensor of one buffered sample (``sample`` indexes the buffer, -1 the newest) and its raw copy."""
        arm = self.arm_of(key, kind)
        with arm.lock:
            summary, raws = arm.buffer[sample]
        return summary["tensors"][index], raws[index]

    def stats(self, key: str, kind: str, role: str) -> dict[str, Any]:
        """The running statistics of one series of an arm since arming; KeyError for a role it has not seen."""
        arm = self.arm_of(key, kind)
        with arm.lock:
            series = arm.series[role]
        return series.to_dict()

    def memory_info(self) -> dict[str, int]:
        with self._memory_lock:
            return {"budget": self.memory, "retained": self.retained, "queued": self.queued}

    def status(self) -> dict[str, Any]:
        self.drain()
        with self._arms_lock:
            arms = list(self.arms.values())
        return {"step": self.step, "rank": self.rank, "world_size": self.world_size, "memory": self.memory_info(),
                "root": next(k for k, m in self.key2module.items() if m is eager_module(self.model)), "arms": [a.info() for a in arms]}

    def __repr__(self) -> str:
        return f"Sampler({type(eager_module(self.model)).__name__}, {sum(a.armed for a in self.arms.values())} armed, step {self.step})"


def _stored_values(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's values for its norm and NaN/Inf counts: a sparse one's stored values (the rest are zeros)."""
    if grad.layout == torch.sparse_coo:
        return grad.coalesce().values()  # duplicates summed first, as the dense gradient has them
    return grad if grad.layout == torch.strided else grad.to_dense()


def _count_nonfinite(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The NaN and the Inf elements of ``grads``, as two 0-d tensors."""
    nan = torch.stack([torch.isnan(g).sum() for g in grads]).sum()
    inf = torch.stack([torch.isinf(g).sum() for g in grads]).sum()
    return nan, inf


def _series(group: str, named: Sequence[tuple[str, torch.Tensor | None]]) -> list[tuple[str, int, torch.Tensor]]:
    """``(role, index, tensor)`` for a group's tensors: one slot is the group's own series, several are named by place."""
    if len(named) == 1:
        named = [(group, named[0][1])]
    return [(role, index, t) for index, (role, t) in enumerate(named) if t is not None]


class KindRefused(FwdtraceError):
    """An arm of a kind its key cannot have (a parameter kind of a function key)."""


class SamplerClosed(FwdtraceError):
    """An arm after :meth:`Sampler.close`."""


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _summary_bytes(sample: dict[str, Any]) -> int:
    return sum(_SUMMARY_BYTES * (24 + 2 * len(t.get("histogram", ()))) for t in sample["tensors"])


def check_positive(name: str, value: Any, optional: bool = False) -> int | None:
    """``value`` as a positive int (None allowed when ``optional``), else a FwdtraceError naming ``name``."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FwdtraceError(f"expected {name} as a positive integer{' or null' if optional else ''}, got {describe(value)} {value!r}")
    return value
