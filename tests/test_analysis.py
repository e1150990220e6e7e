"""analyze(): parameters, shapes, latency runs and memory against plain torch; the CLI."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import zoo
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.cli import main

ROOT = Path(__file__).parent.parent


class TiedAndFrozen(nn.Module):
    """Tied input/output embeddings, one Linear used twice, a frozen layer."""

    def __init__(self, vocab: int = 20, d: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.shared = nn.Linear(d, d)
        self.frozen = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.shared(self.embed(ids)))
        return self.head(self.frozen(h))


def unique_params(model: nn.Module) -> dict[int, nn.Parameter]:
    return {id(p): p for m in model.modules() for p in m.parameters(recurse=False)}


@pytest.mark.parametrize("factory", [lambda: (TiedAndFrozen(), (torch.randint(0, 20, (2, 5)),)), zoo.shared_weights])
def test_params_count_shared_weights_once_and_frozen_ones_as_not_trainable(factory):
    model, inputs = factory()
    unique = unique_params(model)
    result = fwdtrace.analyze(model, *inputs, warmup=1, repeats=1)
    assert result.params == sum(p.numel() for p in unique.values())
    assert result.trainable_params == sum(p.numel() for p in unique.values() if p.requires_grad)
    for key, module in fwdtrace.instrument.keys.key2module(model).items():
        assert result.row(key).params == sum(p.numel() for p in unique_params(module).values())


def test_tied_model_has_fewer_unique_than_listed_parameters():
    model = TiedAndFrozen()
    result = fwdtrace.analyze(model, torch.randint(0, 20, (2, 5)), warmup=1, repeats=1)
    listed = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert result.params == listed - model.embed.weight.numel()
    assert result.trainable_params == result.params - sum(p.numel() for p in model.frozen.parameters())


@pytest.mark.parametrize("name", ["resnetish", "transformer_encoder", "shared_weights", "lstm_tagger"])
def test_rows_follow_module_keys_with_the_shapes_and_calls_plain_hooks_see(name):
    model, inputs = zoo.ZOO[name]()
    seen: dict[str, tuple[list, list]] = {}
    calls: dict[str, int] = {}
    handles = []
    for key, module in fwdtrace.instrument.keys.key2module(model).items():
        def hook(m, args, kwargs, out, key=key):
            calls[key] = calls.get(key, 0) + 1
            seen.setdefault(key, ([tuple(t.shape) for t in fwdtrace._tree.tensors_of((args, kwargs))],
                                  [tuple(t.shape) for t in fwdtrace._tree.tensors_of(out)]))
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    zoo.run_hooked(model, handles, *inputs)
    result = fwdtrace.analyze(model, *inputs, warmup=1, repeats=1)
    assert [r.key for r in result.rows] == fwdtrace.module_keys(model)
    for row in result.rows:
        assert row.calls == calls.get(row.key, 0), row.key
        ins, outs = seen.get(row.key, ([], []))
        assert list(row.input_shapes) == ins and list(row.output_shapes) == outs, row.key


@pytest.mark.parametrize("warmup,repeats", [(3, 10), (0, 2), (1, 1), (2, 4)])
def test_runs_are_warmup_plus_repeats_and_latency_is_positive(warmup, repeats):
    model, inputs = zoo.resnetish()
    forwards = []
    handle = model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        result = fwdtrace.analyze(model, *inputs, warmup=warmup, repeats=repeats)
    finally:
        handle.remove()
    # the counting run is the first warmup run; each repeat is a plain run and a module-timed one
    assert len(forwards) == max(warmup, 1) + 2 * repeats
    assert result.repeats == repeats
    assert result.latency_ms is not None and result.latency_p90_ms is not None
    assert 0 < result.latency_ms <= result.latency_p90_ms
    shares = {r.module_path: r.latency_share for r in result.rows}
    # the root is the whole forward, children are parts of it, from the same runs: they add up
    assert result.rows[-1].latency_share == pytest.approx(1.0)
    assert all(s is not None and 0 <= s <= 1.0 + 1e-9 for s in shares.values())
    for path, share in shares.items():
        children = [s for p, s in shares.items() if p and p.rpartition(".")[0] == path and p != path]
        assert sum(children) <= share + 1e-9, path  # type: ignore[arg-type]


class _Clock:
    """A stand-in for time.perf_counter that only the model moves: each _Tick adds its cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Tick(nn.Module):
    def __init__(self, clock: _Clock, cost: float, spikes: dict[int, float]) -> None:
        super().__init__()
        self.clock, self.cost, self.spikes, self.calls = clock, cost, spikes, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.clock.now += self.cost * self.spikes.get(self.calls, 1.0)
        return x


def test_a_slowed_run_does_not_skew_the_time_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """One pooling layer 100 times slower in some runs (a first call, another program on the
    machine) once made it 90% of the forward: shares come from the quieter runs, warm-up excluded."""
    from fwdtrace import analysis

    clock = _Clock()
    monkeypatch.setattr(analysis, "time", clock)
    # calls 2 and 5 of the pool are slow: a warm-up run and one timed run
    costs = {"0": 0.003, "1": 0.001, "2": 0.002}
    model = nn.Sequential(_Tick(clock, costs["0"], {}), _Tick(clock, costs["1"], {2: 100.0, 5: 100.0}),
                          _Tick(clock, costs["2"], {}))
    result = fwdtrace.analyze(model, torch.ones(1), warmup=3, repeats=3)
    total = sum(costs.values())
    assert result.latency_ms == pytest.approx(1000 * total)
    for path, cost in costs.items():
        row = next(r for r in result.rows if r.module_path == path)
        assert row.latency_share == pytest.approx(cost / total), path
        assert row.latency_ms == pytest.approx(1000 * cost), path
    assert result.rows[-1].latency_ms == pytest.approx(1000 * total)
    assert "from the quieter half of 3 module-timed runs (10 or more for shares stable" in str(result)


class Keep(nn.Module):
    """Keeps every intermediate alive until the end: peak = input + n intermediates."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = [x * 2]
        for _ in range(3):
            kept.append(kept[-1] * 2)
        return kept[-1] + 0


class Chain(nn.Module):
    """Drops each intermediate once the next exists: at most two alive besides the input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        for _ in range(4):
            y = y * 2
        return y


@pytest.mark.parametrize("model,expected_tensors", [(Keep(), 1 + 5), (Chain(), 1 + 1 + 2)])
def test_tracked_peak_memory_matches_the_tensors_alive_at_once(model, expected_tensors):
    x = torch.randn(1000)  # 4000 bytes, like every tensor here
    result = fwdtrace.analyze(model, x, warmup=1, repeats=1)
    assert result.memory_method == "tracked tensor storages"
    assert result.peak_memory_bytes == expected_tensors * 4000
    assert result.rows[-1].peak_memory_bytes == result.peak_memory_bytes


def test_meta_device_analyses_a_billion_parameter_transformer_without_memory():
    d, layers, batch, length = 2048, 20, 1, 256
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta"):
        model = zoo.TransformerEncoder(d=d, layers=layers)
        x = torch.randn(batch, length, d)
    result = fwdtrace.analyze(model, x)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    per_layer = 2 * 2 * d + (4 * d * d + 4 * d) + (d * 4 * d + 4 * d + 4 * d * d + d)  # 2 norms, attention, MLP
    assert result.params == layers * per_layer + 2 * d >= 1_000_000_000
    tokens = batch * length
    per_layer_flops = 2 * tokens * 12 * d * d + 2 * 2 * batch * length * length * d
    assert result.flops == layers * per_layer_flops
    assert result.latency_ms is None and result.latency_p90_ms is None and result.repeats == 0
    assert all(p.device.type == "meta" for p in model.parameters())
    assert grown < 1 << 30  # the parameters alone would need 4 GB
    assert result.peak_memory_bytes > result.params * 4  # the estimate: weights plus activations


def test_analysis_prints_a_table_and_round_trips_through_json():
    model, inputs = zoo.resnetish()
    result = fwdtrace.analyze(model, *inputs, warmup=2, repeats=2)
    text = str(result)
    assert text.startswith("ResNetish on cpu")
    for row in result.rows:
        assert row.key in text
    assert "KFLOPs" in text and "MFLOPs" in text and "5.3 K" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert data["flops"] == result.flops and data["params"] == result.params
    assert [r["key"] for r in data["rows"]] == fwdtrace.module_keys(model)
    assert data["rows"][0]["input_shapes"] == [list(s) for s in result.rows[0].input_shapes]


def test_bad_arguments_are_refused_with_what_was_given():
    model, inputs = zoo.resnetish()
    with pytest.raises(FwdtraceError, match=r"^analyze\(\) expected a torch.nn.Module as model, got str"):
        fwdtrace.analyze("resnet", *inputs)
    with pytest.raises(FwdtraceError, match=r"^analyze\(\) expected repeats as an integer >= 0, got -1"):
        fwdtrace.analyze(model, *inputs, repeats=-1)
    with pytest.raises(FwdtraceError, match=r"^analyze\(\) expected warmup as an integer >= 0, got -1"):
        fwdtrace.analyze(model, *inputs, warmup=-1)
    result = fwdtrace.analyze(model, *inputs, warmup=1, repeats=1)
    with pytest.raises(
        FwdtraceError,
        match=r"^expected a module key or path of ResNetish, got 'fc\.Linaer'; closest keys: 'fc\.Linear'.*; closest module paths: 'fc'",
    ):
        result.row("fc.Linaer")


class Inner(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d + 1, d)  # the bug: expects one feature more than it gets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, d: int, broken: bool) -> None:
        super().__init__()
        self.inner = Inner(d) if broken else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class Deep(nn.Module):
    """A shape bug two levels down in the second block."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(d, False), Block(d, True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


LAYER_NOTE = "fwdtrace: raised in module 'blocks.1.inner.proj.Linear' (torch.nn.Linear) with inputs float32[2, 4]"


@pytest.mark.parametrize("run", [fwdtrace.trace, fwdtrace.analyze], ids=["trace", "analyze"])
def test_an_error_deep_in_the_model_names_the_layer_and_its_input_shapes(run):
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied") as info:
        run(Deep(), torch.randn(2, 4))
    assert info.value.__notes__ == [LAYER_NOTE]
    assert torch.nn.Module.__dict__["__call__"] is torch.nn.modules.module.Module._wrapped_call_impl


def test_cli_prints_the_table_or_json_and_exits_zero(capsys):
    assert main(["analyze", "zoo:ResNetish", "--input-shape", "1,3,16,16", "--warmup", "1", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ResNetish on cpu") and "blocks.1.down.0.Conv2d" in out
    assert main(["analyze", "zoo:ResNetish", "--input-shape", "1,3,16,16", "--json", "--repeats", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    model, inputs = zoo.resnetish()
    assert data["flops"] == fwdtrace.analyze(model, *inputs, warmup=1, repeats=1).flops
    assert main(["analyze", "zoo:ResNetish", "--input-shape", "1,3,16,16", "--device", "meta", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latency_ms"] is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["zoo:ResNetish", "--input-shape", "1,x,16"], "expected --input-shape as positive integers"),
        (["zoo_missing:Net", "--input-shape", "1,3"], "could not import 'zoo_missing'"),
        (["zoo:ResNetish", "--input-shape", "1,5,16,16"],
         "zoo:ResNetish: the forward failed on inputs float32[1, 5, 16, 16]: RuntimeError"),
        (["zoo:ResNetish", "--input-shape", "1,3,16,16", "--repeats", "-1"], "analyze() expected repeats"),
        (["zoo:ResNetish", "--input-shape", "1,3,16,16", "--device", "gpu7"], "expected --device as cpu"),
    ],
)
def test_cli_exits_two_on_bad_input(argv, message, capsys):
    assert main(["analyze", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fwdtrace analyze: error: {message}")


def test_cli_failure_names_the_layer(capsys):
    assert main(["analyze", "zoo:ResNetish", "--input-shape", "1,5,16,16"]) == 2
    assert "fwdtrace: raised in module 'stem.0.Conv2d' (torch.nn.Conv2d) with inputs float32[1, 5, 16, 16]" in (
        capsys.readouterr().err
    )


def test_installed_command_runs_in_a_subprocess():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    command = [str(Path(sys.executable).parent / "fwdtrace"), "analyze", "zoo:MobileNetish", "--input-shape", "1,3,16,16"]
    ok = subprocess.run([*command, "--json", "--repeats", "1"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["model"] == "MobileNetish"  # exit code 2 is checked in-process above


def test_fwdtrace_analyze_stays_callable_after_the_cli_imports_its_module():
    import importlib

    importlib.import_module("fwdtrace.analysis")  # the CLI imports it; fwdtrace.analyze stays the function
    model, inputs = zoo.shared_weights()
    result = fwdtrace.analyze(model, *inputs, warmup=1, repeats=1)
    assert isinstance(result, fwdtrace.Analysis)


def test_repeats_zero_runs_the_model_once_and_times_nothing():
    model, inputs = zoo.resnetish()
    forwards = []
    handle = model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        result = fwdtrace.analyze(model, *inputs, warmup=3, repeats=0)
    finally:
        handle.remove()
    assert len(forwards) == 1  # the counting run only: no timing runs, warmup included
    timed = fwdtrace.analyze(model, *inputs, warmup=1, repeats=1)
    assert (result.params, result.flops, result.peak_memory_bytes) == (timed.params, timed.flops, timed.peak_memory_bytes)
    assert [(r.key, r.flops, r.input_shapes) for r in result.rows] == [(r.key, r.flops, r.input_shapes) for r in timed.rows]
    assert result.latency_ms is None and result.latency_p90_ms is None and result.repeats == 0
    assert all(r.latency_ms is None and r.latency_share is None for r in result.rows)
    assert "latency not measured (repeats=0)" in str(result)


def test_rows_are_found_by_key_or_by_the_path_named_modules_gives():
    model, inputs = zoo.resnetish()
    result = fwdtrace.analyze(model, *inputs, repeats=0)
    key_of = {id(m): k for k, m in fwdtrace.instrument.keys.key2module(model).items()}
    for path, module in model.named_modules():
        row = result.row(path)
        assert row.key == key_of[id(module)] and row.module_path == path
        assert result.row(row.key) is row


def test_a_quantize_dynamic_model_counts_its_packed_weights_and_their_flops() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    # the reference: the float model it was made from, counted by torch itself
    with FlopCounterMode(display=False) as counter:
        model(x)
    a = fwdtrace.analyze(quantized, x, repeats=0)
    assert a.params == sum(p.numel() for p in model.parameters()) and a.trainable_params == 0
    assert a.flops == counter.get_total_flops() and a.row("0").flops == 2 * 4 * 16 * 32
    assert a.row("2").params == 32 * 8 + 8


def test_an_eval_transformer_encoder_under_no_grad_is_shown_as_torchs_fused_kernel() -> None:
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    # the reference: torch's profiler sees the fused kernel in a plain forward, and no Linear
    with torch.no_grad(), torch.profiler.profile() as prof:
        model(x)
    ran = {e.key for e in prof.key_averages()}
    assert "aten::_transformer_encoder_layer_fwd" in ran and "aten::linear" not in ran
    with torch.no_grad():
        a = fwdtrace.analyze(model, x, repeats=0)
    assert [r.key for r in a.rows if r.fused_kernel] == ["layers.0.TransformerEncoderLayer",
                                                        "layers.1.TransformerEncoderLayer"]
    assert a.row("layers.0").fused_kernel == "aten._transformer_encoder_layer_fwd"
    assert a.row("layers.0.linear1").calls == 0
    text = str(a)
    assert re.search(r"^layers\.0\.linear1\.Linear +\(fused\) +\(fused\) ", text, re.M)
    assert re.search(r"^\(fused\): layers\.0\.TransformerEncoderLayer, layers\.1\.TransformerEncoderLayer ran "
                     r"torch's fused kernel aten\._transformer_encoder_layer_fwd \(eval, no grad\)", text, re.M)
    # in training mode the layers run their sub-modules: nothing fused to say
    trained = fwdtrace.analyze(model.train(), x, repeats=0)
    assert not any(r.fused_kernel for r in trained.rows) and "(fused)" not in str(trained)
