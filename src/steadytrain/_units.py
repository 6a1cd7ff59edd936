"""Byte sizes as people write them ("12GiB", "512 MB") and as we print them; the one grammar of a
memory budget (`parse_memory_budget`: a size, a fraction of usable memory, or "auto"), which the
config, the fine-tune config and `estimate`/`plan` all read; the default share of usable memory a
run may take (the config, the device layer and doctor all read it here)."""

from __future__ import annotations

import math
import re

DEFAULT_BUDGET_FRACTION = 0.9
"""`memory_budget: auto`: 10% of usable memory stays free for what the estimate cannot see
(allocator fragmentation, the CUDA context, other processes sharing unified memory)."""

MAX_BUDGET_BYTES = 2**50
"""The largest memory budget size, 1 PiB: more than any machine has, far below int64 overflow."""

_UNITS = {
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'12GiB' -> 12884901888. Decimal units (GB) are powers of 1000, binary (GiB) of 1024. A
    number without a unit ('16') is refused: it was meant as gigabytes, not as 16 bytes."""
    match = _SIZE.match(text)
    if match is not None and not match.group(2):
        n = match.group(1)
        raise ValueError(
            f"{text!r} has no unit; write it with one, like '{n}GiB' (GiB is 1024³ bytes) or "
            f"'{n}GB' (1000³); bytes are '{n}B'"
        )
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write it like '12GiB', '16GB' or '512MiB'")
    return int(float(match.group(1)) * _UNITS[unit])


def memory_budget_forms(n: str = "12") -> str:
    """What a memory budget may be, in one sentence; `n` is the number the size example shows
    (the user's own, when they wrote it without a unit)."""
    return (
        f"write a size with its unit, like '{n}GiB' (GiB is 1024³ bytes, GB 1000³), a fraction "
        "of usable memory more than 0 and at most 1, like 0.8, or 'auto' "
        f"({DEFAULT_BUDGET_FRACTION} of usable memory)"
    )


def parse_memory_budget(value: object) -> str | int | float:
    """A memory budget as written ('12GiB', 0.8, '0.8', 'auto') -> 'auto', a byte count (int)
    or a fraction of usable memory (float) in (0, 1]. A number is a fraction whether it comes as
    text (the command line) or as a number (a config file), so the same words mean the same
    thing everywhere; a number above 1 is refused as a size without its unit. Every refusal is
    one ValueError naming what was found and the forms that work (`memory_budget_forms`)."""
    if value == "auto":
        return "auto"
    shown = repr(value)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{shown} is not a memory budget; {memory_budget_forms()}")
    match = _SIZE.match(value) if isinstance(value, str) else None
    if isinstance(value, str) and match is None:
        raise ValueError(f"{shown} is not a memory budget; {memory_budget_forms()}")
    if isinstance(value, str) and match.group(2):
        unit = match.group(2)
        if unit.lower() not in _UNITS:
            raise ValueError(
                f"{shown}: {unit!r} is not a unit of size (B, KB, MB, GB, TB, KiB, MiB, GiB, "
                f"TiB); {memory_budget_forms(match.group(1))}"
            )
        size = int(float(match.group(1)) * _UNITS[unit.lower()])
        if size <= 0:
            raise ValueError(f"{shown} is not more than 0 bytes; {memory_budget_forms()}")
        if size > MAX_BUDGET_BYTES:
            raise ValueError(
                f"{shown} is more memory than any machine has: a size must be at most 1024TiB; "
                f"{memory_budget_forms()}"
            )
        return size
    number = float(value)
    if isinstance(value, float | int) and not math.isfinite(number):
        raise ValueError(f"{shown} is not a memory budget; {memory_budget_forms()}")
    if number > 1:
        text = match.group(1) if match else f"{number:g}"
        raise ValueError(
            f"{shown} has no unit and is more than 1, so it is neither a size nor a fraction; "
            f"{memory_budget_forms(text)}"
        )
    if number <= 0:
        raise ValueError(f"{shown} is not more than 0; {memory_budget_forms()}")
    return number


def budget_spec(value: object) -> int | float:
    """A memory budget as the device layer takes it: bytes (int) or a fraction of usable memory
    (float), 'auto' being `DEFAULT_BUDGET_FRACTION`."""
    parsed = parse_memory_budget(value)
    return DEFAULT_BUDGET_FRACTION if parsed == "auto" else parsed


def format_bytes(n: int | float | None) -> str:
    """1536 MiB -> '1.50 GiB'; None -> 'n/a'."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_count(n: int | float) -> str:
    """A count in natural units: 436352 -> '436k', 1234567 -> '1.23M', 3.21e9 -> '3.21B'."""
    n = float(n)
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= 0.9995 * scale:  # 999,999 is 1M, not 1000k
            value = n / scale
            return f"{value:.3g}{unit}" if abs(value) < 99.95 else f"{value:.0f}{unit}"
    return f"{n:.0f}"
