"""Calls of hooked functions inside one model, keyed like the graph, with torch's module-hook API per key.

A function or method hooked by path (:func:`fwdtrace.hook_forward`, :func:`fwdtrace.register_atomic`)
runs inside some module's forward. Its key is that module's path and the function's name,
``"model.layers.0.self_attn.eager_attention_forward"``: the ``module_key`` of its node in a trace
(the root's own calls are keyed by the name alone). A :class:`FunctionSite` is one such key. It takes
the hooks a module takes (``register_forward_pre_hook``, ``register_forward_hook``,
``register_full_backward_hook``) and runs them on the calls made there, as ``nn.Module._call_impl``
runs a module's, so probes and dumps hook a function key with the code they hook a module with
(gradients through :func:`fwdtrace.instrument.grads.register_grad_hook`, as for modules).

No patcher of its own: :class:`ModelCalls` puts one handler on the module-call dispatch point (which
of the model's modules is running, per thread) and one on each hooked function's dispatch point
(:mod:`fwdtrace.patching`), while any of its sites has a hook; both run in every thread, as torch's
module hooks do.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import registry as _registry
from ..errors import FwdtraceError, describe
from ..patching import add_call_handler, critical, remove_call_handler
from ..registry import FunctionTarget
from ..tracer import add_function_handlers, layer_notes, remove_handlers
from .grads import GradHandle, register_grad_hook
from .keys import function_key, key2module, key_path

__all__ = ["ModelCalls", "FunctionSite", "called_keys"]

_ids = itertools.count()


class _SiteHandle:
    """What ``FunctionSite.register_*`` returns: ``remove()`` takes the hook off, as torch's handles do."""

    __slots__ = ("site", "hook_id")

    def __init__(self, site: FunctionSite, hook_id: int) -> None:
        self.site = site
        self.hook_id = hook_id

    def remove(self) -> None:
        self.site._remove(self.hook_id)


class FunctionSite:
    """One function key: the calls of ``target`` made while the module at ``module_path`` runs.

    Hooks get the calling module where a module's hooks get the module itself, and the
    function's positional arguments as ``inputs`` (``self`` first for a method):
    ``hook(module, inputs, output)``. A non-None return replaces the inputs (pre-hooks) or the
    output, as for modules. Full backward hooks get ``(module, grad_input, grad_output)`` for
    the positional arguments and the tensor outputs, from tensor hooks
    (:func:`fwdtrace.instrument.grads.register_grad_hook`: safe beside in-place ops, its notes say what
    ``grad_input`` holds).
    """

    def __init__(self, calls: ModelCalls, target: FunctionTarget, module_path: str) -> None:
        self.calls = calls
        self.target = target
        self.module_path = module_path
        self.key = function_key(module_path, target.name)
        # hook id -> (hook, with_kwargs, always_call); dicts copied on change, read without a lock
        self._pre_hooks: dict[int, tuple[Callable[..., Any], bool, bool]] = {}
        self._hooks: dict[int, tuple[Callable[..., Any], bool, bool]] = {}

    def register_forward_pre_hook(self, hook: Callable[..., Any], *, with_kwargs: bool = False) -> _SiteHandle:
        return self._add("_pre_hooks", hook, with_kwargs, False)

    def register_forward_hook(
        self, hook: Callable[..., Any], *, with_kwargs: bool = False, always_call: bool = False
    ) -> _SiteHandle:
        return self._add("_hooks", hook, with_kwargs, always_call)

    def register_full_backward_hook(self, hook: Callable[..., Any]) -> GradHandle:
        return register_grad_hook(self, hook)

    def _add(self, kind: str, hook: Callable[..., Any], with_kwargs: bool, always_call: bool) -> _SiteHandle:
        if not callable(hook):
            raise FwdtraceError(f"FunctionSite expected a callable hook, got {describe(hook)}")
        hook_id = next(_ids)
        with critical():
            setattr(self, kind, {**getattr(self, kind), hook_id: (hook, with_kwargs, always_call)})
            self.calls._hooked(self.target, +1)
        return _SiteHandle(self, hook_id)

    def _remove(self, hook_id: int) -> None:
        with critical():
            for kind in ("_pre_hooks", "_hooks"):
                hooks = getattr(self, kind)
                if hook_id in hooks:
                    setattr(self, kind, {k: v for k, v in hooks.items() if k != hook_id})
                    self.calls._hooked(self.target, -1)
                    return

    def _has_hooks(self) -> bool:
        return bool(self._pre_hooks or self._hooks)

    def _call(self, module: torch.nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One call with this site's hooks, in ``nn.Module._call_impl``'s order."""
        for hook, with_kwargs, _ in self._pre_hooks.values():
            if with_kwargs:
                new = hook(module, args, kwargs)
                if new is not None:
                    args, kwargs = new
            else:
                new = hook(module, args)
                if new is not None:
                    args = new if isinstance(new, tuple) else (new,)
        hooks = self._hooks
        try:
            result = call(*args, **kwargs)
        except Exception:
            for hook, with_kwargs, always_call in hooks.values():
                if always_call:  # as torch does: the forward's exception is the one raised
                    try:
                        hook(module, args, kwargs, None) if with_kwargs else hook(module, args, None)
                    except Exception as e:
                        warnings.warn(f"fwdtrace: a forward hook of {self.key} raised {e!r} while the call raised", stacklevel=2)
            raise
        for hook, with_kwargs, _ in hooks.values():
            new = hook(module, args, kwargs, result) if with_kwargs else hook(module, args, result)
            if new is not None:
                result = new
        return result

    def __repr__(self) -> str:
        return f"FunctionSite({self.key!r}, {self.target.path})"


class ModelCalls:
    """The function keys of one model, and the handlers that see their calls while any of them is hooked.

    >>> import torch
    >>> from fwdtrace.instrument.calls import ModelCalls
    >>> from fwdtrace.registry import resolve_any
    >>> model = torch.nn.Sequential(torch.nn.SiLU())
    >>> site = ModelCalls(model).sites(resolve_any("torch.nn.functional.silu"))["0.silu"]
    >>> handle = site.register_forward_hook(lambda module, inputs, output: output * 0)
    >>> model(torch.ones(2))
    tensor([0., 0.])
    >>> handle.remove(); model(torch.ones(2))
    tensor([0.7311, 0.7311])

    A call made while none of the model's modules runs has no key and passes untouched.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._module2path: dict[int, str] = {}
        self.paths: list[str] = []  # every module path, in module_keys' order
        for key, module in key2module(model).items():
            path = key_path(key, module)
            self._module2path[id(module)] = path
            self.paths.append(path)
        self._sites: dict[tuple[str, str], FunctionSite] = {}  # (target path, module path) -> site
        self._local = threading.local()
        self._hooks_per_target: dict[str, int] = {}
        self._target_handles: dict[str, list[Any]] = {}
        self._module_handle: Any = None

    # -- keys --------------------------------------------------------------------------------------
    def sites(self, target: FunctionTarget) -> dict[str, FunctionSite]:
        """Every key ``target`` can have in this model (one per module path), by key."""
        out = {}
        for path in self.paths:
            site = self._sites.get((target.path, path))
            if site is None:
                site = self._sites[(target.path, path)] = FunctionSite(self, target, path)
            out[site.key] = site
        return out

    def registered_sites(self) -> dict[str, FunctionSite]:
        """The keys of every function registered with ``hook_forward``/``register_atomic``, by key."""
        out: dict[str, FunctionSite] = {}
        for target in list(_registry.REGISTRY.functions.values()):
            for key, site in self.sites(target).items():
                out.setdefault(key, site)
        return out

    # -- dispatch ----------------------------------------------------------------------------------
    def _stack(self) -> list[tuple[str, torch.nn.Module]]:
        try:
            return self._local.stack
        except AttributeError:
            stack = self._local.stack = []
            return stack

    def _on_module_call(self, call: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        path = self._module2path.get(id(module))
        if path is None:  # not the model's: the innermost module of the model stays the caller
            return call(module, *args, **kwargs)
        stack = self._stack()
        stack.append((path, module))
        try:
            return call(module, *args, **kwargs)
        finally:
            stack.pop()

    def _function_handler(self, target: FunctionTarget) -> Callable[..., Any]:
        sites = self._sites
        target_path = target.path

        def on_function(call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            stack = self._stack()
            if stack:
                path, module = stack[-1]
                site = sites.get((target_path, path))
                if site is not None and site._has_hooks():
                    return site._call(module, call, args, kwargs)
            return call(*args, **kwargs)

        return on_function

    def _hooked(self, target: FunctionTarget, delta: int) -> None:
        """Count the hooks on ``target``'s sites; the handlers are in exactly while the count is > 0."""
        with critical():
            before = self._hooks_per_target.get(target.path, 0)
            after = self._hooks_per_target[target.path] = before + delta
            if before == 0 and after > 0:
                if self._module_handle is None:
                    self._module_handle = add_call_handler(self._on_module_call, all_threads=True)
                self._target_handles[target.path] = add_function_handlers(
                    self._function_handler, all_threads=True, targets=[target]
                )
            elif before > 0 and after == 0:
                remove_handlers(self._target_handles.pop(target.path))
                if not self._target_handles and self._module_handle is not None:
                    remove_call_handler(self._module_handle)
                    self._module_handle = None


def called_keys(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, list[str]]:
    """Run ``model(*args, **kwargs)`` once without grad; the keys of the registered functions it called,
    per module path, in first-call order (what :func:`fwdtrace.module_keys` lists with inputs)."""
    calls = ModelCalls(model)
    seen: dict[str, list[str]] = {}

    def record(site: FunctionSite) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: tuple, output: Any) -> None:
            keys = seen.setdefault(site.module_path, [])
            if site.key not in keys:
                keys.append(site.key)

        return hook

    handles = [site.register_forward_hook(record(site)) for site in calls.registered_sites().values()]
    try:
        with layer_notes(model), torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen
