"""Probes: shapes against plain hooks, injection against hand-computed results, grads against autograd."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
import torch.nn.functional as F
import zoo
from stats_reference import assert_moments
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.instrument.stats import RunningStats, summary_text


class TestModel(nn.Module):
    """The issue's example: seq.1.Conv2d sees [1, 20, 5, 5] and makes [1, 40, 5, 5]."""

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Conv2d(3, 20, 3, padding=1), nn.Conv2d(20, 40, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(40, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.seq(x)), 1))


def _model() -> TestModel:
    torch.manual_seed(0)
    return TestModel()


def _hook_shapes(model: nn.Module, x: torch.Tensor) -> dict[str, dict[str, list[list[int]]]]:
    """The reference: plain forward hooks on every module, keyed by path + class name."""
    out = {}
    handles = []
    for path, m in model.named_modules():
        key = f"{path}.{type(m).__name__}" if path else type(m).__name__

        def hook(mod, inputs, output, key=key):
            out[key] = {"input_shape": [list(t.shape) for t in inputs], "output_shape": [list(output.shape)]}

        handles.append(m.register_forward_hook(hook))
    model(x)
    for h in handles:
        h.remove()
    return out


def test_shapes_reproduce_the_issue_example_and_plain_hooks() -> None:
    model, x = _model(), torch.randn(1, 3, 5, 5)
    shapes = fwdtrace.Probe(model).shapes(x)
    assert shapes["seq.1.Conv2d"] == {"input_shape": [[1, 20, 5, 5]], "output_shape": [[1, 40, 5, 5]]}
    assert shapes == _hook_shapes(model, x)
    assert list(shapes)[-1] == "TestModel"  # modules in the order they finish, the root last
    assert json.loads(json.dumps(shapes)) == shapes


def test_shapes_put_the_whole_model_under_name() -> None:
    model, x = _model(), torch.randn(2, 3, 5, 5)
    shapes = fwdtrace.Probe(model, name="net").shapes(x)
    assert "TestModel" not in shapes
    assert shapes["net"] == {"input_shape": [[2, 3, 5, 5]], "output_shape": [list(model(x).shape)]}


def test_keys_and_selectors() -> None:
    probe = fwdtrace.Probe(_model())
    assert probe.keys == fwdtrace.module_keys(probe.model)
    assert list(probe.select("seq.*.Conv2d")) == ["seq.0.Conv2d", "seq.1.Conv2d"]
    assert list(probe.select(nn.Linear)) == ["fc.Linear"]
    assert list(probe.select(["fc.Linear", nn.ReLU])) == ["fc.Linear", "seq.2.ReLU"]


@pytest.mark.parametrize(
    "selector, message",
    [
        ("seq.1.Conv", r"^Probe expected a module key or path, a glob or a class of TestModel, got 'seq.1.Conv', which matches no key or path; closest keys: 'seq.1.Conv2d'"),
        ("*.Conv3d", r"^Probe expected a module key or path, a glob or a class of TestModel, got '\*.Conv3d'"),
        (nn.LSTM, r"^Probe expected a module key or path, a glob or a class of TestModel, got LSTM, of which the model has no instance"),
        (3, r"^Probe expected a selector \(a module key or path, a glob"),
    ],
)
def test_bad_selectors_say_what_exists(selector: object, message: str) -> None:
    with pytest.raises(FwdtraceError, match=message):
        fwdtrace.Probe(_model()).select(selector)  # type: ignore[arg-type]


def test_probe_refuses_a_non_module() -> None:
    with pytest.raises(FwdtraceError, match=r"^Probe expected a torch.nn.Module as model, got str"):
        fwdtrace.Probe("model")  # type: ignore[arg-type]


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_replace_output_applies_and_is_gone_after_with() -> None:
    model, x = _model(), torch.randn(1, 3, 5, 5)
    before = model(x)
    with fwdtrace.Probe(model) as probe:
        probe.replace_output("seq.1.Conv2d", lambda m, inputs, output: output * 2)
        got = model(x)
    conv0, conv1 = model.seq[0], model.seq[1]
    h = F.relu(2 * conv1(conv0(x)))  # the doubled conv output, by hand
    assert torch.allclose(got, model.fc(h.mean((2, 3))), atol=1e-6)
    assert not torch.allclose(got, before)
    assert _hook_count(model) == 0
    assert torch.equal(model(x), before)


def test_hooks_are_removed_when_the_block_raises() -> None:
    model = _model()
    with pytest.raises(ValueError), fwdtrace.Probe(model) as probe:
        probe.replace_output(nn.Conv2d, lambda m, i, o: o)
        probe.print_grads("fc.Linear")
        probe.chaos("seq.2.ReLU", fault="zero")
        raise ValueError("inside the block")
    assert _hook_count(model) == 0
    assert torch.nn.Module.__dict__["__call__"] is torch.nn.modules.module.Module._wrapped_call_impl


def test_replace_input_and_single_handle_removal() -> None:
    model, x = _model(), torch.randn(1, 3, 5, 5)
    probe = fwdtrace.Probe(model)
    handle = probe.replace_input("fc.Linear", lambda m, inputs, output: torch.zeros_like(inputs[0]))
    assert torch.allclose(model(x), model.fc.bias.expand(1, 10))
    handle.remove()
    assert not probe.handles and _hook_count(model) == 0


def test_a_disabled_probe_takes_its_hooks_off_and_keeps_its_state() -> None:
    model, x = _model(), torch.randn(1, 3, 5, 5)
    before = model(x)
    with fwdtrace.Probe(model) as probe:
        probe.replace_output("fc.Linear", lambda m, i, o: o * 0)
        stats = probe.running_stats("fc.Linear")
        printed = io.StringIO()
        probe.print_grads("fc.Linear", file=printed)
        model(x)
        probe.enabled = False
        assert _hook_count(model) == 0
        assert torch.equal(model(x), before)
        probe.enabled = True
        assert torch.equal(model(x), torch.zeros_like(before))
        assert stats.stats["fc.Linear"].count == 2 * before.numel()  # the disabled call not counted
        y = model(x.requires_grad_())
        probe.enabled = False  # a backward after disabling stays quiet
        y.sum().backward()
        assert printed.getvalue() == "" and _hook_count(model) == 0


class _StraightThroughReLU(torch.autograd.Function):
    """The reference custom gradient: ReLU forward, identity backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clamp_min(0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


def test_replace_grad_matches_an_autograd_function() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(4, 5, requires_grad=True)
    with fwdtrace.Probe(model) as probe:
        probe.replace_grad("1.ReLU", lambda m, grad_input, grad_output: grad_output)
        model(x).pow(2).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    model[2](_StraightThroughReLU.apply(model[0](x))).pow(2).sum().backward()
    expected = [x.grad] + [p.grad for p in model.parameters()]
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    x.grad = None  # and without the probe ReLU's own gradient is back
    model(x).pow(2).sum().backward()
    assert not torch.allclose(x.grad, expected[0])


def test_replace_grad_checks_the_count() -> None:
    model = nn.Sequential(nn.Tanh())
    with fwdtrace.Probe(model) as probe:
        probe.replace_grad("0.Tanh", lambda m, gi, go: (go[0], go[0]))
        with pytest.raises(FwdtraceError, match=r"^replace_grad\(\) expected fn to return 1 gradient\(s\) for '0.Tanh', got 2"):
            model(torch.ones(2, requires_grad=True)).sum().backward()


def test_print_io_and_print_grads_show_torch_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3, requires_grad=True)
    buf = io.StringIO()
    outputs = []
    model[0].register_forward_hook(lambda m, i, o: outputs.append(o))
    with fwdtrace.Probe(model) as probe:
        probe.print_io("0.Linear", file=buf)
        probe.print_grads("0.Linear", file=buf, values=True)
        y = model(x)
        y.retain_grad()
        (y * 3).sum().backward()
    model[0]._forward_hooks.clear()
    text = buf.getvalue()
    out = outputs[0].detach()
    assert f"  output0 float32[4, 2] mean={float(out.mean()):.4g} std={float(out.std(correction=0)):.4g}" in text
    assert "0.Linear backward call 0" in text
    assert f"  grad_input0  float32[4, 3] mean={float(x.grad.mean()):.4g}" in text
    assert str(y.grad) in text  # values=True prints the whole gradient


def test_a_failing_probed_forward_names_the_layer() -> None:
    model = _model()
    with pytest.raises(RuntimeError) as info, fwdtrace.Probe(model) as probe:
        probe.replace_input("seq.1.Conv2d", lambda m, inputs, output: inputs[0][:, :7])
        model(torch.randn(1, 3, 5, 5))
    assert any(n.startswith("fwdtrace: raised in module 'seq.1.Conv2d'") for n in info.value.__notes__)


def test_shapes_name_the_failing_layer_without_with() -> None:
    model = _model()
    with pytest.raises(RuntimeError) as info:
        fwdtrace.Probe(model).shapes(torch.randn(1, 4, 5, 5))
    assert any("'seq.0.Conv2d'" in n for n in info.value.__notes__)


class _Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, width)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_match_trains_a_student_towards_the_teacher() -> None:
    torch.manual_seed(0)
    teacher, student = _Net(8), _Net(8)
    x = torch.randn(16, 6)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    with torch.no_grad():  # the reference first loss, before any hook
        first = float(F.mse_loss(torch.tanh(student.fc1(x)), torch.tanh(teacher.fc1(x))))
    losses = []
    with fwdtrace.Probe(student) as s, fwdtrace.Probe(teacher) as t:
        match = s.match(t, {"act.Tanh": "act.Tanh"})
        with pytest.raises(FwdtraceError, match=r"^Match.loss\(\) expected the outputs of both models"):
            match.loss()
        for _ in range(3):
            with torch.no_grad():
                teacher(x)
            student(x)
            loss = match.loss()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        assert torch.equal(match.teacher_outputs["act.Tanh"], torch.tanh(teacher.fc1(x)).detach())
        assert not match.teacher_outputs["act.Tanh"].requires_grad
    assert losses[0] > losses[1] > losses[2]
    assert losses[0] == pytest.approx(first, rel=1e-6)
    assert _hook_count(student) == 0 and _hook_count(teacher) == 0


def test_match_needs_one_module_per_selector() -> None:
    with fwdtrace.Probe(_Net(4)) as s, fwdtrace.Probe(_Net(4)) as t:
        with pytest.raises(FwdtraceError, match=r"^match\(\) expected a selector naming exactly one module, got 'fc\*'"):
            s.match(t, {"fc*": "fc1.Linear"})


# -- arguments are checked when the probe method is called, not in the next forward ---------------
BAD_CALLS = [
    (lambda p: p.running_stats("seq.0.Conv2d", bins=0), r"^running_stats\(\) expected bins as a positive int, got 0"),
    (lambda p: p.running_stats("seq.0.Conv2d", bins=True), r"^running_stats\(\) expected bins as a positive int, got True"),
    (lambda p: p.running_stats("seq.0.Conv2d", range=(1, 0)),
     r"^running_stats\(\) expected range as \(low, high\) finite numbers with low < high, got \(1, 0\)"),
    (lambda p: p.running_stats("seq.0.Conv2d", range=5),
     r"^running_stats\(\) expected range as \(low, high\) finite numbers with low < high, got 5"),
    (lambda p: p.replace_output("seq.0.Conv2d", None),
     r"^replace_output\(\) expected fn as a callable \(module, inputs, output\), got NoneType"),
    (lambda p: p.replace_input("seq.0.Conv2d", 42), r"^replace_input\(\) expected fn as a callable \(module, inputs, None\), got int"),
    (lambda p: p.replace_grad("seq.0.Conv2d", "x"), r"^replace_grad\(\) expected fn as a callable"),
    # a callback that cannot take the arguments it will be given fails now, not in the next forward
    (lambda p: p.replace_output("seq.0.Conv2d", lambda output: output),
     r"^replace_output\(\) expected fn as a callable \(module, inputs, output\), got function <lambda>\(output\)$"),
    (lambda p: p.replace_input("seq.0.Conv2d", lambda m, inputs: inputs),
     r"^replace_input\(\) expected fn as a callable \(module, inputs, None\), got function <lambda>\(m, inputs\)$"),
    (lambda p: p.replace_grad("seq.0.Conv2d", lambda m, gin, gout, extra: gin),
     r"^replace_grad\(\) expected fn as a callable \(module, grad_input, grad_output\), got function <lambda>\(m, gin, gout, extra\)$"),
    (lambda p: p.hook_function("torch.nn.functional.relu", lambda *, output: output),
     r"^hook_function\(\) expected fn as a callable \(inputs, kwargs, output\), got function <lambda>\(\*, output\)$"),
    (lambda p: p.replace_input(42, lambda m, i, o: None), r"^Probe expected a selector .* got int"),
    (lambda p: p.print_io("seq.0.Conv2d", file="out.txt"),
     r"^print_io\(\) expected file as an open text file \(with .write\) or None, got str 'out.txt'"),
    (lambda p: p.print_grads("seq.0.Conv2d", values="yes"), r"^print_grads\(\) expected values as a bool, got str"),
    (lambda p: p.weight_stats(bins=-2), r"^RunningStats expected bins as a positive int, got -2"),
    (lambda p: p.chaos("seq.0.Conv2d", scale=-1.0), r"^chaos\(\) expected scale as a finite number >= 0, got -1.0"),
]


class _Scale:
    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return output * factor


def test_callbacks_of_every_fitting_shape_are_accepted() -> None:
    """*args, defaults, callable objects and builtins without a signature pass the registration check."""
    model = nn.Sequential(nn.ReLU())
    x = torch.tensor([1.0, -1.0])
    with fwdtrace.Probe(model) as probe:
        probe.replace_output("0.ReLU", lambda *args: args[2] + 1)
        assert torch.equal(model(x), torch.relu(x) + 1)
    with fwdtrace.Probe(model) as probe:
        probe.replace_output("0.ReLU", _Scale())
        assert torch.equal(model(x), torch.relu(x) * 2)
    with fwdtrace.Probe(model) as probe:
        probe.replace_output("0.ReLU", max)  # a builtin without a signature to check: taken as it is
    with pytest.raises(FwdtraceError, match=r"^@hook_forward\('torch.nn.ReLU'\) expected fn as a callable \(module, inputs, output\), got function"):
        fwdtrace.hook_forward("torch.nn.ReLU")(lambda module, output: None)


@pytest.mark.parametrize("call, message", BAD_CALLS)
def test_probe_methods_check_their_arguments_when_called(call, message: str) -> None:  # noqa: ANN001
    model = _model()
    probe = fwdtrace.Probe(model)
    with pytest.raises(FwdtraceError, match=message):
        call(probe)
    assert probe.handles == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())
    model(torch.randn(1, 3, 5, 5))  # the next forward is untouched


def test_running_stats_from_several_threads_equal_the_whole_data() -> None:
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
    batches = [torch.randn(32, 16) for _ in range(48)]
    with torch.no_grad():
        everything = torch.cat([model(b) for b in batches])
    for range_ in (None, (0.0, 4.0)):
        with fwdtrace.Probe(model) as probe:
            stats = probe.running_stats("1.ReLU", bins=8, range=range_)
            with torch.no_grad(), ThreadPoolExecutor(4) as pool:
                list(pool.map(model, batches))
        s = stats.stats["1.ReLU"]
        assert s.count == everything.numel()
        assert s.zeros == int((everything == 0).sum())
        assert_moments(s.mean, s.std, s.l2, everything)
        assert s.max == pytest.approx(float(everything.max()))
        assert sum(s.histogram) + s.underflow + s.overflow == everything.numel()
        if range_ is not None:  # bins [a, b), the last one too
            inside = everything[(everything >= 0) & (everything < 4)]
            assert s.histogram == [int(v) for v in torch.histc(inside, bins=8, min=0, max=4).tolist()]


# -- gradients beside in-place ops: compared with torch's full backward hooks on an inplace=False copy ---


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the reference's, as expected
def test_print_grads_and_grad_stats_work_beside_in_place_relu_and_match_torch() -> None:
    model, reference = zoo.inplace_mlp()
    seen, _ = zoo.full_backward_grads(reference)
    buf = io.StringIO()
    with fwdtrace.Probe(model) as probe:
        probe.print_grads(list(zoo.INPLACE_KEYS), file=buf, values=True)
        stats = {of: probe.running_stats("1.ReLU", of=of, bins=8, range=(-1.0, 1.0)) for of in ("grad_input", "grad_output")}
        for x in zoo.inplace_batches():
            zoo.sgd_step(model, model(x).square().mean())  # raised RuntimeError from BackwardHookFunction before
            zoo.sgd_step(reference, reference(x).square().mean())
    want = []
    for step in range(len(zoo.inplace_batches())):
        for key in zoo.INPLACE_KEYS:
            grad_input, grad_output = seen[key][step]
            lines = [f"{key} backward call {step}"]
            lines += [f"  grad_input{i}  {summary_text(t, True)}" for i, t in enumerate(grad_input)]
            lines += [f"  grad_output{i} {summary_text(t, True)}" for i, t in enumerate(grad_output)]
            want.append("\n".join(lines))
    # One block per call; the two keys' gradients are ready at one autograd node, in no set order.
    got = list(re.split(r"\n(?=\S+ backward call \d+\n)", buf.getvalue().strip()))
    assert sorted(got) == sorted(want)
    for of, position in (("grad_input", 0), ("grad_output", 1)):
        reference_stats = RunningStats(8, (-1.0, 1.0))
        for grads in seen["1.ReLU"]:
            reference_stats.update(grads[position][0])
        assert stats[of].summary()["1.ReLU"] == reference_stats.to_dict()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the reference's, as expected
def test_replace_grad_on_an_in_place_relu_matches_torch_full_backward_hook() -> None:
    model, reference = zoo.inplace_mlp()
    captured: list[tuple] = []

    def straight_through(m: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
        captured.append((grad_input, grad_output))
        return grad_output

    reference[1].register_full_backward_hook(straight_through)
    want = captured
    with fwdtrace.Probe(model) as probe:
        got: list[tuple] = []
        probe.replace_grad("1.ReLU", lambda m, gin, gout: got.append((gin, gout)) or gout)
        for x in zoo.inplace_batches():
            zoo.sgd_step(model, model(x).square().mean())  # raised RuntimeError from BackwardHookFunction before
            zoo.sgd_step(reference, reference(x).square().mean())
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)  # the replaced gradient flowed on as torch's does
    assert len(got) == len(want) == 3
    for (gin, gout), (rin, rout) in zip(got, want, strict=True):
        torch.testing.assert_close(gin[0], rin[0], rtol=0, atol=0)
        torch.testing.assert_close(gout[0], rout[0], rtol=0, atol=0)
    torch.testing.assert_close(model[0].weight, reference[0].weight, rtol=0, atol=0)


def test_running_stats_on_the_meta_device_is_fwdtraces_error_naming_the_key() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).to("meta")
    x = torch.randn(2, 4, device="meta")
    with pytest.raises(RuntimeError, match="meta tensors"):  # the reference: torch cannot read its values either
        float(model(x).sum())
    with fwdtrace.Probe(model) as probe:
        probe.running_stats("0", of="output")
        with pytest.raises(FwdtraceError, match=r"^Probe\.running_stats\(\) of '0\.Linear' cannot summarise a tensor "
                                                r"on the meta device \(shape \[2, 4\], float32\)"):
            model(x)
    with pytest.raises(FwdtraceError, match=r"^RunningStats\.update\(\) cannot summarise a tensor on the meta device"):
        RunningStats().update(x)
