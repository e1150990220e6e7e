"""ONNX from one eager run: the ATen calls the model really made, emitted through torchlib.

The route (see the README's "to_onnx" section): the model runs once, eagerly, on the real
example inputs, under ``make_fx(tracing_mode="real")``, which records every ATen call into
an FX graph while Python control flow follows the values it sees (``if x.mean() > 0``
takes the branch the example takes, as ``torch.jit.trace`` did). Functionalization turns
in-place ops into their functional forms; the ops onnxscript's torchlib does not implement
are decomposed with the same table torch's dynamo exporter uses. Each FX node is then
emitted by torch's own translator through the torchlib registry, so the ONNX ops are
those ``torch.onnx.export(dynamo=True)`` writes, without ``torch.export``'s tracing.

Module forward hooks put each call's module path and class into the FX node metadata
(``nn_module_stack``), which the translator writes as the ``pkg.torch.onnx.name_scopes``
and ``pkg.torch.onnx.class_hierarchy`` metadata that :func:`fwdtrace.onnx_graph` reads.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._tree import tensors_of
from ..errors import FwdtraceError, describe, one_line, shapes_text
from .export import _import_onnx, _input_names, _quiet_exporter_logs, _write_onnx

if TYPE_CHECKING:
    import onnx

__all__ = ["to_onnx"]

# The torch.onnx internals this module drives, as they are in torch 2.13.0 (the version the
# Makefile pins): _core._translate_fx_graph, _core.TorchTensor, _registration.ONNXRegistry
# (.from_torchlib, ._register, OnnxDecompMeta), _decomp.create_onnx_friendly_decomposition_table,
# _fx_passes.remove_assertion_nodes, _ir_passes.add_opset_imports, _constants.ONNX_IR_VERSION.
_TORCH_INTERNALS = "torch.onnx._internal.exporter (_core, _registration, _decomp, _fx_passes, _ir_passes)"


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

        for owner, name in [(_core, "_translate_fx_graph"), (_core, "TorchTensor"),
                            (_registration.ONNXRegistry, "from_torchlib"), (_registration, "OnnxDecompMeta"),
                            (_decomp, "create_onnx_friendly_decomposition_table"),
                            (_fx_passes, "remove_assertion_nodes"), (_ir_passes, "add_opset_imports")]:
            getattr(owner, name)
    except (ImportError, AttributeError) as e:
        raise FwdtraceError(
            f"to_onnx() needs {_TORCH_INTERNALS} as in torch 2.13, got torch {torch.__version__} where "
            f"{one_line(e)}; install torch==2.13.0, or use fwdtrace.export_onnx()"
        ) from e
    return _Exporter(_core, _registration, _decomp, _fx_passes, _ir_passes, _constants, ir)


@functools.cache
def _torchlib(opset: int) -> tuple[Any, dict[Any, Callable[..., Any]]]:
    """torchlib's registry at ``opset`` and the decomposition table for the ops it lacks (built once)."""
    ex = _exporter()
    with _quiet_exporter_logs():
        registry = ex.registration.ONNXRegistry.from_torchlib(opset)
    implemented = set(ex.decomp.get_onnx_implemented_overloads(registry))
    return registry, ex.decomp.create_onnx_friendly_decomposition_table(implemented)


def _default_opset() -> int:
    return int(_exporter().constants.TORCHLIB_OPSET)


def to_onnx(
    model: torch.nn.Module,
    *args: Any,
    path: str | os.PathLike[str] | None = None,
    opset: int | None = None,
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
    inputs of the same shapes and dtypes. Inputs are named after ``forward``'s parameters
    (keyword inputs by their keywords); non-tensor inputs (``use_cache=True``) are fixed
    to their values. Outputs are the tensors of what the model returns, flattened from
    tuples, dicts, dataclasses, ``ModelOutput`` s and caches, named by their paths
    (``logits``, ``past_key_values.layers.0.keys``; ``output`` for a single tensor,
    ``output_0``, ``output_1`` for a tuple). Parameters and buffers are initializers named
    by their state-dict names; every node carries the module path and class it ran in
    (the metadata torch's dynamo exporter writes, read back by :func:`fwdtrace.onnx_graph`).

    ``opset`` is the ONNX opset, 18 (torchlib's) to 23; the model is emitted at 18 and converted.
    ``path`` also writes the model there, whole or not at all. Ops that ONNX has no
    translation for raise a :class:`~fwdtrace.FwdtraceError` naming each of them, with the
    module it ran in and a stub to register with :func:`fwdtrace.onnx_symbolic`.
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"to_onnx() expected a torch.nn.Module as model, got {describe(model)}")
    if opset is not None and (not isinstance(opset, int) or isinstance(opset, bool) or not 18 <= opset <= 23):
        raise FwdtraceError(f"to_onnx() expected opset as an integer from 18 to 23, got {opset!r}")
    if not tensors_of((args, kwargs)):
        raise FwdtraceError("to_onnx() expected at least one tensor among the model's inputs, got none")
    _import_onnx()
    gm, record = _record(model, args, kwargs)
    proto = _emit(gm, record, opset)
    if path is not None:
        _write_onnx(proto, os.fspath(path), None, caller="to_onnx()")
    return proto


# -- recording ------------------------------------------------------------------------------------
@dataclass
class _Record:
    """What one eager run gave beside its FX graph: the names and tensors of inputs, outputs, weights."""

    state_names: list[str]
    state_tensors: list[torch.Tensor]
    input_names: list[str]
    output_names: list[str] = field(default_factory=list)


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

    def run(state_values: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        values = list(leaves)
        for i, t in zip(tensor_at, inputs, strict=True):
            values[i] = t
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)
        weights = {name: state_values[i] for name, i in name2index.items()}
        out = torch.func.functional_call(model, weights, tuple(call_args), call_kwargs, strict=False)
        named = list(_named_outputs(out))
        record.output_names = _unique([n for n, _ in named])
        return [t for _, t in named]

    inputs = [leaves[i] for i in tensor_at]
    try:
        gm = _make_graph(run, state_tensors, inputs, registry_table, _module_scopes(model))
    except FwdtraceError:
        raise
    except Exception as e:
        raise FwdtraceError(
            f"to_onnx() could not run {type(model).__name__} on {shapes_text(inputs)}: {one_line(e)}"
        ) from e
    return gm, record


def _make_graph(
    run: Callable[..., Any], state_tensors: list[torch.Tensor], inputs: list[torch.Tensor],
    registry_table: dict[Any, Callable[..., Any]], scopes: contextlib.AbstractContextManager[None],
) -> Any:
    from torch.fx.experimental.proxy_tensor import make_fx

    with scopes, _mkldnn_off():
        # _error_on_data_dependent_ops=False: a value read from a tensor (x.mean() > 0,
        # a mask's all()) is the example's value from here on; that is what an eager trace is.
        gm = make_fx(torch.func.functionalize(run, remove="mutations"), tracing_mode="real",
                     decomposition_table=registry_table, _error_on_data_dependent_ops=False)(state_tensors, inputs)
    if _has_mutations(gm):
        # Decompositions run below functionalization (GRU's writes with copy_): one more
        # eager pass over the recorded graph, functionalized, keeps the module metadata.
        import torch.fx.traceback as fx_traceback

        replay = functools.partial(_run_graph, gm)
        with fx_traceback.preserve_node_meta():
            gm = make_fx(torch.func.functionalize(replay, remove="mutations"), tracing_mode="real",
                         _error_on_data_dependent_ops=False)(
                state_tensors, inputs
            )
    return gm


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


def _has_mutations(gm: Any) -> bool:
    return any(
        n.op == "call_function" and getattr(getattr(n.target, "_schema", None), "is_mutable", False)
        for n in gm.graph.nodes
    )


@contextlib.contextmanager
def _module_scopes(model: torch.nn.Module) -> Iterator[None]:
    """While active, FX nodes made under ``make_fx`` carry the module calls around them.

    Forward hooks on the model's own modules (removed after, exceptions included) keep a
    stack of ``(module path, class)``, written into the metadata torch.fx copies onto each
    new node (``nn_module_stack``, the key ``torch.export`` fills the same way).
    """
    import torch.fx.traceback as fx_traceback

    paths: dict[torch.nn.Module, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(module, name)
    stack: list[tuple[str, type]] = []

    def publish() -> None:
        fx_traceback.get_current_meta()["nn_module_stack"] = {
            f"fwdtrace_{i}": entry for i, entry in enumerate(stack)
        }

    def enter(module: torch.nn.Module, inputs: Any) -> None:
        stack.append((paths[module], type(module)))
        publish()

    def leave(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if stack:
            stack.pop()
        publish()

    handles = []
    try:
        with fx_traceback.preserve_node_meta():
            for module in paths:
                handles.append(module.register_forward_pre_hook(enter))
                handles.append(module.register_forward_hook(leave, always_call=True))
            yield
    finally:
        for handle in reversed(handles):
            handle.remove()


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
    out: list[str] = []
    taken: set[str] = set()
    for name in names:
        unique, i = name, 1
        while unique in taken:
            unique, i = f"{name}_{i}", i + 1
        taken.add(unique)
        out.append(unique)
    return out


# -- emitting -------------------------------------------------------------------------------------
def _emit(gm: Any, record: _Record, opset: int | None) -> onnx.ModelProto:
    ex = _exporter()
    ir = ex.ir
    registry, _ = _torchlib(_default_opset())
    gm = ex.fx_passes.remove_assertion_nodes(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # tensors the forward made from Python data: constants, real values
            node.meta["val"] = getattr(gm, node.target)
    model = ir.Model(
        graph=ir.Graph([], [], nodes=[], name="main_graph"),
        ir_version=ex.constants.ONNX_IR_VERSION,
        producer_name="fwdtrace",
        producer_version=_version(),
    )
    try:
        with _quiet_exporter_logs():
            values = ex.core._translate_fx_graph(
                gm.graph, model, graph_like=model.graph, owned_graphs={}, lower="at_conversion", registry=registry
            )
    except Exception as e:
        raise FwdtraceError(f"to_onnx() could not emit the recorded graph: {_cause_text(e)}") from e

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
    if opset is not None and opset != registry.opset_version:
        _convert_opset(model, opset)
    return ir.serde.serialize_model(model)


def _optimize(model: Any) -> None:
    """Drop what nothing reads; unlike the dynamo exporter, fold no constants.

    Folding would rewrite weights (BatchNorm into the Conv before it, a Linear's transposed
    weight) into new initializers: the state dict's tensors stay as they are, by name.
    Outputs nothing reads (batch norm's saved statistics) lose the shapes eager gave them
    (empty in eval), which torchlib's ops do not reproduce and onnx's checker refuses.
    """
    import onnx_ir.passes.common as passes

    passes.RemoveUnusedNodesPass()(model)
    for node in model.graph:
        for value in node.outputs:
            if not value.uses() and not value.is_graph_output():
                value.shape = None
    passes.RemoveUnusedFunctionsPass()(model)
    passes.RemoveUnusedOpsetsPass()(model)


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


def _cause_text(e: BaseException) -> str:
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    return "; ".join(one_line(c) for c in chain[-2:])


def _version() -> str:
    from .. import __version__

    return __version__
