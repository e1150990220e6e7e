"""Hooks that dynamo traces without a break: statistics and copies taken inside a compiled model's graph.

A hook that takes a lock, reads a clock or converts a tensor to a Python number breaks dynamo's
graph. The hooks made here do none of that: they summarise a tensor with tensor ops only
(:func:`fwdtrace.statistics.summarize_in_graph`, into one float64 vector: :class:`StatsSlot`), or copy a call's tensors
(:meth:`ForwardHook.copies`), and append ``(slot id, payload)`` to a module-level list. Dynamo replays
that append after the graph has run; :func:`drain` then hands each payload to the consumer of its
slot, outside compiled code: a summary is merged into a :class:`~fwdtrace.instrument.stats.RunningStats`
as :meth:`RunningStats.update` merges its own, copies go to the live sampler or the recorder.
The list is empty whenever a compiled graph starts (it is drained after every routed call), so the
guard dynamo puts on it holds and no step recompiles.

The same hooks run eagerly (a model not compiled, a tool that needs the eager route): then they
drain at once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from .._tree import iter_tensors, tensors_of
from ..statistics import summarize
from .stats import RunningStats

__all__ = ["Slot", "StatsSlot", "ForwardHook", "drain", "received", "slot_key"]

# (slot id, payload) appended by the hooks, in graph order; drained outside compiled code.
_SINK: list[tuple[int, Any]] = []
_SLOT2CONSUMER: dict[int, Callable[[Any], None]] = {}
_SLOT2KEY: dict[int, str] = {}  # the key a tool named a slot by, for what fwdtrace says about it
_SLOT2RECEIVED: dict[int, int] = {}  # payloads handed over per slot: a routed call sees which armed slots got none
_DRAINING = threading.Lock()
_SLOT_IDS = itertools.count()
_REUSE2SLOT: dict[Hashable, int] = {}  # what a tool's hooks are (their module and options) -> the slot id they took

class Slot:
    """Where one hook's in-graph results go: a slot id baked into the compiled graph, and the consumer
    that :func:`drain` hands each queued payload to, outside compiled code. :meth:`close` drains first.

    ``key`` names the slot in what fwdtrace says about it. ``reuse`` says what the hooks feeding it are (their
    kind, module and options): a slot made with the same ``reuse`` as a closed one takes its id again, so
    the compiled copy made for those hooks runs again, uncompiled."""

    def __init__(self, consume: Callable[[Any], None], key: str = "", reuse: Hashable | None = None) -> None:
        # The same hooks on the same module take the same slot id again (when no other tool holds it): the
        # id is baked into the compiled copy, which then serves every later arming of them.
        slot_id = _REUSE2SLOT.get(reuse) if reuse is not None else None
        if slot_id is None or slot_id in _SLOT2CONSUMER:
            slot_id = next(_SLOT_IDS)
            if reuse is not None:
                _REUSE2SLOT.setdefault(reuse, slot_id)
        self.id = slot_id
        self.key = key
        _SLOT2CONSUMER[self.id] = consume
        if key:
            _SLOT2KEY[self.id] = key

    def put(self, payload: Any) -> None:
        """Queue ``payload`` (tensors, and Python values dynamo can rebuild) for this slot's consumer."""
        _SINK.append((self.id, payload))
        if not torch.compiler.is_compiling():  # eagerly run: hand it over now (compiled: after the graph)
            drain()

    def close(self) -> None:
        drain()
        _SLOT2CONSUMER.pop(self.id, None)


class StatsSlot(Slot):
    """A slot whose payloads are :mod:`fwdtrace.statistics` summary vectors, merged into ``stats``.

    >>> import torch
    >>> from fwdtrace.instrument.stats import RunningStats
    >>> stats = RunningStats(bins=2, range=(0.0, 2.0))
    >>> slot = StatsSlot(stats)
    >>> slot.add(torch.tensor([0.5, 1.5])); stats.histogram
    [1, 1]
    >>> slot.close()
    """

    def __init__(self, stats: RunningStats, on_first: Callable[[], None] | None = None, key: str = "",
                 reuse: Hashable | None = None) -> None:
        super().__init__(self._consume, key, reuse)
        self.stats = stats
        self._on_first = on_first  # called once, before the first summary is merged
        self._edges = stats.edges()  # fixed edges (a constant of the graph), or None: the statistics' own bins

    def _consume(self, payload: tuple[str, torch.Tensor]) -> None:
        on_first = self._on_first
        if on_first is not None:
            self._on_first = None
            on_first()
        kind, value = payload
        self.stats.add_summary(value if kind == "summary" else summarize(value, self.stats.bins, self._edges))

    def add(self, tensor: torch.Tensor) -> None:
        """Summarise ``tensor`` (:func:`fwdtrace.statistics.summarize`) and queue it for this slot's statistics.
        Inside a compiled graph on a CPU, a copy is queued and summarised after the graph by the CPU's route
        (what an eager model's statistics take, several times faster than the loops a compiler makes of the
        summary); on another device the summary is computed in the graph."""
        t = tensor.detach()
        if torch.compiler.is_compiling() and t.device.type == "cpu":
            self.put(("copy", t.clone()))
        else:
            self.put(("summary", summarize(t, self.stats.bins, self._edges)))


def received(slot_ids: Iterable[int]) -> dict[int, int]:
    """How many payloads each of ``slot_ids`` has handed to its consumer so far."""
    return {slot_id: _SLOT2RECEIVED.get(slot_id, 0) for slot_id in slot_ids}


def slot_key(slot_id: int) -> str:
    """The key a tool named slot ``slot_id`` by (``slot <id>`` where it named none)."""
    return _SLOT2KEY.get(slot_id) or f"slot {slot_id}"


def drain() -> None:
    """Hand every queued summary to its slot's consumer; outside compiled code (after a routed call)."""
    if not _SINK:
        return
    with _DRAINING:
        pending = _SINK[:]
        del _SINK[: len(pending)]
    for slot_id, summary in pending:
        _SLOT2RECEIVED[slot_id] = _SLOT2RECEIVED.get(slot_id, 0) + 1
        consumer = _SLOT2CONSUMER.get(slot_id)
        if consumer is not None:
            consumer(summary)


class ForwardHook:
    """A forward hook (``hook(module, args, kwargs, result)``, and optionally a pre-hook ``pre(module, args,
    kwargs)``) that dynamo traces, feeding ``slot``; removable as a torch hook handle (removing it
    hands over what is queued first). :meth:`stats` adds the input or output tensors' summaries to a
    :class:`StatsSlot`, :meth:`copies` queues detached copies of every input (unless ``inputs=False``) and output tensor, named
    as :func:`fwdtrace._tree.iter_tensors` names them, as ``(inputs, outputs)``."""

    def __init__(self, module: torch.nn.Module, slot: Slot, hook: Callable[..., None],
                 pre: Callable[..., None] | None = None) -> None:
        self.module, self.slot = module, slot
        self._handles = [module.register_forward_hook(hook, with_kwargs=True)]
        if pre is not None:
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))

    @classmethod
    def stats(cls, module: torch.nn.Module, slot: StatsSlot, of: str) -> ForwardHook:
        def hook(m: torch.nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
            for t in tensors_of((args, kwargs)) if of == "input" else tensors_of(result):
                if isinstance(t, torch.Tensor):
                    slot.add(t)

        return cls(module, slot, hook)

    @classmethod
    def copies(cls, module: torch.nn.Module, slot: Slot, inputs: bool = True) -> ForwardHook:
        # A copy, not the tensor: the model may change its output in place later in the step.
        def hook(m: torch.nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
            given = [*iter_tensors(args, "input"), *iter_tensors(kwargs, "input")] if inputs else []
            slot.put(([(name, t.detach().clone()) for name, t in given],
                      [(name, t.detach().clone()) for name, t in iter_tensors(result, "output")]))

        return cls(module, slot, hook)

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        self.slot.close()


