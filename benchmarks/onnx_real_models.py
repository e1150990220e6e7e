"""check_onnx on real models, built from their configs with random weights (offline): ok or DIFF per exporter.

    python benchmarks/onnx_real_models.py run --family torchvision [--start 0 --stop 20] [--only NAME ...]
        [--exporter dynamo --exporter torchscript] [--out results.jsonl]
    python benchmarks/onnx_real_models.py table [--out results.jsonl]

``run`` appends one JSON line per (model, exporter) to ``--out`` (default
``benchmarks/onnx_real_models.jsonl``), so a long run can go in chunks; ``table`` prints
the Markdown table of the latest line per (model, exporter): per family and exporter, how
many exports the exporter completed, how many of those ``check_onnx`` calls ``ok``, the
DIFF models with their counts, and the exporter failures, listed separately.

Needs torchvision, timm and transformers beside fwdtrace; with the CPU build of torch that
``make`` installs, torchvision's wheel does not import (see docs/benchmarks.md
for the separate virtual environment this was run in).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import corpus  # noqa: E402  (the model factories the conformance suite uses: one list of real models)

import fwdtrace  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "onnx_real_models.jsonl")
EXPORTERS = ("dynamo", "torchscript")
Factory = Callable[[], tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]]

# transformers: (config class, model class, config overrides, input kind)
_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
_DEC = {**_SMALL, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64}
TRANSFORMERS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "bert": ("BertConfig", "BertModel", {**_SMALL, "vocab_size": 100}, "ids"),
    "roberta": ("RobertaConfig", "RobertaModel", {**_SMALL, "vocab_size": 100}, "ids"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", {**_SMALL, "vocab_size": 100}, "ids"),
    "distilbert": ("DistilBertConfig", "DistilBertModel", {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128,
                                                           "vocab_size": 100}, "ids"),
    "albert": ("AlbertConfig", "AlbertModel", {**_SMALL, "embedding_size": 32, "vocab_size": 100}, "ids"),
    "electra": ("ElectraConfig", "ElectraModel", {**_SMALL, "embedding_size": 32, "vocab_size": 100}, "ids"),
    "deberta-v2": ("DebertaV2Config", "DebertaV2Model", {**_SMALL, "vocab_size": 100}, "ids"),
    "mobilebert": ("MobileBertConfig", "MobileBertModel", {**_SMALL, "embedding_size": 32, "intra_bottleneck_size": 32,
                                                            "true_hidden_size": 32, "vocab_size": 100}, "ids"),
    "gpt2": ("GPT2Config", "GPT2Model", {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
                                         "n_positions": 64}, "ids"),
    "gpt-neo": ("GPTNeoConfig", "GPTNeoModel", {"hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                                "attention_types": [[["global", "local"], 1]], "vocab_size": 100,
                                                "max_position_embeddings": 64}, "ids"),
    "opt": ("OPTConfig", "OPTModel", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "ffn_dim": 128, "word_embed_proj_dim": 64, "vocab_size": 100,
                                      "max_position_embeddings": 64}, "ids"),
    "llama": ("LlamaConfig", "LlamaModel", _DEC, "ids"),
    "mistral": ("MistralConfig", "MistralModel", _DEC, "ids"),
    "qwen2": ("Qwen2Config", "Qwen2Model", _DEC, "ids"),
    "phi": ("PhiConfig", "PhiModel", _DEC, "ids"),
    "gemma": ("GemmaConfig", "GemmaModel", {**_DEC, "head_dim": 16}, "ids"),
    "t5": ("T5Config", "T5Model", {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                                   "vocab_size": 100}, "seq2seq"),
    "bart": ("BartConfig", "BartModel", {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                                         "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                                         "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 100,
                                         "max_position_embeddings": 64}, "seq2seq"),
    "vit": ("ViTConfig", "ViTModel", {**_SMALL, "image_size": 32, "patch_size": 8}, "pixels32"),
    "swin": ("SwinConfig", "SwinModel", {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1],
                                         "num_heads": [2, 2], "window_size": 4}, "pixels32"),
    "convnext": ("ConvNextConfig", "ConvNextModel", {"hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2},
                 "pixels32"),
    "clip-text": ("CLIPTextConfig", "CLIPTextModel", {**_SMALL, "vocab_size": 100, "max_position_embeddings": 64},
                  "ids"),
    "mamba": ("MambaConfig", "MambaModel", {"hidden_size": 32, "num_hidden_layers": 2, "state_size": 4,
                                            "vocab_size": 100, "use_mambapy": True}, "ids"),
}


def torchvision_models() -> dict[str, Factory]:
    return {f"torchvision/{n}": corpus.torchvision_model(n) for n in corpus.torchvision_classification()}


def timm_models() -> dict[str, Factory]:
    return {f"timm/{n}": corpus.timm_model(n) for n in corpus.TIMM}


def transformers_models() -> dict[str, Factory]:
    import transformers

    def make(config_cls: str, model_cls: str, overrides: dict[str, Any], kind: str) -> Factory:
        def build() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
            config = getattr(transformers, config_cls)(**overrides)
            model = getattr(transformers, model_cls)(config).eval()
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(1, 100, (1, 8), generator=gen)
            if kind == "ids":
                kwargs: dict[str, Any] = {"input_ids": ids}
                if "use_cache" in model.forward.__code__.co_varnames:
                    kwargs["use_cache"] = False
                return model, (), kwargs
            if kind == "seq2seq":
                return model, (), {"input_ids": ids, "decoder_input_ids": ids[:, :4], "use_cache": False}
            return model, (), {"pixel_values": torch.randn(1, 3, 32, 32, generator=gen)}

        return build

    return {f"transformers/{n}": make(*spec) for n, spec in TRANSFORMERS.items()}


FAMILIES = {"torchvision": torchvision_models, "timm": timm_models, "transformers": transformers_models}


def check_one(name: str, factory: Factory, exporters: list[str], out: str) -> None:
    torch.manual_seed(0)
    try:
        model, args, kwargs = factory()
        corpus.vary_constant_weights(model)
    except Exception as e:  # a model this environment cannot build is not the check's fault
        rows = [{"model": name, "exporter": x, "status": "build failed", "why": f"{type(e).__name__}: {e}"[:300]}
                for x in exporters]
        _append(out, rows)
        return
    rows = []
    for exporter in exporters:
        start = time.perf_counter()
        row: dict[str, Any] = {"model": name, "exporter": exporter}
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                report = fwdtrace.check_onnx(model, *args, exporter=exporter, **kwargs)
        except fwdtrace.FwdtraceError as e:
            text = str(e)
            failed = "ONNX exporter failed" in text
            row.update(status="export failed" if failed else "error", why=text[:400])
        except Exception as e:
            row.update(status="error", why=f"{type(e).__name__}: {e}"[:400] + " | " + traceback.format_exc()[-600:])
        else:
            row.update(
                status="ok" if report.ok else "DIFF", missing=len(report.missing), extra=len(report.extra),
                rewired=len(report.rewired), matched=len(report.matched), elided=len(report.elided),
                opened=report.opened, details=report.missing[:5] + report.extra[:5] + report.rewired[:3],
            )
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        print(f"{name:50s} {exporter:12s} {row['status']:14s} {row['seconds']:7.1f}s "
              + (f"m{row.get('missing')} e{row.get('extra')} r{row.get('rewired')}" if row["status"] == "DIFF"
                 else row.get("why", "")[:150]), flush=True)
    _append(out, rows)


def _append(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def table(path: str) -> str:
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            latest[row["model"], row["exporter"]] = row
    lines = ["| family | exporter | models | exported | `ok` | DIFF | export failed | other |",
             "|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for family in FAMILIES:
        for exporter in EXPORTERS:
            rows = [r for (m, x), r in sorted(latest.items()) if m.startswith(family + "/") and x == exporter]
            if not rows:
                continue
            count = {s: sum(1 for r in rows if r["status"] == s) for s in ("ok", "DIFF", "export failed")}
            other = len(rows) - sum(count.values())
            lines.append(f"| {family} | {exporter} | {len(rows)} | {count['ok'] + count['DIFF']} | {count['ok']} "
                         f"| {count['DIFF']} | {count['export failed']} | {other} |")
            for r in rows:
                short = r["model"].split("/", 1)[1]
                if r["status"] == "DIFF":
                    notes.append(f"- DIFF {family}/{short} ({exporter}): {r['missing']} missing, {r['extra']} extra, "
                                 f"{r['rewired']} rewired")
                elif r["status"] != "ok":
                    notes.append(f"- {r['status']} {family}/{short} ({exporter}): {r.get('why', '')[:160]}")
    return "\n".join(lines + [""] + notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--family", choices=FAMILIES, action="append")
    run.add_argument("--only", nargs="*", default=None, help="model names (without the family prefix)")
    run.add_argument("--start", type=int, default=0)
    run.add_argument("--stop", type=int, default=None)
    run.add_argument("--exporter", choices=EXPORTERS, action="append")
    run.add_argument("--out", default=OUT)
    tab = sub.add_parser("table")
    tab.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    if args.command == "table":
        print(table(args.out))
        return 0
    models: dict[str, Factory] = {}
    for family in args.family or list(FAMILIES):
        models.update(FAMILIES[family]())
    names = sorted(models) if args.family is None or len(args.family) > 1 else list(models)
    if args.only:
        names = [n for n in names if n.split("/", 1)[1] in args.only]
    for name in names[args.start:args.stop]:
        check_one(name, models[name], args.exporter or list(EXPORTERS), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
