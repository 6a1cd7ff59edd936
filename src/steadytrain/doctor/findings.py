"""What a doctor check returns (`Finding`), what it reads (`Context`: injected system probe,
backends and environment), and the thresholds and fixes the checks share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from steadytrain.device import Device, SystemProbe
from steadytrain.device.backends import Backend

Status = Literal["ok", "warn", "fail", "info"]
GiB = 1024**3
DISK_WARN_BYTES = 10 * GiB
DISK_FAIL_BYTES = 1 * GiB
SMALL_BUDGET_BYTES = 1 * GiB

ROSETTA_FIX = (
    "install an arm64 Python, e.g. from python.org or `brew install python`; torch ≥ 2.3 "
    "has no x86_64 macOS wheels. Then recreate the virtual environment with it and check "
    "that `python -c 'import platform; print(platform.machine())'` prints arm64."
)
VM_FIX = (
    "run on a physical Apple Silicon Mac, outside any sandbox or virtual machine (GitHub-"
    "hosted macOS runners and Apple Virtualization VMs have no usable Metal device). Until "
    "then device 'auto' trains on the CPU; pass --device cpu to say so explicitly."
)


@dataclass
class Finding:
    check: str
    status: Status
    message: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    system: SystemProbe
    backends: dict[str, Backend]
    environ: Mapping[str, str]
    device_spec: str
    run_dir: Path
    device: Device | None = None

    @property
    def apple_silicon(self) -> bool:
        """A Mac whose hardware could run MPS (native arm64, or arm64 under a translated Python)."""
        return self.system.is_macos() and (
            self.system.machine() == "arm64" or self.system.proc_translated()
        )


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
