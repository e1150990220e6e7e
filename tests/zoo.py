"""A small zoo of test models, shared by every test module.

Each factory returns ``(model, example_inputs)`` with the model in eval mode and
seeded weights, small enough that a forward takes milliseconds on a laptop CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        y = self.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return self.relu(y + identity)


class ResNetish(nn.Module):
    """Conv stem, BatchNorm, two residual stages, global pooling, a classifier."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(width, width), BasicBlock(width, 2 * width, stride=2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class DenseNetish(nn.Module):
    """Each layer sees the concatenation of all earlier feature maps."""

    def __init__(self, growth: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(8 + i * growth), nn.ReLU(), nn.Conv2d(8 + i * growth, growth, 3, padding=1))
            for i in range(layers)
        )
        self.head = nn.Linear(8 + layers * growth, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        y = torch.cat(features, 1)
        return self.head(F.adaptive_avg_pool2d(y, 1).flatten(1))


class MobileNetish(nn.Module):
    """Depthwise-separable blocks with ReLU6, as in MobileNet."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 2, 1)
        self.dw = nn.Conv2d(16, 16, 3, 1, 1, groups=16)
        self.pw = nn.Conv2d(16, 24, 1)
        self.act = nn.ReLU6()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.stem(x))
        x = self.act(self.pw(self.act(self.dw(x))))
        return self.fc(self.pool(x).flatten(1))


class UNetish(nn.Module):
    """Down, up (nearest upsampling), skip concatenation, 1x1 head."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec = nn.Conv2d(16, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = F.relu(self.enc(x))
        m = F.relu(self.mid(self.down(e)))
        d = F.relu(self.dec(torch.cat([self.up(m), e], dim=1)))
        return self.head(d)


class EncoderLayer(nn.Module):
    """A pre-norm transformer encoder layer on nn.MultiheadAttention."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class TransformerEncoder(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class HandAttention(nn.Module):
    """Attention written out: projections, matmul, scale, softmax, matmul."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        return self.o(torch.matmul(att, v))


class EmbedNormGelu(nn.Module):
    """Token embeddings plus positions, LayerNorm, a GELU MLP: a BERT embedding head."""

    def __init__(self, vocab: int = 50, d: int = 16, length: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(length, d)
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        h = self.norm(self.tok(ids) + self.pos(positions))
        return self.fc2(F.gelu(self.fc1(h)))


class LSTMTagger(nn.Module):
    def __init__(self, d: int = 8, hidden: int = 12, tags: int = 3) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.head = nn.Linear(hidden, tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out)


class GRUNet(nn.Module):
    def __init__(self, d: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.gru = nn.GRU(d, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


class SharedWeights(nn.Module):
    """One Linear applied twice (weight sharing), with a residual in between."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.act = nn.Tanh()
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.shared(x))
        h = self.act(self.shared(h)) + h
        return self.out(h)


class Chain(nn.Module):
    """``n`` multiplications by a constant: ``n`` function nodes that share the name ``mul`` (for scaling)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x * 1.0001
        return x


class BranchyCNN(nn.Module):
    """A CNN whose forward branches on the input's values: torch.export cannot follow it, an eager trace does.

    Not in ``ZOO``: torch's dynamo exporter fails on it (tests/test_onnx_emit.py shows how).
    """

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bright = nn.Conv2d(width, width, 1)
        self.dark = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.Tanh())
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        h = self.bright(h) if x.mean() > 0 else self.dark(h)
        return self.head(h.mean((2, 3)))


@dataclass
class Output:
    """A ModelOutput-like result: a dataclass holding several tensors."""

    logits: torch.Tensor
    hidden: torch.Tensor


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc(x)
        return {"logits": h, "probs": h.softmax(-1)}


class DataclassOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Output:
        h = self.fc(x)
        return Output(logits=h * 2, hidden=h)


def run_hooked(model: nn.Module, handles: list, *inputs: torch.Tensor) -> None:
    """Run ``model`` once without grad, then remove the hook ``handles`` (a test's plain-hook reference)."""
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()


def _seeded(
    factory: Callable[[], nn.Module], make_inputs: Callable[[], tuple[torch.Tensor, ...]]
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model and its inputs, both drawn after seeding: every call gives the same ones."""
    torch.manual_seed(0)
    model = factory().eval()
    return model, make_inputs()


def resnetish() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(ResNetish, lambda: (torch.randn(1, 3, 16, 16),))


def densenetish() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(DenseNetish, lambda: (torch.randn(1, 3, 16, 16),))


def mobilenetish() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(MobileNetish, lambda: (torch.randn(1, 3, 16, 16),))


def unetish() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(UNetish, lambda: (torch.randn(1, 3, 16, 16),))


def transformer_encoder() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(TransformerEncoder, lambda: (torch.randn(2, 6, 32),))


def hand_attention() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(HandAttention, lambda: (torch.randn(2, 5, 16),))


def embed_norm_gelu() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(EmbedNormGelu, lambda: (torch.randint(0, 50, (2, 8)),))


def lstm_tagger() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(LSTMTagger, lambda: (torch.randn(2, 5, 8),))


def gru_net() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(GRUNet, lambda: (torch.randn(2, 5, 8),))


def shared_weights() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(SharedWeights, lambda: (torch.randn(3, 8),))


# name -> factory; the architectures every cross-check runs on.
ZOO: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "resnetish": resnetish,
    "densenetish": densenetish,
    "mobilenetish": mobilenetish,
    "unetish": unetish,
    "transformer_encoder": transformer_encoder,
    "hand_attention": hand_attention,
    "embed_norm_gelu": embed_norm_gelu,
    "lstm_tagger": lstm_tagger,
    "gru_net": gru_net,
    "shared_weights": shared_weights,
}


# -- gradients beside in-place ops (fwdtrace.instrument.grads) ---------------------------------------------------
INPLACE_KEYS = ("0.Linear", "1.ReLU")  # a layer followed by ReLU(inplace=True), and that ReLU itself


def inplace_mlp() -> tuple[nn.Module, nn.Module]:
    """A Linear followed by ``ReLU(inplace=True)``, and the reference: a deep copy with ``inplace=False``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True),
                          nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    for m in reference.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    return model, reference


def sgd_step(model: nn.Module, loss: torch.Tensor) -> None:
    """One plain SGD step, written out (torch.optim's first use imports torch._dynamo: seconds)."""
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


def inplace_batches(steps: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(5, 6, generator=generator) for _ in range(steps)]


def full_backward_grads(reference: nn.Module, keys: tuple[str, ...] = INPLACE_KEYS) -> tuple[dict[str, list], list]:
    """``{key: [(grad_input, grad_output), ...]}`` filled by torch's own full backward hooks on ``reference``."""
    seen: dict[str, list] = {key: [] for key in keys}
    handles = []
    for key in keys:
        module = reference.get_submodule(key.split(".")[0])

        def hook(m: nn.Module, gin: tuple, gout: tuple, key: str = key) -> None:
            seen[key].append((tuple(None if g is None else g.clone() for g in gin), tuple(g.clone() for g in gout)))

        handles.append(module.register_full_backward_hook(hook))
    return seen, handles
