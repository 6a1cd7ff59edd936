"""`steadytrain doctor`: what a user runs first, to learn whether this machine can train and why not.

Each check is a function of a `_Context` (an injected `SystemProbe`, backends and environment) and
returns findings: a status (ok / warn / fail / info), what was found and, for warn and fail, the
fix. Exit 0 healthy, 1 warnings, 2 broken. Tests run it against `steadytrain.device.testing`'s
doubles to see a Rosetta Python, a broken MPS or a bad watermark on a Linux machine.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from steadytrain._units import DEFAULT_BUDGET_FRACTION, format_bytes
from steadytrain.device import Device, SystemProbe, default_backends, is_oom, resolve_device
from steadytrain.device.backends import Backend
from steadytrain.device.selftest import run_selftest
from steadytrain.device.watermarks import HIGH_VAR, LOW_VAR, read_watermarks, strtod
from steadytrain.errors import DeviceUnavailableError

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
class _Context:
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


def diagnose(
    device: str = "auto",
    run_dir: str | Path = ".",
    selftest: bool = False,
    system: SystemProbe | None = None,
    backends: dict[str, Backend] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Finding]:
    """Every finding about this machine (or the one the doubles describe), in reading order."""
    system = system or SystemProbe()
    ctx = _Context(
        system,
        {**default_backends(system), **(backends or {})},
        os.environ if environ is None else environ,
        device,
        Path(run_dir),
    )
    checks: list[Callable[[_Context], list[Finding]]] = [
        check_platform,
        check_python,
        check_torch,
        check_cuda,
        check_mps,
        check_device,
        check_memory,
        check_environment,
        check_autocast,
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
    json_output: bool = False,
    selftest: bool = False,
    device: str = "auto",
    run_dir: str = ".",
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


# -- checks ---------------------------------------------------------------------------------


def check_platform(ctx: _Context) -> list[Finding]:
    s = ctx.system
    chip = s.chip_name()
    if not s.is_macos():
        return [
            Finding(
                "os",
                "info",
                f"{s.os_name()} {s.os_release()} on {chip}",
                data={"os": s.os_name(), "release": s.os_release(), "chip": chip},
            )
        ]
    version = s.macos_version()
    data = {"os": "macOS", "version": s.mac_ver(), "chip": chip}
    message = f"macOS {s.mac_ver()} on {chip}"
    if ctx.apple_silicon and version is not None and version < (14, 0):
        return [
            Finding(
                "os",
                "warn",
                message
                + ": current torch runs MPS only on macOS 14 or newer, and bf16 autocast on "
                "MPS needs macOS 14",
                "update macOS to 14 (Sonoma) or newer; until then use device cpu, or an older torch "
                "with fp16/fp32, and confirm MPS with `steadytrain doctor --selftest`",
                data,
            )
        ]
    return [Finding("os", "info", message, data=data)]


def check_python(ctx: _Context) -> list[Finding]:
    s = ctx.system
    machine = s.machine()
    found = [
        Finding(
            "python",
            "ok",
            f"Python {s.python_version()} ({s.python_executable()})",
            data={"version": s.python_version(), "executable": s.python_executable()},
        )
    ]
    data = {"machine": machine}
    if not s.is_macos():
        found.append(Finding("architecture", "ok", f"Python runs as {machine}", data=data))
        return found
    translated = s.proc_translated()
    data["proc_translated"] = translated
    if translated:
        found.append(
            Finding(
                "architecture",
                "fail",
                f"Python runs as {machine} translated by Rosetta 2 on an Apple Silicon Mac "
                "(sysctl.proc_translated = 1): MPS is unavailable to it and no current torch installs",
                ROSETTA_FIX,
                data,
            )
        )
    elif machine == "x86_64":
        found.append(
            Finding(
                "architecture",
                "warn",
                "Intel Mac (x86_64, not translated): MPS needs Apple Silicon, and torch ≥ 2.3 has no "
                "x86_64 macOS wheels, so training runs on the CPU with an old torch",
                "for MPS use an Apple Silicon Mac; on this Mac set device: cpu",
                data,
            )
        )
    else:
        found.append(
            Finding(
                "architecture",
                "ok",
                f"Python runs natively as {machine} (not translated by Rosetta)",
                data=data,
            )
        )
    return found


def check_torch(ctx: _Context) -> list[Finding]:
    return [
        Finding(
            "torch",
            "ok",
            f"torch {torch.__version__}",
            data={"version": torch.__version__, "cuda": torch.version.cuda},
        )
    ]


def check_cuda(ctx: _Context) -> list[Finding]:
    cuda = ctx.backends["cuda"]
    wanted = ctx.device_spec.startswith("cuda")
    if not cuda.is_built():
        if wanted:
            return [
                Finding(
                    "cuda",
                    "fail",
                    "CUDA: this torch build has no CUDA support",
                    "install a CUDA build of torch (see pytorch.org/get-started), or use "
                    "--device auto",
                )
            ]
        return [
            Finding(
                "cuda",
                "info",
                "CUDA: not built into this torch (a CPU or macOS build)",
                data={"built": False},
            )
        ]
    if not cuda.is_available():
        hidden = ctx.environ.get("CUDA_VISIBLE_DEVICES")
        why = f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""
        return [
            Finding(
                "cuda",
                "fail" if wanted else "info",
                f"CUDA: built, but torch sees no GPU{why}",
                "check the driver with `nvidia-smi` and CUDA_VISIBLE_DEVICES" if wanted else None,
                {"built": True, "available": False},
            )
        ]
    devices, broken = [], []
    for index in range(cuda.device_count()):
        devices.append(
            f"cuda:{index} {cuda.device_name(index)} ({format_bytes(cuda.total(index))})"
        )
        try:
            cuda.probe(index)
        except Exception as exc:  # noqa: BLE001
            broken.append(f"cuda:{index}: {_one_line(exc)}")
    data = {"built": True, "available": True, "devices": devices}
    if broken:
        return [
            Finding(
                "cuda",
                "fail" if wanted else "warn",
                f"CUDA: {len(devices)} device(s), but the probe computation failed on "
                f"{'; '.join(broken)}",
                "check `nvidia-smi` for a wedged or busy GPU and restart the driver or machine; "
                "device 'auto' skips a broken GPU",
                data,
            )
        ]
    return [
        Finding("cuda", "ok", f"CUDA: {', '.join(devices)}; probe computation succeeded", data=data)
    ]


def check_mps(ctx: _Context) -> list[Finding]:
    mps = ctx.backends["mps"]
    wanted = ctx.device_spec == "mps"
    if not mps.is_built():
        if wanted or ctx.apple_silicon:
            return [
                Finding(
                    "mps",
                    "fail" if wanted else "warn",
                    "MPS: this torch build has no MPS support",
                    "MPS is in the macOS arm64 wheels only: in an arm64 Python run "
                    "`pip install --force-reinstall torch`"
                    if ctx.apple_silicon
                    else "MPS needs an Apple Silicon Mac; use --device auto or cpu here",
                    {"built": False},
                )
            ]
        return [
            Finding(
                "mps",
                "info",
                "MPS: not built into this torch (macOS arm64 builds only)",
                data={"built": False},
            )
        ]
    if not mps.is_available():
        return [
            Finding(
                "mps",
                "fail" if wanted else "warn" if ctx.apple_silicon else "info",
                "MPS: built but not available (torch.backends.mps.is_available() is False)",
                "MPS needs macOS 14 or newer on Apple Silicon, an arm64 Python and a reachable Metal "
                "device; " + VM_FIX
                if (wanted or ctx.apple_silicon)
                else None,
                {"built": True, "available": False},
            )
        ]
    recommended = getattr(mps, "recommended_max_memory", None)
    data: dict[str, Any] = {"built": True, "available": True}
    try:
        mps.probe(0)
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        data.update(working=False, error=str(exc))
        return [_mps_not_working(exc, wanted, data)]
    data["working"] = True
    detail = ""
    if recommended is not None:
        data["recommended_max_memory"] = recommended()
        detail = f"; recommended_max_memory {format_bytes(data['recommended_max_memory'])}"
    return [
        Finding(
            "mps",
            "ok",
            "MPS: built, available and working (allocated, computed and "
            f"synchronized a small matmul){detail}",
            data=data,
        )
    ]


def _mps_not_working(exc: Exception, wanted: bool, data: dict) -> Finding:
    text = str(exc)
    message = f"MPS: available but not working: the probe computation failed ({_one_line(exc)})"
    if "watermark ratio" in text:
        fix = (
            f"fix {HIGH_VAR} / {LOW_VAR} (see the environment findings): 0 ≤ LOW ≤ HIGH ≤ 2.0, "
            "set in the shell before Python starts"
        )
    elif is_oom(exc) and "MPS allocated: 0 bytes" in text:
        message += (
            ": a tiny allocation on an empty allocator ran out of memory, the signature of "
            "a macOS virtual machine (GitHub-hosted runner) with a paravirtual GPU"
        )
        fix = VM_FIX
    else:
        fix = (
            "check that no other process is stuck on the GPU, restart the Mac, and update "
            "macOS; " + VM_FIX
        )
    return Finding("mps", "fail" if wanted else "warn", message, fix, data)


def check_device(ctx: _Context) -> list[Finding]:
    try:
        device = resolve_device(ctx.device_spec, DEFAULT_BUDGET_FRACTION, ctx.backends, ctx.system)
    except DeviceUnavailableError as exc:
        return [
            Finding(
                "device",
                "fail",
                str(exc),
                "pick one of the available devices (--device auto chooses for you)",
            )
        ]
    ctx.device = device
    reading = device.memory()
    chosen = f" (chosen by {ctx.device_spec})" if ctx.device_spec == "auto" else ""
    message = (
        f"{device.torch_device}{chosen}: {device.name}; memory total "
        f"{format_bytes(reading.total)}, usable {format_bytes(reading.usable)}, budget "
        f"{format_bytes(reading.budget)} ({DEFAULT_BUDGET_FRACTION:g} of usable by default)"
    )
    if device.skipped:
        message += "; skipped " + "; ".join(device.skipped)
    data = {
        "device": str(device.torch_device),
        "memory": reading.to_dict(),
        "skipped": list(device.skipped),
    }
    if reading.budget is not None and reading.budget < SMALL_BUDGET_BYTES:
        return [
            Finding(
                "device",
                "warn",
                message + ": only very small models will fit",
                "free memory (close other programs), or train on a larger machine",
                data,
            )
        ]
    return [Finding("device", "ok", message, data=data)]


def check_memory(ctx: _Context) -> list[Finding]:
    s = ctx.system
    total, available, swap = s.memory_total(), s.memory_available(), s.swap_used()
    message = (
        f"RAM {format_bytes(total)}, available {format_bytes(available)}, swap used "
        f"{format_bytes(swap)}"
    )
    data: dict[str, Any] = {"total": total, "available": available, "swap_used": swap}
    rlimit, cgroup = s.rlimit_as(), s.cgroup_memory()
    if rlimit is not None:
        message += f"; RLIMIT_AS {format_bytes(rlimit)} (address space)"
        data["rlimit_as"] = rlimit
    if cgroup is not None:
        message += (
            f"; cgroup limit {format_bytes(cgroup.limit)}, in use "
            f"{format_bytes(cgroup.usage)} ({cgroup.path})"
        )
        data["cgroup"] = asdict(cgroup)
    if rlimit is not None or cgroup is not None:
        message += ": the CPU budget honours the tightest of these"
    pressure = s.pressure_level()
    if pressure is None:
        return [Finding("memory", "ok", message, data=data)]
    data["pressure"] = pressure
    if pressure >= 4:
        return [
            Finding(
                "memory",
                "fail",
                message + "; macOS memory pressure CRITICAL (4)",
                "close other programs before training: under critical pressure macOS "
                "kills processes without warning (jetsam, SIGKILL)",
                data,
            )
        ]
    if pressure >= 2:
        return [
            Finding(
                "memory",
                "warn",
                message + "; macOS memory pressure WARNING (2)",
                "close other programs or lower memory_budget: the system is compressing "
                "and swapping memory, and training will be slow or killed",
                data,
            )
        ]
    return [Finding("memory", "ok", message + "; macOS memory pressure normal (1)", data=data)]


def check_environment(ctx: _Context) -> list[Finding]:
    found = _watermark_findings(ctx) + _fallback_findings(ctx) + _cuda_env_findings(ctx)
    return found or [
        Finding(
            "environment",
            "info",
            "no PYTORCH_MPS_*, PYTORCH_ENABLE_MPS_FALLBACK, CUDA_VISIBLE_DEVICES "
            "or PYTORCH_CUDA_ALLOC_CONF set",
        )
    ]


def _watermark_findings(ctx: _Context) -> list[Finding]:
    wm = read_watermarks(ctx.environ)
    if wm.high_text is None and wm.low_text is None:
        return []
    mps_here = ctx.backends["mps"].is_built()
    shown = (
        f"{HIGH_VAR}={wm.high_text if wm.high_text is not None else 'unset (1.7)'}, "
        f"{LOW_VAR}={wm.low_text if wm.low_text is not None else 'unset (1.4)'}"
    )
    data = {"high": wm.high, "low": wm.low, "high_text": wm.high_text, "low_text": wm.low_text}
    inert = "" if mps_here else " (no effect on this machine, which has no MPS)"
    found = []
    for var, text in ((HIGH_VAR, wm.high_text), (LOW_VAR, wm.low_text)):
        if text is not None and not _is_number(text):
            found.append(
                Finding(
                    "env.mps_watermarks",
                    "warn",
                    f"{var}={text!r} is not a number: the allocator's strtod reads it as "
                    f"{strtod(text):g}{' (which disables the limit)' if strtod(text) == 0 else ''}{inert}",
                    f"set {var} to a number such as 1.7 (HIGH) or 1.4 (LOW), or unset it",
                    data,
                )
            )
    error = wm.init_error()
    if error is not None:
        found.append(
            Finding(
                "env.mps_watermarks",
                "fail" if mps_here else "warn",
                f"{shown}: the MPS allocator refuses this at its first allocation "
                f"(RuntimeError: {error}), so every MPS run fails{inert}",
                _watermark_fix(wm),
                data,
            )
        )
    elif wm.high == 0.0:
        found.append(
            Finding(
                "env.mps_watermarks",
                "warn",
                f"{shown}: HIGH 0.0 removes the MPS allocation limit; allocations can then exhaust "
                f"unified memory, which 'may cause system failure', instead of raising a catchable "
                f"out-of-memory error{inert}",
                f"unset {HIGH_VAR} (default 1.7) or set a ratio up to 2.0, so an out-of-memory is an "
                "error steadytrain can recover from",
                data,
            )
        )
    else:
        limit = "no soft limit" if wm.low == 0.0 else f"cache collection from LOW {wm.low:g}×"
        found.append(
            Finding(
                "env.mps_watermarks",
                "info",
                f"{shown}: MPS allocations capped at HIGH {wm.high:g}× recommended_max_memory, "
                f"{limit}; read once at the first MPS allocation, so set them before Python "
                f"starts{inert}",
                data=data,
            )
        )
    return found


def _watermark_fix(wm) -> str:
    if wm.high > 2.0:
        return f"{HIGH_VAR} is at most 2.0: unset it (default 1.7) or lower it"
    if wm.low_text is None:
        return (
            f"setting {HIGH_VAR} alone below 1.4 fails because {LOW_VAR} defaults to 1.4: "
            f"set both, LOW ≤ HIGH (e.g. {HIGH_VAR}={wm.high:g} {LOW_VAR}={wm.high * 0.8:.2g}), "
            "in the shell before Python starts"
        )
    return f"{LOW_VAR} must be ≤ {HIGH_VAR} (and ≤ 2.0): lower LOW or raise HIGH"


def _fallback_findings(ctx: _Context) -> list[Finding]:
    var = "PYTORCH_ENABLE_MPS_FALLBACK"
    value = ctx.environ.get(var)
    mps_here = ctx.backends["mps"].is_built()
    when = (
        "torch reads it once, when it is imported: it must be in the environment before "
        "Python starts (export it in the shell); setting os.environ after `import torch` has "
        "no effect"
    )
    if value is None:
        if not mps_here:
            return []
        return [
            Finding(
                "env.mps_fallback",
                "info",
                f"{var} unset: an op MPS does not implement raises NotImplementedError; "
                f"set it to 1 to run such ops on the CPU instead (slower). {when}",
            )
        ]
    if value.strip() not in ("0", "1"):
        return [
            Finding(
                "env.mps_fallback",
                "warn",
                f"{var}={value!r}: torch parses it with std::stoi, so anything but 0 or 1 "
                "is misread or ignored",
                f"export {var}=1 (or 0) in the shell, before Python starts: torch reads it "
                "once, at import",
            )
        ]
    effect = (
        "unsupported MPS ops run on the CPU, with a warning"
        if value.strip() == "1"
        else "unsupported MPS ops raise NotImplementedError"
    )
    inert = "" if mps_here else " (no effect on this machine, which has no MPS)"
    return [
        Finding(
            "env.mps_fallback",
            "info",
            f"{var}={value}: {effect}{inert}. {when}",
            data={"value": value},
        )
    ]


def _cuda_env_findings(ctx: _Context) -> list[Finding]:
    cuda = ctx.backends["cuda"]
    found = []
    visible = ctx.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        if cuda.is_built() and visible.strip() in ("", "-1"):
            found.append(
                Finding(
                    "env.cuda_visible_devices",
                    "warn",
                    f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from torch",
                    "unset CUDA_VISIBLE_DEVICES, or list the GPU indices to use (e.g. 0)",
                )
            )
        else:
            found.append(
                Finding(
                    "env.cuda_visible_devices",
                    "info",
                    f"CUDA_VISIBLE_DEVICES={visible!r}: torch sees only these GPUs, numbered from "
                    "cuda:0 in that order",
                )
            )
    conf = ctx.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is not None:
        found.append(Finding("env.cuda_alloc_conf", "info", f"PYTORCH_CUDA_ALLOC_CONF={conf!r}"))
    elif cuda.is_available():
        found.append(
            Finding(
                "env.cuda_alloc_conf",
                "info",
                "PYTORCH_CUDA_ALLOC_CONF unset: consider PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
                "True, which cuts fragmentation out-of-memory errors when batch shapes vary (set it "
                "before the first CUDA allocation)",
            )
        )
    return found


def check_autocast(ctx: _Context) -> list[Finding]:
    if ctx.device is None:
        return []
    results = ctx.device.autocast_results
    works = [r.name for r in results if r.works]
    reasons = "; ".join(f"{r.name}: {r.reason}" for r in results if not r.works)
    data = {r.name: {"works": r.works, "reason": r.reason} for r in results}
    where = f"on {ctx.device.torch_device}"
    if not works:
        return [
            Finding(
                "autocast",
                "info",
                f"no low-precision autocast runs {where} ({reasons}); training uses fp32",
                data=data,
            )
        ]
    message = f"autocast runs {where}: {', '.join(works)} (probed: matmul + backward, output dtype checked)"
    if reasons:
        message += f"; not {reasons}"
    return [Finding("autocast", "ok", message, data=data)]


def check_disk(ctx: _Context) -> list[Finding]:
    free, measured = ctx.system.disk_free(ctx.run_dir)
    message = f"{format_bytes(free)} free for the run directory ({measured})"
    data = {"free": free, "path": str(measured)}
    fix = (
        "free disk space or point run_dir at a larger disk: every checkpoint holds the weights "
        "and the optimizer state (about 3× the weights with Adam), kept twice while a new one "
        "is committed"
    )
    if free < DISK_FAIL_BYTES:
        return [
            Finding("disk", "fail", message + f": below {format_bytes(DISK_FAIL_BYTES)}", fix, data)
        ]
    if free < DISK_WARN_BYTES:
        return [
            Finding("disk", "warn", message + f": below {format_bytes(DISK_WARN_BYTES)}", fix, data)
        ]
    return [Finding("disk", "ok", message, data=data)]


def check_selftest(ctx: _Context) -> list[Finding]:
    if ctx.device is None:
        return [
            Finding(
                "selftest",
                "fail",
                "selftest not run: no usable device (see 'device')",
                "fix the device finding first",
            )
        ]
    found = []
    for result in run_selftest(ctx.device, ctx.run_dir):
        timing = f" [{result.seconds * 1000:.0f} ms]"
        data = {"seconds": result.seconds, **result.details}
        if result.ok:
            found.append(
                Finding(f"selftest.{result.name}", "ok", result.message + timing, data=data)
            )
        else:
            found.append(
                Finding(
                    f"selftest.{result.name}",
                    "fail",
                    f"on {ctx.device.torch_device}: {result.message}{timing}",
                    "this device does not train correctly: update torch and the OS, run with "
                    "--device cpu to compare, and report the output of `steadytrain doctor --selftest "
                    "--json`",
                    data,
                )
            )
    return found


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


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
