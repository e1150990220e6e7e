"""The ``fwdtrace`` command: ``draw``, ``check-onnx``, ``export-onnx``, ``analyze``, ``dump-diff`` and ``serve``.

Each subcommand runs beside its feature: the module named in ``_COMMANDS`` provides
``run_cli(args) -> int``. The arguments of every subcommand are declared here, in a module
that imports no torch, so ``fwdtrace --help`` and ``fwdtrace COMMAND --help`` answer at once
and torch is imported only when a command runs. One exit-code contract for all:
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
from collections.abc import Callable, Sequence
from typing import Any

from .errors import FwdtraceError, describe, one_line


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


# -- each subcommand's arguments (no torch here: see the module docstring) -------------------------------
# check-onnx's --exporter: onnx.compare.CHECK_EXPORTERS, whose module imports torch (a test keeps them equal)
CHECK_EXPORTERS = ("dynamo", "torchscript", "fwdtrace")
# the suffix of `fwdtrace draw -o` that writes Model Explorer's JSON rather than Graph.to_json
MODEL_EXPLORER_SUFFIX = "model-explorer.json"


def _depth_argument(text: str) -> int | str | None:
    if text == "auto":
        return "auto"
    if text == "all":
        return None
    try:
        depth = int(text)
    except ValueError:
        depth = -1
    if depth < 0:
        raise argparse.ArgumentTypeError(f"expected auto, all or an integer >= 0, got {text!r}")
    return depth


def _draw_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", help="'pkg.module:function' returning the model (traced in eval mode)")
    add_input_arguments(parser)
    parser.add_argument("--depth", type=_depth_argument, default="auto", metavar="auto|all|K",
                        help="collapse module calls nested deeper than K; all draws every level (default auto)")
    parser.add_argument("-o", "--output", required=True, metavar="graph.svg",
                        help=f"the file: .svg, .png, .pdf (a picture), .json (Graph.to_json) or .{MODEL_EXPLORER_SUFFIX}")


def _check_onnx_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", help="'pkg.module:factory', a callable returning the torch.nn.Module to check")
    add_input_arguments(parser)
    parser.add_argument("--exporter", choices=CHECK_EXPORTERS, default=None,
                        help="torch's ONNX exporter, or fwdtrace's own emission (to_onnx) (default dynamo)")
    parser.add_argument("--onnx", default=None, metavar="model.onnx",
                        help="check this ONNX file (made for these input shapes) instead of exporting the model")
    parser.add_argument("--numeric", action="store_true",
                        help="compare numbers too: run the model eagerly and the ONNX model in onnxruntime, "
                             "and name the first call whose value differs (exit 1 if one does)")
    parser.add_argument("--isolate", action="store_true",
                        help="run torch's exporter in a child process: a crash of torch's own code there is an "
                             "error naming the exporter and the signal (exit 2)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")


def _export_onnx_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", help="'pkg.module:factory', a callable returning the torch.nn.Module to export")
    add_input_arguments(parser)
    parser.add_argument("-o", "--output", required=True, metavar="model.onnx", help="the ONNX file to write")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset, 18 to 23 (default 18)")


def _analyze_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", help="'pkg.module:function' returning the model (put in eval mode)")
    add_input_arguments(parser)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, meta (FLOPs and params of big models without allocating their memory)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs, each a plain run and one with every module timed (default 10; 0 skips timing)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _dump_diff_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="first dump (.hdf5), or a distributed run's folder of per-rank dumps")
    parser.add_argument("b", nargs="?", default=None,
                        help="second dump (.hdf5), or the other run's folder: compared rank by rank; left out with "
                             "--overflow or --ranks")
    parser.add_argument("--overflow", action="store_true",
                        help="one run alone: name where inf/NaN first appear in each dump given, forward and backward "
                             "(exit 1 where they do)")
    parser.add_argument("--ranks", action="store_true",
                        help="compare the ranks of one run's folder (a) with its lowest rank: replicas that should "
                             "agree and do not")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    parser.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance (default 1e-8)")
    parser.add_argument("--only-diverged", action="store_true", help="print only the rows that differ")
    parser.add_argument("--picture", default=None, metavar="PATH",
                        help="draw the run's graph coloured by error into PATH (.svg, .png, .pdf); needs dumps "
                             "written with calls='functions' or 'all'")
    parser.add_argument("--model-explorer", default=None, metavar="DIR",
                        help="write the run's graph with each call's errors as node data for Model Explorer into DIR "
                             "(diff.json and diff.*.json); needs dumps written with calls='functions' or 'all'")


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", nargs="?", help="a function returning the model, as 'pkg.module:function' "
                        "(left out with --logdir: reopen that finished run read-only)")
    add_input_arguments(parser, required=False)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    parser.add_argument("--token", default=None, help="token required on every request (generated beyond loopback)")
    parser.add_argument("--logdir", default=None, help="with a factory: keep the history there; alone: reopen "
                        "the finished run there, read-only")
    parser.add_argument("--retention", type=int, default=None, help="rows kept per series in --logdir (default 10000)")


# command -> (the module whose run_cli(args) runs it, one-line help, its arguments)
_COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "draw": ("fwdtrace.passes.draw", "trace a model and draw its graph (SVG, PNG, PDF) or write it as JSON",
             _draw_arguments),
    "check-onnx": ("fwdtrace.onnx.compare", "trace a model, export it to ONNX and diff the two graphs",
                   _check_onnx_arguments),
    "export-onnx": ("fwdtrace.onnx.emit", "run a model once and write the ONNX of what it ran", _export_onnx_arguments),
    "analyze": ("fwdtrace.analysis", "parameters, FLOPs, latency and memory per module", _analyze_arguments),
    "dump-diff": ("fwdtrace.dump", "compare two HDF5 dumps tensor by tensor", _dump_diff_arguments),
    "serve": ("fwdtrace.live.server", "serve a model's graph and live statistics over HTTP", _serve_arguments),
}


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
    for name, (_, help_text, add_arguments) in _COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text, parents=[common]))
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
