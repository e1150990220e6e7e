"""How a run computed, and whether two values differ by more than that math explains.

Two runs of one model rarely agree bit for bit: a CUDA convolution under cuDNN's TF32 rounds
its inputs to 10 bits of mantissa, an autocast region computes in bfloat16 or float16. An
elementwise test (``allclose``) then fails on elements near zero while the two tensors are
the same to every purpose (cosine 1.0). So a value is judged three ways, as msprobe's
precision standards do: elementwise error, the norm-relative error ``|a - b| / max(|a|, |b|)``
over the whole tensor, and the cosine of the two. A difference whose norm-relative error is
within ``ROUNDINGS`` unit roundoffs of the least precise math of the two runs, with a cosine
at least that math's ``min_cosine``, is one that rounding explains; anything beyond is a
divergence. Two float32 runs differ by the order their reductions add in: a difference within
the caller's ``rtol`` as a whole (norm-relative) with float32's least cosine is that noise, even
where elements near zero fail ``allclose``.

That bound is a blanket over a whole run: in bfloat16 it is 8%, so a bug that changes a layer by
3% passes under it. A call is therefore also judged by the error it *adds*: its outputs' error
against its inputs' (:func:`added_error`). A call that rounds its inputs, weights and outputs once
each in ``precision`` and accumulates in float32 adds a few unit roundoffs
(:func:`added_bound`); one that adds more is a divergence, whatever the blanket says.

:func:`math_record` says how this process computes now (device, dtypes, autocast, the TF32
switches, deterministic algorithms, torch version); dumps store it, and
:func:`value_precision` reads a value's math from it. :class:`Agreement` gathers the
statistics block by block (a dump's tensors are read in blocks), or for every row of two matrices
at once by the same code (:meth:`Agreement.add_rows`: a statistics dump's vectors), and
:func:`rounding_explains` gives the verdict: both :func:`fwdtrace.compare_dumps` and
:func:`fwdtrace.check_onnx`'s numeric check use them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["math_record", "value_precision", "pair_precision", "rounding_explains", "explains", "added_error",
           "added_bound", "condition", "follows_dtype", "Agreement", "PRECISIONS", "ROUNDINGS", "ADDED", "AMPLIFY", "RATIOS"]


@dataclass(frozen=True)
class Precision:
    """One kind of arithmetic: its unit roundoff (half the gap between 1 and the next number) and the
    least cosine msprobe's standards accept for values computed in it."""

    name: str
    label: str  # how a report names it: "TF32", "bfloat16"
    unit_roundoff: float
    min_cosine: float


# least precise first. TF32 keeps float32's range with float16's 10 bits of mantissa.
PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("bfloat16", "bfloat16", 2.0 ** -8, 0.99),
    Precision("float16", "float16", 2.0 ** -11, 0.99),
    Precision("tfloat32", "TF32", 2.0 ** -11, 0.999),
    Precision("float32", "float32", 2.0 ** -24, 0.99999),
    Precision("float64", "float64", 2.0 ** -53, 0.9999999),
)}
# How many unit roundoffs of norm-relative error rounding explains: the inputs of each op are
# rounded once (one roundoff each), a sum of n products grows that by about sqrt(n) for random
# signs, and a forward and backward pass chain a few such ops. 20 keeps TF32 and float16 at 1e-2
# (a ResNet's CPU-against-TF32 dump differs by 1e-3) and bfloat16 at 8e-2.
ROUNDINGS = 20.0
# The arithmetic whose rounding :func:`rounding_explains` puts a difference down to; float32 and
# float64 differences are reduction order, judged by :func:`explains` against the caller's rtol.
LOWER = ("bfloat16", "float16", "tfloat32")
# What one call adds, in unit roundoffs of its math: its inputs, its weights and its outputs each
# rounded once (about 0.6 u of norm-relative error each, for round-to-nearest), with room for a
# reduction that adds in another order. Measured on a bfloat16 autocast GPT-2 against float32: a
# Linear adds 0.8 to 1.2 u; a 3% change to its weights adds 7.7 u.
ADDED = 4.0
# A call may pass its inputs' error on amplified by this much for free (a product of two inputs
# that each carry the error, a normalisation of a vector whose mean is not zero): beyond it, the
# excess is what the call added.
AMPLIFY = 2.0
# msprobe's error ratios: the share of elements whose relative error exceeds one and five thousandths.
RATIOS = (1e-3, 5e-3)
# Accumulators are float32 below float32 (autocast's matmuls, TF32, cuDNN): a reduction of length K
# adds about sqrt(K) of the accumulator's unit roundoff, not of the inputs' precision.
_ACCUMULATOR = {"bfloat16": "float32", "float16": "float32", "tfloat32": "float32"}


def math_record(model: torch.nn.Module | None = None, inputs: Iterable[Any] = ()) -> dict[str, Any]:
    """How this process computes now, on the device of ``model`` (else of the first tensor of ``inputs``).

    >>> import torch
    >>> record = math_record(torch.nn.Linear(2, 2))
    >>> record["device"], record["dtypes"], record["autocast"]
    ('cpu', 'float32', 'off')

    Keys: ``device`` (``"cuda:0"``), ``device_name`` (the GPU's name, or ``"cpu"``),
    ``dtypes`` (of the model's parameters, comma separated), ``autocast`` (``"off"`` or its
    dtype on that device), ``matmul_allow_tf32``, ``cudnn_allow_tf32``,
    ``float32_matmul_precision``, ``deterministic`` and ``torch``.
    """
    device = _device(model, inputs)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}) if model is not None else []
    autocast = "off"
    with contextlib.suppress(RuntimeError):  # a device type autocast does not know (meta, a plugin's) has none
        if torch.is_autocast_enabled(device.type):
            autocast = str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")
    name = "cpu"
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    return {
        "device": str(device), "device_name": name, "dtypes": ",".join(dtypes), "autocast": autocast,
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": bool(torch.are_deterministic_algorithms_enabled()), "torch": str(torch.__version__),
    }


def _device(model: torch.nn.Module | None, inputs: Iterable[Any]) -> torch.device:
    # A weight on the meta device holds no values: accelerate's cpu_offload and disk_offload keep them
    # there between forwards and bring each layer's in on the device the inputs are on.
    if model is not None:
        for t in (*model.parameters(), *model.buffers()):
            if t.device.type != "meta":
                return t.device
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def value_precision(dtype: str, record: Mapping[str, Any] | None) -> str:
    """The arithmetic a value of ``dtype`` was computed in, by a run's :func:`math_record`.

    A floating value of an autocast run came from that autocast dtype's math (a float32 op
    after a bfloat16 one carries its rounding); a float32 value of a CUDA run with TF32
    allowed, or of any run with ``float32_matmul_precision`` ``"high"`` (``"medium"``:
    bfloat16), may have come through TF32. Without a record, the dtype.
    """
    if dtype not in PRECISIONS or record is None:
        return dtype
    candidates = [dtype]
    autocast = str(record.get("autocast", "off"))
    if autocast in PRECISIONS:
        candidates.append(autocast)
    if dtype == "float32":
        cuda = str(record.get("device", "")).startswith("cuda")
        if cuda and (record.get("matmul_allow_tf32") or record.get("cudnn_allow_tf32")):
            candidates.append("tfloat32")
        matmul = record.get("float32_matmul_precision")
        candidates.append({"high": "tfloat32", "medium": "bfloat16"}.get(str(matmul), dtype))
    return least_precise(candidates)


def least_precise(names: Iterable[str]) -> str:
    """The coarsest of ``names`` that :data:`PRECISIONS` knows (else the first)."""
    names = list(names)
    order = list(PRECISIONS)
    known = [n for n in names if n in PRECISIONS]
    return min(known, key=order.index) if known else names[0]


def pair_precision(dtype_a: str, record_a: Mapping[str, Any] | None, dtype_b: str,
                   record_b: Mapping[str, Any] | None) -> str:
    """The arithmetic two values are to be judged by: the coarser of the two runs'."""
    return least_precise([value_precision(dtype_a, record_a), value_precision(dtype_b, record_b)])


@dataclass
class Agreement:
    """Elementwise and whole-tensor agreement of two tensors, gathered block by block.

    ``close`` is ``torch.allclose`` at ``rtol``/``atol`` over every block (NaNs equal);
    ``max_rel`` is elementwise (to the larger magnitude of the two elements). Norms are
    combined with ``hypot``: no overflow from summing squares. ``over`` counts the elements
    whose relative error exceeds each of :data:`RATIOS` (msprobe's one- and five-in-a-thousand
    ratios: :attr:`ratios`); ``nonfinite_a``/``nonfinite_b`` count each side's inf and NaN and
    ``only_a``/``only_b`` those where the other side is finite (an overflow one run has alone).
    ``equivalent`` holds pairs of constants that count as equal where ``a`` holds the first and
    ``b`` the second: a fill value that follows the dtype (:func:`follows_dtype`).

    >>> g = Agreement(); g.add(torch.tensor([1.0, 2.0, float("inf")]), torch.tensor([1.0, 2.004, 3.0]))
    >>> g.over, g.only_a, g.nonfinite_b  # 2.004 against 2 is over one thousandth; inf against 3 over both
    ((2, 1), 1, 0)
    """

    rtol: float = 0.0
    atol: float = 0.0
    close: bool = True
    max_abs: float = 0.0
    max_rel: float = 0.0
    dot: float = 0.0
    norm_a: float = 0.0
    norm_b: float = 0.0
    norm_diff: float = 0.0
    count: int = 0
    over: tuple[int, int] = (0, 0)
    nonfinite_a: int = 0
    nonfinite_b: int = 0
    only_a: int = 0
    only_b: int = 0
    magnitude: float = 0.0  # the largest finite |element| of either side
    equivalent: tuple[tuple[float, float], ...] = ()

    def add(self, a: torch.Tensor | Any, b: torch.Tensor | Any) -> None:
        """Gather one block of each side: tensors, or NumPy arrays (a statistics vector)."""
        # NumPy, not torch: a comparison goes block by block over many small rows, and a NumPy operation on a
        # small array costs a fraction of a torch one (the dozen operations here cost more than reading a row)
        a, b = _float64(a), _float64(b)
        if a.size == 0:
            return
        self.merge(_Blocks(a[None], b[None], self.rtol, self.atol, self.equivalent), 0)

    @staticmethod
    def add_rows(agreements: list[Agreement], a: Any, b: Any) -> None:
        """Gather row ``i`` of ``a`` against row ``i`` of ``b`` (two float64 arrays of one 2-D shape) into
        ``agreements[i]``, for every row in one pass: what ``agreements[i].add(a[i], b[i])`` does. The agreements
        share one ``rtol``, ``atol`` and ``equivalent``.

        >>> import numpy as np
        >>> rows = [Agreement(), Agreement()]
        >>> Agreement.add_rows(rows, np.array([[1.0, 2.0], [1.0, 2.0]]), np.array([[1.0, 2.0], [1.0, 3.0]]))
        >>> [g.close for g in rows]
        [True, False]
        """
        if not agreements or not a.shape[1]:
            return
        first = agreements[0]
        if any((g.rtol, g.atol, g.equivalent) != (first.rtol, first.atol, first.equivalent) for g in agreements):
            raise ValueError("Agreement.add_rows() expected agreements of one rtol, atol and equivalent")
        blocks = _Blocks(a, b, first.rtol, first.atol, first.equivalent)
        for i, agreement in enumerate(agreements):
            agreement.merge(blocks, i)

    def merge(self, blocks: _Blocks, i: int) -> None:
        """Gather row ``i`` of ``blocks`` (one block of each side)."""
        self.close = self.close and bool(blocks.close[i])
        self.count += blocks.width
        if blocks.nonfinite is not None:
            nonfinite_a, nonfinite_b, only_a, only_b = (int(n[i]) for n in blocks.nonfinite)
            self.nonfinite_a += nonfinite_a
            self.nonfinite_b += nonfinite_b
            self.only_a += only_a
            self.only_b += only_b
        max_abs, max_rel, dot, squares_a, squares_b, squares_diff, magnitude = (float(x[i]) for x in blocks.sums)
        self.max_abs = _max(self.max_abs, max_abs)
        self.max_rel = _max(self.max_rel, max_rel)
        if blocks.over is not None:
            self.over = tuple(n + int(m[i]) for n, m in zip(self.over, blocks.over, strict=True))  # type: ignore[assignment]
        self.dot += dot
        self.norm_a = math.hypot(self.norm_a, math.sqrt(squares_a))
        self.norm_b = math.hypot(self.norm_b, math.sqrt(squares_b))
        self.norm_diff = math.hypot(self.norm_diff, math.sqrt(squares_diff))
        self.magnitude = max(self.magnitude, magnitude)

    @property
    def cosine(self) -> float:
        na, nb = self.norm_a, self.norm_b
        if na == 0 and nb == 0:
            return 1.0
        if na == 0 or nb == 0 or not (math.isfinite(na) and math.isfinite(nb)):
            return 1.0 if self.close else math.nan
        return self.dot / (na * nb)

    @property
    def ratios(self) -> tuple[float, float]:
        """The share of elements whose relative error exceeds one thousandth and five thousandths."""
        return tuple(n / self.count if self.count else 0.0 for n in self.over)  # type: ignore[return-value]

    @property
    def norm_rel(self) -> float:
        """``|a - b| / max(|a|, |b|)`` over the whole tensor: 0 when equal, NaN where a norm is not finite."""
        scale = max(self.norm_a, self.norm_b)
        if self.norm_diff == 0:
            return 0.0
        if not (math.isfinite(scale) and math.isfinite(self.norm_diff)):
            return math.nan
        return self.norm_diff / scale if scale > 0 else math.inf


class _Blocks:
    """One block of each side per row (``a[i]`` against ``b[i]``, 2-D float64 arrays of one shape), reduced row by
    row to what :class:`Agreement` gathers: one pass of NumPy over all the rows, so comparing a statistics dump's
    hundreds of vectors costs a few operations, not a few per vector.

    ``close`` per row; ``sums``, each an array over the rows: max abs and relative error, the dot product, the
    three sums of squares and the largest finite magnitude; ``over`` (the counts over :data:`RATIOS`) and
    ``nonfinite`` (each side's inf and NaN, and those where the other side is finite) the same, or None where all
    are zero.
    """

    def __init__(self, a: Any, b: Any, rtol: float, atol: float, equivalent: tuple[tuple[float, float], ...]) -> None:
        import numpy as np

        self.width = a.shape[1]
        with np.errstate(all="ignore"):
            # einsum: a single-threaded sum, where @ and linalg.norm call a BLAS that may wake threads per block
            squares_a, squares_b = np.einsum("ij,ij->i", a, a), np.einsum("ij,ij->i", b, b)
            # finite sums of squares: every element finite, known without a pass of its own (one past float64's
            # range takes the general way, which gives the same for finite elements)
            all_finite = not equivalent and bool(np.isfinite(squares_a).all()) and bool(np.isfinite(squares_b).all())
            if all_finite:
                # finite values are the same where they are equal: |a - b| is 0 there already
                diff = np.abs(a - b)
                same = None
            else:
                same = (a == b) | (np.isnan(a) & np.isnan(b))
                for const_a, const_b in equivalent:
                    same |= (a == const_a) & (b == const_b)
                if equivalent:
                    # the constants count as equal: compare b's where a holds its own (so allclose and the norms agree)
                    a = np.where(same, b, a)
                    squares_a = np.einsum("ij,ij->i", a, a)
                finite_a, finite_b = np.isfinite(a), np.isfinite(b)
                all_finite = bool(finite_a.all()) and bool(finite_b.all())
                diff = np.where(same, 0.0, np.abs(a - b))  # inf == inf and nan vs nan are no difference
            self.nonfinite = None if all_finite else (
                (~finite_a).sum(1), (~finite_b).sum(1), (~finite_a & finite_b).sum(1), (finite_a & ~finite_b).sum(1))
            # torch.allclose's rule (equal_nan): equal, or a finite difference within atol + rtol |b|
            magnitude_b = np.abs(b)
            within = diff <= atol + rtol * magnitude_b
            self.close = (within if same is None else same | (np.isfinite(diff) & within)).all(1)
            scale = np.maximum(np.abs(a), magnitude_b)
            rel = np.where(diff == 0, 0.0, diff / scale)
            max_rel = rel.max(1)
            self.over = None
            if not (max_rel <= RATIOS[0]).all():
                # a NaN's relative error (nan against a number) counts as over either bound
                self.over = tuple((~(rel <= bound)).sum(1) for bound in RATIOS)
            finite = scale if all_finite else np.where(finite_a & finite_b, scale, 0.0)
            self.sums = (diff.max(1), max_rel, np.einsum("ij,ij->i", a, b), squares_a, squares_b,
                         np.einsum("ij,ij->i", diff, diff), finite.max(1))


def _float64(x: torch.Tensor | Any) -> Any:
    """A tensor or array as a flat float64 NumPy array (a complex one as its real and imaginary parts)."""
    import numpy as np

    if isinstance(x, torch.Tensor):
        from ._host import host, to_numpy

        x = host(x)  # cast on the host, after the copy
        x = torch.view_as_real(x.to(torch.complex128)) if x.is_complex() else x.to(torch.float64)
        return to_numpy(x.reshape(-1))
    x = np.asarray(x)
    return (x.astype(np.complex128).view(np.float64) if np.iscomplexobj(x) else x.astype(np.float64, copy=False)
            ).reshape(-1)


def _max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def rounding_bound(precision: str) -> float:
    """The norm-relative error that ``precision``'s rounding explains."""
    return ROUNDINGS * PRECISIONS[precision].unit_roundoff


def rounding_explains(norm_rel: float, cosine: float, precision: str) -> str | None:
    """The label of the rounding (``"TF32"``) that explains a difference of ``norm_rel`` and ``cosine``
    between two values judged in ``precision``, or None: a float32 or finer difference (:func:`explains`
    judges those, by reduction order), or one beyond :func:`rounding_bound` or below the precision's
    least cosine."""
    if precision not in LOWER or not (math.isfinite(norm_rel) and math.isfinite(cosine)):
        return None
    p = PRECISIONS[precision]
    return p.label if norm_rel <= rounding_bound(precision) and cosine >= p.min_cosine else None


def explains(norm_rel: float, cosine: float, precision: str, rtol: float = 0.0) -> str | None:
    """What explains a difference of ``norm_rel`` and ``cosine`` between two values judged in ``precision``.

    >>> explains(1e-7, 1.0, "float32", rtol=1e-5), explains(1e-3, 0.99, "float32", rtol=1e-5)
    ('float32', None)
    >>> explains(0.05, 0.999, "bfloat16")
    'bfloat16'

    Below float32, :func:`rounding_explains`. In float32 or float64, the order reductions add in:
    a norm-relative error within ``rtol`` (and at least what ``ROUNDINGS`` of the precision's unit
    roundoffs explain) with the precision's least cosine, labelled by the precision. None otherwise.
    """
    if precision in LOWER:
        return rounding_explains(norm_rel, cosine, precision)
    p = PRECISIONS.get(precision)
    if p is None or not (math.isfinite(norm_rel) and math.isfinite(cosine)):
        return None
    return p.label if norm_rel <= max(rounding_bound(precision), rtol) and cosine >= p.min_cosine else None


def added_bound(precision: str, reduction: int = 1, calls: int = 1) -> float:
    """The norm-relative error one call computed in ``precision`` adds by rounding alone.

    >>> round(added_bound("bfloat16") / PRECISIONS["bfloat16"].unit_roundoff, 3)
    4.0

    :data:`ADDED` unit roundoffs of ``precision`` (its inputs, weights and outputs rounded once
    each), plus a reduction of length ``reduction`` that adds in another order: about
    ``sqrt(reduction)`` unit roundoffs of its accumulator (float32 below float32: autocast, TF32).
    ``calls`` is how many recorded calls a module's call holds: their roundings add in quadrature.
    """
    p = PRECISIONS.get(precision)
    if p is None:
        return 0.0
    accumulator = PRECISIONS[_ACCUMULATOR.get(precision, precision)]
    own = ADDED * p.unit_roundoff + math.sqrt(max(reduction, 1)) * accumulator.unit_roundoff
    return own * math.sqrt(max(calls, 1))


def added_error(output: float, inputs: Iterable[float], condition: float = 1.0) -> float:
    """The norm-relative error a call added: its output's beyond its inputs' worst, amplified by :data:`AMPLIFY`
    times ``condition``.

    >>> round(added_error(0.03, [0.001]), 4), added_error(0.004, [0.003])
    (0.0299, 0.0)

    Independent errors add in quadrature, so the excess is ``sqrt(output² - (AMPLIFY · condition · input)²)``.
    ``condition`` is how much more the call may amplify its inputs' relative error: an exponential
    (``softmax``, ``exp``, ``sigmoid``) turns an input's relative error into an absolute error as
    large as the input's magnitude, so softmax over logits of 30 passes a 0.1% error on as 3%
    (:func:`condition`).
    """
    carried = AMPLIFY * condition * max(inputs, default=0.0)
    if not math.isfinite(output) or not math.isfinite(carried):
        return math.nan
    return math.sqrt(output * output - carried * carried) if output > carried else 0.0


# Calls whose output's relative error is their input's absolute error: an input relative error grows
# by the input's magnitude (softmax over sharp logits). Matched on a function's or class's last name.
_EXPONENTIAL = frozenset({"softmax", "log_softmax", "_softmax", "_log_softmax", "exp", "exp2", "expm1", "logsumexp",
                          "sigmoid", "tanh", "softplus", "silu", "elu", "selu", "celu", "mish", "pow"})


def condition(name: str, magnitude: float, container: bool = False) -> float:
    """How much more than :data:`AMPLIFY` a call named ``name`` may amplify its inputs' relative error, for
    inputs whose largest element is ``magnitude``.

    >>> condition("torch.Tensor.softmax", 30.0), condition("torch.nn.functional.linear", 30.0)
    (30.0, 1.0)

    An exponential (:data:`_EXPONENTIAL`: ``softmax``, ``exp``, ``sigmoid``, ...) by the input's
    magnitude; a ``container`` (a module's call whose inner ops the dump does not all hold, such as an
    attention block's softmax) the same, as it may hold one; anything else 1.
    """
    last = name.rsplit(".", 1)[-1].lower()
    if container or last in _EXPONENTIAL:
        return max(1.0, magnitude)
    return 1.0


# The constants of torch.finfo a model computes with (a causal mask's fill value, a clamp's bounds).
_FINFO = ("min", "max", "eps", "tiny", "smallest_normal", "resolution")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def follows_dtype(value_a: Any, value_b: Any) -> str | None:
    """How two differing arguments of a call are one constant of two dtypes, or None.

    >>> follows_dtype(torch.finfo(torch.float32).min, torch.finfo(torch.float16).min)
    'finfo(float32).min vs finfo(float16).min'
    >>> follows_dtype("float32", "bfloat16"), follows_dtype(0.5, 0.25)
    ('dtype float32 vs bfloat16', None)

    A fill value written ``torch.finfo(x.dtype).min`` is -3.4e38 in a float32 run and -65504 in a
    float16 one: the runs differ there because their dtypes do, not because the code does. A dtype
    argument of two different floating dtypes is the same case.
    """
    names = {str(d).removeprefix("torch."): d for d in _FLOATS}
    if isinstance(value_a, str) and isinstance(value_b, str):
        return f"dtype {value_a} vs {value_b}" if value_a in names and value_b in names and value_a != value_b else None
    if isinstance(value_a, bool) or isinstance(value_b, bool) or not isinstance(value_a, (int, float)) \
            or not isinstance(value_b, (int, float)):
        return None
    for attr in _FINFO:
        found_a = [n for n, d in names.items() if float(getattr(torch.finfo(d), attr)) == value_a]
        found_b = [n for n, d in names.items() if float(getattr(torch.finfo(d), attr)) == value_b]
        if found_a and found_b and set(found_a) != set(found_b):
            return f"finfo({found_a[0]}).{attr} vs finfo({found_b[0]}).{attr}"
    return None
