"""The verdict on two runs of a small GPT-2-like model, with bugs planted at known places.

Each scenario runs in every dump mode (module calls, function calls, both) and both value kinds
(tensors, statistics). The reference is torch itself: the planted place, and the values computed
again on an eager copy (the overflow's count, the error ratios).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fwdtrace
from fwdtrace import precision
from fwdtrace.cli import main

MODES = [(calls, values) for calls in ("modules", "functions", "all") for values in ("tensors", "statistics")]
IDS = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(1))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in self.c_attn(x).split(d, 2))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        # GPT-2's mask: the fill value follows the dtype
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        y = torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(b, t, d)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 61, d: int = 32, layers: int = 2, heads: int = 4, t: int = 8) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT()


def _dump(model: nn.Module, directory: Path, calls: str, values: str, autocast: torch.dtype | None = None,
          grads: bool = False) -> Path:
    """One forward's dump (the backward's overflow has a test of its own; here forward rows keep the tests cheap)."""
    dumper = fwdtrace.Dumper(directory, calls=calls, values=values)
    dumper.register(model, grads=grads)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(IDS)
    if grads:
        out.float().logsumexp(-1).sum().backward()
    (path,) = dumper.remove()
    return path


def _noisy(model: nn.Module) -> nn.Module:
    """``model`` with every weight moved by about one float32 ulp (relative 1e-7): what adding in another order
    does to a float32 run."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=g))
    return model


def _corrupted(model: nn.Module, scale: float) -> nn.Module:
    """``model`` with one MLP's first Linear's weights changed by ``scale``: the planted bug, at h.1.mlp.c_fc."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.h[1].mlp.c_fc.weight.mul_(scale)
    return model


def _overflowing(model: nn.Module) -> nn.Module:
    """``model`` with h.1's queries and keys scaled up: finite in float16 (|q| < 1e3), their products are not."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.h[1].attn.c_attn.weight[:64].mul_(200)
    return model


@pytest.fixture(scope="module", params=MODES, ids=[f"{c}-{v}" for c, v in MODES])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    calls, values = request.param
    root = tmp_path_factory.mktemp(f"verdict-{calls}-{values}")
    model = _gpt()
    big = _overflowing(model)
    out = {
        "f32": _dump(model, root / "f32", calls, values),
        "noise": _dump(_noisy(model), root / "noise", calls, values),
        "bf16": _dump(copy.deepcopy(model), root / "bf16", calls, values, torch.bfloat16),
        "f32_big": _dump(big, root / "f32_big", calls, values),
        "f16_big": _dump(copy.deepcopy(big).half(), root / "f16_big", calls, values),
    }
    # 6% in one mode: what finds 3% finds 6%
    for scale in (1.03, 1.06) if (calls, values) == ("modules", "tensors") else (1.03,):
        out[f"bf16_{scale}"] = _dump(_corrupted(model, scale), root / f"bf16_{scale}", calls, values, torch.bfloat16)
    out["calls"], out["values"] = calls, values  # type: ignore[assignment]
    return out


def test_float32_reduction_noise_is_no_divergence(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    report = fwdtrace.compare_dumps(runs["f32"], runs["noise"])
    assert report.agree and report.first_divergence is None, report.to_text()
    differing = [r for r in report.rows if not r.allclose]
    if runs["values"] == "tensors":
        # the test proves something: elements near zero fail allclose, as they did before the verdict knew better
        assert differing, "the noise changed nothing elementwise"
    assert {r.rounding for r in differing} <= {"float32"}
    assert max((r.norm_rel for r in differing if r.norm_rel is not None), default=0) < 1e-5
    assert min((r.cosine for r in differing if r.cosine is not None), default=1) > 1 - 1e-9
    if runs["calls"] == "modules" and runs["values"] == "tensors":
        assert main(["dump-diff", str(runs["f32"]), str(runs["noise"])]) == 0
        assert "within float32 rounding" in capsys.readouterr().out


def test_clean_bf16_against_float32_still_agrees(runs: dict[str, Path]) -> None:
    report = fwdtrace.compare_dumps(runs["f32"], runs["bf16"])
    assert report.agree and report.first_divergence is None, report.to_text()
    assert {r.rounding for r in report.rows if not r.allclose} == {"bfloat16"}


@pytest.mark.parametrize("scale", [1.03, 1.06])
@pytest.mark.parametrize("against", ["f32", "bf16"])
def test_a_few_percent_inside_a_bf16_run_is_found_at_its_layer(runs: dict[str, Path], scale: float,
                                                                against: str) -> None:
    if f"bf16_{scale}" not in runs:
        pytest.skip("6% in one mode")
    report = fwdtrace.compare_dumps(runs[against], runs[f"bf16_{scale}"])
    assert not report.agree
    assert report.first_divergence == "h.1.mlp.c_fc", report.to_text()
    row = next(r for r in report.rows if r.module_path == "h.1.mlp.c_fc" and r.name == "output0")
    # under the blanket bound, found by the error the call adds beyond its inputs'
    assert row.norm_rel < precision.rounding_bound("bfloat16")
    assert row.added is not None and row.added > precision.added_bound("bfloat16", 32)
    assert "adds" in row.note
    # nothing before the planted place diverges
    bad = [r.module_path for r in report.rows if not r.agrees and not r.name.startswith("grad")]
    assert bad[0] == "h.1.mlp.c_fc", bad


class Conv1D(nn.Module):
    """GPT-2's linear layer as transformers writes it: ``torch.addmm`` with the weight as an argument, so a dump of
    function calls holds the weight as an input of the call."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], self.weight.shape[-1])


@pytest.mark.parametrize("values", ["tensors", "statistics"])
@pytest.mark.parametrize("calls", ["functions", "all"])
def test_a_few_percent_in_a_weight_that_is_an_argument_is_found_at_its_call(calls: str, values: str,
                                                                            tmp_path: Path) -> None:
    model = _gpt()
    for block in model.h:
        block.mlp.c_fc = Conv1D(32, 128)
    f32 = _dump(model, tmp_path / "f32", calls, values)
    bf16 = _dump(copy.deepcopy(model), tmp_path / "bf16", calls, values, torch.bfloat16)
    corrupted = _dump(_corrupted(model, 1.03), tmp_path / "bad", calls, values, torch.bfloat16)
    assert fwdtrace.compare_dumps(f32, bf16).agree
    for against in (f32, bf16):
        report = fwdtrace.compare_dumps(against, corrupted)
        assert not report.agree and report.first_call == ("h.1.mlp.c_fc.addmm", 0), report.to_text()
        assert report.first_divergence == "h.1.mlp.c_fc.addmm" and "h.1.mlp.c_fc.weight" in report.divergence.reason
        # the weight is stored, not computed in bfloat16: 3% is no rounding of it (the reference: the planted change)
        (weight,) = [r for r in report.rows if r.parameter == "h.1.mlp.c_fc.weight"]
        assert weight.precision == "float32" and not weight.agrees
        if values == "tensors":
            assert weight.norm_rel == pytest.approx(0.03 / 1.03, rel=1e-5)
        bad = [r.key for r in report.rows if not r.agrees]
        assert bad[0] == "h.1.mlp.c_fc.addmm", bad


def test_a_float16_overflow_is_named_where_it_happens(runs: dict[str, Path]) -> None:
    report = fwdtrace.compare_dumps(runs["f32_big"], runs["f16_big"])
    d = report.divergence
    assert d is not None and d.kind == "overflow", report.to_text()
    # the reference: q @ k.T of h.1 computed again in float16 from an eager copy
    model = _overflowing(_gpt()).half()
    seen = {}
    model.h[1].attn.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    model(IDS)
    q, k, _ = (y.view(2, 8, 4, 8).transpose(1, 2) for y in model.h[1].attn.c_attn(seen["x"]).split(32, 2))
    infs = int(torch.isinf(torch.matmul(q, k.transpose(-1, -2))).sum())
    assert infs > 0 and torch.isfinite(q).all() and torch.isfinite(k).all()
    if runs["calls"] == "modules":
        assert (d.name, d.call_index) == ("h.1.attn", 0)  # the matmul is inside it, not a call of this dump
    else:
        assert (d.key, d.call_index) == ("h.1.attn.matmul", 0) and d.name == "h.1.attn.matmul"
        assert f"output0 {infs} of" in d.reason
        # the mask's where is explained by its fill value, which follows the dtype, on its own row
        where = next(r for r in report.rows if r.key == "h.0.attn.where" and r.name == "output0")
        assert where.agrees and "finfo(float32).min vs finfo(float16).min" in where.note, where
    assert "overflow in b" in report.to_text().splitlines()[-1]


def test_non_tensor_arguments_are_recorded_with_each_function_call(runs: dict[str, Path]) -> None:
    if runs["calls"] == "modules":
        pytest.skip("module calls record their tensors only")
    groups = fwdtrace.read_dump(runs["f16_big"], show=False)["groups"]
    wheres = [g for g in groups.values() if g["attrs"].get("module_key") == "h.0.attn.where"]
    assert wheres and str(torch.finfo(torch.float16).min) in wheres[0]["attrs"]["arguments"]


def test_error_ratios_are_msprobes(tmp_path: Path) -> None:
    a = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    b = a * (1 + 4e-3 * torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))
    paths = []
    for name, value in (("a", a), ("b", b)):
        dumper = fwdtrace.Dumper(tmp_path / name)
        model = nn.Identity()
        dumper.register(model, grads=False)
        model(value)
        paths += dumper.remove()
    row = next(r for r in fwdtrace.compare_dumps(*paths).rows if r.name == "output0")
    rel = (a.double() - b.double()).abs() / torch.maximum(a.double().abs(), b.double().abs())
    assert row.one_thousandth == pytest.approx(float((rel > 1e-3).double().mean()))
    assert row.five_thousandths == pytest.approx(float((rel > 5e-3).double().mean()))
    assert 0 < row.five_thousandths < row.one_thousandth < 1


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e30


def test_find_overflow_names_where_inf_first_appears_forward_and_backward(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Scale(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    # the reference: the same backward in plain torch, the gradient _Scale hands back
    plain = copy.deepcopy(model)
    grads = {}
    plain[1].register_full_backward_hook(lambda m, gin, gout: grads.update(inp=gin[0]))
    out = plain(x)
    out.backward(torch.full_like(out, 1e10))  # finite: the gradient that overflows is the one _Scale makes
    dumper = fwdtrace.Dumper(tmp_path / "d", calls="all")
    dumper.register(model)
    out = model(x)
    out.backward(torch.full_like(out, 1e10))
    (path,) = dumper.remove()
    found = fwdtrace.find_overflow(path)
    assert found.forward is None  # |1e30 x| stays finite in float32
    assert found.backward is not None and found.backward.name == "1" and found.backward.source
    assert found.backward.tensor == "grad_input0" and found.backward.infs == int(torch.isinf(grads["inp"]).sum()) > 0
    assert main(["dump-diff", "--overflow", str(path)]) == 1
    assert main(["dump-diff", str(path)]) == 2  # one dump, no --overflow: nothing to compare it with
    assert "backward: 1 (call 0 of 1._Scale)" in capsys.readouterr().out


def test_find_overflow_forward_names_the_matmul(runs: dict[str, Path]) -> None:
    found = fwdtrace.find_overflow(runs["f16_big"])
    want = "h.1.attn" if runs["calls"] == "modules" else "h.1.attn.matmul"
    assert found.forward is not None and found.forward.name == want and found.forward.source
    assert fwdtrace.find_overflow(runs["f32_big"]).found is False


def test_the_picture_and_model_explorer_show_the_overflow_where_the_report_names_it(
        runs: dict[str, Path], tmp_path: Path) -> None:
    if runs["calls"] != "all":
        pytest.skip("one mode with a graph and module calls")
    import json
    import re
    import sys

    from fwdtrace.onnx.compare import ERROR_COLORS, error_legend

    report = fwdtrace.compare_dumps(runs["f32_big"], runs["f16_big"])
    d = report.divergence
    assert d is not None and report.graph is not None
    (node,) = [n for n in report.graph.nodes if n.key == d.key and n.call_index == d.call_index]
    # the call it names, by key and call index: h.1.attn's second matmul (probs @ v) shares its key
    assert sum(n.key == d.key for n in report.graph.nodes) == 2
    row = next(r for r in report.rows if r.group == d.group and r.name == "output0")
    svg = Path(report.render(tmp_path / "diff.svg", depth=None)).read_text()
    outlined = [m.group(0) for m in re.finditer(r'<g id="node\d+" class="node[^"]*">.*?</g>\s*</g>', svg, re.S)
                if 'stroke="#c0392b"' in m.group(0) and "xlink:title" in m.group(0)]
    assert len(outlined) == 1 and "max rel err inf" in outlined[0]
    assert f"0 inf/NaN in a, {row.only_b} in b" in outlined[0] and ERROR_COLORS["nonfinite"] in outlined[0]
    assert 'class="cluster legend"' in svg and all(text in svg for _, text in error_legend(report.rtol)[1:])
    assert f"first divergence: {d.name}" in svg
    files = report.to_model_explorer(tmp_path / "me")
    data = {name: json.loads(Path(p).read_text())["fwdtrace"]["results"] for name, p in files.node_data.items()}
    assert data["max_rel"][str(node.id)] == {"value": sys.float_info.max, "bgColor": ERROR_COLORS["nonfinite"]}
    assert data["nonfinite"][str(node.id)]["value"] == row.only_b > 0
    marked = [n for g in json.loads(Path(files.graph).read_text())["graphs"] for n in g["nodes"]
              if n.get("style")]
    assert [n["id"] for n in marked] == [str(node.id)]


class _SharpAttention(nn.Module):
    """Attention over logits in the hundreds, as a trained model's can be: softmax turns its logits' relative
    error into an absolute one that large."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.q(x) @ x.transpose(-1, -2) * 12).softmax(-1) @ x


@pytest.mark.parametrize("calls", ["functions", "modules"])
def test_a_sharp_softmax_under_bf16_is_rounding_not_a_divergence(calls: str, tmp_path: Path) -> None:
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    paths = []
    for name, autocast in (("f32", False), ("bf16", True)):
        model = _SharpAttention()
        dumper = fwdtrace.Dumper(tmp_path / name, calls=calls)
        dumper.register(model, grads=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(x)
        paths += dumper.remove()
    report = fwdtrace.compare_dumps(*paths)
    assert report.agree and report.first_divergence is None, report.to_text()
    # the reference: the logits are that sharp, and the softmax's error is many times its input's
    with torch.no_grad():
        logits = _SharpAttention().q(x) @ x.transpose(-1, -2) * 12
    assert float(logits.abs().max()) > 100
    if calls == "functions":
        softmax = next(r for r in report.rows if r.function.endswith("softmax") and r.name == "output0")
        given = next(r for r in report.rows if r.function.endswith("softmax") and r.name == "input0")
        assert softmax.norm_rel > 4 * given.norm_rel and softmax.rounding == "bfloat16"
