"""FLOPs: analytical formulas for single layers, FlopCounterMode for whole models and modules."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import zoo
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import fwdtrace
from fwdtrace.flops import flops_of
from fwdtrace.instrument.keys import module_key


@contextlib.contextmanager
def decomposed() -> object:
    """Where FlopCounterMode sees the fused kernels as matmuls: grad on (no MHA fast path),
    the math SDPA backend, no oneDNN LSTM."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # oneDNN's TF32 notice
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH), torch.backends.mkldnn.flags(enabled=False):
            yield


def reference(model: nn.Module, *inputs: torch.Tensor) -> FlopCounterMode:
    with decomposed(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter


def conv_out(size: int, k: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


# (cin, cout, kernel, stride, padding, dilation, groups, bias, input hw)
CONVS = [
    (3, 8, 3, 1, 1, 1, 1, True, 16),
    (8, 16, 3, 2, 0, 1, 1, False, 15),
    (16, 16, 3, 1, 2, 2, 16, True, 12),  # depthwise, dilated
    (8, 4, 1, 1, 0, 1, 2, False, 9),
    (4, 6, (3, 5), (1, 2), (1, 2), 1, 1, True, 10),
]


@pytest.mark.parametrize("cin,cout,k,stride,pad,dil,groups,bias,hw", CONVS)
def test_conv2d_flops_match_the_formula(cin, cout, k, stride, pad, dil, groups, bias, hw):
    conv = nn.Conv2d(cin, cout, k, stride, pad, dil, groups, bias)
    kh, kw = (k, k) if isinstance(k, int) else k
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    ph, pw = (pad, pad) if isinstance(pad, int) else pad
    batch = 2
    out_h, out_w = conv_out(hw, kh, sh, ph, dil), conv_out(hw, kw, sw, pw, dil)
    expected = 2 * batch * cout * out_h * out_w * (cin // groups) * kh * kw  # 2 x MACs, bias free
    result = fwdtrace.analyze(conv, torch.randn(batch, cin, hw, hw), warmup=1, repeats=1)
    assert result.flops == expected
    assert result.row("Conv2d").flops == expected


@pytest.mark.parametrize("shape,fin,fout,bias", [((4, 10), 10, 7, True), ((2, 3, 5, 16), 16, 9, False), ((16,), 16, 3, True)])
def test_linear_flops_match_the_formula(shape, fin, fout, bias):
    result = fwdtrace.analyze(nn.Linear(fin, fout, bias), torch.randn(*shape), warmup=1, repeats=1)
    assert result.flops == 2 * math.prod(shape[:-1]) * fin * fout


def sdpa_formula(b: int, h: int, sq: int, sk: int, d: int, dv: int) -> int:
    return 2 * b * h * sq * sk * d + 2 * b * h * sq * sk * dv  # q @ k^T, then weights @ v


class SDPA(nn.Module):
    def forward(self, q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("dv", [8, 5])  # 8: the fused CPU kernel; 5: torch falls back to math
def test_cpu_sdpa_is_not_zero_and_matches_the_formula_and_the_math_backend(dv):
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, dv)
    expected = sdpa_formula(2, 4, 6, 10, 8, dv)
    if dv == 8:  # the gap: plain FlopCounterMode counts nothing for the fused kernel
        with FlopCounterMode(display=False) as fused:
            SDPA()(q, k, v)
        assert fused.get_total_flops() == 0
    result = fwdtrace.analyze(SDPA(), q, k, v, warmup=1, repeats=1)
    assert result.flops == expected == reference(SDPA(), q, k, v).get_total_flops()


@pytest.mark.parametrize("kv_len,need_weights", [(6, False), (9, False), (6, True)])
def test_multihead_attention_fast_path_counts_projections_and_attention(kv_len, need_weights):
    b, length, e, heads = 2, 6, 32, 4

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(e, heads, batch_first=True)

        def forward(self, q, kv):
            return self.attn(q, kv, kv, need_weights=need_weights)[0]

    torch.manual_seed(0)
    model = Attend().eval()
    q, kv = torch.randn(b, length, e), torch.randn(b, kv_len, e)
    expected = 2 * b * e * e * (2 * length + 2 * kv_len) + sdpa_formula(b, heads, length, kv_len, e // heads, e // heads)
    assert fwdtrace.analyze(model, q, kv, warmup=1, repeats=1).flops == expected
    assert reference(model, q, kv).get_total_flops() == expected


def test_transformer_encoder_layer_fast_path_matches_the_formula():
    b, length, e, heads, hidden = 2, 7, 32, 4, 64
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(e, heads, hidden, batch_first=True, dropout=0.0).eval()
    x = torch.randn(b, length, e)
    expected = 2 * b * length * (4 * e * e + 2 * e * hidden) + sdpa_formula(b, heads, length, length, e // heads, e // heads)
    assert fwdtrace.analyze(layer, x, warmup=1, repeats=1).flops == expected
    assert reference(layer, x).get_total_flops() == expected


@pytest.mark.parametrize("layers,bidirectional,proj,batch_first", [(1, False, 0, True), (2, True, 0, False), (2, True, 5, True)])
def test_lstm_counts_like_its_decomposition(layers, bidirectional, proj, batch_first):
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 12, num_layers=layers, bidirectional=bidirectional, proj_size=proj, batch_first=batch_first).eval()
    x = torch.randn(3, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "LSTM with projections is not supported with oneDNN"
        result = fwdtrace.analyze(lstm, x, warmup=1, repeats=1)
    weights = sum(p.numel() for p in lstm.parameters() if p.dim() == 2)
    assert result.flops == 2 * 15 * weights == reference(lstm, x).get_total_flops()


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_totals_agree_with_flop_counter_mode(name):
    model, inputs = zoo.ZOO[name]()
    expected = reference(model, *inputs).get_total_flops()
    result = fwdtrace.analyze(model, *inputs, warmup=1, repeats=1)
    assert expected > 0
    assert abs(result.flops - expected) <= 0.01 * expected


def test_a_larger_torch_transformer_agrees_with_flop_counter_mode():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 8, 512, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval()
    x = torch.randn(2, 64, 128)
    expected = reference(model, x).get_total_flops()
    result = fwdtrace.analyze(model, x, warmup=1, repeats=1)
    assert abs(result.flops - expected) <= 0.01 * expected


@pytest.mark.parametrize("name", ["resnetish", "transformer_encoder", "densenetish", "shared_weights", "hand_attention"])
def test_per_module_flops_add_up_and_match_flop_counter_mode_per_module(name):
    model, inputs = zoo.ZOO[name]()
    counter = reference(model, *inputs)
    root = type(model).__name__
    inclusive = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    result = fwdtrace.analyze(model, *inputs, warmup=1, repeats=1)
    assert sum(r.flops for r in result.rows) == result.flops == result.rows[-1].flops_total
    for path, module in model.named_modules():
        # FlopCounterMode's per-module numbers are inclusive, named "Root.path"
        expected = inclusive.get(f"{root}.{path}" if path else root, 0)
        assert result.row(module_key(path, module)).flops_total == expected, path


def test_flops_of_returns_none_for_free_ops():
    x = torch.ones(3)
    assert flops_of(torch.ops.aten.relu.default, (x,), {}, x.relu()) is None
