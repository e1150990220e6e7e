"""Which ONNX ops a traced torch call may become: the registry the ONNX cross-check reads.

A rule maps a trace node's ``target`` (``"torch.nn.Conv2d"``, ``"torch.Tensor.add"``) to
the ONNX op patterns an exporter may write for it. A pattern is ``"Conv"`` or
``"MatMul+Add"`` (the ops of one call, ``Op*2`` for two of them); several patterns are
alternatives (Linear: ``"Gemm"`` or ``"MatMul+Add"``). A rule may also let the call
vanish: ``optional=True`` (dropout in eval, views and transposes, which the comparison
treats as wiring) or ``folds_into=("Conv",)`` (BatchNorm folded into the Conv before it).
Users extend it for their own layers, the way ``@hook_forward`` registers callbacks.
"""

from __future__ import annotations

import inspect
import re
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, overload

import torch

from ..errors import FwdtraceError, describe
from ..node import Node
from ..registry import BATCHED_NMS, qualified_name

__all__ = [
    "onnx_equivalent", "Equivalence", "Pattern", "equivalence_for", "canonical_target", "ONNX_WIRING_OPS", "QUANTIZED_OPS",
    "NEW_TENSOR_FUNCTIONS", "SHAPE_ONLY_AFTER_FIRST", "BATCHED_NMS", "PAD_FUNCTIONS", "OVERWRITE_FUNCTIONS", "written_through_a_view",
    "FILL_FUNCTIONS", "COPY_FUNCTIONS", "copied_into_a_fill",
]

F = TypeVar("F", bound=Callable[..., Any])
# What a rule function may return for a node: one pattern, several, or None to vanish.
RuleResult = str | Sequence[str] | None

# ONNX ops that only move, reshape or retype data: the comparison treats them as wiring,
# as it treats views and transposes on the torch side.
ONNX_WIRING_OPS = frozenset({
    "Identity", "Cast", "CastLike", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten",
    "Expand", "Dropout", "Slice", "Split", "Tile",
    # a tensor split into a sequence, one part taken (to_onnx's unbind: torch.where(mask)'s index rows)
    "SplitToSequence", "SequenceAt",
    # quantization retypes data (float <-> int8 with a scale): onnxruntime's quantize_dynamic, QDQ files
    "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear",
})

# The integer kernels of quantized files compute the float op on the quantized data: a
# dynamically quantized Linear is DynamicQuantizeLinear, MatMulInteger, Cast and the Muls
# that rescale its result (see fwdtrace.onnx.compare), and is compared as a MatMul.
# (ConvInteger is left out: it has no bias input, and a Conv written as Conv+Add is no rule yet.)
QUANTIZED_OPS = {"MatMulInteger": "MatMul"}


# Elementwise ops that written-out patterns share: alone they do not identify a layer.
ARITHMETIC_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Max", "Min", "Sum", "Where", "Not", "And",
    "Or", "Xor", "Equal", "Less", "Greater", "IsNaN",
})
_PICKING_OPS = frozenset({"Gather", "GatherND", "GatherElements"})


@dataclass(frozen=True)
class Pattern:
    """The ONNX ops one torch call may become, with how many of each: ``Pattern.parse("MatMul+Add")``."""

    ops: tuple[tuple[str, int], ...]
    text: str

    @classmethod
    def parse(cls, text: str) -> Pattern:
        counts: Counter[str] = Counter()
        for part in text.split("+"):
            op, _, times = part.strip().partition("*")
            if not op.isidentifier() or (times and not times.isdigit()):
                raise FwdtraceError(
                    f"expected an ONNX op pattern such as 'Conv', 'MatMul+Add' or 'Mul*2+Erf', got {text!r}"
                )
            counts[op] += int(times) if times else 1
        return cls(tuple(sorted(counts.items())), text)

    @property
    def counts(self) -> Counter[str]:
        return Counter(dict(self.ops))

    def admits(self, ops: Counter[str], key: str) -> bool:
        """True when ``ops`` (a region's op counts) fit inside this pattern, contain ``key`` and are not mere arithmetic.

        A region of a written-out pattern must hold one of its telling ops (the ReduceMean
        of a LayerNorm, the Erf of a GELU), or, when the pattern is all arithmetic, each of
        its ops: a lone Add is not a LayerNorm.
        """
        budget = dict(self.ops)
        if key not in budget or any(budget.get(op, 0) < n for op, n in ops.items()):
            return False
        telling = [op for op in budget if op not in ARITHMETIC_OPS]
        # indexing tells only a pattern that is all indexing: a lone Gather (x[keep]) is no batched_nms
        telling = [op for op in telling if op not in _PICKING_OPS] or telling
        return any(ops.get(op) for op in telling) if telling else all(ops.get(op) for op in budget)


@dataclass(frozen=True)
class Equivalence:
    """What one trace node may be in ONNX: alternative patterns, and whether it may vanish."""

    patterns: tuple[Pattern, ...] = ()
    optional: bool = False
    folds_into: frozenset[str] = frozenset()
    source: str = ""  # the rule's target, for messages

    @property
    def op_types(self) -> frozenset[str]:
        return frozenset(op for p in self.patterns for op, _ in p.ops)


@dataclass
class _Rule:
    fn: Callable[[Node], RuleResult]
    optional: bool
    folds_into: frozenset[str]
    cache: dict[Any, Equivalence] = field(default_factory=dict)


_RULES: dict[str, _Rule] = {}
_inherited: dict[str, str | None] = {}  # layer target -> the ancestor whose rule it takes
_known_classes: weakref.WeakValueDictionary[str, type] = weakref.WeakValueDictionary()
_loaded_plugins = False


def _target_name(target: Any) -> str:
    """The trace ``target`` string a class, a function or a dotted path names."""
    if isinstance(target, str):
        name = target.removesuffix(".forward")
        if not name or not all(p.isidentifier() for p in name.split(".")):
            raise FwdtraceError(
                f"onnx_equivalent() expected a target such as 'torch.nn.Conv2d' or 'torch.Tensor.add', got {target!r}"
            )
        return name
    if isinstance(target, type) and issubclass(target, torch.nn.Module):
        return qualified_name(target)
    if callable(target):
        from ..tracer import function_name

        return function_name(target)
    raise FwdtraceError(
        f"onnx_equivalent() expected a torch.nn.Module subclass, a torch function or a dotted name, "
        f"got {target!r} ({describe(target)})"
    )


@overload
def onnx_equivalent(
    target: Any, *, optional: bool = False, folds_into: Iterable[str] = ()
) -> Callable[[F], F]: ...


@overload
def onnx_equivalent(
    target: Any, pattern: str, /, *patterns: str, optional: bool = False, folds_into: Iterable[str] = ()
) -> None: ...


def onnx_equivalent(
    target: Any, *patterns: str, optional: bool = False, folds_into: Iterable[str] = ()
) -> Callable[[F], F] | None:
    """Declare which ONNX ops a layer or torch function may export as.

    >>> import fwdtrace
    >>> fwdtrace.onnx_equivalent("mypkg.Swish", "Sigmoid+Mul", "Swish")
    >>> @fwdtrace.onnx_equivalent("mypkg.Block")
    ... def block(node):
    ...     return "Conv+Relu" if node.attrs.get("act", True) else "Conv"

    With patterns, the rule is registered at once. Without, it is a decorator: the
    function gets the trace :class:`~fwdtrace.Node` (its ``attrs``, ``inputs``) and returns a
    pattern, a list of alternative patterns, or None when the call may vanish. A pattern
    lists the ops of one call joined by ``+`` (``"Mul*2+Erf"`` for repeats); shape ops
    (Reshape, Transpose, ...) never need listing. ``optional=True`` lets the call vanish
    from the export; ``folds_into=("Conv",)`` lets it vanish into the op that feeds it.
    A later rule for the same target replaces the earlier one.
    """
    name = _target_name(target)
    folds = frozenset(folds_into)
    if patterns or optional or folds:
        parsed = tuple(Pattern.parse(p) for p in patterns)
        _set_rule(name, _Rule(lambda node: [p.text for p in parsed], optional, folds))
        return None

    def decorate(fn: F) -> F:
        if not callable(fn) or not _takes_one_argument(fn):
            raise FwdtraceError(
                f"@onnx_equivalent({target!r}) expected a function of one argument (the trace node), got {describe(fn)}"
            )
        _set_rule(name, _Rule(fn, optional, folds))
        return fn

    return decorate


def _set_rule(name: str, rule: _Rule) -> None:
    _RULES[name] = rule
    _inherited.clear()  # an ancestor may have gained a rule


def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:  # builtins without a signature: let the call decide
        return True
    return True


# Where torch's own Python wrappers define a Tensor method, a mode sees it under their
# module: ``x ** 2`` arrives as ``torch._tensor.TensorBase.pow``. Such a call is the method.
_TENSOR_ALIASES = ("torch._tensor.TensorBase.", "torch._C.TensorBase.", "torch._C._TensorBase.", "torch._tensor.Tensor.")


def canonical_target(target: str) -> str:
    """The name rules use for a trace target: ``torch.Tensor.pow`` for ``torch._tensor.TensorBase.pow``.

    >>> canonical_target("torch._tensor.TensorBase.pow"), canonical_target("torch.nn.Conv2d")
    ('torch.Tensor.pow', 'torch.nn.Conv2d')
    """
    for prefix in _TENSOR_ALIASES:
        if target.startswith(prefix):
            return "torch.Tensor." + target[len(prefix):]
    return target


def note_classes(classes: Iterable[type]) -> None:
    """Remember layer classes by target name: a class made in a function is in no module to look it up in."""
    for cls in classes:
        _known_classes[qualified_name(cls)] = cls


def _class_named(target: str) -> type | None:
    """The class a layer target names, from :func:`note_classes` or the modules already imported."""
    if target in _known_classes:
        return _known_classes[target]
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        obj: Any = sys.modules.get(".".join(parts[:i]))
        if obj is None:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        return obj if isinstance(obj, type) else None
    return None


def inherited_rule_target(target: str) -> str | None:
    """The ancestor whose rule a layer class without one takes: ``torch.nn.LayerNorm`` for a subclass.

    Only a subclass that runs its ancestor's ``forward`` is that ancestor; one with a
    ``forward`` of its own may do anything (timm's ``BatchNormAct2d`` adds an activation)
    and is compared as the calls it makes (see :func:`fwdtrace.check_onnx`).
    """
    if target in _inherited:
        return _inherited[target]
    found = None
    cls = _class_named(target)
    if cls is None:
        # a class made at run time is in no module: unless it is a parametrized torch layer, which is
        # known by name, say nothing for now, and nothing cached (noted later, it may be found)
        if target.startswith(_PARAMETRIZED):
            return rule_target(f"torch.nn.{target.removeprefix(_PARAMETRIZED)}")
        return None
    if issubclass(cls, torch.nn.Module):
        owner = next((k for k in cls.__mro__ if "forward" in k.__dict__), torch.nn.Module)
        for base in cls.__mro__[1:]:
            if qualified_name(base) in _RULES:
                found = qualified_name(base) if issubclass(base, owner) else None
                break
    _inherited[target] = found
    return found


# torch.nn.utils.parametrize (weight_norm, spectral_norm, orthogonal) swaps a layer's class for one
# it makes at run time, ``Parametrized<Layer>``, with properties for the weights and the layer's forward
_PARAMETRIZED = "torch.nn.utils.parametrize.Parametrized"


def rule_target(target: str) -> str | None:
    """The registered target whose rule applies to ``target`` (itself, its canonical name or an ancestor).

    A torch op with an :func:`fwdtrace.onnx_symbolic` and no rule gets one derived from the
    ONNX ops its symbolic emits. A torch function no rule names gets one derived from
    onnxscript's torchlib, the table the dynamo exporter itself emits with (``torch.addcmul``
    is ``aten::addcmul``: Mul*2+Add).
    """
    _load_plugins_once()
    name = canonical_target(target)
    if name in _RULES:
        return name
    return inherited_rule_target(name) or _symbolic_rule(name) or _torchlib_rule(name)


# torch op -> (its symbolic, the rule derived from it): re-derived when the symbolic changes
_symbolic_rules: dict[str, tuple[Any, _Rule]] = {}


def _symbolic_rule(name: str) -> str | None:
    """``name`` when a torch op of that name has a symbolic (``mylib.twice``), its rule derived; else None.

    Layer classes are left out: torch's exporters do not run a layer's symbolic, they export
    what its forward calls, which check_onnx compares by opening the layer.
    """
    from .emit import _SYMBOLICS

    fn = _SYMBOLICS.get(name)
    if fn is None or _class_named(name) is not None:
        return None
    done = _symbolic_rules.get(name)
    if done is None or done[0] is not fn:
        pattern = _symbolic_pattern(fn)
        if pattern is None:
            return None
        done = _symbolic_rules[name] = (fn, _Rule((lambda node: pattern or None), False, frozenset()))
    return name


def _symbolic_pattern(fn: Any) -> str | None:
    """The pattern of the ONNX ops a symbolic emits, read from the function (as torchlib's are), or None."""
    try:
        proto = getattr(fn, "to_function_proto", None)  # an onnxscript function
        ops = [n.op_type for n in proto().node] if proto is not None else _OP_CALL.findall(inspect.getsource(fn))
    except (OSError, TypeError, AttributeError):
        return None
    counts = Counter(op for op in ops if op not in _NOT_WORK)
    return "+".join(f"{op}*{n}" for op, n in sorted(counts.items()))


# ONNX ops of torchlib's functions that carry no computation of their own.
_NOT_WORK = ONNX_WIRING_OPS | {"Constant", "ConstantOfShape", "Shape", "Size", "If", "Range", "Loop"}
_OP_CALL = re.compile(r"\bop\.([A-Z][A-Za-z0-9]*)\(")
_torchlib_done: dict[str, str | None] = {}  # torch function -> its derived pattern, None if none


def _torchlib_rule(name: str) -> str | None:
    """Register and return a rule for torch function ``name`` from torchlib's ``aten::`` function, if any."""
    if name not in _torchlib_done:
        _torchlib_done[name] = _torchlib_pattern(name)
    pattern = _torchlib_done[name]
    if pattern is None:
        return None
    if name not in _RULES:
        _set_rule(name, _Rule((lambda node: pattern or None), False, frozenset()))
    return name


def _torchlib_pattern(name: str) -> str | None:
    """The pattern of torchlib's ``aten::`` function for torch function ``name`` ('' for pure wiring), or None."""
    prefix, _, short = name.rpartition(".")
    if prefix not in ("torch", "torch.Tensor", "torch.nn.functional", "torch.special", "torch.linalg"):
        return None
    aten = short.strip("_") if short.startswith("__") else short.removesuffix("_")
    if short.startswith("__i"):
        aten = aten[1:]  # __iadd__ is add
    counts = _torchlib_ops(f"aten::{_ATEN_ALIASES.get(aten, aten)}")
    if counts is None:
        return None
    return "+".join(f"{op}*{n}" for op, n in sorted(counts.items()) if op not in _NOT_WORK)


_ATEN_ALIASES = {"norm": "linalg_vector_norm", "absolute": "abs", "arctan": "atan", "true_divide": "div"}


def _torchlib_ops(aten: str) -> Counter[str] | None:
    """How many times each ONNX op appears in torchlib's implementations of ``aten`` (all overloads)."""
    try:
        import onnxscript.function_libs.torch_lib.ops  # noqa: F401 - registers the functions
        from onnxscript.function_libs.torch_lib.registration import default_registry
    except ImportError:  # pragma: no cover - onnxscript is a dependency
        return None
    entry = default_registry._registry.get(aten)
    if entry is None:
        return None
    counts: Counter[str] = Counter()
    for fn in entry.overloads:
        try:
            ops = [n.op_type for n in fn.to_function_proto().node]
        except AttributeError:  # a traced function: its ops are in its source
            try:
                ops = _OP_CALL.findall(inspect.getsource(fn.func))
            except (OSError, TypeError):
                continue
        counts |= Counter(ops)
    return counts


def equivalence_for(node: Node) -> Equivalence | None:
    """The :class:`Equivalence` registered for ``node.target``, or None when no rule knows it.

    >>> import torch, fwdtrace
    >>> from torch.nn.modules.linear import NonDynamicallyQuantizableLinear  # a Linear, forward and all
    >>> node = fwdtrace.trace(NonDynamicallyQuantizableLinear(4, 2), torch.ones(1, 4)).nodes[1]
    >>> equivalence_for(node).source, [p.text for p in equivalence_for(node).patterns]
    ('torch.nn.Linear', ['Gemm', 'MatMul+Add', 'MatMul'])
    """
    name = rule_target(node.target)
    if name is None:
        return None
    rule = _RULES[name] if name in _RULES else _symbolic_rules[name][1]
    result = rule.fn(node)
    texts = (result,) if isinstance(result, str) else tuple(result or ())
    key = (texts, rule.optional, rule.folds_into)
    eq = rule.cache.get(key)
    if eq is None:
        eq = Equivalence(
            tuple(Pattern.parse(t) for t in texts),
            optional=rule.optional or not texts,
            folds_into=rule.folds_into,
            source=name,
        )
        rule.cache[key] = eq
    return eq


def _load_plugins_once() -> None:
    global _loaded_plugins
    if not _loaded_plugins:
        from ..plugins import load_plugins

        _loaded_plugins = True
        load_plugins()


# -- the built-in rules ---------------------------------------------------------------------------
def _register(targets: Iterable[str], *patterns: str, optional: bool = False, folds_into: Iterable[str] = ()) -> None:
    for t in targets:
        onnx_equivalent(t, *patterns, optional=optional, folds_into=folds_into)


def _functions(*names: str) -> list[str]:
    """``torch.X``, ``torch.Tensor.X`` and ``torch.nn.functional.X`` for each name that exists."""
    out = []
    for n in names:
        for owner, prefix in ((torch, "torch"), (torch.Tensor, "torch.Tensor"), (torch.nn.functional, "torch.nn.functional")):
            if hasattr(owner, n):
                out.append(f"{prefix}.{n}")
    return out


def _binary(name: str) -> list[str]:
    """``x + y`` is traced as ``torch.Tensor.add``, ``__add__``, ``__radd__``, ``__iadd__`` or ``add_``."""
    return _functions(name, f"{name}_") + [f"torch.Tensor.__{name}__", f"torch.Tensor.__r{name}__", f"torch.Tensor.__i{name}__"]


def _nn(*names: str) -> list[str]:
    return [f"torch.nn.{n}" for n in names]


_CASTS = ("float", "double", "half", "bfloat16", "int", "long", "short", "char", "byte", "bool", "cpu", "cuda")
# Calls whose tensors after the first give only a shape or a dtype: ``y.reshape_as(x)``
# reads none of x's values, and an export has no edge from x.
SHAPE_ONLY_AFTER_FIRST = frozenset(_functions("reshape_as", "view_as", "expand_as", "type_as"))
NEW_TENSOR_FUNCTIONS = frozenset(
    _functions("zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like",
               "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor")
)


# In-place calls whose result does not depend on what they overwrite: ``y.zero_()`` is a
# constant like ``zeros_like(y)``; through a view (``y[:, :2].zero_()``) it is a write into y.
OVERWRITE_FUNCTIONS = frozenset(_functions("zero_", "fill_"))


# Views, layout and copies: wiring on both sides.
_register(
    _functions(
        "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute", "contiguous",
        "squeeze", "unsqueeze", "expand", "expand_as", "t", "chunk", "split", "unbind", "narrow", "select",
        "movedim", "repeat", "tile", "clone", "detach", "to", "type_as", "type", "swapaxes", "swapdims",
        "moveaxis", "ravel", "squeeze_", "unsqueeze_", "transpose_", "t_",
        "repeat_interleave",  # by a count: Unsqueeze, then Tile or Expand, then Reshape
    )
    + [f"torch.Tensor.{cast}" for cast in _CASTS]
    + ["torch.Tensor.__getitem__", "torch.Tensor.T", "torch.Tensor.mT", "torch._pack_padded_sequence",
       "torch._pad_packed_sequence", "torch.nn.utils.rnn.pack_padded_sequence",
       "torch.nn.utils.rnn.pad_packed_sequence"]
    + _nn("Flatten", "Unflatten", "Identity"),
    optional=True,
)


def _getitem(node: Node) -> RuleResult:
    # x[mask] selects by a boolean mask: exporters take the mask's indices with a NonZero first
    return ["NonZero+GatherND", "NonZero+Gather", "NonZero"] if any(r.dtype == "bool" for r in node.inputs[1:]) else None


_set_rule("torch.Tensor.__getitem__", _Rule(_getitem, True, frozenset()))  # optional: one NonZero may serve two


# New tensors shaped like their input carry none of its values: not an edge from it (the
# comparison takes them for constants; a random one may stay in the export as *Like ops).
_register(OVERWRITE_FUNCTIONS, optional=True)
_register(NEW_TENSOR_FUNCTIONS, "RandomNormalLike", "RandomUniformLike", "RandomNormal", "RandomUniform", optional=True)
# Dropout is an ONNX Dropout in a training-mode export and nothing at all in eval mode.
_register(
    _functions("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
    + _nn("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout"),
    "Dropout",
    optional=True,
)


def _dropout(node: Node) -> RuleResult:
    # Emitted from the ATen calls (to_onnx), F.dropout(training=True) is a Mul by its mask (the mask
    # drawn apart by bernoulli's RandomUniformLike: a new tensor, which the comparison takes for a
    # constant). Only where the call says it trains: in eval mode a Mul nearby is another call's.
    return ("Dropout", "Mul") if node.attrs.get("training") is True else ("Dropout",)


for _target in _functions("dropout"):
    _set_rule(_target, _Rule(_dropout, True, frozenset()))

_register(_nn("Conv1d", "Conv2d", "Conv3d") + _functions("conv1d", "conv2d", "conv3d"), "Conv")
_register(
    _nn("ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")
    + _functions("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    "ConvTranspose",
)
_register(_nn("Linear") + _functions("linear"), "Gemm", "MatMul+Add", "MatMul")
_register(_functions("matmul", "mm", "bmm") + ["torch.Tensor.__matmul__", "torch.Tensor.__rmatmul__"], "MatMul", "Gemm")
_register(_functions("addmm", "baddbmm"), "Gemm", "MatMul+Add", "MatMul+Mul+Add")
_register(
    _nn("BatchNorm1d", "BatchNorm2d", "BatchNorm3d") + _functions("batch_norm"),
    "BatchNormalization",
    "Mul+Add",  # eval mode with nothing to fold into: a scale and a shift
    folds_into=("Conv", "ConvTranspose", "Gemm", "MatMul"),
)
_register(
    _nn("LayerNorm") + _functions("layer_norm"),
    "LayerNormalization",
    # opset < 17 writes it out: mean, centre, variance, normalise, scale and shift
    "ReduceMean*2+Sub+Pow+Add*2+Sqrt+Div+Mul",
)
_register(_nn("RMSNorm") + _functions("rms_norm"), "RMSNormalization", "Pow+ReduceMean+Add+Sqrt+Reciprocal+Div+Mul*2")
_register(
    _nn("GroupNorm") + _functions("group_norm"),
    "GroupNormalization", "InstanceNormalization+Mul+Add", "GroupNormalization+Mul+Add",
)
_register(_nn("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d") + _functions("instance_norm"),
          "InstanceNormalization")
_register(_nn("Embedding") + _functions("embedding"), "Gather")
_register(_nn("ReLU") + _functions("relu", "relu_"), "Relu")
_register(_nn("ReLU6", "Hardtanh") + _functions("relu6", "hardtanh", "clamp", "clip", "clamp_", "clamp_min",
                                                 "clamp_max"), "Clip", "Max", "Min", "Max+Min", "Relu")
_register(_nn("LeakyReLU") + _functions("leaky_relu"), "LeakyRelu")
_register(_nn("PReLU") + _functions("prelu"), "PRelu")
_register(_nn("ELU") + _functions("elu"), "Elu")
_register(_nn("SELU") + _functions("selu"), "Selu")
_register(_nn("CELU") + _functions("celu"), "Celu")
_register(
    _nn("GELU") + _functions("gelu"),
    "Gelu",
    "Div+Erf+Add+Mul*2",  # exact GELU written out (opset < 20)
    "Mul*5+Pow+Add*2+Tanh",  # the tanh approximation written out
)
_register(_nn("SiLU") + _functions("silu"), "Sigmoid+Mul", "Swish")
_register(_nn("Mish") + _functions("mish"), "Mish", "Softplus+Tanh+Mul")
_register(_nn("Sigmoid") + _functions("sigmoid"), "Sigmoid")
_register(_nn("Tanh") + _functions("tanh"), "Tanh")
_register(_nn("Hardswish") + _functions("hardswish"), "HardSwish", "HardSigmoid+Mul")
_register(_nn("Hardsigmoid") + _functions("hardsigmoid"), "HardSigmoid")
_register(_nn("Softplus") + _functions("softplus"), "Softplus", "Softplus+Greater+Where")
_register(_nn("Softmax") + _functions("softmax"), "Softmax", "ReduceMax+Sub+Exp+ReduceSum+Div", "Exp+ReduceSum+Div")
_register(_nn("LogSoftmax") + _functions("log_softmax"), "LogSoftmax", "Softmax+Log")
# Gumbel noise -log(-log(u)) from a uniform draw (its zeros guarded by a Where) added to the logits, the
# softmax of that over tau; hard=True then puts a one-hot of the argmax in, y_hard - y_soft + y_soft
_GUMBEL_NOISE = "RandomUniformLike+GreaterOrEqual+Where+Log*2+Mul+Neg+Add+Div+Softmax"
_register(_functions("gumbel_softmax"), _GUMBEL_NOISE,
          f"{_GUMBEL_NOISE}+ArgMax+ConstantOfShape+ScatterElements+Sub+Add")
_register(_nn("MaxPool1d", "MaxPool2d", "MaxPool3d") + _functions("max_pool1d", "max_pool2d", "max_pool3d"), "MaxPool")
_register(_nn("AvgPool1d", "AvgPool2d", "AvgPool3d") + _functions("avg_pool1d", "avg_pool2d", "avg_pool3d"),
          "AveragePool")
_register(
    _nn("AdaptiveAvgPool1d", "AdaptiveAvgPool3d") + _functions("adaptive_avg_pool1d", "adaptive_avg_pool3d"),
    "GlobalAveragePool", "ReduceMean", "AveragePool",
)


@onnx_equivalent(torch.nn.AdaptiveAvgPool2d)
def _adaptive_avg_pool2d(node: Node) -> RuleResult:
    # Output sizes that do not divide the input's (7x7 from 2x2: VGG at 64 px) have no ONNX
    # pool: dynamo writes out torch's decomposition, windows gathered with a mask (a Where per
    # dimension whose windows differ in length), summed element by element and divided.
    found = ["GlobalAveragePool", "ReduceMean", "AveragePool"]
    if node.inputs and node.outputs and len(node.inputs[0].shape) >= 2 and len(node.outputs[0].shape) >= 2:
        ragged, window = 0, 1
        for n_in, n_out in zip(node.inputs[0].shape[-2:], node.outputs[0].shape[-2:], strict=True):
            longest, ragged_here = _adaptive_window(n_in, n_out)
            ragged += ragged_here
            window *= longest
        if ragged:
            found.append(f"Where*{ragged}" + (f"+Add*{window - 1}" if window > 1 else "") + "+Div")
    return found


for _target in _functions("adaptive_avg_pool2d"):
    onnx_equivalent(_target)(_adaptive_avg_pool2d)


def _adaptive_window(n_in: int, n_out: int) -> tuple[int, bool]:
    """The longest window of an adaptive pool from ``n_in`` to ``n_out``, and whether windows differ in length.

    As torch's decomposition (``torch._decomp``'s ``adaptive_avg_pool2d``) computes them.
    """
    if n_out <= 0:
        return 1, False
    longest = n_in // n_out + 1
    rest = n_in % n_out
    ragged = not (rest == 0 or n_out % rest == 0)
    if ragged:
        longest += 1
    elif rest == 0:
        longest -= 1
    return longest, ragged
_register(
    _nn("AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d")
    + _functions("adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"),
    "GlobalMaxPool", "ReduceMax", "MaxPool",
)
_register(_nn("Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d") + _functions("interpolate", "upsample"),
          "Resize", "Upsample")
_register(_nn("PixelShuffle") + _functions("pixel_shuffle"), "DepthToSpace")
# A zero pad before a Conv may become that op's own pads (dynamo does it for timm's Conv2dSame);
# with several readers it may stay a Pad for some and vanish into the others (compare.py).
PAD_FUNCTIONS = frozenset(_functions("pad"))
_register(PAD_FUNCTIONS, "Pad", optional=True)
_register(_binary("add"), "Add", "Sum")
_register(_binary("sub") + _functions("rsub"), "Sub")
_register(_binary("mul") + _functions("multiply"), "Mul")
# a scalar over a tensor (9.0 / x) may be TorchScript's Reciprocal, then a Mul by the scalar
_TRUE_DIVIDE = ("Div", "Mul", "Reciprocal+Mul", "Reciprocal")
_register(_binary("truediv"), *_TRUE_DIVIDE)
# Rounding down: a Floor after the Div on floats; on integers (the TorchScript exporter) a Div put
# right where the signs differ and a remainder is left (Less, Xor, Mod, Equal, Not, And, Sub, Where).
_FLOOR_DIVIDE = ("Div+Floor", "Div+Less*2+Xor+Mod+Equal+Not+And+Sub+Where", "Div")
_register(_binary("floordiv") + _functions("floor_divide", "floor_divide_"), *_FLOOR_DIVIDE)


def _div(node: Node) -> RuleResult:
    return {"floor": _FLOOR_DIVIDE, "trunc": ("Div", "Div+Floor+Ceil+Less+Where")}.get(
        str(node.attrs.get("rounding_mode")), _TRUE_DIVIDE
    )


for _target in _binary("div") + _functions("divide"):
    onnx_equivalent(_target)(_div)
_register(_binary("pow"), "Pow", "Mul", "Sqrt")
_register(_functions("neg") + ["torch.Tensor.__neg__"], "Neg")
_register(_functions("cat", "concat", "concatenate", "stack", "hstack", "vstack"), "Concat")
for _name, _op in {
    "sqrt": "Sqrt", "exp": "Exp", "log": "Log", "erf": "Erf", "abs": "Abs", "reciprocal": "Reciprocal",
    "sin": "Sin", "cos": "Cos", "floor": "Floor", "ceil": "Ceil", "round": "Round", "sign": "Sign",
    "masked_fill": "Where", "sum": "ReduceSum", "mean": "ReduceMean", "amax": "ReduceMax",
    "amin": "ReduceMin", "argmax": "ArgMax", "argmin": "ArgMin", "cumsum": "CumSum",
    "topk": "TopK", "minimum": "Min", "maximum": "Max", "logsumexp": "ReduceLogSumExp", "tan": "Tan",
    "atan": "Atan", "asin": "Asin", "acos": "Acos", "sinh": "Sinh", "cosh": "Cosh",
    "prod": "ReduceProd",
}.items():
    _register(_functions(_name, f"{_name}_"), _op)
_register(_functions("where_") + ["torch.Tensor.where"], "Where")


@onnx_equivalent("torch.where")
def _where(node: Node) -> RuleResult:
    # torch.where(cond) alone is torch.nonzero(cond, as_tuple=True): the indices, not a selection
    return "NonZero" if len(node.inputs) == 1 and not node.attrs.get("args") else "Where"


# a % b: ONNX's Mod, or (the TorchScript exporter on floats) written out as a - floor(a / b) * b
_register(_functions("remainder", "remainder_", "fmod", "fmod_") + _binary("mod")[2:], "Mod", "Div+Floor+Mul+Sub")
# torchvision's operators (named by their torch.library namespace: no import of torchvision here),
# as its ONNX symbolics write them (torchvision/ops/_register_onnx_ops.py)
_register(["torchvision.nms"], "NonMaxSuppression")
_register(["torchvision.roi_align"], "RoiAlign")
_register(["torchvision.roi_pool"], "MaxRoiPool")
# torchvision's batched_nms loops over the classes in eager mode (over 1000 boxes on CPU) and offsets
# each class's boxes apart when traced for export: one result, two computations. Every trace records
# it as one call (fwdtrace.registry.WHOLE_FUNCTIONS), compared with the offsets (max + 1, times the
# class, added) and the NonMaxSuppression the export writes, or (TorchScript: torchvision scripts it)
# the If that holds them.
_register([BATCHED_NMS], "NonMaxSuppression+ReduceMax+Add*2+Mul+Gather", "NonMaxSuppression", "If")
# the sorted distinct values (batched_nms's classes, in eager mode and to_onnx's record of it)
_register(_functions("unique"), "Unique")
# einsum is ONNX's Einsum, or, recorded below it (to_onnx), the batched matmul it contracts with
_register(_functions("einsum"), "Einsum", "MatMul")
# Comparisons and boolean logic (masks): ``a > b`` is traced as ``torch.Tensor.__gt__`` or ``gt``.
for _name, _ops in {
    "eq": ("Equal",), "ne": ("Equal+Not",), "gt": ("Greater",), "lt": ("Less",),
    "ge": ("GreaterOrEqual", "Less+Not"), "le": ("LessOrEqual", "Greater+Not"),
    "and": ("And",), "or": ("Or",), "xor": ("Xor",),
}.items():
    _register(_binary(_name) + _functions(f"logical_{_name}", f"bitwise_{_name}", f"{_name}_"), *_ops)
_register(_functions("logical_not", "bitwise_not") + ["torch.Tensor.__invert__"], "Not")
_register(_functions("all"), "ReduceMin", "ReduceProd", "Not+ReduceMax+Not")
_register(_functions("any"), "ReduceMax", "ReduceSum+Greater")
_register(_functions("isnan"), "IsNaN")
_register(_functions("isinf"), "IsInf")
# Indexing by a tensor of indices; indexing by constants is wiring (see fwdtrace.onnx.compare).
_register(_functions("gather", "take_along_dim"), "GatherElements", "Gather", optional=True)
_register(_functions("index_select", "take"), "Gather", optional=True)
# torch.roll is slices put back together; ``x[i] = v`` a scatter, or slices and a Concat
_register(_functions("roll"), "Concat", "Concat*2", "Concat*3", optional=True)
SETITEM_FUNCTIONS = frozenset(["torch.Tensor.__setitem__", *_functions("index_put", "index_put_")])
_register(
    sorted(SETITEM_FUNCTIONS) + _functions("slice_scatter", "select_scatter"),
    "ScatterND", "ScatterElements", "Concat", "Concat*2", "Where", "Expand+ScatterND", optional=True,
)


def scattered_per_dimension(eq: Equivalence, rank: int) -> Equivalence:
    """A write by index into a tensor of ``rank`` dimensions: a scatter per indexed dimension at most.

    >>> eq = Equivalence((Pattern.parse("ScatterND"),))
    >>> [p.text for p in scattered_per_dimension(eq, 2).patterns]
    ['ScatterND', 'ScatterND*2', 'ScatterND+ScatterElements', 'ScatterElements*2', 'Expand+ScatterND*2']

    ``im[y0:y1, x0:x1] = m`` (torchvision's ``paste_mask_in_image``) is a ``slice_scatter``
    per sliced dimension when recorded functionally (to_onnx's two ScatterNDs), where
    TorchScript writes one ScatterND.
    """
    more = (*_scatters(rank), f"Expand+ScatterND*{rank}")
    return replace(eq, patterns=eq.patterns + tuple(Pattern.parse(t) for t in more if t not in
                                                    {p.text for p in eq.patterns}))


def _scatters(dims: int) -> list[str]:
    """``dims`` scatters at most, of either kind: a ``slice_scatter`` (ScatterND) or a ``select_scatter``
    (ScatterElements) per indexed dimension.

    >>> _scatters(2)
    ['ScatterND*2', 'ScatterND+ScatterElements', 'ScatterElements*2']

    A bound on the two counts apart would let one write take the next write's scatter
    (BART's ``shift_tokens_right``: ``ids[:, 1:] = ...`` then ``ids[:, 0] = start``).
    """
    def times(op: str, n: int) -> list[str]:
        return [] if n == 0 else [op if n == 1 else f"{op}*{n}"]

    return ["+".join(times("ScatterND", k) + times("ScatterElements", dims - k)) for k in range(dims, -1, -1) if dims]


def written_through_a_view(eq: Equivalence | None, dims: int) -> Equivalence:
    """What an in-place call through a view of a larger tensor may become: its ops, then the write put back.

    >>> eq = written_through_a_view(Equivalence((Pattern.parse("Mul"),)), 2)
    >>> [p.text for p in eq.patterns]
    ['Mul+ScatterND*2', 'Mul+ScatterND+ScatterElements', 'Mul+ScatterElements*2', 'Mul+Concat*2', 'Mul+Where']

    Exporters turn ``y[:, :2].mul_(2)`` into the Mul on a slice and a scatter into ``y``:
    dynamo a ScatterND or ScatterElements per indexed dimension (``dims`` at most), TorchScript
    one ScatterND; or slices put back together with a Concat, or a Where for a mask. The
    write-back is required: an export that drops it computes something else.
    """
    back = [*_scatters(dims), "Concat*2", "Where"]
    own = [p.text for p in eq.patterns] if eq is not None else []
    texts = [f"{o}+{b}" for o in own for b in back] if own else back
    return Equivalence(
        tuple(Pattern.parse(t) for t in texts),
        folds_into=eq.folds_into if eq is not None else frozenset(),
        source=eq.source if eq is not None else "",
    )


# New tensors holding one value everywhere, and the call that copies into them.
FILL_FUNCTIONS = frozenset(_functions("zeros", "ones", "full", "zeros_like", "ones_like", "full_like",
                                      "new_zeros", "new_ones", "new_full"))
COPY_FUNCTIONS = frozenset(_functions("copy_"))


def copied_into_a_fill(eq: Equivalence | None, dims: int | None, rank: int | None = None) -> Equivalence:
    """What a copy into (a view of) a tensor filled with one value may become: a constant Pad of what is copied.

    >>> [p.text for p in copied_into_a_fill(None, None).patterns], copied_into_a_fill(None, None).optional
    (['Pad'], True)

    ``buf = img.new_full(size, 0); buf[0, :c, :h, :w].copy_(img)`` computes a zero pad of
    ``img``, and torchvision's detectors export it as one when traced (``F.pad`` by sizes
    computed from shapes). ``dims`` is how many dimensions the write indexes when it fills
    part of the buffer: the Pad, or the write put back (:func:`written_through_a_view`). A
    copy that fills all of it is wiring, or a Pad by amounts the export computes (all zero),
    or, given the buffer's ``rank``, the write put back through the view's indices
    (``buf[0].copy_(img)`` recorded functionally is a ``select_scatter``: to_onnx's ScatterElements).
    """
    pad = Pattern.parse("Pad")
    if dims is None:
        back_patterns = written_through_a_view(None, rank).patterns if rank else ()
        return Equivalence((pad, *back_patterns), optional=True, source=eq.source if eq is not None else "")
    back = written_through_a_view(eq, dims)
    return Equivalence((pad, *back.patterns), folds_into=back.folds_into, source=back.source)


_register(_functions("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"),
          "ScatterElements", "ScatterND")
_register(_functions("index_add", "index_add_", "index_copy", "index_copy_", "masked_scatter"),
          "ScatterND", "ScatterElements")
_register(_functions("cross_entropy"), "SoftmaxCrossEntropyLoss", "LogSoftmax+NegativeLogLikelihoodLoss")
_register(_functions("nll_loss"), "NegativeLogLikelihoodLoss")
# windows along one dimension: gathered (dynamo, torchlib's form), or sliced and concatenated (TorchScript)
_register(["torch.Tensor.unfold"], "Add+Gather*2+Sub", "Concat")
# cdist past 25 rows is torch's matrix-product form: the squared norms and -2x concatenated with ones, one
# product, clamped at 0, a square root
_register(_functions("cdist"), "Sub+Pow+ReduceSum+Sqrt", "Sub+Pow*2+ReduceSum", "ReduceSumSquare*2+MatMul+Mul+Add*2+Max+Sqrt",
          "ReduceSum*2+Pow*2+MatMul+Mul+Add*2+Max+Sqrt", "ReduceSum*2+Pow*2+Mul+Concat*2+MatMul+Max+Sqrt",
          "ReduceSum*2+Pow*2+Mul+Concat*2+MatMul+Clip+Sqrt")
_register(_functions("square"), "Mul", "Pow")
_register(_functions("rsqrt"), "Sqrt+Reciprocal", "Sqrt+Div", "Pow")
_register(_functions("max"), "ReduceMax", "Max")
_register(_functions("min"), "ReduceMin", "Min")
_register(_functions("var"), "ReduceMean*2+Sub+Mul+Pow+Div", "ReduceVariance")
# the square root of the variance written out: mean, centre, square, mean, the correction's scale (N / (N - 1))
_register(_functions("std"), "ReduceMean*2+Sub+Mul*2+Pow+Div+Sqrt")
# Masked by an EyeLike (a constant) and summed, then sliced (dynamo) or picked inside an If (a GatherND
# in its branch: TorchScript). torchlib's own form also adds and gathers, on indices an export folds
# away: that rule took the Add of diagonal(c).add(-1) in.
_register(_functions("diagonal"), "Mul+ReduceSum", "Mul+ReduceSum+If")
# the dot product over the norms' product (TorchScript, each norm a sum of squares), or each side over
# its clamped norm, then the dot product (dynamo)
_register(_functions("cosine_similarity"), "Mul*4+ReduceSum*3+Sqrt+Max+Clip+Div",
          "ReduceL2*2+Clip*2+Max*2+Div*2+Mul+ReduceSum")
_register(_functions("normalize"), "LpNormalization", "ReduceL2+Clip+Div", "ReduceL2+Max+Div", "ReduceL2+Div")


@onnx_equivalent("torch.nn.MultiheadAttention")
def _multihead_attention(node: Node) -> RuleResult:
    # Input projections, scaled q.k^T and the weighted sum (two MatMuls), softmax, the
    # output projection; masks add Where/Add and averaged weights a ReduceMean. Self-attention
    # (query is key is value) projects once with the packed weight; otherwise there are up to
    # three projections (kdim/vdim give key and value their own even when they are one tensor).
    # Exact MatMul/Gemm counts for self-attention, so an op slipped into it shows as extra.
    distinct = 1 if len({r.obj_id for r in node.inputs[:3]}) == 1 else 3
    masks = "+Mul*4+Div*2+Sqrt*2+Softmax+Where*3+ReduceMean+Sub+IsNaN+Not+And+Or+Equal+Less"
    out = []
    for proj in ("MatMul", "Gemm"):
        for out_proj, adds in (("Gemm", 0), ("MatMul", 1)):
            ops = Counter({proj: distinct, "Add": distinct + 2 + adds})
            ops["MatMul"] += 2
            ops[out_proj] += 1
            out.append("+".join(f"{op}*{n}" for op, n in sorted(ops.items())) + masks)
    return [*out, "Attention+MatMul*3+Gemm*4+Add*4"]


@onnx_equivalent("torch.nn.functional.scaled_dot_product_attention")
def _sdpa(node: Node) -> RuleResult:
    # to_onnx zeroes a fully masked query row, as eager does: torch's math decomposition guards
    # the softmax (where every score is -inf: Equal, all() as ReduceMin); torchlib's attention
    # (the CPU kernel's op) is guarded after it (where the mask's ReduceMax is -inf: Equal, Where)
    return ["MatMul*2+Mul*3+Div+Sqrt*2+Softmax+Add*2+Where*3+IsNaN+Not+And+Or+Equal+ReduceMin",
            "MatMul*2+Mul*3+Sqrt*2+Softmax+Add*2+Where*2+Equal+ReduceMax", "Attention"]


def _recurrent(op: str) -> Callable[[Node], RuleResult]:
    def rule(node: Node) -> RuleResult:
        layers = int(node.attrs.get("num_layers", 1) or 1)
        # one ONNX op per layer; bidirectional layers stack their two directions with Concat
        return [f"{op}*{layers}" + (f"+Concat*{layers}" if layers > 1 else "")]

    rule.__name__ = f"_{op.lower()}"
    return rule


for _cls in ("LSTM", "GRU", "RNN"):
    onnx_equivalent(f"torch.nn.{_cls}")(_recurrent(_cls))
# One step of a recurrent cell: the ONNX op over a sequence of one, or written out with two
# projections (the hidden state's folds away when it starts at zero).
_register(_nn("LSTMCell") + ["torch.lstm_cell"], "LSTM", "Gemm*2+MatMul*2+Add*4+Sigmoid*3+Tanh*2+Mul*3")
_register(_nn("GRUCell") + ["torch.gru_cell"], "GRU", "Gemm*2+MatMul*2+Add*6+Sigmoid*2+Tanh+Mul*3+Sub")
_register(_nn("RNNCell") + ["torch.rnn_tanh_cell"], "RNN", "Gemm*2+MatMul*2+Add*3+Tanh")
_register(["torch.rnn_relu_cell"], "RNN", "Gemm*2+MatMul*2+Add*3+Relu")


@onnx_equivalent("torch.cat")
def _cat(node: Node) -> RuleResult:
    # cat of one tensor, or with empty ones (a key/value cache's first step), is a copy;
    # exporters may drop it
    return None if sum(1 for r in node.inputs if 0 not in r.shape) <= 1 else "Concat"


def rules() -> dict[str, Callable[[Node], RuleResult]]:
    """Every registered target and its rule function (for inspection and tests)."""
    return {name: rule.fn for name, rule in sorted(_RULES.items())}
