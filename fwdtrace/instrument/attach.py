"""Attaching a tool to a model: the one place where fwdtrace puts hooks on modules, function sites and tensors.

A tool (Probe, Dumper, the live sampler, the Recorder, ``serve()``'s first-forward trace) says what it wants
called ("this pre-hook and this hook on these keys, these gradients") and gets one :class:`Attachment`
back. The attachment holds every hook it added and the route the model's compiled parts take meanwhile
(:mod:`fwdtrace.instrument.compiled`), and ``remove()`` takes all of it off, hooks first, last added first,
the route last: each step is a :class:`~fwdtrace.patching.critical` section, so a Ctrl-C never leaves a hook
or a patch behind.

Routes (``Attachment.route``):

- ``"eager"``: any hook. While attached, the model's compiled parts run their eager modules, so the hooks
  run and nothing they do enters dynamo's cache. Taken before the first hook is added.
- ``"graph"``: hooks dynamo traces without a break (:meth:`Attachment.stats`, :meth:`Attachment.copies`,
  :meth:`Attachment.traced`: :mod:`fwdtrace.instrument.ingraph`). A compiled part with such a hook below it runs
  a compiled copy of itself made with the hooks in place; a model not compiled runs them eagerly. Plain
  hooks are taken only where they run outside compiled code: on modules outside the compiled parts, or on
  a ``torch.compile`` wrapper itself.
- ``"none"``: hooks that run outside compiled code anyway (a ``torch.compile`` wrapper's own hooks, a
  parameter's gradient accumulation): no route is taken.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..patching import critical
from .compiled import EagerRoute, GraphRoute, compiled_parts, inside_compiled_parts
from .grads import register_grad_hook
from .ingraph import ForwardHook, Slot, StatsSlot
from .params import after_backward

__all__ = ["ROUTES", "Attachment", "attach"]

ROUTES = ("eager", "graph", "none")

HookFactory = Callable[[str, Any], Callable[..., Any]]  # (key, module or function site) -> the hook


class Attachment:
    """Every hook one tool added to ``model``, and the route its compiled parts take while they are on.

    >>> import torch
    >>> from fwdtrace.instrument.attach import Attachment
    >>> model = torch.nn.Sequential(torch.nn.ReLU())
    >>> with Attachment(model, "example") as on:
    ...     _ = on.forward(model[0], lambda m, inputs, output: print(output))
    ...     _ = model(torch.tensor([-1.0, 2.0]))
    tensor([0., 2.])
    >>> len(model[0]._forward_hooks)
    0

    ``caller`` names the public function in errors (a model whose ``forward`` is itself a compiled
    function cannot be run eagerly). ``route`` is one of :data:`ROUTES` (see the module's notes).
    Each ``forward*``/``grads``/... method adds its hooks now and returns their handle, which may
    also be removed alone; :meth:`remove` (or leaving ``with``) takes everything off, twice is harmless.
    """

    def __init__(self, model: torch.nn.Module, caller: str, route: str = "eager") -> None:
        if route not in ROUTES:
            raise ValueError(f"route is one of {ROUTES}, got {route!r}")
        self.model, self.caller, self.route = model, caller, route
        self._handles: list[Any] = []
        self._eager: EagerRoute | None = None
        self._inside: set[int] | None = None  # id() of every module inside a compiled part, on the graph route
        if route == "eager":
            with critical():
                self._eager = EagerRoute(model, caller)

    @property
    def in_graph(self) -> bool:
        """Whether the hooks are in-graph hooks (run inside a compiled model's compiled code)."""
        return self.route == "graph"

    @property
    def runs(self) -> str:
        """How the model runs while attached: ``"eager"`` (no compiled part), ``"compiled"`` (its compiled
        code, in-graph hooks inside it, or hooks outside it) or ``"eager route"`` (its compiled parts eagerly)."""
        if not compiled_parts(self.model):
            return "eager"
        return "eager route" if self._eager is not None else "compiled"

    def _graph_routes(self) -> list[GraphRoute]:
        return [h for h in self._handles if isinstance(h, GraphRoute)]

    def eager_why(self) -> list[str]:
        """On the ``"graph"`` route: why compiled parts with these hooks run them eagerly instead (a graph
        break in the model's compiled code, a compile that failed); empty while they run in the graphs."""
        return list(dict.fromkeys(why for route in self._graph_routes() for why in route.eager_why()))

    def missing(self) -> list[str]:
        """On the ``"graph"`` route: keys whose in-graph hooks got no value in a call of their compiled part."""
        return sorted({key for route in self._graph_routes() for key in route.missing()})

    def _keep(self, handle: Any) -> Any:
        self._handles.append(handle)
        return handle

    def inside_compiled(self, owner: Any) -> bool:
        """Whether ``owner``'s hooks would run inside a compiled part's code (only in-graph hooks may, there)."""
        if self._inside is None:
            self._inside = inside_compiled_parts(self.model)
        return id(owner) in self._inside

    def _plain(self, owner: Any, what: str) -> None:
        if self.route == "graph" and self.inside_compiled(owner):
            raise ValueError(f"{self.caller}: an in-graph attachment takes only in-graph hooks inside compiled code, "
                             f"not {what}")

    def add(self, handle: Any) -> Any:
        """Keep ``handle`` (anything with ``remove()``: a function-dispatch handler's) and remove it with the rest."""
        with critical():
            return self._keep(handle)

    def forward_pre(self, owner: Any, hook: Callable[..., Any], *, with_kwargs: bool = False) -> Any:
        """``owner.register_forward_pre_hook(hook)``: ``owner`` a module or a function site."""
        self._plain(owner, "forward pre-hooks")
        with critical():
            return self._keep(owner.register_forward_pre_hook(hook, with_kwargs=with_kwargs))

    def forward(self, owner: Any, hook: Callable[..., Any], *, with_kwargs: bool = False,
                always_call: bool = False) -> Any:
        """``owner.register_forward_hook(hook)``: ``owner`` a module or a function site."""
        self._plain(owner, "forward hooks")
        with critical():
            return self._keep(owner.register_forward_hook(hook, with_kwargs=with_kwargs, always_call=always_call))

    def grads(self, owner: Any, hook: Callable[[Any, tuple, tuple], Any], *, replace: bool = False,
              begin: Callable[[Any], Any] | None = None,
              on_error: Callable[[BaseException], Any] | None = None) -> Any:
        """``hook(module, grad_input, grad_output)`` on every backward of ``owner``'s calls
        (:func:`fwdtrace.instrument.grads.register_grad_hook`, whose arguments these are)."""
        self._plain(owner, "gradient hooks")
        with critical():
            return self._keep(register_grad_hook(owner, hook, replace=replace, begin=begin, on_error=on_error))

    def after_backward(self, parameters: list[tuple[str, torch.nn.Parameter]],
                       callback: Callable[[str, torch.Tensor], None]) -> list[Any]:
        """``callback(name, parameter)`` each time a backward has accumulated into a parameter's ``.grad``
        (:func:`fwdtrace.instrument.params.after_backward`). Autograd runs these outside compiled graphs."""
        with critical():
            handles = after_backward(parameters, callback)
            self._handles.extend(handles)
            return handles

    def _in_graph(self, made: list[tuple[torch.nn.Module, Slot, Callable[[], ForwardHook]]]) -> list[ForwardHook]:
        with critical():
            if self.route == "graph" and made:
                # The route first (one for them all): the hooks are never seen by a part's own compiled code.
                self._keep(GraphRoute(self.model, self.caller, [(slot.id, module) for module, slot, _ in made]))
            return [self._keep(make()) for _, _, make in made]

    def stats(self, module: torch.nn.Module, slot: StatsSlot, of: str) -> ForwardHook:
        """The statistics of ``module``'s input or output tensors (``of``), into ``slot``: computed inside
        the compiled graph on the ``"graph"`` route (:meth:`fwdtrace.instrument.ingraph.ForwardHook.stats`)."""
        return self._in_graph([(module, slot, lambda: ForwardHook.stats(module, slot, of))])[0]

    def copies(self, module: torch.nn.Module, slot: Slot, inputs: bool = True) -> ForwardHook:
        """Detached copies of ``module``'s input (unless ``inputs=False``) and output tensors, handed to
        ``slot`` (:meth:`fwdtrace.instrument.ingraph.ForwardHook.copies`)."""
        return self._in_graph([(module, slot, lambda: ForwardHook.copies(module, slot, inputs))])[0]

    def traced(self, hooks: Iterable[tuple[torch.nn.Module, Slot, Callable[..., None], Callable[..., None] | None]],
               ) -> list[ForwardHook]:
        """Per ``(module, slot, hook, pre)``, a forward hook ``hook(module, args, kwargs, result)`` and a pre-hook
        ``pre(module, args, kwargs)`` (or None) that dynamo traces without a break: tensor ops, and
        ``slot.put(payload)`` to hand results out after the graph. All of them take one route."""
        return self._in_graph([(module, slot, functools.partial(ForwardHook, module, slot, hook, pre))
                               for module, slot, hook, pre in hooks])

    def remove(self) -> None:
        """Take every hook off, last added first, then give the route back; twice is harmless."""
        errors: list[BaseException] = []
        with critical():
            while self._handles:
                try:
                    self._handles.pop().remove()
                except Exception as e:  # take the others off all the same
                    errors.append(e)
            eager, self._eager = self._eager, None
            if eager is not None:
                try:
                    eager.release()
                except Exception as e:
                    errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Attachment({type(self.model).__name__}, {self.caller}, route={self.route}, {len(self._handles)} hooks)"


def attach(
    model: torch.nn.Module, owners: Mapping[str, Any] | Iterable[tuple[str, Any]], *, caller: str,
    pre: HookFactory | None = None, post: HookFactory | None = None, grads: HookFactory | None = None,
    with_kwargs: bool = False, always_call: bool = False, route: str = "eager",
) -> Attachment:
    """Hooks on every ``(key, owner)`` of ``owners`` (what :func:`fwdtrace.instrument.keys.select_keys`
    returns), each made by a factory ``pre(key, owner)``, ``post(key, owner)``, ``grads(key, owner)``.

    >>> import torch
    >>> from fwdtrace.instrument.attach import attach
    >>> from fwdtrace.instrument.keys import key2module
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
    >>> seen = []
    >>> with attach(model, key2module(model), caller="example",
    ...             post=lambda key, m: lambda m, inputs, output: seen.append((key, output.shape[-1]))):
    ...     _ = model(torch.ones(1, 2))
    >>> seen
    [('0.Linear', 3), ('1.ReLU', 3), ('Sequential', 3)]

    Everything is on, or nothing (a factory that raises takes off what was added); the
    :class:`Attachment` returned removes it all.
    """
    attachment = Attachment(model, caller, route)
    try:
        for key, owner in owners.items() if isinstance(owners, Mapping) else owners:
            if pre is not None:
                attachment.forward_pre(owner, pre(key, owner), with_kwargs=with_kwargs)
            if post is not None:
                attachment.forward(owner, post(key, owner), with_kwargs=with_kwargs, always_call=always_call)
            if grads is not None:
                attachment.grads(owner, grads(key, owner))
    except BaseException:
        attachment.remove()
        raise
    return attachment
