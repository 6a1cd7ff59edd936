"""Choosing the arithmetic: autocast dtype and grad scaler, refused up front when the device cannot."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from steadytrain.device import Device
from steadytrain.errors import BadInputError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    name: str  # "fp32" | "bf16" | "fp16"
    device_type: str
    dtype: torch.dtype | None  # autocast dtype, None for fp32
    scaler: torch.amp.GradScaler | None  # fp16 only

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: fp16's times the scaler's factor, so that small gradients
        do not underflow; the loss itself otherwise."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: divide the gradients by the scaler's factor again, before they are clipped."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
        """`optimizer.step()`, or fp16's scaler's step and update. Returns whether the scaler
        skipped the step (gradients with inf or NaN): a tensor, so nothing waits for the device."""
        if self.scaler is None:
            optimizer.step()
            return False
        before = self.scaler._scale.clone()  # compared after the update, without a sync here
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler._scale < before


def resolve_precision(requested: str, device: Device) -> Precision:
    """'auto': bf16 on CUDA where it runs, else fp16; fp32 on MPS and CPU (see config docs)."""
    if requested == "auto":
        if device.type == "cuda":
            requested = "bf16" if torch.bfloat16 in device.autocast_dtypes else "fp16"
        else:
            requested = "fp32"
    if requested == "fp32":
        return Precision("fp32", device.type, None, None)
    supported = device.autocast_dtypes  # probed by running, so only when a low precision is asked
    dtype = _DTYPES[requested]
    if dtype not in supported:
        names = [n for n, d in _DTYPES.items() if d in supported] + ["fp32"]
        why = next((r.reason for r in device.autocast_results if r.dtype == dtype), "")
        raise BadInputError(
            f"precision: {requested} autocast does not run on {device.torch_device} here (probed "
            "with a small matmul and backward"
            + (", and a GradScaler step for fp16" if requested == "fp16" else "")
            + (f": {why}" if why else "")
            + f"); use one of: {', '.join(names)}"
        )
    scaler = None
    if requested == "fp16":
        scaler = torch.amp.GradScaler(device.type)
    return Precision(requested, device.type, dtype, scaler)
