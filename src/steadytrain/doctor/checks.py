"""The doctor's checks of the platform, Python, torch, the devices, memory, autocast, disk and
the self-test; the environment variables have their own module (`environment`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from steadytrain._units import DEFAULT_BUDGET_FRACTION, format_bytes
from steadytrain.device import is_oom, resolve_device
from steadytrain.device.core import DOCTOR_HINT
from steadytrain.device.selftest import run_selftest
from steadytrain.device.watermarks import HIGH_VAR, LOW_VAR
from steadytrain.doctor.findings import (
    DISK_FAIL_BYTES,
    DISK_WARN_BYTES,
    ROSETTA_FIX,
    SMALL_BUDGET_BYTES,
    VM_FIX,
    Context,
    Finding,
    one_line,
)
from steadytrain.errors import DeviceUnavailableError

# -- checks ---------------------------------------------------------------------------------


def check_platform(ctx: Context) -> list[Finding]:
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


def check_python(ctx: Context) -> list[Finding]:
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


def check_torch(ctx: Context) -> list[Finding]:
    return [
        Finding(
            "torch",
            "ok",
            f"torch {torch.__version__}",
            data={"version": torch.__version__, "cuda": torch.version.cuda},
        )
    ]


def check_cuda(ctx: Context) -> list[Finding]:
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
            broken.append(f"cuda:{index}: {one_line(exc)}")
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


def check_mps(ctx: Context) -> list[Finding]:
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
    message = f"MPS: available but not working: the probe computation failed ({one_line(exc)})"
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


def check_device(ctx: Context) -> list[Finding]:
    try:
        device = resolve_device(ctx.device_spec, DEFAULT_BUDGET_FRACTION, ctx.backends, ctx.system)
    except DeviceUnavailableError as exc:
        return [
            Finding(
                "device",
                "fail",
                str(exc).replace(DOCTOR_HINT, ""),  # we are that diagnosis
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


def check_memory(ctx: Context) -> list[Finding]:
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


def check_autocast(ctx: Context) -> list[Finding]:
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


def check_disk(ctx: Context) -> list[Finding]:
    run_dir = Path(ctx.run_dir)
    file = next((p for p in (run_dir, *run_dir.parents) if p.is_file()), None)
    if file is not None:  # a run there stops at its start
        return [
            Finding(
                "disk",
                "fail",
                f"run directory {run_dir}: {file} is a file, not a folder",
                "give --run-dir (the run's run_dir, a fine-tune's output_dir) a folder; it is "
                "made if it does not exist",
                {"path": str(run_dir), "file": str(file)},
            )
        ]
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


def check_selftest(ctx: Context) -> list[Finding]:
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
