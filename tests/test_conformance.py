"""Every public entry point on every model of the corpus (tests/corpus.py), with its invariants.

One case per (model, entry point); a model's build, trace and exports are shared by its cases
(one module-scoped Run per model, the cases of a model kept on one xdist worker).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import corpus
import pytest
import torch

import fwdtrace

CASES = {case.name: case for case in corpus.CORPUS}
assert all(case.repeats in CASES for case in CASES.values() if case.repeats), "a row repeats a row of the corpus"

# Cells the corpus found failing that are not fixed yet (issue 20 stays open for them): strict, so
# a fix shows up as XPASS and fails the run until the entry is removed.
KNOWN: dict[tuple[str, str], str] = {
    # Real exporter bugs on a left-padded batch: a fully masked query row of scaled_dot_product_attention,
    # which eager gives as 0. The structure alone is right, so only the numbers can say (numeric[x] does).
    **{(row, "check_onnx[dynamo]"): "the dynamo exporter's attention computes a fully masked row otherwise than eager"
       for row in ("llama_left", "opt_left", "gpt2_left")},
}


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> corpus.Run:
    case = CASES[request.param]
    return corpus.Run(case, Path(tmp_path_factory.mktemp(case.name)))


@pytest.mark.parametrize(("run", "entry"), [
    pytest.param(name, entry, marks=pytest.mark.xdist_group(name), id=f"{name}-{entry}")
    for entry in corpus.ENTRIES for name, case in CASES.items() if corpus.runs(case, entry)], indirect=["run"])
def test_entry_point(run: corpus.Run, entry: str, request: pytest.FixtureRequest) -> None:
    known = KNOWN.get((run.case.name, entry))
    if known:
        request.applymarker(pytest.mark.xfail(reason=known, strict=True))
    corpus.run_entry(run, entry)


class _Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        import transformers

        cache = transformers.DynamicCache()
        cache.update(x[None, None, None] + 1, x[None, None, None] - 1, 0)
        return {"out": x * 2, "cache": cache}


def test_the_onnxruntime_reference_skips_only_what_is_declared_left_out(tmp_path: Path) -> None:
    """``corpus.ort_agrees`` against a file that returns ``out`` only (the cache left out), or a wrong ``out``."""
    pytest.importorskip("transformers")
    import onnx
    from onnx import TensorProto, helper

    x = torch.randn(3)
    run = SimpleNamespace(model=_Doubler(), args=(x,), kwargs={})
    run.eager = run.model(x)
    for factor in (2.0, 3.0):
        graph = helper.make_graph(
            [helper.make_node("Mul", ["x", "two"], ["out"])], "doubler",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3])],
            [helper.make_tensor("two", TensorProto.FLOAT, [], [factor])])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
        cache = ["cache.layers[0].keys", "cache.layers[0].values"]
        agrees, why = corpus.ort_agrees(tmp_path / "m.onnx", run, cache)
        assert agrees == (factor == 2.0), why  # the outputs returned are still compared
        assert not corpus.ort_agrees(tmp_path / "m.onnx", run)[0]  # nothing declared: the cache is expected
        assert not corpus.ort_agrees(tmp_path / "m.onnx", run, cache[:1])[0]  # the file lacks an undeclared one
    with pytest.raises(AssertionError, match="names no tensor of a returned cache"):
        corpus.ort_agrees(tmp_path / "m.onnx", run, ["out"])  # only a cache's tensors may be left out


def test_calibrated_batchnorms_give_a_random_network_a_trained_networks_scale() -> None:
    """A deep random conv stack's activations vanish through fresh BatchNorms (mean 0, variance 1); with
    the statistics of a batch each norm's output has unit scale, down to a 1x1 map, and the model is left
    in eval mode with its momenta. Reference: the statistics computed by hand from plain hooks."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Conv2d(8, 8, 3, 2, 1), torch.nn.BatchNorm2d(8, momentum=0.03)]
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), *layers).eval()
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.normal_(m.weight, std=0.03)  # a tiny init: each layer shrinks what it sees
            torch.nn.init.zeros_(m.bias)
    images = torch.rand(4, 3, 64, 64)
    scale = lambda: float(model(images[:1]).abs().mean())  # noqa: E731
    norms = [m for m in model if isinstance(m, torch.nn.BatchNorm2d)]
    seen: dict[torch.nn.Module, list[torch.Tensor]] = {m: [] for m in norms}
    hooks = [m.register_forward_hook(lambda m, i, o: seen[m].append(i[0])) for m in norms]
    with torch.no_grad():
        before = scale()
        corpus.calibrate_batchnorm(model, images)  # seen[m][1]: what each norm saw in that forward
        out = {m: m(seen[m][1]) for m in norms}
        after = scale()
    for h in hooks:
        h.remove()
    assert before < 1e-4 < 0.1 < after
    for bn in norms:
        assert not bn.training and bn.momentum == 0.03
        assert torch.allclose(bn.running_mean, seen[bn][1].mean((0, 2, 3)), atol=1e-6)
        assert torch.allclose(bn.running_var, seen[bn][1].var((0, 2, 3)), rtol=1e-4)
        assert 0.5 < float(out[bn].std()) < 1.5
    assert seen[norms[-1]][1].shape[-2:] == (1, 1)  # the last norm sees 4 values per channel, one per image


def test_the_picture_invariant_finds_a_lost_edge_and_a_lost_node() -> None:
    import fwdtrace

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    graph = fwdtrace.trace(model, torch.randn(1, 4))
    dot = graph.to_dot(None)
    corpus.assert_nothing_lost(graph, dot)
    edge = next(line for line in dot.source.splitlines() if "->" in line and "invis" not in line)
    with pytest.raises(AssertionError, match="contracted by box"):
        corpus.assert_nothing_lost(graph, SimpleNamespace(source=dot.source.replace(edge + "\n", "", 1)))
    box = next(line for line in dot.source.splitlines() if "fwdtrace_members" in line)
    with pytest.raises(AssertionError, match="no box"):
        corpus.assert_nothing_lost(graph, SimpleNamespace(source=dot.source.replace(box + "\n", "", 1)))


def test_the_onnxruntime_reference_lets_rows_swap_only_where_eager_scores_tie(tmp_path: Path) -> None:
    """A detector's rows sorted by score may come out of onnxruntime swapped where eager's scores tie within
    float tolerance (RetinaNet, FCOS, SSDlite with random weights); any other difference still disagrees."""
    import onnx
    from onnx import helper, numpy_helper

    torch.manual_seed(0)
    boxes, labels = torch.rand(5, 4) * 300, torch.tensor([3, 7, 1, 7, 2])
    scores = torch.tensor([0.9, 0.0265497, 0.0265493, 0.02, 0.01])  # rows 1 and 2 tie within tolerance
    features = torch.randn(2, 3)
    run = SimpleNamespace(model=torch.nn.Identity(), args=(torch.zeros(1),), kwargs={})
    run.eager = ({"boxes": boxes, "scores": scores, "labels": labels}, features)

    def agrees(order: list[int], labels_order: list[int] | None = None, more: torch.Tensor = features) -> bool:
        outputs = [boxes[order], scores[order], labels[labels_order or order], more]
        nodes = [helper.make_node("Constant", [], [f"out{i}"], value=numpy_helper.from_array(t.numpy()))
                 for i, t in enumerate(outputs)]
        graph = helper.make_graph(nodes, "detections", [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [1])],
                                  [helper.make_empty_tensor_value_info(f"out{i}") for i in range(len(outputs))])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "d.onnx")
        return corpus.ort_agrees(tmp_path / "d.onnx", run)[0]

    assert agrees([0, 1, 2, 3, 4])
    assert agrees([0, 2, 1, 3, 4])  # the tied rows swapped, whole
    assert not agrees([1, 0, 2, 3, 4])  # scores 0.9 and 0.0265 do not tie
    assert not agrees([0, 2, 1, 3, 4], labels_order=[0, 1, 2, 3, 4])  # a row's label stays with its box
    assert not agrees([0, 2, 1, 3, 4], more=features + 1)  # the outputs after the detections are still compared


def test_the_numeric_reference_finds_a_divergence_named_after_its_start(tmp_path: Path) -> None:
    """``corpus.assert_divergence_starts_there`` on a file whose first layer's weight is changed: the report's
    own first divergence (that layer) passes; one moved to the next layer, whose input onnxruntime no longer
    computes, fails; a draw named in a row that declares none fails."""
    import dataclasses

    import onnx
    from onnx import numpy_helper

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).eval()
    x = torch.randn(2, 6)
    proto = fwdtrace.export_onnx(model, x, exporter="torchscript")
    weight = next(t for t in proto.graph.initializer if t.name == "0.weight")
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.5, weight.name))
    onnx.save(proto, tmp_path / "m.onnx")
    run = corpus.Run(corpus.Case("tampered", lambda: (model, (x,), {})), tmp_path)
    run._done["export:torchscript"] = (True, tmp_path / "m.onnx")
    report = fwdtrace.check_onnx(model, x, onnx=str(tmp_path / "m.onnx"), numeric=True)
    assert report.first_divergence is not None and report.first_divergence.module_path == "0"
    corpus.assert_divergence_starts_there(run, "torchscript", report)
    for row in report.numeric.rows:
        if row.module_path in ("0", "1"):
            row.ok = True  # as if the changed layer and the ReLU after it agreed: the last Linear comes first
    assert report.first_divergence.module_path == "2"
    with pytest.raises(AssertionError, match="its input 0 .* is no value onnxruntime computes"):
        corpus.assert_divergence_starts_there(run, "torchscript", report)
    report.numeric.random = [dataclasses.replace(report.first_divergence, kind="random", order=0, target="torch.rand")]
    with pytest.raises(AssertionError, match="is said to draw random numbers; the row declares 'no draw'"):
        corpus.assert_draws_declared(run, report)
