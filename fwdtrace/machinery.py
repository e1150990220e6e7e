"""Other tools' machinery around a model's layers: what a trace draws as one node, or not at all.

FSDP2 (``torch.distributed.fsdp.fully_shard``) brings each unit's parameters in before the
unit runs: an all-gather plus the buffers it fills, copies and views. accelerate's offload
hooks (``cpu_offload``) bring a layer's weights from the CPU copy to the execution device
before the layer runs and move its inputs and outputs between devices. Traced as they come,
these are dozens of ``empty``/``copy_``/``as_strided``/``Tensor.to``/``torch.tensor`` nodes
per layer (and nothing for the collective itself), drawn as if the model computed them.

A trace runs each method below hidden, as the inside of a leaf layer, and then:

- where the call put new parameter or buffer tensors on the modules it serves (the unsharded
  parameters, the weights brought in), one node named for what it did, its outputs those
  tensors under their own names, read by the layer as the untraced model reads its own;
- tensors it handed on in place of the ones it was given (inputs moved to a device, FSDP's
  views that register the backward) are the same tensors in the graph, so the model's
  dataflow runs through as without the tool.

The methods are patched only while a trace runs a model that uses the tools (a module
fully_shard wrapped, or carrying accelerate's hooks), and only those whose module is imported
(fwdtrace imports neither tool). Each entry is the method's path and the node it makes (None:
hidden, no node). analyze reads the device an offloaded model runs on from accelerate's hooks
(:func:`execution_device`).

``fully_shard`` (and ``replicate``) also swap each module they wrap into a class of their own,
``FSDPLinear``: graphs, pictures and module keys name the model's class (:func:`model_class`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "Machinery", "MACHINERY", "NODE_TARGETS", "imported_machinery", "uses_machinery", "module_tensors", "model_class", "execution_device",
]

_FSDP_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup"
_FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState"
_ALIGN = "accelerate.hooks.AlignDevicesHook"


class Machinery(NamedTuple):
    """One method of another tool run around a layer: ``method(tool, module, *passed_on)``."""

    path: str  # where the method is defined, "pkg.mod.Class.method"
    target: str | None  # the node made when the call replaced the served modules' tensors; None: no node
    served: Callable[[tuple], list[torch.nn.Module]]  # the modules whose tensors it may replace, from its arguments
    attrs: Callable[[tuple], dict[str, Any]]  # the node's attributes


def _fsdp_group_modules(args: tuple) -> list[torch.nn.Module]:
    # A group made by fully_shard([a, b]) unshards a's and b's parameters at once.
    return list(getattr(args[0], "modules", ())) or [args[1]]


def _accelerate_modules(args: tuple) -> list[torch.nn.Module]:
    return [args[1]]


def _no_modules(args: tuple) -> list[torch.nn.Module]:
    return []


def _no_attrs(args: tuple) -> dict[str, Any]:
    return {}


MACHINERY: tuple[Machinery, ...] = (
    # the root's first-call set-up and its inputs moved to the device
    Machinery(f"{_FSDP_STATE}._root_pre_forward", None, _no_modules, _no_attrs),
    # one unshard: the all-gather and its buffers, then the parameters swapped to the unsharded ones
    Machinery(f"{_FSDP_GROUP}.pre_forward", "fsdp.unshard", _fsdp_group_modules,
              lambda args: {"collective": "all_gather"}),
    Machinery(f"{_FSDP_GROUP}.unshard", None, _no_modules, _no_attrs),  # an explicit prefetch's all-gather
    Machinery(f"{_FSDP_GROUP}.post_forward", None, _no_modules, _no_attrs),  # the reshard
    # the weights brought from the offloaded copy, the inputs moved to the execution device
    Machinery(f"{_ALIGN}.pre_forward", "accelerate.onload", _accelerate_modules,
              lambda args: {"transfer": f"to {getattr(args[0], 'execution_device', None)}"}),
    Machinery(f"{_ALIGN}.post_forward", None, _no_modules, _no_attrs),  # weights dropped, outputs moved back
)

# The targets of the nodes the machinery is drawn as: the draw pass joins each to the layers whose parameters it outputs.
NODE_TARGETS = frozenset(entry.target for entry in MACHINERY if entry.target is not None)


def imported_machinery() -> list[tuple[Machinery, Any, str]]:
    """Each entry of :data:`MACHINERY` whose module is imported, with the class and attribute holding it."""
    out = []
    for entry in MACHINERY:
        owner_path, _, name = entry.path.rpartition(".")
        module_name, _, class_name = owner_path.rpartition(".")
        module = sys.modules.get(module_name)
        owner = getattr(module, class_name, None) if module is not None else None
        if owner is not None and callable(vars(owner).get(name)):
            out.append((entry, owner, name))
    return out


def uses_machinery(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` carries accelerate's hooks or is one torch.distributed wrapped (fully_shard)."""
    return any("_hf_hook" in vars(m) or type(m).__module__.startswith("torch.distributed.") for m in model.modules())


def module_tensors(modules: list[torch.nn.Module]) -> dict[tuple[int, str], torch.Tensor]:
    """Every parameter and buffer of ``modules`` and their sub-modules, by ``(id(module), name)``."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for root in modules:
        for module in root.modules():
            for name, t in (*module._parameters.items(), *module._buffers.items()):
                if t is not None:
                    out[(id(module), name)] = t
    return out


def model_class(cls: type) -> type:
    """The model's own class behind a class torch.distributed made for a module it wraps.

    >>> import torch
    >>> model_class(torch.nn.Linear) is torch.nn.Linear
    True

    ``fully_shard(linear)`` turns the layer into an ``FSDPLinear``, made as
    ``type("FSDP" + cls.__name__, (FSDPModule, cls), ...)`` (``replicate`` likewise): one of
    torch.distributed's classes, then the wrapped one, and no forward of its own.
    """
    bases = cls.__bases__
    while (len(bases) == 2 and cls.__module__.startswith("torch.distributed.")
           and bases[0].__module__.startswith("torch.distributed.") and cls.__name__.endswith(bases[1].__name__)
           and "forward" not in vars(cls)):
        cls = bases[1]
        bases = cls.__bases__
    return cls


def execution_device(model: torch.nn.Module) -> torch.device | None:
    """The device accelerate's hooks run ``model``'s layers on, or None where no hook says.

    Between forwards an offloaded layer's parameters wait on the meta device (``cpu_offload``)
    or the CPU: the first parameter's device is not where the model runs.
    """
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or [hook]:  # a SequentialHook holds several
            device = getattr(h, "execution_device", None)
            if device is not None:
                return torch.device(device)
    return None
