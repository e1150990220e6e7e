"""Gradients of one module call, safe beside in-place ops: tensor hooks, not module backward hooks.

torch's ``register_full_backward_hook`` wraps a module's inputs and outputs in a custom autograd
function (``BackwardHookFunction``); any in-place op on them afterwards (``ReLU(inplace=True)``
after the layer, or as the layer) then raises in the training loop's forward. So every
gradient fwdtrace takes (dumps, probes, function keys, the recorder, the live sampler) comes
from here instead: a :class:`GradCall` puts plain tensor hooks on a call's inputs (before the
module runs) and outputs (after), and reports both once per backward.

What the hooks see:

- ``grad_output``: the gradient of each output, as torch's full backward hook gives it (a
  hook registered before an in-place op keeps the value's gradient, not the modified one's).
  Outputs are every tensor leaf of the result (:func:`fwdtrace._tree.tensors_of`), so a
  ``ModelOutput``, a dict or nested tuples are hooked too, where torch hooks none.
- ``grad_input``: the gradient of each input *value*, all its uses summed. It equals
  torch's ``grad_input`` when the input feeds only this module (a chain of layers); where
  the same tensor also feeds another branch (a residual ``x + f(x)``) it includes that too.
- Replacing: ``grad_output`` cannot be replaced from here (the module's backward has already
  used it when it is known); :func:`register_grad_hook` with ``replace=True`` replaces the
  ``grad_input`` of a call with one input that needs a gradient through that input's hook
  (the gradient flowing on from it). A call with several such inputs cannot be replaced tensor by
  tensor (each gradient arrives at its own time), so it falls back to torch's own
  ``BackwardHook`` for that call, with torch's limits beside in-place ops.

A leaf input (a tensor created with ``requires_grad=True``) keeps a tensor hook for good, so
its hook is removed once it has fired, or when the call's autograd graph is freed.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import BackwardHook

from .._tree import tensors_of
from ..errors import FwdtraceError

__all__ = ["GradCall", "GradHandle", "register_grad_hook"]

Grads = list[torch.Tensor | None]
_MAX_PENDING = 8  # forwards that raised never reach the forward hook: older pending calls are dropped


class GradCall:
    """The gradients of one call: ``on_grads(grad_input, grad_output)`` once per backward.

    >>> import torch
    >>> from fwdtrace.instrument.grads import GradCall
    >>> x = torch.ones(2, requires_grad=True) * 1  # a non-leaf input
    >>> seen = []
    >>> call = GradCall([x], lambda gin, gout: seen.append((gin, gout)))
    >>> y = x * 3; call.hook_outputs([y]); y.sum().backward()
    >>> seen[0][0][0].tolist(), seen[0][1][0].tolist()
    ([3.0, 3.0], [1.0, 1.0])

    ``inputs`` may hold None (a non-tensor argument): it keeps its place, with a None
    gradient, as does a tensor that needs none or gets none in this backward. ``on_grads`` runs
    once every hooked tensor has its gradient, or when the backward ends (those that got none in
    it are None). ``replace(index, grad_input, grad_output)`` (optional) is called in the hook of
    input ``index`` and returns its new gradient or None. ``on_error(exc)`` (optional) gets what a hook raised instead of the backward.
    """

    # Slots, and containers made when first needed: a dump makes a call per layer and per function each step, and
    # every object alive through the step adds to what Python's collector counts towards a full collection.
    __slots__ = ("__weakref__", "_pending", "active", "done", "leaf_handles", "n_inputs", "n_outputs", "on_error",
                 "on_grads", "replace", "replaced", "slots")

    def __init__(self, inputs: Sequence[torch.Tensor | None], on_grads: Callable[[Grads, Grads], Any],
                 replace: Callable[[int, Grads, Grads], torch.Tensor | None] | None = None,
                 on_error: Callable[[BaseException], Any] | None = None) -> None:
        self.on_grads, self.replace, self.on_error = on_grads, replace, on_error
        self.n_inputs = len(inputs)
        self.slots: tuple[int, ...] = ()  # position (inputs first, then outputs) of each hooked tensor
        self.leaf_handles: list[Any] | None = None
        # per backward pass (graph task) still arriving: its grads and the indices arrived (bits of an int)
        self._pending: dict[int, list[Any]] | None = None
        self.done: tuple[int, ...] = ()  # backward passes reported (a tuple of ints: untracked by the collector)
        self.replaced: set[int] | None = None  # backward passes where replace() ran (it called the user's hook)
        self.active = True
        self.n_outputs = 0
        self._hook(inputs, 0)

    def hook_outputs(self, outputs: Sequence[torch.Tensor | None]) -> None:
        """Hook the call's outputs (after the module ran: ``tensors_of(result)``)."""
        self.n_outputs = len(outputs)
        self._hook(outputs, self.n_inputs)

    def cancel(self) -> None:
        """Report nothing more; take off the hooks left on leaves."""
        self.active = False
        self._unhook_leaves()

    def _unhook_leaves(self) -> None:
        while self.leaf_handles:
            self.leaf_handles.pop().remove()

    def _hook(self, tensors: Sequence[torch.Tensor | None], first: int) -> None:
        # A hook registered on a non-leaf tensor stays with the node its gradient arrives at now: an in-place op
        # later gives the tensor a new node. Only the graph holds the call (through these hooks), and the call
        # holds no node: the graph, its hooks and the call go together once nothing else holds the graph (a
        # node kept here would make a cycle through C++ that Python's collector cannot break, leaking every
        # step's calls and their graphs).
        for position, t in enumerate(tensors, first):
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                continue
            self.slots += (position,)
            if t.grad_fn is None:  # a leaf: the hook lives on the tensor, not on the graph
                if self.leaf_handles is None:
                    self.leaf_handles = []
                self.leaf_handles.append(t.register_hook(functools.partial(_leaf_grad, weakref.ref(self),
                                                                           len(self.slots) - 1)))
                # Nothing else keeps this call alive but its non-leaf hooks (the graph): once
                # the graph is freed no backward can come, and the leaf's hook goes with it.
                weakref.finalize(self, self.leaf_handles[-1].remove)
            else:
                t.register_hook(functools.partial(_on_grad, self, len(self.slots) - 1))

    def _guarded(self, run: Callable[..., torch.Tensor | None], *args: Any) -> torch.Tensor | None:
        """``run(*args)``, what it raises going to ``on_error`` (the call then reports nothing more) where given."""
        try:
            return run(*args)
        except Exception as e:
            if self.on_error is None:
                raise
            self.cancel()
            self.on_error(e)
            return None

    def _arrived(self, index: int, grad: torch.Tensor) -> torch.Tensor | None:
        if not self.active:
            return None
        task = torch._C._current_graph_task_id()
        with _LOCK:
            if task in self.done:
                return None
            if self._pending is None:
                self._pending = {}
            first = task not in self._pending
            entry = self._pending.setdefault(task, [[None] * (self.n_inputs + self.n_outputs), 0])
            grads = entry[0]
            position = self.slots[index]
            # None arrives where autograd has an undefined gradient (torch's BackwardHook passes them on)
            grads[position] = None if grad is None else grad.detach()
            entry[1] |= 1 << index
            complete = entry[1].bit_count() == len(self.slots)
            if complete:
                self._mark_done(task)
            replacing = self.replace is not None and position < self.n_inputs
            if replacing:
                if self.replaced is None:
                    self.replaced = set()
                self.replaced.add(task)
        if first and not complete:
            # Some tensors get no gradient in this backward (an unused output, inputs= given): what arrived is
            # reported when the backward ends, unless the rest arrives first.
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_finish, ref=weakref.ref(self),
                                                                                       task=task))
        new = None
        if replacing:
            assert self.replace is not None
            new = self.replace(position, grads[:self.n_inputs], grads[self.n_inputs:])
            if new is not None:
                grads[position] = new.detach()
        if complete:
            self._report(task, grads)
        return new

    def _mark_done(self, task: int) -> list[Any] | None:
        """Backward pass ``task`` reported (under the lock): its pending ``[grads, arrived]`` taken off, if any."""
        pending = None if self._pending is None else self._pending.pop(task, None)
        if not self._pending:
            self._pending = None
        self.done += (task,)
        return pending

    def _report(self, task: int, grads: Grads) -> None:
        self._unhook_leaves()
        if self.replaced is None or task not in self.replaced:
            self.on_grads(grads[:self.n_inputs], grads[self.n_inputs:])
        if self.replaced is not None:
            self.replaced.discard(task)


_LOCK = threading.Lock()  # the gradients of one call may arrive on several threads (one per device's backward)


def _on_grad(call: GradCall, index: int, grad: torch.Tensor) -> torch.Tensor | None:
    """A non-leaf tensor's hook: its gradient arrived (the graph holds the call through it)."""
    return call._guarded(call._arrived, index, grad)


def _leaf_grad(ref: weakref.ref[GradCall], index: int, grad: torch.Tensor) -> torch.Tensor | None:
    """A leaf's hook, which outlives the graph on the tensor: it holds the call weakly."""
    call = ref()
    return None if call is None else _on_grad(call, index, grad)


def _finish(ref: weakref.ref[GradCall], task: int) -> None:
    """At the end of backward ``task``: report a call whose hooked tensors did not all get a gradient in it."""
    call = ref()
    if call is None or not call.active:
        return
    with _LOCK:
        if call._pending is None or task not in call._pending:
            return
        pending = call._mark_done(task)
    assert pending is not None
    call._guarded(call._report, task, pending[0])


class GradHandle:
    """What :func:`register_grad_hook` returns: ``remove()`` takes its hooks off; pending calls report nothing more."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.calls: weakref.WeakSet[GradCall] = weakref.WeakSet()
        self.local = threading.local()

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()
        for call in list(self.calls):
            call.cancel()

    def pending(self) -> list[Any]:
        stack = self.local.__dict__.setdefault("stack", [])
        return stack


def register_grad_hook(owner: Any, hook: Callable[[Any, tuple, tuple], Any], replace: bool = False,
                       begin: Callable[[Any], Any] | None = None,
                       on_error: Callable[[BaseException], Any] | None = None) -> GradHandle:
    """``hook(module, grad_input, grad_output)`` on every backward of ``owner``'s calls, like
    ``register_full_backward_hook`` but safe beside in-place ops (see the module's notes).

    >>> import torch
    >>> from fwdtrace.instrument.grads import register_grad_hook
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(inplace=True))
    >>> handle = register_grad_hook(model[0], lambda m, gin, gout: print(gout[0].shape))
    >>> model(torch.ones(1, 2)).sum().backward()
    torch.Size([1, 2])
    >>> handle.remove()

    ``owner`` is a module or a :class:`fwdtrace.instrument.calls.FunctionSite` (whose hooks get the calling
    module). ``grad_input`` has one entry per positional argument, as torch's, None where it is no
    tensor or gets no gradient; ``grad_output`` one per tensor leaf of the result (a
    ``ModelOutput`` or dict too). ``replace=True``: a non-None return is the new ``grad_input``
    (a tuple like it, or one tensor). ``begin(module)`` (optional) runs in the forward: None skips
    the call, anything else is what the hook gets in the module's place; ``on_error`` gets what a hook raised instead of the backward.
    """
    handle = GradHandle()

    def pre_hook(module: Any, args: tuple) -> Any:
        pending = handle.pending()
        if len(pending) >= _MAX_PENDING:
            del pending[0]
        token = module if begin is None or not torch.is_grad_enabled() else begin(module)
        if not torch.is_grad_enabled() or token is None:
            pending.append(None)
            return None
        needing = sum(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if replace and needing > 1:
            # Each input's gradient arrives at its own time: only torch's hook sees them together.
            backward = BackwardHook(module, [lambda m, gin, gout: hook(token, gin, gout)], [])
            pending.append(backward)
            return backward.setup_input_hook(args)
        call = GradCall(list(args), lambda gin, gout: hook(token, tuple(gin), tuple(gout)),
                        _replacer(token, hook) if replace else None, on_error)
        handle.calls.add(call)
        pending.append(call)
        return None

    def post_hook(module: Any, args: tuple, result: Any) -> Any:
        pending = handle.pending()
        call = pending.pop() if pending else None
        if isinstance(call, GradCall):
            if result is None:
                call.cancel()  # the forward raised (always_call hooks run then) or returned nothing
            else:
                call.hook_outputs(tensors_of(result))
        elif isinstance(call, BackwardHook) and result is not None:
            return call.setup_output_hook(result)
        return None

    def guarded(body: Callable[..., Any]) -> Callable[..., Any]:
        if on_error is None:
            return body

        def run(*args: Any) -> Any:
            try:
                return body(*args)
            except Exception as e:
                on_error(e)
                return None

        return run

    handle.handles.append(owner.register_forward_pre_hook(guarded(pre_hook)))
    handle.handles.append(owner.register_forward_hook(guarded(post_hook), always_call=True))
    return handle


def _replacer(module: Any, hook: Callable[[Any, tuple, tuple], Any]) -> Callable[[int, Grads, Grads], Any]:
    """The replacement of the one input needing a gradient: ``hook``'s return at that input's place."""
    def replace(position: int, grad_input: Grads, grad_output: Grads) -> torch.Tensor | None:
        new = hook(module, tuple(grad_input), tuple(grad_output))
        if new is None:
            return None
        if isinstance(new, torch.Tensor):
            new = (new,)
        if len(new) != len(grad_input):
            raise FwdtraceError(f"expected {len(grad_input)} gradient(s), got {len(new)}")
        return new[position]

    return replace
