"""The tracer: see every module call and torch function of one forward, give tensors stable ids, record a Graph.

Two things see the model run, both only in the thread that traces:

- a handler on fwdtrace's one dispatch point of module calls (``nn.Module._call_impl``,
  :mod:`fwdtrace.patching`): which module is running (paths, scopes, error notes), a
  ``"module"`` node per call of an atomic layer, with what the call really received and
  returned (the user's own pre-hooks and forward hooks included), and the
  ``@hook_forward`` callbacks;
- a ``TorchFunctionMode`` pushed on this thread's mode stack: torch functions called
  between layers become ``"function"`` nodes;
- a handler on the dispatch point of each function or method registered with
  ``@hook_forward``/``register_atomic`` (the attribute that holds it, patched meanwhile):
  its callbacks, and for an atomic one a ``"function"`` node per call, its inside hidden.

Other threads keep running their forwards untouched, and may trace at the same time.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.overrides import _get_current_function_mode as _current_function_mode
from torch.overrides import _get_current_function_mode_stack as _function_mode_stack

from . import registry as _registry
from ._tree import arguments_text, dtype_name, iter_tensors, tensors_of
from .errors import FwdtraceError, add_layer_note, describe
from .graph import Graph
from .instrument.compiled import EagerRoute, compiled_parts
from .instrument.keys import module_key
from .machinery import Machinery, imported_machinery, model_class, module_tensors, uses_machinery
from .names import function_name
from .node import Scope, TensorRef, new_tuple
from .patching import (
    FunctionHandler,
    InterruptGuard,
    add_call_handler,
    add_function_handler,
    critical,
    guarded_enter,
    guarded_exit,
    remove_call_handler,
)

__all__ = [
    "Tracer", "trace", "obj_id", "install", "uninstall", "layer_notes", "around_module_calls", "around_function_calls",
]

_local = threading.local()  # .tracer: this thread's active Tracer
_INSTALLED: Any = None  # the handle of install()'s handler, for every thread
_INSTALLED_FUNCTIONS: list[Any] = []  # install()'s handles on hooked functions' dispatch points

_SIMPLE = (int, float, bool, str, type(None))
_SIMPLE_TYPES = frozenset(_SIMPLE)
_SETITEM = torch.Tensor.__setitem__
_FUNC2NAMES: dict[Any, tuple[str, str, bool]] = {}  # torch function -> (target, short name, writes in place)
_TYPE2CONSTANTS: dict[type, tuple[str, ...]] = {}


def _writes_in_place(target: str) -> bool:
    """Whether the op writes into its first argument (``add_``, ``__iadd__``), by name."""
    short = target.rsplit(".", 1)[-1]
    return (short.endswith("_") and not short.endswith("__")) or (
        short.startswith("__i") and short.endswith("__") and short not in ("__index__", "__init__", "__invert__", "__int__", "__iter__")
    )


def _short_op_name(target: str) -> str:
    return target.rsplit(".", 1)[-1].strip("_") or "op"


def _simple(value: Any) -> Any:
    """A JSON-friendly copy of a simple argument, or None when it is not simple."""
    if type(value) in _SIMPLE_TYPES or isinstance(value, _SIMPLE):
        return value
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float, bool)) for v in value):
        return list(value)
    return None


def _module_attrs(module: torch.nn.Module) -> dict[str, Any]:
    """Display attributes: the hyperparameters torch layers list in ``__constants__``."""
    out: dict[str, Any] = {}
    names = _TYPE2CONSTANTS.get(type(module))
    if names is None:
        names = _TYPE2CONSTANTS[type(module)] = tuple(getattr(type(module), "__constants__", ()))
    for name in names:
        value = _simple(getattr(module, name, None))
        if value is not None:
            out[name] = value
    return out


class _TypeInfo(NamedTuple):
    """What a trace does with the calls of one module class (cached per trace)."""

    atomic: bool  # one node per call
    callbacks: list[_registry.Callback]  # @hook_forward callbacks, in registration order
    splits: bool  # atomic only by inheritance and overrides forward: an instance with children is not
    scripted: bool  # a torch.jit.ScriptModule: opaque, one node
    compiled: bool  # torch.compile(module): traced through the module it wraps
    target: str  # the node's target: torch.nn.Linear, mypkg.Block, torch.jit.ScriptModule
    fused: str | None  # the fused kernel torch's own forward of this class may run instead of its layers
    nests: bool  # torch's own TransformerEncoder.forward: may run its layers on nested tensors
    class_name: str  # the class scopes name: the model's own (fully_shard's FSDPLinear is a Linear)


_TYPE2INFO: dict[type, _TypeInfo] = {}
_TYPE2INFO_STATE: list[Any] = [None]  # the registry state the cache was filled for


def _cached_type_info(module_type: type) -> _TypeInfo:
    """:func:`_type_info`, kept across traces until the registry changes."""
    reg = _registry.REGISTRY
    state = (reg.version, id(reg.atomic), id(reg.callbacks))
    if _TYPE2INFO_STATE[0] != state:
        _TYPE2INFO.clear()
        _TYPE2INFO_STATE[0] = state
    info = _TYPE2INFO.get(module_type)
    if info is None:
        info = _TYPE2INFO[module_type] = _type_info(module_type)
    return info


def _type_info(module_type: type) -> _TypeInfo:
    reg = _registry.REGISTRY
    scripted = issubclass(module_type, torch.jit.ScriptModule)
    compiled = module_type.__name__ == "OptimizedModule" and module_type.__module__.startswith("torch._dynamo")
    atomic = scripted or reg.is_atomic(module_type)
    # timm's BatchNormAct2d: a BatchNorm2d subclass whose forward also calls its own act and drop
    # children. Registered classes (and torch's own, MultiheadAttention with its out_proj) stay whole.
    splits = (
        atomic and not scripted and module_type not in reg.atomic and _registry.has_forward(module_type)
        and _registry.forward_owner(module_type) not in reg.atomic
    )
    shown = model_class(module_type)
    target = "torch.jit.ScriptModule" if scripted else _registry.qualified_name(shown)
    owner = _registry.forward_owner(module_type) if not atomic and _registry.has_forward(module_type) else None
    return _TypeInfo(atomic, reg.callbacks_for(module_type), splits, scripted, compiled, target,
                     _FUSED_FORWARDS.get(owner) if owner is not None else None, owner is torch.nn.TransformerEncoder,
                     shown.__name__)


# Layers whose own forward runs one fused kernel instead of its sub-layers when torch allows it
# (eval, no gradient wanted, torch.backends.mha's fast path on, no hooks). One condition is that no
# TorchFunctionMode is active, which a trace's recorder is: traced as usual, the layer would take
# its slow path, and the graph would show sub-layers that never run in the user's own forward.
_FUSED_FORWARDS: dict[type, str] = {torch.nn.TransformerEncoderLayer: "torch._transformer_encoder_layer_fwd"}


def _skips_nested(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether torch's ``TransformerEncoder.forward`` would run its layers on nested tensors untraced.

    It does in eval with a ``src_key_padding_mask`` (left-aligned), on the same conditions as
    its layers' fused path, and gives zeros at the padded positions; an active mode rules it
    out, so traced, the layers run on the padded tensors and the padded positions differ.
    """
    src = args[0] if args else kwargs.get("src")
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    padding = args[2] if len(args) > 2 else kwargs.get("src_key_padding_mask")
    layers = getattr(module, "layers", None)
    if not (isinstance(src, torch.Tensor) and isinstance(padding, torch.Tensor) and mask is None and src.dim() == 3
            and not src.is_nested and getattr(module, "use_nested_tensor", False) and layers
            and not layers[0].training and torch.backends.mha.get_fastpath_enabled()
            and not torch.is_autocast_enabled()):
        return False
    if torch.is_grad_enabled() and (src.requires_grad or any(p.requires_grad for p in layers[0].parameters())):
        return False
    with torch._C.DisableTorchFunction():
        return not getattr(module, "mask_check", True) or bool(
            torch._nested_tensor_from_mask_left_aligned(src, padding.logical_not()))


class _SlowPath(BaseException):
    """Raised at the first sub-layer call of a layer tried for its fused path: it took its slow path."""


def _may_fuse(module: torch.nn.Module) -> bool:
    """Whether torch's fused path could run for ``module``, on the conditions that cost nothing to check.

    The layer's forward decides the rest (its inputs' shapes, devices, masks). Hooks anywhere in
    it or global ones rule the fused path out here, as torch does for the layer's own: the layer
    is tried with the recorder stepped aside, and a hook would run twice if the try fell through.
    """
    if module.training or not torch.backends.mha.get_fastpath_enabled() or torch.is_autocast_enabled():
        return False
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks \
            or hooks._global_backward_pre_hooks:
        return False
    for m in module.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
    return not (torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()))


class _WeakTensor(weakref.ref):
    """A weak reference that knows the ``id()`` its tensor had, for the retirement callback."""

    __slots__ = ("raw",)
    raw: int


class _Recorder(TorchFunctionMode):
    """Sends torch functions called between layers to the tracer."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        t = self.tracer
        if t._quiet or not t._stack:  # inside a leaf layer or a callback, or outside the model
            return func(*args, **(kwargs or {}))
        return t._on_function(func, args, kwargs or {})


class Tracer:
    """Record the graph of whatever model runs inside the ``with`` block, in this thread.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.ReLU())
    >>> with fwdtrace.Tracer() as t:
    ...     y = model(torch.ones(1, 3, 4, 4))
    >>> [n.target for n in t.graph.nodes]
    ['input', 'torch.nn.Conv2d', 'torch.nn.ReLU', 'output']

    The outermost module call's tensor arguments become input nodes and its tensor
    results output nodes. ``pin=False`` (the default) keeps no tensor alive and retires an
    id when its tensor dies, so CPython's reuse of ``id()`` can never confuse two tensors;
    ``pin=True`` keeps every tensor seen alive until the trace ends (for callbacks that
    want them). Both give the same graph. ``through`` names layer classes (subclasses
    included) recorded as the calls they make instead of one node, for this trace only;
    ``atomic`` names functions (:class:`~fwdtrace.registry.FunctionTarget`) recorded as one
    node each, for this trace only (a function registered already keeps its registration);
    ``through_functions`` names atomic functions by path recorded as the calls they make, for
    this trace only (their callbacks still run).
    Functions that compute one result by a route the values decide in eager mode and by
    another when exported (:data:`fwdtrace.registry.WHOLE_FUNCTIONS`: torchvision's
    ``batched_nms``) are one node in every trace, so that a graph alone compares with an export.

    Only calls made in the thread that entered the tracer are recorded; other threads run
    as if nothing were traced, and may trace at the same time. Leaving puts everything
    back, exceptions and Ctrl-C included. A torch.jit scripted module is one opaque node;
    a ``torch.compile``'d module is traced through the module it wraps; both are said
    once per trace with a warning that names their paths.
    """

    def __init__(
        self, pin: bool = False, *, through: tuple[type, ...] = (), atomic: tuple[_registry.FunctionTarget, ...] = (),
        through_functions: tuple[str, ...] = (),
    ) -> None:
        if not isinstance(through, tuple) or not all(
            isinstance(c, type) and issubclass(c, torch.nn.Module) for c in through
        ):
            raise FwdtraceError(f"Tracer() expected through as a tuple of torch.nn.Module classes, got {through!r}")
        if not isinstance(atomic, tuple) or not all(isinstance(t, _registry.FunctionTarget) for t in atomic):
            raise FwdtraceError(f"Tracer() expected atomic as a tuple of FunctionTarget, got {atomic!r}")
        self.pin = pin
        self.through = through
        self.atomic = atomic
        self.through_functions = frozenset(through_functions)
        self.graph = Graph()
        self._handle: Any = None
        self._function_handles: list[Any] = []
        self._mode: _Recorder | None = None
        self._entered = False
        self._entered_from: tuple[FrameType, int] | None = None  # the frame whose statement entered it, and where
        # tensor identity
        self._next_id = 0
        self._raw2obj: dict[int, tuple[int, Any, TensorRef | None]] = {}
        # where we are
        self._stack: list[tuple[torch.nn.Module, Scope]] = []  # module calls, outermost first
        self._scopes: list[tuple[Scope, ...]] = [()]  # the scope of a node made at each depth
        self._quiet = 0  # > 0 inside a leaf, a callback or fwdtrace's own bookkeeping
        self._leaf_quiet = 0  # _quiet inside the innermost leaf's own call (its hooks'), 0 outside leaves
        self._machinery_patched = False  # other tools' methods patched (fwdtrace.machinery), once a model uses them
        self._trying_fused = False  # a layer runs with the recorder aside, to see whether torch fuses it
        self._module2path: dict[int, str] = {}
        self._outside: dict[int, weakref.ref[torch.nn.Module]] = {}  # modules not in the model
        self._forgotten = 0  # paths of such modules that died (numbering goes on past them)
        self._param_names: dict[int, tuple[str, torch.Tensor]] = {}
        self._calls: dict[tuple[str, str], int] = {}  # function nodes so far per (module path, op)
        self._scope_calls: dict[str, int] = {}  # calls so far of every module, atomic or not
        self._type2info: dict[type, _TypeInfo] = {}
        self._unseen: dict[str, list[str]] = {}  # what the trace could not see inside, for one warning
        self._alias_root: dict[int, int] = {}  # obj_id of a view -> obj_id of its base
        self._aliases: dict[int, set[int]] = {}  # obj_id of a base -> it and every view of it seen
        self._guard = InterruptGuard(_GUARDED_CODE)
        self._eager_model: torch.nn.Module | None = None  # trace(): its compiled parts run eagerly while traced
        self._route: EagerRoute | None = None

    # -- activation -------------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        entered_from = sys._getframe(1)
        active: Tracer | None = getattr(_local, "tracer", None)
        if active is not None and not active._stale(entered_from):
            raise FwdtraceError(
                "a fwdtrace Tracer is already active: nested tracing is not supported; "
                "trace the inner model inside the outer trace's graph instead"
            )
        if self._entered:
            raise FwdtraceError("a Tracer records one graph: make a new Tracer for another trace")
        _load_plugins()
        if active is not None:
            active._close()
            active._guard.stop()  # its handlers back before this trace's guard wraps them
            warnings.warn("fwdtrace: the previous trace in this thread was left active (its clean-up was "
                          "cut short by an exception fwdtrace could not hold back); it was closed", stacklevel=2)
        try:
            self._guard.start()  # from here on, signals wait while fwdtrace's own code runs
            with critical():
                self._entered = True
                self._entered_from = (entered_from, entered_from.f_lasti)
                _local.tracer = self
                self._handle = add_call_handler(self._on_call)
                self._function_handles = add_function_handlers(
                    self._function_handler, targets=_registry.function_targets(self.atomic))
                self._mode = _Recorder(self)
                self._mode.__enter__()
                if self._eager_model is not None:
                    self._route = EagerRoute(self._eager_model, "trace()")
        except BaseException:
            try:
                self._close()
            finally:
                self._guard.stop()
            raise
        return self

    def _stale(self, entering: FrameType) -> bool:
        """Whether this thread's active tracer can no longer be in use, so a new trace may replace it.

        Its ``__exit__`` never ran (an exception from a signal handler installed after it
        started, or a thread's asynchronous exception, landed on its first instruction) and
        either the very ``with`` statement that entered it runs again (a loop that caught the
        exception), or the :func:`trace` call that entered it has returned. A tracer entered
        any other way (an ``ExitStack``, a fixture) may still be in use: nesting stays an error.
        """
        if self._entered_from is None:
            return not self._entered
        frame, lasti = self._entered_from
        if frame is entering and frame.f_lasti == lasti:
            return True
        if frame.f_code is not trace.__code__:
            return False
        caller: FrameType | None = entering
        while caller is not None:
            if caller is frame:
                return False
            caller = caller.f_back
        return True

    def __exit__(self, *exc: object) -> None:
        try:
            while self._entered:
                self._close()
            self._warn_unseen()
        finally:
            self._guard.stop()  # raises a Ctrl-C held back meanwhile

    def _close(self) -> None:
        with critical():
            if self._route is not None:
                self._route.release()
                self._route = None
            if self._mode is not None:
                _remove_mode(self._mode)
                self._mode = None
            if self._handle is not None:
                remove_call_handler(self._handle)
                self._handle = None
            remove_handlers(self._function_handles)
            if getattr(_local, "tracer", None) is self:
                _local.tracer = None
            self._entered_from = None
            self._outside.clear()
            self._raw2obj.clear()  # unpins, and dropping the weakrefs also drops their callbacks
            self._param_names.clear()
            self._stack.clear()
            self._type2info.clear()
            self._entered = False

    def _warn_unseen(self) -> None:
        unseen, self._unseen = self._unseen, {}
        for what, paths in unseen.items():
            warnings.warn(f"fwdtrace: {what}: {', '.join(repr(p or '<root>') for p in paths)}", stacklevel=3)

    # -- tensor identity --------------------------------------------------------------------------
    def obj_id(self, t: torch.Tensor) -> int:
        return self._entry(t)[0]

    def _entry(self, t: torch.Tensor) -> tuple[int, Any, TensorRef | None]:
        # raw id() -> (obj_id, the tensor itself when pinned else a weakref to it, its last TensorRef)
        raw = id(t)
        entry = self._raw2obj.get(raw)
        if entry is not None:
            held = entry[1]
            if held is t if self.pin else held() is t:  # not a stale entry (a retirement lost to Ctrl-C)
                return entry
        oid = self._next_id
        self._next_id += 1
        if self.pin:
            entry = (oid, t, None)
        else:
            ref = _WeakTensor(t, self._retire)
            ref.raw = raw
            entry = (oid, ref, None)
        self._raw2obj[raw] = entry
        return entry

    def _retire(self, ref: _WeakTensor) -> None:
        # The tensor died: CPython may give its id() to a new tensor, which must get a new obj_id.
        entry = self._raw2obj.get(ref.raw)
        if entry is not None and entry[1] is ref:
            del self._raw2obj[ref.raw]

    def _refs(self, tensors: list[torch.Tensor]) -> list[TensorRef]:
        """The TensorRef of each tensor: made once per tensor and shape, shared by every node that reads it."""
        out = []
        for t in tensors:
            oid, held, ref = self._entry(t)
            if ref is None or ref.shape != t.shape:  # new, or reshaped in place since (unsqueeze_)
                named = self._param_names.get(id(t))
                ref = new_tuple(TensorRef, (oid, tuple(t.shape), dtype_name(t.dtype),
                                            named[0] if named is not None and named[1] is t else None))
                self._raw2obj[id(t)] = (oid, held, ref)
            out.append(ref)
        return out

    # -- module calls -----------------------------------------------------------------------------
    def _path(self, module: torch.nn.Module) -> str:
        path = self._module2path.get(id(module))
        if path is None:  # a module outside the traced model, made or passed in at run time
            number = len(self._module2path) + self._forgotten
            path = self._module2path[id(module)] = f"<{type(module).__name__}@{number}>"
            # One made in forward dies soon and a new one may get its id(): forget the path then.
            raw = id(module)
            self._outside[raw] = weakref.ref(module, functools.partial(self._forget_module, raw))
        return path

    def _forget_module(self, raw: int, ref: weakref.ref[torch.nn.Module]) -> None:
        if self._outside.get(raw) is ref:
            del self._outside[raw]
            if self._module2path.pop(raw, None) is not None:
                self._forgotten += 1

    def _info(self, module_type: type) -> _TypeInfo:
        info = self._type2info.get(module_type)
        if info is None:  # one look-up per class and trace: registering mid-trace takes effect next trace
            info = _cached_type_info(module_type)
            if (info.atomic or info.fused) and self.through and issubclass(module_type, self.through):
                info = info._replace(atomic=False, fused=None)  # opened for this trace only, in this thread only
            self._type2info[module_type] = info
        return info

    def _on_call(self, call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._guard.pending is not None:  # a Ctrl-C held back in fwdtrace's code: now is safe
            self._guard.raise_pending()
        if self._trying_fused:  # a layer tried for its fused path calls a sub-layer: its slow path
            raise _SlowPath
        module_type = type(module)
        info = self._info(module_type)
        if info.compiled:  # torch.compile(module): run the module it wraps, eagerly, as one would read it
            self._say_unseen("torch.compile'd modules were traced through the modules they wrap", module)
            return cast("torch.nn.Module", module._orig_mod)(*args, **kwargs)
        if self._quiet:  # inside a leaf or a callback: not part of the graph, callbacks still run
            out = self._call_noted(call, module, args, kwargs)
            return self._run_callbacks(info.callbacks, module, args, out) if info.callbacks else out
        atomic = info.atomic and not (info.splits and module._modules)
        fused = info.fused is not None and _may_fuse(module)  # one node if torch's fused path runs
        if info.nests and _may_fuse(module) and _skips_nested(module, args, kwargs):
            self._say_unseen(
                "nn.TransformerEncoder runs its layers on nested tensors untraced (eval, with a "
                "src_key_padding_mask), which a trace rules out: traced, they ran on the padded tensors, "
                "and the output's padded positions are not the zeros an untraced run gives", module)
        root = not self._stack
        if root:
            self._begin_root(module, args, kwargs)
        path = "" if root else self._path(module)
        call_index = self._scope_calls.get(path, 0)
        self._scope_calls[path] = call_index + 1
        scope = new_tuple(Scope, (path, info.class_name, call_index))
        if info.scripted:
            self._say_unseen("scripted modules (torch.jit) are opaque, one node each", module)
        in_refs: list[TensorRef] = []
        in_tensors: list[torch.Tensor] = []
        if atomic or fused:
            with torch._C.DisableTorchFunction():
                in_tensors = _call_tensors(args, kwargs)
                in_refs = self._refs(in_tensors)
        if atomic:
            self._quiet += 1
            leaf_quiet, self._leaf_quiet = self._leaf_quiet, self._quiet
        self._stack.append((module, scope))
        self._scopes.append(self._scopes[-1] if root else (*self._scopes[-1], scope))
        try:
            if atomic:
                out = self._call_aside(self._call_noted, call, module, args, kwargs, path)
            else:
                if fused:
                    out = self._call_fused(call, module, args, kwargs, path)
                    fused = out is not _SlowPath
                if not fused:
                    out = self._call_noted(call, module, args, kwargs, path)
        finally:
            self._stack.pop()
            self._scopes.pop()
            if atomic:
                self._quiet -= 1
                self._leaf_quiet = leaf_quiet
        if info.callbacks:
            out = self._run_callbacks(info.callbacks, module, args, out)
        if atomic or fused:
            with torch._C.DisableTorchFunction():
                self._add_sources(in_refs)
                out_tensors = [out] if isinstance(out, torch.Tensor) else tensors_of(out)
                out_refs = self._refs(out_tensors)
                node = self.graph._append(
                    "module",
                    # (a lazy layer became its real class during the call: LazyLinear -> Linear)
                    info.target if type(module) is module_type else _registry.qualified_name(type(module)),
                    path or (info.class_name if type(module) is module_type else type(module).__name__),
                    path,
                    call_index,
                    in_refs,
                    out_refs,
                    {**_module_attrs(module), "fused": info.fused} if fused else
                    _module_attrs(module) if not info.scripted else _scripted_attrs(module),
                    self._scopes[-1],
                )
                # A layer returning its input (eval Dropout, Identity, ReLU(inplace=True)) is its
                # output's producer as before; only what torch functions write reaches the aliases.
                self._track_aliases(node.id, in_tensors, out_tensors, out_refs, False)
        if root:
            self._end_root(out)
        return out

    def _call_fused(
        self, call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict, path: str
    ) -> Any:
        """The layer's call as the user's own forward makes it, or :class:`_SlowPath` where it calls its sub-layers.

        With the recorder stepped aside, torch's forward takes its fused path wherever it would
        untraced. If it calls a sub-layer instead, that call stops the try before it runs
        (nothing before it in torch's forward changes any state), and the caller runs the layer
        again, traced as usual.
        """
        self._trying_fused = True
        try:
            return self._call_aside(self._call_noted, call, module, args, kwargs, path)
        except _SlowPath:
            return _SlowPath
        finally:
            self._trying_fused = False

    def _call_aside(self, run: Callable[..., Any], *args: Any) -> Any:
        """``run(*args)`` with the function recorder stepped aside, for the inside of a leaf.

        Torch's fused fast paths (nn.MultiheadAttention's) check for an active mode and would
        fall back to slower, memory-hungrier kernels. (Inline, not torch's generator-based
        _pop_mode_temporarily: a generator cut short by Ctrl-C would push the mode back
        whenever it is collected, after the trace ended.)
        """
        if self._mode is not None and _current_function_mode() is self._mode:
            torch._C._pop_torch_function_stack()
            try:
                return run(*args)
            finally:
                torch._C._push_on_torch_function_stack(self._mode)
        return run(*args)

    def _call_noted(
        self, call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict, path: str | None = None
    ) -> Any:
        try:
            return call(module, *args, **kwargs)
        except BaseException as e:
            _note_layer(e, self._path(module) if path is None else path, module, args, kwargs)
            raise

    def _say_unseen(self, what: str, module: torch.nn.Module) -> None:
        paths = self._unseen.setdefault(what, [])
        path = "" if not self._stack else self._path(module)
        if path not in paths:
            paths.append(path)

    def _begin_root(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        with torch._C.DisableTorchFunction():
            if self._module2path.get(id(model)) != "":
                self._module2path, self._param_names = _walk(model)
                if not self._machinery_patched:
                    self._patch_machinery(model)
            for name, t in _named_inputs(model, args, kwargs):
                ref = self._refs([t])[0]
                if ref.obj_id not in self.graph._producer:
                    self.graph.add_node("input", "input", name=name, outputs=[ref])

    def _end_root(self, out: Any) -> None:
        with torch._C.DisableTorchFunction():
            # A returned KV cache's tensors are outputs too, marked: an export may leave them out
            plain = {path for path, _ in iter_tensors(out, "output")}
            for name, t in iter_tensors(out, "output", caches=True):
                meta = None if name in plain else {"cache": name.removeprefix("output.")}
                self.graph.add_node("output", "output", name=name, inputs=self._refs([t]), meta=meta)

    def _run_callbacks(self, callbacks: list[Callable[..., Any]], first: Any, second: Any, out: Any) -> Any:
        self._quiet += 1  # a callback's own tensor work is not part of the model's graph
        try:
            return _chain_callbacks(callbacks, first, second, out)
        finally:
            self._quiet -= 1

    # -- hooked functions and methods -------------------------------------------------------------
    def _function_handler(self, target: _registry.FunctionTarget) -> FunctionHandler:
        def on_function(call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            return self._on_hooked_function(target, call, args, kwargs)

        return on_function

    def _on_hooked_function(self, target: _registry.FunctionTarget, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not target.atomic or self._quiet or not self._stack or target.path in self.through_functions:
            # Not one node (or inside a leaf, or outside the model): its torch calls are recorded as they come.
            out = call(*args, **kwargs)
            return self._run_callbacks(target.callbacks, args, kwargs, out) if target.callbacks else out
        with torch._C.DisableTorchFunction():
            in_tensors = _call_tensors(args, kwargs)
            in_refs = self._refs(in_tensors)
        self._quiet += 1  # what it computes inside is hidden, as inside a leaf layer
        try:
            out = self._call_aside(self._call_function_noted, target, call, args, kwargs)
        finally:
            self._quiet -= 1
        if target.callbacks:
            out = self._run_callbacks(target.callbacks, args, kwargs, out)
        with torch._C.DisableTorchFunction():
            self._add_sources(in_refs)
            out_tensors = [out] if isinstance(out, torch.Tensor) else tensors_of(out)
            out_refs = self._refs(out_tensors)
            module_path = self._stack[-1][1].module_path
            node = self.graph._append("function", target.path, target.name, module_path,
                                      self._next_call(module_path, target.path), in_refs, out_refs,
                                      {"atomic": True}, self._scopes[-1])
            self._track_aliases(node.id, in_tensors, out_tensors, out_refs, False)
        return out

    def _call_function_noted(self, target: _registry.FunctionTarget, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        try:
            return call(*args, **kwargs)
        except BaseException as e:
            module, scope = self._stack[-1]
            _note_layer(e, scope.module_path, module, args, kwargs, op=target.path)
            raise

    # -- other tools' machinery around layers (fwdtrace.machinery) ------------------------------------
    def _patch_machinery(self, model: torch.nn.Module) -> None:
        """Patch the tools' methods (:data:`fwdtrace.machinery.MACHINERY`) once a model they serve is traced.

        Only then: patching and restoring them costs as much as a small model's whole trace.
        """
        machinery = imported_machinery()
        if machinery and uses_machinery(model):
            with critical():
                self._machinery_patched = True
                for entry, owner, name in machinery:
                    self._function_handles.append(add_function_handler(owner, name, self._machinery_handler(entry)))

    def _machinery_handler(self, entry: Machinery) -> FunctionHandler:
        def on_machinery(call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            return self._on_machinery(entry, call, args, kwargs)

        return on_machinery

    def _on_machinery(self, entry: Machinery, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run a tool's method hidden; one node for the tensors it put on the layer it serves, if any.

        A node is made for the layer running now (its hooks and wrapped forward run inside its
        call, an atomic layer's too), not inside a callback, another hidden call or a layer tried
        for its fused path (it may run again).
        """
        if not self._stack:
            return call(*args, **kwargs)
        emits = (entry.target is not None and self._quiet == self._leaf_quiet and not self._trying_fused
                 and len(args) > 1 and args[1] is self._stack[-1][0])
        if self._quiet and not emits:  # nothing of it would be recorded anyway
            return call(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            served = entry.served(args) if emits else []
            before = module_tensors(served)
            given = tensors_of((args[2:], kwargs))
        self._quiet += 1
        try:
            out = self._call_aside(lambda: call(*args, **kwargs))
        finally:
            self._quiet -= 1
        with torch._C.DisableTorchFunction():
            self._pass_through(given, tensors_of(out))
            after = module_tensors(served)
            placed = [(key, t) for key, t in after.items() if before.get(key) is not t]
            if placed:
                scope = self._stack[-1][1]
                leaf = self._quiet > 0  # an atomic layer's own call: drawn beside the layer, not inside it
                node_scope = self._scopes[-1][:-1] if leaf and self._scopes[-1] else self._scopes[-1]
                target = cast(str, entry.target)
                self.graph._append("function", target, _short_op_name(target), scope.module_path,
                                   self._next_call(scope.module_path, target), [], self._placed_refs(placed),
                                   entry.attrs(args), node_scope)
        return out

    def _placed_refs(self, placed: list[tuple[tuple[int, str], torch.Tensor]]) -> list[TensorRef]:
        """The refs of tensors a tool put on modules, named as the module's parameters and buffers.

        Their names are known only while the refs are made (each tensor's ref keeps it): the
        name table holds its tensors, and these must be freed when the tool frees them (FSDP's
        reshard), or a traced forward would keep every unsharded parameter alive.
        """
        added = []
        for (module_id, name), t in placed:
            path = self._module2path.get(module_id)
            if path is not None and id(t) not in self._param_names:
                self._param_names[id(t)] = (f"{path}.{name}" if path else name, t)
                added.append(id(t))
        try:
            return self._refs([t for _, t in placed])
        finally:
            for raw in added:
                del self._param_names[raw]

    def _pass_through(self, given: list[torch.Tensor], handed_on: list[torch.Tensor]) -> None:
        """Tensors a tool handed on in place of those it was given (moved, or viewed to hook the
        backward) are the same tensors in the graph: they keep the given ones' ids and producers."""
        if len(given) != len(handed_on):
            return
        for old, new in zip(given, handed_on, strict=True):
            if new is old or new.shape != old.shape or new.dtype != old.dtype:
                continue
            oid, _, ref = self._entry(old)
            if self.pin:
                self._raw2obj[id(new)] = (oid, new, ref)
            else:
                weak = _WeakTensor(new, self._retire)
                weak.raw = id(new)
                self._raw2obj[id(new)] = (oid, weak, ref)

    # -- torch functions between layers -----------------------------------------------------------
    def _on_function(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # Runs inside the mode's handler, where torch has already set the mode aside.
        try:
            out = func(*args, **kwargs)
        except BaseException as e:
            module, scope = self._stack[-1]
            _note_layer(e, scope.module_path, module, args, kwargs, op=function_name(func))
            raise
        if isinstance(out, torch.Tensor):
            out_tensors = [out]
        elif func is _SETITEM:
            out_tensors = [args[0]]  # x[i] = y writes into x
        else:
            out_tensors = _tensors_in(out) if isinstance(out, (tuple, list)) else []
            if not out_tensors:  # x.shape, x.size(), x.item(): no tensor flows on
                return out
        in_tensors = _call_tensors(args, kwargs)
        in_refs = self._refs(in_tensors)
        producer = self.graph._producer
        unmade = [r for r in in_refs if r.obj_id not in producer]
        if len(unmade) == len(in_refs) and _inside_module_init():
            return out  # a layer built in forward initialising its weights: not the model's dataflow
        module_path = self._stack[-1][1].module_path
        names = _FUNC2NAMES.get(func)
        if names is None:
            target = function_name(func)
            names = _FUNC2NAMES[func] = (target, _short_op_name(target), _writes_in_place(target))
        target, short, in_place = names
        if unmade:
            self._add_sources(unmade)
        in_place = in_place or func is _SETITEM or "out" in kwargs
        out_refs = self._refs(out_tensors)
        call_index = self._next_call(module_path, target)
        attrs = {}
        simple_args = [_simple(a) for a in args if not isinstance(a, torch.Tensor)]
        if any(a is not None for a in simple_args):
            attrs["args"] = simple_args
        for k, v in kwargs.items():
            sv = _simple(v)
            if sv is not None:
                attrs[k] = sv
        node = self.graph._append("function", target, short, module_path, call_index, in_refs, out_refs, attrs,
                                  self._scopes[-1])
        self._track_aliases(node.id, in_tensors, out_tensors, out_refs, in_place)
        return out

    # -- aliasing and sources ---------------------------------------------------------------------
    def _track_aliases(
        self, node_id: int, in_tensors: list[torch.Tensor], out_tensors: list[torch.Tensor],
        out_refs: list[TensorRef], in_place: bool,
    ) -> None:
        """Views share memory with their base: a write through one is a write to all of them.

        ``y[:1].zero_()`` writes into ``y``: the node that wrote becomes the producer of the
        base and of every view of it, so a later read of ``y`` is wired to the write. Only
        in-place ops write (``zero_``, ``x[i] = v``, ``+=``, ``out=``): ``x.float()`` or
        ``x.contiguous()`` handing back ``x`` itself write nothing.
        """
        for t, ref in zip(out_tensors, out_refs, strict=True):
            if t._is_view():
                base = t._base
                if base is not None:
                    root = self.obj_id(base)  # the base a view of a view points to is the root
                    self._alias_root[ref.obj_id] = root
                    self._aliases.setdefault(root, {root}).add(ref.obj_id)
            if not in_place:
                continue
            for x in in_tensors:
                if x is t:  # an output that is an input of an in-place op: written
                    root = self._alias_root.get(ref.obj_id, ref.obj_id)
                    for oid in self._aliases.get(root, ()):
                        self.graph._producer[oid] = node_id
                    break

    def _add_sources(self, refs: list[TensorRef]) -> None:
        """A tensor read before anything made it (``torch.Tensor([...])``, ``torch.from_numpy``,
        a plain tensor attribute) gets a source node, as a ``torch.tensor`` call would."""
        producer = self.graph._producer
        for ref in refs:
            if ref.param is None and ref.obj_id not in producer:  # read again later: made once
                module_path = self._stack[-1][1].module_path
                self.graph._append("function", "torch.tensor", "tensor", module_path,
                                   self._next_call(module_path, "torch.tensor"), [], [ref],
                                   {"made": "outside torch functions"}, self._scopes[-1])

    def _next_call(self, module_path: str, target: str) -> int:
        """The call index of the next ``target`` function node in the module at ``module_path``."""
        key = (module_path, target)
        call_index = self._calls.get(key, 0)
        self._calls[key] = call_index + 1
        return call_index


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's function-mode stack, wherever it is (or do nothing)."""
    stack = _function_mode_stack()
    if not any(m is mode for m in stack):
        return  # already gone (an interrupt inside a step-aside)
    above: list[Any] = []
    while _current_function_mode() is not mode:
        above.append(torch._C._pop_torch_function_stack())
    torch._C._pop_torch_function_stack()
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


# Where a Ctrl-C must wait: entering and leaving a trace (fwdtrace.patching's own code always waits).
_GUARDED_CODE = tuple(
    f.__code__ for f in (Tracer.__enter__, Tracer.__exit__, Tracer._close, Tracer._retire, _remove_mode)
)


def _walk(model: torch.nn.Module) -> tuple[dict[int, str], dict[int, tuple[str, torch.Tensor]]]:
    """Every module's path, and every parameter's and buffer's name with the tensor, by ``id()``.

    One pass over ``_modules``, ``_parameters`` and ``_buffers`` giving what ``named_modules()``,
    ``named_parameters()`` and ``named_buffers()`` give (shared ones under their first path),
    several times faster than the three generators. The modules that ``torch.compile`` wraps
    take the path of their wrapper.
    """
    module2path: dict[int, str] = {}
    params: dict[int, tuple[str, torch.Tensor]] = {}
    buffers: dict[int, tuple[str, torch.Tensor]] = {}
    todo: list[tuple[str, torch.nn.Module]] = [("", model)]
    while todo:
        path, module = todo.pop()
        if id(module) in module2path:
            continue
        if "_orig_mod" in path:
            path = path.replace("._orig_mod", "").removeprefix("_orig_mod.").removeprefix("_orig_mod")
        module2path[id(module)] = path
        prefix = f"{path}." if path else ""
        for name, p in module._parameters.items():
            if p is not None and id(p) not in params:
                params[id(p)] = (prefix + name, p)
        for name, b in module._buffers.items():
            if b is not None and id(b) not in buffers:
                buffers[id(b)] = (prefix + name, b)
        children = [(prefix + name, c) for name, c in module._modules.items() if c is not None]
        todo += reversed(children)  # depth first, in order, as named_modules() goes
    params.update(buffers)
    return module2path, params


def _module_paths(model: torch.nn.Module) -> dict[int, str]:
    """Every module's path by ``id()`` (see :func:`_walk`)."""
    return _walk(model)[0]


def _inside_module_init(max_depth: int = 24) -> bool:
    """Whether the caller runs inside an ``nn.Module.__init__`` (a layer built in forward)."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), torch.nn.Module):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _call_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments, one level of lists deep (what torch functions take) or deeper."""
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple, dict)) and a:
            out += _tensors_in(a)
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple, dict)) and v:
                out += _tensors_in(v)
    return out


def _tensors_in(value: list | tuple | dict) -> list[torch.Tensor]:
    """:func:`tensors_of` with a fast path for flat sequences of tensors and numbers (sizes, torch.cat's list)."""
    if isinstance(value, dict):
        return tensors_of(value)
    out = []
    for v in value:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) not in _SIMPLE_TYPES:
            return tensors_of(value)  # nested, or a dataclass: the full walk
    return out


def _scripted_attrs(module: torch.nn.Module) -> dict[str, Any]:
    name = getattr(module, "original_name", None)
    return {"original_name": name} if isinstance(name, str) else {}


def _note_layer(
    exc: BaseException, path: str, module: torch.nn.Module, args: tuple, kwargs: dict, op: str | None = None
) -> None:
    with torch._C.DisableTorchFunction():
        add_layer_note(exc, module_key(path, module), _registry.qualified_name(type(module)),
                       arguments_text(args, kwargs), op=op)


class _GuardedHandlers:
    """Handlers in while a ``with`` block runs, put in and taken off whole whatever Ctrl-C does (see patching.guarded_enter)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._guard: InterruptGuard | None = None

    def _add(self) -> None:
        raise NotImplementedError

    def _remove(self) -> None:
        remove_handlers(self._handles)

    def __enter__(self) -> None:
        self._guard = guarded_enter(_GUARDED_HANDLERS_CODE, self._add, self._remove)

    def __exit__(self, *exc: object) -> None:
        guard, self._guard = self._guard, None
        guarded_exit(guard, self._remove)


_GUARDED_HANDLERS_CODE = (_GuardedHandlers.__enter__.__code__, _GuardedHandlers.__exit__.__code__)


class around_module_calls(_GuardedHandlers):  # noqa: N801 - used as a function: with around_module_calls(...)
    """Send every module call of this thread to ``handler(call, module, args, kwargs)`` while active.

    >>> import torch
    >>> from fwdtrace.tracer import around_module_calls
    >>> names = []
    >>> def count(call, module, args, kwargs):
    ...     names.append(type(module).__name__)
    ...     return call(module, *args, **kwargs)
    >>> with around_module_calls(count):
    ...     _ = torch.nn.Sequential(torch.nn.ReLU())(torch.ones(1))
    >>> names
    ['Sequential', 'ReLU']

    Layer notes, analysis's counting and timing runs and traces all go through the one
    dispatch point of :mod:`fwdtrace.patching`; they may be left in any order.
    """

    def __init__(self, handler: Callable[..., Any]) -> None:
        super().__init__()
        self._handler = handler

    def _add(self) -> None:
        self._handles.append(add_call_handler(self._handler))


def add_function_handlers(
    make_handler: Callable[[_registry.FunctionTarget], FunctionHandler], *, all_threads: bool = False,
    targets: list[_registry.FunctionTarget] | None = None,
) -> list[Any]:
    """Put ``make_handler(target)`` on every attribute of each registered function target (or of ``targets``).

    Returns the handles, for :func:`remove_handlers`. All or none are added: a critical
    section (:class:`fwdtrace.patching.critical`), and a failure half-way removes those added.
    """
    handles: list[Any] = []
    with critical():
        try:
            for target in list(_registry.REGISTRY.functions.values()) if targets is None else targets:
                handler = make_handler(target)
                for owner, name in target.attributes():
                    handles.append(add_function_handler(owner, name, handler, all_threads=all_threads))
        except BaseException:
            remove_handlers(handles)
            raise
    return handles


def remove_handlers(handles: list[Any]) -> None:
    """Remove every handle of :func:`add_function_handlers` (the list empties), in one critical section."""
    with critical():
        while handles:
            remove_call_handler(handles.pop())


class around_function_calls(_GuardedHandlers):  # noqa: N801 - used as a function
    """Send this thread's calls of each function target to ``make_handler(target)`` while active.

    >>> import torch
    >>> from fwdtrace.registry import resolve_any
    >>> from fwdtrace.tracer import around_function_calls
    >>> seen = []
    >>> def note(target):
    ...     return lambda call, args, kwargs: seen.append(target.name) or call(*args, **kwargs)
    >>> with around_function_calls([resolve_any("torch.nn.functional.silu")], note):
    ...     _ = torch.nn.SiLU()(torch.ones(1))
    >>> seen
    ['silu']
    """

    def __init__(
        self, targets: list[_registry.FunctionTarget], make_handler: Callable[[_registry.FunctionTarget], FunctionHandler]
    ) -> None:
        super().__init__()
        self._targets, self._make_handler = targets, make_handler

    def _add(self) -> None:
        self._handles.extend(add_function_handlers(self._make_handler, targets=self._targets))


class layer_notes(around_module_calls):  # noqa: N801 - used as a function: with layer_notes(model)
    """While active, an error raised in any module of ``model`` (in this thread) gets a note naming that layer.

    >>> import torch
    >>> from fwdtrace.tracer import layer_notes
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> try:
    ...     with layer_notes(model):
    ...         model(torch.ones(1, 3))
    ... except RuntimeError as e:
    ...     print(e.__notes__[0][:37])
    fwdtrace: raised in module '0.Linear'

    Traces add the same note by themselves; probes and analysis use this for plain forwards.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        module2path = _module_paths(model)

        def on_call(call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
            try:
                return call(module, *args, **kwargs)
            except BaseException as e:
                _note_layer(e, module2path.get(id(module), f"<{type(module).__name__}>"), module, args, kwargs)
                raise

        super().__init__(on_call)


_SIGNATURES: weakref.WeakKeyDictionary[Any, dict[bool, inspect.Signature | None]] = weakref.WeakKeyDictionary()


def _forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    """``inspect.signature(model.forward)``, computed once per forward function."""
    forward = model.forward
    function = getattr(forward, "__func__", forward)
    bound = hasattr(forward, "__self__")
    try:
        cache = _SIGNATURES.setdefault(function, {})
    except TypeError:  # not weak-referenceable: compute each time
        cache = {}
    if bound not in cache:
        try:
            cache[bound] = inspect.signature(forward)
        except (TypeError, ValueError):
            cache[bound] = None
    return cache[bound]


def _named_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """Tensor leaves of a call's arguments, named after forward's parameters: ``x``, ``batch.ids``."""
    try:
        signature = _forward_signature(model)
        if signature is None:
            raise TypeError("no signature")
        bound = signature.bind(*args, **kwargs)
        named: list[tuple[str, Any]] = []
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named += list(value.items())
            else:
                named.append((name, value))
    except (TypeError, ValueError):
        named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    return [(path, t) for name, value in named for path, t in iter_tensors(value, name)]


def trace(model: torch.nn.Module, *args: Any, pin: bool = False, **kwargs: Any) -> Graph:
    """Run ``model(*args, **kwargs)`` once and return the graph it ran.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.ReLU(), torch.nn.Conv2d(3, 1, 1))
    >>> g = fwdtrace.trace(model, torch.ones(1, 3, 3, 3))
    >>> [(n.name, [r.obj_id for r in n.inputs], [r.obj_id for r in n.outputs]) for n in g.nodes]
    [('input', [], [0]), ('0', [0], [1]), ('1', [1], [2]), ('2', [2], [3]), ('output', [3], [])]

    Grad mode is left as it is. See :class:`Tracer` for ``pin`` and threads. A
    ``torch.compile``'d model is traced through the module it wraps.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"trace() expected a torch.nn.Module as model, got {describe(model)}")
    if not tensors_of((args, kwargs)):
        given = ", ".join([describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()])
        raise FwdtraceError(
            "trace() expected at least one tensor among the model's inputs (positional or keyword, "
            f"possibly inside tuples, lists or dicts), got ({given})"
        )
    compiled = compiled_parts(model)
    tracer = Tracer(pin=pin)
    if compiled:  # they run eagerly while traced: what a user reads, and nothing of the trace enters dynamo's cache
        tracer._eager_model = model
    with tracer:
        if any(how == "module.compile" for _, how in compiled):
            tracer._say_unseen("compiled modules (module.compile()) were traced uncompiled", model)
        model(*args, **kwargs)
    return tracer.graph


def active_tracer() -> Tracer | None:
    """This thread's active tracer, if any (for fwdtrace's own features)."""
    return getattr(_local, "tracer", None)


def obj_id(obj: torch.Tensor) -> int:
    """The stable id of a tensor in this thread's active trace: 0, 1, 2, ... in first-seen order.

    >>> import torch, fwdtrace
    >>> with fwdtrace.Tracer():
    ...     x = torch.ones(1)
    ...     fwdtrace.obj_id(x), fwdtrace.obj_id(x * 2), fwdtrace.obj_id(x)
    (0, 1, 0)
    """
    tracer = active_tracer()
    if tracer is None:
        raise FwdtraceError(
            "obj_id() works only while a trace is active in this thread (inside fwdtrace.trace(), "
            "`with fwdtrace.Tracer():` or a callback they run); callbacks that install() runs "
            "outside a trace have no ids"
        )
    if not isinstance(obj, torch.Tensor):
        raise FwdtraceError(f"obj_id() expected a torch.Tensor, got {describe(obj)}")
    with torch._C.DisableTorchFunction():
        return tracer.obj_id(obj)


def _chain_callbacks(callbacks: list[Callable[..., Any]], first: Any, second: Any, out: Any) -> Any:
    """Run ``@hook_forward`` callbacks in order, ``fn(module, inputs, output)`` for a layer and
    ``fn(inputs, kwargs, output)`` for a function; each non-None result replaces the output."""
    for fn in callbacks:
        replaced = fn(first, second, out)
        if replaced is not None:
            out = replaced
    return out


def _installed_call(call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """install()'s handler, in every thread: callbacks after each call (a trace runs them itself)."""
    out = call(module, *args, **kwargs)
    if getattr(_local, "tracer", None) is not None:
        return out
    callbacks = _cached_type_info(type(module)).callbacks
    return _chain_callbacks(callbacks, module, args, out) if callbacks else out


def _installed_function(target: _registry.FunctionTarget) -> FunctionHandler:
    """install()'s handler of one hooked function, in every thread (a trace runs the callbacks itself)."""

    def on_function(call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        out = call(*args, **kwargs)
        if not target.callbacks or getattr(_local, "tracer", None) is not None:
            return out
        return _chain_callbacks(target.callbacks, args, kwargs, out)

    return on_function


def _install_function(target: _registry.FunctionTarget) -> None:
    """install()'s listener: a function registered while installed is patched at once."""
    with critical():
        _INSTALLED_FUNCTIONS.extend(add_function_handlers(_installed_function, all_threads=True, targets=[target]))


def install() -> None:
    """Run every ``@hook_forward`` callback after each call of its layer class, in every thread, until :func:`uninstall`.

    >>> import torch, fwdtrace
    >>> @fwdtrace.hook_forward(torch.nn.Tanh)
    ... def double(module, inputs, output):
    ...     return output * 2
    >>> fwdtrace.install()
    >>> torch.nn.Tanh()(torch.zeros(1) + 100)
    tensor([2.])
    >>> fwdtrace.uninstall(); fwdtrace.remove_hook(double)
    1

    Callbacks registered later run too; traces work as usual meanwhile. Installing
    twice changes nothing.
    """
    global _INSTALLED
    if active_tracer() is not None:
        raise FwdtraceError("install() cannot run while a trace is active; call it before or after")
    _load_plugins()
    with critical():
        if _INSTALLED is None:
            _INSTALLED = add_call_handler(_installed_call, all_threads=True)
            _INSTALLED_FUNCTIONS.extend(add_function_handlers(_installed_function, all_threads=True))
            _registry.REGISTRY.listeners.append(_install_function)


def uninstall() -> None:
    """Undo :func:`install`: ``nn.Module._call_impl`` is the original object again once nothing else uses it."""
    global _INSTALLED
    if active_tracer() is not None:
        raise FwdtraceError("uninstall() cannot run while a trace is active; call it after the trace")
    with critical():
        if _INSTALLED is not None:
            if _install_function in _registry.REGISTRY.listeners:
                _registry.REGISTRY.listeners.remove(_install_function)
            remove_handlers(_INSTALLED_FUNCTIONS)
            remove_call_handler(_INSTALLED)
            _INSTALLED = None


def _load_plugins() -> None:
    from .plugins import load_plugins

    load_plugins()
