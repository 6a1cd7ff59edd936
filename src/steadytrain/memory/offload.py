"""Activation checkpointing whose kept layer inputs live in host memory: `activation_checkpointing:
"offload"`, for a GPU with memory of its own (never on unified memory, where host memory is the
same memory and a copy frees nothing).

With non-reentrant checkpointing a layer keeps nothing of its forward but its inputs (for the
Llama-3.2-1B shape at seq 1024: hidden 2048 × 1024 tokens × 2 bytes, 4 MiB a sample a layer),
and torch keeps them as saved tensors of the checkpoint's own input saver, packed before its
inner hooks take over. So a `saved_tensors_hooks` pair around the checkpoint call sees exactly
those inputs and nothing of the layer's inside (what the layer saves is packed by the
checkpoint's own, innermost, hooks). Each checkpoint call gets its own `_Layer`, which holds
that layer's inputs in pinned host memory from its forward to its backward.

On CUDA the copies run on a side stream, beside the layers' compute (`_SideStream`):

* forward: the side stream waits on an event recorded on the compute stream when the input is
  packed (the input is written by then), copies it to pinned host memory, and the input is
  marked as used by the side stream (`record_stream`), so the caching allocator gives its block
  to nothing else before that copy has run. The compute stream never waits. Nothing writes the
  input again before the backward (plain checkpointing's version check refuses a program that
  does), so the copy sees what the forward saw.
* backward: when the backward reaches layer i (its recomputation unpacks its inputs), the copy
  back of layer i-1's inputs is started on the side stream (a prefetch: layers are chained in
  the order their forward packed them), so it runs while layer i recomputes and back-propagates;
  the compute stream waits only on the event of the copy it is about to read, and the copied
  tensor is marked as used by the compute stream for the allocator.

Pinned buffers come from torch's caching host allocator (`pin_memory=True`), which reuses freed
blocks once the copies recorded on them are done: no new page-locked allocation each step.
`STEADYTRAIN_OFFLOAD_STREAM=0` keeps the first version: both copies on the compute stream,
serialized with the layers, no prefetch (`_Serial`; the bench times both). On a CPU tensor
(tests) the host copy is a plain copy through the same hooks (`_Plain`).

`offloaded_checkpoint` is the checkpoint function Hugging Face layers call
(`_gradient_checkpointing_func`); `use_offload` puts it on every layer whose checkpointing is
on, after the model's own switch turned checkpointing on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint

from steadytrain.run import env as run_env

if TYPE_CHECKING:
    from steadytrain.memory.choice import Mode
    from steadytrain.memory.probe import Fit

OFFLOAD = "offload"
"""The `activation_checkpointing` value (config, `TrainState`, `Mode`) for offloaded inputs."""

STREAM_SWITCH = run_env.ENV_OFFLOAD_STREAM
"""Environment variable: "0" copies on the compute stream, serialized (read at each pack through
`run_env`, so one process can time both)."""


class _Plain:
    """A CPU tensor's host copy is a plain copy (tests: the same path through the hooks)."""

    overlaps = False

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        return host, None

    def hand_over(self, tensor: torch.Tensor, ready: Any) -> torch.Tensor:
        return tensor


class _Serial(_Plain):
    """Both copies on the current (compute) stream: ordered with the layers' kernels, so the
    input's block may be reused at once and nothing is read before it is written; the GPU waits
    for each copy."""

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        return host.to(device, non_blocking=True), None


class _SideStream(_Serial):
    """Both copies on a side stream of `device`, ordered with the compute stream by events (the
    module's docstring says how). `record_stream` rather than a reference kept until an event
    says the copy is done: the allocator itself then keeps a freed block from reuse until the
    other stream has done what was queued on it by then (the copy, at most a few more), with no
    list of pending tensors here to poll and drop, and under memory pressure it waits for those
    events before it reports an out-of-memory."""

    overlaps = True

    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        self.side.wait_event(torch.cuda.current_stream(tensor.device).record_event())
        with torch.cuda.stream(self.side):
            host = super().to_host(tensor)
        tensor.record_stream(self.side)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.side):
            tensor, _ = super().to_device(host, device)
        return tensor, self.side.record_event()

    def hand_over(self, tensor: torch.Tensor, ready: Any) -> torch.Tensor:
        compute = torch.cuda.current_stream(tensor.device)
        compute.wait_event(ready)
        tensor.record_stream(compute)
        return tensor


_PLAIN, _SERIAL = _Plain(), _Serial()
_SIDE_STREAMS: dict[torch.device, _SideStream] = {}


def _copier(device: torch.device) -> _Plain:
    """How an input on `device` goes to host memory and back."""
    if device.type == "cpu":
        return _PLAIN
    if device.type != "cuda" or not run_env.offload_stream():
        return _SERIAL
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = _SideStream(device)
    return _SIDE_STREAMS[device]


_chain = threading.local()
"""`last`: a weak reference to the `_Layer` that packed most recently in this thread."""


class _Layer:
    """One checkpointed layer's kept inputs: in host memory from its forward to its backward,
    and on the device again from when they are fetched (at the latest when they are unpacked;
    with a side stream, when the layer after this one is unpacked) until they are handed to the
    recomputation. `previous` is the layer whose forward packed before this one's, held weakly:
    once its backward is done and its graph freed, there is nothing to prefetch."""

    def __init__(self) -> None:
        self.kept: list[tuple[_Plain, torch.device, torch.Tensor]] = []
        self.fetched: list[tuple[torch.Tensor, Any] | None] | None = None
        self.previous: weakref.ref[_Layer] | None = None

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.numel() == 0:  # the checkpoint's empty marker: nothing to move
            return tensor
        if not self.kept:
            self.previous = getattr(_chain, "last", None)
            _chain.last = weakref.ref(self)
        copier = _copier(tensor.device)
        self.kept.append((copier, tensor.device, copier.to_host(tensor)))
        return len(self.kept) - 1

    def fetch(self) -> list[tuple[torch.Tensor, Any] | None]:
        """Start the copies of every kept input back to its device, unless they are started
        already and not all handed over yet; each copy and its ready event."""
        if self.fetched is None:
            self.fetched = [copier.to_device(host, device) for copier, device, host in self.kept]
        return self.fetched

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        copier, device, host = self.kept[packed]
        fetched = self.fetch()
        previous = self.previous() if copier.overlaps and self.previous is not None else None
        if previous is not None:
            previous.fetch()
        # A second unpack of the same input before the others (not what the checkpoint does)
        # copies it again.
        tensor, ready = fetched[packed] or copier.to_device(host, device)
        fetched[packed] = None
        if not any(fetched):  # all handed over: another backward fetches anew
            self.fetched = None
        return copier.hand_over(tensor, ready)


def offloaded_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint(function, *args)`, non-reentrant, with the inputs it
    keeps for the backward held in host memory until then."""
    kwargs["use_reentrant"] = False
    layer = _Layer()
    with torch.autograd.graph.saved_tensors_hooks(layer.pack, layer.unpack):
        return checkpoint(function, *args, **kwargs)


def use_offload(model: torch.nn.Module) -> int:
    """Make every layer of `model` whose checkpointing is on (a Hugging Face layer's
    `gradient_checkpointing` flag, set by the model's own switch) checkpoint through
    `offloaded_checkpoint`; the number of layers (0: the model has no such layers, and offload
    is not possible). Turning checkpointing on again through the model's switch puts its plain
    checkpoint function back."""
    layers = [
        module
        for module in model.modules()
        if getattr(module, "gradient_checkpointing", False) is True
        and hasattr(module, "_gradient_checkpointing_func")
    ]
    for module in layers:
        module._gradient_checkpointing_func = offloaded_checkpoint
    return len(layers)


def offload_not_needed(fits: dict[Mode, Fit], mode: Mode, top: int, limit: float) -> str | None:
    """Why an offload mode need not be probed: the same mode without offload already fits the
    largest allowed size `top` within `limit`, where offload could only be slower (None when
    it must be probed)."""
    without = mode._replace(offload=False)
    if not mode.offload or without not in fits or fits[without].peak(top) > limit:
        return None
    return (
        f"{mode.describe()}: not probed; {without.describe()} fits micro {top} already, and the "
        "copies to host memory only add time"
    )
