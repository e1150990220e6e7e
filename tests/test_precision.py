"""Comparisons that know the math: a run's math record, and differences rounding explains.

No GPU here: TF32 is emulated the way the hardware computes it, each convolution's and
matmul's inputs and weights rounded to 10 bits of mantissa, and the dump's math record says
what a CUDA run with cuDNN's TF32 says. bfloat16 is real: CPU autocast.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import h5py
import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace import precision
from fwdtrace.dump import MATH_PREFIX


def tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to nearest with TF32's 10-bit mantissa, as tensor cores read it."""
    bits = x.detach().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _emulate_tf32(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose convolutions and linear layers compute as under TF32."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            with torch.no_grad():
                m.weight.copy_(tf32(m.weight))
            # Inside the layer, as a TF32 kernel rounds: the call's input (what a dump records) is the
            # run's own, the product reads it rounded; straight through, the gradient flows as it was.
            def forward(x: torch.Tensor, _forward=m.forward) -> torch.Tensor:
                return _forward(x + (tf32(x) - x).detach())

            m.forward = forward  # type: ignore[method-assign]
    return model


def _dump(model: nn.Module, directory: Path, autocast: torch.dtype | None = None) -> Path:
    dumper = fwdtrace.Dumper(directory)
    dumper.register(model)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        out = model(X)
    out.float().logsumexp(1).sum().backward()
    (path,) = dumper.remove()
    return path


def _set_math(path: Path, **values: object) -> None:
    with h5py.File(path, "r+") as f:
        for name, value in values.items():
            f.attrs[MATH_PREFIX + name] = value


def _drop_math(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        for name in [n for n in f.attrs if n.startswith(MATH_PREFIX)]:
            del f.attrs[name]


def _cuda_tf32(path: Path) -> None:
    """The record of a CUDA run with torch's defaults: cuDNN's TF32 on, matmul's off."""
    _set_math(path, device="cuda:0", device_name="NVIDIA H100 80GB HBM3", cudnn_allow_tf32=True,
              matmul_allow_tf32=False)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("precision")
    model = _net()
    nudged = _emulate_tf32(model)
    with torch.no_grad():
        nudged[2].weight.mul_(1.05)
    return {
        "cpu": _dump(model, root / "cpu"),
        "tf32": _dump(_emulate_tf32(model), root / "tf32"),
        "tf32_nudged": _dump(nudged, root / "nudged"),
        "bf16": _dump(copy.deepcopy(model), root / "bf16", torch.bfloat16),
    }


def test_a_dump_records_how_its_run_computed(dumps: dict[str, Path]) -> None:
    attrs = fwdtrace.read_dump(dumps["bf16"], show=False)["attrs"]
    record = {k.removeprefix(MATH_PREFIX): v for k, v in attrs.items() if k.startswith(MATH_PREFIX)}
    assert record == {
        "device": "cpu", "device_name": "cpu", "dtypes": "float32", "autocast": "bfloat16",
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(), "torch": torch.__version__,
    }
    assert fwdtrace.read_dump(dumps["cpu"], show=False)["attrs"][MATH_PREFIX + "autocast"] == "off"


def test_tf32_rounding_is_no_divergence(dumps: dict[str, Path]) -> None:
    path = dumps["tf32"].with_name("cuda.hdf5")
    path.write_bytes(dumps["tf32"].read_bytes())
    _cuda_tf32(path)
    report = fwdtrace.compare_dumps(dumps["cpu"], path)
    rounded = [r for r in report.rows if not r.allclose]
    assert rounded, "the emulation changed nothing: the test would prove nothing"
    assert all(r.rounding == "TF32" and r.precision == "tfloat32" for r in rounded), report.to_text()
    assert report.first_divergence is None and report.agree and not report.equal
    # the independent measure: each row's norm-relative error, recomputed from the tensors
    a = fwdtrace.read_dump(dumps["cpu"], show=False, values=True)["groups"]
    b = fwdtrace.read_dump(path, show=False, values=True)["groups"]
    for r in rounded:
        want, got = a[r.group]["datasets"][r.name]["value"].double(), b[r.group]["datasets"][r.name]["value"].double()
        assert r.norm_rel == pytest.approx(float((want - got).norm() / max(want.norm(), got.norm())), rel=1e-9)
        assert r.cosine == pytest.approx(float(torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), 0,
                                                                                       eps=0)), abs=1e-12)
    assert "within TF32 rounding" in report.to_text()
    assert "explains" in report.to_text().splitlines()[-1]


def test_the_same_difference_without_tf32_in_the_record_diverges(dumps: dict[str, Path]) -> None:
    report = fwdtrace.compare_dumps(dumps["cpu"], dumps["tf32"])
    assert report.first_divergence == "0" and not report.agree  # two float32 CPU runs: judged elementwise


def test_a_real_nudge_under_tf32_is_still_the_first_divergence(dumps: dict[str, Path]) -> None:
    path = dumps["tf32_nudged"].with_name("cuda_nudged.hdf5")
    path.write_bytes(dumps["tf32_nudged"].read_bytes())
    _cuda_tf32(path)
    report = fwdtrace.compare_dumps(dumps["cpu"], path)
    assert report.first_divergence == "2", report.to_text()
    first = next(r for r in report.rows if r.module_path == "2" and r.name == "output0")
    assert first.rounding is None and first.norm_rel > precision.rounding_bound("tfloat32")
    assert [r.rounding for r in report.rows if r.module_path == "0" and r.name == "output0"] == ["TF32"]


def test_bf16_autocast_against_float32_agrees_within_bf16_rounding(dumps: dict[str, Path]) -> None:
    report = fwdtrace.compare_dumps(dumps["cpu"], dumps["bf16"])
    assert report.first_divergence is None and report.agree, report.to_text()
    assert {r.rounding for r in report.rows if not r.allclose} == {"bfloat16"}
    assert {r.precision for r in report.rows} == {"bfloat16"}


def test_dumps_without_a_math_record_compare_as_before(dumps: dict[str, Path], tmp_path: Path) -> None:
    old = tmp_path / "old.hdf5"
    old.write_bytes(dumps["bf16"].read_bytes())
    _drop_math(old)
    report = fwdtrace.compare_dumps(dumps["cpu"], old)
    assert all(r.rounding is None for r in report.rows)
    assert report.first_divergence == "0" and not report.agree
    assert report.math[str(old)] is None and report.math[str(dumps["cpu"])] is not None
    assert "old.hdf5: no math record (written by an older fwdtrace): elementwise tolerances are the defaults" \
        in report.to_text()


@pytest.mark.parametrize(("dtype", "record", "want"), [
    ("float32", None, "float32"),
    ("float32", {"device": "cpu", "autocast": "off", "float32_matmul_precision": "highest"}, "float32"),
    ("float32", {"device": "cuda:0", "autocast": "off", "cudnn_allow_tf32": True,
                 "float32_matmul_precision": "highest"}, "tfloat32"),
    ("float32", {"device": "cpu", "autocast": "off", "float32_matmul_precision": "medium"}, "bfloat16"),
    ("float32", {"device": "cuda:0", "autocast": "float16", "cudnn_allow_tf32": True}, "float16"),
    ("float64", {"device": "cuda:0", "autocast": "off", "cudnn_allow_tf32": True}, "float64"),
    ("int64", {"device": "cuda:0", "autocast": "bfloat16"}, "int64"),
])
def test_a_values_arithmetic_follows_dtype_and_math(dtype: str, record: dict | None, want: str) -> None:
    assert precision.value_precision(dtype, record) == want


def test_rounding_explains_only_coarse_arithmetic_within_its_bound() -> None:
    bound = precision.rounding_bound("tfloat32")
    assert precision.rounding_explains(bound / 2, 0.99999, "tfloat32") == "TF32"
    assert precision.rounding_explains(bound * 2, 0.99999, "tfloat32") is None
    assert precision.rounding_explains(bound / 2, 0.9, "tfloat32") is None  # below the least cosine
    assert precision.rounding_explains(1e-9, 1.0, "float32") is None  # float32 is judged elementwise
    assert precision.rounding_explains(math.nan, 1.0, "bfloat16") is None


def test_check_onnx_puts_the_eager_runs_bf16_matmuls_down_to_rounding() -> None:
    """Eager computes its Linear in bfloat16 (emulated), the ONNX model in float32; the run says its
    float32 matmuls may be bfloat16 ("medium"): within rounding. A 20% nudge is still found."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).eval()
    x = torch.randn(8, 16)
    proto = fwdtrace.export_onnx(model, x, exporter="torchscript")
    rounded = copy.deepcopy(model)
    for m in rounded:
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.copy_(m.weight.bfloat16().float())
            m.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().float(),))
    before = torch.get_float32_matmul_precision()
    try:
        strict = fwdtrace.check_onnx(rounded, x, onnx=proto, numeric=True)
        assert strict.first_divergence is not None  # "highest": a float32 run, judged by float32's tolerance
        torch.set_float32_matmul_precision("medium")
        report = fwdtrace.check_onnx(rounded, x, onnx=proto, numeric=True)
        assert report.numeric is not None and report.numeric.math["float32_matmul_precision"] == "medium"
        assert report.first_divergence is None, str(report)
        assert {r.rounding for r in report.numeric.rows if not r.ok} == {"bfloat16"}
        assert "within what bfloat16 rounding explains" in report.numeric.lead()
        with torch.no_grad():
            rounded[2].weight.mul_(1.2)
        nudged = fwdtrace.check_onnx(rounded, x, onnx=proto, numeric=True)
        assert nudged.first_divergence is not None and nudged.first_divergence.module_path == "2", str(nudged)
    finally:
        torch.set_float32_matmul_precision(before)


def test_dump_diff_exits_0_when_rounding_explains_every_difference(dumps: dict[str, Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from fwdtrace.cli import main

    assert main(["dump-diff", str(dumps["cpu"]), str(dumps["bf16"]), "--only-diverged"]) == 0
    assert "within what bfloat16 rounding explains" in capsys.readouterr().out
    old = tmp_path / "old.hdf5"
    old.write_bytes(dumps["bf16"].read_bytes())
    _drop_math(old)
    assert main(["dump-diff", str(dumps["cpu"]), str(old)]) == 1


# blocks whose verdicts take each way through the engine: equal, rounding noise, a NaN or an inf on one side or
# both, equal infinities, a constant that follows the dtype, a sum of squares past float64's range
_BLOCKS = [
    ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], ()),
    ([1.0, 2.0, 3.0], [1.0, 2.0000001, 3.0], ()),
    ([1.0, float("nan"), 3.0], [1.0, 2.0, 3.0], ()),
    ([1.0, float("nan"), 3.0], [1.0, float("nan"), 3.0], ()),
    ([float("inf"), 2.0, 3.0], [float("inf"), 2.0, 3.5], ()),
    ([float("-inf"), 2.0, 3.0], [5.0, 2.0, 3.0], ()),
    ([-3.4028234663852886e38, 2.0, 3.0], [-65504.0, 2.0, 3.003], ((-3.4028234663852886e38, -65504.0),)),
    ([1e200, 2.0, 3.0], [1.1e200, 2.0, 3.0], ()),
]


@pytest.mark.parametrize("a, b, equivalent", _BLOCKS)
def test_rows_gathered_at_once_agree_with_each_row_gathered_alone(a: list[float], b: list[float],
                                                                  equivalent: tuple) -> None:
    """Agreement.add_rows (a statistics dump's matrix in one pass) gives what add gives for each row."""
    import numpy as np

    others = [(x, y, e) for x, y, e in _BLOCKS if e == equivalent]
    rows = [precision.Agreement(1e-5, 1e-8, equivalent=equivalent) for _ in others]
    precision.Agreement.add_rows(rows, np.array([x for x, _, _ in others]), np.array([y for _, y, _ in others]))
    alone = precision.Agreement(1e-5, 1e-8, equivalent=equivalent)
    alone.add(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    assert repr(rows[[(x, y) for x, y, _ in others].index((a, b))]) == repr(alone)
