"""Compiled models: every tool that attaches to a running model, on torch.compile'd ones.

Each case is checked against an eager copy of the model (plain torch hooks) and against the compiled
model itself: a backend that counts calls of the graphs it compiled says how many compiled graphs a
step runs, before a tool attaches and after it leaves, and dynamo's counters say how many graphs it
compiled and where it broke them.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from process_groups import run_in_session
from stats_reference import assert_moments, reference
from torch import nn
from torch._dynamo.utils import counters

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.instrument.compiled import compiled_parts, eager_path
from fwdtrace.live.sampler import Sampler

CALLS = [0]  # calls of compiled graphs since the last reset

# trace() says it traced through torch.compile wrappers (tests/test_tracer.py checks that it says so)
pytestmark = pytest.mark.filterwarnings("ignore:fwdtrace. (torch.compile'd|compiled) modules:UserWarning")


def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A backend that runs dynamo's graph as it is and counts its calls: no C++ compiler needed."""
    return lambda *a: (CALLS.__setitem__(0, CALLS[0] + 1), gm.forward(*a))[1]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Block(nn.Sequential):
    """A block with a forward of its own: dynamo compiles user code, and skips torch.nn's own frames."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = Block(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


KEYS = ["inp.Linear", "block.0.Linear", "block.1.GELU", "block.2.Linear", "block.Block", "out.Linear", "Net"]
LAYER = "block.0.Linear"  # the layer every tool below looks at


@dataclass
class Case:
    given: nn.Module  # what the tool is given
    run: nn.Module  # what the training loop calls
    eager: nn.Module  # an eager copy, for reference values


def make(how: str) -> Case:
    """The ways a training script compiles a model (``given eager``: the tool got the model before
    ``torch.compile`` wrapped it, and the loop runs the wrapper)."""
    torch.manual_seed(0)
    net = Net()
    eager = copy.deepcopy(net)
    if how == "torch.compile":
        compiled = torch.compile(net, backend=counting)
        return Case(compiled, compiled, eager)
    if how == "given eager":
        return Case(net, torch.compile(net, backend=counting), eager)
    if how == "module.compile":
        net.compile(backend=counting)
    elif how == "submodule":
        net.block = torch.compile(net.block, backend=counting)  # type: ignore[assignment]
    elif how == "submodule.compile":
        net.block.compile(backend=counting)
    return Case(net, net, eager)


HOWS = ["torch.compile", "given eager", "module.compile", "submodule", "submodule.compile"]
X = torch.randn(3, 4)


def step(model: nn.Module, x: torch.Tensor = X) -> int:
    """One training step (forward and backward, no optimizer: values stay put); the compiled-graph calls it made."""
    CALLS[0] = 0
    model(x).square().mean().backward()
    return CALLS[0]


def compile_state() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def eager_outputs(model: nn.Module, key: str, steps: int) -> list[torch.Tensor]:
    """What a plain forward hook on the eager copy sees at ``key``, over training steps."""
    seen: list[torch.Tensor] = []
    module = fwdtrace.instrument.keys.key2module(model)[key]
    handle = module.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    for _ in range(steps):
        step(model)
    handle.remove()
    return seen


# -- one set of keys ---------------------------------------------------------------------------------
@pytest.mark.parametrize("how", HOWS)
def test_keys_are_the_eager_models(how: str) -> None:
    case = make(how)
    assert fwdtrace.module_keys(case.given) == KEYS == fwdtrace.module_keys(case.eager)
    assert fwdtrace.module_keys(case.run) == KEYS
    probe = fwdtrace.Probe(case.given)
    assert probe.keys == KEYS
    layer = fwdtrace.instrument.keys.key2module(case.given)[LAYER]
    # what named_modules() of a torch.compile wrapper spells still selects the same layer
    for name in (LAYER, "block.0", "_orig_mod.block.0.Linear", "block._orig_mod.0", "_orig_mod.block._orig_mod.0"):
        assert probe.select(name) == {LAYER: layer}
    assert list(probe.select("_orig_mod")) == ["Net"]


def test_a_compiled_models_key_error_names_eager_keys() -> None:
    probe = fwdtrace.Probe(torch.compile(Net(), backend=counting))
    with pytest.raises(FwdtraceError, match=r"^Probe expected a module key or path.*closest keys: 'block.0.Linear'"):
        probe.select("block.0.Lin")


def test_eager_path_strips_only_whole_orig_mod_steps() -> None:
    assert eager_path("_orig_mod.0.Linear") == "0.Linear"
    assert eager_path("a._orig_mod.b._orig_mod.c") == "a.b.c"
    assert eager_path("my_orig_mod.x") == "my_orig_mod.x"


def test_the_trace_and_the_live_keys_agree_on_a_compiled_model() -> None:
    case = make("torch.compile")
    step(case.run)
    graph = fwdtrace.trace(case.given, X)
    assert [n.module_path for n in graph.nodes if n.kind == "module"] == [
        n.module_path for n in fwdtrace.trace(case.eager, X).nodes if n.kind == "module"]
    sampler = Sampler(case.given)
    try:
        assert list(sampler.key2module) == KEYS
        assert sampler.arm("_orig_mod.block.0", "forward") == [LAYER]
    finally:
        sampler.close()


# -- never silent, and as compiled as it was ----------------------------------------------------------
def probe_session(given: nn.Module, run: nn.Module, steps: int) -> list[float]:
    with fwdtrace.Probe(given) as probe:
        stats = probe.running_stats(LAYER)
        for _ in range(steps):
            step(run)
    s = stats.stats[LAYER]
    return [s.count, s.mean, s.max]


def probe_reference(outputs: list[torch.Tensor]) -> list[float]:
    values = torch.cat([o.reshape(-1) for o in outputs]).double()
    return [values.numel(), float(values.mean()), float(values.max())]


def sampler_session(given: nn.Module, run: nn.Module, steps: int) -> list[float]:
    sampler = Sampler(given)
    try:
        sampler.arm(LAYER, "forward")
        for _ in range(steps):
            step(run)
        sampler.drain(30)
        samples = sampler.samples(LAYER, "forward")
    finally:
        sampler.close()
    return [t["mean"] for s in samples for t in s["tensors"] if t["role"] == "output"]


TOOLS: dict[str, tuple[Callable[..., list[float]], Callable[[list[torch.Tensor]], list[float]]]] = {
    "probe": (probe_session, probe_reference),
    "sampler": (sampler_session, lambda outputs: [float(o.double().mean()) for o in outputs]),
}
# Where the tool's hooks run inside a compiled copy of the model: one graph compiled while attached.
# (A Sampler's root compiled in place runs eagerly while served: its step count hooks it.)
IN_GRAPH = {(tool, how) for tool in TOOLS for how in HOWS if how != "given eager"} - {("sampler", "module.compile")}


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("how", HOWS)
def test_tools_record_eager_values_and_leave_the_model_compiled(tool: str, how: str) -> None:
    session, reference = TOOLS[tool]
    case = make(how)
    before = [step(case.run) for _ in range(2)]
    assert before[-1] >= 1  # the model runs compiled code
    graphs = compile_state()
    got = session(case.given, case.run, 2)
    assert got == pytest.approx(reference(eager_outputs(case.eager, LAYER, 2)), rel=1e-6)
    armed = compile_state()
    assert armed == (graphs[0] + ((tool, how) in IN_GRAPH), graphs[1])  # at most the armed copy, unbroken
    after = [step(case.run) for _ in range(2)]
    assert after == before[-1:] * 2 and compile_state() == armed  # the same graphs, none compiled anew


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_tool_attached_before_the_first_compiled_call_leaves_no_broken_up_code(tool: str) -> None:
    session, reference = TOOLS[tool]
    case = make("torch.compile")
    got = session(case.given, case.run, 2)
    assert got == pytest.approx(reference(eager_outputs(case.eager, LAYER, 2)), rel=1e-6)
    in_graph = (tool, "torch.compile") in IN_GRAPH
    assert compile_state() == (int(in_graph), 0)  # the tool's own compiled copy at most, unbroken
    assert [step(case.run) for _ in range(3)] == [1, 1, 1]
    assert compile_state() == (1 + in_graph, 0)


@pytest.mark.parametrize("how", HOWS)
def test_a_dump_of_a_compiled_model_is_the_eager_models(how: str, tmp_path: Path) -> None:
    case = make(how)
    warm = step(case.run)
    graphs = compile_state()
    dumper = fwdtrace.Dumper(tmp_path)
    dumper.register(case.given)
    step(case.run)
    [path] = dumper.remove()
    tree = fwdtrace.read_dump(path, show=False, values=True)
    assert tree["status"] == "complete"
    groups = {g["attrs"]["module_key"]: g["datasets"] for g in tree["groups"].values()}
    assert list(groups) == ["Net", "inp.Linear", "block.Block", "block.0.Linear", "block.1.GELU",
                            "block.2.Linear", "out.Linear"]
    [want] = eager_outputs(case.eager, LAYER, 1)
    torch.testing.assert_close(torch.as_tensor(groups[LAYER]["output0"]["value"]), want)
    assert "grad_output0" in groups[LAYER]
    assert step(case.run) == warm and compile_state() == graphs


def test_analyze_times_the_eager_modules_and_leaves_the_model_compiled() -> None:
    case = make("submodule")
    assert step(case.run) == 1
    graphs = compile_state()
    report = fwdtrace.analyze(case.given, X, warmup=1, repeats=2)
    eager = fwdtrace.analyze(case.eager, X, repeats=0)
    assert [r.key for r in report.rows] == KEYS and report.flops == eager.flops
    assert [r.calls for r in report.rows] == [r.calls for r in eager.rows]
    assert report.ran_eager == ("block",) and eager.ran_eager == ()
    assert "(eager: its torch.compile'd block ran uncompiled)" in str(report)
    assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == graphs


def test_trace_runs_compiled_submodules_eagerly_and_leaves_them_compiled() -> None:
    case = make("submodule.compile")
    assert step(case.run) == 1
    graphs = compile_state()
    with pytest.warns(UserWarning, match="compiled modules"):
        graph = fwdtrace.trace(case.given, X)
    want = fwdtrace.trace(case.eager, X)
    assert [(n.kind, n.name, n.module_path) for n in graph.nodes] == [(n.kind, n.name, n.module_path) for n in want.nodes]
    assert step(case.run) == 1 and compile_state() == graphs


def test_everything_is_put_back_whichever_tool_leaves_first() -> None:
    case = make("module.compile")
    compiled_call = case.run._compiled_call_impl
    step(case.run)
    probe = fwdtrace.Probe(case.given)
    handle = probe.running_stats(LAYER)
    sampler = Sampler(case.given)
    sampler.arm(LAYER, "grad")
    assert case.run._compiled_call_impl is not compiled_call and step(case.run) == 0  # eager while attached
    handle.remove()
    assert case.run._compiled_call_impl is not compiled_call  # the sampler's arm still holds it
    assert step(case.run) == 0
    sampler.close()
    assert case.run._compiled_call_impl is compiled_call
    assert step(case.run) == 1


def test_a_compiled_forward_function_is_refused_at_once() -> None:
    net = Net()
    net.block.forward = torch.compile(net.block.forward, backend=counting)  # type: ignore[method-assign]
    with pytest.raises(FwdtraceError, match=r"^Probe cannot reach into module 'block' \(Block\): its forward "
                       r"is a torch.compile'd function"):
        fwdtrace.Probe(net).running_stats(LAYER)


def test_compiled_parts_names_each_compiled_module_by_its_eager_path() -> None:
    assert compiled_parts(make("torch.compile").given) == [("", "torch.compile")]
    assert compiled_parts(make("submodule").given) == [("block", "torch.compile")]
    assert compiled_parts(make("submodule.compile").given) == [("block", "module.compile")]
    assert compiled_parts(Net()) == []


@pytest.mark.parametrize("how", ["torch.compile", "module.compile", "submodule"])
def test_fwdtraces_dispatch_point_adds_no_compiled_graph(how: str) -> None:
    # A probe without hooks only watches module calls for error notes, through the patched
    # nn.Module._call_impl: dynamo must start its frames where it does without fwdtrace.
    case = make(how)
    with fwdtrace.Probe(case.given):
        assert [step(case.run) for _ in range(2)] == [1, 1]
    assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == (1, 0)


def test_a_model_compiled_in_place_while_a_tool_is_attached_compiles_once(recwarn: pytest.WarningsRecorder) -> None:
    torch.manual_seed(0)
    net, other = Net(), Net()
    with fwdtrace.Probe(other) as probe:
        probe.running_stats("*")
        net.compile(backend=counting)  # what it compiles is nn.Module._call_impl, fwdtrace's while patched
        assert [step(net) for _ in range(2)] == [1, 1]
    assert [step(net) for _ in range(2)] == [1, 1] and compile_state() == (1, 0)
    assert not [w for w in recwarn if "torch._dynamo" in w.filename or "fwdtrace" in str(w.message)]


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_the_live_service_names_eager_keys_and_leaves_an_idle_model_compiled(how: str) -> None:
    from test_live import request

    case = make(how)
    assert step(case.run) == 1
    graphs = compile_state()
    with fwdtrace.serve(case.given, port=0) as server:
        idle = [step(case.run) for _ in range(3)]  # the first one also traces the graph, eagerly
        # Idle, a torch.compile wrapper keeps its compiled code; a model compiled in place runs its own
        # hooks (the step count) inside it, so it runs eagerly while served.
        assert idle == ([1, 1, 1] if how == "torch.compile" else [0, 0, 0])
        _, keys = request(server, "GET", "/api/keys")
        assert [k["key"] for k in keys] == KEYS
        assert server.graph is not None
        assert {n.module_key for n in server.graph.nodes if n.kind == "module"} <= set(KEYS)  # the page's boxes
        _, answer = request(server, "POST", "/api/sample", {"key": "_orig_mod.block.0", "kind": "forward"})
        assert answer["armed"] == [LAYER]
        # A torch.compile wrapper runs a compiled copy with the arm's hooks; a model compiled in place, eagerly.
        assert answer["runs"] == ("compiled" if how == "torch.compile" else "eager")
        _, answer = request(server, "POST", "/api/sample", {"key": LAYER, "kind": "weight"})
        assert answer["runs"] == ("compiled" if how == "torch.compile" else "eager")  # served in place: eager
        assert [step(case.run) for _ in range(2)] == ([1, 1] if how == "torch.compile" else [0, 0])
        _, answer = request(server, "DELETE", f"/api/sample?key={LAYER}&kind=forward")
        assert answer["disarmed"] == [LAYER]
        # The weight arm hooks gradient accumulation, which autograd runs outside compiled graphs.
        assert [step(case.run) for _ in range(2)] == idle[:2]
        server.sampler.drain(30)
        _, forward = request(server, "GET", f"/api/samples?key={LAYER}&kind=forward")
        _, weight = request(server, "GET", f"/api/samples?key={LAYER}&kind=weight")
        _, status = request(server, "GET", "/api/status")
        assert status["step"] == 7
    want = eager_outputs(case.eager, LAYER, 2)
    assert [t["mean"] for s in forward["samples"] for t in s["tensors"] if t["role"] == "output"] == pytest.approx(
        [float(o.double().mean()) for o in want], rel=1e-6)
    assert weight["taken"] == 4
    eager_weight = float(case.eager.block[0].weight.detach().double().mean())
    assert [t["mean"] for s in weight["samples"] for t in s["tensors"] if t["role"] == "weight"] == pytest.approx(
        [eager_weight] * 4, rel=1e-6)
    in_graph = how == "torch.compile"  # the forward arm's compiled copy: one graph more, no break
    assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == (graphs[0] + in_graph, graphs[1])


def test_regional_compilation_of_a_transformers_models_blocks(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, attn_implementation="eager", use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    eager = copy.deepcopy(model)
    for block in model.model.layers:  # regional compilation: each repeated block on its own
        block.compile(backend=counting)
    ids = torch.randint(0, 64, (1, 6))

    def llama_step(m: nn.Module) -> int:
        CALLS[0] = 0
        m(ids).logits.square().mean().backward()
        return CALLS[0]

    before = [llama_step(model) for _ in range(2)]
    assert before[-1] >= 2  # one graph per block, at least
    graphs = compile_state()
    assert fwdtrace.module_keys(model) == fwdtrace.module_keys(eager)
    key = "model.layers.1.mlp.down_proj.Linear"
    with fwdtrace.Probe(model) as probe:
        stats = probe.running_stats(key)
        assert llama_step(model) == before[-1]  # the probed block runs a compiled copy with the probe's hooks
    graphs = (graphs[0] + 1, graphs[1])  # that copy, with no break
    seen: list[torch.Tensor] = []
    handle = eager.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    llama_step(eager)
    handle.remove()
    assert stats.stats[key].count == seen[0].numel()
    assert stats.stats[key].mean == pytest.approx(float(seen[0].double().mean()), rel=1e-5)
    assert [llama_step(model) for _ in range(2)] == before and compile_state() == graphs

    trees, dumped = [], []
    for m, folder in ((model, tmp_path / "compiled"), (eager, tmp_path / "eager")):
        dumper = fwdtrace.Dumper(folder)
        dumper.register(m, grads=False)
        CALLS[0] = 0
        with torch.no_grad():
            m(ids)
        dumped.append(CALLS[0])
        trees.append(fwdtrace.read_dump(dumper.remove()[0], show=False, values=True))
    assert dumped[0] == before[-1]  # each block ran a compiled copy with the dump's hooks
    graphs = (graphs[0] + len(model.model.layers), graphs[1])  # one copy per compiled block, with no break
    assert compile_state() == graphs
    assert trees[0]["status"] == "complete" and trees[0]["attrs"]["compiled"].startswith("compiled: ")
    calls = [[(g["attrs"]["module_key"], g["attrs"]["module_path"]) for g in t["groups"].values()] for t in trees]
    assert calls[0] == calls[1]
    for got, want in zip(trees[0]["groups"].values(), trees[1]["groups"].values(), strict=True):
        if "output0" in want["datasets"]:
            torch.testing.assert_close(torch.as_tensor(got["datasets"]["output0"]["value"]),
                                       torch.as_tensor(want["datasets"]["output0"]["value"]))
    assert llama_step(model) == before[-1] and compile_state() == graphs


def test_the_recorder_records_a_compiled_models_eager_values_under_eager_keys(tmp_path: Path) -> None:
    case = make("torch.compile")
    assert step(case.run) == 1
    graphs = compile_state()
    recorded: list[torch.Tensor] = []
    with fwdtrace.Recorder(tmp_path, transform=lambda t: recorded.append(t.clone()) or t, timeout=300.0) as rec:
        assert rec.track(case.given, "_orig_mod.block.0", kind="forward") == [LAYER]
        recording = [step(case.run) for _ in range(2)]
    paths = rec.stop()
    assert sorted(p.name for p in paths) == [f"{LAYER}.forward.mp4", f"{LAYER}.forward.png"]
    for got, want in zip(recorded, eager_outputs(case.eager, LAYER, 2), strict=True):
        torch.testing.assert_close(got, want)
    # The outputs are copied inside a compiled copy of the model: one graph compiled when tracked, no break.
    assert recording == [1, 1] and compile_state() == (graphs[0] + 1, 0)
    assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == (graphs[0] + 1, 0)


def test_a_dump_that_records_no_call_below_the_root_is_not_complete(tmp_path: Path) -> None:
    class Functional(nn.Module):  # its layer's hooks never run: what a layer inside compiled code looked like
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.lin.weight, self.lin.bias)

    model = Functional()
    dumper = fwdtrace.Dumper(tmp_path)
    dumper.register(model, grads=False)
    model(torch.ones(1, 2))
    [path] = dumper.remove()
    assert fwdtrace.read_dump(path, show=False)["status"] == (
        "incomplete: stopped after 000_Functional (no call of the model's layers was recorded, only the root's)")


def test_a_wrapper_made_after_the_tool_attached_in_a_fresh_process() -> None:
    # Before torch.compile first runs, torch._dynamo is not even imported: the tool cannot know of the
    # wrapper to come, and the dispatch point must send it to the model all the same.
    script = """
import sys, torch, fwdtrace
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
x = torch.randn(3, 4)
reference = [model[0](x).detach()]
assert "torch._dynamo" not in sys.modules
probe = fwdtrace.Probe(model)
stats = probe.running_stats("0.Linear")
calls = [0]
def counting(gm, example_inputs):
    return lambda *a: (calls.__setitem__(0, calls[0] + 1), gm.forward(*a))[1]
compiled = torch.compile(model, backend=counting)
compiled(x)
assert calls[0] == 0 and stats.stats["0.Linear"].count == 24, (calls, stats.stats)
assert abs(stats.stats["0.Linear"].mean - float(reference[0].double().mean())) < 1e-6
probe.remove()
compiled(x); compiled(x)
from torch._dynamo.utils import counters
assert calls[0] == 2 and counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (calls, counters)
print("ok")
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_chaos_on_a_compiled_model_injects_what_it_injects_on_the_eager_one() -> None:
    case = make("torch.compile")
    assert step(case.run) == 1
    graphs = compile_state()
    with fwdtrace.Probe(case.given) as probe:
        chaos = probe.chaos(LAYER, fault="zero")
        compiled_out = case.run(X)
    with fwdtrace.Probe(case.eager) as probe:
        probe.chaos(LAYER, fault="zero")
        eager_out = case.eager(X)
    torch.testing.assert_close(compiled_out, eager_out)
    assert [i.key for i in chaos.log] == [LAYER]
    assert step(case.run) == 1 and compile_state() == graphs


# -- sampled at compiled speed ------------------------------------------------------------------------
def eager_stats(outputs: list[torch.Tensor], **options: Any) -> dict[str, Any]:
    stats = fwdtrace.instrument.stats.RunningStats(**options)
    for o in outputs:
        stats.update(o)
    return stats.to_dict()


@pytest.mark.parametrize("how", ["torch.compile", "submodule", "module.compile", "submodule.compile"])
def test_forward_statistics_are_computed_inside_the_compiled_graph(how: str) -> None:
    case = make(how)
    assert [step(case.run) for _ in range(2)] == [1, 1]
    graphs = compile_state()
    with fwdtrace.Probe(case.given) as probe:
        out = probe.running_stats([LAYER, "out.Linear"])  # (a submodule compiled alone leaves out.Linear eager)
        inp = probe.running_stats("block.2.Linear", of="input", bins=4, range=(-0.2, 0.2))
        armed = [step(case.run) for _ in range(3)]
        assert "computed inside the compiled graphs" in repr(out)
    assert armed == [1, 1, 1]  # compiled code while armed, one graph per step
    assert compile_state() == (graphs[0] + 1, 0)  # arming compiled one graph, with no break
    for key in (LAYER, "out.Linear"):
        assert out.stats[key].to_dict() == pytest.approx(eager_stats(eager_outputs(case.eager, key, 3)), rel=1e-9)
    gelu = eager_outputs(case.eager, "block.1.GELU", 3)
    assert inp.stats["block.2.Linear"].to_dict() == pytest.approx(eager_stats(gelu, bins=4, range=(-0.2, 0.2)), rel=1e-9)
    assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == (graphs[0] + 1, 0)


def test_each_key_set_compiles_once_for_the_life_of_the_process_and_disarming_compiles_nothing() -> None:
    """Arming a key set armed before (the same probe, a new probe, the live page's toggles) runs the copy
    compiled then: no compilation. Before, every arming compiled the whole model again."""
    case = make("torch.compile")
    step(case.run)
    probe = fwdtrace.Probe(case.given)
    counts, handles = [], []
    for selector in (LAYER, LAYER, "block.*", LAYER):
        handle = probe.running_stats(selector)
        handles.append(handle)
        counts.append([step(case.run) for _ in range(2)] + [compile_state()[0]])
        handle.remove()
        counts.append([step(case.run) for _ in range(2)] + [compile_state()[0]])
    assert counts == [[1, 1, 2], [1, 1, 2], [1, 1, 2], [1, 1, 2], [1, 1, 3], [1, 1, 3], [1, 1, 3], [1, 1, 3]]
    with fwdtrace.Probe(case.given) as again:  # a new Probe, the same key set
        fresh = again.running_stats(LAYER)
        step(case.run, X * 10)  # other values: the copy reads this probe's state, not the first's
    assert compile_state() == (3, 0)
    want = eager_stats(eager_outputs(case.eager, LAYER, 2))
    assert all(h.stats[LAYER].to_dict() == pytest.approx(want, rel=1e-9) for h in handles if LAYER in h.keys)
    seen: list[torch.Tensor] = []
    hook = fwdtrace.instrument.keys.key2module(case.eager)[LAYER].register_forward_hook(
        lambda m, a, out: seen.append(out.detach().clone()))
    case.eager(X * 10)
    hook.remove()
    assert fresh.stats[LAYER].to_dict() == pytest.approx(eager_stats(seen), rel=1e-9)


def test_toggling_a_live_forward_arm_compiles_at_most_once() -> None:
    case = make("torch.compile")
    step(case.run)
    graphs = compile_state()[0]
    sampler = Sampler(case.given)
    means = []
    try:
        for n in range(5):  # arm, step, disarm: what a click on the live page does
            sampler.arm(LAYER, "forward")
            step(case.run, X * (n + 1))
            sampler.drain(30)
            means.append([t["mean"] for s in sampler.samples(LAYER, "forward") for t in s["tensors"]
                          if t["role"] == "output"][-1])
            sampler.disarm(LAYER)
    finally:
        sampler.close()
    assert compile_state() == (graphs + 1, 0)
    seen: list[torch.Tensor] = []
    hook = fwdtrace.instrument.keys.key2module(case.eager)[LAYER].register_forward_hook(
        lambda m, a, out: seen.append(out.detach().clone()))
    for n in range(5):
        case.eager(X * (n + 1))
    hook.remove()
    for mean, o in zip(means, seen, strict=True):  # torch's, to the output's own rounding
        assert_moments(mean, None, None, o)


def test_in_graph_statistics_with_aot_autograd_train_as_the_eager_model() -> None:
    torch.manual_seed(0)
    net = Net()
    eager, trained = copy.deepcopy(net), copy.deepcopy(net)
    compiled = torch.compile(net, backend="aot_eager")
    with fwdtrace.Probe(compiled) as probe:
        stats = probe.running_stats(["block.*"], bins=8)
        for _ in range(2):
            step(compiled)
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    for key in ("block.0.Linear", "block.1.GELU", "block.2.Linear"):
        assert stats.stats[key].to_dict() == pytest.approx(eager_stats(eager_outputs(eager, key, 2), bins=8), rel=1e-9)
    for _ in range(2):
        step(trained)
    for p, q in zip(net.parameters(), trained.parameters(), strict=True):  # the hooks left training alone
        torch.testing.assert_close(p.grad, q.grad)


SPECIAL = {
    "nan and inf": torch.tensor([1.0, float("nan"), -2.0, float("inf"), 0.0, float("-inf")]),
    "constant": torch.full((5,), 3.0),
    "no finite value": torch.tensor([float("nan"), float("inf")]),
    "empty": torch.zeros(0),
    "complex": torch.tensor([1 + 2j, -3 + 0j]),
    "half": torch.tensor([0.5, -1.5, 2.0], dtype=torch.float16),
}


@pytest.mark.parametrize("name", list(SPECIAL))
@pytest.mark.parametrize("range_", [None, (-1.0, 1.0)])
def test_a_summary_merges_as_running_stats_update(name: str, range_: tuple[float, float] | None) -> None:
    from fwdtrace.instrument.ingraph import StatsSlot, drain
    from fwdtrace.instrument.stats import RunningStats

    batches = [SPECIAL[name], torch.linspace(-2, 4, 7).to(SPECIAL[name].dtype)]
    want, got = RunningStats(4, range_), RunningStats(4, range_)
    slot = StatsSlot(got)
    for batch in batches:
        want.update(batch)
        slot.add(batch)
    drain()
    slot.close()
    assert got.to_dict() == pytest.approx(want.to_dict(), rel=1e-12, nan_ok=True)


def test_in_graph_and_eager_routes_share_a_wrapper_whichever_leaves_first() -> None:
    case = make("torch.compile")
    original = case.run.forward
    step(case.run)
    probe = fwdtrace.Probe(case.given)
    stats = probe.running_stats(LAYER)
    sampler = Sampler(case.given)
    sampler.arm(LAYER, "grad")  # needs the eager route: the in-graph hooks then run eagerly
    assert step(case.run) == 0
    sampler.close()
    assert step(case.run) == 1  # back in the compiled copy with the probe's hooks
    probe.remove()
    assert case.run.forward is original and step(case.run) == 1
    assert stats.stats[LAYER].to_dict() == pytest.approx(eager_stats(eager_outputs(case.eager, LAYER, 2)), rel=1e-9)


@pytest.mark.parametrize(("how", "of", "says"), [
    ("torch.compile", "output", "computed inside the compiled graphs"),
    ("torch.compile", "grad_output", "the compiled parts run eagerly while attached"),
    ("module.compile", "output", "computed inside the compiled graphs"),
    ("submodule.compile", "input", "computed inside the compiled graphs"),
    ("submodule.compile", "grad_input", "the compiled parts run eagerly while attached"),
])
def test_a_stats_handle_says_how_the_model_runs(how: str, of: str, says: str) -> None:
    case = make(how)
    with fwdtrace.Probe(case.given) as probe:
        handle = probe.running_stats(LAYER, of=of)
        assert repr(handle) == f"StatsHandle({LAYER}; of={of}; {says})"
        assert handle.in_graph == (says.startswith("computed"))


def test_a_forward_arm_samples_the_compiled_graphs_copies() -> None:
    case = make("submodule")
    assert step(case.run) == 1
    graphs = compile_state()
    sampler = Sampler(case.given)
    try:
        sampler.arm(LAYER, "forward", every=2)
        assert sampler.arms[(LAYER, "forward")].info()["runs"] == "compiled"
        assert [step(case.run) for _ in range(4)] == [1, 1, 1, 1]
        assert compile_state() == (graphs[0] + 1, 0)  # arming compiled one graph, with no break
        sampler.disarm(LAYER)
        assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == (graphs[0] + 1, 0)
        sampler.drain(30)
        samples = sampler.samples(LAYER, "forward")
        info = sampler.arms[(LAYER, "forward")].info()
    finally:
        sampler.close()
    assert (info["calls"], info["taken"]) == (4, 2)  # every call counted after its graph, every second sampled
    want = eager_outputs(case.eager, LAYER, 4)[::2]
    got = [t["mean"] for s in samples for t in s["tensors"] if t["role"] == "output"]
    assert len(got) == len(want)
    for mean, o in zip(got, want, strict=True):  # torch's, to the output's own rounding
        assert_moments(mean, None, None, o)


def test_a_transformer_blocks_layers_are_sampled_compiled() -> None:
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
    eager = copy.deepcopy(block)
    compiled = torch.compile(block, backend=counting)
    x = torch.randn(2, 5, 16)
    compiled(x).sum().backward()
    counters.clear()
    stats, calls = [], []
    for model in (compiled, eager):
        with fwdtrace.Probe(model) as probe:
            # the attention's tuple output, a layer, a norm and the whole block
            stats.append(probe.running_stats(["self_attn", "linear2", "norm1", "TransformerEncoderLayer"]))
            for _ in range(2):
                CALLS[0] = 0
                model(x).sum().backward()
                calls.append(CALLS[0])
    assert calls == [1, 1, 0, 0]
    assert stats[0].in_graph and sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert list(stats[0].stats) == list(stats[1].stats) and len(stats[1].stats) == 4
    for key, want in stats[1].stats.items():
        assert stats[0].stats[key].to_dict() == pytest.approx(want.to_dict(), rel=1e-6), key


def test_what_cannot_be_compiled_with_the_hooks_runs_eagerly_and_says_so() -> None:
    compiles = [0]

    def first_only(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiles[0] += 1
        if compiles[0] > 1:
            raise RuntimeError("this backend compiles one graph")
        return counting(gm, example_inputs)

    torch.manual_seed(0)
    net = Net()
    eager = copy.deepcopy(net)
    compiled = torch.compile(net, backend=first_only)
    assert step(compiled) == 1
    with fwdtrace.Probe(compiled) as probe:
        stats = probe.running_stats(LAYER)
        with pytest.warns(RuntimeWarning, match=r"^fwdtrace: compiling Net with the hooks of the tools attached "
                          r"failed \(BackendCompilerFailed: .*\); it runs eagerly while they are attached"):
            assert step(compiled) == 0
        assert step(compiled) == 0  # eager, without trying again
    assert stats.stats[LAYER].to_dict() == pytest.approx(eager_stats(eager_outputs(eager, LAYER, 2)), rel=1e-9)
    assert step(compiled) == 1


def test_a_failing_compiled_forward_arm_disarms_its_key_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make("torch.compile")
    original = case.run.forward
    assert step(case.run) == 1
    sampler = Sampler(case.given)
    try:
        def broken(*args: Any) -> None:
            raise ValueError("no room")

        monkeypatch.setattr(sampler, "_submit", broken)
        sampler.arm(LAYER, "forward")
        assert step(case.run) == 1  # the step ran compiled and finished
        info = sampler.arms[(LAYER, "forward")].info()
        assert not info["armed"] and info["error"] == "disarmed: the forward hook raised ValueError: no room"
        assert case.run.forward is original and step(case.run) == 1  # the model's own graph again
    finally:
        sampler.close()


# -- inductor, the backend most training scripts compile with ----------------------------------------
_CXX = next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)), None)


@pytest.mark.skipif(_CXX is None, reason="inductor on the CPU needs a C++ compiler (g++ or clang++), none on PATH")
def test_inductor_compiled_forward_statistics_equal_the_eager_models() -> None:
    """The default backend, which generates and compiles C++: statistics computed inside its code equal a
    plain hook's on an eager copy (to float32 rounding: inductor fuses), with no graph break."""
    torch.manual_seed(0)
    net = Net()
    eager = copy.deepcopy(net)
    compiled = torch.compile(net)  # inductor
    compiled(X).square().mean().backward()
    with fwdtrace.Probe(compiled) as probe:
        handle = probe.running_stats(LAYER)
        for _ in range(2):
            compiled(X).square().mean().backward()
        assert "computed inside the compiled graphs" in repr(handle)
    assert sum(counters["graph_break"].values()) == 0
    got, want = handle.stats[LAYER].to_dict(), eager_stats(eager_outputs(eager, LAYER, 2))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert torch.allclose(compiled(X), eager(X), rtol=1e-5, atol=1e-6)  # still the model it was


@pytest.mark.skipif(_CXX is None, reason="inductor on the CPU needs a C++ compiler (g++ or clang++), none on PATH")
def test_an_inductor_compiled_statistics_dump_equals_the_eager_models(tmp_path: Path) -> None:
    """A forward statistics dump of a model compiled by inductor: every layer's statistics (of the tensors taken
    inside the generated code) are torch's on the eager copy (to float32 rounding: inductor fuses the model's own
    ops), the histogram's counts included, with no graph break. Before, each summary was traced into the graph by
    its in-place route, dozens of kernels per tensor to generate: compiling took minutes."""
    torch.manual_seed(0)
    net = Net()
    eager = copy.deepcopy(net)
    compiled = torch.compile(net)  # inductor
    compiled(X).square().mean().backward()
    dumper = fwdtrace.Dumper(tmp_path, values="statistics")
    dumper.register(compiled, grads=False)
    compiled(X).square().mean().backward()
    [path] = dumper.remove()
    assert sum(counters["graph_break"].values()) == 0
    tree = fwdtrace.read_dump(path, show=False)
    assert tree["attrs"]["compiled"].startswith("compiled: ")
    groups = {g["attrs"]["module_key"]: g["datasets"] for g in tree["groups"].values()}
    [want] = eager_outputs(eager, LAYER, 1)  # torch itself, on the eager copy
    got = groups[LAYER]["output0"]["statistics"]
    flat = want.double().reshape(-1)
    assert got["count"] == got["finite"] == flat.numel() and got["nans"] == got["infs"] == 0
    expected = {"mean": flat.mean(), "std": flat.std(correction=0), "min": flat.min(), "max": flat.max(),
                "norm": torch.linalg.vector_norm(flat)}
    assert {k: got[k] for k in expected} == pytest.approx({k: float(v) for k, v in expected.items()}, rel=1e-5)
    assert got["histogram"] == reference(want)["histogram"]  # the power-of-two bins of the same sampled values


# -- forward dumps inside the compiled code ---------------------------------------------------------------
def dump_step(model: nn.Module, run: nn.Module, folder: Path, values: str) -> tuple[Path, int]:
    """One step dumped (forward only, ``grads=False``): the dump's path and the compiled-graph calls it made."""
    dumper = fwdtrace.Dumper(folder, values=values)
    dumper.register(model, grads=False)
    calls = step(run)
    [path] = dumper.remove()
    return path, calls


@pytest.mark.parametrize(("how", "values"), [("torch.compile", "statistics"), ("torch.compile", "tensors"),
                                           ("submodule", "statistics"), ("submodule.compile", "tensors")])
def test_a_forward_dump_runs_inside_the_compiled_code_and_equals_the_eager_models(
        how: str, values: str, tmp_path: Path) -> None:
    case = make(how)
    warm = [step(case.run) for _ in range(2)]
    assert warm == [1, 1]
    graphs = compile_state()
    path, calls = dump_step(case.given, case.run, tmp_path / "compiled", values)
    assert calls == 1  # the step ran compiled code (the eager route runs none)
    assert compile_state() == (graphs[0] + 1, 0)  # one compilation for the registration, no graph break
    eager_path_, _ = dump_step(case.eager, case.eager, tmp_path / "eager", values)
    tree = fwdtrace.read_dump(path, show=False, values=True)
    assert tree["status"] == "complete"
    assert tree["attrs"]["compiled"].startswith("compiled: ")
    report = fwdtrace.compare_dumps(path, eager_path_, rtol=1e-6)
    assert report.equal and report.rows and not report.only_in_a and not report.only_in_b
    groups = {g["attrs"]["module_key"]: g["datasets"] for g in tree["groups"].values()}
    assert list(groups) == ["Net", "inp.Linear", "block.Block", "block.0.Linear", "block.1.GELU",
                            "block.2.Linear", "out.Linear"]
    [want] = eager_outputs(case.eager, LAYER, 1)  # torch itself, on the eager copy
    got = groups[LAYER]["output0"]
    if values == "tensors":
        torch.testing.assert_close(torch.as_tensor(got["value"]), want)
    else:
        assert got["shape"] == list(want.shape) and got["dtype"] == "float32"
        assert got["statistics"]["mean"] == pytest.approx(float(want.double().mean()), rel=1e-6)
        assert got["statistics"]["max"] == pytest.approx(float(want.max()), rel=1e-6)
    # removed: the model's own graphs again, nothing compiled anew
    assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == (graphs[0] + 1, 0)


def test_a_forward_dump_of_a_model_compiled_before_its_first_call_leaves_no_broken_up_code(tmp_path: Path) -> None:
    case = make("torch.compile")
    path, calls = dump_step(case.given, case.run, tmp_path, "statistics")
    assert calls == 1 and compile_state() == (1, 0)  # the dump's compiled copy only, unbroken
    assert fwdtrace.read_dump(path, show=False)["status"] == "complete"
    assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == (2, 0)


def test_a_gradient_dump_of_a_compiled_model_says_it_ran_eagerly(tmp_path: Path) -> None:
    case = make("torch.compile")
    step(case.run)
    dumper = fwdtrace.Dumper(tmp_path)
    with pytest.warns(UserWarning, match="runs the model's compiled parts eagerly for this dump: gradients"):
        dumper.register(case.given)
    assert step(case.run) == 0  # the eager route: no compiled graph ran
    tree = fwdtrace.read_dump(dumper.remove()[0], show=False)
    assert tree["status"] == "complete"
    assert tree["attrs"]["compiled"].startswith("eager: the compiled parts ran eagerly while dumped, as gradients")


def test_dumping_every_step_of_a_compiled_model_compiles_once(tmp_path: Path) -> None:
    case = make("submodule")
    step(case.run)
    graphs = compile_state()
    dumper = fwdtrace.Dumper(tmp_path / "compiled", values="statistics")
    calls = []
    for n in range(3):
        dumper.register(case.given, step=n, grads=False)
        calls.append(step(case.run))
    paths = dumper.remove()
    assert calls == [1, 1, 1] and compile_state() == (graphs[0] + 1, 0)  # the first registration's copy, run again
    reference, _ = dump_step(case.eager, case.eager, tmp_path / "eager", "statistics")
    for path in paths:  # no optimizer step: every step's values are the eager model's
        assert fwdtrace.compare_dumps(path, reference, rtol=1e-6).equal
    assert [step(case.run) for _ in range(2)] == [1, 1] and compile_state() == (graphs[0] + 1, 0)


# -- graph breaks: the model's own, after it has run compiled ----------------------------------------------
def _break(kind: str, x: torch.Tensor) -> torch.Tensor:
    """What a training script's forward does that dynamo cannot put in one graph."""
    if kind == "graph_break":
        torch._dynamo.graph_break()
    elif kind == "print":
        print(end="")
    elif kind == "item":
        x = x + x.sum().item() * 0
    elif kind == "if":  # a data-dependent branch
        if x.sum() > 1e9:
            x = x * 0
    return x


class BreakBlock(Block):
    kind = "if"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self[0](x)
        return self[2](self[1](_break(self.kind, x)))


class BreakNet(Net):
    kind = ""

    def __init__(self) -> None:
        super().__init__()
        self.block = BreakBlock(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _break(self.kind, self.inp(x))
        return self.out(self.block(x))


def make_breaking(kind: str, how: str, backend: Any = counting) -> Case:
    torch.manual_seed(0)
    net = BreakNet()
    net.kind = "" if how == "regional" else kind
    net.block.kind = kind if how == "regional" else ""
    eager = copy.deepcopy(net)
    if how == "torch.compile":
        compiled = torch.compile(net, backend=backend)
        return Case(compiled, compiled, eager)
    if how == "module.compile":
        net.compile(backend=backend)
    else:  # regional: the block with the data-dependent branch compiled alone
        net.block.compile(backend=backend)
    return Case(net, net, eager)


BREAK_KEYS = ["inp.Linear", "block.0.Linear", "block.2.Linear", "out.Linear"]


@pytest.mark.filterwarnings("ignore:fwdtrace. \\w+ runs eagerly while the hooks:fwdtrace.errors.FwdtraceWarning")  # the arm's
@pytest.mark.parametrize(("kind", "how"), [
    ("graph_break", "torch.compile"), ("print", "torch.compile"), ("item", "module.compile"), ("if", "regional"),
])
def test_every_forward_tool_records_every_call_of_a_model_with_graph_breaks(kind: str, how: str) -> None:
    """A model whose compiled forward breaks its graph, run compiled first (as every training loop has): a Probe's
    statistics and a live forward arm get every call, equal to the eager copy's, and fwdtrace says once, in one
    line, that the part runs eagerly and why. Before, the frames after the break ran code compiled without
    the hooks: the statistics were empty and the arm took nothing, without a word."""
    case = make_breaking(kind, how)
    step(case.run)
    assert sum(counters["graph_break"].values()) > 0  # the model's own breaks
    with pytest.warns(fwdtrace.errors.FwdtraceWarning, match=r"^fwdtrace: \w+ runs eagerly while the hooks on "
                      r".* are attached: its compiled code breaks the graph \(") as said:
        with fwdtrace.Probe(case.given) as probe:
            stats = probe.running_stats(BREAK_KEYS)
            for _ in range(2):
                step(case.run)
            assert "computed inside the compiled graphs" not in repr(stats)
            assert "breaks its graph" in repr(stats)
    assert len(said) == 1  # once, in one line
    sampler = Sampler(case.given)
    try:
        sampler.arm("block.2.Linear", "forward")
        for _ in range(2):
            step(case.run)
        sampler.drain(30)
        taken = sampler.arms[("block.2.Linear", "forward")].info()["taken"]
        samples = sampler.samples("block.2.Linear", "forward")
    finally:
        sampler.close()
    for key in BREAK_KEYS:
        assert stats.stats[key].to_dict() == pytest.approx(eager_stats(eager_outputs(case.eager, key, 2)), rel=1e-9)
    want = eager_outputs(case.eager, "block.2.Linear", 2)
    assert taken == 2
    got = [t["mean"] for s in samples for t in s["tensors"] if t["role"] == "output"]
    assert len(got) == len(want)
    for mean, o in zip(got, want, strict=True):  # torch's, to the output's own rounding
        assert_moments(mean, None, None, o)
    calls = step(case.run)
    assert calls >= 1  # the model's compiled code again once the tools left


def test_a_statistics_dump_of_a_model_with_a_graph_break_holds_every_eager_call(tmp_path: Path) -> None:
    case = make_breaking("graph_break", "torch.compile", backend="aot_eager")
    step(case.run)
    with pytest.warns(fwdtrace.errors.FwdtraceWarning, match="breaks the graph"):
        path, _ = dump_step(case.given, case.run, tmp_path / "compiled", "statistics")
    reference, _ = dump_step(case.eager, case.eager, tmp_path / "eager", "statistics")
    tree = fwdtrace.read_dump(path, show=False)
    assert tree["status"] == "complete"
    assert "breaks its graph" in tree["attrs"]["compiled"]
    report = fwdtrace.compare_dumps(path, reference, rtol=1e-6)
    assert report.equal and len(report.rows) == len(fwdtrace.compare_dumps(reference, reference).rows)


def test_a_key_that_gets_no_value_inside_the_compiled_code_is_named(tmp_path: Path) -> None:
    """A layer the compiled part runs without calling: every tool hears of it, once; a dump holds what the eager
    model's dump holds (complete: an eager run does not call it either) and names it in ``not_called``."""

    class Skips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Skips())
    eager = copy.deepcopy(model)
    model[1] = torch.compile(model[1], backend=counting)
    model(X)
    with pytest.warns(fwdtrace.errors.FwdtraceWarning, match=r"^fwdtrace: no value for 1\.unused\.Linear in a call "
                      r"of compiled Skips: not called in it, or not reached by its compiled code$") as said:
        with fwdtrace.Probe(model) as probe:
            stats = probe.running_stats(["1.used.Linear", "1.unused.Linear"])
            model(X)
            model(X)
    assert len(said) == 1 and list(stats.stats) == ["1.used.Linear"]
    paths = []
    for m, folder in ((model, "compiled"), (eager, "eager")):
        dumper = fwdtrace.Dumper(tmp_path / folder, values="statistics")
        dumper.register(m, grads=False)
        m(X)
        paths += dumper.remove()
    tree = fwdtrace.read_dump(paths[0], show=False)
    assert tree["status"] == "complete" and tree["attrs"]["not_called"] == "1.unused.Linear"
    assert "not_called" not in fwdtrace.read_dump(paths[1], show=False)["attrs"]
    assert fwdtrace.compare_dumps(paths[0], paths[1], rtol=1e-6).equal


_DISTRIBUTED = '''
import copy, json, socket, sys, torch, torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Block(nn.Sequential):  # forwards of the user's own, as training scripts' models have
    def forward(self, x):
        return self[1](self[0](x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 8), Block(nn.Linear(8, 8), nn.GELU()), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def run(rank, port, out):
    import fwdtrace
    from fwdtrace.live.sampler import Sampler
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls = [0]

    def counting(gm, example_inputs):
        return lambda *a: (calls.__setitem__(0, calls[0] + 1), gm.forward(*a))[1]

    def dump(model, folder):
        dumper = fwdtrace.Dumper(f"{out}/{folder}{rank}", values="statistics")
        dumper.register(model, grads=False)
        model(x).sum().backward()
        [path] = dumper.remove()
        return path

    results = {}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for how in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        net = Net()
        eager = copy.deepcopy(net)
        if how == "ddp":
            compiled, eager, key = torch.compile(DistributedDataParallel(net), backend=counting), \\
                DistributedDataParallel(eager), "module.block.0.Linear"
        else:
            mesh = init_device_mesh("cpu", (2,))
            fully_shard(net.block, mesh=mesh)
            compiled, key = torch.compile(fully_shard(net, mesh=mesh), backend=counting), "block.0.Linear"
        compiled(x).sum().backward()  # the first compiled call, as every training loop has made
        path, reference = dump(compiled, how), dump(eager, how + "eager")
        tree, want = fwdtrace.read_dump(path, show=False), fwdtrace.read_dump(reference, show=False)
        sampler = Sampler(compiled)
        sampler.arm(key, "forward")
        compiled(x).sum().backward()
        sampler.drain(30)
        taken = sampler.arms[(key, "forward")].info()["taken"]
        sampler.close()
        results[how] = {
            "status": tree["status"], "groups": [g["attrs"]["module_key"] for g in tree["groups"].values()],
            "eager_groups": [g["attrs"]["module_key"] for g in want["groups"].values()],
            "equal": fwdtrace.compare_dumps(path, reference, rtol=1e-6).equal, "taken": taken,
        }
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    other = mp.get_context("spawn").Process(target=run, args=(1, port, sys.argv[1]))
    other.start()
    run(0, port, sys.argv[1])
    other.join(120)
    sys.exit(other.exitcode)
'''


def test_compiled_ddp_and_fsdp2_on_two_ranks_dump_every_eager_group_and_sample(tmp_path: Path) -> None:
    """``torch.compile(DDP(model))`` and an FSDP2 model compiled whole, on two gloo ranks: a forward statistics
    dump holds every group the eager copy's dump holds, with its values, and a live forward arm takes samples.
    Before, DDP's and FSDP's graph breaks left the layers' hooks in frames compiled without them: a dump marked
    complete held the root alone."""
    import json
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(_DISTRIBUTED)
    done = run_in_session([sys.executable, str(script), str(tmp_path)], 300, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for how, got in results.items():
            assert got["status"] == "complete", (rank, how)
            assert got["groups"] == got["eager_groups"] and len(got["groups"]) >= 4, (rank, how, got)
            assert got["equal"] and got["taken"] == 1, (rank, how, got)
