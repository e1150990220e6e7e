"""FLOP formulas: torch's ``FlopCounterMode`` registry, plus the fused CPU kernels it counts as zero.

One convention throughout, torch's own: a multiply-add is 2 FLOPs, only matrix products
and convolutions count (bias adds, norms, activations and softmax are free). The reference
is ``torch.utils.flop_counter.flop_registry``; this module adds formulas only for the
fused kernels that registry leaves out, each equal to what torch counts for the same
computation when it is decomposed (checked in ``tests/test_flops.py``):

- ``aten._scaled_dot_product_flash_attention_for_cpu``: ``F.scaled_dot_product_attention``
  on CPU (torch counts its two matmuls only under ``sdpa_kernel(SDPBackend.MATH)``);
- ``aten._native_multi_head_attention``: ``nn.MultiheadAttention``'s fast path (eval, no grad);
- ``aten._transformer_encoder_layer_fwd``: ``nn.TransformerEncoderLayer``'s fast path;
- ``aten.mkldnn_rnn_layer`` and ``aten._cudnn_rnn``: ``nn.LSTM``'s fused CPU and cuDNN kernels
  (``2 x tokens x`` every weight matrix, as the decomposed GRU counts);
- ``quantized.linear_dynamic`` (and its ``_fp16``): a ``quantize_dynamic`` model's Linear, its
  weight packed out of sight (``2 x tokens x in x out``, as the float Linear counts).

A formula torch itself registers for one of these ops later wins over ours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry as _torch_registry
from torch.utils.flop_counter import sdpa_flop_count, shape_wrapper

__all__ = ["FLOP_FORMULAS", "flops_of"]

aten = torch.ops.aten
Shape = Sequence[int]


def _cpu_sdpa_flop(query: Shape, key: Shape, value: Shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))


def _attention_flop(query: Shape, key: Shape, embed_dim: int, num_heads: int) -> int:
    """In-projections of q, k and v, the two attention matmuls, the out-projection."""
    batch, q_len, k_len = query[0], query[1], key[1]
    head_dim = embed_dim // num_heads
    projections = 2 * batch * embed_dim * embed_dim * (2 * q_len + 2 * k_len)  # q, out: q_len; k, v: k_len
    heads = (batch, num_heads, q_len, head_dim)
    kv_heads = (batch, num_heads, k_len, head_dim)
    return projections + int(sdpa_flop_count(heads, kv_heads, kv_heads))


def _mha_flop(query: Shape, key: Shape, value: Shape, embed_dim: int, num_heads: int, *args: Any,
              out_shape: Any = None, **kwargs: Any) -> int:
    return _attention_flop(query, key, embed_dim, num_heads)


def _encoder_layer_flop(src: Shape, embed_dim: int, num_heads: int, *args: Any, out_shape: Any = None,
                        **kwargs: Any) -> int:
    # args after num_heads: qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
    # norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ...
    hidden = args[11][0]  # ffn_weight_1: [hidden, embed_dim]
    tokens = src[0] * src[1]
    return _attention_flop(src, src, embed_dim, num_heads) + 2 * 2 * tokens * embed_dim * hidden


def _mkldnn_rnn_layer_flop(input: Shape, weight_ih: Shape, weight_hh: Shape, *args: Any, out_shape: Any = None,
                           **kwargs: Any) -> int:
    """One layer, one direction of ``nn.LSTM`` on CPU: both weight matrices meet every token."""
    tokens = math.prod(input[:-1])
    return 2 * tokens * (math.prod(weight_ih) + math.prod(weight_hh))


def _cudnn_rnn_flop(input: Shape, weights: Sequence[Shape], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """Every layer and direction of a cuDNN RNN: each weight matrix meets every token once."""
    tokens = math.prod(input[:-1])  # (T, B, D), or (sum of batch_sizes, D) when packed
    return 2 * tokens * sum(math.prod(w) for w in weights if len(w) == 2)


def _linear_dynamic_flop(input: Shape, packed: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * math.prod(input) * int(out_shape[-1])


_EXTRA: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._native_multi_head_attention: _mha_flop,
    aten._transformer_encoder_layer_fwd: _encoder_layer_flop,
    aten.mkldnn_rnn_layer: _mkldnn_rnn_layer_flop,
    aten._cudnn_rnn: _cudnn_rnn_flop,
    **{op: _linear_dynamic_flop for name in ("linear_dynamic", "linear_dynamic_fp16")
       if (op := getattr(torch.ops.quantized, name, None)) is not None},
}

# op overload packet -> formula(*args, out_val=..., **kwargs) -> FLOPs
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **{op: shape_wrapper(f) for op, f in _EXTRA.items()},
    **_torch_registry,
}


def flops_of(func: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
    """FLOPs of one aten op call, or None when the op has no formula (it counts as free).

    >>> import torch
    >>> from fwdtrace.flops import flops_of
    >>> a, b = torch.ones(2, 3), torch.ones(3, 4)
    >>> flops_of(torch.ops.aten.mm.default, (a, b), {}, a @ b)  # 2 x 2*3*4
    48
    """
    formula = FLOP_FORMULAS.get(func._overloadpacket)
    if formula is None:
        return None
    return int(formula(*args, **kwargs, out_val=out))
