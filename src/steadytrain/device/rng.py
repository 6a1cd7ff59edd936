"""Every RNG stream a training run draws from: python, numpy, torch CPU, each CUDA device, MPS.

A resumed run reproduces the uninterrupted one only if every stream comes back, so a snapshot
holding a stream this machine cannot restore (a CUDA checkpoint resumed on a Mac, an MPS one on
Linux) is refused before anything is changed, never half-restored or silently skipped.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from steadytrain.device import mps
from steadytrain.errors import RNGStateError

STREAMS = ("python", "numpy", "torch", "cuda", "mps")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device and MPS


def get_rng_state() -> dict[str, Any]:
    """A snapshot of every stream in use. Tensors stay tensors (CPU uint8). CUDA is included once
    CUDA is initialized (before that its generators were never drawn from)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if mps.rng_available():
        state["mps"] = mps.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a `get_rng_state()` snapshot, every stream or none."""
    problems = _unrestorable(state)
    if problems:
        raise RNGStateError(
            "RNG state: the snapshot cannot be restored on this machine: "
            + "; ".join(problems)
            + ". Resume on the kind of machine that saved it, or start the run afresh (a new "
            "run_dir) to accept different random draws."
        )
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state:
        mps.set_rng_state(state["mps"])


def _unrestorable(state: dict[str, Any]) -> list[str]:
    problems = [
        f"{name!r} stream is missing" for name in ("python", "numpy", "torch") if name not in state
    ]
    unknown = sorted(set(state) - set(STREAMS))
    if unknown:
        problems.append(
            f"unknown stream(s) {', '.join(map(repr, unknown))} (expected only "
            f"{', '.join(STREAMS)})"
        )
    if "cuda" in state:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < len(state["cuda"]):
            problems.append(
                f"it has {len(state['cuda'])} CUDA device stream(s) but this machine "
                f"has {have} CUDA device(s)"
            )
    if "mps" in state and not mps.rng_available():
        problems.append("it has an MPS stream but MPS is not available here")
    return problems
