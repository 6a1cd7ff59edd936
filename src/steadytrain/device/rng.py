"""Every RNG stream a training run draws from: python, numpy, torch CPU, each CUDA device, MPS."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device and MPS


def get_rng_state() -> dict[str, Any]:
    """A snapshot of every stream in use. Tensors stay tensors (CPU uint8)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if _mps_in_use():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a `get_rng_state()` snapshot; a stream the snapshot has but this machine cannot
    restore is an error, never skipped silently."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(state["cuda"]):
            raise RuntimeError(
                f"the saved RNG state has {len(state['cuda'])} CUDA device stream(s) but this "
                f"machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state:
        if not _mps_in_use():
            raise RuntimeError("the saved RNG state has an MPS stream but MPS is not in use here")
        torch.mps.set_rng_state(state["mps"])


def _mps_in_use() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_built() and mps.is_available())
