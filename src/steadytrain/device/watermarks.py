"""The MPS allocator's watermark variables, read the way the allocator reads them (mps.md §2).

`PYTORCH_MPS_HIGH_WATERMARK_RATIO` is a hard limit on every Metal allocation of the process, as a
multiple of `recommended_max_memory` (default 1.7, at most 2.0, 0.0 = no limit).
`PYTORCH_MPS_LOW_WATERMARK_RATIO` is the soft limit where the allocator starts collecting its cache
(default 1.4 on unified memory) and must not exceed HIGH (or 2.0 when HIGH is 0.0). Both are parsed
with C `strtod`, so text that is not a number reads as 0.0, and they are read once, at the first MPS
allocation. A bad pair makes that first allocation raise ("invalid low watermark ratio ..."), so
every MPS run fails: `steadytrain doctor` and the budget both use this module to see it coming.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

HIGH_VAR = "PYTORCH_MPS_HIGH_WATERMARK_RATIO"
LOW_VAR = "PYTORCH_MPS_LOW_WATERMARK_RATIO"
DEFAULT_HIGH = 1.7
DEFAULT_LOW = 1.4
HIGH_UPPER_BOUND = 2.0

_STRTOD_PREFIX = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


@dataclass(frozen=True)
class Watermarks:
    high: float
    low: float
    high_text: str | None  # the variable as set, None when unset
    low_text: str | None

    @property
    def limit_ratio(self) -> float | None:
        """The hard limit as a multiple of recommended_max_memory; None when disabled (0.0)."""
        return None if self.high == 0.0 else self.high

    def init_error(self) -> str | None:
        """The allocator's own start-up check: the message its first allocation raises, or None."""
        if not 0.0 <= self.high <= HIGH_UPPER_BOUND:
            return f"invalid high watermark ratio {self.high:g}"
        high_limit = HIGH_UPPER_BOUND if self.high == 0.0 else self.high
        if not 0.0 <= self.low <= high_limit:
            return f"invalid low watermark ratio {self.low:g}"
        return None


def strtod(text: str) -> float:
    """C `strtod` as the allocator calls it: the longest numeric prefix, 0.0 when there is none."""
    match = _STRTOD_PREFIX.match(text)
    return float(match.group(0)) if match else 0.0


def read_watermarks(environ: Mapping[str, str]) -> Watermarks:
    high_text, low_text = environ.get(HIGH_VAR), environ.get(LOW_VAR)
    return Watermarks(
        high=DEFAULT_HIGH if high_text is None else strtod(high_text),
        low=DEFAULT_LOW if low_text is None else strtod(low_text),
        high_text=high_text,
        low_text=low_text,
    )
