"""The conformance corpus: real architectures in one table, and every public entry point run on each.

A row (:class:`Case`) builds a model from a small config with random weights and its example
inputs. :data:`ENTRIES` names each public entry point (the trace, pictures at every depth,
each ONNX check and export, analysis, probes, the live page's SVG, JSON) and holds the
function that runs it on one :class:`Run` and asserts its invariants, each against an
independent reference where there is one (plain forward hooks, ``p.numel()``, onnxruntime,
the graph contracted by box). A :class:`Run` does a model's expensive work once: one
build, one trace, one export per exporter, one ``check_onnx`` per exporter, with and without numbers.

``tests/test_conformance.py`` makes one pytest case per (row, entry point) from
:data:`CORPUS`; ``benchmarks/conformance_real.py`` runs the same entries over torchvision
and timm (:func:`real_cases`). Adding a model is adding a row.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import struct
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import fwdtrace

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]
EXPORTERS = ("dynamo", "torchscript", "fwdtrace")
AUTO_MIN_BOXES = 30  # the automatic picture shows at least min(this, boxes at full detail)


@dataclass(frozen=True)
class Case:
    """One model of the corpus.

    ``exporter_fails`` declares where an exporter itself cannot export the model (not a
    fwdtrace defect): exporter -> a regex its error must match. The cells of that exporter
    then assert that fwdtrace's error names the exporter and matches, instead of a report.
    """

    name: str
    build: Callable[[], Built]
    exporter_fails: Mapping[str, str] = field(default_factory=dict)
    family: str = "own"
    # a regex of the targets of the calls that draw random numbers (``randn_like``, a Dropout in training):
    # the outputs that depend on them differ in onnxruntime by nature (see Run.drawn_outputs)
    draws: str = ""
    # the row this one repeats on other inputs (the same architecture): the picture entry points, whose
    # invariants depend on the architecture alone, are that row's (see :func:`runs`)
    repeats: str = ""
    # the model builds part of itself in its first call (lazy layers, a head sized from its first input): the
    # exports and ONNX checks get it made but never called, as a user who has just made it hands it over
    # (see Run.unbuilt); the other entry points get the shared model, called once
    fresh: bool = False


# -- the rows: models of our own ---------------------------------------------------------------------------
class TinyAnchors(nn.Module):
    """torchvision's ``AnchorGenerator`` in small: one cell anchor per level, kept in a plain list
    attribute that every forward sets anew (``.to`` the features' dtype and device), shifted over
    each level's grid; and ``MultiScaleRoIAlign``'s scales, computed by the first call only."""

    def __init__(self, sizes: tuple[int, ...] = (4, 8, 16)) -> None:
        super().__init__()
        self.cell_anchors = [torch.tensor([-s, -s, s, s], dtype=torch.float32) / 2 for s in sizes]
        self.scales: list[float] | None = None

    def forward(self, batch: torch.Tensor, features: list[torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
        if self.scales is None:
            self.scales = [2 ** float(torch.tensor(f.shape[-1] / batch.shape[-1]).log2().round()) for f in features]
        self.cell_anchors = [a.to(dtype=features[0].dtype, device=features[0].device) for a in self.cell_anchors]
        anchors = []
        for f, a, scale in zip(features, self.cell_anchors, self.scales, strict=True):
            ys, xs = torch.meshgrid(torch.arange(f.shape[-2]) / scale, torch.arange(f.shape[-1]) / scale, indexing="ij")
            anchors.append(torch.stack([xs, ys, xs, ys], -1).reshape(-1, 4) + a)
        return torch.cat(anchors), self.scales


class TinyDetector(nn.Module):
    """A two-stage-detector's skeleton in small: images of different sizes batched as torchvision's
    ``GeneralizedRCNNTransform.batch_images`` does (``new_full``, then ``copy_`` through a view),
    a backbone, an FPN-like top-down merge, anchors as torchvision makes them, one head run in a
    loop over the levels, and a loop over the top boxes decoding each against its anchor."""

    def __init__(self, width: int = 16, boxes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.c2 = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
        self.c3 = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.lateral = nn.ModuleList(nn.Conv2d(c, width, 1) for c in (8, 16, 32))
        self.anchors = TinyAnchors()
        self.head = nn.Conv2d(width, 5, 3, padding=1)  # 4 box deltas and a score per place, shared by levels
        self.boxes = boxes

    def forward(self, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        size = [max(s) for s in zip(*[img.shape for img in images], strict=True)]
        size[1], size[2] = (int(math.ceil(s / 8) * 8) for s in size[1:])
        batch = images[0].new_full([len(images), *size], 0)
        for img, pad in zip(images, batch, strict=True):
            pad[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
        f1 = self.stem(batch)
        f2 = self.c2(f1)
        f3 = self.c3(f2)
        p3 = self.lateral[2](f3)
        p2 = self.lateral[1](f2) + F.interpolate(p3, size=f2.shape[-2:], mode="nearest")
        p1 = self.lateral[0](f1) + F.interpolate(p2, size=f1.shape[-2:], mode="nearest")
        out = torch.cat([self.head(p).flatten(2).transpose(1, 2) for p in (p1, p2, p3)], 1)
        anchors, scales = self.anchors(batch, [p1, p2, p3])
        scores = out[0, :, 4].sigmoid()
        top = scores.topk(self.boxes).indices
        boxes = []
        for i in range(self.boxes):
            d, a = out[0, top[i], :4], anchors[top[i]] * scales[0]
            boxes.append(torch.stack([a[0] + d[0], a[1] + d[1], a[2] + d[2].exp(), a[3] + d[3].exp()]))
        return {"boxes": torch.stack(boxes), "scores": scores[top]}


class EmbedConvLSTM(nn.Module):
    """Token ids, an Embedding, a residual Conv1d, an LSTM (the issue's ``'l:0'`` draw-pass crash)."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        out, _ = self.lstm(x)
        return self.head(out)


class Seq2Seq(nn.Module):
    """An LSTM encoder and a greedy LSTMCell decoder with dot-product attention, ``steps`` steps."""

    def __init__(self, vocab: int = 1000, d: int = 256, steps: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.cell = nn.LSTMCell(2 * d, d)
        self.out = nn.Linear(2 * d, vocab)
        self.steps = steps

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        memory, (h, c) = self.encoder(self.embed(src))
        h, c = h[-1], c[-1]
        token = torch.zeros(src.shape[0], dtype=torch.long)
        context = memory.mean(1)
        logits = []
        for _ in range(self.steps):
            h, c = self.cell(torch.cat([self.embed(token), context], -1), (h, c))
            weights = torch.softmax(torch.bmm(memory, h.unsqueeze(2)).squeeze(2), -1)
            context = torch.bmm(weights.unsqueeze(1), memory).squeeze(1)
            logits.append(self.out(torch.cat([h, context], -1)))
            token = logits[-1].argmax(-1)
        return torch.stack(logits, 1)


class RandomOps(nn.Module):
    """Draws random numbers as torchlens' toy models do: ``randn_like``, ``rand`` and dropout in training
    mode (in an eval model), beside a deterministic output."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        noisy = (h + 0.1 * torch.randn_like(h)) * torch.rand(h.shape)
        return self.out(h), F.dropout(noisy, 0.5, training=True)


class BarlowTwins(nn.Module):
    """BarlowTwins' loss, as its authors wrote it: two views through one projector, each standardised by
    ``Tensor.std``, their cross-correlation, and a loss on its diagonal and (a flatten-and-view trick) off-diagonal."""

    def __init__(self, d: int = 8, width: int = 16) -> None:
        super().__init__()
        self.projector = nn.Sequential(nn.Linear(d, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        za, zb = self.projector(a), self.projector(b)
        za = (za - za.mean(0)) / za.std(0)
        zb = (zb - zb.mean(0)) / zb.std(0)
        c = za.T @ zb / a.shape[0]
        on = (torch.diagonal(c) - 1).pow(2).sum()
        n = c.shape[0]
        off = c.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten().pow(2).sum()
        return on + 0.005 * off


class GumbelCodes(nn.Module):
    """A discrete bottleneck as in a dVAE: logits over a codebook, a ``gumbel_softmax`` sample of them (hard,
    straight-through), the codes it picks decoded; the logits returned beside, which no draw reaches."""

    def __init__(self, d: int = 8, codes: int = 6) -> None:
        super().__init__()
        self.encoder = nn.Linear(d, codes)
        self.codebook = nn.Linear(codes, d, bias=False)
        self.decoder = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.encoder(x)
        sample = F.gumbel_softmax(logits, tau=0.5, hard=True)
        return logits, self.decoder(torch.relu(self.codebook(sample)))


class LazyNet(nn.Module):
    """Built from its first input: lazy layers (``nn.LazyConv2d``, ``nn.LazyBatchNorm2d``, ``nn.LazyLinear``), and
    a head and a buffer sized from that input's width and made in the first call, as a fresh detector sets up."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.LazyConv2d(8, 3, padding=1)
        self.norm = nn.LazyBatchNorm2d()
        self.fc = nn.LazyLinear(8)
        self.head: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
            self.head = nn.Linear(8, 4)
        h = self.fc(torch.relu(self.norm(self.conv(x))).mean((2, 3)))
        return self.head(torch.relu(h) * self.scale)


class CellLoop(nn.Module):
    """torch's ``nn.LSTMCell`` example: a cell stepped over the sequence from a given state, each step's h stacked."""

    def __init__(self, d: int = 10, hidden: int = 20) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(d, hidden)

    def forward(self, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor) -> torch.Tensor:
        output = []
        for step in x:
            hx, cx = self.cell(step, (hx, cx))
            output.append(hx)
        return torch.stack(output, dim=0)


def _zoo(name: str) -> Callable[[], Built]:
    def build() -> Built:
        import zoo

        model, inputs = zoo.ZOO[name]()
        return model, inputs, {}

    return build


def _own(make: Callable[[], nn.Module], *inputs: Callable[[], Any]) -> Callable[[], Built]:
    def build() -> Built:
        return make().eval(), tuple(i() for i in inputs), {}

    return build


# -- the rows: transformers from small configs ---------------------------------------------------------------
def _ids(length: int = 8, vocab: int = 100, padded: bool = True) -> dict[str, torch.Tensor]:
    """Token ids and a padded attention mask: transformers drops an all-ones mask in eager mode only."""
    mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        mask[1, length - 3 :] = 0
    return {"input_ids": torch.randint(1, vocab, (2, length)), "attention_mask": mask}


def _left_padded_ids(length: int = 8, vocab: int = 100) -> dict[str, torch.Tensor]:
    """Token ids padded on the left, as batched generation pads: with the causal mask, the padded
    sequence's first query rows see no key at all (a fully masked row, which eager
    ``scaled_dot_product_attention`` gives as 0)."""
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :3] = 0
    return {"input_ids": torch.randint(1, vocab, (2, length)), "attention_mask": mask}


def _hf(model_cls: str, config_cls: str, inputs: Callable[[], dict[str, Any]], **config: Any) -> Callable[[], Built]:
    def build() -> Built:
        import transformers

        transformers.logging.set_verbosity_error()
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
        return model.eval(), (), inputs()

    return build


_SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
          "vocab_size": 100, "max_position_embeddings": 32}
_SEQ2SEQ = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
            "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 100,
            "max_position_embeddings": 32}


def _pixels(size: int = 32) -> Callable[[], dict[str, Any]]:
    return lambda: {"pixel_values": torch.randn(1, 3, size, size)}


def _seq2seq_ids() -> dict[str, Any]:
    return {**_ids(), "decoder_input_ids": torch.randint(1, 100, (2, 5))}


CORPUS: list[Case] = [
    Case("bert", _hf("BertModel", "BertConfig", _ids, **_SMALL), family="transformers"),
    Case("gpt2", _hf("GPT2Model", "GPT2Config", _ids, n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                     n_positions=32), family="transformers"),  # use_cache on, as shipped
    Case("t5", _hf("T5Model", "T5Config", _seq2seq_ids, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   vocab_size=100), family="transformers"),
    Case("bart", _hf("BartModel", "BartConfig", _seq2seq_ids, **_SEQ2SEQ), family="transformers"),
    Case("opt", _hf("OPTModel", "OPTConfig", _ids, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    ffn_dim=64, word_embed_proj_dim=32, vocab_size=100, max_position_embeddings=32),
         family="transformers"),
    Case("llama", _hf("LlamaModel", "LlamaConfig", _ids, **_SMALL, num_key_value_heads=2), family="transformers"),
    Case("whisper", _hf("WhisperModel", "WhisperConfig",
                        lambda: {"input_features": torch.randn(1, 16, 32), "decoder_input_ids": torch.tensor([[1, 2, 3]])},
                        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                        max_source_positions=16, max_target_positions=16, vocab_size=100, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
         family="transformers"),
    Case("vit", _hf("ViTModel", "ViTConfig", _pixels(), **{**_SMALL, "image_size": 32, "patch_size": 8}),
         family="transformers"),
    Case("swin", _hf("SwinModel", "SwinConfig", _pixels(), image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                     num_heads=[2, 2], window_size=4), family="transformers"),
    Case("clip", _hf("CLIPModel", "CLIPConfig", lambda: {**_ids(), **_pixels()()},
                     text_config={**_SMALL}, vision_config={**_SMALL, "image_size": 32, "patch_size": 8},
                     projection_dim=16), family="transformers"),
    Case("wav2vec2", _hf("Wav2Vec2Model", "Wav2Vec2Config", lambda: {"input_values": torch.randn(1, 400)},
                         **{**_SMALL, "conv_dim": (16, 16), "conv_kernel": (10, 3), "conv_stride": (5, 2),
                            "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4}),
         family="transformers"),
    Case("mamba", _hf("MambaModel", "MambaConfig", lambda: {"input_ids": torch.randint(1, 100, (1, 8))},
                      hidden_size=32, num_hidden_layers=2, state_size=4, vocab_size=100, use_mambapy=True),
         family="transformers"),
    # Decoders on left-padded batches (one layer): the fully masked query rows of the padding
    Case("llama_left", _hf("LlamaModel", "LlamaConfig", _left_padded_ids,
                           **{**_SMALL, "num_hidden_layers": 1}, num_key_value_heads=2), family="transformers", repeats="llama"),
    Case("opt_left", _hf("OPTModel", "OPTConfig", _left_padded_ids, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32, vocab_size=100,
                         max_position_embeddings=32), family="transformers", repeats="opt"),
    Case("gpt2_left", _hf("GPT2Model", "GPT2Config", _left_padded_ids, n_embd=32, n_layer=1, n_head=4,
                          vocab_size=100, n_positions=32), family="transformers", repeats="gpt2"),
    Case("resnetish", _zoo("resnetish")),
    Case("densenetish", _zoo("densenetish")),
    Case("unetish", _zoo("unetish")),
    Case("transformer_encoder", _zoo("transformer_encoder"),  # nn.MultiheadAttention's fast path under no_grad
         exporter_fails={"torchscript": "aten::_native_multi_head_attention"}),
    Case("lstm_tagger", _zoo("lstm_tagger")),
    Case("embed_conv_lstm", _own(EmbedConvLSTM, lambda: torch.randint(0, 50, (2, 7)))),
    Case("seq2seq", _own(lambda: Seq2Seq(vocab=50, d=16, steps=4), lambda: torch.randint(0, 50, (2, 6)))),
    Case("detector", _own(TinyDetector, lambda: [torch.rand(3, 30, 26), torch.rand(3, 28, 32)])),
    Case("random_ops", _own(RandomOps, lambda: torch.randn(2, 8)), draws=r"(^|\.)(randn_like|rand|dropout)$"),
    Case("gumbel", _own(GumbelCodes, lambda: torch.randn(4, 8)), draws=r"(^|\.)gumbel_softmax$",
         exporter_fails={"torchscript": "exponential"}),
    Case("barlow_twins", _own(BarlowTwins, lambda: torch.randn(4, 8), lambda: torch.randn(4, 8))),
    Case("lazy", _own(LazyNet, lambda: torch.randn(2, 3, 8, 8)), fresh=True),
    Case("cell_loop", _own(CellLoop, lambda: torch.randn(6, 3, 10), lambda: torch.randn(3, 20),
                           lambda: torch.randn(3, 20))),
    # A decoder returning its sliding-window cache, as shipped: the file returns more outputs than the trace
    # (TorchScript's one int64 more per layer). Its layers are LLaMA's, renamed: the pictures are llama's
    Case("mistral", _hf("MistralModel", "MistralConfig", lambda: {"input_ids": torch.randint(1, 100, (1, 6))},
                        **{**_SMALL, "num_hidden_layers": 2}, num_key_value_heads=4, use_cache=True),
         family="transformers", repeats="llama"),
]


# -- the rows for make bench-real: torchvision and timm -------------------------------------------------------
def torchvision_classification() -> list[str]:
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def torchvision_model(name: str, size: int | None = None) -> Callable[[], Built]:
    """A torchvision classifier on one image of its size (299 px for Inception v3, else 224)."""
    side = size or (299 if name == "inception_v3" else 224)

    def build() -> Built:
        import torchvision

        return torchvision.models.get_model(name, weights=None).eval(), (torch.randn(1, 3, side, side),), {}

    return build


def torchvision_detection(name: str, size: int = 320) -> Callable[[], Built]:
    """A torchvision detector on one image, keeping every detection whatever its score.

    With random weights no score passes the default thresholds: the model would return no boxes,
    and onnxruntime's outputs would agree with eager's whatever the file computes (Faster R-CNN's
    TorchScript export returns boxes up to 64 px off eager's, unseen at the default threshold).
    Its BatchNorms get the statistics of a few images (:func:`calibrate_batchnorm`): with a fresh
    norm's, SSDlite's scores all tie and no reference can say which boxes an export should keep.
    """
    def build() -> Built:
        import torchvision

        keep_all = {"box_score_thresh": 0.0} if "rcnn" in name else {"score_thresh": 0.0}
        model = torchvision.models.get_model(name, weights=None, weights_backbone=None, **keep_all).eval()
        images = [torch.rand(3, size, size) for _ in range(4)]
        vary_constant_weights(model)  # before the statistics are taken: it moves the norms' weights and biases
        calibrate_batchnorm(model, images)
        return model, (images[:1],), {}

    return build


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, *args: Any) -> None:
    """Set every BatchNorm's running statistics to those of one forward on ``args``, as training leaves them.

    A fresh BatchNorm's statistics (mean 0, variance 1) do not match what reaches it: through the
    many BatchNorms of a randomly initialized detector the activations vanish (SSDlite's to about
    1e-13), every class score comes out 1/91, and which of the hundreds of boxes tied at that score
    a TopK keeps is each runtime's own choice, so no reference could judge the export. Statistics
    of real inputs give each layer a trained network's scale. ``args`` should hold a batch of a few
    images: on a 1x1 feature map (SSDlite's last extra layers) one image gives one value per channel.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one forward, exactly that forward's statistics
        m.train()
    try:
        model(*args)
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
            m.eval()


def torchvision_segmentation(name: str, size: int = 224) -> Callable[[], Built]:
    def build() -> Built:
        import torchvision

        model = torchvision.models.get_model(name, weights=None, weights_backbone=None).eval()
        return model, (torch.randn(1, 3, size, size),), {}

    return build


def timm_model(name: str) -> Callable[[], Built]:
    def build() -> Built:
        import timm

        model = timm.create_model(name, pretrained=False).eval()
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))
        return model, (torch.randn(1, *size),), {}

    return build


TV_DETECTION = ["fasterrcnn_mobilenet_v3_large_320_fpn", "fasterrcnn_resnet50_fpn", "maskrcnn_resnet50_fpn",
                "retinanet_resnet50_fpn", "fcos_resnet50_fpn", "ssd300_vgg16", "ssdlite320_mobilenet_v3_large",
                "keypointrcnn_resnet50_fpn"]
TV_SEGMENTATION = ["deeplabv3_mobilenet_v3_large", "deeplabv3_resnet50", "fcn_resnet50", "lraspp_mobilenet_v3_large"]
# timm: the smallest member of many families.
TIMM = [
    "vit_tiny_patch16_224", "deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224", "eva02_tiny_patch14_224",
    "swin_tiny_patch4_window7_224", "swinv2_cr_tiny_224", "convnext_atto", "convnextv2_atto",
    "efficientnet_b0", "tf_efficientnet_b0", "mobilenetv3_small_100", "mobilenetv3_large_100",
    "regnetx_002", "regnety_002", "levit_128s", "fastvit_t8", "poolformer_s12", "poolformerv2_s12",
    "mobilevit_xxs", "mobilevitv2_050", "coatnet_nano_rw_224", "coat_lite_tiny", "ghostnet_100", "edgenext_xx_small",
    "resnet18", "resnet50d", "densenet121", "rexnet_100", "tiny_vit_5m_224", "efficientformer_l1",
    "repvit_m1", "pvt_v2_b0", "cait_xxs24_224", "mixer_s16_224", "maxvit_nano_rw_256", "mobilenetv4_conv_small",
    "hgnetv2_b0", "dla34", "convmixer_768_32", "beit_base_patch16_224",
]


def real_cases() -> list[Case]:
    """torchvision (every classification model, detection, segmentation) and timm, for ``make bench-real``.

    Detection and segmentation come first: they are where the defects were found.
    """
    cases = [Case(f"torchvision/{n}", torchvision_detection(n), family="torchvision-detection") for n in TV_DETECTION]
    cases += [Case(f"torchvision/{n}", torchvision_segmentation(n), family="torchvision-segmentation") for n in TV_SEGMENTATION]
    cases += [Case(f"torchvision/{n}", torchvision_model(n), family="torchvision")
              for n in torchvision_classification()]
    cases += [Case(f"timm/{n}", timm_model(n), family="timm") for n in TIMM]
    return cases


# -- the shared work of one model ----------------------------------------------------------------------------
class Run:
    """One model's build, trace, exports and checks, each done once and kept (errors too).

    Every entry point of :data:`ENTRIES` takes a Run; what they share is computed on first use.
    """

    def __init__(self, case: Case, workdir: Path) -> None:
        self.case = case
        self.workdir = Path(workdir)
        self._done: dict[str, Any] = {}

    def _once(self, key: str, compute: Callable[[], Any]) -> Any:
        if key not in self._done:
            try:
                self._done[key] = (True, compute())
            except Exception as e:  # kept so that every cell needing it fails with the same error, once computed
                self._done[key] = (False, e)
        ok, value = self._done[key]
        if not ok:
            raise value
        return value

    def _built(self) -> Built:
        def build() -> Built:
            model, args, kwargs = self._made()
            # One plain forward first, kept as the eager reference: a model may set itself up in its first
            # call (torchvision's MultiScaleRoIAlign computes its scales then), and every trace and export
            # must start from the state later calls see, or two traces of one model would differ.
            with torch.no_grad():
                self._done["eager"] = (True, model(*args, **kwargs))
            return model, args, kwargs

        return self._once("build", build)

    def _made(self) -> Built:
        """The row's model made, not called yet, and its inputs: the same weights and random state each time, so
        that a lazy layer's first call builds the same weights."""
        torch.manual_seed(0)
        model, args, kwargs = self.case.build()
        vary_constant_weights(model)
        return model, args, kwargs

    @property
    def model(self) -> nn.Module:
        return self._built()[0]

    @property
    def args(self) -> tuple[Any, ...]:
        return self._built()[1]

    @property
    def kwargs(self) -> dict[str, Any]:
        return self._built()[2]

    def path(self, name: str) -> Path:
        return self.workdir / name

    @contextlib.contextmanager
    def unbuilt(self) -> Iterator[nn.Module]:
        """The model as the exports and checks get it: for a ``fresh`` row a copy made but never called, its
        first call drawing the weights the shared model's did (checked when the block ends); else the shared model."""
        if not self.case.fresh:
            yield self.model
            return
        self._built()
        model = self._made()[0]  # made again: a lazy layer's weights cannot be copied before they are built
        yield model
        built, shared = model.state_dict(), self.model.state_dict()
        assert built.keys() == shared.keys() and all(torch.equal(built[k], shared[k]) for k in built), (
            "the fresh copy built other weights than the shared model: something drew random numbers before its first call")

    @property
    def graph(self) -> fwdtrace.Graph:
        return self._once("trace", lambda: self.trace())

    def trace(self) -> fwdtrace.Graph:
        with torch.no_grad():
            return fwdtrace.trace(self.model, *self.args, **self.kwargs)

    @property
    def eager(self) -> Any:
        self._built()
        return self._done["eager"][1]

    def exported(self, exporter: str) -> Path:
        """The model exported to a file the public way: ``export_onnx(path=...)`` or ``to_onnx(path=...)``."""
        def export() -> Path:
            path = self.path(f"{exporter}.onnx")
            before = self.graph.to_json()
            state = module_state(self.model)
            with self.unbuilt() as model, torch.no_grad():
                if exporter == "fwdtrace":
                    fwdtrace.to_onnx(model, *self.args, path=path, **self.kwargs)
                else:
                    fwdtrace.export_onnx(model, *self.args, exporter=exporter, path=str(path), **self.kwargs)
            if model is self.model:
                assert_left_as_found(self, state, before, f"exporting with {exporter!r}")
            else:  # a model never called: left as its first plain call leaves it (the shared model)
                assert {p: a.keys() for p, a in module_state(model).items()} == {p: a.keys() for p, a in state.items()}, (
                    f"exporting with {exporter!r} a model never called left it otherwise than a plain first call")
                with torch.no_grad():
                    assert fwdtrace.trace(model, *self.args, **self.kwargs).to_json() == before, (
                        f"after exporting with {exporter!r} a model never called, its trace differs from the shared model's")
            return path

        return self._once(f"export:{exporter}", export)

    def check(self, exporter: str) -> fwdtrace.TopologyReport:
        """``check_onnx(model, ..., exporter=exporter)``, its export being the one :meth:`exported` wrote.

        check_onnx exports exactly as export_onnx / to_onnx do (the same call into the exporter), so
        the corpus hands it that model instead of exporting it a second time: the dynamo export
        of a small transformer is seconds. Everything after the export is check_onnx's own.
        """
        return self._checked(exporter, numeric=False)

    def check_numeric(self, exporter: str) -> fwdtrace.TopologyReport:
        """``check_onnx(model, ..., exporter=exporter, numeric=True)``, handed the file as :meth:`check` is."""
        return self._checked(exporter, numeric=True)

    def _checked(self, exporter: str, numeric: bool) -> fwdtrace.TopologyReport:
        def check() -> fwdtrace.TopologyReport:
            import onnx

            from fwdtrace.onnx import compare, emit

            proto = onnx.load(str(self.exported(exporter)))
            exported = lambda *args, **kwargs: proto  # noqa: E731
            with mock.patch.object(compare, "_export", exported), mock.patch.object(emit, "to_onnx", exported), \
                    self.unbuilt() as model, torch.no_grad():
                return fwdtrace.check_onnx(model, *self.args, exporter=exporter, numeric=numeric, **self.kwargs)

        return self._once(f"{'numeric' if numeric else 'check'}:{exporter}", check)

    def runs_like_eager(self, exporter: str, tolerances: Mapping[str, tuple[float, float]] | None = None
                        ) -> tuple[bool, str]:
        """Whether onnxruntime on the exported file gives eager's outputs, and where not, how; the outputs
        the report on that file declares left out (a cache the exporter could not export) excepted.

        Without ``tolerances``, within float32 tolerance, and the outputs that depend on random draws
        (:meth:`drawn_outputs`) by their shapes and dtypes only: does the file compute what eager does.
        With a numeric report's ``tolerances`` (dtype -> rtol, atol), every output within them: are
        onnxruntime's numbers eager's.
        """
        def agrees() -> tuple[bool, str]:
            drawn = set() if tolerances is not None else self.drawn_outputs()
            return ort_agrees(self.exported(exporter), self, self.compared(exporter).left_out, drawn, tolerances)

        return self._once(f"ort:{exporter}:{tolerances is not None}", agrees)

    def drawn_outputs(self) -> set[int]:
        """The eager outputs (positions in ``leaves(eager, caches=True)``) that a forward under another seed
        changes: those that depend on random draws. Only for a row that declares draws, which must have some."""
        def drawn() -> set[int]:
            if not self.case.draws:
                return set()
            torch.manual_seed(12345)
            with torch.no_grad():
                again = list(leaves(self.model(*self.args, **self.kwargs), caches=True))
            first = list(leaves(self.eager, caches=True))
            changed = {k for k, (a, b) in enumerate(zip(first, again, strict=True)) if not torch.equal(a, b)}
            assert changed, f"the row declares draws ({self.case.draws!r}), but a forward under another seed " \
                            "gives the same outputs"
            return changed

        return self._once("drawn", drawn)

    def compared(self, exporter: str) -> fwdtrace.TopologyReport:
        return self._once(f"compare:{exporter}", lambda: fwdtrace.compare_onnx(self.graph, self.exported(exporter)))


def module_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``vars()`` of every module, each entry of its ``_parameters`` and ``_buffers`` one more (``"_parameters:weight"``):
    an exporter that swaps a parameter keeps the dict and changes what it holds."""
    return {p: {**vars(m), **{f"{kind}:{k}": t for kind in ("_parameters", "_buffers") for k, t in vars(m)[kind].items()}}
            for p, m in model.named_modules()}


def assert_left_as_found(run: Run, state: dict[str, dict[str, Any]], trace_json: str, what: str) -> None:
    """Nothing ``what`` set on the model remains, and a new trace is the trace before (``trace_json``).

    The reference is what a plain forward leaves (``state``: ``vars()`` of every module before):
    each module keeps its attributes, and each is the object it was, unless the model's own forward
    replaces it at every call (torchvision's AnchorGenerator sets ``cell_anchors`` to a new list of
    the same tensors): then it must hold what a plain forward puts there, alike in type and value.
    """
    after = module_state(run.model)
    assert after.keys() == state.keys(), f"{what} changed the modules: {sorted(after.keys() ^ state.keys())[:5]}"
    replaced = []
    for p, attrs in state.items():
        assert after[p].keys() == attrs.keys(), f"{what} left attributes on {p or 'the model'}: {sorted(after[p].keys() ^ attrs.keys())}"
        replaced += [(p, k) for k, v in attrs.items() if after[p][k] is not v]
    if replaced:
        with torch.no_grad():
            run.model(*run.args, **run.kwargs)
        eager_state = module_state(run.model)
        for p, k in replaced:
            eager = eager_state[p][k]
            assert eager is not after[p][k], f"{what} replaced attributes of {p or 'the model'}: {k!r}, which a plain forward keeps"
            assert alike(after[p][k], eager), (
                f"{what} left {describe(after[p][k])} in {p or 'the model'}.{k}, where a plain forward leaves {describe(eager)}")
    assert run.trace().to_json() == trace_json, f"after {what}, a trace of the model differs from the trace before"


def alike(a: Any, b: Any) -> bool:
    """The same types all the way down (no tensor subclass or wrapper for a tensor) and equal values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device) and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(alike(a[k], b[k]) for k in a)
    return bool(a == b)


def describe(obj: Any) -> str:
    if isinstance(obj, (list, tuple)):
        return f"a {type(obj).__name__} of [{', '.join(describe(x) for x in obj[:3])}{', ...' if len(obj) > 3 else ''}]"
    if isinstance(obj, torch.Tensor):
        return f"a {type(obj).__name__} {tuple(obj.shape)} {obj.dtype}"
    return repr(obj)[:80]


@torch.no_grad()
def vary_constant_weights(model: nn.Module) -> None:
    """Give every all-equal weight and statistic (a fresh norm's ones and zeros) some spread, as training would.

    Freshly built norms are all alike: an exporter may then merge two of them on one input
    (LeViT's two heads), which it could not do on a trained model.
    """
    gen = torch.Generator().manual_seed(1)
    for t in list(model.parameters()) + list(model.buffers()):
        if torch.nn.parameter.is_lazy(t):
            continue  # a lazy layer's weights, built in its first call
        if t.is_floating_point() and t.numel() > 1 and bool((t == t.flatten()[0]).all()):
            t.add_(0.1 * torch.rand(t.shape, generator=gen).to(t.dtype))


# -- independent references ----------------------------------------------------------------------------------
def leaves(obj: Any, caches: bool = False) -> Iterator[torch.Tensor]:
    """The tensors a user sees in inputs and outputs: inside tuples, lists, dicts (ModelOutput) and dataclasses;
    ``caches=True`` (a model's outputs, as the trace returns them) also transformers' KV caches
    (``past_key_values``).

    Caches stay closed elsewhere: a hook sees the cache object after the forward updated it, so a
    layer's "input" cache would show the keys and values that layer itself added.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from leaves(v, caches)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from leaves(v, caches)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from leaves(getattr(obj, f.name), caches)
    elif caches and type(obj).__module__ == "transformers.cache_utils":  # a returned KV cache: its layers' tensors
        for v in vars(obj).values():
            yield from leaves(v, caches)


def hook_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, dict[str, list[list[int]]]]:
    """Plain forward hooks on every module, keyed by path and class name, first call of each."""
    out: dict[str, dict[str, list[list[int]]]] = {}
    handles = []
    for path, m in model.named_modules():
        key = f"{path}.{type(m).__name__}" if path else type(m).__name__

        def hook(mod: nn.Module, a: tuple, kw: dict, result: Any, key: str = key) -> None:
            out.setdefault(key, {"input_shape": [list(t.shape) for t in leaves((a, kw))],
                                 "output_shape": [list(t.shape) for t in leaves(result)]})

        handles.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return out


def hook_calls(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, int]:
    """How many times plain forward hooks see each module (by path) called in one forward."""
    calls: dict[str, int] = {}
    handles = [m.register_forward_hook(lambda *_, p=path: calls.__setitem__(p, calls.get(p, 0) + 1))
               for path, m in model.named_modules(remove_duplicate=False)]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _input_names(run: Run) -> dict[str, torch.Tensor]:
    """The exporters' names for the example's tensors: forward's parameter names, keywords by their
    keys, the items of a list input as ``name_0``, ``name_1``."""
    params = [p.name for p in inspect.signature(run.model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named: dict[str, torch.Tensor] = {}
    for name, value in [*zip(params, run.args, strict=False), *run.kwargs.items()]:
        if isinstance(value, torch.Tensor):
            named[name] = value
        elif isinstance(value, (list, tuple)):
            named.update((f"{name}_{i}", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor))
    return named


def cache_field(out: Mapping[str, Any]) -> str:
    """The field of a transformers model's output that holds its cache: ``cache`` since transformers 5.24,
    ``past_key_values`` (Mamba: ``cache_params``) before; output names and report labels start with it."""
    from transformers.cache_utils import Cache

    (name,) = [key for key, value in out.items() if isinstance(value, Cache)]
    return name


def output_at(out: Any, path: str) -> Any:
    """What ``path`` (``cache_params.layers[0].conv_states[0]``, ``['a b']``) names in a model's output,
    by attribute, key and index."""
    import ast

    for attr, key in re.findall(r"(?:^|\.)([A-Za-z_]\w*)|\[([^\]]+)\]", path):
        if attr:
            out = out[attr] if isinstance(out, Mapping) and attr in out else getattr(out, attr)
        else:
            out = out[ast.literal_eval(key)]
    return out


def _left_out(run: Run, left_out: list[str]) -> set[int]:
    """Which eager outputs (by position in ``leaves(run.eager, caches=True)``) the labels name: each must name
    one tensor of a returned cache, no two the same."""
    expected = list(leaves(run.eager, caches=True))
    plain = {id(t) for t in leaves(run.eager)}
    skipped = set()
    for label in left_out:
        tensor = output_at(run.eager, label)
        at = [k for k, t in enumerate(expected) if t is tensor]
        assert len(at) == 1 and id(tensor) not in plain, (
            f"declared left out, {label!r} names no tensor of a returned cache in eager's outputs")
        assert at[0] not in skipped, f"{label!r} declared left out twice"
        skipped.add(at[0])
    return skipped


def _ort_feed(session: Any, run: Run) -> dict[str, Any]:
    """The example's tensors for an onnxruntime session's inputs: by name, else in order."""
    names = [i.name for i in session.get_inputs()]
    named, given = _input_names(run), list(leaves((run.args, run.kwargs)))
    if all(n in named for n in names):
        return {n: named[n].numpy() for n in names}
    assert len(names) == len(given), f"ONNX inputs {names} for the {len(given)} tensors given"
    return {n: t.numpy() for n, t in zip(names, given, strict=True)}


def ort_agrees(path: Path, run: Run, left_out: list[str] | None = None, drawn: set[int] | None = None,
               tolerances: Mapping[str, tuple[float, float]] | None = None) -> tuple[bool, str]:
    """onnxruntime on an exported file against eager: the eager outputs must come out, in order, among
    the ONNX outputs (which may hold more: the tensors of caches), within float32 tolerance, or within
    ``tolerances`` (a numeric report's: dtype -> rtol, atol).

    ``left_out`` (a report's) names the outputs the file does not return: only the tensors of a
    returned cache may be named, and the file must then return exactly the others. ``drawn``: eager
    outputs (positions, as :meth:`Run.drawn_outputs`) compared by shape and dtype only.
    """
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    results = session.run(None, _ort_feed(session, run))
    skipped = _left_out(run, left_out or [])
    kept = [k for k in range(len(list(leaves(run.eager, caches=True)))) if k not in skipped]
    expected = [t for k, t in enumerate(leaves(run.eager, caches=True)) if k not in skipped]
    if skipped and len(results) != len(expected):
        return False, (f"{len(skipped)} outputs declared left out, but the file returns {len(results)} outputs "
                       f"for the other {len(expected)}")
    return outputs_agree([torch.from_numpy(r) for r in results], expected,
                         {i for i, k in enumerate(kept) if k in (drawn or set())}, tolerances)


def outputs_agree(results: list[torch.Tensor], expected: list[torch.Tensor], drawn: set[int] | None = None,
                  tolerances: Mapping[str, tuple[float, float]] | None = None) -> tuple[bool, str]:
    """Whether the ``expected`` (eager) outputs come out, in order, among ``results``, within float32 tolerance.

    A detector's outputs (boxes, scores, labels: one row per detection, sorted by score) may come
    out with rows swapped where eager's scores tie within that same tolerance: the exported
    arithmetic differs from eager's by float rounding, and a sort by values equal up to rounding
    has no one order (RetinaNet with random weights: scores 0.0265497 and 0.0265493 swap in
    onnxruntime). Such a swap must be the same in every output of the group (a row moves whole),
    and only between rows whose 1-dim float output (the scores) is equal within the tolerance.
    ``drawn`` (positions in ``expected``) are compared by shape and dtype only; with ``tolerances``
    (dtype -> rtol, atol: a numeric report's) each output is compared within them, rows in order.
    """
    k = r = 0
    while k < len(expected) and r < len(results):
        group = _row_group(expected, k)
        if k in (drawn or set()) and (results[r].shape, results[r].dtype) == (expected[k].shape, expected[k].dtype):
            k, r = k + 1, r + 1
        elif tolerances is not None:
            k, r = (k + 1, r + 1) if within(results[r], expected[k], tolerances) else (k, r + 1)
        elif _all_close(results[r], expected[k]):
            k, r = k + 1, r + 1
        elif r + len(group) <= len(results) and _rows_permuted(results[r:r + len(group)], group):
            k, r = k + len(group), r + len(group)
        else:
            r += 1
    if k == len(expected):
        return True, ""
    return False, (f"{k} of the {len(expected)} eager outputs found in order; the next, "
                   f"{list(expected[k].shape)}, is not among the {len(results)} ONNX outputs"
                   + (" within the report's tolerance" if tolerances is not None else ""))


def within(got: Any, want: Any, tolerances: Mapping[str, tuple[float, float]]) -> bool:
    """A numeric report's test, computed here: same shape, ``max|got - want| <= atol + rtol * max|want|``
    with the (rtol, atol) of ``want``'s dtype; integers and booleans exactly."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    if tuple(got.shape) != tuple(want.shape):
        return False
    if not want.is_floating_point():
        return bool(torch.equal(got.to(want.dtype), want))
    rtol, atol = tolerances.get(str(want.dtype).removeprefix("torch."), (0.0, 0.0))
    if not want.numel():
        return True
    diff = (got.double() - want.double()).abs().max()
    return bool(diff <= atol + rtol * want.double().abs().max())  # NaN on either side: False


def parted(got: Any, want: Any, tolerances: Mapping[str, tuple[float, float]]) -> bool:
    """Whether some float element of ``got`` differs from ``want``'s by more than ten times the rtol of ``want``'s
    dtype, relative to the larger magnitude of the two: where a numeric report says values start to part."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    if tuple(got.shape) != tuple(want.shape) or not want.is_floating_point() or not want.numel():
        return False
    rtol = tolerances.get(str(want.dtype).removeprefix("torch."), (0.0, 0.0))[0]
    g, w = got.double(), want.double()
    return bool(((g - w).abs() > 10 * rtol * torch.maximum(g.abs(), w.abs())).any())


def _all_close(got: torch.Tensor, want: torch.Tensor, like: torch.Tensor | None = None) -> bool:
    """``got`` equals ``want`` within the tolerance of the output ``like`` (``want`` itself by default)."""
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return False
    if not want.is_floating_point():
        return bool((got == want).all())
    return torch.allclose(got, want, rtol=1e-3, atol=_atol(want if like is None else like))


def _atol(want: torch.Tensor) -> float:
    # float32 rounding grows with the values summed: the absolute tolerance scales with the output's
    # largest magnitude (torchvision's FCN at 224 px: outputs up to 82, onnxruntime within 2.7e-4)
    scale = float(want.abs().max()) if want.numel() else 1.0
    return 1e-4 * max(1.0, scale / 10)


def _row_group(expected: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """The outputs from ``expected[k]`` on that have rows of one length: a detector's boxes, scores, labels."""
    rows = expected[k].shape[0] if expected[k].dim() else None
    group = [expected[k]]
    while rows is not None and k + len(group) < len(expected) and expected[k + len(group)].dim() \
            and expected[k + len(group)].shape[0] == rows:
        group.append(expected[k + len(group)])
    return group


def _rows_permuted(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Whether ``got`` is ``want`` with rows swapped only between rows whose scores tie (see :func:`outputs_agree`)."""
    if any(tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype for g, w in zip(got, want, strict=True)):
        return False
    keys = [w for w in want if w.dim() == 1 and w.is_floating_point()]
    if not keys or want[0].shape[0] < 2:  # no scores to rank by (a scalar output: a cache's sliding window)
        return False
    n = want[0].shape[0]
    ties = torch.ones(n, n, dtype=torch.bool)  # ties[i, j]: eager's rows i and j have equal scores within tolerance
    for key in keys:
        ties &= (key[:, None] - key[None, :]).abs() <= _atol(key) + 1e-3 * key[None, :].abs()
    taken: set[int] = set()
    for i in range(n):
        candidates = sorted((j for j in ties[i].nonzero().flatten().tolist() if j not in taken), key=lambda j: abs(j - i))
        row = next((j for j in candidates
                    if all(_all_close(g[j], w[i], like=w) for g, w in zip(got, want, strict=True))), None)
        if row is None:
            return False
        taken.add(row)
    return True


def members_of(agraph: Any) -> dict[int, str]:
    """node id -> the DOT node whose box holds it; each node id in exactly one box."""
    node2box: dict[int, str] = {}
    for n in agraph.nodes():
        for part in str(n.attr.get("fwdtrace_members")).split():
            a, _, b = part.partition("-")
            for i in range(int(a), int(b or a) + 1):
                assert i not in node2box, f"node {i} is in two boxes: {node2box[i]} and {n}"
                node2box[i] = str(n)
    return node2box


def assert_nothing_lost(graph: fwdtrace.Graph, dot: Any) -> int:
    """Every node in exactly one box; the drawn edges are those of the graph contracted by box
    (an edge between two boxes wherever the graph has one between their members: the quotient
    graph, computed from the edges directly; networkx's ``quotient_graph`` took 85 of the 98 s of
    an ONNX picture cell on RetinaNet). Returns the number of boxes."""
    import pygraphviz

    agraph = pygraphviz.AGraph(string=dot.source)
    node2box = members_of(agraph)
    assert sorted(node2box) == [n.id for n in graph.nodes], "some nodes are in no box"
    contracted = {(node2box[u], node2box[v]) for u, v in graph.to_networkx().edges() if node2box[u] != node2box[v]}
    drawn = [(str(u), str(v)) for u, v in agraph.edges() if agraph.get_edge(u, v).attr.get("style") != "invis"]
    assert len(drawn) == len(set(drawn)), "two edges between one pair of boxes"
    assert set(drawn) == contracted, "the drawn edges are not the graph's contracted by box"
    return len(agraph.nodes())


def side_boxes(dot: Any) -> dict[int, bool]:
    """node id -> whether its box is a dashed side-computation box."""
    import pygraphviz

    agraph = pygraphviz.AGraph(string=dot.source)
    out = {}
    for n in agraph.nodes():
        side = "dashed" in str(n.attr.get("style") or "")
        for part in str(n.attr.get("fwdtrace_members")).split():
            a, _, b = part.partition("-")
            out.update({i: side for i in range(int(a), int(b or a) + 1)})
    return out


def png_size(path: str | Path) -> tuple[int, int]:
    data = Path(path).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    return width, height


def assert_svg(path: str | Path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg", f"{path} is not an SVG"
    return root


def _levels(graph: fwdtrace.Graph) -> int:
    return max((len(n.scope) for n in graph.nodes), default=0) + 1  # depth `levels` collapses nothing


def _boxes(dot: Any) -> int:
    return sum(1 for line in dot.source.splitlines() if "fwdtrace_members=" in line)


def png_exporter(run: Run) -> str:
    """The exporter whose ONNX pictures a row also draws as PNG (the others as SVG only), and whose file it
    hands to ``check_onnx(onnx=...)``: one per row, in turn.

    A PNG is the SVG's layout rasterised by cairo, seconds for a large picture where the SVG takes
    milliseconds; what a PNG adds (a valid file, the automatic picture within ``MAX_PNG``) does not
    depend on the exporter, so each row checks it on one, and the rows together on all three. So
    does reading a file given to ``check_onnx`` (a trace and a comparison more per cell).
    """
    rows = [case.name for case in CORPUS]
    exporting = [x for x in EXPORTERS if x not in run.case.exporter_fails] or list(EXPORTERS)
    return exporting[rows.index(run.case.name) % len(exporting) if run.case.name in rows else 0]


def _assert_readable_auto_picture(graph: fwdtrace.Graph, stem: Path, png: bool = True) -> None:
    """The automatic picture: nothing lost, at least min(30, full detail) boxes, within the README's bounds
    (its PNG's size where ``png``)."""
    from fwdtrace.passes.draw import MAX_PNG, TARGET_NODES

    if png:
        png_path = graph.render(stem.with_suffix(".png"))  # first: the layout that measured the picture draws it
    dot = graph.to_dot()
    boxes = assert_nothing_lost(graph, dot)
    full = _boxes(graph.to_dot(None))
    caption = re.search(r'label="([^"]*\(auto[^"]*)"', dot.source)
    assert boxes >= min(AUTO_MIN_BOXES, full), (
        f"the automatic picture shows {boxes} boxes, fewer than min({AUTO_MIN_BOXES}, {full} at full detail)"
        f" ({caption.group(1) if caption else 'no caption'})")
    assert boxes <= TARGET_NODES, f"{boxes} boxes, over the target of {TARGET_NODES}"
    if png:
        width, height = png_size(png_path)
        assert width <= MAX_PNG[0] and height <= MAX_PNG[1], f"PNG of {width}x{height} px, over {MAX_PNG}"
    assert_svg(graph.render(stem.with_suffix(".svg")))


# -- the entry points ----------------------------------------------------------------------------------------
def _trace(run: Run) -> None:
    graph = run.graph
    ids = [n.id for n in graph.nodes]
    assert ids == list(range(len(ids))) and graph.input_nodes and graph.output_nodes
    assert all(0 <= e.src < len(ids) and 0 <= e.dst < len(ids) for e in graph.edges)
    # Layers: each module node is a module of the model, called as many times as plain hooks count.
    modules = dict(run.model.named_modules(remove_duplicate=False))
    calls = hook_calls(run.model, run.args, run.kwargs)
    recorded: dict[str, int] = {}
    for n in graph.find(kind="module"):
        assert n.module_path in modules, f"module node {n.name} at {n.module_path!r}, not a module of the model"
        assert type(modules[n.module_path]).__name__ == n.class_name
        recorded[n.module_path] = recorded.get(n.module_path, 0) + 1
    wrong = {p: (k, calls.get(p, 0)) for p, k in recorded.items() if calls.get(p, 0) != k}
    assert not wrong, f"module nodes per path differ from the calls plain hooks saw (traced, hooked): {wrong}"
    # The outputs: the tensors the model returned, with their shapes.
    traced = sorted(tuple(r.shape) for n in graph.output_nodes for r in n.inputs)
    eager = sorted(tuple(t.shape) for t in leaves(run.eager, caches=True))
    assert traced == eager, f"output shapes {traced} differ from eager's {eager}"


def _render_auto(run: Run) -> None:
    _assert_readable_auto_picture(run.graph, run.path("auto"))


def _render_depths(run: Run) -> None:
    """Every depth drawn, nothing lost; as SVG at every depth, as PNG at depth 0 (the same layout rasterised:
    the automatic picture's PNG is render_auto's, a picture over cairo's bitmap limit test_draw's)."""
    graph = run.graph
    for depth in range(0, _levels(graph) + 1):
        assert_nothing_lost(graph, graph.to_dot(depth))
        if depth == 0:
            png_size(graph.render(run.path(f"depth{depth}.png"), depth=depth))
        assert_svg(graph.render(run.path(f"depth{depth}.svg"), depth=depth))


def _declared_failure(run: Run, exporter: str, call: Callable[[], Any]) -> bool:
    """True (and checked) where the row declares that ``exporter`` cannot export this model."""
    why = run.case.exporter_fails.get(exporter)
    if why is None:
        return False
    try:
        call()
    except fwdtrace.FwdtraceError as e:
        text = str(e)
        named = "to_onnx()" if exporter == "fwdtrace" else f"the {exporter} ONNX exporter failed"
        assert named in text, f"the error does not name the {exporter} exporter: {text[:500]}"
        assert re.search(why, text), f"the {exporter} exporter failed otherwise than declared ({why!r}): {text[:500]}"
        return True
    raise AssertionError(f"declared to fail with {exporter} ({why!r}), but it did not: update the corpus row")


def _check_onnx(exporter: str) -> Callable[[Run], None]:
    def entry(run: Run) -> None:
        if _declared_failure(run, exporter, lambda: run.check(exporter)):
            return
        report = run.check(exporter)
        # The reference: the export run in onnxruntime. An export that computes something else must
        # not be ok (the TorchScript exporter drops writes through views); one that computes what
        # eager does must be, or the check cries wolf.
        agrees, why = run.runs_like_eager(exporter)
        if not agrees:
            assert not report.ok, f"check_onnx(exporter={exporter!r}) is ok on an export that differs from eager: {why}"
            return
        assert report.ok, (
            f"check_onnx(exporter={exporter!r}) is not ok: {_summary(report)}\n{str(report)[:3000]}")

    return entry


def _check_numeric(exporter: str) -> Callable[[Run], None]:
    def entry(run: Run) -> None:
        if _declared_failure(run, exporter, lambda: run.check_numeric(exporter)):
            return
        report = run.check_numeric(exporter)
        numeric = report.numeric
        assert numeric is not None
        text = f"{numeric.lead()}\n" + "\n".join(numeric.table())
        # The reference: onnxruntime's outputs on the file against eager's, within the report's own
        # tolerances. ok exactly when they agree; where they do not, the divergence it names must be
        # where the difference starts (checked against eager hooks and onnxruntime's own values).
        agrees, why = run.runs_like_eager(exporter, numeric.tolerances)
        first = numeric.first_divergence
        if agrees:
            assert report.ok and first is None, (
                f"check_onnx(exporter={exporter!r}, numeric=True) is {report.status} while onnxruntime gives "
                f"eager's outputs within its tolerance:\n{text}")
            return
        assert not report.ok, (
            f"check_onnx(exporter={exporter!r}, numeric=True) is {report.status} while onnxruntime's outputs "
            f"differ from eager's: {why}\n{text}")
        assert_draws_declared(run, report)
        if first is None:  # only values after random draws differ: not compared, and the status says so
            drawn_only, why = run.runs_like_eager(exporter)
            assert numeric.random and report.status == "incomplete" and drawn_only, (
                f"check_onnx(exporter={exporter!r}, numeric=True) is {report.status}, naming no divergence, while "
                f"onnxruntime's outputs differ from eager's: {why}\n{text}")
            return
        assert_divergence_starts_there(run, exporter, report)

    return entry


def numeric_lead(run: Run, entry: str) -> str | None:
    """The one-line answer of the numeric check an entry ``numeric[x]`` made, where it made one."""
    match = re.fullmatch(r"numeric\[(\w+)\]", entry)
    done = run._done.get(f"numeric:{match.group(1)}") if match else None
    if not done or not done[0] or done[1].numeric is None:
        return None
    return str(done[1].numeric.lead())


def assert_draws_declared(run: Run, report: fwdtrace.TopologyReport) -> None:
    """Each call a numeric report names as drawing random numbers is one the row declares."""
    numeric = report.numeric
    assert numeric is not None
    for drawn in numeric.random:
        assert run.case.draws and re.search(run.case.draws, drawn.target), (
            f"{drawn.call} is said to draw random numbers; the row declares {run.case.draws or 'no draw'!r}:\n"
            f"{numeric.lead()}\n" + "\n".join(numeric.table()))


def assert_divergence_starts_there(run: Run, exporter: str, report: fwdtrace.TopologyReport) -> None:
    """The first divergence a numeric report names is a call whose inputs agree and whose output does not.

    Checked independently of the report's pairing: the call's inputs and output as plain hooks (a
    module) or a TorchFunctionMode (a torch function) see them in a forward of their own, against
    every value onnxruntime computes in the file (an input agrees when some ONNX value equals it
    within the report's tolerance). A call neither can see (a torchvision op) is checked through
    the report's eager value of its output and the rows of the calls the trace says feed it.
    """
    numeric = report.numeric
    assert numeric is not None
    first = numeric.first_divergence
    assert first is not None
    text = f"{numeric.lead()}\n" + "\n".join(numeric.table())
    tols = numeric.tolerances
    values = ort_values(run.exported(exporter), run)
    if first.kind == "missing":  # a call the export dropped (a write through a view): a real call, fed agreeing values
        seen = eager_call(run, first, None)
        assert seen is not None, f"{first.call}, missing from the file, is no call a forward of its own sees:\n{text}"
        _assert_computed(first, seen[0], values, tols, text)
        return
    assert first.kind in ("module", "function", "output"), (
        f"the first divergence is a structural {first.kind}: {first.note}\n{text}")
    name = first.onnx_value.split(", ")[0]
    assert name in values, f"the first divergence's ONNX value {name!r} is not a value of the file"
    reported = numeric.eager.get(name)
    seen = eager_call(run, first, reported)
    if seen is None:  # not a module nor a torch function: the report's eager value, and its inputs' rows
        assert reported is not None, f"no eager value kept for {first.call}"
        assert parted(values[name], reported, tols) if first.parts else not within(values[name], reported, tols), (
            f"{first.call} is the first divergence, but onnxruntime's {name} equals its eager value:\n{text}")
        assert first.inputs_rel is not None and first.inputs_rel <= sum(tols.get(first.inputs_dtype or first.dtype, (0, 0))), (
            f"{first.call} is the first divergence, but its inputs are off by {first.inputs_rel}:\n{text}")
        return
    inputs, outputs = seen
    # a value within tolerance as a whole named where its elements start to part: some of them, to their own magnitude
    assert any(parted(values[name], out, tols) for out in outputs) if first.parts else not any(
        within(values[name], out, tols) for out in outputs), (
        f"{first.call} is the first divergence, but onnxruntime's {name} equals its eager output:\n{text}")
    _assert_computed(first, inputs, values, tols, text)


def _assert_computed(first: Any, inputs: list[torch.Tensor], values: dict[str, Any],
                     tols: Mapping[str, tuple[float, float]], text: str) -> None:
    """Each float input of the call is a value onnxruntime computes in the file (reshaped alike), within ``tols``."""
    by_numel: dict[int, list[Any]] = {}
    for value in values.values():
        by_numel.setdefault(int(value.size), []).append(value)
    for k, x in enumerate(inputs):
        if not x.is_floating_point():
            continue  # a mask or an index: an exporter may carry it in another dtype (a float additive mask)
        if k == 0 and first.target.endswith(".copy_"):
            continue  # copy_ overwrites its destination: it reads the source only
        found = any(within(torch.from_numpy(v).reshape(x.shape), x, tols) for v in by_numel.get(x.numel(), ())
                    if str(v.dtype) == str(x.dtype).removeprefix("torch."))
        assert found, (f"{first.call} is named the first divergence, but its input {k} {list(x.shape)} is no value "
                       f"onnxruntime computes (within the report's tolerance): the difference starts before it\n{text}")


def ort_values(path: Path, run: Run) -> dict[str, Any]:
    """Every value onnxruntime computes running the file on the example, by name: node outputs, graph
    inputs and initializers (numpy arrays), the graph run as written (no fusion)."""
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import numpy_helper

    def compute() -> dict[str, Any]:
        proto = onnx.load(str(path))
        names = [o for n in proto.graph.node for o in n.output if o]
        known = {o.name for o in proto.graph.output}
        proto.graph.output.extend(onnx.ValueInfoProto(name=o) for o in dict.fromkeys(names) if o not in known)
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        session = onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feed = _ort_feed(session, run)
        out = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
        # the example's tensors, those the file reads and those it does not (an export may drop an input)
        out.update({f"example input {k}": t.numpy() for k, t in enumerate(leaves((run.args, run.kwargs)))})
        out.update(feed)
        got = zip([o.name for o in session.get_outputs()], session.run(None, feed), strict=True)
        out.update((name, value) for name, value in got if isinstance(value, np.ndarray))  # not a sequence's list
        return out

    return run._once(f"ort-values:{path}", compute)


def eager_call(run: Run, row: Any, reported: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The inputs and outputs of the call a numeric report's ``row`` names, as a forward of its own sees them:
    a module's by plain forward hooks, a torch function's by a TorchFunctionMode (within the module the row
    names). Of several calls, the one whose output is the report's eager value (``reported``); None where
    no call matches (a function torch does not dispatch, a value not kept)."""
    from torch.overrides import TorchFunctionMode

    def flat(obj: Any) -> list[torch.Tensor]:
        return [t.detach().clone() for t in leaves(obj)]

    seen: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    short = row.target.rsplit(".", 1)[-1]
    modules = dict(run.model.named_modules())
    path: list[str] = []

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            result = func(*args, **(kwargs or {}))
            if getattr(func, "__name__", "") == short and path and path[-1] == row.module_path:
                seen.append((flat((args, kwargs)), flat(result)))
            return result

    handles = []
    if row.kind == "module":
        module = modules.get(row.module_path)
        if module is None:
            return None
        handles.append(module.register_forward_hook(
            lambda m, a, kw, out: seen.append((flat((a, kw)), flat(out))), with_kwargs=True))
    else:
        def leave(*_: Any) -> None:  # a forward hook that returns a value replaces the output
            path.pop()

        for p, m in modules.items():
            handles.append(m.register_forward_pre_hook(lambda *_, p=p: path.append(p)))
            handles.append(m.register_forward_hook(leave))
    try:
        with torch.no_grad(), (Calls() if row.kind != "module" else contextlib.nullcontext()):
            run.model(*run.args, **run.kwargs)
    finally:
        for h in handles:
            h.remove()
    if reported is None:  # a call the export dropped: the trace's name counts the calls of its target (copy, copy_1)
        name = row.call.split(" = ")[0]
        suffix = name.rsplit("_", 1)[-1] if " = " in row.call else ""
        index = int(suffix) if suffix.isdigit() and name != row.target.rsplit(".", 1)[-1] else 0
        return seen[index] if len(seen) == 1 or (row.kind == "missing" and index < len(seen)) else None
    want = torch.from_numpy(reported)
    return next(((i, o) for i, o in seen if any(t.shape == want.shape and torch.equal(t.to(want.dtype), want)
                                                for t in o)), None)


def _summary(report: fwdtrace.TopologyReport) -> str:
    """The counts and the first differences of a report, on one line."""
    first = (report.missing[:2] + report.extra[:2] + report.rewired[:2])
    return (f"{len(report.missing)} missing, {len(report.extra)} extra, {len(report.rewired)} rewired; "
            + " | ".join(" ".join(x.split()) for x in first))


def _opened_classes(report: fwdtrace.TopologyReport) -> set[str]:
    return {c.rsplit(".", 1)[-1] for c in report.opened}


def _compare_file(exporter: str) -> Callable[[Run], None]:
    def entry(run: Run) -> None:
        if _declared_failure(run, exporter, lambda: run.exported(exporter)):
            return
        path = run.exported(exporter)
        compared, checked = run.compared(exporter), run.check(exporter)
        counts = lambda r: (r.ok, len(r.missing), len(r.extra), len(r.rewired))  # noqa: E731
        opened = _opened_classes(checked)
        # compare_onnx must not report as missing what check_onnx opens (it cannot open a graph alone).
        cried = [m for m in compared.missing if any(f"({c})" in m for c in opened)]
        assert not cried, f"compare_onnx reports as missing layers check_onnx opens ({sorted(opened)}): {cried[:5]}"
        if not opened:
            assert counts(compared) == counts(checked), (
                f"compare_onnx on the exported file (ok, missing, extra, rewired) {counts(compared)} disagrees with "
                f"check_onnx {counts(checked)}:\n{str(compared)[:1500]}")
        if exporter != png_exporter(run):  # check_onnx(onnx=file): each row on one exporter's file, in turn
            return
        with run.unbuilt() as model, torch.no_grad():  # the file given to check_onnx itself
            given = fwdtrace.check_onnx(model, *run.args, onnx=path, **run.kwargs)
        assert counts(given) == counts(checked), (
            f"check_onnx(onnx=file) {counts(given)} disagrees with check_onnx(exporter={exporter!r}) "
            f"{counts(checked)}:\n{str(given)[:1500]}")

    return entry


def _side_by_side(exporter: str) -> Callable[[Run], None]:
    def entry(run: Run) -> None:
        if _declared_failure(run, exporter, lambda: run.exported(exporter)):
            return
        path = run.exported(exporter)
        if exporter == png_exporter(run):
            png_size(fwdtrace.render_side_by_side(run.graph, path, run.path(f"side_{exporter}.png")))
        root = assert_svg(fwdtrace.render_side_by_side(run.graph, path, run.path(f"side_{exporter}.svg")))
        titles = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}title")]
        assert any(t.startswith("t_") for t in titles) and any(t.startswith("o_") for t in titles)
        # The ONNX side draws its data path: the ops matched to the trace's layers are not folded away as
        # side computations. The side-by-side draws the pruned graph at its automatic depth; checked at full
        # depth, which bounds it: a shallower depth only collapses side ops into module boxes, so every op
        # in a side box at that depth is in one at full depth too.
        og = fwdtrace.onnx_graph(path, prune=True)
        side = side_boxes(og.to_dot(None))
        name2id = {str(n.meta.get("onnx_name", n.name)): n.id for n in og.nodes}
        layers = [names for label, names in run.compared(exporter).matched
                  if " = " not in label and not label.startswith(("input ", "output"))]
        on_path = [names for names in layers if any(not side.get(name2id.get(x, -1), True) for x in names)]
        assert len(on_path) * 2 >= len(layers), (
            f"only {len(on_path)} of the {len(layers)} layers matched in ONNX are on the ONNX side's data path; "
            f"the others are drawn inside side-computation boxes")

    return entry


def _onnx_graph(exporter: str) -> Callable[[Run], None]:
    def entry(run: Run) -> None:
        if _declared_failure(run, exporter, lambda: run.exported(exporter)):
            return
        _assert_readable_auto_picture(fwdtrace.onnx_graph(run.exported(exporter)), run.path(f"onnx_{exporter}"),
                                      png=exporter == png_exporter(run))

    return entry


def _to_onnx(run: Run) -> None:
    if _declared_failure(run, "fwdtrace", lambda: run.exported("fwdtrace")):
        return
    agrees, why = run.runs_like_eager("fwdtrace")
    assert agrees, f"onnxruntime on to_onnx's model differs from eager: {why}"


def _analyze(run: Run) -> None:
    analysis = fwdtrace.analyze(run.model, *run.args, warmup=1, repeats=1, **run.kwargs)
    params = list(run.model.parameters())  # shared parameters once
    assert analysis.params == sum(p.numel() for p in params)
    assert analysis.trainable_params == sum(p.numel() for p in params if p.requires_grad)
    unknown = {r.key for r in analysis.rows} - set(fwdtrace.module_keys(run.model))
    assert not unknown, f"rows under keys that are not module keys: {sorted(unknown)[:5]}"


def _probe_shapes(run: Run) -> None:
    model = run.model
    keys = fwdtrace.module_keys(model)
    expected = {f"{p}.{type(m).__name__}" if p else type(m).__name__ for p, m in model.named_modules()}
    assert set(keys) == expected and len(keys) == len(expected) and keys[-1] == type(model).__name__
    position = {k: i for i, k in enumerate(keys)}
    for p, m in model.named_modules():  # children before their parents
        for c, child in m.named_children():
            key = f"{p}.{c}" if p else c
            if f"{key}.{type(child).__name__}" in position:
                parent = f"{p}.{type(m).__name__}" if p else type(m).__name__
                assert position[f"{key}.{type(child).__name__}"] < position[parent]
    with fwdtrace.Probe(model) as probe:
        shapes = probe.shapes(*run.args, **run.kwargs)
    reference = hook_shapes(model, run.args, run.kwargs)
    assert list(shapes.items()) == list(reference.items()), (
        f"Probe.shapes differs from plain forward hooks at "
        f"{[k for k in {**shapes, **reference} if shapes.get(k) != reference.get(k)][:5]}")


def _live_svg(run: Run) -> None:
    from fwdtrace.live.svg import graph_svg

    root = ET.fromstring(graph_svg(run.graph))
    keys = [g.get("data-key") for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("data-key")]
    unknown = set(keys) - set(fwdtrace.module_keys(run.model))
    assert not unknown, f"boxes keyed by names that are not module keys: {sorted(unknown)[:5]}"
    module_boxes = [g for g in root.iter("{http://www.w3.org/2000/svg}g")
                    if g.get("class") == "node" and g.get("data-key")]
    assert module_boxes or not run.graph.find(kind="module"), "no layer box of the live page carries its key"
    for g in module_boxes:  # on its own module's box: the draw pass's tooltip starts with the module path
        a = g.find(".//{http://www.w3.org/2000/svg}a")
        tooltip = "" if a is None else a.get("{http://www.w3.org/1999/xlink}title", "")
        path = g.get("data-key", "").rsplit(".", 1)[0]
        assert tooltip.startswith(path + " "), f"box keyed {g.get('data-key')!r} has the tooltip {tooltip[:80]!r}"


def _json(run: Run) -> None:
    text = run.graph.to_json()
    back = fwdtrace.Graph.from_json(text)
    assert back == run.graph and back.to_json() == text
    assert run.trace().to_json() == text, "a second trace of the same model and inputs gives other JSON"


ENTRIES: dict[str, Callable[[Run], None]] = {
    "trace": _trace,
    "render_auto": _render_auto,
    "render_depths": _render_depths,
    **{f"check_onnx[{x}]": _check_onnx(x) for x in EXPORTERS},
    **{f"numeric[{x}]": _check_numeric(x) for x in EXPORTERS},
    **{f"compare_file[{x}]": _compare_file(x) for x in EXPORTERS},
    **{f"side_by_side[{x}]": _side_by_side(x) for x in EXPORTERS},
    **{f"onnx_graph[{x}]": _onnx_graph(x) for x in EXPORTERS},
    "to_onnx": _to_onnx,
    "analyze": _analyze,
    "probe_shapes": _probe_shapes,
    "live_svg": _live_svg,
    "json": _json,
}


# entry points whose invariants depend on the architecture only (its pictures), not on the inputs
PICTURE_ENTRIES = frozenset({"render_auto", "render_depths", "live_svg",
                             *(f"{e}[{x}]" for e in ("side_by_side", "onnx_graph") for x in EXPORTERS)})


def runs(case: Case, entry: str) -> bool:
    """Whether ``entry`` runs on ``case``: all do, but a row that repeats another's architecture leaves it the pictures."""
    return not (case.repeats and entry in PICTURE_ENTRIES)


def run_entry(run: Run, entry: str) -> None:
    """Run one entry point on one model, other libraries' warnings silenced (they are not the invariants)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ENTRIES[entry](run)
