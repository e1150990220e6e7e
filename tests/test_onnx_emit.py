"""to_onnx: ONNX emitted from one eager run, checked by onnx's checker and run by onnxruntime against torch."""

from __future__ import annotations

import inspect
import os
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import zoo
from corpus import cache_field
from onnxscript import FLOAT, script
from onnxscript import opset18 as script_op
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError


def run_ort(proto: onnx.ModelProto, feeds: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {k: v.numpy() for k, v in feeds.items()}), strict=True))


def assert_matches(proto: onnx.ModelProto, feeds: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The model is valid and onnxruntime gives torch's outputs, by name, to a relative max difference < 1e-4."""
    onnx.checker.check_model(proto, full_check=True)
    assert [i.name for i in proto.graph.input] == list(feeds)
    got = run_ort(proto, feeds)
    assert list(got) == list(want)
    for name, expected in want.items():
        expected_np = expected.detach().numpy()
        assert got[name].shape == expected_np.shape, name
        if not expected_np.size:
            continue
        scale = max(float(np.abs(expected_np).max()), 1e-6)
        assert float(np.abs(got[name] - expected_np).max()) / scale < 1e-4, name


# -- the zoo --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_models_run_in_onnxruntime_like_torch(name: str) -> None:
    model, inputs = zoo.ZOO[name]()
    proto = fwdtrace.to_onnx(model, *inputs)
    param = next(iter(inspect.signature(model.forward).parameters))
    with torch.no_grad():
        want = model(*inputs)
    assert_matches(proto, {param: inputs[0]}, {"output": want})
    # initializers carry the state dict's names and values
    state = model.state_dict()
    for init in proto.graph.initializer:
        if init.name in state:
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), state[init.name].numpy())
    assert {i.name for i in proto.graph.initializer} >= {n for n, p in model.named_parameters()}


def test_module_paths_are_kept_as_the_scopes_onnx_graph_reads() -> None:
    model, (x,) = zoo.resnetish()
    graph = fwdtrace.onnx_graph(fwdtrace.to_onnx(model, x))
    paths = {n.module_path for n in graph.nodes if n.kind == "function"}
    modules = dict(model.named_modules())
    assert paths <= set(modules)
    # every convolution sits in a Conv2d's scope, every Gemm-like op in the classifier
    convs = [n for n in graph.nodes if n.target == "onnx.Conv"]
    assert len(convs) == sum(isinstance(m, nn.Conv2d) for m in modules.values())
    assert all(isinstance(modules[n.module_path], nn.Conv2d) for n in convs)
    assert {n.module_path for n in convs} == {k for k, m in modules.items() if isinstance(m, nn.Conv2d)}
    # the hooks that recorded the scopes are gone
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in modules.values())


def test_tied_weights_are_one_initializer_and_outputs_get_their_names() -> None:
    proto = fwdtrace.to_onnx(zoo.DictOutput(), torch.randn(2, 4))
    assert [o.name for o in proto.graph.output] == ["logits", "probs"]
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    ids = torch.tensor([[1, 2, 3]])
    proto = fwdtrace.to_onnx(tied, ids)
    weights = [i.name for i in proto.graph.initializer if i.name in tied.state_dict()]
    assert weights == ["0.weight"]  # '1.weight' is the same tensor: one initializer, by its first name
    assert_matches(proto, {"input": ids}, {"output": tied(ids)})


class _SharesAPositionEncoding(nn.Module):
    """timm's CoaT in small: one depthwise conv reached by two paths (the model's and a block's)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpe = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.blocks = nn.ModuleList([nn.Sequential(self.cpe, nn.ReLU())])
        self.register_buffer("scale", torch.full((1, 4, 1, 1), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x) * self.scale + self.cpe(x)


def test_a_module_reached_by_two_paths_keeps_its_own_parameters() -> None:
    # torch's functional_call, which records the model, put the recording's tensors in such a module
    model, x = _SharesAPositionEncoding(), torch.randn(1, 4, 5, 5)
    held = {name: t for name, t in [*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)]}
    proto = fwdtrace.to_onnx(model, x)
    assert all(t is held[name] for name, t in [*model.named_parameters(remove_duplicate=False),
                                               *model.named_buffers(remove_duplicate=False)])
    assert_matches(proto, {"x": x}, {"output": model(x)})


def test_dataclass_output_and_an_input_returned_as_it_is() -> None:
    class PassThrough(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return x, y + 1, x

    x, y = torch.randn(2, 3), torch.randn(2, 3)
    proto = fwdtrace.to_onnx(PassThrough(), x, y=y)
    assert_matches(proto, {"x": x, "y": y}, {"output_0": x, "output_1": y + 1, "output_2": x})
    model = zoo.DataclassOutput().eval()
    x = torch.randn(2, 4)
    out = model(x)
    assert_matches(fwdtrace.to_onnx(model, x), {"x": x}, {"logits": out.logits, "hidden": out.hidden})


def test_an_op_whose_onnx_form_has_another_dtype_is_cast_to_eagers() -> None:
    class IntCumsum(nn.Module):
        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            running = torch.cumsum(ids.ne(0).int(), dim=1)  # int32 in, int64 out in torch; int32 in ONNX's CumSum
            return running, running * 2

    ids = torch.tensor([[1, 0, 3, 4], [0, 5, 6, 0]], dtype=torch.int32)
    proto = fwdtrace.to_onnx(IntCumsum(), ids)
    running, doubled = IntCumsum()(ids)
    assert running.dtype == torch.int64
    assert_matches(proto, {"ids": ids}, {"output_0": running, "output_1": doubled})
    assert run_ort(proto, {"ids": ids})["output_0"].dtype == np.int64


class MixedDtypes(nn.Module):
    """Elementwise ops on tensors of two dtypes, which torch promotes (torch.result_type) and ONNX does not."""

    def forward(self, f: torch.Tensor, i64: torch.Tensor, i32: torch.Tensor, h: torch.Tensor,
                s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (f * i64, f / i32, i32 + i64, i64 / i32,  # float32, float32, int64, float32 (true division)
                i32 < f, torch.where(i32 > 2, i32, f),  # compared in float32; float32
                h * s, h + f, f + i32.bool())  # a 0-dim float32 keeps float16; float32; bool promotes too


def test_elementwise_ops_on_mixed_dtypes_promote_as_torch_does() -> None:
    torch.manual_seed(0)
    feeds = {"f": torch.randn(2, 3), "i64": torch.randint(-4, 5, (2, 3)),
             "i32": torch.randint(1, 5, (2, 3), dtype=torch.int32), "h": torch.randn(2, 3).half(),
             "s": torch.tensor(1.5)}
    proto = fwdtrace.to_onnx(MixedDtypes(), *feeds.values())
    onnx.checker.check_model(proto, full_check=True)
    want = MixedDtypes()(*feeds.values())
    got = list(run_ort(proto, feeds).values())
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (k, str(g.dtype)) == (k, str(w.numpy().dtype))
        np.testing.assert_allclose(g.astype(np.float64), w.double().numpy(), rtol=1e-3, atol=1e-6, err_msg=str(k))


# -- Python control flow on values ----------------------------------------------------------------
def test_control_flow_on_values_follows_the_branch_the_example_took() -> None:
    torch.manual_seed(0)
    model = zoo.BranchyCNN().eval()
    bright, dark = torch.rand(1, 3, 8, 8) + 0.1, -torch.rand(1, 3, 8, 8) - 0.1
    with pytest.raises(FwdtraceError, match=r"^the dynamo ONNX exporter failed on BranchyCNN: "):
        fwdtrace.export_onnx(model, bright, exporter="dynamo")
    proto = fwdtrace.to_onnx(model, bright)
    with torch.no_grad():
        assert_matches(proto, {"x": bright}, {"output": model(bright)})
        # another input runs the branch the example took, as the trace said: not the dark one
        h = torch.relu(model.conv(dark))
        want_bright_path = model.head(model.bright(h).mean((2, 3)))
        assert_matches(proto, {"x": dark}, {"output": want_bright_path})
        assert not torch.allclose(model(dark), want_bright_path)
    ops = {n.op_type for n in proto.graph.node}
    assert "Tanh" not in ops
    assert_matches(fwdtrace.to_onnx(model, dark), {"x": dark}, {"output": model(dark)})


class TopRows(nn.Module):
    """Rows picked by topk, each indexed with a 0-dim tensor (a detector's per-box loop)."""

    def forward(self, scores: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        top = scores.topk(2).indices
        return torch.stack([feats[0, top[i], :3].exp() for i in range(2)]), feats[..., top[-1]], feats[None, top[0]]


class WriteThroughPicked(nn.Module):
    def forward(self, scores: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        feats = feats.clone()
        row = feats[scores.argmax()]
        row.mul_(2)  # writes feats' row: eager's select is a view
        return feats


def test_a_0_dim_tensor_index_stays_an_input_of_the_graph() -> None:
    torch.manual_seed(0)
    example, other = (torch.randn(6), torch.randn(6, 6, 6)), (torch.randn(6), torch.randn(6, 6, 6))
    model = TopRows()
    proto = fwdtrace.to_onnx(model, *example)
    for scores, feats in (example, other):  # other scores pick other rows
        want = model(scores, feats)
        assert_matches(proto, {"scores": scores, "feats": feats}, {f"output_{k}": w for k, w in enumerate(want)})
    assert {"TopK", "Gather"} <= {n.op_type for n in proto.graph.node}
    # a write through such a selection must reach the tensor selected from: the example's index then
    scores, feats = example[0], example[1][0]
    proto = fwdtrace.to_onnx(WriteThroughPicked(), scores, feats)
    assert_matches(proto, {"scores": scores, "feats": feats}, {"output": WriteThroughPicked()(scores, feats)})


class KeptBoxes(nn.Module):
    """A detector's post-processing in small: per image, the boxes whose score passes a threshold, then all
    images' together (with random weights, the example often keeps none: FCOS at 320 px)."""

    def forward(self, scores: torch.Tensor, boxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = [boxes[i][scores[i] > 0.5] for i in range(scores.shape[0])]
        confident = [scores[i][scores[i] > 0.99] for i in range(scores.shape[0])]
        return torch.cat(kept) * 2, torch.cat(confident)


def test_sizes_that_depend_on_values_are_not_fixed_to_the_examples() -> None:
    torch.manual_seed(0)
    scores, boxes = torch.rand(3, 8) * 0.9, torch.randn(3, 8, 4)
    model = KeptBoxes()
    proto = fwdtrace.to_onnx(model, scores, boxes)  # the example keeps no confident score: a cat of empty tensors
    dims = [[d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in proto.graph.output]
    assert [len(d) for d in dims] == [2, 1] and all(isinstance(d, str) for d in dims[0][:1] + dims[1])
    for other in (scores, torch.rand(3, 8), scores + 0.095):  # as many boxes as the example, more, all
        want = model(other, boxes)
        assert_matches(proto, {"scores": other, "boxes": boxes}, {"output_0": want[0], "output_1": want[1]})


class RefinedBoxes(nn.Module):
    """The boxes a score keeps, then ``steps`` ops on them: a detector's post-processing, in any length."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def forward(self, scores: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        kept = boxes[scores > 0.5]
        for _ in range(self.steps):
            kept = kept * 1.01 + 0.1
        return kept


def test_the_work_of_an_emission_per_op_is_no_fake_mode_and_no_symbol() -> None:
    """torch made a fake mode per recorded op (each taking a stack trace) and the emission two symbols
    with guards per value after a data-dependent size: Keypoint R-CNN's to_onnx took over 300 s."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    torch.manual_seed(0)
    scores, boxes = torch.rand(8), torch.randn(8, 4)
    made = []
    for steps in (2, 12):
        model = RefinedBoxes(steps)
        with mock.patch.object(FakeTensorMode, "__init__", autospec=True, side_effect=FakeTensorMode.__init__) as modes, \
                mock.patch.object(ShapeEnv, "create_unbacked_symint", autospec=True,
                                  side_effect=ShapeEnv.create_unbacked_symint) as symbols:
            proto = fwdtrace.to_onnx(model, scores, boxes)
        made.append((modes.call_count, symbols.call_count))
        other = torch.rand(8)
        assert_matches(proto, {"scores": other, "boxes": boxes}, {"output": model(other, boxes)})
    assert made[0] == made[1], f"(fake modes, symbols) made for 2 and for 12 ops: {made}"


def test_multihead_attention_fast_path_under_no_grad() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    q = torch.randn(2, 5, 16)
    with torch.no_grad():
        proto = fwdtrace.to_onnx(mha, q, q, q)
        out, weights = mha(q, q, q)
    assert_matches(proto, {"query": q, "key": q, "value": q}, {"output_0": out, "output_1": weights})


class _MaskedAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_gives_a_fully_masked_query_row_zeros_as_eager(dtype: torch.dtype) -> None:
    # a left-padded decoder's pad position under the causal mask: its query row attends to no key
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 4, 8, dtype=dtype).unbind(0)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, 0] = False  # the second sample's first position is padding
    model = _MaskedAttention()
    with torch.no_grad():
        want = model(q, k, v, mask)
        proto = fwdtrace.to_onnx(model, q, k, v, mask)
    assert not want[1, :, 0].any() and want[0, :, 0].abs().sum() > 0  # eager: zeros on that row only
    got = run_ort(proto, {"q": q, "k": k, "v": v, "mask": mask})["output"]
    assert not np.isnan(got).any()
    assert_matches(proto, {"q": q, "k": k, "v": v, "mask": mask}, {"output": want})
    report = fwdtrace.check_onnx(model, q, k, v, mask, onnx=proto)  # the guard counts as the attention's
    assert report.ok, report.text


class _GroupedQueryAttention(nn.Module):
    def __init__(self, mask: bool) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril() if self.mask else None
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("mask", [False, True])
def test_grouped_query_attention_shares_each_key_and_value_head_as_eager(mask: bool) -> None:
    # 4 query heads over 2 key and value heads (transformers' Mistral and Llama without a mask): eager's CPU
    # kernel pairs query heads 0-1 with key head 0 and 2-3 with key head 1
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    model = _GroupedQueryAttention(mask)
    with torch.no_grad():
        want = model(q, k, v)
        proto = fwdtrace.to_onnx(model, q, k, v)
    assert torch.allclose(want, model(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))  # eager's pairing
    assert_matches(proto, {"q": q, "k": k, "v": v}, {"output": want})


# -- transformers models from small configs -------------------------------------------------------
@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _ids(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(1))


def _cache_tensors(prefix: str, cache) -> dict[str, torch.Tensor]:
    return {f"{prefix}.layers.{i}.{kind}": getattr(layer, kind)
            for i, layer in enumerate(cache.layers) for kind in ("keys", "values")}


def test_bert(hf) -> None:
    torch.manual_seed(0)
    config = hf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32)
    model = hf.BertModel(config).eval()
    ids, mask = _ids(), torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    proto = fwdtrace.to_onnx(model, ids, attention_mask=mask)
    out = model(ids, attention_mask=mask)
    assert_matches(proto, {"input_ids": ids, "attention_mask": mask},
                   {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output})


@pytest.mark.parametrize("use_cache", [True, False])
def test_gpt2_with_and_without_cache(hf, use_cache: bool) -> None:
    torch.manual_seed(0)
    config = hf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    model = hf.GPT2LMHeadModel(config).eval()
    ids = _ids()
    proto = fwdtrace.to_onnx(model, ids, use_cache=use_cache)
    out = model(ids, use_cache=use_cache)
    want = {"logits": out.logits}
    if use_cache:
        want.update(_cache_tensors(cache_field(out), out.past_key_values))
        assert len(want) == 5  # two layers' keys and values
    assert_matches(proto, {"input_ids": ids}, want)


def test_t5_encoder_decoder(hf) -> None:
    torch.manual_seed(0)
    config = hf.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
    model = hf.T5Model(config).eval()
    ids, decoder_ids = _ids(), _ids(2, 4)
    proto = fwdtrace.to_onnx(model, ids, decoder_input_ids=decoder_ids)
    out = model(ids, decoder_input_ids=decoder_ids)
    want = {"last_hidden_state": out.last_hidden_state}
    cache = cache_field(out)
    want.update(_cache_tensors(f"{cache}.self_attention_cache", out.past_key_values.self_attention_cache))
    want.update(_cache_tensors(f"{cache}.cross_attention_cache", out.past_key_values.cross_attention_cache))
    want["encoder_last_hidden_state"] = out.encoder_last_hidden_state
    assert_matches(proto, {"input_ids": ids, "decoder_input_ids": decoder_ids}, want)


def test_vit(hf) -> None:
    torch.manual_seed(0)
    config = hf.ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=64)
    model = hf.ViTModel(config).eval()
    pixels = torch.randn(1, 3, 16, 16)
    proto = fwdtrace.to_onnx(model, pixels)
    out = model(pixels)
    assert_matches(proto, {"pixel_values": pixels},
                   {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output})


# -- files and errors -----------------------------------------------------------------------------
def test_path_writes_the_model_whole(tmp_path) -> None:
    model, (x,) = zoo.mobilenetish()
    target = tmp_path / "model.onnx"
    proto = fwdtrace.to_onnx(model, x, path=target)
    assert onnx.load(target) == proto
    assert os.listdir(tmp_path) == ["model.onnx"]
    with pytest.raises(FwdtraceError, match=r"^to_onnx\(\) could not create a file in '.*missing': No such file or directory"):
        fwdtrace.to_onnx(model, x, path=tmp_path / "missing" / "model.onnx")


def test_a_large_model_has_its_weights_written_beside_it(tmp_path, monkeypatch) -> None:
    # torchvision's vit_h_14 and regnet_y_128gf (2.5 GB of weights) by to_onnx(path=...): protobuf's
    # "Failed to serialize proto" (make bench-real). The threshold export_onnx uses is lowered here.
    from fwdtrace.onnx import export as onnx_export

    model, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), torch.randn(2, 64)
    whole = fwdtrace.to_onnx(model, x)
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", (64 * 64 + 64 + 64 * 8 + 8) * 4 - 1)
    target = tmp_path / "model.onnx"
    proto = fwdtrace.to_onnx(model, x, path=target)
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "model.onnx.data"]
    assert os.path.getsize(target) < whole.ByteSize() / 2  # the weights are in the data file
    moved = [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert moved and all(e.value == "model.onnx.data" for t in proto.graph.initializer
                         for e in t.external_data if e.key == "location")
    loaded = onnx.load(target)  # with its data file
    assert {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in loaded.graph.initializer} == \
        {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in whole.graph.initializer}
    with torch.no_grad():
        expected = model(x).numpy()
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_opset_is_converted_to() -> None:
    model, (x,) = zoo.mobilenetish()
    proto = fwdtrace.to_onnx(model, x, opset=20)
    assert {o.domain: o.version for o in proto.opset_import}[""] == 20
    with torch.no_grad():
        assert_matches(proto, {"x": x}, {"output": model(x)})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fwdtrace.to_onnx("model", torch.ones(1)), r"^to_onnx\(\) expected a torch.nn.Module as model, got str"),
        (lambda: fwdtrace.to_onnx(nn.ReLU(), torch.ones(1), opset=3), r"^to_onnx\(\) expected opset as an integer from 18 to 23, got 3"),
        (lambda: fwdtrace.to_onnx(nn.ReLU(), 1.0), r"^to_onnx\(\) expected at least one tensor among the model's inputs"),
    ],
)
def test_bad_input_is_refused(call, message) -> None:
    with pytest.raises(FwdtraceError, match=message):
        call()


def test_a_failing_forward_leaves_no_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(5, 2))
    with pytest.raises(FwdtraceError, match=r"^to_onnx\(\) could not run Sequential on float32\[1, 4\]: RuntimeError: "):
        fwdtrace.to_onnx(model, torch.ones(1, 4))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# -- symbolics: what torchlib does not cover ------------------------------------------------------
@torch.library.custom_op("fwdtrace_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("fwdtrace_test::shift", mutates_args=())
def shift(x: torch.Tensor, by: float) -> torch.Tensor:
    return x + by


class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return twice(x)


class ScaledShift(nn.Module):
    """A layer with a parameter whose forward calls an op ONNX has no translation for."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([0.5, 2.0, -1.0]))

    def forward(self, x: torch.Tensor, by: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
        y = shift(x, by) * self.scale
        return y, torch.tanh(y)


class CustomNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.dbl = Twice()
        self.block = nn.Sequential(ScaledShift())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, t = self.block(self.dbl(self.fc(x)))
        return y + twice(t)


def test_unsupported_ops_are_all_listed_with_where_they_ran_and_a_stub(restore_rules) -> None:
    torch.manual_seed(0)
    model = CustomNet().eval()
    with pytest.raises(FwdtraceError, match=(
        r"^to_onnx\(\) found 2 ops with no ONNX translation: "
        r"fwdtrace_test\.twice \(in 'dbl' \(test_onnx_emit\.Twice\), the model's forward\); "
        r"fwdtrace_test\.shift \(in 'block\.0' \(test_onnx_emit\.ScaledShift\)\)\. "
    )) as info:
        fwdtrace.to_onnx(model, torch.randn(2, 3))
    message = str(info.value)
    assert "@fwdtrace.onnx_symbolic('fwdtrace_test.twice')\ndef fwdtrace_test_twice(op, x):" in message
    assert "@fwdtrace.onnx_symbolic('fwdtrace_test.shift')\ndef fwdtrace_test_shift(op, x, by):" in message
    assert all(not m._forward_hooks and not m._forward_pre_hooks and "forward" not in vars(m) for m in model.modules())


def test_symbolics_for_an_op_and_for_a_layer_make_it_export(restore_rules) -> None:
    torch.manual_seed(0)
    model = CustomNet().eval()
    x = torch.randn(2, 3)

    @fwdtrace.onnx_symbolic(torch.ops.fwdtrace_test.twice)
    def twice_onnx(op, x):
        return op.Add(x, x)

    @fwdtrace.onnx_symbolic("test_onnx_emit.ScaledShift")
    def scaled_shift_onnx(op, x, *, scale):
        y = op.Mul(op.Add(x, op.Constant(value_float=3.0)), scale)
        return y, op.Tanh(y)

    proto = fwdtrace.to_onnx(model, x)
    with torch.no_grad():
        assert_matches(proto, {"x": x}, {"output": model(x)})
    graph = fwdtrace.onnx_graph(proto)
    assert {n.target for n in graph.nodes if n.module_path == "block.0"} - {"onnx.Constant"} == {"onnx.Add", "onnx.Mul", "onnx.Tanh"}
    assert "block.0.scale" in {i.name for i in proto.graph.initializer}  # the layer's parameter, by name
    assert all("forward" not in vars(m) for m in model.modules())  # the layer's boundary is gone
    assert fwdtrace.remove_onnx_symbolic("test_onnx_emit.ScaledShift")
    with pytest.raises(FwdtraceError, match=r"^to_onnx\(\) found 1 op with no ONNX translation: fwdtrace_test\.shift"):
        fwdtrace.to_onnx(model, x)


@script()
def twice_script(x: FLOAT) -> FLOAT:  # onnxscript resolves FLOAT and script_op among the module's globals
    return script_op.Mul(x, script_op.CastLike(2.0, x))


def test_an_onnxscript_function_is_a_symbolic_too(restore_rules) -> None:
    fwdtrace.onnx_symbolic("fwdtrace_test::twice")(twice_script)
    model, x = Twice(), torch.randn(4)
    assert_matches(fwdtrace.to_onnx(model, x), {"x": x}, {"output": model(x)})


def test_a_symbolic_replaces_torchlibs_translation(restore_rules) -> None:
    @fwdtrace.onnx_symbolic("aten.tanh")
    def tanh_by_exp(op, x):  # tanh(x) = 1 - 2 / (exp(2x) + 1)
        two = op.Constant(value_float=2.0)
        return op.Sub(op.Constant(value_float=1.0), op.Div(two, op.Add(op.Exp(op.Mul(two, x)), op.Constant(value_float=1.0))))

    x = torch.randn(5)
    proto = fwdtrace.to_onnx(nn.Tanh(), x)
    assert "Tanh" not in {n.op_type for n in proto.graph.node}
    assert_matches(proto, {"input": x}, {"output": torch.tanh(x)})


@pytest.mark.parametrize("target", [42, "nodots", torch.tanh])
def test_symbolic_targets_are_checked(target) -> None:
    with pytest.raises(FwdtraceError, match=r"^onnx_symbolic\(\) expected a torch.nn.Module subclass, a torch op"):
        fwdtrace.onnx_symbolic(target)


def test_a_symbolic_that_returns_nothing_is_named(restore_rules) -> None:
    fwdtrace.onnx_symbolic("fwdtrace_test.twice")(lambda op, x: None)
    with pytest.raises(FwdtraceError, match=r"^to_onnx\(\) could not emit the recorded graph: the ONNX symbolic '<lambda>' "
                       r"expected to return ONNX values \(op.Add\(...\)\), got None"):
        fwdtrace.to_onnx(Twice(), torch.randn(3))


def test_an_op_that_cannot_be_emitted_is_named_with_where_it_ran(restore_rules) -> None:
    def broken(op, x):
        raise ValueError("no ONNX for this")

    fwdtrace.onnx_symbolic("fwdtrace_test.twice")(broken)
    with pytest.raises(FwdtraceError, match=r"^to_onnx\(\) could not emit the recorded graph at fwdtrace_test\.twice "
                       r"in '0\.0' \(test_onnx_emit\.Twice\): .*no ONNX for this"):
        fwdtrace.to_onnx(nn.Sequential(nn.Sequential(Twice())), torch.randn(3))


class Gate(nn.Module):
    """In the recording thread, lets ``other`` run (and waits for it) the first time it is called."""

    def __init__(self) -> None:
        super().__init__()
        self.other: threading.Thread | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.other is not None and threading.current_thread() is not self.other and not self.other.is_alive():
            self.other.start()
            self.other.join(timeout=30)
        return x


def test_another_thread_running_the_model_meanwhile_is_not_recorded(restore_rules) -> None:
    fwdtrace.onnx_symbolic(torch.ops.fwdtrace_test.twice)(lambda op, x: op.Add(x, x))

    @fwdtrace.onnx_symbolic("test_onnx_emit.ScaledShift")
    def scaled_shift_onnx(op, x, *, scale):
        y = op.Mul(op.Add(x, op.Constant(value_float=3.0)), scale)
        return y, op.Tanh(y)

    torch.manual_seed(0)
    net = CustomNet().eval()
    gate = Gate()
    model = nn.Sequential(gate, net)
    x = torch.randn(2, 3)
    with torch.no_grad():
        want = net(x)
    results = []

    def other() -> None:  # runs while to_onnx records: hooks and the layer's boundary are in place
        with torch.no_grad():
            results.append(net(x))

    gate.other = threading.Thread(target=other)
    proto = fwdtrace.to_onnx(model, x)
    assert len(results) == 1 and torch.equal(results[0], want)
    with torch.no_grad():
        assert_matches(proto, {"input": x}, {"output": want})
    graph = fwdtrace.onnx_graph(proto)
    assert {n.module_path for n in graph.nodes if n.target == "onnx.Tanh"} == {"1.block.0"}
    assert {n.module_path for n in graph.nodes if n.target == "onnx.Gemm"} == {"1.fc"}
