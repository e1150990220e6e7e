"""The ``fwdtrace`` command: ``draw``, ``check-onnx``, ``export-onnx``, ``analyze``, ``dump-diff`` and ``serve``.

Each subcommand lives beside its feature: the module named in ``_COMMANDS`` provides
``configure_parser(parser)`` and ``run_cli(args) -> int``. One exit-code contract for all:
0 when all is well, 1 when the check found a difference, 2 for anything else (bad usage,
a factory that fails, shapes, devices, unreadable files, a forward that raises, user code
that calls ``sys.exit()``: never taken as the command's own exit code), with a
one-line message naming the cause and the layer where there is one; ``--traceback``
prints the details.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from .errors import FwdtraceError, describe, one_line

# command -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "draw": ("fwdtrace.passes.draw", "trace a model and draw its graph (SVG, PNG, PDF) or write it as JSON"),
    "check-onnx": ("fwdtrace.onnx.compare", "trace a model, export it to ONNX and diff the two graphs"),
    "export-onnx": ("fwdtrace.onnx.emit", "run a model once and write the ONNX of what it ran"),
    "analyze": ("fwdtrace.analysis", "parameters, FLOPs, latency and memory per module"),
    "dump-diff": ("fwdtrace.dump", "compare two HDF5 dumps tensor by tensor"),
    "serve": ("fwdtrace.live.server", "serve a model's graph and live statistics over HTTP"),
}


def load_factory(spec: str) -> Any:
    """Call the factory named ``"pkg.module:factory"`` and return the torch.nn.Module it makes.

    The current directory is importable, as under ``python -m``: ``models:make_cnn`` finds
    ``./models.py``.
    """
    import torch

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FwdtraceError(f"expected a factory as 'pkg.module:function', got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except SystemExit as e:
        raise FwdtraceError(f"could not import {module_name!r} for factory {spec!r}: it called sys.exit({e.code!r})") from e
    except Exception as e:
        raise FwdtraceError(f"could not import {module_name!r} for factory {spec!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FwdtraceError(f"{spec}: module {module_name!r} has no attribute {attr!r}") from None
    if callable(obj) and not isinstance(obj, torch.nn.Module):
        try:
            inspect.signature(obj).bind()
        except TypeError:
            raise FwdtraceError(
                f"factory {spec!r} expected to be callable without arguments, got {attr}{inspect.signature(obj)}"
            ) from None
        except ValueError:  # no signature to check (a builtin): just call it
            pass
        try:
            model = obj()
        except SystemExit as e:  # not the command's own exit: a user's function cannot end it silently
            raise FwdtraceError(f"factory {spec!r} called sys.exit({e.code!r})") from e
        except Exception as e:
            raise FwdtraceError(f"factory {spec!r} raised {one_line(e)}") from e
    else:
        model = obj
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


# The input dtypes of --dtype, for every subcommand that makes inputs.
INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32")


def add_input_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``--input-shape`` (repeatable) and ``--dtype``, the same for every subcommand that runs a model."""
    parser.add_argument("--input-shape", action="append", required=required, metavar="1,3,224,224",
                        help="shape of one input tensor; repeat for more inputs")
    parser.add_argument("--dtype", default="float32", choices=INPUT_DTYPES,
                        help="dtype of the inputs: floats are seeded normal values, ints token ids in [0, 10) (default float32)")


def parse_device(text: str) -> Any:
    """The ``torch.device`` of ``--device``, checked to exist on this machine."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise FwdtraceError(f"expected --device as cpu, cuda, cuda:1 or meta, got {text!r}") from e
    try:
        torch.empty(0, device=device)
    except Exception as e:
        raise FwdtraceError(f"expected --device as a device this machine has, got {text!r}: {one_line(e)}") from e
    return device


def make_inputs(args: argparse.Namespace, device: Any = "cpu") -> list[Any]:
    """The seeded inputs of ``--input-shape``/``--dtype``: the same values for every subcommand."""
    import torch

    dtype = getattr(torch, args.dtype)
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    inputs = []
    for text in args.input_shape:
        shape = parse_shape(text)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if device.type == "meta":
            inputs.append(torch.empty(shape, dtype=dtype, device=device))
            continue
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        if memory and nbytes > memory:
            raise FwdtraceError(
                f"expected --input-shape that fits in memory, got {text!r}: {nbytes / 2**30:.1f} GiB as {args.dtype}, "
                f"this machine has {memory / 2**30:.1f} GiB"
            )
        try:
            if dtype.is_floating_point:
                t = torch.randn(shape, generator=generator).to(dtype)
            else:
                t = torch.randint(0, 10, shape, generator=generator, dtype=dtype)
            inputs.append(t.to(device))
        except Exception as e:
            raise FwdtraceError(f"could not make an input of shape {text!r} as {args.dtype} on {device}: {one_line(e)}") from e
    return inputs


def forward_failed(factory: str, inputs: Sequence[Any], e: BaseException) -> FwdtraceError:
    """The error of a subcommand whose model raised: the cause and, from the core's note, the layer."""
    from .errors import shapes_text

    return FwdtraceError(f"{factory}: the forward failed on inputs {shapes_text(inputs)}: {one_line(e)}")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="fwdtrace", description="See, check and reach into your PyTorch model's graph.")
    parser.add_argument("--version", action="version", version=f"fwdtrace {__version__}")
    parser.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's default must not undo `fwdtrace --traceback COMMAND`
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                        help="print the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        importlib.import_module(module).configure_parser(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fwdtrace`` command; return its exit code (0 well, 1 a difference found, 2 an error).

    >>> main(["--version"])  # doctest: +ELLIPSIS
    fwdtrace ...
    0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help and --version
        return int(e.code or 0)
    module = importlib.import_module(_COMMANDS[args.command][0])
    try:
        return int(module.run_cli(args))
    except BrokenPipeError:  # `fwdtrace analyze ... | head` closed the pipe: not an error of ours
        # The Python docs' recipe: point stdout at devnull so the exit flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except SystemExit as e:  # the model's code (its forward) called sys.exit(): an error, never the exit code
        factory = getattr(args, "factory", None)
        where = f"{factory}: the model's code" if factory else "code run by the command"
        error: Exception = FwdtraceError(f"{where} called sys.exit({e.code!r})")
        error.__cause__ = e
        return _report(args, error)
    except Exception as e:
        return _report(args, e)


def _report(args: argparse.Namespace, e: Exception) -> int:
    """Print the one-line error of a failed command (and its traceback under ``--traceback``); exit code 2."""
    if args.traceback:
        traceback.print_exc()
    if isinstance(e, FwdtraceError):
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    else:
        message = one_line(e)
    hint = "" if args.traceback or (isinstance(e, FwdtraceError) and e.__cause__ is None) else " (--traceback for details)"
    print(f"fwdtrace {args.command}: error: {message}{hint}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
