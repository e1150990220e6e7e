"""ONNX export, thin and honest, and the exported model read back as a fwdtrace Graph.

:func:`export_onnx` calls ``torch.onnx.export`` with one of torch's two exporters and
returns the ``onnx.ModelProto``; :func:`onnx_graph` turns any ONNX model into a
:class:`~fwdtrace.Graph`, so the same renderer and the same comparison work on both.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import inspect
import io
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import torch

from .._files import AtomicFile
from .._tree import tensors_of
from ..errors import FwdtraceError, FwdtraceWarning, describe, one_line, shapes_text
from ..graph import Graph
from ..node import Scope, TensorRef
from ._quiet import quiet, user_stacklevel

if TYPE_CHECKING:
    import onnx

__all__ = ["export_onnx", "onnx_graph", "EXPORTERS", "EXTERNAL_DATA_THRESHOLD"]

EXPORTERS = ("dynamo", "torchscript")
# Models whose parameters and buffers take more bytes than this export through a file in
# onnx's external-data format: a ModelProto cannot be serialised past protobuf's 2 GiB, and
# constants an exporter folds can add to the weights.
EXTERNAL_DATA_THRESHOLD = 1 << 30
# Tensors smaller than this stay inside the .onnx file (shape constants, small biases): readers
# need them without opening the data file, as onnx's own convert_model_to_external_data does.
_INLINE_BYTES = 1024
# ONNX ops whose output describes a tensor's shape, not its values: what they feed is
# shape arithmetic, folded away by the comparison.
_SHAPE_OPS = frozenset({"Shape", "Size"})
# Inputs that give a shape, sizes or positions, not values: (op type, input index), None for all inputs
_SHAPE_INPUTS: dict[str, frozenset[int] | None] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}), "ConstantOfShape": None,
    "Range": None, "Slice": frozenset({1, 2, 3, 4}), "Unsqueeze": frozenset({1}), "Squeeze": frozenset({1}),
    "Resize": frozenset({1, 2, 3}), "Pad": frozenset({1, 3}), "TopK": frozenset({1}), "OneHot": frozenset({1}),
}
_UNSET = object()


def _import_onnx() -> Any:
    try:
        import onnx
    except ImportError as e:  # pragma: no cover - onnx is a dependency
        raise FwdtraceError("the ONNX features need the onnx package: pip install onnx onnxscript onnxruntime") from e
    return onnx


def export_onnx(
    model: torch.nn.Module,
    *args: Any,
    exporter: str = "dynamo",
    path: str | os.PathLike[str] | None = None,
    opset_version: int | None = None,
    verbose: bool = False,
    isolate: bool = False,
    **kwargs: Any,
) -> onnx.ModelProto:
    """Export ``model(*args, **kwargs)`` with torch's ONNX exporter and return the ModelProto.

    >>> import torch, fwdtrace
    >>> proto = fwdtrace.export_onnx(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()),
    ...                              torch.ones(1, 4), exporter="torchscript")
    >>> [n.op_type for n in proto.graph.node]
    ['Gemm', 'Relu']

    ``exporter`` is ``"dynamo"`` (torch.export based, torch's default; needs onnxscript) or
    ``"torchscript"`` (the legacy ``dynamo=False`` exporter). Keyword inputs go to the
    model as keyword inputs. Outputs that are dicts, dataclasses or transformers'
    ``ModelOutput`` become the flat list of their tensors, in order, a returned KV cache's
    key and value tensors included (where the TorchScript exporter cannot export the cache,
    as on Mamba's, the export leaves it out and a :class:`~fwdtrace.errors.FwdtraceWarning`
    says so). When the exporter fails, the error names it, quotes its first line and
    suggests the other exporter. A model whose lazy layers are not built yet (``nn.LazyLinear``
    before its first call) is called once on the example first, in eval mode and without
    gradients, to build them: the file holds the weights they are built with.

    What torch's exporters and onnxscript warn and print while they run is not shown: a
    warning in fwdtrace's words says what matters (a TorchScript trace that read values
    from tensors), and the rest goes to the ``fwdtrace.onnx`` logger at DEBUG.
    ``verbose=True`` shows their output as they print it.

    ``path`` also writes the model to a file, whole or not at all (written beside it, then
    moved in place). A model whose parameters and buffers exceed
    :data:`EXTERNAL_DATA_THRESHOLD` bytes (1 GiB; protobuf stops at 2 GiB) is exported through
    a file with onnx's external-data format, by both exporters: with ``path``, its tensors of
    1 KiB or more go to ``path + ".data"`` beside it, and the proto returned refers to that
    file instead of holding the weights (``onnx.load(path)`` reads them); without ``path``
    the weights are loaded into the proto returned.

    ``isolate=True`` runs the exporter in a child process (forked: the model and inputs as they
    are, nothing pickled), so that a crash of torch's own code there (the TorchScript exporter
    dies of SIGFPE on some chains of empty-tensor reshapes) is a :class:`~fwdtrace.errors.FwdtraceError`
    naming the exporter and the signal, not the end of your process or notebook kernel. An
    interrupt (Ctrl-C) ends the child too. It costs a process start; it needs ``fork`` (Linux, macOS).
    """
    return _export(model, args, kwargs, exporter, opset_version, path, weights=True, verbose=verbose,
                   isolate=isolate)


def _export(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    exporter: str,
    opset_version: int | None,
    path: str | os.PathLike[str] | None,
    weights: bool,
    verbose: bool = False,
    isolate: bool = False,
    caller: str = "export_onnx()",
) -> onnx.ModelProto:
    """export_onnx's work; ``weights=False`` (for check_onnx) leaves a large model's weights unread.

    Over :data:`EXTERNAL_DATA_THRESHOLD` the exporter writes into a private folder (beside
    ``path`` when given) with external data, read back without the weights' bytes.
    ``isolate``: in a child process (see :func:`export_onnx`).
    """
    if not isinstance(model, torch.nn.Module):
        raise FwdtraceError(f"export_onnx() expected a torch.nn.Module as model, got {describe(model)}")
    if exporter not in EXPORTERS:
        raise FwdtraceError(f"export_onnx() expected exporter 'dynamo' or 'torchscript', got {exporter!r}")
    _import_onnx()  # its error before any work
    build_lazy_layers(model, args, kwargs, caller)
    if isolate:
        return _export_in_child(model, args, kwargs, exporter, opset_version, path, weights, verbose, caller)
    if not _large(model):
        proto = _run_exporter(model, args, kwargs, exporter, opset_version, None, verbose)
        if path is not None:
            _write_onnx(proto, os.fspath(path), None)
        return proto
    target, folder = _target_folder(path, caller)
    with tempfile.TemporaryDirectory(prefix=".fwdtrace-export-", dir=folder) as tmp:
        source = os.path.join(tmp, "model.onnx")
        _run_exporter(model, args, kwargs, exporter, opset_version, source, verbose)
        return _read_back(source, target, weights, large=True)


def _target_folder(path: str | os.PathLike[str] | None, caller: str) -> tuple[str | None, str | None]:
    """``path`` as a string and the existing folder it is in (both None without ``path``)."""
    target = os.fspath(path) if path is not None else None
    folder = os.path.dirname(os.path.abspath(target)) if target is not None else None
    if folder is not None and not os.path.isdir(folder):
        raise FwdtraceError(f"{caller} expected path in an existing folder, got {target!r}")
    return target, folder


def _read_back(source: str, target: str | None, weights: bool, large: bool) -> onnx.ModelProto:
    """The file the exporter wrote at ``source`` (in a private folder): written to ``target``, else read.

    ``large``: tensors of 1 KiB or more go to ``target + ".data"``; without ``target``, ``weights=False``
    leaves a large model's weights unread.
    """
    onnx_mod = _import_onnx()
    tmp = os.path.dirname(source)
    proto = onnx_mod.load(source, load_external_data=False)
    if target is not None:
        _write_onnx(proto, target, tmp if large else None)  # large tensors now refer to the data file beside it
    elif weights:
        onnx_mod.load_external_data_for_model(proto, tmp)
    else:
        _load_small_external_data(proto, tmp)
    return cast("onnx.ModelProto", proto)


def _export_in_child(
    model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], exporter: str, opset_version: int | None,
    path: str | os.PathLike[str] | None, weights: bool, verbose: bool, caller: str,
) -> onnx.ModelProto:
    """Export in a forked child into a private folder; read the file back here, or name how the child died.

    The folder is this process's: what a killed child leaves there goes with it, and ``path``
    is written here only from a complete file.
    """
    import multiprocessing
    import signal

    if "fork" not in multiprocessing.get_all_start_methods():
        raise FwdtraceError(f"{caller} with isolate=True exports in a forked child process, and this platform has "
                            "no fork: export without isolate=True")
    context = multiprocessing.get_context("fork")
    target, folder = _target_folder(path, caller)
    with tempfile.TemporaryDirectory(prefix=".fwdtrace-isolated-", dir=folder) as tmp:
        source = os.path.join(tmp, "model.onnx")
        reader, writer = context.Pipe(duplex=False)
        child = context.Process(target=_exporting_child, daemon=True,
                                args=(writer, model, args, kwargs, exporter, opset_version, source, verbose, caller))
        child.start()
        writer.close()
        try:
            outcome, text, said = reader.recv()
        except EOFError:  # the child died before it could say anything
            outcome, text, said = "died", "", []
        except BaseException:  # interrupted (Ctrl-C): the export goes too, not left hung or waited for
            child.kill()
            raise
        finally:
            reader.close()
            child.join()
        for message in said:  # what the export warned, in fwdtrace's words, said here where the user sees it
            warnings.warn(message, FwdtraceWarning, stacklevel=user_stacklevel())
        if outcome == "died" or child.exitcode != 0:
            code = child.exitcode or 0
            how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                   else f"exited with status {code}")
            raise FwdtraceError(
                f"{caller}: the {exporter} ONNX exporter crashed on {type(model).__name__}: its process was {how} "
                f"(a crash in torch's own code, isolated in a child process by isolate=True; your process is fine)"
                + (" (try exporter='dynamo')" if exporter == "torchscript" else ""))
        if outcome == "error":
            raise FwdtraceError(text)
        return _read_back(source, target, weights, large=_large(model))


def _exporting_child(writer: Any, model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], exporter: str,
                     opset_version: int | None, source: str, verbose: bool, caller: str) -> None:
    """The forked child of :func:`_export_in_child`: export into ``source``, send (outcome, error, warnings)."""
    # the parent's OpenMP threads do not exist in a forked child; one thread needs none
    # (DataLoader's workers do the same)
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FwdtraceWarning)
        try:
            _run_exporter(model, args, kwargs, exporter, opset_version, source, verbose)
            outcome, text = "ok", ""
        except FwdtraceError as e:
            outcome, text = "error", str(e)
        except BaseException as e:  # noqa: BLE001 - anything else the child raises is said in the parent
            outcome, text = "error", f"{caller}: the {exporter} ONNX exporter failed: {type(e).__name__}: {e}"
    said = [str(w.message) for w in caught if issubclass(w.category, FwdtraceWarning)]
    writer.send((outcome, text, said))
    writer.close()


def build_lazy_layers(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], caller: str) -> None:
    """Build the lazy layers (``nn.LazyLinear``...) of a model not called yet, by one call on the example inputs.

    Until its first call such a layer's weights have no shape: the TorchScript exporter and
    to_onnx read the weights before they run the model, and the model's size is unknown. The call
    is the user's own first call, but in eval mode (a norm in training would move its statistics)
    and without gradients; what it builds stays, as after a plain call.
    """
    if not any(torch.nn.parameter.is_lazy(t) for t in [*model.parameters(), *model.buffers()]):
        return
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            model.eval()
            model(*args, **kwargs)
    except Exception as e:
        raise FwdtraceError(f"{caller} could not build {type(model).__name__}'s lazy layers: its first call on "
                            f"{shapes_text(tensors_of((args, kwargs)))} raised {one_line(e)}") from e
    finally:
        for module, training in modes:
            module.training = training


def _large(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters and buffers exceed :data:`EXTERNAL_DATA_THRESHOLD`: its file keeps its weights apart."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()) > EXTERNAL_DATA_THRESHOLD


def _run_exporter(
    model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], exporter: str, opset_version: int | None,
    file: str | None, verbose: bool = False,
) -> Any:
    """Run torch's exporter quietly: into memory (returns the ModelProto), or into ``file`` with external data.

    A returned KV cache is part of the outputs. The TorchScript exporter cannot export every
    cache's writes (Mamba's ``copy_`` into its states): then it runs again without the cache,
    and a warning says so; the comparison leaves out outputs an export does not return.
    """
    # the TorchScript exporter writes its "Torch IR graph at exception" dump from C++
    with quiet(f"the {exporter} exporter", verbose, fds=exporter == "torchscript"), _state_kept(model):
        try:
            return _run_exporter_once(model, args, kwargs, exporter, opset_version, file, True)
        except _CacheNotExported as e:
            proto = _run_exporter_once(model, args, kwargs, exporter, opset_version, file, False)
            why = _first_line(e.error)
    warnings.warn(  # outside the capture, which would keep it from the user
        f"the {exporter} exporter could not export {type(model).__name__}'s returned cache ({why}): "
        "the ONNX model returns the other outputs only", FwdtraceWarning, stacklevel=user_stacklevel(),
    )
    return proto


_KEPT_DICTS = ("_parameters", "_buffers", "_modules")


@contextlib.contextmanager
def _state_kept(model: torch.nn.Module) -> Iterator[None]:
    """While active, what the exporter's runs of ``model`` set on its modules is undone when it ends.

    A model's forward may store what it computed in its attributes, and while torch.jit traces
    it that is a traced tensor: transformers' Swin sets ``window_size`` to
    ``torch.min(torch.tensor(...))`` under ``torch.jit.is_tracing()``, so every later call (and
    fwdtrace's next trace) reads a tensor made outside torch functions where it read an int;
    the dynamo exporter resets an LSTM's flat weights and a transformers model's parallelism
    plans. Each module's attributes (and its parameters, buffers and children) go back to the
    objects they were: a tensor changed in place is not undone (eval mode writes none).
    """
    # A ScriptModule's state lives in C++ (its _parameters is a wrapper without clear()): left alone
    modules = [m for m in {id(m): m for m in model.modules()}.values() if not isinstance(m, torch.jit.ScriptModule)]
    saved = [(m, dict(vars(m)), {k: dict(vars(m)[k]) for k in _KEPT_DICTS if k in vars(m)}) for m in modules]
    try:
        yield
    finally:
        for module, attrs, kept in saved:
            now = vars(module)
            for key in [k for k in now if k not in attrs]:
                del now[key]
            for key, value in attrs.items():
                if now.get(key, _UNSET) is not value:
                    now[key] = value
            for key, entries in kept.items():  # the same dict objects, with their entries as they were
                current = attrs[key]
                if current.keys() != entries.keys() or any(current[k] is not v for k, v in entries.items()):
                    current.clear()
                    current.update(entries)


class _CacheNotExported(Exception):
    """The TorchScript exporter failed on a model whose outputs included a KV cache's tensors."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _run_exporter_once(
    model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], exporter: str, opset_version: int | None,
    file: str | None, caches: bool,
) -> Any:
    onnx_mod = _import_onnx()
    opened: list[bool] = []  # set by the patched forward when it returned a cache's tensors
    other = EXPORTERS[1 - EXPORTERS.index(exporter)]
    if args and type(args[-1]) is dict:  # both exporters read a trailing dict as keyword arguments
        args = (*args, {})
    try:
        if exporter == "dynamo":
            with _export_forward(model, _n_positional(args), (), caches=opened), _quiet_exporter_logs(), \
                    _torchlib_registry_kept():
                program = torch.onnx.export(
                    model, args, kwargs=kwargs or None, dynamo=True, verbose=False, opset_version=opset_version
                )
            if program is None:  # pragma: no cover - dynamo=True always returns a program
                raise RuntimeError("torch.onnx.export returned no ONNXProgram")
            if file is not None:
                program.save(file, external_data=True)
            proto = None if file is not None else program.model_proto
        else:
            # The TorchScript exporter passes kwargs as one trailing positional dict, which
            # models such as transformers' refuse: keyword tensors go in as positions and the
            # patched forward hands them back by name. Into a file, it writes the weights of a
            # model over 2 GiB as external data beside it.
            tensor_kw = [k for k, v in kwargs.items() if tensors_of(v)]
            consts = {k: v for k, v in kwargs.items() if k not in tensor_kw}
            buffer = io.BytesIO()
            n_args = _n_positional(args)
            positions = (*args[:n_args], *(kwargs[k] for k in tensor_kw))
            if positions and type(positions[-1]) is dict:
                positions = (*positions, {})
            with _export_forward(model, n_args, tuple(tensor_kw), consts, opened if caches else None), \
                    _quiet_exporter_logs():
                torch.onnx.export(
                    model, positions, cast(Any, file or buffer), dynamo=False,
                    opset_version=opset_version, input_names=_input_names(model, n_args) + tensor_kw,
                )
            proto = None if file is not None else onnx_mod.load_from_string(buffer.getvalue())
    except FwdtraceError:
        raise
    except Exception as e:
        if any(opened) and exporter == "torchscript":
            raise _CacheNotExported(e) from e
        root = _cause_chain(e)[-1]
        why = f"{type(e).__name__}: {_first_line(e)}"
        if root is not e:  # the dynamo exporter wraps the real reason in its step messages
            why += f"; caused by {type(root).__name__}: {_first_line(root)}"
        raise FwdtraceError(
            f"the {exporter} ONNX exporter failed on {type(model).__name__}: {why}"
            + _other_exporter_hint(model, args, kwargs, other, opset_version)
        ) from e
    return proto


# -- writing: whole or not at all -----------------------------------------------------------------
@contextlib.contextmanager
def _replacing(path: str, caller: str = "export_onnx()") -> Iterator[BinaryIO]:
    """A new file that takes ``path``'s place only once complete (see :mod:`fwdtrace._files`).

    Write failures stay ``OSError`` here: :func:`_write_onnx` names the file and what it holds.
    """
    atomic = AtomicFile(path, caller=caller)  # created beside path with O_EXCL
    try:
        with open(atomic.tmp, "r+b") as f:
            yield f
        os.replace(atomic.tmp, path)  # replaces a link planted at path rather than follow it
    except BaseException:
        atomic.discard()
        raise


def _write_onnx(proto: onnx.ModelProto, path: str, source_dir: str | None, caller: str = "export_onnx()",
                large: bool = False) -> None:
    """Write ``proto`` to ``path``; with ``source_dir`` or ``large``, tensors of 1 KiB or more go to ``path`` + ``.data``.

    ``source_dir`` is where the external data ``proto`` already refers to lies; ``large`` moves
    tensors ``proto`` holds (to_onnx's, see :func:`_large`). The data file is complete before
    the model that refers to it appears; ``proto`` is changed to refer to the new data file.
    """
    what = f"{caller} could not write {path!r}"
    try:
        if source_dir is not None or large:
            data_name = os.path.basename(path) + ".data"
            with _replacing(os.path.join(os.path.dirname(os.path.abspath(path)), data_name), caller) as data:
                for tensor in _tensors(proto):
                    _move_to_data_file(tensor, source_dir, data, data_name)
            what += f" (its weights are in {data_name} beside it)"
        with _replacing(path, caller) as f:
            f.write(proto.SerializeToString())
    except OSError as e:
        raise FwdtraceError(f"{what}: {type(e).__name__}: {e}") from e


def _tensors(proto: onnx.ModelProto) -> Iterator[Any]:
    """Every TensorProto of the model: initializers and tensor attributes, subgraphs included."""
    graphs = [proto.graph]
    while graphs:
        g = graphs.pop()
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("g"):
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)


def _move_to_data_file(tensor: Any, source_dir: str | None, data: BinaryIO, data_name: str) -> None:
    onnx_mod = _import_onnx()
    external = tensor.data_location == onnx_mod.TensorProto.EXTERNAL
    if external:
        assert source_dir is not None, f"tensor {tensor.name!r} refers to a file, but no folder was given to read it"
        info = onnx_mod.external_data_helper.ExternalDataInfo(tensor)
        source = os.path.join(source_dir, info.location)
        offset = info.offset or 0
        length = info.length if info.length is not None else os.path.getsize(source) - offset
    elif tensor.HasField("raw_data"):
        length = len(tensor.raw_data)
    else:
        return  # typed fields (float_data, ...): exporters only use them for small constants
    if length < _INLINE_BYTES:
        if external:
            onnx_mod.external_data_helper.load_external_data_for_tensor(tensor, source_dir)
        return
    start = data.tell()
    if external:
        with open(source, "rb") as src:
            src.seek(offset)
            left = length
            while left:
                chunk = src.read(min(left, 1 << 24))
                if not chunk:
                    raise OSError(f"{source} ends before the {length} bytes of tensor {tensor.name!r}")
                data.write(chunk)
                left -= len(chunk)
    else:
        data.write(tensor.raw_data)
        tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx_mod.TensorProto.EXTERNAL
    for key, value in (("location", data_name), ("offset", start), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def _load_small_external_data(proto: onnx.ModelProto, folder: str) -> None:
    """Load external tensors of at most 64 elements (shape constants shape inference reads), not the weights."""
    onnx_mod = _import_onnx()
    for tensor in _tensors(proto):
        if tensor.data_location == onnx_mod.TensorProto.EXTERNAL and _numel(tensor.dims) <= 64:
            onnx_mod.external_data_helper.load_external_data_for_tensor(tensor, folder)


def _n_positional(args: tuple[Any, ...]) -> int:
    """How many of ``args`` are the model's: a trailing ``{}`` only stops a dict being read as keywords."""
    return len(args) - 1 if len(args) >= 2 and type(args[-2]) is dict and args[-1] == {} else len(args)


_probing_other = contextvars.ContextVar("_probing_other", default=False)


def _other_exporter_hint(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], other: str, opset_version: int | None
) -> str:
    """`` (try exporter='...')`` when the other exporter does export the model, else what it says.

    Suggesting an exporter that fails the same way sends users in circles, so the other
    one is tried (the failure path only pays for it).
    """
    if _probing_other.get():
        return ""
    token = _probing_other.set(True)
    try:
        export_onnx(model, *args[: _n_positional(args)], exporter=other, opset_version=opset_version, **kwargs)
    except FwdtraceError as e:
        return f"; the {other} exporter fails too: {str(e).partition(': ')[2]}"
    finally:
        _probing_other.reset(token)
    return f" (try exporter={other!r})"


def _cause_chain(e: BaseException) -> list[BaseException]:
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    return chain


def _first_line(e: BaseException) -> str:
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # the dynamo exporter colours its messages
    line = line.removesuffix(" Next steps:")
    return line if len(line) <= 300 else line[:297] + "..."


def _needs_flattening(out: Any) -> bool:
    """True when an output holds something other than tensors in plain tuples, lists and dicts."""
    if out is None or isinstance(out, (torch.Tensor, int, float, bool)):
        return False
    if type(out) in (tuple, list):
        return any(_needs_flattening(o) for o in out)
    if type(out) is dict:
        return any(_needs_flattening(o) for o in out.values())
    return True


@contextlib.contextmanager
def _export_forward(
    model: torch.nn.Module, n_args: int, keywords: tuple[str, ...], consts: dict[str, Any] | None = None,
    caches: list[bool] | None = None,
) -> Iterator[None]:
    """While active, ``model``'s forward takes keyword tensors by position and returns plain outputs.

    Positions after the first ``n_args`` go back to the forward as ``keywords``, with
    ``consts`` added. Both exporters refuse dataclass outputs and the TorchScript one
    refuses ModelOutput: such outputs become the tuple of their tensors, decided while the
    exporter runs the model (no extra forward). With ``caches`` (a list), a returned KV
    cache's tensors are outputs too, as they are the trace's, and ``True`` is appended to
    the list when there was one. The forward is patched on the instance, not
    wrapped in a parent module, so scopes and parameter names in the export stay ``model``'s.
    """
    forward = model.forward
    fixed = dict(consts or {})

    @functools.wraps(forward)
    def export_forward(*a: Any, **k: Any) -> Any:
        # The TorchScript exporter appends forward's defaults as positions after the inputs
        # it was given: they would collide with keywords that wrappers of forward pass
        # (transformers' use_cache) and could turn into graph inputs (logits_to_keep).
        a = a[: n_args + len(keywords)]
        if keywords or fixed:
            k = {**k, **fixed, **dict(zip(keywords, a[n_args:], strict=False))}
            a = a[:n_args]
        out = forward(*a, **k)
        if not _needs_flattening(out):
            return out
        flat = tensors_of(out, caches=caches is not None)
        if caches is not None and len(flat) > len(tensors_of(out)):
            caches.append(True)
        return tuple(flat)

    if isinstance(model, torch.jit.ScriptModule):  # compiled: no Python forward to wrap
        yield
        return
    # Set and removed in the instance's __dict__ directly: nn.Module.__setattr__ and
    # __delattr__ can refuse or raise, and nothing of fwdtrace may stay on the user's model.
    attrs = vars(model)
    previous = attrs.get("forward", _UNSET)
    attrs["forward"] = export_forward
    try:
        yield
    finally:
        if previous is _UNSET:
            attrs.pop("forward", None)
        else:
            attrs["forward"] = previous


def _input_names(model: torch.nn.Module, n_args: int) -> list[str]:
    """The names of forward's first ``n_args`` parameters (``input_ids``), as the dynamo exporter uses."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n_args]]
    return names if len(names) == n_args else [f"input_{i}" for i in range(n_args)]


@contextlib.contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    # The dynamo exporter logs a warning per torchvision op when torchvision is absent.
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# The dynamo exporter's table of ATen -> ONNX functions, built once per (opset, set of torchlib functions).
_TORCHLIB_REGISTRIES: dict[tuple[int, ...], Any] = {}


def _torchlib_fingerprint(opset_version: int) -> tuple[int, ...]:
    """What a registry built from torchlib depends on: the opset and how many functions each library holds."""
    from onnxscript.function_libs.torch_lib import ops, registration  # importing ops registers them
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry
    from torch.onnx._internal.exporter._torchlib import ops as torch_ops  # and torch's own

    del ops, torch_ops

    functions = list(registration.default_registry.values())
    overloads = sum(len(f.overloads) + len(f.complex) for f in functions)
    return opset_version, len(_torchlib_registry._registry), len(functions), overloads


def _registry_once(call: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``ONNXRegistry.from_torchlib`` kept: each call gets its own copy of the function lists (an export
    may register custom translations into it), sharing the immutable function entries."""
    from torch.onnx._internal.exporter import _constants

    cls, *rest = args
    key = _torchlib_fingerprint(int(kwargs.get("opset_version", rest[0] if rest else _constants.TORCHLIB_OPSET)))
    kept = _TORCHLIB_REGISTRIES.get(key)
    if kept is None:
        kept = _TORCHLIB_REGISTRIES[key] = call(*args, **kwargs)
    registry = cls()
    registry._opset_version = kept._opset_version
    registry.functions = {target: list(entries) for target, entries in kept.functions.items()}
    return registry


@contextlib.contextmanager
def _torchlib_registry_kept() -> Iterator[None]:
    """Build the dynamo exporter's ATen -> ONNX table once, not at every export.

    ``torch.onnx.export(dynamo=True)`` rebuilds it from onnxscript's torchlib each time, parsing
    the source of ~500 functions to read their domain: about 1 s of CPU per export, two thirds
    of a small model's export. The table depends only on the opset and on which torchlib
    functions are registered (the key; a registration made since builds a new one).
    """
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    from ..patching import add_function_handler, remove_call_handler

    handle = add_function_handler(ONNXRegistry, "from_torchlib", _registry_once)
    try:
        yield
    finally:
        remove_call_handler(handle)


# -- reading an ONNX model ------------------------------------------------------------------------
# The metadata key to_onnx writes on the ONNX nodes it emitted for a call a trace records as one
# node (an atomic function): "<target>#<k>", the target's k-th call in the run.
CALL_KEY = "pkg.fwdtrace.call"


def onnx_scope(node: onnx.NodeProto) -> tuple[str | None, tuple[Scope, ...]]:
    """The module path an ONNX node came from, and its enclosing scopes, when the export says so.

    The dynamo exporter writes ``pkg.torch.onnx.name_scopes`` (``['', 'blocks', 'blocks.0',
    'blocks.0.c1', 'conv2d']``); the TorchScript exporter names nodes after their scope
    (``/blocks/blocks.0/c1/Conv``). Anything else gives ``(None, ())``.
    """
    props = {p.key: p.value for p in node.metadata_props}
    names = _literal_list(props.get("pkg.torch.onnx.name_scopes"))
    if names and len(names) >= 2:
        classes = _literal_list(props.get("pkg.torch.onnx.class_hierarchy")) or []
        scopes = tuple(
            Scope(names[i], classes[i].rsplit(".", 1)[-1] if i < len(classes) else "")
            for i in range(1, len(names) - 1)
        )
        return names[-2], scopes
    if node.name.startswith("/"):
        path = ""
        scopes_list = []
        for seg in node.name.split("/")[1:-1]:
            last = path.rsplit(".", 1)[-1] if path else ""
            # TorchScript names a container's child "stem.0" under "stem": one level, not two
            if last and seg.startswith(last + "."):
                path = path[: len(path) - len(last)] + seg
            else:
                path = f"{path}.{seg}" if path else seg
            scopes_list.append(Scope(path, ""))
        return path, tuple(scopes_list)
    return None, ()


def _literal_list(text: str | None) -> list[str] | None:
    if not text:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return [str(v) for v in value] if isinstance(value, list) else None


def _dtype_name(elem_type: int) -> str:
    onnx = _import_onnx()
    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        return "unknown"


def _attr_value(attr: Any) -> Any:
    onnx = _import_onnx()
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return list(value)
    return None  # tensors and subgraphs are not display attributes


def _inferred_value_info(proto: onnx.ModelProto, declared: bool = True) -> list[Any]:
    """Shapes of the values the model itself does not describe, from ONNX shape inference.

    Inference runs on a copy without the weights' data (weights become typed inputs):
    serialising hundreds of megabytes of weights would cost more than the comparison.
    With ``declared=False`` what the model says of its node outputs (``value_info``, the
    graph outputs' types) is left out, and every node output comes back as ONNX infers it.
    """
    onnx = _import_onnx()
    g = proto.graph
    known = {vi.name for vi in [*g.input, *g.value_info, *g.output]} | {i.name for i in g.initializer}
    if declared and all(o in known for n in g.node for o in n.output if o):
        return []
    value_info = list(g.value_info) if declared else []
    outputs = list(g.output) if declared else [onnx.ValueInfoProto(name=o.name) for o in g.output]
    small = [i for i in g.initializer if _numel(i.dims) <= 64]  # shape constants: inference reads them
    large = [
        onnx.helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
        for i in g.initializer if _numel(i.dims) > 64
    ]
    light = onnx.helper.make_model(
        onnx.helper.make_graph(list(g.node), g.name, [*g.input, *large], outputs,
                               initializer=small, value_info=value_info),
        opset_imports=list(proto.opset_import),
        functions=list(proto.functions),
        ir_version=proto.ir_version,
    )
    try:
        inferred = onnx.shape_inference.infer_shapes(light).graph
    except Exception:  # a model shape inference cannot follow still has a topology
        return []
    return list(inferred.value_info) + ([] if declared else list(inferred.output))


def _numel(dims: Any) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def _read_only_as_shapes(g: Any) -> dict[int, str]:
    """Nodes (by index) whose every result is read only as a shape, with the name of the op reading it.

    torchlib's indexing computes a broadcast shape as ``Shape(Max(arange, argmax))``: the
    Max is fed by data but nothing the model computes reads its values.
    """
    readers: dict[str, list[tuple[int, int]]] = {}
    for i, node in enumerate(g.node):
        for k, name in enumerate(node.input):
            if name:
                readers.setdefault(name, []).append((i, k))
    outputs = {o.name for o in g.output}
    found: dict[int, str] = {}
    for i in range(len(g.node) - 1, -1, -1):  # readers before the nodes they read
        node = g.node[i]
        shape_readers: list[str] = []
        for out in node.output:
            if not out:
                continue
            if out in outputs or not readers.get(out):
                shape_readers = []
                break
            for j, k in readers[out]:
                reader = g.node[j]
                slots = _SHAPE_INPUTS.get(reader.op_type, frozenset())
                if reader.op_type in _SHAPE_OPS or slots is None or k in slots:
                    shape_readers.append(reader.name or f"{reader.op_type}_{j}")
                elif j in found:
                    shape_readers.append(found[j])
                else:
                    shape_readers = []
                    break
            if not shape_readers:
                break
        if shape_readers:
            found[i] = shape_readers[0]
    return found


def _outer_reads(node: Any) -> list[str]:
    """The values of the enclosing graph that an If's or a Loop's subgraphs read: its data inputs too.

    The TorchScript exporter puts a scripted function (torchvision's ``batched_nms``) in an If
    whose only input is its condition; the boxes it works on are read from inside.
    """
    reads: list[str] = []
    for a in node.attribute:
        for sub in [a.g] if a.HasField("g") else list(a.graphs):
            made = {v.name for v in sub.input} | {t.name for t in sub.initializer}
            for inner in sub.node:
                for name in [*inner.input, *_outer_reads(inner)]:
                    if name and name not in made and name not in reads:
                        reads.append(name)
                made.update(inner.output)
    return reads


def onnx_graph(proto: onnx.ModelProto | str | os.PathLike[str], *, prune: bool = False) -> Graph:
    """An ONNX model as a :class:`~fwdtrace.Graph`: one node per ONNX node, edges by value.

    >>> import torch, fwdtrace
    >>> proto = fwdtrace.export_onnx(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()),
    ...                              torch.ones(1, 4), exporter="torchscript")
    >>> [(n.kind, n.target) for n in fwdtrace.onnx_graph(proto).nodes]
    [('input', 'input'), ('function', 'onnx.Gemm'), ('function', 'onnx.Relu'), ('output', 'output')]

    Graph inputs become input nodes and graph outputs one output node. Value names map
    to ``obj_id`` s 0, 1, 2, ... in first-seen order; initializers are parameters
    (``TensorRef.param`` is their name). ``module_path`` is the module scope the exporter
    recorded, if any. ``meta`` holds ``onnx_name``, ``op_type`` and ``data`` (False for
    constants and shape arithmetic, which ``prune=True`` leaves out) and ``shape_only``
    (why, for an op fed by data whose results are read only as shapes) and ``unknown_rank``
    (the indices of outputs whose rank neither the model nor inference states: their shape
    reads ``()``, which is no scalar). Shapes come from ONNX
    shape inference; unknown dimensions are -1. A file with external data is read without
    the weights' bytes (only the few small tensors shape inference reads).
    """
    onnx = _import_onnx()
    if isinstance(proto, (str, os.PathLike)):
        file = os.fspath(proto)
        loaded = onnx.load(file, load_external_data=False)
        _load_small_external_data(loaded, os.path.dirname(os.path.abspath(file)))
        proto = loaded
    if not isinstance(proto, onnx.ModelProto):
        raise FwdtraceError(f"onnx_graph() expected an onnx.ModelProto or a path to a .onnx file, got {describe(proto)}")
    g = proto.graph
    info: dict[str, tuple[tuple[int, ...], str]] = {}
    ranked: set[str] = set()  # values whose rank is known: the others read () and are not scalars
    for vi in [*g.input, *g.value_info, *g.output, *_inferred_value_info(proto)]:
        t = vi.type.tensor_type
        if vi.name in ranked and not t.HasField("shape"):
            continue  # what inference could not follow does not hide what the model states
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
        info[vi.name] = (dims, _dtype_name(t.elem_type))
        if t.HasField("shape"):
            ranked.add(vi.name)
    initializers = {init.name: init for init in g.initializer}
    for name, init in initializers.items():
        info[name] = (tuple(init.dims), _dtype_name(init.data_type))
        ranked.add(name)

    name2id: dict[str, int] = {}

    def ref(name: str) -> TensorRef:
        obj = name2id.setdefault(name, len(name2id))
        shape, dtype = info.get(name, ((), "unknown"))
        return TensorRef(obj, shape, dtype, name if name in initializers else None)

    shape_only = _read_only_as_shapes(g)
    graph = Graph()
    data_values: set[str] = set()
    for vi in g.input:
        if vi.name in initializers:  # old exports list initializers as inputs too
            continue
        data_values.add(vi.name)
        # the node name is made unique and dot-free (input.1 -> input_1): the name to feed is kept apart
        graph.add_node("input", "input", name=vi.name, outputs=[ref(vi.name)], meta={"onnx_name": vi.name})
    for i, node in enumerate(g.node):
        reads = [n for n in node.input if n]
        reads += [n for n in _outer_reads(node) if n not in reads]
        data = node.op_type not in _SHAPE_OPS and any(n in data_values for n in reads)
        if data:
            data_values.update(o for o in node.output if o)
        if prune and not data:
            continue
        meta: dict[str, Any] = {}
        if data and node.output and i in shape_only:
            meta["shape_only"] = f"shape arithmetic: its result is read only as a shape, by {shape_only[i]}"
        if unranked := [j for j, o in enumerate(o for o in node.output if o) if o not in ranked]:
            meta["unknown_rank"] = unranked
        scope_path, scopes = onnx_scope(node)
        if call := next((p.value for p in node.metadata_props if p.key == CALL_KEY), None):
            meta["call"] = call
        domain = node.domain if node.domain not in ("", "ai.onnx") else "onnx"
        attrs = {a.name: v for a in node.attribute if (v := _attr_value(a)) is not None}
        graph.add_node(
            "function",
            f"{domain}.{node.op_type}",
            name=node.name or f"{node.op_type}_{i}",
            module_path=scope_path or "",
            inputs=[ref(n) for n in reads],
            outputs=[ref(n) for n in node.output if n],
            attrs=attrs,
            scope=scopes,
            meta={"onnx_name": node.name or f"{node.op_type}_{i}", "op_type": node.op_type, "data": data,
                  "scope": scope_path, "input_names": reads, "output_names": [o for o in node.output if o], **meta},
        )
    graph.add_node("output", "output", inputs=[ref(o.name) for o in g.output], meta={"names": [o.name for o in g.output]})
    return graph
