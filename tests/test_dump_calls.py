"""Function-level dumps: the calls a trace records, keyed as its graph's nodes, in execution order."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError, dump
from fwdtrace.cli import build_parser
from fwdtrace.instrument.keys import module_key
from fwdtrace.onnx.compare import ERROR_COLORS


class _Attention(nn.Module):
    def __init__(self, softmax_dtype: torch.dtype) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.softmax_dtype = softmax_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) + 2e4  # an offset softmax ignores and float16 does not
        return scores.to(self.softmax_dtype).softmax(-1).to(x.dtype) @ x


class _Model(nn.Module):
    def __init__(self, softmax_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.attn = _Attention(softmax_dtype)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.attn(self.embed(x))))


_X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


def _dump(tmp_path: Path, name: str, model: nn.Module, calls: str, values: str = "tensors") -> Path:
    with fwdtrace.Dumper(tmp_path / name, calls=calls, values=values) as dumper:
        dumper.register(model)
        model(_X).sum().backward()
    return dumper.paths[0]


def _keys(path: Path) -> list[str]:
    return [g["attrs"]["module_key"] for g in fwdtrace.read_dump(path, show=False)["groups"].values()]


def test_function_calls_are_keyed_as_the_traces_function_nodes_in_execution_order(tmp_path: Path) -> None:
    model = _Model()
    graph = fwdtrace.trace(model, _X)
    # the reference: the trace's own function nodes, and plain forward hooks' module calls
    function_keys = [n.key for n in graph.nodes if n.kind == "function"]
    assert "attn.softmax" in function_keys
    assert _keys(_dump(tmp_path, "f", model, "functions")) == function_keys
    order: list[str] = []
    keys = {id(m): module_key(p, m) for p, m in model.named_modules()}
    handles = [m.register_forward_pre_hook(lambda m, a: order.append(keys[id(m)])) for m in model.modules()]
    model(_X)
    for h in handles:
        h.remove()
    everything = _keys(_dump(tmp_path, "a", model, "all"))
    assert [k for k in everything if k in set(order)] == order
    assert [k for k in everything if k not in set(order)] == function_keys
    # a function call comes after the module calls that made its inputs: attn.q and attn.k before the matmul
    assert everything.index("attn.k.Linear") < everything.index("attn.matmul") < everything.index("attn.softmax")
    assert everything.index("attn.softmax") < everything.index("out.Linear")


def test_function_calls_hold_the_values_torch_computed(tmp_path: Path) -> None:
    model = _Model()
    seen = {}
    model.attn.k.register_forward_hook(lambda m, a, out: seen.setdefault("k", out.detach().clone()))
    tree = fwdtrace.read_dump(_dump(tmp_path, "f", model, "functions"), show=False, values=True)
    groups = {g["attrs"]["module_key"]: g for g in tree["groups"].values()}
    transpose = groups["attn.transpose"]["datasets"]
    assert torch.equal(transpose["input0"]["value"], seen["k"])
    assert torch.equal(transpose["output0"]["value"], seen["k"].transpose(-1, -2))
    assert groups["attn.softmax"]["attrs"]["function"] == "torch.Tensor.softmax"
    assert tree["status"] == "complete"
    assert "grad_output0" in groups["attn.softmax"]["datasets"]


@pytest.mark.parametrize("values", ["tensors", "statistics"])
def test_a_float16_softmax_is_the_first_divergence_at_function_level(tmp_path: Path, values: str) -> None:
    a = _dump(tmp_path, "a", _Model(), "all", values)
    b = _dump(tmp_path, "b", _Model(torch.float16), "all", values)
    report = fwdtrace.compare_dumps(a, b)
    assert report.first_divergence == "attn.softmax", report.to_text()
    rows = {(r.key, r.name): r for r in report.rows}
    given, made = rows[("attn.softmax", "input0")], rows[("attn.softmax", "output0")]
    assert given.allclose or given.rounding == "float16"  # what it was given agrees, to float16's rounding
    assert not made.allclose and made.rounding is None
    # at module level the same runs part at the attention block
    report = fwdtrace.compare_dumps(_dump(tmp_path, "ma", _Model(), "modules", values),
                                    _dump(tmp_path, "mb", _Model(torch.float16), "modules", values))
    assert report.first_divergence == "attn", report.to_text()


def test_dumper_checks_calls(tmp_path: Path) -> None:
    with pytest.raises(FwdtraceError, match=r"^Dumper expected calls as one of 'modules', 'functions', 'all', got 'ops'"):
        fwdtrace.Dumper(tmp_path, calls="ops")


def _groups(path: Path) -> list[tuple[str, int, torch.Tensor | None]]:
    """(key, call_index, output0) of every group, in call order."""
    tree = fwdtrace.read_dump(path, show=False, values=True)
    return [(g["attrs"]["module_key"], g["attrs"]["call_index"], g["datasets"].get("output0", {}).get("value"))
            for g in tree["groups"].values()]


def _same(got: list, expected: list) -> None:
    assert [(k, i) for k, i, _ in got] == [(k, i) for k, i, _ in expected]
    for (_, _, a), (_, _, b) in zip(got, expected, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_key_globs_keep_the_matching_calls_of_the_whole_run(tmp_path: Path) -> None:
    whole = _groups(_dump(tmp_path, "whole", _Model(), "all"))
    # the reference: the whole run's groups, filtered by the same globs on key or module path
    expected = [g for g in whole if fnmatch.fnmatchcase(g[0], "attn.*") or g[0] == "out.Linear"]
    path = _dump_filtered(tmp_path, "filtered", keys=["attn.*", "out"])
    assert len(expected) > 3 and fwdtrace.read_dump(path, show=False)["status"] == "complete"
    _same(_groups(path), expected)


def _dump_filtered(tmp_path: Path, name: str, **filters: object) -> Path:
    model = _Model()
    with fwdtrace.Dumper(tmp_path / name, calls="all", **filters) as dumper:
        dumper.register(model)
        model(_X).sum().backward()
    return dumper.paths[0]


@pytest.mark.parametrize("scope, first, end", [
    # ends with a function call: the softmax is the last call kept
    (("attn.q.Linear", "attn.softmax"), "attn.q.Linear", lambda keys: keys.index("attn.softmax") + 1),
    # ends with a module: its inner calls kept, up to the root's relu after it
    (("embed*", "attn._Attention"), "embed.Linear", lambda keys: keys.index("relu")),
])
def test_a_scope_keeps_the_calls_between_two_keys(tmp_path: Path, scope: tuple, first: str, end: Any) -> None:
    whole = _groups(_dump(tmp_path, "whole", _Model(), "all"))
    keys = [k for k, _, _ in whole]
    expected = whole[keys.index(first):end(keys)]
    _same(_groups(_dump_filtered(tmp_path, "scoped", scope=scope)), expected)


def test_steps_and_ranks_choose_which_registrations_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    for steps, dumped in ((2, [0, 2, 4]), ([1, 4], [1, 4])):
        dumper = fwdtrace.Dumper(tmp_path / f"steps{steps}", steps=steps)
        for step in range(5):
            dumper.register(model, step=step, grads=False)
            model(torch.ones(1, 2))
        assert [p.name for p in dumper.remove()] == [f"0-epoch_{s}-step_dump.hdf5" for s in dumped]
    monkeypatch.setenv("RANK", "1")
    for ranks, files in (([0], 0), ([1], 1)):
        dumper = fwdtrace.Dumper(tmp_path / f"ranks{ranks}", ranks=ranks)
        dumper.register(model, grads=False)
        model(torch.ones(1, 2))
        assert len(dumper.remove()) == files


@pytest.mark.parametrize("kwargs, message", [
    ({"keys": []}, r"^Dumper expected keys as a glob or a non-empty list of globs, got list \[\]"),
    ({"scope": ("a",)}, r"^Dumper expected scope as \(first key, last key\) globs, got tuple \('a',\)"),
    ({"steps": 0}, r"^Dumper expected steps as a positive int \(every Nth\) or a list of non-negative ints, got int 0"),
    ({"ranks": 1}, r"^Dumper expected ranks as a list of non-negative ints, got int 1"),
])
def test_filters_are_checked(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(FwdtraceError, match=message):
        fwdtrace.Dumper(tmp_path, **kwargs)


def test_a_single_process_without_rank_is_rank_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    model = nn.Linear(1, 1)
    for ranks, files in (([0], 1), ([1], 0)):
        with fwdtrace.Dumper(tmp_path / f"ranks{ranks}", ranks=ranks) as dumper:
            dumper.register(model, grads=False)
            model(torch.ones(1))
        assert len(dumper.paths) == files


class _RoundTrip(_Model):
    """The same model with two extra calls that change no value: a cast to float64 and back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).to(torch.float64).to(torch.float32)
        return self.out(torch.relu(self.attn(h)))


def test_calls_are_matched_by_key_and_call_order_with_extra_calls_one_sided(tmp_path: Path) -> None:
    for values in ("tensors", "statistics"):
        a = _dump(tmp_path, f"a_{values}", _Model(), "all", values)
        b = _dump(tmp_path, f"b_{values}", _RoundTrip(), "all", values)
        report = fwdtrace.compare_dumps(a, b)
        assert report.only_in_b == ["to", "to"] and report.only_in_a == []
        # every call of a is matched with b's, though b's group numbers are shifted by two after the casts
        matched = [r for r in report.rows if not r.one_sided]
        assert {r.key for r in matched} == set(_keys(a))
        assert all(r.allclose for r in matched), report.to_text()
        assert report.first_divergence is None and not report.equal
        assert "calls only in b: to, to" in report.to_text()


def _svg_nodes(svg: str) -> dict[str, str]:
    """Each drawn box's tooltip -> its SVG, from the draw pass's own output."""
    out = {}
    for match in re.finditer(r'<g id="node\d+" class="node[^"]*">(.*?)</g>\s*</g>', svg, re.S):
        tooltip = re.search(r'xlink:title="([^"]*)"', match.group(1))
        if tooltip:
            out[tooltip.group(1)] = match.group(1)
    return out


def test_the_picture_colours_each_call_by_its_error_and_marks_the_first_divergence(tmp_path: Path) -> None:
    a = _dump(tmp_path, "a", _Model(), "all")
    b = _dump(tmp_path, "b", _Model(torch.float16), "all")
    report = fwdtrace.compare_dumps(a, b)
    boxes = _svg_nodes(Path(report.render(tmp_path / "diff.svg")).read_text())
    softmax = [svg for tip, svg in boxes.items() if "torch.Tensor.softmax" in tip]
    transpose = [svg for tip, svg in boxes.items() if "torch.Tensor.transpose" in tip]
    assert len(softmax) == len(transpose) == 1
    # the reference: the report's own rows (a transpose before the softmax agrees exactly)
    assert all(r.allclose for r in report.rows if r.key == "attn.transpose" and r.name.startswith("output"))
    assert ERROR_COLORS["exact"] in transpose[0]
    assert 'stroke="#c0392b"' in softmax[0] and "diverges" in softmax[0]  # highlighted: the first divergence
    assert sum('stroke="#c0392b"' in svg for svg in boxes.values()) == 1
    # from the command line
    picture = tmp_path / "cli.svg"
    assert dump.run_cli(build_parser().parse_args(["dump-diff", str(a), str(b), "--picture", str(picture)])) == 1
    assert picture.read_text().startswith("<?xml")


def test_a_dump_of_module_calls_has_no_graph_to_draw(tmp_path: Path) -> None:
    a = _dump(tmp_path, "a", _Model(), "modules")
    with pytest.raises(FwdtraceError, match=r"^DumpReport.render\(\) expected dumps that hold their run's graph"):
        fwdtrace.compare_dumps(a, a).render(tmp_path / "diff.svg")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.proj(x)).softmax(-1) @ x.transpose(-1, -2)


def _fp32_and_autocast_bf16(tmp_path: Path, fp32: nn.Module, bf16: nn.Module) -> list[Path]:
    """A dump of ``fp32``'s step and one of ``bf16``'s under CPU autocast to bfloat16."""
    paths = []
    for name, model, autocast in (("fp32", fp32, False), ("bf16", bf16, True)):
        with fwdtrace.Dumper(tmp_path / name, calls="all") as dumper, torch.autocast("cpu", torch.bfloat16,
                                                                                     enabled=autocast):
            dumper.register(model)
            model(_X).float().sum().backward()
        paths += dumper.paths
    return paths


def test_a_float32_run_and_its_autocast_bfloat16_run_match_call_for_call(tmp_path: Path) -> None:
    paths = _fp32_and_autocast_bf16(tmp_path, _Block(), _Block())
    report = fwdtrace.compare_dumps(*paths)
    # autocast's casts happen below torch functions: the two traces are the same calls
    assert report.only_in_a == report.only_in_b == []
    bf16 = fwdtrace.read_dump(paths[1], show=False)["groups"]
    assert bf16["001_Linear"]["datasets"]["output0"]["dtype"] == "bfloat16"
    # and every difference is what bfloat16's rounding explains
    assert report.agree and not report.equal, report.to_text()
    assert {r.rounding for r in report.rows if not r.allclose} == {"bfloat16"}


class _Mixed(nn.Module):
    """Attention-like scores; under autocast the softmax runs in float32 between two casts of the model's own."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.name = name
        self.add_module(name, nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = getattr(self, self.name)(x)
        low = torch.is_autocast_enabled("cpu")
        if low:
            h = h.float()
        s = h.softmax(-1)
        if low:
            s = s.to(torch.bfloat16)
        return s @ x.transpose(-1, -2)


def test_a_float32_run_against_a_renamed_autocast_bfloat16_run_lists_its_casts_as_one_sided(tmp_path: Path) -> None:
    report = fwdtrace.compare_dumps(*_fp32_and_autocast_bf16(tmp_path, _Mixed("proj"), _Mixed("query")))
    assert report.only_in_a == [] and report.only_in_b == ["float", "to"]
    assert report.renamed == [("proj.Linear", "query.Linear")]
    assert {r.key for r in report.rows if not r.one_sided} == {"_Mixed", "proj.Linear", "softmax", "transpose",
                                                                "matmul"}
    # every paired call agrees within what bfloat16's rounding explains
    assert all(r.allclose or r.rounding == "bfloat16" for r in report.rows if not r.one_sided), report.to_text()
    assert report.first_divergence is None
