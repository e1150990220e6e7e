"""Cost of check_onnx(numeric=True) against torch's own verification, on BERT, GPT-2 and ResNet-50.

    python benchmarks/onnx_numeric.py [--repeats 3] [--model resnet50 --model bert ...]

Per model, on one dynamo export (``torch.onnx.export(..., dynamo=True)``; a TorchScript one
for T5, on which the dynamo exporter fails in this torch), medians over the repeats of:

- ``export``: the export alone; ``eager``: one forward; ``ort``: one onnxruntime
  session made and run once (default optimizations). ``baseline`` is their sum: what a
  user pays to export and try the file once.
- ``verify``: ``torch.onnx.verification.verify_onnx_program`` on that export: the outputs
  of the ExportedProgram against onnxruntime's. ``--intermediates`` passes
  ``compare_intermediates=True`` (every FX value; it runs onnxruntime once per value: on
  ResNet-50 it had not finished after 9 minutes on two loaded cores). It takes a dynamo
  export's ``ONNXProgram``: none for a TorchScript export.
- ``check file``: ``fwdtrace.check_onnx(model, x, onnx=proto, numeric=True)`` on that export's
  model: trace, structural comparison, one eager run and one onnxruntime run with the
  matched values as extra outputs.
- ``check``: ``fwdtrace.check_onnx(model, x, exporter=..., numeric=True)``, export included, with the
  row's exporter.

The target: ``check`` costs at most 2x ``baseline``. What each tool reports is printed
beside the times: values compared, and whether a value is named by module path.
Exits 1 when the target is missed or an honest export is reported as diverging.
"""

from __future__ import annotations

import argparse
import inspect
import io
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_models import ResNet50
from torch import nn

import fwdtrace

TARGET = 2.0  # check / (export + eager + ort)


def _bert() -> tuple[nn.Module, tuple, dict]:
    import transformers

    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024)  # BERT-small (Turc et al.'s 4x256)
    return transformers.BertModel(config).eval(), (), {"input_ids": torch.randint(0, 30522, (1, 128))}


def _gpt2() -> tuple[nn.Module, tuple, dict]:
    import transformers

    config = transformers.GPT2Config(use_cache=False)  # GPT-2 small: 12 layers, 768 wide, 124 M parameters
    return transformers.GPT2LMHeadModel(config).eval(), (torch.randint(0, 50257, (1, 64)),), {}


def _t5_encoder() -> tuple[nn.Module, tuple, dict]:
    import transformers

    config = transformers.T5Config(d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_heads=8)  # T5-mini-sized
    return transformers.T5EncoderModel(config).eval(), (torch.randint(0, 32128, (1, 64)),), {}


def _vit() -> tuple[nn.Module, tuple, dict]:
    import transformers

    config = transformers.ViTConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                                    intermediate_size=1536)  # ViT-S/16-sized, half depth
    return transformers.ViTModel(config).eval(), (torch.randn(1, 3, 224, 224),), {}


MODELS: dict[str, tuple[str, Callable[[], tuple[nn.Module, tuple, dict]]]] = {
    "resnet50": ("ResNet-50 1x3x224x224", lambda: (ResNet50().eval(), (torch.randn(1, 3, 224, 224),), {})),
    "bert": ("BERT-small 4x256, 1x128 tokens", _bert),
    "gpt2": ("GPT-2 small 12x768, 1x64 tokens", _gpt2),
    "t5": ("T5 encoder 4x256, 1x64 tokens", _t5_encoder),
    "vit": ("ViT 6x384, 1x3x224x224", _vit),
}
# the dynamo exporter fails on T5 in this torch (a view of [1, 64, 8, 32] as (1, 64, 256)): TorchScript's export
EXPORTER: dict[str, str] = {"t5": "torchscript"}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def ort_once(proto: Any, feeds: dict[str, Any]) -> Any:
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def export(model: nn.Module, args: tuple, kwargs: dict, exporter: str) -> tuple[Any, Any]:
    """(the ONNX model, the dynamo export's ONNXProgram or None), from torch.onnx.export itself."""
    import onnx

    if exporter == "dynamo":
        program = torch.onnx.export(model, args, kwargs=kwargs or None, dynamo=True, verbose=False)
        return program.model_proto, program
    buffer = io.BytesIO()
    # forward's parameter names, as fwdtrace.export_onnx gives them: TorchScript's own are input.1, ...
    names = [*list(inspect.signature(model.forward).parameters)[:len(args)], *kwargs]
    torch.onnx.export(model, args, buffer, kwargs=kwargs or None, dynamo=False, input_names=names)
    return onnx.load_from_string(buffer.getvalue()), None


def measure(model: nn.Module, args: tuple, kwargs: dict, repeats: int, intermediates: bool,
            exporter: str = "dynamo") -> dict[str, Any]:
    from torch.onnx.verification import verify_onnx_program

    times: dict[str, list[float]] = {}
    seen: dict[str, Any] = {"verify result": None}
    with torch.no_grad():
        model(*args, **kwargs)  # warm-up: kernel selection
    for _ in range(repeats):
        t, (proto, program) = timed(lambda: export(model, args, kwargs, exporter))
        times.setdefault("export", []).append(t)
        with torch.no_grad():
            times.setdefault("eager", []).append(timed(lambda: model(*args, **kwargs))[0])
        names = [i.name for i in proto.graph.input]
        feeds = {n: v.numpy() for n, v in zip(names, [*args, *kwargs.values()], strict=True)}
        times.setdefault("ort", []).append(timed(lambda p=proto, f=feeds: ort_once(p, f))[0])
        if program is not None:
            t, infos = timed(lambda p=program: verify_onnx_program(p, compare_intermediates=intermediates))
            times.setdefault("verify", []).append(t)
            seen["verify result"] = infos
        t, report = timed(lambda p=proto: fwdtrace.check_onnx(model, *args, onnx=p, numeric=True, **kwargs))
        times.setdefault("check file", []).append(t)
        seen["check file report"] = report
        t, report = timed(lambda: fwdtrace.check_onnx(model, *args, exporter=exporter, numeric=True, **kwargs))
        times.setdefault("check", []).append(t)
        seen["check report"] = report
        print("  " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), file=sys.stderr, flush=True)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    out["baseline"] = out["export"] + out["eager"] + out["ort"]
    out.update(seen)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", action="append", choices=tuple(MODELS))
    parser.add_argument("--intermediates", action="store_true",
                        help="verify_onnx_program(compare_intermediates=True): every FX value (slow)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    header = (f"{'model':44s} {'export s':>9s} {'eager s':>8s} {'ort s':>6s} {'baseline s':>11s} {'verify s':>9s} "
              f"{'check file s':>13s} {'check s':>8s} {'check/baseline':>15s}")
    print(header)
    print("-" * len(header))
    met, honest, reports = True, True, []
    for key in args.model or ["resnet50", "bert", "gpt2"]:
        label, factory = MODELS[key]
        model, margs, mkwargs = factory()
        exporter = EXPORTER.get(key, "dynamo")
        if exporter != "dynamo":
            label += f" ({exporter})"
        try:
            r = measure(model, margs, mkwargs, args.repeats, args.intermediates, exporter)
        except Exception as e:  # torch's exporter failing on a model is a row, not the end of the run
            lines = str(e).strip().splitlines()
            print(f"{label:44s} {exporter} export failed: {type(e).__name__}: {lines[-1][:120] if lines else ''}")
            continue
        ratio = r["check"] / r["baseline"]
        met &= ratio <= TARGET
        report = r["check report"]
        honest &= report.numeric is not None and report.numeric.first_divergence is None
        verify = f"{r['verify']:9.2f}" if "verify" in r else f"{'-':>9s}"
        print(f"{label:44s} {r['export']:9.2f} {r['eager']:8.3f} {r['ort']:6.2f} {r['baseline']:11.2f} "
              f"{verify} {r['check file']:13.2f} {r['check']:8.2f} {ratio:14.2f}x")
        reports.append((label, r))
    print()
    print("what each reports:")
    for label, r in reports:
        infos = r["verify result"]
        worst = max(infos, key=lambda i: i.max_rel_diff) if infos else None
        verify = ("not available: it takes a dynamo export's ONNXProgram" if infos is None else
                  f"{len(infos)} values by FX name (worst {worst.name if worst else '-'}, "
                  f"max rel {worst.max_rel_diff if worst else 0:.1e}); no module path, no first divergence")
        numeric = r["check report"].numeric
        compared = sum(1 for row in numeric.rows if row.compared) if numeric is not None else 0
        named = sum(1 for row in numeric.rows if row.compared and row.module_path) if numeric is not None else 0
        print(f"  {label}:")
        print(f"    verify_onnx_program: {verify}")
        print(f"    check_onnx(numeric=True): {compared} values compared, {named} named by module path; "
              f"{numeric.lead() if numeric is not None else ''}")
    print(f"check within {TARGET:.0f}x of export + eager + onnxruntime everywhere: {'yes' if met else 'NO'}")
    if not honest:
        print("an honest export was reported as diverging")
    return 0 if met and honest else 1


if __name__ == "__main__":
    sys.exit(main())
