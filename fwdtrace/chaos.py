"""Reproducible fault injection into layer outputs: NaN, Inf, zeros, noise, bit flips, skips.

Every random choice (whether a call is hit, which element, which bit, the noise) comes
from one ``torch.Generator`` seeded once, so the same seed and the same sequence of
calls give the same faults. Each fault is logged as an :class:`Injection`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .errors import FwdtraceError, describe

__all__ = ["FAULTS", "Chaos", "Injection"]

FAULTS = ("nan", "inf", "zero", "noise", "bitflip", "skip")

# Floating dtypes -> the integer dtype of the same size whose bits a bitflip flips.
_BITS_AS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


@dataclass(frozen=True)
class Injection:
    """One injected fault: where (module key, its call index), what, and on which element."""

    call: int  # the n-th call this Chaos saw, over all its modules
    key: str
    call_index: int  # the n-th call of this module
    fault: str
    index: int | None  # flat index of the element hit, None for whole-tensor faults
    detail: str


class Chaos:
    """Decides, per layer call, whether and how to corrupt its output; keeps the log.

    >>> import torch
    >>> from fwdtrace.chaos import Chaos
    >>> chaos = Chaos("nan", p=1.0, seed=0)
    >>> out = chaos.apply("fc.Linear", torch.nn.Identity(), (torch.ones(3),), torch.ones(3))
    >>> int(out.isnan().sum()), chaos.log[0].fault
    (1, 'nan')

    Used through :meth:`fwdtrace.Probe.chaos`, which hooks the selected modules.
    """

    def __init__(self, fault: str, p: float = 1.0, seed: int = 0, scale: float = 0.1) -> None:
        if fault not in FAULTS:
            raise FwdtraceError(f"chaos() expected fault as one of {', '.join(FAULTS)}, got {fault!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise FwdtraceError(f"chaos() expected p as a probability in [0, 1], got {p!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise FwdtraceError(f"chaos() expected seed as an int, got {describe(seed)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
            raise FwdtraceError(f"chaos() expected scale as a finite number >= 0, got {scale!r}")
        self.fault = fault
        self.p = float(p)
        self.seed = seed
        self.scale = float(scale)
        self.generator = torch.Generator().manual_seed(seed)
        self.log: list[Injection] = []
        self.calls = 0
        self._key2calls: dict[str, int] = {}
        # one generator, one log: calls from several threads take turns (the same seed still
        # gives the same faults when the calls come in the same order)
        self._lock = threading.Lock()

    def apply(self, key: str, module: torch.nn.Module, inputs: tuple, output: Any) -> Any:
        """The output to use for this call: ``output`` itself, or a corrupted copy (logged)."""
        with self._lock:
            return self._apply(key, inputs, output)

    def _apply(self, key: str, inputs: tuple, output: Any) -> Any:
        call = self.calls
        self.calls += 1
        call_index = self._key2calls.get(key, 0)
        self._key2calls[key] = call_index + 1
        g = self.generator
        if float(torch.rand((), generator=g)) >= self.p:
            return output
        target = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(target, torch.Tensor):
            raise FwdtraceError(
                f"chaos(fault={self.fault!r}) expected module '{key}' to output a tensor "
                f"(or a tuple starting with one), got {describe(output)}"
            )
        new, index, detail = self._corrupt(target, inputs)
        self.log.append(Injection(call, key, call_index, self.fault, index, detail))
        if target is output:
            return new
        return type(output)([new, *output[1:]]) if isinstance(output, list) else (new, *output[1:])

    def _corrupt(self, out: torch.Tensor, inputs: tuple) -> tuple[torch.Tensor, int | None, str]:
        g = self.generator
        fault = self.fault
        if fault == "zero":
            return torch.zeros_like(out), None, "output set to zeros"
        if fault == "noise":
            noise = torch.randn(out.shape, generator=g, dtype=torch.float32).to(out.device, out.dtype)
            return out + self.scale * noise, None, f"added Gaussian noise, std {self.scale:g}"
        if fault == "skip":
            x = inputs[0] if inputs else None
            if not isinstance(x, torch.Tensor) or x.shape != out.shape:
                raise FwdtraceError(
                    "chaos(fault='skip') expected the layer's first input to have the output's shape "
                    f"{list(out.shape)} so it can pass through, got {describe(x)}"
                )
            return x, None, "layer skipped: output is its input"
        if out.numel() == 0:
            return out, None, "empty output, nothing to hit"
        index = int(torch.randint(out.numel(), (), generator=g))
        new = out.clone(memory_format=torch.contiguous_format)
        flat = new.view(-1)
        old = flat[index].detach().clone()
        if fault == "bitflip":
            int_dtype = _BITS_AS.get(out.dtype, out.dtype)
            if int_dtype.is_floating_point or int_dtype.is_complex or int_dtype == torch.bool:
                raise FwdtraceError(f"chaos(fault='bitflip') expected a float or integer output, got {out.dtype}")
            nbits = old.element_size() * 8
            bit = int(torch.randint(nbits, (), generator=g))
            mask = 1 << bit
            if int_dtype != torch.uint8 and mask >= 1 << (nbits - 1):
                mask -= 1 << nbits  # the sign bit, as the signed integer torch stores
            value = (old.reshape(1).view(int_dtype) ^ mask).view(out.dtype)[0]
            detail = f"bit {bit} flipped: {old.item()!r} -> {value.item()!r}"
        else:
            if not out.is_floating_point():
                raise FwdtraceError(f"chaos(fault={fault!r}) expected a floating-point output, got {out.dtype}")
            value = torch.tensor(float(fault), dtype=out.dtype, device=out.device)
            detail = f"{old.item()!r} -> {fault}"
        flat[index] = value
        return new, index, detail
