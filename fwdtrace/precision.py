"""How a run computed, and whether two values differ by more than that math explains.

Two runs of one model rarely agree bit for bit: a CUDA convolution under cuDNN's TF32 rounds
its inputs to 10 bits of mantissa, an autocast region computes in bfloat16 or float16. An
elementwise test (``allclose``) then fails on elements near zero while the two tensors are
the same to every purpose (cosine 1.0). So a value is judged three ways, as msprobe's
precision standards do: elementwise error, the norm-relative error ``|a - b| / max(|a|, |b|)``
over the whole tensor, and the cosine of the two. A difference whose norm-relative error is
within ``ROUNDINGS`` unit roundoffs of the least precise math of the two runs, with a cosine
at least that math's ``min_cosine``, is one that rounding explains; anything beyond is a
divergence.

:func:`math_record` says how this process computes now (device, dtypes, autocast, the TF32
switches, deterministic algorithms, torch version); dumps store it, and
:func:`value_precision` reads a value's math from it. :class:`Agreement` gathers the
statistics block by block (a dump's tensors are read in blocks), and
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

__all__ = ["math_record", "value_precision", "pair_precision", "rounding_explains", "Agreement", "PRECISIONS",
           "ROUNDINGS"]


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
# Only arithmetic coarser than float32 explains a difference: two float32 runs that differ are
# judged elementwise, as they always were.
LOWER = ("bfloat16", "float16", "tfloat32")


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
    combined with ``hypot``: no overflow from summing squares.
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

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.is_complex() or b.is_complex():
            a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
        a, b = a.to(torch.float64).reshape(-1), b.to(torch.float64).reshape(-1)
        self.close = self.close and bool(torch.allclose(a, b, rtol=self.rtol, atol=self.atol, equal_nan=True))
        if a.numel() == 0:
            return
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        diff = torch.where(same, torch.zeros_like(a), (a - b).abs())  # inf == inf and nan vs nan are no difference
        scale = torch.maximum(a.abs(), b.abs())
        rel = torch.where(diff == 0, torch.zeros_like(diff), diff / scale)
        self.max_abs = _max(self.max_abs, float(diff.max()))
        self.max_rel = _max(self.max_rel, float(rel.max()))
        self.dot += float(a @ b)
        self.norm_a = math.hypot(self.norm_a, float(a.norm()))
        self.norm_b = math.hypot(self.norm_b, float(b.norm()))
        self.norm_diff = math.hypot(self.norm_diff, float(diff.norm()))

    @property
    def cosine(self) -> float:
        na, nb = self.norm_a, self.norm_b
        if na == 0 and nb == 0:
            return 1.0
        if na == 0 or nb == 0 or not (math.isfinite(na) and math.isfinite(nb)):
            return 1.0 if self.close else math.nan
        return self.dot / (na * nb)

    @property
    def norm_rel(self) -> float:
        """``|a - b| / max(|a|, |b|)`` over the whole tensor: 0 when equal, NaN where a norm is not finite."""
        scale = max(self.norm_a, self.norm_b)
        if self.norm_diff == 0:
            return 0.0
        if not (math.isfinite(scale) and math.isfinite(self.norm_diff)):
            return math.nan
        return self.norm_diff / scale if scale > 0 else math.inf


def _max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def rounding_bound(precision: str) -> float:
    """The norm-relative error that ``precision``'s rounding explains."""
    return ROUNDINGS * PRECISIONS[precision].unit_roundoff


def rounding_explains(norm_rel: float, cosine: float, precision: str) -> str | None:
    """The label of the rounding (``"TF32"``) that explains a difference of ``norm_rel`` and ``cosine``
    between two values judged in ``precision``, or None: a float32 or finer difference, or one beyond
    :func:`rounding_bound` or below the precision's least cosine."""
    if precision not in LOWER or not (math.isfinite(norm_rel) and math.isfinite(cosine)):
        return None
    p = PRECISIONS[precision]
    return p.label if norm_rel <= rounding_bound(precision) and cosine >= p.min_cosine else None
