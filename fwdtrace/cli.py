"""The ``fwdtrace`` command: ``check-onnx``, ``analyze``, ``dump-diff`` and ``serve``.

Each subcommand lives beside its feature: the module named in ``_COMMANDS`` provides
``configure_parser(parser)`` and ``run_cli(args) -> int``. Exit codes: 0 when all is
well, 1 when the check found a difference, 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from .errors import FwdtraceError, describe

# command -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "check-onnx": ("fwdtrace.onnx_compare", "trace a model, export it to ONNX and diff the two graphs"),
    "analyze": ("fwdtrace.analysis", "parameters, FLOPs, latency and memory per module"),
    "dump-diff": ("fwdtrace.dump", "compare two HDF5 dumps tensor by tensor"),
    "serve": ("fwdtrace.live.server", "serve a model's graph and live statistics over HTTP"),
}


def load_factory(spec: str) -> Any:
    """Call the factory named ``"pkg.module:factory"`` and return the torch.nn.Module it makes."""
    import torch

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FwdtraceError(f"expected a factory as 'pkg.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise FwdtraceError(f"could not import {module_name!r} for factory {spec!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FwdtraceError(f"{spec}: module {module_name!r} has no attribute {attr!r}") from None
    model = obj() if callable(obj) and not isinstance(obj, torch.nn.Module) else obj
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"factory {spec!r} expected to return a torch.nn.Module, got {describe(model)}")
    return model


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` -> ``(1, 3, 224, 224)``; every dimension a positive integer."""
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise FwdtraceError(f"expected --input-shape as positive integers separated by commas (1,3,224,224), got {text!r}")
    return shape


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fwdtrace", description="See, check and reach into your PyTorch model's graph.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).configure_parser(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help
        return int(e.code or 0)
    module = importlib.import_module(_COMMANDS[args.command][0])
    try:
        return int(module.run_cli(args))
    except FwdtraceError as e:
        print(f"fwdtrace {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fwdtrace analyze ... | head` closed the pipe: not an error of ours
        # The Python docs' recipe: point stdout at devnull so the exit flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
