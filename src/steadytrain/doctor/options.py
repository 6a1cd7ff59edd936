"""The options of `steadytrain doctor`, written once: the command line is generated from
`DoctorOptions` (cli/options.py) and `run_doctor` / `diagnose` take their defaults from its
fields. Nothing here imports torch: `steadytrain --help` reads these without loading the checks."""

from __future__ import annotations

from dataclasses import dataclass

from steadytrain._options import option


@dataclass(frozen=True)
class DoctorOptions:
    """Diagnose this machine for training: exit 0 healthy, 1 warnings, 2 broken."""

    json_output: bool = option(False, "Print the findings as JSON.", flag="--json")
    selftest: bool = option(False, "Also run a tiny training step and a checkpoint round trip.")
    device: str = option("auto", "Device to diagnose: auto, cpu, mps, cuda, cuda:N.")
    run_dir: str = option(".", "Where runs will be written (its free disk is checked).")


__all__ = ["DoctorOptions"]
