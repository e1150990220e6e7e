"""A Node is one call the model made: a layer, a torch function, an input or an output.

Nodes are small (the torch.fx way): a kind from a fixed set, a target, where it ran,
the tensors it read and wrote, and a ``meta`` dict for what analyses attach.
Nodes are created by :meth:`fwdtrace.Graph.add_node`, never directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

NodeKind = Literal["input", "module", "function", "output"]
NODE_KINDS: tuple[str, ...] = ("input", "module", "function", "output")


# TensorRef, Scope and Edge are immutable named tuples: a trace makes several per call, and a
# named tuple is built in a third of a frozen dataclass's time.
# ``tuple.__new__(TensorRef, (...))``: a NamedTuple without its Python-level ``__new__``, for the
# tracer's hot path, which makes one per tensor, edge and scope (no defaults are filled: give every field).
new_tuple = tuple.__new__


class TensorRef(NamedTuple):
    """One tensor at a node's boundary.

    ``obj_id`` is the stable id the trace gave the tensor (0, 1, 2, ... in first-seen
    order); ``param`` names the parameter or buffer it is (``"fc.weight"``), if any.
    """

    obj_id: int
    shape: tuple[int, ...]
    dtype: str
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"obj_id": self.obj_id, "shape": list(self.shape), "dtype": self.dtype}
        if self.param is not None:
            d["param"] = self.param
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorRef:
        return cls(int(d["obj_id"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]), d.get("param"))


class Scope(NamedTuple):
    """One enclosing module call: its path, its class name and which call of it this is."""

    module_path: str
    class_name: str
    call_index: int = 0


@dataclass(slots=True)
class Node:
    """One call in the graph, in execution order.

    >>> import torch, fwdtrace
    >>> g = fwdtrace.trace(torch.nn.Linear(4, 2), torch.ones(1, 4))
    >>> [(n.kind, n.target) for n in g.nodes]
    [('input', 'input'), ('module', 'torch.nn.Linear'), ('output', 'output')]
    """

    id: int
    kind: str
    target: str
    name: str
    module_path: str = ""
    call_index: int = 0
    inputs: list[TensorRef] = field(default_factory=list)
    outputs: list[TensorRef] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    # Enclosing module calls, outermost first (the root model excluded): drawing uses
    # them for clusters and depth collapsing.
    scope: tuple[Scope, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def class_name(self) -> str:
        """The last part of ``target``: ``Conv2d``, ``relu``, ``__add__``."""
        return self.target.rsplit(".", 1)[-1]

    @property
    def module_key(self) -> str:
        """The module key of a module node, ``"blocks.0.c1.Conv2d"`` (see :func:`fwdtrace.module_keys`);
        of an atomic function node, its name in its module, ``"layers.0.attn.apply_rotary_pos_emb"``."""
        if not self.module_path:
            return self.class_name
        return f"{self.module_path}.{self.class_name}"

    @property
    def key(self) -> str | None:
        """The name selectors take for this node (:mod:`fwdtrace.instrument.keys`): a module node's module key,
        a function node's function key (selectable once the function is hooked by path), None for
        the graph's inputs and outputs. ``module_path`` names the same layer (selectors take both).

        >>> import torch, fwdtrace
        >>> g = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.ones(1, 4))
        >>> [(n.module_path, n.key) for n in g.nodes]
        [('', None), ('0', '0.Linear'), ('', None)]
        """
        return self.module_key if self.kind in ("module", "function") else None

    def to_dict(self) -> dict[str, Any]:
        # "key" is derived (from_dict ignores it): written for readers of the JSON, same bytes every time
        return {
            "id": self.id,
            "key": self.key,
            "kind": self.kind,
            "target": self.target,
            "name": self.name,
            "module_path": self.module_path,
            "call_index": self.call_index,
            "inputs": [r.to_dict() for r in self.inputs],
            "outputs": [r.to_dict() for r in self.outputs],
            "attrs": self.attrs,
            "scope": [[s.module_path, s.class_name, s.call_index] for s in self.scope],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Node:
        return cls(
            id=int(d["id"]),
            kind=str(d["kind"]),
            target=str(d["target"]),
            name=str(d["name"]),
            module_path=str(d.get("module_path", "")),
            call_index=int(d.get("call_index", 0)),
            inputs=[TensorRef.from_dict(r) for r in d.get("inputs", [])],
            outputs=[TensorRef.from_dict(r) for r in d.get("outputs", [])],
            attrs=dict(d.get("attrs", {})),
            scope=tuple(Scope(str(p), str(c), int(i)) for p, c, i in d.get("scope", [])),
            meta=dict(d.get("meta", {})),
        )


class Edge(NamedTuple):
    """A tensor flowing from the node that produced it to a node that read it."""

    src: int
    dst: int
    obj_id: int
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "obj_id": self.obj_id, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Edge:
        return cls(int(d["src"]), int(d["dst"]), int(d["obj_id"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]))
