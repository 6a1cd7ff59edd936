"""Prove a device trains: what `steadytrain doctor --selftest` runs on the resolved device.

Availability flags are not proof (MPS can report available and compute nothing, mps.md §9), so
this does the work a run does, at toy size: a matmul compared with the CPU, a few optimizer steps
whose loss must fall with finite gradients, and a checkpoint written the way steadytrain writes
them (weights in safetensors, optimizer state with `torch.save`) in the run directory, read back
with `weights_only=True` and compared bit for bit, also after a trip back onto the device.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from steadytrain.device.core import Device

MATMUL_RTOL = 1e-3
MATMUL_ATOL = 1e-3
TRAIN_STEPS = 8


@dataclass
class SelftestCheck:
    name: str
    ok: bool
    message: str
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)


def run_selftest(device: Device, run_dir: str | Path) -> list[SelftestCheck]:
    """Every check runs even when an earlier one fails, so one report shows all that is wrong."""
    return [
        _timed("matmul", lambda: _matmul(device)),
        _timed("train_step", lambda: _train(device)),
        _timed("checkpoint", lambda: _checkpoint(device, Path(run_dir))),
    ]


def _timed(name: str, check) -> SelftestCheck:
    start = time.perf_counter()
    try:
        ok, message, details = check()
    except Exception as exc:  # noqa: BLE001 - a failure of any kind is the finding
        ok, message, details = False, f"raised {type(exc).__name__}: {exc}", {}
    return SelftestCheck(name, ok, message, time.perf_counter() - start, details)


def _inputs(*shape: int, seed: int) -> torch.Tensor:
    """Fixed values from a private generator: the selftest never shifts the global RNG."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=generator) * 2 - 1


def _matmul(device: Device) -> tuple[bool, str, dict]:
    a, b = _inputs(128, 64, seed=1), _inputs(64, 96, seed=2)
    expected = a @ b
    got = (a.to(device.torch_device) @ b.to(device.torch_device)).cpu()
    device.synchronize()
    error = float((got - expected).abs().max())
    ok = bool(torch.allclose(got, expected, rtol=MATMUL_RTOL, atol=MATMUL_ATOL))
    verdict = "matches" if ok else "does NOT match"
    return (
        ok,
        (
            f"128×64 @ 64×96 on {device.torch_device} {verdict} the CPU result (max abs "
            f"error {error:.2e}, tolerance {MATMUL_ATOL:g})"
        ),
        {"max_abs_error": error},
    )


def _tiny_model(device: Device) -> torch.nn.Module:
    # Building layers draws from the global CPU RNG; fork it so the caller's stream is untouched,
    # then overwrite every weight with fixed values.
    with torch.random.fork_rng(devices=[]):
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
    with torch.no_grad():
        for seed, param in enumerate(model.parameters(), start=10):
            param.copy_(_inputs(*param.shape, seed=seed) * 0.3)
    return model.to(device.torch_device)


def _train(device: Device) -> tuple[bool, str, dict]:
    model = _tiny_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    x = _inputs(64, 16, seed=3).to(device.torch_device)
    y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
    losses, bad_grads = [], []
    for step in range(TRAIN_STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            bad_grads.append(step)
        optimizer.step()
        losses.append(float(loss.detach()))
    device.synchronize()
    finite = all(torch.isfinite(torch.tensor(losses)))
    falls = finite and losses[-1] < losses[0]
    ok = falls and not bad_grads
    summary = f"{TRAIN_STEPS} AdamW steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    if bad_grads:
        summary += f"; non-finite gradients at step(s) {bad_grads}"
    elif not falls:
        summary += "; the loss did not fall"
    else:
        summary += ", gradients finite"
    return ok, summary, {"losses": losses}


def _checkpoint(device: Device, run_dir: Path) -> tuple[bool, str, dict]:
    model = _tiny_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(_inputs(4, 16, seed=4).to(device.torch_device)).sum().backward()
    optimizer.step()  # so the optimizer has state tensors to save
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    optim_state = _to_cpu(optimizer.state_dict())

    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=run_dir, prefix=".steadytrain-selftest-") as tmp:
        start = time.perf_counter()
        save_file(weights, str(Path(tmp) / "model.safetensors"))
        torch.save(optim_state, Path(tmp) / "optimizer.pt")
        saved = time.perf_counter() - start
        start = time.perf_counter()
        loaded_weights = load_file(str(Path(tmp) / "model.safetensors"))
        loaded_optim = torch.load(Path(tmp) / "optimizer.pt", weights_only=True)
        loaded = time.perf_counter() - start

    problems = _differences(weights, loaded_weights, "model") + _differences(
        optim_state, loaded_optim, "optimizer"
    )
    model.load_state_dict(loaded_weights)  # and back onto the device
    on_device = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    problems += _differences(weights, on_device, "model after reloading onto the device")
    message = (
        f"saved and reloaded model + optimizer state in {run_dir} "
        f"(save {saved * 1000:.0f} ms, load {loaded * 1000:.0f} ms)"
    )
    if problems:
        return False, message + "; differs: " + "; ".join(problems[:5]), {"problems": problems}
    return True, message + ", bitwise identical", {"save_s": saved, "load_s": loaded}


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _differences(expected: Any, got: Any, where: str) -> list[str]:
    if isinstance(expected, torch.Tensor):
        same = (
            isinstance(got, torch.Tensor)
            and expected.dtype == got.dtype
            and expected.shape == got.shape
            and torch.equal(_bits(expected), _bits(got))
        )
        return [] if same else [where]
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return [f"{where} (keys)"]
        return [p for k in expected for p in _differences(expected[k], got[k], f"{where}.{k}")]
    if isinstance(expected, list | tuple):
        if not isinstance(got, list | tuple) or len(expected) != len(got):
            return [f"{where} (length)"]
        return [
            p
            for i, (e, g) in enumerate(zip(expected, got, strict=True))
            for p in _differences(e, g, f"{where}[{i}]")
        ]
    return [] if expected == got else [where]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so -0.0 vs 0.0 or a changed NaN payload counts as a difference."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
