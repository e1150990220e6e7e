"""The one patcher: every original comes back, the very same object, exceptions included."""

from __future__ import annotations

import pytest
from torch import nn

from fwdtrace.patching import ORIGINAL_ATTR, Patcher, unwrap


class Base:
    def greet(self) -> str:
        return "base"


class Child(Base):
    pass


def test_restore_puts_back_the_very_same_objects() -> None:
    original = nn.ReLU.__dict__["forward"]
    call = nn.Module.__dict__["__call__"]
    with Patcher() as p:
        p.patch(nn.ReLU, "forward", lambda self, x: x * 0)
        p.patch(nn.Module, "__call__", lambda self, *a: "patched")
        assert len(p) == 2
        assert nn.ReLU.__dict__["forward"] is not original
    assert nn.ReLU.__dict__["forward"] is original
    assert nn.Module.__dict__["__call__"] is call
    assert len(p) == 0


def test_the_same_attribute_patched_twice_restores_in_reverse_order() -> None:
    original = Base.__dict__["greet"]
    with Patcher() as p:
        p.patch(Base, "greet", lambda self: "one")
        p.patch(Base, "greet", lambda self: "two")
        assert Base().greet() == "two"
    assert Base.__dict__["greet"] is original


def test_an_inherited_attribute_is_removed_again() -> None:
    with Patcher() as p:
        p.patch(Child, "greet", lambda self: "child")
        assert Child().greet() == "child"
    assert "greet" not in Child.__dict__
    assert Child().greet() == "base"


def test_restore_on_exception_and_twice() -> None:
    original = Base.__dict__["greet"]
    p = Patcher()
    with pytest.raises(KeyError):
        with p:
            p.patch(Base, "greet", lambda self: "patched")
            raise KeyError("boom")
    assert Base.__dict__["greet"] is original
    p.restore()  # safe to call again
    assert Base.__dict__["greet"] is original


def test_unwrap_reaches_the_true_original() -> None:
    def original() -> None:
        pass

    def inner() -> None:
        pass

    def outer() -> None:
        pass

    setattr(inner, ORIGINAL_ATTR, original)
    setattr(outer, ORIGINAL_ATTR, inner)
    assert unwrap(outer) is original
    assert unwrap(original) is original
