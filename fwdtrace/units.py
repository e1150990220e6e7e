"""Human units for tables: ``25.6 M`` parameters, ``4.1 GFLOPs``, ``12.3 ms``, ``98.0 MiB``."""

from __future__ import annotations

__all__ = ["human_count", "human_flops", "human_ms", "human_bytes"]

_DECIMAL = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def _scaled(value: float, steps: tuple[tuple[float, str], ...]) -> tuple[str, str]:
    for factor, prefix in steps:
        if abs(value) >= factor:
            return f"{value / factor:.1f}", prefix
    return (f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"), ""


def human_count(n: float) -> str:
    """A count with a decimal prefix.

    >>> human_count(25_557_032), human_count(1_500), human_count(12)
    ('25.6 M', '1.5 K', '12')
    """
    number, prefix = _scaled(n, _DECIMAL)
    return f"{number} {prefix}" if prefix else number


def human_flops(n: float) -> str:
    """FLOPs with a decimal prefix.

    >>> human_flops(4.1e9), human_flops(800)
    ('4.1 GFLOPs', '800 FLOPs')
    """
    number, prefix = _scaled(n, _DECIMAL)
    return f"{number} {prefix}FLOPs"


def human_ms(ms: float | None) -> str:
    """Milliseconds, or microseconds below one; ``-`` for None (not measured).

    >>> human_ms(12.34), human_ms(0.0421), human_ms(None)
    ('12.3 ms', '42.1 us', '-')
    """
    if ms is None:
        return "-"
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    if ms >= 1:
        return f"{ms:.1f} ms"
    return f"{ms * 1000:.1f} us"


def human_bytes(n: float | None) -> str:
    """Binary prefixes, as torch.cuda.memory_summary prints them.

    >>> human_bytes(3 * 2**20), human_bytes(512), human_bytes(None)
    ('3.0 MiB', '512 B', '-')
    """
    if n is None:
        return "-"
    for factor, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= factor:
            return f"{n / factor:.1f} {prefix}"
    return f"{n:.0f} B"
