"""Draw real models with default settings and check that every picture is readable in size.

Builds each model from its config with random weights (nothing is downloaded), traces one
forward, renders PNG and SVG with ``graph.render(path)`` and no other option, and writes a
contact sheet and a table to ``out/real_models/``. Every PNG must be at most 4096 px wide and
16384 px tall, with at most the default target of 250 boxes; the script exits 1 otherwise.

Needs torchvision, transformers and pillow: ``make bench-real`` sets up ``.venv-real`` (torch
2.14.1 with torchvision 0.29.1, the pair that runs on this CPU) and runs it. ``--only NAME``
draws some of the models.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import corpus  # noqa: E402  (the model factories the conformance suite uses: one list of real models)

import fwdtrace  # noqa: E402
from fwdtrace.passes.draw import MAX_PNG, TARGET_NODES

OUT = Path("out/real_models")
Factory = Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]


# -- models of our own: a DETR-like detector and an LSTM seq2seq ------------------------------------------
class DETRish(nn.Module):
    """DETR in small: a ResNet-50 trunk, a 1x1 projection, sine-free learned positions, an
    nn.Transformer over the feature map and object queries, class and box heads."""

    def __init__(self, d: int = 256, queries: int = 100, classes: int = 91) -> None:
        super().__init__()
        import torchvision

        trunk = torchvision.models.resnet50(weights=None)
        self.backbone = nn.Sequential(*list(trunk.children())[:-2])
        self.proj = nn.Conv2d(2048, d, 1)
        self.row = nn.Embedding(50, d // 2)
        self.col = nn.Embedding(50, d // 2)
        self.queries = nn.Embedding(queries, d)
        self.transformer = nn.Transformer(d, 8, num_encoder_layers=6, num_decoder_layers=6, batch_first=True)
        self.cls = nn.Linear(d, classes + 1)
        self.box = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.proj(self.backbone(images))
        b, d, h, w = f.shape
        pos = torch.cat([self.col(torch.arange(w)).unsqueeze(0).expand(h, w, d // 2),
                         self.row(torch.arange(h)).unsqueeze(1).expand(h, w, d // 2)], -1).flatten(0, 1)
        src = f.flatten(2).transpose(1, 2) + pos.unsqueeze(0)
        tgt = self.queries.weight.unsqueeze(0).expand(b, -1, -1)
        hs = self.transformer(src, tgt)
        return {"logits": self.cls(hs), "boxes": self.box(hs).sigmoid()}


# -- the list ------------------------------------------------------------------------------------------------
def _hf(make_model: Callable[[Any], nn.Module], config: str, inputs: Callable[[], dict[str, Any]], **cfg: Any) -> Factory:
    def make() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        import transformers

        transformers.logging.set_verbosity_error()
        return make_model(getattr(transformers, config)(**cfg)).eval(), (), inputs()
    return make


def _tokens(length: int = 16, padded: bool = True) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        mask = torch.ones(2, length, dtype=torch.long)
        if padded:
            mask[1, length - 4 :] = 0  # a padded batch: the mask arithmetic runs
        return {"input_ids": torch.randint(0, 1000, (2, length)), "attention_mask": mask}
    return make


def _models() -> dict[str, Factory]:
    import transformers as tf

    return {
        "resnet50": corpus.torchvision_model("resnet50"),
        "convnext_tiny": corpus.torchvision_model("convnext_tiny"),
        "swin_t": corpus.torchvision_model("swin_t"),
        "maskrcnn_resnet50_fpn": corpus.torchvision_detection("maskrcnn_resnet50_fpn"),
        "fasterrcnn_resnet50_fpn": corpus.torchvision_detection("fasterrcnn_resnet50_fpn"),
        "detr_like": lambda: (DETRish().eval(), (torch.randn(1, 3, 320, 320),), {}),
        "bert_base": _hf(tf.BertModel, "BertConfig", _tokens()),
        "gpt2": _hf(tf.GPT2Model, "GPT2Config", _tokens()),
        "t5_small": _hf(tf.T5Model, "T5Config",
                        lambda: {**_tokens()(), "decoder_input_ids": torch.randint(0, 1000, (2, 8))}),
        "whisper_tiny": _hf(tf.WhisperModel, "WhisperConfig",
                            lambda: {"input_features": torch.randn(1, 80, 3000),
                                     "decoder_input_ids": torch.randint(0, 1000, (1, 8))}),
        "wav2vec2_base": _hf(tf.Wav2Vec2Model, "Wav2Vec2Config", lambda: {"input_values": torch.randn(1, 16000)}),
        "lstm_seq2seq": lambda: (corpus.Seq2Seq().eval(), (torch.randint(0, 1000, (2, 20)),), {}),
    }


def _contact_sheet(rows: list[dict[str, Any]], path: Path, cell: int = 520) -> None:
    """Thumbnails, scaled to fit a cell, with the model's name and figures under each."""
    from PIL import Image, ImageDraw

    Image.MAX_IMAGE_PIXELS = None
    cols = 4
    sheet = Image.new("RGB", (cols * cell, -(-len(rows) // cols) * (cell + 60)), "white")
    draw = ImageDraw.Draw(sheet)
    for k, row in enumerate(rows):
        x, y = (k % cols) * cell, (k // cols) * (cell + 60)
        with Image.open(row["png"]) as im:
            im.thumbnail((cell - 10, cell - 10))
            sheet.paste(im, (x + (cell - im.width) // 2, y + 5))
        draw.text((x + 8, y + cell + 4), row["model"], fill="black")
        draw.text((x + 8, y + cell + 20), f"{row['choice']}, {row['boxes']} boxes", fill="#333333")
        draw.text((x + 8, y + cell + 36), f"{row['png_size'][0]}x{row['png_size'][1]} px", fill="#333333")
    sheet.save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model names to draw (default: all)")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    factories = _models()
    rows = []
    failures = []
    for name, make in factories.items():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(0)
        model, inputs, kwargs = make()
        with torch.no_grad():
            t0 = time.perf_counter()
            graph = fwdtrace.trace(model, *inputs, **kwargs)
            t1 = time.perf_counter()
        png = Path(graph.render(OUT / f"{name}.png"))
        t2 = time.perf_counter()
        graph.render(OUT / f"{name}.svg")
        source = graph.to_dot().source
        boxes = sum(1 for line in source.splitlines() if "fwdtrace_members=" in line)
        caption = next(line for line in source.splitlines() if "(auto, at most" in line)
        choice = caption.split('label="', 1)[1].split(":", 1)[0]
        size = corpus.png_size(png)
        ok = size[0] <= MAX_PNG[0] and size[1] <= MAX_PNG[1] and boxes <= TARGET_NODES
        if not ok:
            failures.append(name)
        rows.append({"model": name, "nodes": len(graph.nodes), "choice": choice, "boxes": boxes,
                     "png_size": size, "trace_s": round(t1 - t0, 2), "render_png_s": round(t2 - t1, 2),
                     "within_bounds": ok, "png": str(png)})
        print(f"{name:26s} {len(graph.nodes):6d} nodes  {choice:16s} {boxes:4d} boxes  {size[0]:5d}x{size[1]:<5d} px  "
              f"trace {t1 - t0:5.1f} s  render {t2 - t1:5.1f} s  {'ok' if ok else 'OUT OF BOUNDS'}", flush=True)
        del model, graph
    (OUT / "summary.json").write_text(json.dumps(rows, indent=1))
    try:
        _contact_sheet(rows, OUT / "contact_sheet.png")
        print("wrote", OUT / "contact_sheet.png")
    except ImportError:
        print("no pillow: contact sheet skipped (pip install pillow)")
    if failures:
        print("out of bounds:", ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
