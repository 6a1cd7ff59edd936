"""The doctor's run: every check in reading order (`diagnose`), the exit code, and the table or
JSON that `steadytrain doctor` prints (`run_doctor`). Defaults are `DoctorOptions`'."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from steadytrain.device import SystemProbe, default_backends
from steadytrain.device.backends import Backend
from steadytrain.doctor.checks import (
    check_autocast,
    check_cuda,
    check_device,
    check_disk,
    check_memory,
    check_mps,
    check_platform,
    check_python,
    check_selftest,
    check_torch,
)
from steadytrain.doctor.environment import check_environment
from steadytrain.doctor.findings import Context, Finding
from steadytrain.doctor.options import DoctorOptions
from steadytrain.doctor.process_group import check_process_group
from steadytrain.doctor.threads import check_threads


def diagnose(
    device: str = DoctorOptions.device,
    run_dir: str | Path = DoctorOptions.run_dir,
    selftest: bool = DoctorOptions.selftest,
    system: SystemProbe | None = None,
    backends: dict[str, Backend] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Finding]:
    """Every finding about this machine (or the one the doubles describe), in reading order."""
    system = system or SystemProbe()
    ctx = Context(
        system,
        {**default_backends(system), **(backends or {})},
        os.environ if environ is None else environ,
        device,
        Path(run_dir),
    )
    checks: list[Callable[[Context], list[Finding]]] = [
        check_platform,
        check_python,
        check_torch,
        check_cuda,
        check_mps,
        check_device,
        check_memory,
        check_environment,
        check_autocast,
        check_threads,
        check_process_group,
        check_disk,
    ]
    if selftest:
        checks.append(check_selftest)
    findings = []
    for check in checks:
        try:
            findings += check(ctx)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            findings.append(
                Finding(
                    check.__name__.removeprefix("check_"),
                    "fail",
                    f"this check itself raised {type(exc).__name__}: {exc}",
                    "report this at the steadytrain issue tracker with the output of "
                    "`steadytrain doctor --json`",
                )
            )
    return findings


def exit_code(findings: list[Finding]) -> int:
    statuses = {f.status for f in findings}
    return 2 if "fail" in statuses else 1 if "warn" in statuses else 0


def run_doctor(
    json_output: bool = DoctorOptions.json_output,
    selftest: bool = DoctorOptions.selftest,
    device: str = DoctorOptions.device,
    run_dir: str = DoctorOptions.run_dir,
    system: SystemProbe | None = None,
    backends: dict[str, Backend] | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Diagnose, print a table (or JSON and nothing else on stdout), return the exit code."""
    findings = diagnose(device, run_dir, selftest, system, backends, environ)
    code = exit_code(findings)
    if json_output:
        payload = {"findings": [asdict(f) for f in findings], "summary": _summary(findings, code)}
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        _print_table(findings, code, system or SystemProbe())
    return code


# -- output ---------------------------------------------------------------------------------


def _summary(findings: list[Finding], code: int) -> dict[str, Any]:
    counts = {s: sum(f.status == s for f in findings) for s in ("ok", "warn", "fail", "info")}
    device = next((f.data.get("device") for f in findings if f.check == "device"), None)
    verdict = {0: "healthy", 1: "warnings", 2: "broken"}[code]
    return {
        "exit_code": code,
        "verdict": verdict,
        "counts": counts,
        "device": device,
        "torch": torch.__version__,
    }


_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "blue"}


def _print_table(findings: list[Finding], code: int, system: SystemProbe) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 120)
    summary = _summary(findings, code)
    console.print(
        Text(
            f"steadytrain doctor: torch {torch.__version__}, Python {system.python_version()} "
            f"({system.machine()}), device {summary['device'] or 'none usable'}"
        ),
        soft_wrap=True,
    )
    with_fixes = any(f.fix for f in findings)
    table = Table(show_lines=with_fixes, expand=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("finding", overflow="fold")
    if with_fixes:
        table.add_column("fix", overflow="fold")
    for f in findings:
        status = Text(f.status.upper() if f.status == "fail" else f.status, style=_STYLE[f.status])
        cells = [status, Text(f.check), Text(f.message)]
        table.add_row(*cells, Text(f.fix or "")) if with_fixes else table.add_row(*cells)
    console.print(table)
    counts = summary["counts"]
    console.print(
        Text(
            f"{summary['verdict']} (exit {code}): {counts['fail']} failure(s), {counts['warn']} "
            f"warning(s), {counts['ok']} ok, {counts['info']} info",
            style=_STYLE["fail" if code == 2 else "warn" if code == 1 else "ok"],
        ),
        soft_wrap=True,
    )


__all__ = ["Finding", "diagnose", "exit_code", "run_doctor"]
