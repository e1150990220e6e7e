"""One comparison whatever the caller has: a given ONNX file, a graph alone, caches, symbolics, quiet exports.

References: onnxruntime runs what is compared (the exports are right), and check_onnx, which
has the model, is the reference compare_onnx must never contradict.
"""

from __future__ import annotations

import logging
import os
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from corpus import cache_field
from test_onnx_export import run_ort

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.errors import FwdtraceWarning
from fwdtrace.onnx import export as onnx_export


class LayerNorm2d(torch.nn.LayerNorm):
    """timm's LayerNorm2d: a LayerNorm subclass with a forward of its own (permute, layer_norm, permute)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtish(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3)
        self.norm = LayerNorm2d(8)
        self.head = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.stem(x))))


def _convnextish() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ConvNeXtish().eval(), torch.randn(1, 3, 8, 8)


def _export(model: torch.nn.Module, x: torch.Tensor, exporter: str) -> onnx.ModelProto:
    return fwdtrace.to_onnx(model, x) if exporter == "fwdtrace" else fwdtrace.export_onnx(model, x, exporter=exporter)


def _drop_relu(proto: onnx.ModelProto) -> onnx.ModelProto:
    p = onnx.ModelProto()
    p.CopyFrom(proto)
    (relu,) = [n for n in p.graph.node if n.op_type == "Relu"]
    for n in p.graph.node:
        n.input[:] = [relu.input[0] if i == relu.output[0] else i for i in n.input]
    p.graph.node.remove(relu)
    return p


# -- a graph alone: layers it cannot open are reported apart --------------------------------------
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript", "fwdtrace"])
def test_compare_onnx_and_check_onnx_agree_on_a_layer_with_its_own_forward(exporter: str) -> None:
    model, x = _convnextish()
    proto = _export(model, x, exporter)
    np.testing.assert_allclose(run_ort(proto, x)[0], model(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    alone = fwdtrace.compare_onnx(fwdtrace.trace(model, x), proto)
    checked = fwdtrace.check_onnx(model, x, onnx=proto)
    assert checked.status == "ok" and checked.ok, checked.text
    assert checked.opened == [f"{__name__}.LayerNorm2d"]
    # neither ok nor a mismatch: the layer's ONNX op is its, unchecked, and the hint says what to do
    assert (alone.status, alone.ok, alone.missing, alone.extra, alone.rewired) == ("incomplete", False, [], [], [])
    assert alone.not_opened == ["norm (LayerNorm2d)"]
    assert alone.text.startswith("ONNX cross-check: INCOMPLETE: 1 layer call not opened")
    assert "fwdtrace.check_onnx(model, x, onnx=proto)" in alone.text
    assert alone.to_dict()["status"] == "incomplete"


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_real_difference_beside_a_layer_not_opened_is_still_a_mismatch(exporter: str) -> None:
    model, x = _convnextish()
    tampered = _drop_relu(_export(model, x, exporter))
    assert np.abs(run_ort(tampered, x)[0] - model(x).detach().numpy()).max() > 1e-3  # the tampering is real
    alone = fwdtrace.compare_onnx(fwdtrace.trace(model, x), tampered)
    checked = fwdtrace.check_onnx(model, x, onnx=tampered)
    assert checked.status == alone.status == "mismatch"
    assert alone.missing == checked.missing == ["relu = torch.relu"]


# -- check_onnx(onnx=...) -------------------------------------------------------------------------
def test_check_onnx_checks_a_file_a_pipeline_wrote(tmp_path) -> None:
    model, x = _convnextish()
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False)  # the pipeline's own export, not fwdtrace's
    report = fwdtrace.check_onnx(model, x, onnx=path)
    assert report.ok, report.text
    assert report.exporter is None and report.text.startswith(f"ONNX cross-check ({path}): the export has")
    assert fwdtrace.check_onnx(model, x, onnx=str(path)).ok
    assert not fwdtrace.check_onnx(model, x, onnx=_drop_relu(onnx.load(str(path)))).ok


def test_check_onnx_reads_an_external_data_file_without_its_weights(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 0)  # every model goes through external data
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval(), torch.randn(2, 64)
    path = tmp_path / "model.onnx"
    fwdtrace.export_onnx(model, x, exporter="torchscript", path=path)
    assert os.path.getsize(str(path) + ".data") >= 64 * 64 * 4  # the weights are there, beside it
    os.remove(str(path) + ".data")  # read the weights, and the check would fail
    report = fwdtrace.check_onnx(model, x, onnx=path)
    assert report.ok, report.text
    assert fwdtrace.compare_onnx(fwdtrace.trace(model, x), path).ok


def test_check_onnx_refuses_an_exporter_and_a_file_together(tmp_path) -> None:
    model, x = _convnextish()
    with pytest.raises(FwdtraceError, match=r"^check_onnx\(\) expected exporter= \(export the model\) or onnx= "
                                            r"\(check a given ONNX model\), not both: got exporter='dynamo' and onnx="):
        fwdtrace.check_onnx(model, x, exporter="dynamo", onnx=tmp_path / "model.onnx")
    with pytest.raises(FwdtraceError, match=r"^check_onnx\(\) expected onnx= as an onnx.ModelProto or a path"):
        fwdtrace.check_onnx(model, x, onnx=42)
    with pytest.raises(FwdtraceError, match=r"^check_onnx\(\) expected a .onnx file, got .*which does not exist"):
        fwdtrace.check_onnx(model, x, onnx=tmp_path / "missing.onnx")


# -- caches ---------------------------------------------------------------------------------------
def _gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 50, (1, 8))


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript", "fwdtrace"])
def test_a_model_returning_its_cache_agrees_with_every_exporter(exporter: str) -> None:
    model, ids = _gpt2()
    out = model(ids, use_cache=True)
    eager = [out.logits] + [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    proto = fwdtrace.to_onnx(model, ids) if exporter == "fwdtrace" else fwdtrace.export_onnx(model, ids, exporter=exporter)
    got = run_ort(proto, ids)
    assert len(got) == len(eager) == 5  # the cache's tensors are outputs of the export
    for a, b in zip(got, eager, strict=True):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-4, atol=1e-5)
    report = fwdtrace.check_onnx(model, ids, exporter=exporter)
    assert report.ok, report.text
    assert fwdtrace.check_onnx(model, ids, onnx=proto).ok


def test_a_cache_output_wired_elsewhere_is_named() -> None:
    model, ids = _gpt2()
    cache = cache_field(model(ids))
    proto = fwdtrace.to_onnx(model, ids)
    p = onnx.ModelProto()
    p.CopyFrom(proto)
    names = [o.name for o in p.graph.output]
    for what in ("keys", "values"):  # layer 0's cache outputs now copy layer 1's
        mine, other = f"{cache}.layers.0.{what}", f"{cache}.layers.1.{what}"
        for n in p.graph.node:  # the model's own readers keep the original value
            n.output[:] = [f"{o}_kept" if o == mine else o for o in n.output]
            n.input[:] = [f"{o}_kept" if o == mine else o for o in n.input]
        p.graph.node.append(onnx.helper.make_node("Identity", [other], [mine], name=f"copy_{what}"))
    keys0 = names.index(f"{cache}.layers.0.keys")
    assert not np.allclose(run_ort(p, ids)[keys0], run_ort(proto, ids)[keys0])  # the tampering is real
    report = fwdtrace.check_onnx(model, ids, onnx=p)
    assert report.status == "mismatch"
    (edge,) = report.rewired
    assert edge.startswith("trace edge addmm = torch.addmm in transformer.h.0.attn.c_attn -> output "
                           f"({cache}.layers[0].keys, {cache}.layers[0].values) has no ONNX path"), edge


def test_an_export_without_the_cache_leaves_it_out_and_says_so() -> None:
    model, ids = _gpt2()
    proto = fwdtrace.export_onnx(model, ids, exporter="dynamo", use_cache=False)  # logits only
    # logits only (dynamo names that output 'logits' or after its producer, 'linear', depending on
    # what ran before in the process: its value is what counts)
    (logits,) = run_ort(proto, ids)
    np.testing.assert_allclose(logits, model(ids, use_cache=False).logits.detach().numpy(), rtol=1e-4, atol=1e-5)
    report = fwdtrace.check_onnx(model, ids, onnx=proto)  # the model returns its cache: 5 outputs
    assert report.ok, report.text
    cache = cache_field(model(ids))
    assert f"outputs the export does not return, left out: {cache}.layers[0].keys" in report.text
    assert report.left_out == [f"{cache}.layers[{i}].{kv}" for i in range(2) for kv in ("keys", "values")]
    assert report.to_dict()["left_out"] == report.left_out


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_mamba_with_its_cache_stays_ok(exporter: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                      conv_kernel=4)
    torch.manual_seed(0)
    model, ids = transformers.MambaForCausalLM(config).eval(), torch.randint(0, 50, (1, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = fwdtrace.check_onnx(model, ids, exporter=exporter, use_cache=True)
    assert report.ok, report.text
    ours = [str(w.message) for w in caught if w.category is FwdtraceWarning]
    if exporter == "torchscript":  # it cannot export Mamba's cache writes (aten::copy): exported without
        assert any("could not export MambaForCausalLM's returned cache" in m for m in ours), ours
        cache = cache_field(model(ids, use_cache=True))
        assert f"outputs the export does not return, left out: {cache}.layers[0]" in report.text


# -- symbolics ------------------------------------------------------------------------------------
@torch.library.custom_op("fwdtrace_check::thrice", mutates_args=())
def thrice(x: torch.Tensor) -> torch.Tensor:
    return x * 3


class Thrice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(thrice(x) + 1)


def test_a_torch_op_with_a_symbolic_needs_no_equivalence(restore_rules) -> None:
    @fwdtrace.onnx_symbolic("fwdtrace_check.thrice")
    def thrice_onnx(op, x):
        return op.Mul(x, op.CastLike(op.Constant(value_float=3.0), x))

    model, x = Thrice(), torch.randn(2, 3)
    proto = fwdtrace.to_onnx(model, x)
    np.testing.assert_allclose(run_ort(proto, x)[0], model(x).numpy(), rtol=1e-6)
    report = fwdtrace.check_onnx(model, x, exporter="fwdtrace")
    assert report.ok, report.text
    assert report.matched[0][0] == "thrice = fwdtrace_check.thrice"
    fwdtrace.remove_onnx_symbolic("fwdtrace_check.thrice")
    without = fwdtrace.compare_onnx(fwdtrace.trace(model, x), proto)  # nothing says what it became
    assert without.status == "incomplete" and not without.missing and not without.extra, without.text
    assert [t for t, _ in without.undecided] == ["thrice = fwdtrace_check.thrice"]
    assert "no ONNX rule knows fwdtrace_check.thrice" in without.undecided[0][1]


# -- quiet by default -----------------------------------------------------------------------------
class Branchy(torch.nn.Module):
    """A model whose TorchScript export reads a tensor as a Python value (a TracerWarning)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y.relu() if bool(y.sum() > -1e9) else y


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_check_prints_nothing_of_other_libraries(exporter: str, capfd) -> None:
    torch.manual_seed(0)
    # torch.export refuses Branchy's branch on a value: dynamo gets a model without one
    model, x = (Branchy().eval(), torch.randn(2, 4)) if exporter == "torchscript" else _convnextish()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fwdtrace.check_onnx(model, x, exporter=exporter).ok
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    foreign = [w for w in caught if w.category is not FwdtraceWarning]
    assert foreign == [], [str(w.message) for w in foreign]
    ours = [str(w.message) for w in caught if w.category is FwdtraceWarning]
    if exporter == "torchscript":  # said once, in fwdtrace's words, with where
        assert len(ours) == 1 and "values read from tensors as Python values (1 place: test_onnx_check.py:" in ours[0]


def test_verbose_shows_the_exporters_own_output(capfd) -> None:
    torch.manual_seed(0)
    model, x = Branchy().eval(), torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fwdtrace.check_onnx(model, x, exporter="torchscript", verbose=True)
    assert any(w.category.__name__ == "TracerWarning" for w in caught)
    assert not any(w.category is FwdtraceWarning for w in caught)


def test_a_failed_export_prints_only_fwdtraces_error(capfd, caplog) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
                                      conv_kernel=4)
    model, ids = transformers.MambaForCausalLM(config).eval(), torch.randint(0, 50, (1, 6))
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="fwdtrace.onnx"):
        proto = fwdtrace.export_onnx(model, ids, exporter="torchscript", use_cache=True)
    assert len(proto.graph.output) == 1
    out, err = capfd.readouterr()
    assert "Torch IR graph at exception" not in out + err  # torch's C++ dump of the failed first try
    assert "Torch IR graph at exception" in caplog.text  # ... kept in the DEBUG log


# -- recurrent layers: a multi-layer LSTM's final states, an LSTMCell written out -----------------
def _decoder_starts_from_the_context(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The decoder's first hidden state is the encoder's mean output, not the LSTM's last h."""
    p = onnx.ModelProto()
    p.CopyFrom(proto)
    made_by = {o: n for n in p.graph.node for o in n.output}
    states = [n for n in p.graph.node if n.op_type == "Concat" and all(made_by.get(i) is not None and made_by[i].op_type == "LSTM" for i in n.input)]
    h = next(n for n in p.graph.node if n.input and n.input[0] == states[0].output[0])  # h_n[-1]
    mean = next(n for n in p.graph.node if n.op_type == "ReduceMean")
    for n in p.graph.node:
        n.input[:] = [mean.output[0] if i == h.output[0] else i for i in n.input]
    return p


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript", "fwdtrace"])
def test_an_lstm_encoder_and_lstmcell_decoder_match_and_a_rewired_state_is_caught(exporter: str) -> None:
    # the 2-layer LSTM's h and c are ONNX Concats of each layer's Y_h and Y_c; the cell is written out
    from corpus import Seq2Seq

    torch.manual_seed(0)
    model, src = Seq2Seq(vocab=50, d=16, steps=2).eval(), torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        proto = _export(model, src, exporter)
        np.testing.assert_allclose(run_ort(proto, src)[0], model(src).numpy(), rtol=1e-4, atol=1e-5)
        report = fwdtrace.check_onnx(model, src, onnx=proto)
        assert report.ok, report.text
        encoder = dict(report.matched)["encoder (LSTM)"]
        assert sorted(onnx_op(proto, name) for name in encoder) == ["Concat", "Concat", "LSTM", "LSTM"]
        tampered = _decoder_starts_from_the_context(proto)
        assert np.abs(run_ort(tampered, src)[0] - model(src).numpy()).max() > 1e-3  # the tampering is real
        caught = fwdtrace.check_onnx(model, src, onnx=tampered)
    assert caught.status == "mismatch", caught.text
    assert any("mean" in edge and "cell" in edge for edge in caught.rewired), caught.text


def onnx_op(proto: onnx.ModelProto, name: str) -> str:
    return next(n.op_type for n in proto.graph.node if n.name == name)


class PostProcess(torch.nn.Module):
    """A detector's post-processing in miniature: indices over a threshold, the class of flat top-k indices, padding."""

    def forward(self, scores: torch.Tensor, boxes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        keep = torch.where(scores.flatten() > 0.5)[0]  # torch.where of one argument: NonZero
        flat = torch.topk(scores.flatten(), 4).indices
        labels = flat % 3  # integer Mod
        anchors = torch.div(flat, 3, rounding_mode="floor")  # integers: written out with Mod, Xor, Where...
        phase = scores.remainder(0.3)  # float: TorchScript writes it out as a - floor(a / b) * b
        padded = F.pad(boxes, (0, 1))
        picked = boxes[scores[0] > 0.5]  # a boolean mask: NonZero, then a gather
        return boxes.flatten()[keep] * 2, labels + anchors, phase * 2, padded + 1, picked - 1


def test_detection_post_processing_ops_match_their_onnx_ops() -> None:
    # TorchScript only: a dynamo export of data-dependent shapes costs ~15 s here (it writes the same ops)
    torch.manual_seed(0)
    model, scores, boxes = PostProcess().eval(), torch.rand(2, 5), torch.rand(5, 4)
    proto = fwdtrace.export_onnx(model, scores, boxes, exporter="torchscript")
    want = model(scores, boxes)
    for got, expected in zip(run_ort(proto, scores, boxes), want, strict=True):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)  # the export is right
    report = fwdtrace.check_onnx(model, scores, boxes, onnx=proto)
    assert report.ok, report.text
    matched = {call.split(" = ")[0]: sorted(onnx_op(proto, n) for n in names) for call, names in report.matched}
    assert matched["where"] == ["NonZero"]
    assert matched["remainder"] == ["Mod"]
    assert matched["remainder_1"] == ["Div", "Floor", "Mul", "Sub"]
    assert matched["getitem_1"] == ["NonZero"]
    assert "Mod" in matched["div"] and "Where" in matched["div"]


class RetinaPostProcess(torch.nn.Module):
    """RetinaNet's head and ``postprocess_detections`` in small, on two levels.

    Per level, the top (place, class) scores; ``torch.div(index, classes, rounding_mode="floor")``
    picks the anchors and deltas the boxes are decoded from. Then ``batched_nms``'s trick: each
    class's boxes offset apart, a box kept where no higher-scoring one overlaps it (weighted, not
    selected, so that the sizes stay those of the example).
    """

    def __init__(self, classes: int = 3, boxes: int = 4) -> None:
        from corpus import TinyAnchors

        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, 2, 1)
        self.c2 = torch.nn.Conv2d(8, 8, 3, 2, 1)
        self.anchors = TinyAnchors((4, 8))
        self.head = torch.nn.Conv2d(8, 4 + classes, 3, padding=1)
        self.classes, self.boxes = classes, boxes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        f1 = torch.relu(self.c1(x))
        features = [f1, torch.relu(self.c2(f1))]
        anchors, _ = self.anchors(x, features)
        sizes = [f.shape[-2] * f.shape[-1] for f in features]
        out = torch.cat([self.head(f).flatten(2).transpose(1, 2) for f in features], 1)[0]
        boxes, scores, labels = [], [], []
        for o, a in zip(out.split(sizes), anchors.split(sizes), strict=True):
            s, idx = o[:, 4:].sigmoid().flatten().topk(self.boxes)
            place = torch.div(idx, self.classes, rounding_mode="floor")
            d, a = o[place, :4], a[place]
            w, h = a[:, 2] - a[:, 0], a[:, 3] - a[:, 1]
            cx, cy = a[:, 0] + 0.5 * w + d[:, 0] * w, a[:, 1] + 0.5 * h + d[:, 1] * h
            pw, ph = d[:, 2].exp() * w, d[:, 3].exp() * h
            boxes.append(torch.stack([cx - pw / 2, cy - ph / 2, cx + pw / 2, cy + ph / 2], -1))
            scores.append(s)
            labels.append(idx % self.classes)
        box, score, label = torch.cat(boxes), torch.cat(scores), torch.cat(labels)
        apart = box + (label.to(box.dtype) * (box.max() + 1))[:, None]
        lt = torch.max(apart[:, None, :2], apart[None, :, :2])
        rb = torch.min(apart[:, None, 2:], apart[None, :, 2:])
        inter = (rb - lt).clamp(min=0).prod(-1)
        area = (apart[:, 2:] - apart[:, :2]).prod(-1)
        iou = inter / (area[:, None] + area[None, :] - inter)
        beaten = (score[None, :] > score[:, None]) & (iou > 0.5)
        return box, score * ~beaten.any(1), label


def test_anchors_picked_by_a_floor_division_are_decoded_by_the_next_calls() -> None:
    # The TorchScript exporter writes each level's floor division out (Div, Less, Xor, Mod, ...,
    # Where); its Div, Sub and Where only compute where Gathers read, so they are wiring, and the
    # region grown up from the box decoder's first Sub through the anchors' Gather held one op
    # more than the division's own: the division took the decoder's Sub, and every call after was
    # paired one op off (torchvision's RetinaNet: 3 missing, 18 extra, 457 rewired).
    torch.manual_seed(0)
    model, x = RetinaPostProcess().eval(), torch.rand(1, 3, 16, 16)
    with torch.no_grad():
        want = model(x)  # TinyAnchors' scales, taken by the first call: the export reads no tensor as a number
        proto = fwdtrace.export_onnx(model, x, exporter="torchscript")
        for got, expected in zip(run_ort(proto, x), want, strict=True):
            np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)  # the export is right
        report = fwdtrace.check_onnx(model, x, onnx=proto)
    assert report.ok, report.text
    ops = [(call.partition(" = ")[2], sorted(onnx_op(proto, n) for n in names)) for call, names in report.matched]
    divisions = [found for target, found in ops if target == "torch.div"]
    # one a level, with no Sub of the decoder's (its Div, Sub and Where are wiring: the report leaves them out)
    assert divisions == [["And", "Equal", "Less", "Mod", "Not", "Xor"]] * 2, ops
    subs = [found for target, found in ops if target.startswith("torch.Tensor.sub")]
    # a level's width, height and two corners, and the suppression's three, each its own Sub
    assert len(subs) == 2 * 4 + 3 and all(found == ["Sub"] for found in subs), subs


class PastesMasks(torch.nn.Module):
    """torchvision's ``paste_mask_in_image`` in small: each mask resized, then written into a slice of an empty image."""

    def forward(self, masks: torch.Tensor, corners: torch.Tensor) -> torch.Tensor:
        images = []
        for i in range(masks.shape[0]):
            mask = F.interpolate(masks[i:i + 1], size=(6, 6), mode="bilinear", align_corners=False)[0][0]
            image = torch.zeros(10, 10, dtype=masks.dtype)
            y, x = int(corners[i, 0]), int(corners[i, 1])
            image[y:y + 3, x:x + 4] = mask[1:4, 2:6]
            images.append(image)
        return torch.stack(images)


def test_a_write_into_a_slice_of_two_dimensions_is_one_call() -> None:
    # Recorded functionally, im[y0:y1, x0:x1] = m is a slice_scatter per sliced dimension: to_onnx's
    # two ScatterNDs, of which the check matched one and reported the other extra (100 in Mask R-CNN)
    model, masks, corners = PastesMasks(), torch.randn(2, 1, 4, 4), torch.tensor([[2.0, 3.0], [1.0, 5.0]])
    proto = fwdtrace.to_onnx(model, masks, corners)
    np.testing.assert_allclose(run_ort(proto, masks, corners)[0], model(masks, corners).numpy(), rtol=1e-5, atol=1e-6)
    report = fwdtrace.check_onnx(model, masks, corners, onnx=proto)
    assert report.ok, report.text
    setitems = {name: ops for name, ops in report.matched if "__setitem__" in name}
    assert len(setitems) == 2 and all(any("ScatterND" in o or "slice_scatter" in o for o in ops) for ops in setitems.values())


class BiasedAttention(torch.nn.Module):
    """timm TinyViT's attention in small: a learned additive bias as the mask of scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.bias = torch.nn.Parameter(torch.randn(2, 5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, 5, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


def test_attention_with_a_mask_written_out_by_to_onnx_is_one_call() -> None:
    # torch's math decomposition guards the softmax of a fully masked row (Equal -inf, all() as
    # ReduceMin, Where): 20 extra in timm's tiny_vit_5m_224 before
    model, x = BiasedAttention(), torch.randn(1, 5, 8)
    proto = fwdtrace.to_onnx(model, x)
    assert {"Equal", "ReduceMin"} <= {n.op_type for n in proto.graph.node}
    np.testing.assert_allclose(run_ort(proto, x)[0], model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    report = fwdtrace.check_onnx(model, x, onnx=proto)
    assert report.ok, report.text
    (names,) = [names for name, names in report.matched if "scaled_dot_product_attention" in name]
    assert {"Equal", "ReduceMin", "Softmax"} <= {n.op_type for n in proto.graph.node if n.name in names}, names


class _TrainingDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.5, training=True) + F.dropout(self.fc(x), 0.5, training=False)


def test_a_training_mode_dropout_written_out_by_to_onnx_is_its_mul_by_the_mask() -> None:
    model = _TrainingDropout().eval()
    x = torch.randn(2, 8)
    proto = fwdtrace.to_onnx(model, x)
    # the reference: the file applies a drawn mask to the first layer's output with one Mul
    gemm = [n.output[0] for n in proto.graph.node if n.op_type == "Gemm"][0]
    (mul,) = [n for n in proto.graph.node if n.op_type == "Mul" and gemm in n.input]
    assert any(n.op_type == "RandomUniformLike" for n in proto.graph.node)
    report = fwdtrace.check_onnx(model, x, onnx=proto)
    assert report.ok, str(report)
    assert [o for t, o in report.matched if t.startswith("dropout = ")] == [(mul.name,)]
    assert not [o for t, o in report.matched if t.startswith("dropout_1 = ")]  # in eval mode: nothing
