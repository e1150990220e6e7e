"""torch.onnx (TorchScript), torch.onnx (dynamo) and fwdtrace.to_onnx on the models of issue 12, one run each.

    python benchmarks/onnx_emit.py [--only NAME ...]

For each model (transformers models built from small configs with random weights, a CNN
that branches on its input's values, ``nn.MultiheadAttention`` under ``no_grad``) and
each exporter: did it produce a model, the export's wall time, its node count, and the
largest absolute difference between onnxruntime's outputs and eager PyTorch's on the
example inputs, over the outputs both have (``outputs`` says how many of eager's tensors
the ONNX model returns). Each exporter first exports a tiny model once, so no time here
includes a first call's imports. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

import fwdtrace
from fwdtrace.onnx import export as onnx_export
from fwdtrace.onnx.emit import _named_outputs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from zoo import BranchyCNN  # noqa: E402  (the tests' model: benchmark and tests run the same code)

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]
EXPORTERS = ("torchscript", "dynamo", "fwdtrace")


def _ids(length: int = 8) -> torch.Tensor:
    return torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(0))


def _hf(config: str, model: str, **overrides: Any) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return getattr(transformers, model)(getattr(transformers, config)(**overrides)).eval()


_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
_GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 64}


def _bert() -> Case:
    return _hf("BertConfig", "BertModel", **_SMALL, vocab_size=100), (_ids(),), {}


def _gpt2(use_cache: bool) -> Callable[[], Case]:
    return lambda: (_hf("GPT2Config", "GPT2LMHeadModel", **_GPT2), (_ids(),), {"use_cache": use_cache})


def _t5() -> Case:
    model = _hf("T5Config", "T5Model", d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=100)
    return model, (_ids(),), {"decoder_input_ids": _ids(4)}


def _vit() -> Case:
    model = _hf("ViTConfig", "ViTModel", **_SMALL, image_size=32, patch_size=8)
    return model, (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)),), {}


def _branchy() -> Case:
    torch.manual_seed(0)
    return BranchyCNN(8).eval(), (torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) + 0.1,), {}


def _mha() -> Case:
    torch.manual_seed(0)
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0))
    return nn.MultiheadAttention(64, 4, batch_first=True).eval(), (x, x, x), {"need_weights": False}  # the fast path


MODELS: dict[str, tuple[Callable[[], Case], bool]] = {  # name -> (factory, run under no_grad)
    "BERT (2 layers)": (_bert, False),
    "GPT-2 with cache": (_gpt2(True), False),
    "GPT-2 without cache": (_gpt2(False), False),
    "T5 (decoder_input_ids)": (_t5, False),
    "ViT": (_vit, False),
    "CNN branching on values": (_branchy, False),
    "nn.MultiheadAttention, no_grad": (_mha, True),
}


def export(exporter: str, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if exporter == "fwdtrace":
        return fwdtrace.to_onnx(model, *args, **kwargs)
    return fwdtrace.export_onnx(model, *args, exporter=exporter, **kwargs)


def max_difference(proto: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, str]:
    """onnxruntime against eager: the largest absolute difference, and how many of eager's outputs ONNX has."""
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    params = list(inspect.signature(model.forward).parameters)
    by_name = {**dict(zip(params, args, strict=False)), **kwargs}
    feeds = {i.name: by_name[i.name].numpy() for i in session.get_inputs()}
    got = session.run(None, feeds)
    want = [t.detach().numpy() for _, t in _named_outputs(model(*args, **kwargs))]
    diffs = [float(np.abs(g - w).max()) for g, w in zip(got, want, strict=False) if g.shape == w.shape]
    return (max(diffs) if diffs else float("nan")), f"{len(diffs)}/{len(want)}"


@contextlib.contextmanager
def quiet_stdout() -> Any:
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def run_one(exporter: str, name: str) -> dict[str, Any]:
    factory, no_grad = MODELS[name]
    model, args, kwargs = factory()
    with torch.set_grad_enabled(not no_grad):
        start = time.perf_counter()
        try:
            with quiet_stdout():  # the TorchScript exporter prints its graph on failure, from C++
                proto = export(exporter, model, args, kwargs)
        except Exception as e:
            return {"ok": False, "seconds": time.perf_counter() - start, "why": fwdtrace.errors.one_line(e)}
        seconds = time.perf_counter() - start
        try:
            diff, outputs = max_difference(proto, model, args, kwargs)
        except Exception as e:
            return {"ok": False, "seconds": seconds, "why": "onnxruntime: " + fwdtrace.errors.one_line(e)}
    return {"ok": True, "seconds": seconds, "nodes": len(proto.graph.node), "diff": diff, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="run only the models whose name contains this")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    onnx_export._probing_other.set(True)  # a failure is timed alone, without trying the other exporter
    tiny = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for exporter in EXPORTERS:  # imports and first-call costs, outside the timings
        export(exporter, tiny, (torch.ones(1, 4),), {})
    names = [n for n in MODELS if not args.only or any(o.lower() in n.lower() for o in args.only)]
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, 1 thread; one run each\n")
    print("| model | torch.onnx TorchScript | torch.onnx dynamo | fwdtrace.to_onnx |")
    print("|---|---|---|---|")
    failures = []
    for name in names:
        cells = []
        for exporter in EXPORTERS:
            r = run_one(exporter, name)
            if r["ok"]:
                cells.append(f"ok, {r['seconds']:.2f} s, {r['nodes']} nodes, max diff {r['diff']:.1e} ({r['outputs']} outputs)")
            else:
                cells.append(f"**failed** ({r['seconds']:.2f} s)")
                failures.append(f"- {name}, {exporter}: {r['why'][:240]}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if failures:
        print("\nFailures:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
