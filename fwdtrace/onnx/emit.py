"""ONNX from one eager run: the ATen calls the model really made, emitted through torchlib.

The route (docs/guide/onnx-emit.md, "How it works", says why): the model runs once,
eagerly, on the real example inputs, under ``make_fx(tracing_mode="real")``, which records
every ATen call into an FX graph while Python control flow follows the values it sees
(``if x.mean() > 0`` takes the branch the example takes, as ``torch.jit.trace`` did).
Functionalization turns in-place ops into their functional forms; the ops onnxscript's
torchlib does not implement are decomposed with the table torch's dynamo exporter uses.
Each FX node is then emitted by torch's own translator through the torchlib registry:
the ONNX ops ``torch.onnx.export(dynamo=True)`` writes before its optimizer, without
``torch.export``'s tracing. Layers with a symbolic (the user's, or fwdtrace's for LSTM
and GRU) are recorded as one ``fwdtrace::layer`` op and emitted as the symbolic says.

Module forward hooks put each call's module path and class into the FX node metadata
(``nn_module_stack``), which the translator writes as the ``pkg.torch.onnx.name_scopes``
and ``pkg.torch.onnx.class_hierarchy`` metadata that :func:`fwdtrace.onnx_graph` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import functools
import itertools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._tree import tensors_of
from ..errors import FwdtraceError, describe, one_line, shapes_text
from ..names import UniqueNames
from ._quiet import quiet
from .export import (
    CALL_KEY,
    _cause_chain,
    _import_onnx,
    _input_names,
    _large,
    _quiet_exporter_logs,
    _write_onnx,
    build_lazy_layers,
)

if TYPE_CHECKING:
    import onnx

__all__ = ["to_onnx", "onnx_symbolic", "remove_onnx_symbolic"]

_UNSET = object()
# The torch.onnx internals this module drives, as they are in torch 2.13.0 (the version the
# Makefile pins): _core._translate_fx_graph, _core.TorchTensor, _registration.ONNXRegistry
# (.from_torchlib, ._register, OnnxDecompMeta), _decomp.create_onnx_friendly_decomposition_table,
# _fx_passes.remove_assertion_nodes, _ir_passes.add_opset_imports, _constants.ONNX_IR_VERSION,
# and fx.passes.type_promotion (TypePromotionTable, ElementwiseTypePromotionRule).
_TORCH_INTERNALS = ("torch.onnx._internal.exporter (_core, _registration, _decomp, _fx_passes, _ir_passes) "
                    "and torch.onnx._internal.fx.passes.type_promotion")


@dataclass(frozen=True)
class _Exporter:
    """The torch.onnx internals, imported once; a clear error when they moved."""

    core: Any
    registration: Any
    decomp: Any
    fx_passes: Any
    ir_passes: Any
    constants: Any
    ir: Any
    type_promotion: Any


@functools.cache
def _exporter() -> _Exporter:
    try:
        from onnxscript import ir
        from torch.onnx._internal.exporter import (
            _constants,
            _core,
            _decomp,
            _fx_passes,
            _ir_passes,
            _registration,
        )
        from torch.onnx._internal.fx.passes import type_promotion

        for owner, name in [(_core, "_translate_fx_graph"), (_core, "TorchTensor"),
                            (_registration.ONNXRegistry, "from_torchlib"), (_registration, "OnnxDecompMeta"),
                            (_decomp, "create_onnx_friendly_decomposition_table"),
                            (_fx_passes, "remove_assertion_nodes"), (_ir_passes, "add_opset_imports"),
                            (type_promotion, "TypePromotionTable"), (type_promotion, "ElementwiseTypePromotionRule")]:
            getattr(owner, name)
    except (ImportError, AttributeError) as e:
        raise FwdtraceError(
            f"to_onnx() needs {_TORCH_INTERNALS} as in torch 2.13, got torch {torch.__version__} where "
            f"{one_line(e)}; install torch==2.13.0, or use fwdtrace.export_onnx()"
        ) from e
    return _Exporter(_core, _registration, _decomp, _fx_passes, _ir_passes, _constants, ir, type_promotion)


@functools.cache
def _torchlib(opset: int) -> tuple[Any, dict[Any, Callable[..., Any]]]:
    """torchlib's registry at ``opset`` and the decomposition table for the ops it lacks (built once)."""
    ex = _exporter()
    with _quiet_exporter_logs():
        registry = ex.registration.ONNXRegistry.from_torchlib(opset)
    _guard_masked_rows(registry)
    implemented = set(ex.decomp.get_onnx_implemented_overloads(registry))
    table = ex.decomp.create_onnx_friendly_decomposition_table(implemented)
    # In-place ops stay whole: the replay under functionalization turns them into the
    # functional ops torchlib has (sigmoid_ into sigmoid), where their decompositions would
    # write them out in prims (sigmoid as neg, exp, add and div).
    return registry, {op: fn for op, fn in table.items() if not op._schema.is_mutable}


def _default_opset() -> int:
    return int(_exporter().constants.TORCHLIB_OPSET)


# Attention as eager torch computes it, where torchlib's differs. A query row whose every key is
# masked (a left-padded decoder's pad positions under the causal mask) is zeros in eager torch (its
# CPU kernel, and _safe_softmax on the math path); torchlib's Softmax over a row of -inf is NaN. And
# the CPU kernel takes fewer key and value heads than query heads (grouped-query attention:
# enable_gqa, transformers' Mistral and Llama without a mask), each shared by a group of query
# heads, where torchlib's MatMul needs as many. The ATen ops eager tracing records for
# F.scaled_dot_product_attention (a bool mask arrives as 0 and -inf):
_EAGER_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu",)


def _guard_masked_rows(registry: Any) -> None:
    """Make torchlib's attention compute what eager's does: grouped key and value heads, fully masked rows."""
    ex = _exporter()
    for name in _EAGER_ATTENTION:
        target = getattr(torch.ops.aten, name).default
        decomps = registry.get_decomps(target)
        if decomps:
            registry._register(target, ex.registration.OnnxDecompMeta(
                onnx_function=functools.partial(_emit_eager_attention, decomps[0].onnx_function),
                fx_target=target, signature=None, is_custom=True, skip_signature_inference=True))


def _emit_eager_attention(attention: Any, *args: Any, **kwargs: Any) -> Any:
    """torchlib's ``attention`` on each query head's key and value head, its output zero where the mask
    leaves a query row no key."""
    from onnxscript import ir

    op = _opset()
    query, key, value, *rest_args = args
    heads, groups = query.shape[-3] if query.shape else None, key.shape[-3] if key.shape else None
    if isinstance(heads, int) and isinstance(groups, int) and heads != groups:
        key, value = (_repeat_heads(op, t, heads // groups) for t in (key, value))
    out = attention(query, key, value, *rest_args, **kwargs)
    mask = kwargs.get("attn_mask")  # keyword-only in the op's schema
    if mask is None:
        return out
    result, *rest = out
    # the mask is added to the scores: a row whose largest entry is -inf attends to nothing
    no_key = op.Equal(op.ReduceMax(mask, [-1], keepdims=1), op.Constant(value=ir.tensor(float("-inf"), dtype=mask.dtype)))
    return (op.Where(no_key, op.Constant(value=ir.tensor(0.0, dtype=query.dtype)), result), *rest)


def _repeat_heads(op: Any, t: Any, times: int) -> Any:
    """``t`` (batch..., heads, length, dim) with each head repeated ``times`` in place: ``repeat_interleave`` on heads."""
    from onnxscript import ir

    *batch, heads, length, dim = (int(d) for d in t.shape)
    ints = lambda v: op.Constant(value=ir.tensor(v, dtype=ir.DataType.INT64))  # noqa: E731
    grouped = op.Expand(op.Unsqueeze(t, ints([-3])), ints([*batch, heads, times, length, dim]))
    out = op.Reshape(grouped, ints([*batch, heads * times, length, dim]))
    out.shape, out.type = ir.Shape([*batch, heads * times, length, dim]), t.type  # torchlib's attention reads them
    return out


# -- what torchlib does not cover: symbolics the user registers -----------------------------------
SymbolicFn = Callable[..., Any]
# target name -> the user's function: a layer class ("mypkg.MyLayer") or a torch op ("mylib.twice")
_SYMBOLICS: dict[str, SymbolicFn] = {}


def _softplus(op: Any, x: Any, beta: float = 1.0, threshold: float = 20.0) -> Any:
    """``softplus`` as torch.onnx writes it: ``Where(x > threshold, x, Softplus(x))``, scaled only when beta is not 1.

    torchlib scales by ``beta`` even when it is 1 (a Mul and a Div by one), which the dynamo
    exporter's optimizer then removes; without that optimizer, the emission would show two
    ops the trace does not have.
    """
    scaled = x if beta == 1.0 else op.Mul(x, op.CastLike(op.Constant(value_float=float(beta)), x))
    soft = op.Softplus(scaled)
    if beta != 1.0:
        soft = op.Div(soft, op.CastLike(op.Constant(value_float=float(beta)), x))
    return op.Where(op.Greater(scaled, op.CastLike(op.Constant(value_float=float(threshold)), x)), x, soft)


_SYMBOLICS["aten.softplus"] = _softplus  # built in; a user's registration replaces it


def onnx_symbolic(target: Any) -> Callable[[SymbolicFn], SymbolicFn]:
    """Emit a layer class or a torch op as the ONNX ops the decorated function gives, in :func:`to_onnx`.

    >>> import torch, fwdtrace
    >>> class Swish(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * torch.sigmoid(x)
    >>> @fwdtrace.onnx_symbolic(Swish)
    ... def swish(op, x):
    ...     return op.Mul(x, op.Sigmoid(x))
    >>> proto = fwdtrace.to_onnx(torch.nn.Sequential(Swish()), torch.ones(2))
    >>> [n.op_type for n in proto.graph.node]
    ['Sigmoid', 'Mul']
    >>> fwdtrace.remove_onnx_symbolic(Swish)
    True

    ``target`` is a layer class, or its qualified name (``"mypkg.MyLayer"``; subclasses that
    run its ``forward`` are included), or a torch op: ``torch.ops.mylib.twice``, an overload
    of it, or ``"mylib.twice"``. The function gets ``op``, an onnxscript opset (``op.Mul``,
    ``op.Gemm``, ... at opset 18), then:

    - for a layer, the ONNX values of the tensors its ``forward`` was given, in order, and
      its parameters and buffers by their names in the layer as keywords
      (``fn(op, x, *, weight, bias)``); the layer's other arguments stay as the trace saw
      them;
    - for an op, its arguments as torch's exporter hands them to torchlib: ONNX values for
      tensors, Python values for the rest (``fn(op, x, alpha=1.0)``).

    It returns one value or a tuple of values, in the order the layer or op returns its
    tensors. An onnxscript function (``@onnxscript.script()``) is also accepted and called
    without ``op``. A later registration for the same target replaces the earlier one.
    """
    name = _symbolic_name(target)

    def decorate(fn: SymbolicFn) -> SymbolicFn:
        if not callable(fn):
            raise FwdtraceError(f"@onnx_symbolic({target!r}) expected a function, got {describe(fn)}")
        _SYMBOLICS[name] = fn
        return fn

    return decorate


def remove_onnx_symbolic(target: Any) -> bool:
    """Forget the symbolic registered for ``target``; True if there was one.

    >>> import fwdtrace
    >>> fwdtrace.remove_onnx_symbolic("mypkg.NeverRegistered")
    False
    """
    return _SYMBOLICS.pop(_symbolic_name(target), None) is not None


def _symbolic_name(target: Any) -> str:
    """``mypkg.MyLayer`` for a layer class, ``mylib.twice`` for a torch op, its overload or ``mylib::twice``."""
    from ..registry import qualified_name

    if isinstance(target, type) and issubclass(target, torch.nn.Module):
        return qualified_name(target)
    if isinstance(target, torch._ops.OpOverload):
        return _op_name(target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    if isinstance(target, str):
        name = target.replace("::", ".").removesuffix(".default")
        if name and all(p.isidentifier() for p in name.split(".")) and "." in name:
            return name
    raise FwdtraceError(
        "onnx_symbolic() expected a torch.nn.Module subclass, a torch op (torch.ops.mylib.twice) or a dotted "
        f"name ('mypkg.MyLayer', 'mylib.twice'), got {target!r} ({describe(target)})"
    )


def _op_name(op: Any) -> str:
    """``mylib.twice`` for ``torch.ops.mylib.twice.default``, ``aten.add.Tensor`` for another overload."""
    return str(op.name()).replace("::", ".")


def _op_symbolic(op: Any) -> SymbolicFn | None:
    """The symbolic registered for this overload, or for all of the op's overloads."""
    return _SYMBOLICS.get(_op_name(op)) or _SYMBOLICS.get(op.overloadpacket._qualified_op_name.replace("::", "."))


def _module_symbolic(cls: type) -> SymbolicFn | _BuiltinLayer | None:
    """The symbolic of ``cls`` or of the nearest ancestor whose ``forward`` it runs; a built-in one if none."""
    from ..registry import forward_owner, qualified_name

    try:
        owner = forward_owner(cls)
    except FwdtraceError:
        return None
    for klass in cls.__mro__:
        fn = _SYMBOLICS.get(qualified_name(klass))
        if fn is not None:
            return fn if issubclass(klass, owner) else None
    return _BUILTIN_LAYERS.get(owner)


@dataclass(frozen=True)
class _BuiltinLayer:
    """fwdtrace's own symbolic for a layer whose ATen op torchlib has but eager tracing never sees.

    ``aten.lstm`` and ``aten.gru`` are composite: they decompose into their cells, step by
    step, before any recording sees them. Kept whole as a layer call, they become ONNX's
    LSTM and GRU ops through torchlib's own functions for them.
    """

    accepts: Callable[[torch.nn.Module, list[Any]], bool]
    emit: Callable[[Any, list[Any], dict[str, Any]], Any]


def _recurrent_accepts(module: torch.nn.Module, leaves: list[Any]) -> bool:
    """Batched float32 input, no projection: what torchlib's LSTM and GRU functions take."""
    x = leaves[0] if leaves else None
    return (isinstance(x, torch.Tensor) and x.dim() == 3 and x.dtype == torch.float32
            and not getattr(module, "proj_size", 0))


def _recurrent_emit(call: Any, inputs: list[Any], params: dict[str, Any]) -> Any:
    import numpy as np
    from onnxscript import ir
    from onnxscript.function_libs.torch_lib.ops.core import aten_gru, aten_lstm

    module = call.module
    op = _opset()
    weights = [params[name] for name in module._flat_weights_names]
    states = [t for t in call.out_leaves[1:] if isinstance(t, torch.Tensor)]  # h_n (and c_n): hx's shapes
    hx = list(inputs[1:])
    if not hx:  # the layer starts from zeros: a constant of h_n's (and c_n's) shape, which torchlib reads
        for state in states:
            zeros = op.Constant(value=ir.tensor(np.zeros(tuple(state.shape), dtype=np.float32)))
            zeros.shape, zeros.dtype = ir.Shape(tuple(state.shape)), ir.DataType.FLOAT
            hx.append(zeros)
    config = (module.bias, module.num_layers, float(module.dropout), module.training, module.bidirectional,
              module.batch_first)
    if isinstance(module, torch.nn.LSTM):
        return aten_lstm(inputs[0], hx, weights, *config)
    return aten_gru(inputs[0], hx[0], weights, *config)


_RECURRENT = _BuiltinLayer(_recurrent_accepts, _recurrent_emit)
_BUILTIN_LAYERS: dict[type, _BuiltinLayer] = {torch.nn.LSTM: _RECURRENT, torch.nn.GRU: _RECURRENT}



def to_onnx(
    model: torch.nn.Module,
    *args: Any,
    path: str | os.PathLike[str] | None = None,
    opset: int | None = None,
    verbose: bool = False,
    **kwargs: Any,
) -> onnx.ModelProto:
    """Run ``model(*args, **kwargs)`` once, eagerly, and return what it ran as an ONNX model.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU())
    >>> proto = fwdtrace.to_onnx(model, torch.ones(1, 4))
    >>> [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
    (['input'], ['output'])
    >>> sorted(i.name for i in proto.graph.initializer)
    ['0.bias', '0.weight']

    The model runs on the real inputs, so Python control flow follows their values (an
    ``if x.mean() > 0:`` takes the branch the example takes) and the ONNX model holds that
    path only. Shapes are static, those of the example inputs: the model answers other
    inputs of the same shapes and dtypes. Sizes that depend on the values (the boxes a
    detector keeps, ``x[x > 0]``, NMS) are declared unknown, and the ops on them follow
    the values; but a size the model computed from them in Python (a ``view``'s shape,
    ``topk``'s k) stays the example's. Lazy layers not built yet are built first by one
    call on the example, as :func:`fwdtrace.export_onnx` builds them. Inputs are named after ``forward``'s parameters
    (keyword inputs by their keywords); non-tensor inputs (``use_cache=True``) are fixed
    to their values. Outputs are the tensors of what the model returns, flattened from
    tuples, dicts, dataclasses, ``ModelOutput`` s and caches, named by their paths
    (``logits``, ``cache.layers.0.keys``; ``output`` for a single tensor,
    ``output_0``, ``output_1`` for a tuple). Parameters and buffers are initializers named
    by their state-dict names; every node carries the module path and class it ran in
    (the metadata torch's dynamo exporter writes, read back by :func:`fwdtrace.onnx_graph`).

    ``opset`` is the ONNX opset, 18 (torchlib's) to 23; the model is emitted at 18 and converted.
    ``path`` also writes the model there, whole or not at all; a model whose parameters and
    buffers exceed :data:`~fwdtrace.onnx.export.EXTERNAL_DATA_THRESHOLD` (1 GiB; protobuf stops at
    2 GiB: torchvision's ``vit_h_14``) has its weights written to ``path`` + ``.data`` beside it,
    as :func:`fwdtrace.export_onnx` does, and the returned model refers to that file. Ops that ONNX has no
    translation for raise a :class:`~fwdtrace.FwdtraceError` naming each of them, with the
    module it ran in and a stub to register with :func:`fwdtrace.onnx_symbolic`. What torch
    and onnxscript warn and print meanwhile goes to the ``fwdtrace.onnx`` logger at DEBUG;
    ``verbose=True`` shows it as they print it.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"to_onnx() expected a torch.nn.Module as model, got {describe(model)}")
    if opset is not None and (not isinstance(opset, int) or isinstance(opset, bool) or not 18 <= opset <= 23):
        raise FwdtraceError(f"to_onnx() expected opset as an integer from 18 to 23, got {opset!r}")
    if not tensors_of((args, kwargs)):
        raise FwdtraceError("to_onnx() expected at least one tensor among the model's inputs, got none")
    _import_onnx()
    build_lazy_layers(model, args, kwargs, "to_onnx()")
    token = _symbolic_calls.set({})
    try:
        with quiet("to_onnx()", verbose):
            gm, record = _record(model, args, kwargs)
            proto = _emit(gm, record, opset)
    finally:
        _symbolic_calls.reset(token)
    if path is not None:
        _write_onnx(proto, os.fspath(path), None, caller="to_onnx()", large=_large(model))
    return proto


# -- recording ------------------------------------------------------------------------------------
@dataclass
class _Record:
    """What one eager run gave beside its FX graph: the names and tensors of inputs, outputs, weights."""

    state_names: list[str]
    state_tensors: list[torch.Tensor]
    input_names: list[str]
    output_names: list[str] = field(default_factory=list)


def _functional_call(module: torch.nn.Module, weights: dict[str, torch.Tensor], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
    """``torch.func.functional_call``, every module's own parameters and buffers put back afterwards.

    functional_call leaves the tensors it swapped in inside a module the model reaches by two paths
    (timm's CoaT shares one convolutional position encoding between blocks): torch 2.13 restores
    each path in turn, so the user's model would keep the recording's tensors.
    """
    held: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (d, dict(d)) for m in module.modules() for d in (m._parameters, m._buffers)]
    try:
        return torch.func.functional_call(module, weights, args, kwargs, strict=False)
    finally:
        for d, before in held:
            d.clear()
            d.update(before)


def _record(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, _Record]:
    """The model's ATen calls on these inputs as a functional FX graph: weights first, then inputs."""
    from torch.utils import _pytree as pytree

    # One graph input per tensor: tied weights are one initializer, named by their first name.
    state_names: list[str] = []
    state_tensors: list[torch.Tensor] = []
    index_of: dict[int, int] = {}
    name2index: dict[str, int] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        i = name2index[name] = index_of.setdefault(id(t), len(state_tensors))
        if i == len(state_tensors):
            state_names.append(name)
            state_tensors.append(t)

    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    record = _Record(state_names, state_tensors, _leaf_names(model, args, kwargs, tensor_at))
    _, registry_table = _torchlib(_default_opset())
    if _SYMBOLICS:  # an op the user gives a symbolic for stays one op
        registry_table = {op: fn for op, fn in registry_table.items() if _op_symbolic(op) is None}

    def run(state_values: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        values = list(leaves)
        for i, t in zip(tensor_at, inputs, strict=True):
            values[i] = t
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)
        weights = {name: state_values[i] for name, i in name2index.items()}
        out = _functional_call(model, weights, tuple(call_args), call_kwargs)
        named = list(_named_outputs(out))
        record.output_names = _unique([n for n, _ in named])
        return [t for _, t in named]

    inputs = [leaves[i] for i in tensor_at]
    try:
        gm = _make_graph(run, state_tensors, inputs, registry_table, model)
    except FwdtraceError:
        raise
    except Exception as e:
        raise FwdtraceError(
            f"to_onnx() could not run {type(model).__name__} on {shapes_text(inputs)}: {one_line(e)}"
        ) from e
    return gm, record


def _make_graph(
    run: Callable[..., Any], state_tensors: list[torch.Tensor], inputs: list[torch.Tensor],
    registry_table: dict[Any, Callable[..., Any]], model: torch.nn.Module,
) -> Any:
    from torch.fx.experimental.proxy_tensor import make_fx

    def record(indices: contextlib.AbstractContextManager[Any]) -> Any:
        with _module_scopes(model), _boundaries(model), _mkldnn_off(), _one_fake_mode(), indices:
            # _error_on_data_dependent_ops=False: a value read from a tensor (x.mean() > 0,
            # a mask's all()) is the example's value from here on; that is what an eager trace is.
            return make_fx(torch.func.functionalize(run, remove="mutations"), tracing_mode="real",
                           decomposition_table=registry_table, _error_on_data_dependent_ops=False)(
                state_tensors, inputs)

    indices = _TensorIndices()
    gm = _functional(record(indices), state_tensors, inputs)
    if indices.used and not _computes_eagers(gm, run, state_tensors, inputs):
        # A write through what such an index selected (``row = x[t]; row.zero_()``) would not
        # reach ``x``: the selection is a copy. The example's indices, fixed, then.
        gm = _functional(record(contextlib.nullcontext()), state_tensors, inputs)
    return gm


def _functional(gm: Any, state_tensors: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
    """``gm``, recorded once more where writes are left in it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if _has_mutations(gm):
        # Decompositions run below functionalization (GRU's writes with copy_): one more
        # eager pass over the recorded graph, functionalized, keeps the module metadata.
        import torch.fx.traceback as fx_traceback

        replay = functools.partial(_run_graph, gm)
        with fx_traceback.preserve_node_meta(), _one_fake_mode():
            gm = make_fx(torch.func.functionalize(replay, remove="mutations"), tracing_mode="real",
                         _error_on_data_dependent_ops=False)(
                state_tensors, inputs
            )
    return gm


@contextlib.contextmanager
def _one_fake_mode() -> Iterator[None]:
    """While active, make_fx describes the real tensors it records (each node's ``val``) in one fake mode.

    With none in sight, it makes a new fake mode for every op's output, and each records a
    stack trace as it is made: a fifth of the recording of a detector's thousands of ops.
    """
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


@contextlib.contextmanager
def _mkldnn_off() -> Iterator[None]:
    # LSTM's decomposition calls mkldnn_rnn_layer, which ONNX lacks, when mkldnn is on.
    # torch.backends.mkldnn.flags() would also set TF32 and warn about it.
    mkldnn: Any = torch.backends.mkldnn
    was = mkldnn.enabled
    mkldnn.enabled = False
    try:
        yield
    finally:
        mkldnn.enabled = was


def _run_graph(gm: Any, state_values: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
    return torch.fx.Interpreter(gm).run(state_values, inputs)


def _computes_eagers(gm: Any, run: Callable[..., Any], state_tensors: list[torch.Tensor],
                     inputs: list[torch.Tensor]) -> bool:
    """Whether the recorded graph gives the model's eager outputs on the example inputs."""
    with torch.no_grad():
        want, got = run(state_tensors, inputs), _run_graph(gm, state_tensors, inputs)
    return len(want) == len(got) and all(
        a.shape == b.shape and a.dtype == b.dtype
        and (torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, rtol=1e-4, atol=1e-6, equal_nan=True))
        for a, b in zip(want, got, strict=True))


class _TensorIndices(torch.overrides.TorchFunctionMode):
    """While active, ``x[..., t, ...]`` with ``t`` a 0-dim integer tensor selects at ``t``'s value in the graph.

    Eager indexing reads ``t`` as a Python int (``t.item()``), which the recording would
    keep as the example's number: a box picked by ``topk`` would be the example's box for
    every input. ``torch.jit.trace`` records such a select with its tensor index, and the
    dynamo exporter with a symbolic one; here it is ``fwdtrace::select``, an ONNX ``Gather``.
    ``used`` says whether any index was taken so.
    """

    def __init__(self) -> None:
        super().__init__()
        self.used = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
            out = _select_at_tensors(*args)
            if out is not None:
                self.used = True
                return out
        return func(*args, **(kwargs or {}))


def _is_scalar_index(item: Any) -> bool:
    """A 0-dim integer tensor, which eager indexing reads as an int (bool and uint8 are masks)."""
    return (isinstance(item, torch.Tensor) and item.dim() == 0 and not item.is_floating_point()
            and not item.is_complex() and item.dtype not in (torch.bool, torch.uint8))


def _select_at_tensors(x: torch.Tensor, index: Any) -> torch.Tensor | None:
    """``x[index]`` with its 0-dim integer tensors as ``fwdtrace::select``; None where ``index`` has none,
    or holds other tensors or sequences (advanced indexing, left as it is)."""
    items = index if isinstance(index, tuple) else (index,)
    scalar = {k for k, item in enumerate(items) if _is_scalar_index(item)}
    basic = all(item is None or item is Ellipsis or isinstance(item, slice)
                or (isinstance(item, int) and not isinstance(item, bool)) for k, item in enumerate(items) if k not in scalar)
    if not scalar or not basic or sum(item is Ellipsis for item in items) > 1:
        return None
    consumed = sum(item is not None and item is not Ellipsis for item in items)
    if consumed > x.dim():
        return None  # torch's own error
    dims: list[tuple[int, torch.Tensor]] = []  # where each selected dimension is in x[basic]
    at = 0
    for k, item in enumerate(items):
        if item is None or isinstance(item, slice) or k in scalar:
            if k in scalar:
                dims.append((at, item))
            at += 1
        elif item is Ellipsis:
            at += x.dim() - consumed
    out = x[tuple(slice(None) if k in scalar else item for k, item in enumerate(items))]
    for dim, t in reversed(dims):  # the last first: the dimensions before it keep their places
        out = _select_op()(out, dim, t)
    return out


@functools.cache
def _select_op() -> Any:
    """``fwdtrace::select(Tensor x, int dim, Tensor index) -> Tensor``: ``x.select(dim, index)``, index a tensor."""

    @torch.library.custom_op("fwdtrace::select", mutates_args=())
    def select(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        return x.select(dim, int(index)).clone()  # a custom op's output may not alias its input

    return select


def _emit_select(x: Any, dim: int, index: Any) -> Any:
    from onnxscript import ir

    op = _opset()
    if index.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        index = op.Cast(index, to=ir.DataType.INT64)
    return op.Gather(x, index, axis=dim)  # a 0-dim index drops the axis, as select does; negative counts from the end


def _has_mutations(gm: Any) -> bool:
    return any(
        n.op == "call_function" and getattr(getattr(n.target, "_schema", None), "is_mutable", False)
        for n in gm.graph.nodes
    )


@contextlib.contextmanager
def _module_scopes(model: torch.nn.Module) -> Iterator[None]:
    """While active, FX nodes made under ``make_fx`` carry the module calls around them.

    A handler on fwdtrace's module-call dispatch point (this thread's calls only) keeps a
    stack of ``(module path, class)`` for the model's own modules, written into the metadata
    torch.fx copies onto each new node (``nn_module_stack``, the key ``torch.export`` fills
    the same way). A call of a function every trace records as one node (an atomic
    function target, :data:`fwdtrace.registry.WHOLE_FUNCTIONS`) tags the nodes made inside
    it with ``CALL_KEY``: ``"<target>#<k>"``, its k-th call, which :func:`_emit` writes on the
    ONNX nodes so that the comparison matches all of them (batched_nms's loop over the
    classes) to that one traced call.
    """
    import torch.fx.traceback as fx_traceback

    from ..patching import add_call_handler, remove_call_handler
    from ..registry import function_targets
    from ..tracer import add_function_handlers, remove_handlers

    paths: dict[torch.nn.Module, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(module, name)
    stack: list[tuple[str, type]] = []
    calls: list[str] = []  # the atomic function call being recorded: the outermost only, as a trace has it
    counts: dict[str, int] = {}

    def publish() -> None:
        meta = fx_traceback.get_current_meta()
        meta["nn_module_stack"] = {f"fwdtrace_{i}": entry for i, entry in enumerate(stack)}
        if calls:
            meta["custom"] = {CALL_KEY: calls[0]}
        else:
            meta.pop("custom", None)

    def on_function(target: Any) -> Callable[..., Any]:
        def handler(call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            if calls or not stack:  # inside another one, or outside the model: no node of a trace's
                return call(*args, **kwargs)
            k = counts[target.path] = counts.get(target.path, -1) + 1
            calls.append(f"{target.path}#{k}")
            publish()
            try:
                return call(*args, **kwargs)
            finally:
                calls.pop()
                publish()

        return handler

    def on_call(call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        path = paths.get(module)
        if path is None:  # a module made in forward, or outside the model
            return call(module, *args, **kwargs)
        stack.append((path, type(module)))
        publish()
        try:
            return call(module, *args, **kwargs)
        finally:
            stack.pop()
            publish()

    atomic = [t for t in function_targets() if t.atomic]  # the calls a trace records as one node
    with fx_traceback.preserve_node_meta():
        handle = add_call_handler(on_call)
        function_handles = add_function_handlers(on_function, targets=atomic)
        try:
            yield
        finally:
            remove_handlers(function_handles)
            remove_call_handler(handle)


def _leaf_names(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tensor_at: list[int]) -> list[str]:
    """ONNX input names for the tensor leaves of ``(args, kwargs)``: forward's parameter names, keywords."""
    from torch.utils import _pytree as pytree

    params = _input_names(model, len(args))
    names = []
    for i, (keypath, _) in enumerate(pytree.tree_flatten_with_path((args, kwargs))[0]):
        if i not in tensor_at:
            continue
        keys = [_key_text(k) for k in keypath]
        # keypath: (0 for args / 1 for kwargs, position or keyword, then nested keys)
        head = params[int(keys[1])] if keys[0] == "0" else keys[1]
        names.append(".".join([head, *keys[2:]]))
    return _unique(names)


def _key_text(key: Any) -> str:
    for attr in ("idx", "key", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _named_outputs(out: Any, path: str = "", seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor the model returned, opening caches and other objects too."""
    import dataclasses

    seen = set() if seen is None else seen
    if isinstance(out, torch.Tensor):
        yield path or "output", out
        return
    if id(out) in seen or out is None or isinstance(out, (str, bytes, int, float, bool, torch.nn.Module)):
        return
    seen.add(id(out))
    if isinstance(out, Mapping):
        items: list[tuple[Any, Any]] = list(out.items())
    elif isinstance(out, (list, tuple)):
        items = list(enumerate(out))
        if not path:
            path = "output"
            if len(out) == 1:
                items = [("", out[0])]
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        items = [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    elif hasattr(out, "__dict__"):  # transformers' caches: layers[i].keys, .values
        items = list(vars(out).items())
    else:
        return
    for key, value in items:
        if path == "output" and isinstance(key, int):
            child = f"output_{key}"
        else:
            child = ".".join(p for p in (path, re.sub(r"[^0-9A-Za-z_]+", "_", str(key))) if p)
        yield from _named_outputs(value, child, seen)


def _unique(names: list[str]) -> list[str]:
    table = UniqueNames()
    return [table.take(name) for name in names]



# -- layers with a symbolic: one op in the recorded graph -----------------------------------------
@dataclass
class _SymbolicCall:
    """One call of a layer that has a symbolic: what the eager run and the emission need of it."""

    module: torch.nn.Module
    path: str
    fn: SymbolicFn | _BuiltinLayer
    leaves: list[Any]
    spec: Any
    tensor_at: list[int]
    param_names: list[str]
    out_leaves: list[Any] = field(default_factory=list)
    out_spec: Any = None


# key -> call, for the to_onnx() running in this context (the op's kernel and its emission read it)
_symbolic_calls: contextvars.ContextVar[dict[str, _SymbolicCall]] = contextvars.ContextVar("_symbolic_calls")
_running_layer: contextvars.ContextVar[bool] = contextvars.ContextVar("_running_layer", default=False)


@functools.cache
def _layer_op() -> Any:
    """``fwdtrace::layer(Tensor[] tensors, str key) -> Tensor[]``: a layer call that make_fx keeps whole.

    Its kernel runs the layer's own forward eagerly on the real tensors (the inputs,
    then the parameters); the recording sees one op, which the emission replaces by
    the user's ONNX nodes.
    """

    @torch.library.custom_op("fwdtrace::layer", mutates_args=())
    def layer(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
        from torch.utils import _pytree as pytree

        call = _symbolic_calls.get()[key]
        n = len(call.tensor_at)
        values = list(call.leaves)
        for i, t in zip(call.tensor_at, tensors[:n], strict=True):
            values[i] = t
        args, kwargs = pytree.tree_unflatten(values, call.spec)
        token = _running_layer.set(True)
        try:
            out = _functional_call(call.module, dict(zip(call.param_names, tensors[n:], strict=True)), tuple(args), kwargs)
        finally:
            _running_layer.reset(token)
        call.out_leaves, call.out_spec = pytree.tree_flatten(out)
        # a custom op's outputs may not alias its inputs
        return [t.clone() for t in call.out_leaves if isinstance(t, torch.Tensor)]

    return layer


@contextlib.contextmanager
def _boundaries(model: torch.nn.Module) -> Iterator[None]:
    """While active, each layer with a symbolic (the outermost, where they nest) runs as ``fwdtrace::layer``."""
    from torch.utils import _pytree as pytree

    paths: dict[torch.nn.Module, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(module, name)
    chosen: dict[torch.nn.Module, SymbolicFn | _BuiltinLayer] = {}
    for module, path in paths.items():
        fn = _module_symbolic(type(module))
        if fn is not None and not any(path.startswith(f"{paths[c]}.") or paths[c] == "" for c in chosen):
            chosen[module] = fn
    patched: list[tuple[torch.nn.Module, Any]] = []

    def boundary_for(module: torch.nn.Module, fn: SymbolicFn | _BuiltinLayer) -> Callable[..., Any]:
        forward = module.forward

        def boundary(*args: Any, **kwargs: Any) -> Any:
            if _running_layer.get() or _symbolic_calls.get(None) is None:
                return forward(*args, **kwargs)  # the op's kernel, or a call outside to_onnx (another thread)
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if isinstance(fn, _BuiltinLayer) and not fn.accepts(module, leaves):
                return forward(*args, **kwargs)  # recorded as the ATen calls it makes
            tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            named = [*module.named_parameters(), *module.named_buffers()]
            calls = _symbolic_calls.get()
            key = f"{paths[module]}#{len(calls)}"
            call = calls[key] = _SymbolicCall(module, paths[module], fn, leaves, spec, tensor_at, [n for n, _ in named])
            tensors = _layer_op()([leaves[i] for i in tensor_at] + [t for _, t in named], key)
            produced = iter(tensors)
            out = [next(produced) if isinstance(leaf, torch.Tensor) else leaf for leaf in call.out_leaves]
            return pytree.tree_unflatten(out, call.out_spec)

        return boundary

    from ..patching import critical

    try:
        with critical():  # Ctrl-C waits: no user's module is left half patched
            for module, fn in chosen.items():
                attrs = vars(module)
                patched.append((module, attrs.get("forward", _UNSET)))
                attrs["forward"] = boundary_for(module, fn)
        yield
    finally:
        with critical():
            for module, previous in reversed(patched):
                if previous is _UNSET:
                    vars(module).pop("forward", None)
                else:
                    vars(module)["forward"] = previous


def _emit_layer(tensors: list[Any], key: str) -> list[Any]:
    """The ONNX of a ``fwdtrace::layer`` node: the user's symbolic on the inputs and the parameters."""
    call = _symbolic_calls.get()[key]
    n = len(call.tensor_at)
    params = dict(zip(call.param_names, tensors[n:], strict=True))
    if isinstance(call.fn, _BuiltinLayer):
        out = call.fn.emit(call, tensors[:n], params)
    else:
        out = _call_symbolic(call.fn, tensors[:n], params)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _call_symbolic(fn: SymbolicFn, args: Any, kwargs: dict[str, Any]) -> Any:
    import onnxscript

    out = fn(*args, **kwargs) if isinstance(fn, onnxscript.OnnxFunction) else fn(_opset(), *args, **kwargs)
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    if not values or any(not hasattr(v, "producer") for v in values):
        raise FwdtraceError(
            f"the ONNX symbolic {getattr(fn, '__name__', fn)!r} expected to return ONNX values (op.Add(...)), "
            f"got {out!r}" + (" (an onnxscript function needs annotated outputs: -> FLOAT)" if not values else "")
        )
    return out


@functools.cache
def _opset() -> Any:
    import onnxscript

    return onnxscript.values.Opset("", _default_opset())


def _with_symbolics(base: Any, gm: Any) -> Any:
    """torchlib's registry with the user's symbolics for the ops of ``gm`` first (a copy: ``base`` is shared)."""
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    _layer_op()  # defines torch.ops.fwdtrace.layer
    layer = torch.ops.fwdtrace.layer.default if torch.ops.fwdtrace.layer.default in targets else None
    select = next((t for t in targets if t.namespace == "fwdtrace" and t.name() == "fwdtrace::select"), None)
    mine = {t: _op_symbolic(t) for t in targets}
    if layer is None and select is None and not any(mine.values()):
        return base
    ex = _exporter()
    registry = copy.copy(base)
    registry.functions = {k: list(v) for k, v in base.functions.items()}
    for target, fn in mine.items():
        if fn is not None:
            registry._register(target, ex.registration.OnnxDecompMeta(
                onnx_function=functools.partial(_call_symbolic_op, fn), fx_target=target, signature=None,
                is_custom=True, skip_signature_inference=True))
    for own, emit in [(layer, _emit_layer), (select, _emit_select)]:
        if own is not None:
            registry._register(own, ex.registration.OnnxDecompMeta(
                onnx_function=emit, fx_target=own, signature=None, is_custom=True, skip_signature_inference=True))
    return registry


def _call_symbolic_op(fn: SymbolicFn, *args: Any, **kwargs: Any) -> Any:
    return _call_symbolic(fn, args, kwargs)


def _check_supported(gm: Any, registry: Any) -> None:
    """Raise one error naming every op of ``gm`` that nothing translates, where it ran, and a stub for each."""
    missing: dict[str, tuple[Any, list[str]]] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if registry.is_registered(target) or target.namespace == "onnx":
            continue
        where = _where(node)
        entry = missing.setdefault(_op_name(target), (target, []))
        if where not in entry[1]:
            entry[1].append(where)
    if not missing:
        return
    lines = [f"to_onnx() found {len(missing)} op{'s' if len(missing) > 1 else ''} with no ONNX translation: "
             + "; ".join(f"{name} (in {', '.join(wheres)})" for name, (_, wheres) in missing.items())
             + ". Register a symbolic for each op, or for the layer that calls it "
             "(@fwdtrace.onnx_symbolic('mypkg.MyLayer') gets the layer's inputs):"]
    for name, (target, _) in missing.items():
        params = [a.name for a in target._schema.arguments if not a.kwarg_only]
        lines += ["", f"@fwdtrace.onnx_symbolic({name!r})",
                  f"def {re.sub(r'[^0-9A-Za-z_]', '_', name)}(op, {', '.join(params)}):",
                  f"    return op.Identity({params[0] if params else ''})  # the ONNX ops that compute {name}"]
    raise FwdtraceError("\n".join(lines))


def _where(node: Any) -> str:
    """The module call an FX node was recorded in: ``'head.conv' (mypkg.Head)``, or the model's forward."""
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return "the model's forward" if len(stack) <= 1 else f"'{stack[-1][0]}' ({_class_text(stack[-1][1])})"


def _class_text(cls: Any) -> str:
    from ..registry import qualified_name

    return qualified_name(cls) if isinstance(cls, type) else str(cls)


# -- emitting -------------------------------------------------------------------------------------
def _emit(gm: Any, record: _Record, opset: int | None) -> onnx.ModelProto:
    ex = _exporter()
    ir = ex.ir
    registry = _with_symbolics(_torchlib(_default_opset())[0], gm)
    gm = ex.fx_passes.remove_assertion_nodes(gm)
    gm.graph.eliminate_dead_code()
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # tensors the forward made from Python data: constants, real values
            node.meta["val"] = getattr(gm, node.target)
    _promote_types(gm)
    _unfix_data_dependent_sizes(gm)
    gm.recompile()
    model = ir.Model(
        graph=ir.Graph([], [], nodes=[], name="main_graph"),
        ir_version=ex.constants.ONNX_IR_VERSION,
        producer_name="fwdtrace",
        producer_version=_version(),
    )
    _check_supported(gm, registry)
    try:
        with _quiet_exporter_logs():
            values = ex.core._translate_fx_graph(
                gm.graph, model, graph_like=model.graph, owned_graphs={}, lower="at_conversion", registry=registry
            )
    except Exception as e:
        mine = next((c for c in _cause_chain(e) if isinstance(c, FwdtraceError)), None)
        if mine is not None:  # a symbolic's own error, raised inside torch's translator
            raise FwdtraceError(f"to_onnx() could not emit the recorded graph: {mine}") from e
        raise FwdtraceError(f"to_onnx() could not emit the recorded graph{_failed_node_text(gm, e)}: "
                            f"{_cause_text(e)}") from e

    for ir_node in model.graph.all_nodes():
        fx_node = ir_node.meta.get("node")
        call = fx_node.meta.get("custom", {}).get(CALL_KEY) if fx_node is not None else None
        if call is not None:
            ir_node.metadata_props[CALL_KEY] = call
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_state = len(record.state_names)
    model.graph.inputs.clear()
    for node, name, tensor in zip(placeholders[:n_state], record.state_names, record.state_tensors, strict=True):
        value = values[node.name]
        if not value.uses():
            continue  # a weight this run did not read
        value.name = name
        value.const_value = ex.core.TorchTensor(tensor.detach(), name=name)
        model.graph.initializers[name] = value
    for node, name in zip(placeholders[n_state:], record.input_names, strict=True):
        value = values[node.name]
        value.name = name
        model.graph.inputs.append(value)
    outputs = list(model.graph.outputs)
    model.graph.outputs.clear()
    for value, name in zip(outputs, record.output_names, strict=True):
        if value.is_graph_input() or value.is_initializer() or value in model.graph.outputs or value.const_value is not None:
            copy = ir.Value(name=name, shape=value.shape, type=value.type)
            model.graph.append(ir.Node("", "Identity", [value], outputs=[copy], name=f"node_{name}"))
            value = copy
        _rename(model.graph, value, name)
        model.graph.outputs.append(value)
    ex.ir_passes.add_opset_imports(model)
    _optimize(model)
    proto = _cast_to_eager_dtypes(model, ir.serde.serialize_model(model))
    if opset is not None and opset != registry.opset_version:
        _convert_opset(model, opset)
        proto = ir.serde.serialize_model(model)
    return proto


def _unfix_data_dependent_sizes(gm: Any) -> None:
    """Give every value whose size depends on the input's values (boxes kept by a score, NMS) unknown dims.

    The recording saw the example's sizes; declared in the ONNX model, they would be promises
    that such values keep them: onnxruntime then plans its Reshapes by them and fails where
    its own arithmetic keeps one box more or less, and torchlib drops from a ``cat`` the
    inputs that were empty in the example (all of them, in a detector with random weights,
    where it then has nothing to emit). Each such value and all that is computed from it
    keep their rank and dtype and get one unknown dim per axis (``u0``, ``u1``, ... as the
    dynamo exporter names them); sizes the model computed from them in Python (a ``view``'s
    shape, ``topk``'s k) stay the example's.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)  # for other libraries' fake kernels
    varies: set[Any] = set()
    names = (f"u{i}" for i in itertools.count())
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if not (any(a in varies for a in node.all_input_nodes) or _sizes_depend_on_values(node, mode)):
            continue
        varies.add(node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["val"] = _UnknownSizes.like(val, names)
        elif isinstance(val, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in val):
            node.meta["val"] = type(val)(_UnknownSizes.like(v, names) for v in val)


class _UnknownDim:
    """One unknown size, as torch's translator reads a symbolic one: ``str(dim.node)`` is its ONNX name."""

    __slots__ = ("node",)

    def __init__(self, name: str) -> None:
        self.node = name


class _UnknownSizes(torch.Tensor):
    """A value's dtype and rank with unknown sizes: what torch's translator reads of an FX node's ``val``.

    The translator needs ``isinstance(val, torch.Tensor)``, ``val.dtype`` and, per dim of
    ``val.shape``, an int or a symbol's name. Fake tensors with fresh unbacked symbols say
    the same at about 10 ms each (the shape environment records a traceback per symbol and
    guards on every size); over the thousands of post-processing values of a detector
    (Keypoint R-CNN) that was minutes. This stands in for no computation: it is never run.
    """

    _dims: tuple[_UnknownDim, ...]

    @classmethod
    def like(cls, val: torch.Tensor, names: Iterator[str]) -> _UnknownSizes:
        out = torch.empty([0] * val.dim(), dtype=val.dtype, device="meta").as_subclass(cls)
        out._dims = tuple(_UnknownDim(next(names)) for _ in range(val.dim()))
        return out

    @property
    def shape(self) -> tuple[_UnknownDim, ...]:  # type: ignore[override]
        return self._dims


def _sizes_depend_on_values(node: Any, mode: Any) -> bool:
    """Whether the op's output sizes depend on its inputs' values, not only on their sizes.

    ATen says so by a tag (``nonzero``, ``masked_select``, ``unique``; ``index`` only with a
    mask); another library's op (``torchvision::nms``) by the size its fake kernel gives:
    one it cannot know (an unbacked symbol).
    """
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.dynamic_output_shape in target.tags:
        if target.overloadpacket is torch.ops.aten.index:
            indices = node.args[1] if len(node.args) > 1 else []
            return any(isinstance(i, torch.fx.Node) and getattr(i.meta.get("val"), "dtype", None) in (torch.bool, torch.uint8)
                       for i in indices)
        return True
    if target.namespace in ("aten", "prims", "fwdtrace", "onnx"):
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.utils import _pytree as pytree

    def fake(a: Any) -> Any:
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype) if isinstance(val, torch.Tensor) else val

    try:
        with mode:
            out = target(*pytree.tree_map(fake, node.args), **pytree.tree_map(fake, node.kwargs))
    except Exception:  # no fake kernel: the op is taken to keep the sizes the example gave
        return False
    return any(free_unbacked_symbols(t.shape) for t in tensors_of(out))


def _promote_types(gm: Any) -> None:
    """Cast the tensor inputs of elementwise ops to the dtype torch computes them in.

    torch promotes mixed dtypes (a float32 tensor times an int64 count is float32, as
    ``torch.result_type`` says); ONNX's ``Mul``, ``Div``, ``Less`` take one type. The rules
    are torch's own (the table the dynamo exporter's type-promotion pass reads, generated
    from ``torch._refs``), applied to the dtypes the eager run recorded. Python numbers are
    left as they are: torchlib casts them like the tensor they meet.
    """
    ex = _exporter()
    table = ex.type_promotion.TypePromotionTable()  # one per call (under a ms): torch's div rule keeps state
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        rule = table.get_rule(node.target.overloadpacket)
        if not isinstance(rule, ex.type_promotion.ElementwiseTypePromotionRule):
            continue
        values = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
        try:
            promoted = rule.preview_type_promotion(tuple(values(a) for a in node.args),
                                                   {k: values(a) for k, a in node.kwargs.items()})
        except (TypeError, ValueError, RuntimeError, AttributeError):  # an argument without a recorded dtype
            continue
        args = [_cast_arg(gm, node, a, promoted.args_dtypes.get(i)) for i, a in enumerate(node.args)]
        kwargs = {k: _cast_arg(gm, node, a, promoted.kwargs_dtypes.get(k)) for k, a in node.kwargs.items()}
        node.args, node.kwargs = tuple(args), kwargs


def _cast_arg(gm: Any, node: Any, arg: Any, dtype: torch.dtype | None) -> Any:
    """``arg`` cast to ``dtype`` before ``node`` where it is a tensor of another dtype, else ``arg``."""
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if dtype is None or not isinstance(val, torch.Tensor) or val.dtype == dtype:
        return arg
    with gm.graph.inserting_before(node):
        cast = gm.graph.call_function(torch.ops.prims.convert_element_type.default, (arg, dtype))
    cast.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=dtype, device="meta")
    if "nn_module_stack" in node.meta:  # the cast belongs to the op that needs it
        cast.meta["nn_module_stack"] = node.meta["nn_module_stack"]
    return cast


def _cast_to_eager_dtypes(model: Any, proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model, with a Cast where an op's ONNX output has another dtype than eager's.

    Each value is declared with the dtype eager gave it, but a torchlib function can
    compute another: ``cumsum`` of int32 is int64 in torch and int32 in its ONNX form,
    and onnxruntime refuses such a model. ONNX's own inference says what each op gives;
    an op is cast only where its inputs already are what eager had, then inference runs
    again on what follows (a rare path: a model without such ops is inferred once).
    """
    from onnxscript import ir

    from .export import _inferred_value_info

    for _ in range(16):
        inferred = {vi.name: vi.type.tensor_type.elem_type for vi in _inferred_value_info(proto, declared=False)}
        wrong = [(node, value, got) for node in model.graph if not any(_other_dtype(i, inferred) for i in node.inputs)
                 for value in node.outputs if (got := _other_dtype(value, inferred))]
        if not wrong:
            return proto
        for node, value, got in wrong:
            name, eager_type = value.name, value.type
            value.name, value.type = f"{name}__{ir.DataType(got).name.lower()}", ir.TensorType(ir.DataType(got))
            cast = ir.Value(name=name, shape=value.shape, type=eager_type)
            ir.convenience.replace_all_uses_with(value, cast, replace_graph_outputs=True)
            model.graph.insert_after(node, ir.Node("", "Cast", [value], attributes=[ir.AttrInt64("to", eager_type.dtype.value)],
                                                   outputs=[cast], name=f"node_{name}__cast"))
        proto = ir.serde.serialize_model(model)
    return proto


def _optimize(model: Any) -> None:
    """Inline torchlib's functions, fold constants, drop what nothing reads; leave the weights as they are.

    The dynamo exporter's optimizer also folds weights (a Linear's transposed weight, a
    BatchNorm into the Conv before it) into new initializers and fuses ops: here the
    state dict's tensors stay, by name, and each op stays the call that made it.
    Outputs nothing reads (batch norm's saved statistics) lose the shapes eager gave them
    (empty in eval), which torchlib's ops do not reproduce and onnx's checker refuses.
    """
    import numpy as np
    import onnx_ir.passes.common as passes
    import onnxscript.optimizer

    passes.InlinePass()(model)
    weights = set(model.graph.initializers.values())
    with np.errstate(all="ignore"):  # folding T5's position buckets takes log(0), as eager does
        onnxscript.optimizer.fold_constants_ir(
            model, should_fold=lambda node: False if any(v in weights for v in node.inputs) else None
        )
    passes.RemoveUnusedNodesPass()(model)
    for node in model.graph:
        for value in node.outputs:
            if not value.uses() and not value.is_graph_output():
                value.shape = None
    passes.RemoveUnusedFunctionsPass()(model)
    passes.RemoveUnusedOpsetsPass()(model)


def _other_dtype(value: Any, inferred: dict[str, int]) -> int | None:
    """The dtype ONNX infers for ``value`` where it is not the one declared (eager's), else None."""
    got = inferred.get(value.name or "") if value is not None else None
    return got if got and value.dtype is not None and got != value.dtype.value else None


def _rename(graph: Any, value: Any, name: str) -> None:
    """Give ``value`` the name ``name``, moving another value that has it out of the way."""
    for node in graph:
        for other in node.outputs:
            if other is not value and other.name == name:
                other.name = f"{name}__inner"
    value.name = name


def _convert_opset(model: Any, opset: int) -> None:
    import onnxscript.version_converter

    try:
        onnxscript.version_converter.convert_version(model, target_version=opset)
    except Exception as e:
        raise FwdtraceError(f"to_onnx() could not convert the model to opset {opset}: {one_line(e)}") from e


def _failed_node_text(gm: Any, e: BaseException) -> str:
    """`` at aten.cat.default in 'head' (mypkg.Head)``: the op torch's translator stopped at and where it ran."""
    for cause in _cause_chain(e):
        found = re.search(r"Error when translating node %(\w+)", str(cause))
        node = next((n for n in gm.graph.nodes if found and n.name == found.group(1)), None)
        if node is not None:
            what = _op_name(node.target) if isinstance(node.target, torch._ops.OpOverload) else str(node.target)
            return f" at {what} in {_where(node)}"
    return ""


def _cause_text(e: BaseException) -> str:
    return "; ".join(one_line(c) for c in _cause_chain(e)[-2:])


def _version() -> str:
    from .. import __version__

    return __version__


# -- command line ---------------------------------------------------------------------------------
def run_cli(args: argparse.Namespace) -> int:
    """Run ``fwdtrace export-onnx``: write the ONNX of one eager run, 0 when written, 2 when not.

    The model is put in eval mode and fed the seeded inputs of ``--input-shape``/``--dtype``,
    made as ``fwdtrace check-onnx`` makes them.
    """
    from ..cli import load_factory, make_inputs

    inputs = make_inputs(args)
    model = load_factory(args.factory).eval()
    proto = to_onnx(model, *inputs, path=args.output, opset=args.opset)
    ios = ", ".join(f"{v.name}" for v in proto.graph.input)
    print(f"wrote {args.output}: {len(proto.graph.node)} nodes, inputs {ios}, "
          f"outputs {', '.join(o.name for o in proto.graph.output)}")
    return 0
