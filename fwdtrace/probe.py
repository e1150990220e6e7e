"""Probes: hooks addressed by module key, to look inside a model, change it or break it on purpose.

A key may also be a hooked function's (``"model.layers.0.self_attn.eager_attention_forward"``, see
:mod:`fwdtrace.instrument.keys`): its hooks are :class:`fwdtrace.instrument.calls.FunctionSite` hooks, which run on that
function's calls as torch's hooks run on a module's, so every probe method takes either.

Every hook a :class:`Probe` adds is attached through :mod:`fwdtrace.instrument.attach` and kept in a
:class:`Hooks` handle, so it
can be removed alone (``handle.remove()``) or with all others (``probe.remove()``, or
leaving ``with Probe(model) as probe:``, exceptions included). While the ``with`` block
is active, an error raised in any layer gets the core's note naming that layer.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable
from typing import IO, Any

import torch
import torch.nn.functional as F

from ._tree import tensors_of
from .chaos import Chaos
from .errors import FwdtraceError, check_callback, describe
from .instrument.attach import Attachment, attach
from .instrument.calls import FunctionSite, ModelCalls
from .instrument.compiled import compiled_parts, eager_module, graph_routable
from .instrument.ingraph import StatsSlot
from .instrument.keys import Selector, key2module, select_keys
from .instrument.stats import RunningStats, check_bins, check_has_values, check_range, summary_text
from .patching import InterruptGuard, critical, guarded_enter, guarded_exit
from .registry import FunctionTarget, resolve_any
from .tracer import add_function_handlers, layer_notes, remove_handlers

__all__ = ["Probe", "Hooks", "Match", "StatsHandle", "ChaosHandle"]

_KINDS = ("input", "output", "grad_input", "grad_output")


def _check_file(file: Any, caller: str) -> None:
    if file is not None and not callable(getattr(file, "write", None)):
        raise FwdtraceError(
            f"{caller} expected file as an open text file (with .write) or None, got {describe(file)} {file!r}"
        )


def _check_bool(value: Any, name: str, caller: str) -> None:
    if not isinstance(value, bool):
        raise FwdtraceError(f"{caller} expected {name} as a bool, got {describe(value)}")


class Hooks:
    """Removable torch hooks added by one probe call; ``remove()`` takes them all off.

    >>> import torch, fwdtrace
    >>> probe = fwdtrace.Probe(torch.nn.Sequential(torch.nn.ReLU()))
    >>> handle = probe.replace_output("0.ReLU", lambda m, i, o: o + 1)
    >>> handle.remove(); len(probe.handles)
    0
    """

    def __init__(self, probe: Probe, keys: list[str]) -> None:
        self.probe = probe
        self.keys = keys
        # (register, key, module): register(attachment, key, module) adds that key's hooks to the attachment
        self._registrations: list[tuple[Callable[[Attachment, str, Any], Any], str, Any]] = []
        self._attachment: Attachment | None = None
        self.in_graph = False  # whether the hooks run inside a compiled model's graph (else it runs eagerly)

    def _can_run_in_graph(self) -> bool:
        return False

    # Attaching and removing are critical sections: a Ctrl-C waits, so no hook is left on untracked.
    def _attach(self) -> None:
        with critical():
            if self._attachment is None and self._registrations:
                self.in_graph = self._can_run_in_graph()
                # While attached, a compiled model's compiled parts run eagerly, so these hooks run; hooks
                # that dynamo can trace run in a compiled copy of them instead.
                attachment = Attachment(self.probe.model, "Probe", "graph" if self.in_graph else "eager")
                try:
                    for register, key, module in self._registrations:
                        register(attachment, key, module)
                except BaseException:
                    attachment.remove()
                    raise
                self._attachment = attachment

    def _detach(self) -> None:
        with critical():
            attachment, self._attachment = self._attachment, None
            if attachment is not None:
                attachment.remove()

    def remove(self) -> None:
        """Remove every hook of this handle; calling it twice is harmless."""
        with critical():
            self._detach()
            self._registrations.clear()
            if self in self.probe.handles:
                self.probe.handles.remove(self)

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.keys)})"


class _FunctionHooks:
    """A probe's handles on function dispatch points, removable as one torch hook handle is."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        remove_handlers(self.handles)


class StatsHandle(Hooks):
    """Running statistics per module key (:class:`~fwdtrace.instrument.stats.RunningStats`), across calls and steps."""

    def __init__(self, probe: Probe, keys: list[str], of: str) -> None:
        super().__init__(probe, keys)
        self.of = of
        self.stats: dict[str, RunningStats] = {}

    def _can_run_in_graph(self) -> bool:
        # Forward statistics are tensor ops dynamo traces; gradient hooks and hooked functions' dispatch
        # points run outside compiled graphs.
        return (
            self.of in ("input", "output")
            and not any(isinstance(module, FunctionSite) for _, _, module in self._registrations)
            and graph_routable(self.probe.model)
        )

    def __repr__(self) -> str:
        if not compiled_parts(self.probe.model):
            runs = ""
        elif self.in_graph and self._attachment is not None and self._attachment.eager_why():
            runs = f"; computed eagerly: {'; '.join(self._attachment.eager_why())}"
        elif self.in_graph:
            runs = "; computed inside the compiled graphs"
        else:
            runs = "; the compiled parts run eagerly while attached"
        return f"{type(self).__name__}({', '.join(self.keys)}; of={self.of}{runs})"

    def summary(self) -> dict[str, dict[str, Any]]:
        """``{key: {"mean": ..., "std": ..., ...}}`` for every key seen so far."""
        return {k: s.to_dict() for k, s in self.stats.items()}

    def to_tensorboard(self, writer: Any, step: int) -> None:
        """Write the statistics as they stand to TensorBoard at ``step`` (a ``SummaryWriter`` or a log
        folder): per key a histogram and mean/std/nan/inf, see :func:`fwdtrace.tensorboard.add_running_stats`."""
        from .tensorboard import add_running_stats, summary_writer

        made, owned = summary_writer(writer, "to_tensorboard()")
        try:
            add_running_stats(made, self, step)
        finally:
            (made.close if owned else made.flush)()


class ChaosHandle(Hooks):
    """The hooks of one :meth:`Probe.chaos` call; ``log`` lists every fault injected."""

    def __init__(self, probe: Probe, keys: list[str], chaos: Chaos) -> None:
        super().__init__(probe, keys)
        self.chaos = chaos

    @property
    def log(self) -> list[Any]:
        return self.chaos.log


class Match(Hooks):
    """Teacher and student outputs captured at paired keys, for a feature-distillation loss.

    ``teacher_outputs`` are detached; ``student_outputs`` keep their graph, so
    :meth:`loss` trains the student towards the teacher's features.
    """

    def __init__(self, probe: Probe, pairs: list[tuple[str, str]]) -> None:
        super().__init__(probe, [])
        self.pairs = pairs
        self.teacher_outputs: dict[str, torch.Tensor] = {}
        self.student_outputs: dict[str, torch.Tensor] = {}
        self.teacher_hooks: Hooks | None = None

    def loss(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Sum over the pairs of ``fn(student_output, teacher_output)``, MSE by default."""
        if fn is not None:
            check_callback(fn, "Match.loss()", "(student_output, teacher_output)")
        fn = fn or F.mse_loss
        missing = [s for s, t in self.pairs if s not in self.student_outputs or t not in self.teacher_outputs]
        if missing:
            raise FwdtraceError(
                "Match.loss() expected the outputs of both models at every pair (run the teacher "
                f"and the student forward first), got none yet for student keys {missing}"
            )
        total: torch.Tensor | None = None
        for s, t in self.pairs:
            a, b = self.student_outputs[s], self.teacher_outputs[t]
            if fn is F.mse_loss and a.shape != b.shape:
                raise FwdtraceError(
                    f"Match.loss() expected student '{s}' and teacher '{t}' outputs of one shape, got "
                    f"{list(a.shape)} and {list(b.shape)}; pass fn= with a projection"
                )
            term = fn(a, b)
            total = term if total is None else total + term
        assert total is not None
        return total

    def remove(self) -> None:
        if self.teacher_hooks is not None:
            self.teacher_hooks.remove()
        super().remove()


class Probe:
    """Hooks on a model, addressed by module key (``"seq.0.Conv2d"``), a glob or a class.

    >>> import torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU())
    >>> with fwdtrace.Probe(model, name="net") as probe:
    ...     probe.shapes(torch.ones(3, 4))["0.Linear"]
    {'input_shape': [[3, 4]], 'output_shape': [[3, 2]]}

    ``probe.keys`` lists the keys, children before parents, the root (its class name) last.
    Every selector also takes the keys of functions hooked by path (``register_atomic(path)``):
    ``"model.layers.0.self_attn.eager_attention_forward"``, a glob, or the function itself; their
    hooks get the calling module and the function's arguments (:class:`fwdtrace.instrument.calls.FunctionSite`).
    Set ``probe.enabled = False`` to switch every hook of the probe off without removing it.
    """

    def __init__(self, model: torch.nn.Module, name: str | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise FwdtraceError(f"Probe expected a torch.nn.Module as model, got {describe(model)}")
        if name is not None and not isinstance(name, str):
            raise FwdtraceError(f"Probe expected name as a str or None, got {describe(name)}")
        self.model = model
        self.name = name
        self._enabled = True
        self.handles: list[Hooks] = []
        self._key2module = key2module(model)
        self._module2key = {id(m): k for k, m in self._key2module.items()}
        self._calls = ModelCalls(model)
        self._notes: contextlib.ExitStack | None = None
        self._guard: InterruptGuard | None = None

    @property
    def keys(self) -> list[str]:
        return list(self._key2module)

    @property
    def enabled(self) -> bool:
        """Whether the probe's hooks run. Disabling takes its torch hooks off the modules (so a
        disabled probe costs a forward nothing) and enabling puts them back, state kept."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        for handle in self.handles:
            if self._enabled:
                handle._attach()
            else:
                handle._detach()

    # -- lifetime ---------------------------------------------------------------------------------
    # Ctrl-C (a notebook interrupt) is held back as in a trace: entering and leaving happen whole.
    def __enter__(self) -> Probe:
        self._guard = guarded_enter(_PROBE_CODE, self._add_notes, self._leave)
        return self

    def __exit__(self, *exc: object) -> None:
        guard, self._guard = self._guard, None
        guarded_exit(guard, self._leave)

    def _add_notes(self) -> None:
        self._notes = contextlib.ExitStack()
        self._notes.enter_context(layer_notes(self.model))

    def _leave(self) -> None:
        self.remove()
        # Only here, so nested probes restore Module.__call__ last in, first out.
        if self._notes is not None:
            self._notes.close()
            self._notes = None

    def remove(self) -> None:
        """Remove every hook this probe added; the probe stays usable."""
        with critical():
            while self.handles:
                self.handles[-1].remove()

    # -- selection --------------------------------------------------------------------------------
    def select(self, selector: Selector) -> dict[str, torch.nn.Module | FunctionSite]:
        """The modules a selector names, by key: a key, a glob (``"seq.*.Conv2d"``), a class, or a list of them.

        >>> import torch, fwdtrace
        >>> probe = fwdtrace.Probe(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        >>> list(probe.select(torch.nn.ReLU)), list(probe.select("*.Linear"))
        (['1.ReLU'], ['0.Linear'])

        Function keys are selected too (:func:`fwdtrace.instrument.keys.select_keys`): a key or glob
        matches those of the functions registered with ``hook_forward``/``register_atomic``,
        one per module path where they may be called (``"*.eager_attention_forward"``), and a
        function or method itself selects all of its keys; they come as
        :class:`~fwdtrace.instrument.calls.FunctionSite` objects.
        """
        return select_keys(self._key2module, selector, "Probe", type(eager_module(self.model)).__name__, self._calls)

    def _one(self, selector: Selector, what: str) -> str:
        found = self.select(selector)
        if len(found) != 1:
            raise FwdtraceError(f"{what} expected a selector naming exactly one module, got {selector!r} naming {list(found)}")
        return next(iter(found))

    def _add(self, handle: Hooks, register: Callable[[Attachment, str, Any], Any], selector: Selector) -> Any:
        """Call ``register(attachment, key, module)`` for every selected module or function site (now, or when
        the probe is enabled): it adds that key's hooks to the handle's :class:`~fwdtrace.instrument.attach.Attachment`."""
        for key, module in self.select(selector).items():
            handle.keys.append(key)
            handle._registrations.append((register, key, module))
        return self._track(handle)

    def _track(self, handle: Hooks) -> Any:
        with critical():  # attached and tracked, or neither
            if self._enabled:
                handle._attach()
            self.handles.append(handle)
        return handle

    # -- shapes -----------------------------------------------------------------------------------
    def shapes(self, *args: Any, **kwargs: Any) -> dict[str, dict[str, list[list[int]]]]:
        """Run the model once (without grad) and return the tensor shapes every module saw.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
        >>> fwdtrace.Probe(model, name="net").shapes(torch.ones(1, 4))
        {'0.Linear': {'input_shape': [[1, 4]], 'output_shape': [[1, 2]]}, 'net': {'input_shape': [[1, 4]], 'output_shape': [[1, 2]]}}

        Keys come in the order modules finish, so the root comes last: under ``name`` when
        the probe has one, else under its class name. A module called several times reports
        its first call. The calls of functions registered with ``hook_forward``/``register_atomic``
        are there under their keys (``"layers.0.attn.eager_attention_forward"``), before the
        module that made them. Only tensors count; the result is JSON-serialisable.
        """
        out: dict[str, dict[str, list[list[int]]]] = {}

        def record(key: str) -> Callable[..., None]:
            def hook(module: torch.nn.Module, a: tuple, kw: dict, result: Any) -> None:
                if key not in out:
                    out[key] = {
                        "input_shape": [list(t.shape) for t in tensors_of((a, kw))],
                        "output_shape": [list(t.shape) for t in tensors_of(result)],
                    }

            return hook

        hooked: dict[str, Any] = {**self._key2module, **self._calls.registered_sites()}
        handles: list[Any] = []

        def attach_all() -> None:
            handles.append(attach(self.model, hooked, caller="Probe.shapes()", post=lambda k, m: record(k), with_kwargs=True))

        def detach() -> None:
            while handles:
                handles.pop().remove()

        # A Ctrl-C that lands between attaching and the forward, or on the clean-up, waits for it:
        # the eager route patches nn.Module._call_impl, which must never stay behind.
        guard = guarded_enter(_SHAPES_CODE, attach_all, detach)
        try:
            with layer_notes(self.model), torch.no_grad():
                self.model(*args, **kwargs)
        finally:
            guarded_exit(guard, detach)
        root = next(reversed(self._key2module))
        if self.name is not None and root in out:
            out[self.name] = out.pop(root)
        return out

    # -- printing ---------------------------------------------------------------------------------
    def print_io(self, selector: Selector, values: bool = False, file: IO[str] | None = None) -> Hooks:
        """Print each selected module's inputs and outputs on every forward: shape, dtype, statistics.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.ReLU())
        >>> with fwdtrace.Probe(model) as probe:
        ...     _ = probe.print_io("0.ReLU")
        ...     _ = model(torch.tensor([-1.0, 1.0]))
        0.ReLU forward call 0
          input0  float32[2] mean=0 std=1 min=-1 max=1
          output0 float32[2] mean=0.5 std=0.5 min=0 max=1

        ``values=True`` prints the full tensors too.
        """
        _check_bool(values, "values", "print_io()")
        _check_file(file, "print_io()")
        calls: dict[str, int] = {}

        def register(on: Attachment, key: str, module: torch.nn.Module) -> Any:
            def hook(m: torch.nn.Module, a: tuple, kw: dict, result: Any) -> None:
                n = calls[key] = calls.get(key, -1) + 1
                lines = [f"{key} forward call {n}"]
                lines += [f"  input{i}  {summary_text(t, values)}" for i, t in enumerate(tensors_of((a, kw)))]
                lines += [f"  output{i} {summary_text(t, values)}" for i, t in enumerate(tensors_of(result))]
                print("\n".join(lines), file=file or sys.stdout)

            return on.forward(module, hook, with_kwargs=True)

        return self._add(Hooks(self, []), register, selector)

    def print_grads(self, selector: Selector, values: bool = False, file: IO[str] | None = None) -> Hooks:
        """Print each selected module's grad_input and grad_output on every backward.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 1))
        >>> with fwdtrace.Probe(model) as probe:
        ...     _ = probe.print_grads("0.Linear")
        ...     model(torch.ones(1, 2, requires_grad=True)).sum().backward()  # doctest: +ELLIPSIS
        0.Linear backward call 0
          grad_input0  float32[1, 2] ...
          grad_output0 float32[1, 1] mean=1 std=0 min=1 max=1

        Gradients come from tensor hooks (:func:`fwdtrace.instrument.grads.register_grad_hook`), safe beside
        in-place ops; ``grad_input`` is each positional argument's (its gradient over all its uses),
        ``grad_output`` each tensor of the output. A ``None`` gradient (an input that needs none) prints as None.
        """
        _check_bool(values, "values", "print_grads()")
        _check_file(file, "print_grads()")
        calls: dict[str, int] = {}

        def register(on: Attachment, key: str, module: torch.nn.Module) -> Any:
            def hook(m: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> None:
                if not self.enabled:  # a forward run while enabled keeps its backward hooks
                    return
                n = calls[key] = calls.get(key, -1) + 1
                lines = [f"{key} backward call {n}"]
                lines += [f"  grad_input{i}  {summary_text(t, values)}" for i, t in enumerate(grad_input)]
                lines += [f"  grad_output{i} {summary_text(t, values)}" for i, t in enumerate(grad_output)]
                print("\n".join(lines), file=file or sys.stdout)

            return on.grads(module, hook)

        return self._add(Hooks(self, []), register, selector)

    # -- injection --------------------------------------------------------------------------------
    def replace_input(self, selector: Selector, fn: Callable[[torch.nn.Module, tuple, None], Any]) -> Hooks:
        """Replace the positional inputs of the selected modules with ``fn(module, inputs, None)``.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.ReLU())
        >>> with fwdtrace.Probe(model) as probe:
        ...     _ = probe.replace_input("0.ReLU", lambda m, inputs, output: (-inputs[0],))
        ...     model(torch.tensor([-2.0]))
        tensor([2.])

        ``fn`` has ``@hook_forward``'s signature (the output is None: it is not computed yet);
        it returns the new inputs (a tuple, or one tensor), or None to keep them.
        """
        check_callback(fn, "replace_input()", "(module, inputs, None)")

        def register(on: Attachment, key: str, module: torch.nn.Module) -> Any:
            def hook(m: torch.nn.Module, inputs: tuple) -> Any:
                return fn(m, inputs, None)

            return on.forward_pre(module, hook)

        return self._add(Hooks(self, []), register, selector)

    def replace_output(self, selector: Selector, fn: Callable[[torch.nn.Module, tuple, Any], Any]) -> Hooks:
        """Replace the output of the selected modules with ``fn(module, inputs, output)`` (None keeps it).

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.ReLU())
        >>> with fwdtrace.Probe(model) as probe:
        ...     _ = probe.replace_output("0.ReLU", lambda m, inputs, output: output * 10)
        ...     model(torch.tensor([2.0]))
        tensor([20.])
        """
        check_callback(fn, "replace_output()", "(module, inputs, output)")

        def register(on: Attachment, key: str, module: torch.nn.Module) -> Any:
            def hook(m: torch.nn.Module, inputs: tuple, output: Any) -> Any:
                return fn(m, inputs, output)

            return on.forward(module, hook)

        return self._add(Hooks(self, []), register, selector)

    def replace_grad(self, selector: Selector, fn: Callable[[torch.nn.Module, tuple, tuple], Any]) -> Hooks:
        """Replace the gradient a module passes back to its inputs: ``fn(module, grad_input, grad_output)``.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.ReLU())
        >>> x = torch.tensor([-1.0, 1.0], requires_grad=True)
        >>> with fwdtrace.Probe(model) as probe:
        ...     _ = probe.replace_grad("0.ReLU", lambda m, gin, gout: gout)  # straight-through
        ...     model(x).sum().backward()
        >>> x.grad
        tensor([1., 1.])

        ``fn`` returns the new grad_input (a tuple like grad_input, or one tensor), or None
        to keep it: a custom gradient without writing an autograd.Function. With one input
        needing a gradient (the usual layer) the replacement is made by a tensor hook on that
        input, safe beside in-place ops; it replaces the gradient flowing on from the input, so
        where that input also feeds another branch, that branch's share is replaced too. With
        several such inputs their gradients arrive at different times, so that call goes through
        torch's own ``BackwardHook`` (exact, but an in-place op on those inputs or outputs then raises, as torch's does).
        """
        check_callback(fn, "replace_grad()", "(module, grad_input, grad_output)")

        def register(on: Attachment, key: str, module: torch.nn.Module) -> Any:
            def hook(m: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> Any:
                if not self.enabled:
                    return None
                new = fn(m, grad_input, grad_output)
                if isinstance(new, torch.Tensor):
                    new = (new,)
                if new is not None and len(new) != len(grad_input):
                    raise FwdtraceError(
                        f"replace_grad() expected fn to return {len(grad_input)} gradient(s) for '{key}', "
                        f"got {len(new)}"
                    )
                return tuple(new) if new is not None else None

            return on.grads(module, hook, replace=True)

        return self._add(Hooks(self, []), register, selector)

    def hook_function(self, target: Any, fn: Callable[[tuple, dict, Any], Any]) -> Hooks:
        """Run ``fn(inputs, kwargs, output)`` after every call of a function or method; non-None replaces the output.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.SiLU())
        >>> with fwdtrace.Probe(model) as probe:
        ...     _ = probe.hook_function("torch.nn.functional.silu", lambda inputs, kwargs, output: output * 0)
        ...     model(torch.ones(2))
        tensor([0., 0.])

        ``target`` is what :func:`fwdtrace.hook_forward` takes for a function (a dotted path,
        ``"pkg.Class.method"``, or the function itself); the handle's key is its path. The
        attribute holding it is patched while the hook is on (in every thread, as torch's
        hooks are), sharing its one wrapper with traces and other probes; removing the
        handle, or leaving the probe, puts the original back once nothing else uses it.
        """
        check_callback(fn, "hook_function()", "(inputs, kwargs, output)")
        found = resolve_any(target, "Probe.hook_function()")
        if not isinstance(found, FunctionTarget):
            raise FwdtraceError(
                f"Probe.hook_function() expected a function or method, got the layer class {found.__qualname__}; "
                "use replace_output() with its module key"
            )

        def on_call(call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            out = call(*args, **kwargs)
            replaced = fn(args, kwargs, out)
            return out if replaced is None else replaced

        def register(on: Attachment, key: str, module: Any) -> Any:
            return on.add(_FunctionHooks(add_function_handlers(lambda _: on_call, all_threads=True, targets=[found])))

        handle = Hooks(self, [found.path])
        handle._registrations.append((register, found.path, None))
        return self._track(handle)

    # -- teacher / student ------------------------------------------------------------------------
    def match(self, teacher: Probe, pairs: dict[str, str] | Iterable[tuple[Selector, Selector]]) -> Match:
        """Capture this (student) model's and ``teacher``'s outputs at paired keys, for a distillation loss.

        >>> import torch, fwdtrace
        >>> student, teacher = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> with fwdtrace.Probe(student) as s, fwdtrace.Probe(teacher) as t:
        ...     m = s.match(t, {"0.Linear": "0.Linear"})
        ...     _ = teacher(torch.ones(1, 2)), student(torch.ones(1, 2))
        ...     m.loss().ndim
        0

        ``pairs`` maps student selectors to teacher selectors, each naming one module.
        """
        if not isinstance(teacher, Probe):
            raise FwdtraceError(f"match() expected the teacher as a fwdtrace.Probe, got {describe(teacher)}")
        items = pairs.items() if isinstance(pairs, dict) else pairs
        resolved = [(self._one(s, "match()"), teacher._one(t, "match()")) for s, t in items]
        if not resolved:
            raise FwdtraceError("match() expected at least one (student key, teacher key) pair, got none")
        handle = Match(self, resolved)

        def capture(store: dict[str, torch.Tensor], detach: bool) -> Callable[[Attachment, str, torch.nn.Module], Any]:
            def register(on: Attachment, key: str, module: torch.nn.Module) -> Any:
                def hook(m: torch.nn.Module, inputs: tuple, output: Any) -> None:
                    t = tensors_of(output)[0]
                    store[key] = t.detach() if detach else t

                return on.forward(module, hook)

            return register

        handle.teacher_hooks = teacher._add(
            Hooks(teacher, []), capture(handle.teacher_outputs, True), [t for _, t in resolved]
        )
        return self._add(handle, capture(handle.student_outputs, False), [s for s, _ in resolved])

    # -- chaos ------------------------------------------------------------------------------------
    def chaos(
        self, selector: Selector, fault: str = "nan", p: float = 1.0, seed: int = 0, scale: float = 0.1
    ) -> ChaosHandle:
        """Inject a fault into the output of the selected modules, each call with probability ``p``.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> with fwdtrace.Probe(model) as probe:
        ...     chaos = probe.chaos("0.Linear", fault="inf", p=1.0, seed=0)
        ...     int(model(torch.ones(1, 4)).isinf().sum()), chaos.log[0].key
        (1, '0.Linear')

        Faults: ``nan``/``inf`` (one random element), ``zero`` (the whole output), ``noise``
        (Gaussian, std ``scale``), ``bitflip`` (one random bit of one element), ``skip`` (the
        layer's input passes through). The same seed and calls give the same faults;
        ``handle.log`` lists them as :class:`~fwdtrace.chaos.Injection` records.
        """
        engine = Chaos(fault, p=p, seed=seed, scale=scale)

        def register(on: Attachment, key: str, module: torch.nn.Module) -> Any:
            def hook(m: torch.nn.Module, inputs: tuple, output: Any) -> Any:
                return engine.apply(key, m, inputs, output)

            return on.forward(module, hook)

        return self._add(ChaosHandle(self, [], engine), register, selector)

    # -- statistics -------------------------------------------------------------------------------
    def weight_stats(self, selector: Selector = "*", bins: int = 16) -> dict[str, dict[str, dict[str, Any]]]:
        """``{key: {param_name: statistics}}`` of the selected modules' own parameters.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> torch.nn.init.ones_(model[0].weight)
        Parameter containing:
        tensor([[1., 1.],
                [1., 1.]], requires_grad=True)
        >>> fwdtrace.Probe(model).weight_stats("0.Linear")["0.Linear"]["weight"]["l2"]
        2.0

        Modules without parameters of their own (and function keys) are left out; see
        :meth:`~fwdtrace.instrument.stats.RunningStats.to_dict` for the statistics.
        """
        check_bins(bins)
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for key, module in self.select(selector).items():
            if isinstance(module, FunctionSite):
                continue
            params = {}
            for name, p in module.named_parameters(recurse=False):
                s = RunningStats(bins)
                s.update(p)
                params[name] = s.to_dict()
            if params:
                out[key] = params
        return out

    def running_stats(
        self, selector: Selector, of: str = "output", bins: int = 16, range: tuple[float, float] | None = None  # noqa: A002
    ) -> StatsHandle:
        """Keep running statistics of the selected modules' activations or gradients across steps.

        >>> import torch, fwdtrace
        >>> model = torch.nn.Sequential(torch.nn.ReLU())
        >>> with fwdtrace.Probe(model) as probe:
        ...     stats = probe.running_stats("0.ReLU", of="output")
        ...     _ = model(torch.tensor([-1.0, 1.0])); _ = model(torch.tensor([3.0]))
        ...     round(stats.stats["0.ReLU"].mean, 4), stats.stats["0.ReLU"].zero_fraction
        (1.3333, 0.3333333333333333)

        ``of`` is ``input``, ``output``, ``grad_input`` or ``grad_output``; every tensor of
        every call is summarised by :mod:`fwdtrace.statistics` and merged into one
        :class:`~fwdtrace.instrument.stats.RunningStats` per key, at a cost per call proportional to the
        tensors' size and independent of the steps before. The histogram has ``bins`` power-of-two bins
        that widen as values arrive, or ``bins`` equal bins over ``range`` (values outside counted apart).
        """
        if of not in _KINDS:
            raise FwdtraceError(f"running_stats() expected of= one of {', '.join(_KINDS)}, got {of!r}")
        try:  # checked now, not in the next forward
            check_bins(bins)
            check_range(range)
        except FwdtraceError as e:
            raise FwdtraceError(f"running_stats(){str(e).removeprefix('RunningStats')}") from None
        handle = StatsHandle(self, [], of)
        created = threading.Lock()  # hooks may run in several threads: one RunningStats per key

        def add(key: str, tensors: Iterable[Any]) -> None:
            stats = handle.stats.get(key)
            if stats is None:
                with created:
                    stats = handle.stats.get(key)
                    if stats is None:
                        stats = handle.stats[key] = RunningStats(bins, range)
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    check_has_values(t, f"Probe.running_stats() of {key!r}")
                    stats.update(t)

        def register(on: Attachment, key: str, module: torch.nn.Module) -> Any:
            if handle.in_graph:  # the statistics are computed in the compiled graph and merged after it

                def publish(key: str = key) -> None:
                    handle.stats.setdefault(key, stats)

                stats = handle.stats.get(key) or RunningStats(bins, range)
                return on.stats(module, StatsSlot(stats, publish, key, reuse=("stats", id(module), of, bins, range)), of)
            if of in ("input", "output"):

                def hook(m: torch.nn.Module, a: tuple, kw: dict, result: Any) -> None:
                    add(key, tensors_of((a, kw)) if of == "input" else tensors_of(result))

                return on.forward(module, hook, with_kwargs=True)

            def grad_hook(m: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> None:
                if self.enabled:
                    add(key, grad_input if of == "grad_input" else grad_output)

            return on.grads(module, grad_hook)

        return self._add(handle, register, selector)

    def __repr__(self) -> str:
        return f"Probe({type(eager_module(self.model)).__name__}, {len(self._key2module)} keys, {len(self.handles)} hook sets)"


_PROBE_CODE = (Probe.__enter__.__code__, Probe.__exit__.__code__)
_SHAPES_CODE = (Probe.shapes.__code__,)
