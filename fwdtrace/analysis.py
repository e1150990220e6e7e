"""One-pass model analysis: parameters, FLOPs, latency and memory, per module key.

The model runs ``max(warmup, 1) + 2 * repeats`` times, always under ``torch.no_grad()``:

1. the first warmup run counts. Every aten op's FLOPs (:mod:`fwdtrace.flops`, torch's
   ``FlopCounterMode`` registry plus the fused CPU attention and LSTM kernels) go to the
   module running it, and every tensor storage created is followed until it is freed, for
   memory. With ``warmup=0`` this run still happens (untimed): a model must run to be counted;
2. the other warmup runs are plain and untimed: first calls (lazy initialisation, allocator
   growth, kernel selection) happen there;
3. each repeat is two runs, one after the other: the plain, unpatched forward timed as a whole
   (``torch.cuda.synchronize`` around each on GPU), and a run with every module timed.
   ``latency_ms`` is the median of the plain runs, ``latency_p90_ms`` their 90th percentile.
   A module's ``latency_ms`` is its mean time over the module-timed runs at or below the
   median forward time (the quieter half: a run slowed by something else on the machine is
   left out whole), and its ``latency_share`` that time over the root's in the same runs. So
   shares taken from the same runs add up: children's shares never exceed their parent's,
   and a leaf's share moves by noise only as the runs do. About 10 repeats give shares that
   agree within a few percent from one call to the next on a quiet machine; fewer give a
   rough picture.

With ``repeats=0`` only the counting run happens, as torchinfo-style summaries do: parameters,
FLOPs, shapes and memory, every time None (the table's Time column shows "-").
On the meta device (``model.to("meta")`` or a model built under ``torch.device("meta")``)
only the counting run happens too, without allocating memory: parameters and FLOPs are exact,
``peak_memory_bytes`` is what the tensors would occupy, every time is None.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._tree import tensors_of
from .errors import FwdtraceError, describe
from .flops import flops_of
from .instrument.attach import Attachment
from .instrument.compiled import compiled_parts, eager_module
from .instrument.keys import closest_names, key2module, key_path
from .machinery import execution_device, model_class
from .memory import StorageTracker
from .registry import qualified_name
from .tracer import active_tracer, around_module_calls, layer_notes
from .units import human_bytes, human_count, human_flops, human_ms

__all__ = ["analyze", "Analysis", "ModuleRow", "run_cli"]

Shape = tuple[int, ...]

MEMORY_CUDA = "torch.cuda.max_memory_allocated"
MEMORY_TRACKED = "tracked tensor storages"
MEMORY_META = "tracked tensor storages (meta: what they would occupy)"
# repeats below this: the table's foot says the Time shares are rough (see the module docstring)
STABLE_REPEATS = 10


@dataclass(frozen=True)
class ModuleRow:
    """One module key's numbers. FLOPs come twice: ``flops`` are the module's own (the ops its
    forward runs outside its child modules), ``flops_total`` include everything it called.
    The ``flops`` of all rows add up to :attr:`Analysis.flops`."""

    key: str
    module_path: str  # as ``named_modules()`` names it; "" for the root
    class_name: str
    calls: int  # forward calls in one run of the model
    input_shapes: tuple[Shape, ...]  # of its first call; () when it did not run
    output_shapes: tuple[Shape, ...]
    params: int  # parameters in the module and its children, each counted once
    flops: int
    flops_total: int
    latency_ms: float | None  # time inside the module per model run, mean of the quieter half of the module-timed runs
    latency_share: float | None  # latency_ms over the root module's
    peak_memory_bytes: int  # tensor memory while it ran: model and inputs included
    # torch's fused kernel the module ran instead of its sub-modules (an eval TransformerEncoderLayer
    # under no_grad: aten._transformer_encoder_layer_fwd), "" when none
    fused_kernel: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_shapes"] = [list(s) for s in self.input_shapes]
        out["output_shapes"] = [list(s) for s in self.output_shapes]
        return out


@dataclass(frozen=True)
class Analysis:
    """What :func:`analyze` found; ``print()`` it for a table, ``to_dict()`` for JSON."""

    model: str
    device: str
    params: int
    trainable_params: int
    flops: int
    latency_ms: float | None
    latency_p90_ms: float | None
    peak_memory_bytes: int
    memory_method: str
    warmup: int
    repeats: int  # timed runs; 0 on the meta device or when timing was skipped
    rows: tuple[ModuleRow, ...]
    # The model's compiled parts ("<root>", "layers.0", ...): they ran eagerly, so every latency is the eager modules'.
    ran_eager: tuple[str, ...] = ()

    def row(self, name: str) -> ModuleRow:
        """The row of one module, by key (see :func:`fwdtrace.module_keys`) or module path:
        ``row("0.Linear")`` and ``row("0")`` are the same row."""
        for r in self.rows:
            if r.key == name:
                return r
        for r in self.rows:
            if r.module_path == name:
                return r
        hint = closest_names(name, [r.key for r in self.rows], [r.module_path for r in self.rows])
        raise FwdtraceError(f"expected a module key or path of {self.model}, got {name!r}; {hint}")

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "rows"}
        out["rows"] = [r.to_dict() for r in self.rows]
        return out

    def __repr__(self) -> str:
        return (
            f"Analysis(model={self.model!r}, params={self.params}, flops={self.flops}, "
            f"latency_ms={self.latency_ms}, peak_memory_bytes={self.peak_memory_bytes}, rows={len(self.rows)})"
        )

    def __str__(self) -> str:
        if self.latency_ms is None:
            timing = f"latency not measured ({'meta device' if self.device == 'meta' else 'repeats=0'})"
        else:
            timing = f"latency {human_ms(self.latency_ms)} median, {human_ms(self.latency_p90_ms)} p90 of {self.repeats}"
            if self.ran_eager:
                timing += f" (eager: its torch.compile'd {', '.join(self.ran_eager)} ran uncompiled)"
        head = [
            f"{self.model} on {self.device}",
            f"params {human_count(self.params)} ({human_count(self.trainable_params)} trainable) | "
            f"{human_flops(self.flops)} | {timing} | peak memory {human_bytes(self.peak_memory_bytes)} "
            f"({self.memory_method})",
        ]
        header = ["Module", "Input", "Output", "Params", "FLOPs", "FLOPs incl.", "Time", "Peak mem"]
        fused = [r for r in self.rows if r.fused_kernel]

        def inside_fused(r: ModuleRow) -> bool:
            return any(r.module_path.startswith(f"{f.module_path}.") or not f.module_path for f in fused if f is not r)

        body = [
            [
                r.key,
                "(fused)" if not r.calls and inside_fused(r) else _shapes_cell(r.input_shapes, r.calls),
                "(fused)" if not r.calls and inside_fused(r) else _shapes_cell(r.output_shapes, r.calls),
                human_count(r.params),
                human_flops(r.flops),
                human_flops(r.flops_total),
                "-" if r.latency_share is None else f"{100 * r.latency_share:.1f}%",
                human_bytes(r.peak_memory_bytes) if r.calls else "-",
            ]
            for r in self.rows
        ]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        left = 3  # text columns; the numbers align right

        def fmt(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

        rule = "-" * len(fmt(header))
        foot = ["FLOPs: the module's own; FLOPs incl.: with what it called; Time: share of the model's forward"]
        if self.latency_ms is not None:  # how much the shares can be trusted goes with them
            foot[0] += (f", from the quieter half of {self.repeats} module-timed run{'s' if self.repeats != 1 else ''}"
                        f"{'' if self.repeats >= STABLE_REPEATS else f' ({STABLE_REPEATS} or more for shares stable within a few percent)'}")
        for kernel in dict.fromkeys(r.fused_kernel for r in fused):
            which = [r.key for r in fused if r.fused_kernel == kernel]
            foot.append(f"(fused): {', '.join(which[:3])}{f' and {len(which) - 3} more' if len(which) > 3 else ''} "
                        f"ran torch's fused kernel {kernel} (eval, no grad), not the modules inside; "
                        f"fwdtrace.trace records those, the path torch takes while a trace runs")
        return "\n".join([*head, rule, fmt(header), rule, *map(fmt, body), rule, *foot])


def _shapes_cell(shapes: tuple[Shape, ...], calls: int, width: int = 30) -> str:
    if not calls:
        return "(not run)"
    text = ", ".join("x".join(map(str, s)) if s else "scalar" for s in shapes) or "-"
    return text if len(text) <= width else text[: width - 3] + "..."


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# -- the counting run -----------------------------------------------------------------------------
class _Counts:
    """What the counting run records per module key: calls, shapes, FLOPs, tensor memory."""

    def __init__(self, keys: list[str], base: list[torch.Tensor]) -> None:
        self.calls = dict.fromkeys(keys, 0)
        self.inputs: dict[str, tuple[Shape, ...]] = {}
        self.outputs: dict[str, tuple[Shape, ...]] = {}
        self.flops = dict.fromkeys(keys, 0)
        self.fused: dict[str, str] = {}  # key -> the fused kernel it ran in place of its sub-modules
        self.flops_total = dict.fromkeys(keys, 0)
        self.peak = dict.fromkeys(keys, 0)
        self.stack: list[str] = []
        # Memory: the model's parameters and buffers and the inputs (``base``) stay alive
        # throughout; storages the ops create are followed until freed.
        self.memory = StorageTracker(base)

    def enter(self, key: str, args: tuple, kwargs: dict) -> None:
        if not self.calls[key]:
            self.inputs[key] = tuple(tuple(t.shape) for t in tensors_of((args, kwargs)))
        self.calls[key] += 1
        self.stack.append(key)
        self.peak[key] = max(self.peak[key], self.memory.live_bytes)

    def leave(self, key: str, out: Any) -> None:
        self.stack.pop()
        if key not in self.outputs:
            self.outputs[key] = tuple(tuple(t.shape) for t in tensors_of(out))

    def add_flops(self, flops: int) -> None:
        if self.stack:
            self.flops[self.stack[-1]] += flops
            for key in set(self.stack):  # a module called inside itself counts once
                self.flops_total[key] += flops

    def add_outputs(self, out: Any) -> None:
        self.memory.add(out)
        for key in self.stack:
            self.peak[key] = max(self.peak[key], self.memory.live_bytes)


# torch's fast paths: one kernel for a whole layer, whose sub-modules then do not run
_FUSED_LAYER_KERNELS = frozenset({torch.ops.aten._transformer_encoder_layer_fwd, torch.ops.aten._native_multi_head_attention})


class _CountingMode(TorchDispatchMode):
    """Counts each aten op's FLOPs and follows its outputs' memory.

    Ops decompose exactly as under ``FlopCounterMode``, so totals agree with it.
    """

    def __init__(self, counts: _Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.prim.device.default:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed  # its parts came through here and were counted
        out = func(*args, **kwargs)
        if func._overloadpacket in _FUSED_LAYER_KERNELS and self.counts.stack:
            self.counts.fused.setdefault(self.counts.stack[-1], str(func._overloadpacket))
        flops = flops_of(func, args, kwargs, out)
        if flops:
            self.counts.add_flops(flops)
        self.counts.add_outputs(out)
        return out


def _packed_numel(module: torch.nn.Module) -> int:
    """The elements of the weights and biases packed out of ``parameters()`` in ``module`` and below.

    A quantized layer (``quantize_dynamic``'s Linear, a quantized Conv) keeps them in a
    ``torch.ScriptObject`` that only its ``_weight_bias()`` unpacks.
    """
    total = 0
    for m in module.modules():
        if isinstance(getattr(m, "_packed_params", None), torch.ScriptObject) and hasattr(m, "_weight_bias"):
            unpacked: tuple[Any, ...] = m._weight_bias()  # type: ignore[operator]
            total += sum(int(t.numel()) for t in unpacked if isinstance(t, torch.Tensor))
    return total


def _device_of(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    hooked = execution_device(model)
    if hooked is not None:
        return hooked
    for t in [*model.parameters(), *model.buffers(), *tensors_of((args, kwargs))]:
        return t.device
    return torch.device("cpu")


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FwdtraceError(f"analyze() expected {name} as an integer >= {minimum}, got {value!r}")
    return value


def analyze(model: torch.nn.Module, *args: Any, warmup: int = 3, repeats: int = 10, **kwargs: Any) -> Analysis:
    """Parameters, FLOPs, latency and memory of ``model(*args, **kwargs)``, per module key.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    >>> a = fwdtrace.analyze(model, torch.ones(2, 8), repeats=3)
    >>> a.params, a.flops, a.row("0.Linear").flops  # 2 x 2*8*4 multiply-adds
    (36, 128, 128)
    >>> print(a)  # doctest: +SKIP

    - ``params`` counts each parameter tensor once, however many modules share it, and the
      weights a quantized layer packs out of ``parameters()`` (``quantize_dynamic``'s Linear);
      ``trainable_params`` those with ``requires_grad``.
    - ``flops`` are forward FLOPs, a multiply-add being 2 FLOPs, as ``FlopCounterMode``
      counts them; attention and LSTM count on CPU too (see :mod:`fwdtrace.flops`).
    - ``rows`` has one :class:`ModuleRow` per key of :func:`fwdtrace.module_keys`, in that
      order (children first, the root last). A row's ``flops`` are its own; summed over all
      rows they give ``flops``. ``flops_total`` includes the modules it called.
    - ``peak_memory_bytes``: on CUDA ``torch.cuda.max_memory_allocated`` over the counting run
      (everything on the device). Elsewhere it is tracked: the bytes of the parameters,
      buffers and inputs plus every tensor storage the forward creates, alive at once, at
      the worst moment. It misses kernels' private workspaces and allocator overhead.

    - An eval ``nn.TransformerEncoderLayer`` or ``nn.MultiheadAttention`` runs torch's fused
      kernel (``aten._transformer_encoder_layer_fwd``): its row's ``fused_kernel`` names it, and
      the modules inside, which did not run, show ``(fused)``. :func:`fwdtrace.trace` records
      those modules: torch leaves its fast path while a trace runs.

    ``repeats=0`` skips timing: one counting run, every latency None. How the runs are spent
    is in the module docstring of :mod:`fwdtrace.analysis`. The model runs in the mode it is
    in: call ``model.eval()`` first, or dropout stays on and BatchNorm updates its running
    statistics on every run. A ``torch.compile``'d model, or one with compiled submodules, runs
    eagerly while analyzed (see :mod:`fwdtrace.instrument.compiled`): ``ran_eager`` names its
    compiled parts, every latency is the eager modules', and afterwards the model runs the
    compiled code it had. An error in the forward is re-raised with
    a note naming the module key, class and input shapes.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"analyze() expected a torch.nn.Module as model, got {describe(model)}")
    warmup = _check_count("warmup", warmup, 0)
    repeats = _check_count("repeats", repeats, 0)
    if active_tracer() is not None:
        raise FwdtraceError("analyze() cannot run while a trace is active; call it before or after the trace")
    compiled = tuple(path or "<root>" for path, _ in compiled_parts(model))
    with Attachment(model, "analyze()"):  # compiled parts run eagerly: counted, timed, and left compiled as they were
        return _analyze(model, args, kwargs, warmup, repeats, compiled)


def _analyze(
    model: torch.nn.Module, args: tuple, kwargs: dict, warmup: int, repeats: int, compiled: tuple[str, ...]
) -> Analysis:
    key2mod = key2module(model)
    keys = list(key2mod)
    module2key = {id(m): k for k, m in key2mod.items()}
    device = _device_of(model, args, kwargs)
    on_meta, on_cuda = device.type == "meta", device.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if on_cuda else (lambda: None)

    base = [*model.parameters(), *model.buffers(), *tensors_of((args, kwargs))]
    counts = _Counts(keys, base)

    def counting_call(call: Callable[..., Any], module: torch.nn.Module, a: tuple, kw: dict) -> Any:
        key = module2key.get(id(module))
        if key is None:  # a module made at run time: its work belongs to the caller
            return call(module, *a, **kw)
        counts.enter(key, a, kw)
        try:
            out = call(module, *a, **kw)
        except BaseException:
            counts.stack.pop()
            raise
        counts.leave(key, out)
        return out

    with torch.no_grad():
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with layer_notes(model), around_module_calls(counting_call), _CountingMode(counts):
            model(*args, **kwargs)
        peak_bytes = counts.memory.peak_bytes
        if on_cuda:
            sync()
            peak_bytes = torch.cuda.max_memory_allocated(device)

        runs: list[dict[str, float]] = []
        times: list[float] = []
        if not on_meta and repeats:  # repeats=0: no timing at all, module times included
            for _ in range(warmup - 1):
                model(*args, **kwargs)
            for _ in range(repeats):  # interleaved, so that both kinds of run see the same machine
                sync()
                start = time.perf_counter()
                model(*args, **kwargs)
                sync()
                times.append((time.perf_counter() - start) * 1000)
                runs.append(_timed_modules(model, module2key, args, kwargs, sync))

    module_ms = _module_ms(runs, keys[-1])
    root_ms = module_ms.get(keys[-1]) or None
    rows = tuple(
        ModuleRow(
            key=k,
            module_path=key_path(k, m),
            class_name=qualified_name(model_class(type(m))),
            calls=counts.calls[k],
            input_shapes=counts.inputs.get(k, ()),
            output_shapes=counts.outputs.get(k, ()),
            params=sum(p.numel() for p in m.parameters()) + _packed_numel(m),
            flops=counts.flops[k],
            flops_total=counts.flops_total[k],
            latency_ms=module_ms.get(k),
            latency_share=module_ms[k] / root_ms if root_ms else None,
            peak_memory_bytes=counts.peak[k],
            fused_kernel=counts.fused.get(k, ""),
        )
        for k, m in key2mod.items()
    )
    params = list(model.parameters())  # each shared parameter once
    return Analysis(
        model=model_class(type(eager_module(model))).__name__,
        device=str(device),
        params=sum(p.numel() for p in params) + _packed_numel(model),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        flops=sum(counts.flops.values()),
        latency_ms=_percentile(times, 50) if times else None,
        latency_p90_ms=_percentile(times, 90) if times else None,
        peak_memory_bytes=peak_bytes,
        memory_method=MEMORY_CUDA if on_cuda else MEMORY_META if on_meta else MEMORY_TRACKED,
        warmup=warmup,
        repeats=len(times),
        rows=rows,
        ran_eager=compiled,
    )


def _module_ms(runs: list[dict[str, float]], root: str) -> dict[str, float]:
    """Milliseconds per key: the mean over the runs whose root time is at most the median's.

    Whole runs are kept or left out, so the times of one key and of its children come from
    the same runs and add up as they did in each run.
    """
    if not runs:
        return {}
    median = _percentile([r[root] for r in runs], 50)
    quiet = [r for r in runs if r[root] <= median]
    return {k: 1000 * sum(r[k] for r in quiet) / len(quiet) for k in runs[0]}


def _timed_modules(
    model: torch.nn.Module, module2key: dict[int, str], args: tuple, kwargs: dict, sync: Callable[[], None]
) -> dict[str, float]:
    """One run with every module timed (seconds per key, all its calls together)."""
    spent = dict.fromkeys(module2key.values(), 0.0)

    def timing_call(call: Callable[..., Any], module: torch.nn.Module, a: tuple, kw: dict) -> Any:
        key = module2key.get(id(module))
        if key is None:
            return call(module, *a, **kw)
        sync()
        start = time.perf_counter()
        try:
            return call(module, *a, **kw)
        finally:
            sync()
            spent[key] += time.perf_counter() - start

    with layer_notes(model), around_module_calls(timing_call):
        model(*args, **kwargs)
    return spent


# -- command line ---------------------------------------------------------------------------------
def run_cli(args: argparse.Namespace) -> int:
    """Run ``fwdtrace analyze``: 0 when the model ran, FwdtraceError (exit 2) on bad input."""
    from .cli import forward_failed, load_factory, make_inputs, parse_device

    device = parse_device(args.device)
    inputs = make_inputs(args, device)
    model = load_factory(args.factory).eval().to(device)
    try:
        result = analyze(model, *inputs, warmup=args.warmup, repeats=args.repeats)
    except FwdtraceError:
        raise
    except Exception as e:
        raise forward_failed(args.factory, inputs, e) from e
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0
