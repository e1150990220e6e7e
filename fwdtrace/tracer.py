"""The tracer: patch layer forwards while active, give tensors stable ids, record a Graph.

Three things are patched, all through one :class:`~fwdtrace.patching.Patcher` that always
restores them: the ``forward`` of every registered layer class (nodes and callbacks),
``torch.nn.Module.__call__`` (which module is running, for paths and error notes), and a
``TorchFunctionMode`` is pushed so torch functions called between layers become nodes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.overrides import _get_current_function_mode as _current_function_mode

from . import registry as _registry
from ._tree import dtype_name, iter_tensors, tensors_of
from .errors import FwdtraceError, add_layer_note, describe, shapes_text
from .graph import Graph
from .keys import module_key
from .names import function_name
from .node import Scope, TensorRef
from .patching import ORIGINAL_ATTR, Patcher, unwrap

__all__ = ["Tracer", "trace", "obj_id", "install", "uninstall"]

_ACTIVE: Tracer | None = None  # the one active tracer; nesting is refused
_INSTALLED: _Installed | None = None

_SIMPLE = (int, float, bool, str, type(None))


def _short_op_name(target: str) -> str:
    return target.rsplit(".", 1)[-1].strip("_") or "op"


def _simple(value: Any) -> Any:
    """A JSON-friendly copy of a simple argument, or None when it is not simple."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float, bool)) for v in value):
        return list(value)
    return None


def _module_attrs(module: torch.nn.Module) -> dict[str, Any]:
    """Display attributes: the hyperparameters torch layers list in ``__constants__``."""
    out: dict[str, Any] = {}
    for name in getattr(type(module), "__constants__", ()):
        value = _simple(getattr(module, name, None))
        if value is not None:
            out[name] = value
    return out


class _Recorder(TorchFunctionMode):
    """Sends torch functions called between layers to the tracer."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = self.tracer
        if t._quiet or not t._stack:  # inside a leaf layer or a callback, or outside the model
            return func(*args, **kwargs)
        return t._on_function(func, args, kwargs)


class Tracer:
    """Record the graph of whatever model runs inside the ``with`` block.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.ReLU())
    >>> with fwdtrace.Tracer() as t:
    ...     y = model(torch.ones(1, 3, 4, 4))
    >>> [n.target for n in t.graph.nodes]
    ['input', 'torch.nn.Conv2d', 'torch.nn.ReLU', 'output']

    The outermost module call's tensor arguments become input nodes and its tensor
    results output nodes. ``pin=True`` keeps a reference to every tensor seen, so
    CPython cannot reuse an ``id()`` during the trace; ``pin=False`` keeps none alive
    and retires an id when its tensor dies, so two tensors are never confused either.
    Everything patched on entry is restored on exit, exceptions included.
    """

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self.graph = Graph()
        self._patcher = Patcher()
        self._mode: _Recorder | None = None
        # tensor identity
        self._next_id = 0
        self._raw2obj: dict[int, int] = {}
        self._pinned: list[torch.Tensor] = []
        self._weakrefs: dict[int, weakref.ref[torch.Tensor]] = {}
        # where we are
        self._stack: list[tuple[torch.nn.Module, Scope]] = []  # module calls, outermost first
        self._forwarding: list[torch.nn.Module] = []  # modules inside a patched forward
        self._quiet = 0  # > 0 inside a leaf, a callback or fwdtrace's own bookkeeping
        self._leaf_call: torch.nn.Module | None = None  # the leaf whose __call__ (hooks included) runs
        self._module2path: dict[int, str] = {}
        self._outside: dict[int, weakref.ref[torch.nn.Module]] = {}  # modules not in the model
        self._forgotten = 0  # paths of such modules that died (numbering goes on past them)
        self._param_names: dict[int, str] = {}
        self._calls: dict[str, int] = {}  # nodes so far per module path (and per op in a module)
        self._scope_calls: dict[str, int] = {}  # calls so far of every module, atomic or not
        self._type2info: dict[type, tuple[bool, list[_registry.Callback]]] = {}
        self._patched: set[type[torch.nn.Module]] = set()  # classes whose forward this tracer has patched

    # -- activation -------------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        global _ACTIVE
        if _ACTIVE is not None:
            raise FwdtraceError(
                "a fwdtrace Tracer is already active: nested tracing is not supported; "
                "trace the inner model inside the outer trace's graph instead"
            )
        _load_plugins()
        try:
            for owner in _registry.REGISTRY.owners():
                self._patch_forward(owner)
            call = unwrap(torch.nn.Module.__call__)
            self._patcher.patch(torch.nn.Module, "__call__", _wrap(call, self._on_call))
            self._mode = _Recorder(self)
            self._mode.__enter__()
        except BaseException:
            self._patcher.restore()
            raise
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = None
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
        finally:
            self._patcher.restore()
            self._pinned.clear()
            self._weakrefs.clear()  # dropping the weakrefs also drops their callbacks
            self._outside.clear()
            self._raw2obj.clear()
            self._stack.clear()
            self._patched.clear()
            self._type2info.clear()

    # -- tensor identity --------------------------------------------------------------------------
    def obj_id(self, t: torch.Tensor) -> int:
        raw = id(t)
        oid = self._raw2obj.get(raw)
        if oid is None:
            oid = self._next_id
            self._next_id += 1
            self._raw2obj[raw] = oid
            if self.pin:
                self._pinned.append(t)
            else:
                self._weakrefs[raw] = weakref.ref(t, functools.partial(self._retire, raw))
        return oid

    def _retire(self, raw: int, ref: weakref.ref[torch.Tensor]) -> None:
        # The tensor died: CPython may give its id() to a new tensor, which must get a new obj_id.
        if self._weakrefs.get(raw) is ref:
            del self._weakrefs[raw]
            del self._raw2obj[raw]

    def _refs(self, tensors: list[torch.Tensor]) -> list[TensorRef]:
        with torch._C.DisableTorchFunction():
            return [
                TensorRef(self.obj_id(t), tuple(t.shape), dtype_name(t.dtype), self._param_names.get(id(t)))
                for t in tensors
            ]

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

    def _patch_forward(self, owner: type[torch.nn.Module]) -> None:
        self._patcher.patch(owner, "forward", _wrap(unwrap(owner.forward), self._on_forward))
        self._patched.add(owner)

    def _on_call(self, call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        atomic = self._info(type(module))[0]  # also patches a layer subclass's forward on first call
        # The hooks of a leaf (a lazy layer's set-up, a probe) are not nodes either: only its forward is.
        leaf_call = atomic and not self._quiet
        root = not self._stack
        if root:
            self._begin_root(module, args, kwargs)
            path = ""
        else:
            path = self._path(module)
        call_index = self._scope_calls.get(path, 0)
        self._scope_calls[path] = call_index + 1
        self._stack.append((module, Scope(path, type(module).__name__, call_index)))
        if leaf_call:
            self._quiet += 1
            self._leaf_call = module
        # Inside a leaf the function recorder steps aside: torch's fused fast paths (nn.MultiheadAttention's)
        # check for an active mode and would fall back to slower, memory-hungrier kernels.
        step_aside = leaf_call and self._mode is not None and _current_function_mode() is self._mode
        try:
            if step_aside:
                with _pop_mode_temporarily():
                    out = call(module, *args, **kwargs)
            else:
                out = call(module, *args, **kwargs)
        except BaseException as e:
            _note_layer(e, path, module, args, kwargs)
            raise
        finally:
            self._stack.pop()
            if leaf_call:
                self._quiet -= 1
                self._leaf_call = None
        if root:
            self._end_root(out)
        return out

    def _begin_root(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        with torch._C.DisableTorchFunction():
            if not self._module2path or self._module2path.get(id(model)) != "":
                self._module2path = {id(m): p for p, m in model.named_modules()}
                self._param_names = {id(t): n for n, t in model.named_parameters()}
                self._param_names.update({id(t): n for n, t in model.named_buffers()})
            for name, t in _named_inputs(model, args, kwargs):
                ref = self._refs([t])[0]
                if ref.obj_id not in self.graph._producer:
                    self.graph.add_node("input", "input", name=name, outputs=[ref])

    def _end_root(self, out: Any) -> None:
        with torch._C.DisableTorchFunction():
            for name, t in iter_tensors(out, "output"):
                self.graph.add_node("output", "output", name=name, inputs=self._refs([t]))

    def _info(self, module_type: type) -> tuple[bool, list[_registry.Callback]]:
        info = self._type2info.get(module_type)
        if info is None:
            reg = _registry.REGISTRY
            info = self._type2info[module_type] = (reg.is_atomic(module_type), reg.callbacks_for(module_type))
            if (info[0] or info[1]) and _registry.has_forward(module_type):
                owner = _registry.forward_owner(module_type)
                if owner not in self._patched and _registry.patchable_forward(owner):
                    # A subclass overriding forward (say, calling super().forward()): patch its
                    # own forward, so that all of it is the one node and callbacks see its output.
                    self._patch_forward(owner)
        return info

    def _on_forward(self, forward: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._forwarding and self._forwarding[-1] is module:
            return forward(module, *args, **kwargs)  # super().forward() of a patched class
        atomic, callbacks = self._info(type(module))
        # not quiet, or quiet only because this very leaf's __call__ is running its hooks
        record = atomic and (not self._quiet or (self._quiet == 1 and self._leaf_call is module))
        if record:
            in_refs = self._refs(tensors_of((args, kwargs)))
            self._quiet += 1  # what runs inside a leaf is not a separate node
        self._forwarding.append(module)
        try:
            out = forward(module, *args, **kwargs)
        finally:
            self._forwarding.pop()
            if record:
                self._quiet -= 1
        if record:
            out_refs = self._refs(tensors_of(out))
        if callbacks:
            out = self._run_callbacks(callbacks, module, args, out)
            if record:
                out_refs = self._refs(tensors_of(out))
        if record:
            path = self._path(module)
            call_index = self._calls.get(path, 0)
            self._calls[path] = call_index + 1
            self.graph.add_node(
                "module",
                _registry.qualified_name(type(module)),
                name=path or type(module).__name__,
                module_path=path,
                call_index=call_index,
                inputs=in_refs,
                outputs=out_refs,
                attrs=_module_attrs(module),
                scope=self._scope(exclude=module),
            )
        return out

    def _run_callbacks(self, callbacks: list[_registry.Callback], module: torch.nn.Module, args: tuple, out: Any) -> Any:
        self._quiet += 1  # a callback's own tensor work is not part of the model's graph
        try:
            return _chain_callbacks(callbacks, module, args, out)
        finally:
            self._quiet -= 1

    def _scope(self, exclude: torch.nn.Module | None = None) -> tuple[Scope, ...]:
        # The root call is not part of any scope: every node is inside it.
        return tuple(s for m, s in self._stack[1:] if m is not exclude)

    # -- torch functions between layers -----------------------------------------------------------
    def _on_function(self, func: Any, args: tuple, kwargs: dict) -> Any:
        module, scope = self._stack[-1]
        try:
            out = func(*args, **kwargs)
        except BaseException as e:
            _note_layer(e, scope.module_path, module, args, kwargs, op=function_name(func))
            raise
        if func is torch.Tensor.__setitem__:
            out_tensors = [args[0]]  # x[i] = y writes into x
        else:
            out_tensors = tensors_of(out)
            if not out_tensors:  # x.shape, x.size(), x.item(): no tensor flows on
                return out
        target = function_name(func)
        in_refs = self._refs(tensors_of((args, kwargs)))
        out_refs = self._refs(out_tensors)
        call_key = f"{scope.module_path}:{target}"
        call_index = self._calls.get(call_key, 0)
        self._calls[call_key] = call_index + 1
        attrs = {}
        simple_args = [_simple(a) for a in args if not isinstance(a, torch.Tensor)]
        if any(a is not None for a in simple_args):
            attrs["args"] = simple_args
        for k, v in kwargs.items():
            sv = _simple(v)
            if sv is not None:
                attrs[k] = sv
        self.graph.add_node(
            "function",
            target,
            name=_short_op_name(target),
            module_path=scope.module_path,
            call_index=call_index,
            inputs=in_refs,
            outputs=out_refs,
            attrs=attrs,
            scope=self._scope(),
        )
        return out


def _note_layer(
    exc: BaseException, path: str, module: torch.nn.Module, args: tuple, kwargs: dict, op: str | None = None
) -> None:
    with torch._C.DisableTorchFunction():
        add_layer_note(exc, module_key(path, module), _registry.qualified_name(type(module)),
                       shapes_text(tensors_of((args, kwargs))), op=op)


@contextlib.contextmanager
def layer_notes(model: torch.nn.Module) -> Iterator[None]:
    """While active, an error raised in any module of ``model`` gets a note naming that layer.

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
    if _ACTIVE is not None:  # the active trace already notes errors
        yield
        return
    module2path = {id(m): p for p, m in model.named_modules()}

    def on_call(call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        try:
            return call(module, *args, **kwargs)
        except BaseException as e:
            _note_layer(e, module2path.get(id(module), f"<{type(module).__name__}>"), module, args, kwargs)
            raise

    with around_module_calls(on_call):
        yield


@contextlib.contextmanager
def around_module_calls(handler: Callable[..., Any]) -> Iterator[None]:
    """Send every module call to ``handler(call, module, args, kwargs)``, on top of what is patched.

    Layer notes and analysis's counting and timing runs stack this way; traces replace it.
    """
    with Patcher() as patcher:
        patcher.patch(torch.nn.Module, "__call__", _wrap(torch.nn.Module.__dict__["__call__"], handler))
        yield


def _wrap(original: Callable[..., Any], handler: Callable[..., Any]) -> Callable[..., Any]:
    """A method that sends each call to ``handler(original, module, args, kwargs)``."""

    def wrapper(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return handler(original, module, args, kwargs)

    functools.update_wrapper(wrapper, original)  # keeps the signature that transformers inspects
    setattr(wrapper, ORIGINAL_ATTR, original)
    return wrapper


def _named_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """Tensor leaves of a call's arguments, named after forward's parameters: ``x``, ``batch.ids``."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        named: list[tuple[str, Any]] = []
        for name, value in bound.arguments.items():
            kind = inspect.signature(model.forward).parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named += list(value.items())
            else:
                named.append((name, value))
    except (TypeError, ValueError):
        named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    return [(path, t) for name, value in named for path, t in iter_tensors(value, name)]


def trace(model: torch.nn.Module, *args: Any, pin: bool = True, **kwargs: Any) -> Graph:
    """Run ``model(*args, **kwargs)`` once and return the graph it ran.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.ReLU(), torch.nn.Conv2d(3, 1, 1))
    >>> g = fwdtrace.trace(model, torch.ones(1, 3, 3, 3))
    >>> [(n.name, [r.obj_id for r in n.inputs], [r.obj_id for r in n.outputs]) for n in g.nodes]
    [('input', [], [0]), ('0', [0], [1]), ('1', [1], [2]), ('2', [2], [3]), ('output', [3], [])]

    Grad mode is left as it is. See :class:`Tracer` for ``pin``.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"trace() expected a torch.nn.Module as model, got {describe(model)}")
    if not tensors_of((args, kwargs)):
        given = ", ".join([describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()])
        raise FwdtraceError(
            "trace() expected at least one tensor among the model's inputs (positional or keyword, "
            f"possibly inside tuples, lists or dicts), got ({given})"
        )
    with Tracer(pin=pin) as tracer:
        model(*args, **kwargs)
    return tracer.graph


def obj_id(obj: torch.Tensor) -> int:
    """The stable id of a tensor in the active trace: 0, 1, 2, ... in first-seen order.

    >>> import torch, fwdtrace
    >>> with fwdtrace.Tracer():
    ...     x = torch.ones(1)
    ...     fwdtrace.obj_id(x), fwdtrace.obj_id(x * 2), fwdtrace.obj_id(x)
    (0, 1, 0)
    """
    if _ACTIVE is None:
        raise FwdtraceError(
            "obj_id() works only while a trace is active (inside fwdtrace.trace(), "
            "`with fwdtrace.Tracer():` or a callback they run); callbacks that install() runs "
            "outside a trace have no ids"
        )
    if not isinstance(obj, torch.Tensor):
        raise FwdtraceError(f"obj_id() expected a torch.Tensor, got {describe(obj)}")
    with torch._C.DisableTorchFunction():
        return _ACTIVE.obj_id(obj)


def _chain_callbacks(callbacks: list[_registry.Callback], module: torch.nn.Module, args: tuple, out: Any) -> Any:
    """Run ``@hook_forward`` callbacks in order; each non-None result replaces the output."""
    for fn in callbacks:
        replaced = fn(module, args, out)
        if replaced is not None:
            out = replaced
    return out


class _Installed:
    """The always-on style: registered callbacks run after every forward, no graph is kept."""

    def __init__(self) -> None:
        self.patcher = Patcher()
        self._forwarding: list[torch.nn.Module] = []

    def on_forward(self, forward: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if _ACTIVE is not None or (self._forwarding and self._forwarding[-1] is module):
            return forward(module, *args, **kwargs)  # a trace runs the callbacks itself
        self._forwarding.append(module)
        try:
            out = forward(module, *args, **kwargs)
        finally:
            self._forwarding.pop()
        return _chain_callbacks(_registry.REGISTRY.callbacks_for(type(module)), module, args, out)


def install() -> None:
    """Patch the forwards of every class with a ``@hook_forward`` callback, until :func:`uninstall`.

    >>> import torch, fwdtrace
    >>> @fwdtrace.hook_forward(torch.nn.Tanh)
    ... def double(module, inputs, output):
    ...     return output * 2
    >>> fwdtrace.install()
    >>> torch.nn.Tanh()(torch.zeros(1) + 100)
    tensor([2.])
    >>> fwdtrace.uninstall(); fwdtrace.remove_hook(double)
    1

    Calling it again picks up callbacks registered since; traces work as usual meanwhile.
    """
    global _INSTALLED
    if _ACTIVE is not None:
        raise FwdtraceError("install() cannot run while a trace is active; call it before or after")
    uninstall()
    _load_plugins()
    session = _Installed()
    try:
        for owner in _registry.REGISTRY.owners(with_atomic=False, with_subclasses=True):
            session.patcher.patch(owner, "forward", _wrap(unwrap(owner.forward), session.on_forward))
    except BaseException:
        session.patcher.restore()
        raise
    _INSTALLED = session


def uninstall() -> None:
    """Undo :func:`install`: every patched forward is the original object again."""
    global _INSTALLED
    if _ACTIVE is not None:
        raise FwdtraceError("uninstall() cannot run while a trace is active; call it after the trace")
    if _INSTALLED is not None:
        _INSTALLED.patcher.restore()
        _INSTALLED = None


def active_tracer() -> Tracer | None:
    """The active tracer, if any (for fwdtrace's own features)."""
    return _ACTIVE


def _load_plugins() -> None:
    from .plugins import load_plugins

    load_plugins()
