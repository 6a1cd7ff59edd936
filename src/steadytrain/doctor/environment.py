"""The doctor's checks of environment variables: the MPS watermarks, the CPU fallback and the
CUDA allocator settings, each a finding with its fix."""

from __future__ import annotations

from steadytrain.device.watermarks import HIGH_VAR, LOW_VAR, read_watermarks, strtod
from steadytrain.doctor.findings import Context, Finding, is_number


def check_environment(ctx: Context) -> list[Finding]:
    found = _watermark_findings(ctx) + _fallback_findings(ctx) + _cuda_env_findings(ctx)
    return found or [
        Finding(
            "environment",
            "info",
            "no PYTORCH_MPS_*, PYTORCH_ENABLE_MPS_FALLBACK, CUDA_VISIBLE_DEVICES "
            "or PYTORCH_CUDA_ALLOC_CONF set",
        )
    ]


def _watermark_findings(ctx: Context) -> list[Finding]:
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
    found = _unparsable_watermarks(wm, data, inert)
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


def _unparsable_watermarks(wm, data: dict, inert: str) -> list[Finding]:
    """A watermark that is not a number: the allocator's strtod reads a prefix of it, or 0."""
    found = []
    for var, text in ((HIGH_VAR, wm.high_text), (LOW_VAR, wm.low_text)):
        if text is not None and not is_number(text):
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


def _fallback_findings(ctx: Context) -> list[Finding]:
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


def _cuda_env_findings(ctx: Context) -> list[Finding]:
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
