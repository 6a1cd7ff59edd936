"""Resolve a device spec to a working `Device`, and read its memory."""

from __future__ import annotations

import os
import re
from functools import cached_property

import torch

from steadytrain._units import DEFAULT_BUDGET_FRACTION
from steadytrain.device.autocast import CANDIDATES, AutocastResult, check_autocast
from steadytrain.device.backends import Backend, CPUBackend, CUDABackend
from steadytrain.device.budget import budget_bytes, check_budget_spec
from steadytrain.device.mps import MPSBackend
from steadytrain.device.reading import MemoryReading, PeakReading
from steadytrain.device.system import SystemProbe
from steadytrain.errors import DeviceUnavailableError

ACCELERATORS = ("cuda", "mps")  # the order "auto" tries them in
_SPEC = re.compile(r"^(cuda|mps|cpu)(?::(\d+))?$")


class Device:
    """A resolved, working device: `torch_device`, `type`, memory readings and controls."""

    def __init__(
        self,
        backend: Backend,
        index: int = 0,
        budget_spec: int | float = DEFAULT_BUDGET_FRACTION,
        system: SystemProbe | None = None,
        skipped: tuple[str, ...] = (),
    ) -> None:
        self.backend = backend
        self.index = index
        self.type = backend.name
        self.torch_device = (
            torch.device(self.type, index) if self.type == "cuda" else torch.device(self.type)
        )
        self.budget_spec = check_budget_spec(budget_spec)
        self.system = system or SystemProbe()
        self.skipped = skipped
        """Why "auto" passed over an accelerator on the way here (empty when none was skipped)."""
        self._cpu_peak_resets = False

    def __repr__(self) -> str:
        return f"Device({self.torch_device})"

    @property
    def discrete_memory(self) -> bool:
        """The device has memory of its own, apart from the host's (CUDA): a tensor moved to host
        memory frees device memory. On MPS (unified memory) and on CPU it is the same memory."""
        return self.type == "cuda"

    @property
    def name(self) -> str:
        """What the hardware calls itself: GPU name, Apple chip, CPU model."""
        return self.backend.device_name(self.index)

    @cached_property
    def usable(self) -> int | None:
        """Read once: a run's budget is fixed at its start (and reading it on CPU costs cgroup
        and /proc reads that have no place in every step's memory reading)."""
        return self.backend.usable(self.index)

    @property
    def budget(self) -> int | None:
        """Bytes this run may use: an explicit size wins; a fraction multiplies usable memory."""
        return budget_bytes(self.budget_spec, self.usable)

    def memory(self) -> MemoryReading:
        b, i, s = self.backend, self.index, self.system
        usable = self.usable
        return MemoryReading(
            allocated=b.allocated(i),
            reserved=b.reserved(i),
            peak=b.peak(i),
            total=b.total(i),
            budget=budget_bytes(self.budget_spec, usable),
            rss=s.process_rss(),
            system_available=s.memory_available(),
            swap_used=s.swap_used(),
            alloc_retries=b.alloc_retries(i),
            pressure=s.pressure_level(),
            usable=usable,
        )

    def swap_in(self) -> int | None:
        """Bytes swapped in since boot, machine-wide; None where unknown (`SystemProbe.swap_in`)."""
        return self.system.swap_in()

    def empty_cache(self) -> None:
        self.backend.empty_cache()

    def synchronize(self) -> None:
        self.backend.synchronize(self.index)

    def reset_peak(self) -> None:
        self.backend.reset_peak(self.index)

    def reset_peak_reading(self) -> None:
        """Start a `peak_reading` window: every peak counter this device has starts from now
        (on MPS the cache is emptied so that driver memory afterwards shows what was allocated)."""
        self.backend.reset_peak(self.index)
        if self.type == "cpu":
            self._cpu_peak_resets = self.system.reset_peak_rss()
        elif self.type == "mps":
            self.backend.empty_cache()

    def peak_reading(self) -> PeakReading:
        """The peak since `reset_peak_reading` (see `PeakReading` for what each device gives)."""
        if self.type == "cuda":
            return PeakReading(self.backend.peak(self.index), "exact")
        if self.type == "mps":
            return PeakReading(self.backend.reserved(self.index), "lower_bound")
        if self._cpu_peak_resets:
            return PeakReading(self.system.peak_rss(), "resident")
        return PeakReading(None, "none")

    @cached_property
    def autocast_results(self) -> tuple[AutocastResult, ...]:
        """For bf16 and fp16: whether autocast really runs here, and if not, why."""
        return tuple(self._autocast_result(dtype) for dtype in CANDIDATES)

    @cached_property
    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """Low-precision dtypes autocast really runs here, found by running a tiny matmul and a
        backward under autocast; a dtype that only warns and silently disables autocast is out."""
        return tuple(r.dtype for r in self.autocast_results if r.works)

    def _autocast_result(self, dtype: torch.dtype) -> AutocastResult:
        if self.type == "mps" and dtype == torch.bfloat16:
            version = self.system.macos_version()
            if version is not None and version < (14, 0):
                return AutocastResult(
                    dtype,
                    False,
                    f"bf16 on MPS needs macOS 14 or newer; this is macOS {self.system.mac_ver()}",
                )
        return check_autocast(dtype, lambda d: self.backend.autocast_probe(self.index, d))


# The end of the "device not usable" message: where doctor itself says it, doctor leaves it out.
DOCTOR_HINT = ", and run `steadytrain doctor` for a diagnosis"


def default_backends(system: SystemProbe | None = None) -> dict[str, Backend]:
    system = system or SystemProbe()
    return {"cuda": CUDABackend(), "mps": MPSBackend(system), "cpu": CPUBackend(system)}


def resolve_device(
    spec: str = "auto",
    budget_spec: int | float = DEFAULT_BUDGET_FRACTION,
    backends: dict[str, Backend] | None = None,
    system: SystemProbe | None = None,
) -> Device:
    """'auto' prefers cuda, then mps, then cpu, taking an accelerator only after it computed a
    small matmul (MPS can report available and fail on its first allocation, mps.md §9). A
    requested device that is missing or broken raises `DeviceUnavailableError` naming what is
    available. `backends` replaces some or all of the real ones (tests pass doubles)."""
    system = system or SystemProbe()
    backends = {**default_backends(system), **(backends or {})}
    check_budget_spec(budget_spec)
    rank_gpu = rank_cuda_index()
    if spec == "auto":
        skipped = []
        for name in ACCELERATORS:
            backend = backends[name]
            if not backend.is_available() or backend.device_count() < 1:
                continue
            index = rank_gpu if name == "cuda" and rank_gpu is not None else 0
            if index >= backend.device_count():
                raise DeviceUnavailableError(_too_few_gpus(index, backend.device_count()))
            try:
                _select(backend, index)
                backend.probe(index)
            except Exception as exc:  # noqa: BLE001 - a broken accelerator falls back to the next
                skipped.append(
                    f"{name}: reports available but failed a small computation ({_one_line(exc)})"
                )
                continue
            return Device(backend, index, budget_spec, system, tuple(skipped))
        return Device(backends["cpu"], 0, budget_spec, system, tuple(skipped))

    match = _SPEC.match(spec)
    if match is None or (match.group(1) != "cuda" and match.group(2) not in (None, "0")):
        raise DeviceUnavailableError(
            f"device: unknown device {spec!r}; use auto, cpu, mps, cuda or cuda:N"
        )
    name, index = match.group(1), int(match.group(2) or 0)
    if name == "cuda" and match.group(2) is None and rank_gpu is not None:
        index = rank_gpu  # "cuda" under torchrun: this rank's own GPU
    backend = backends[name]
    why = _why_unavailable(backend, index)
    if why is not None and index == rank_gpu and match.group(2) is None and backend.is_available():
        raise DeviceUnavailableError(_too_few_gpus(index, backend.device_count()))
    if why is None:
        try:
            _select(backend, index)
            backend.probe(index)
        except Exception as exc:  # noqa: BLE001
            why = f"it reports available but failed a small computation ({_one_line(exc)})"
    if why is not None:
        raise DeviceUnavailableError(
            f"device: {spec!r} is not usable on this machine: {why}. Available here: "
            f"{', '.join(available_devices(backends, system))}. Set device to one of those or to "
            f"'auto'{DOCTOR_HINT}."
        )
    return Device(backend, index, budget_spec, system)


def rank_cuda_index() -> int | None:
    """This process's GPU under a launcher of several processes (torchrun: WORLD_SIZE > 1), its
    LOCAL_RANK; None for a single process. "auto" and "cuda" resolve to cuda:LOCAL_RANK there,
    so that no rank computes, allocates or opens a communicator on another rank's GPU."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return None  # the process group's own check names the bad variable


def wait_on_host(device: str | torch.device) -> None:
    """Block this process until the collectives queued on `device` are done. NCCL's all-reduce
    returns once it is queued on the GPU, so an all-reduce alone is no barrier there: rank 0
    went on to hash a checkpoint's files before rank 1 had written its own (seen on two GPUs:
    "extra ['rng-rank-1.safetensors']", and the resume refused the checkpoint). gloo's returns
    when done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def collective_device(device: torch.device, backends: str) -> torch.device:
    """Where a collective of a group whose backends are `backends` (`dist.get_backend_config`:
    "nccl", "cpu:gloo,cuda:nccl", ...) can take a tensor now on `device`: there; where that is
    the CPU (the shards in host memory, `fsdp_offload`, or a group made before the rank's
    device) and the group serves no CPU tensors (an NCCL-only group, which
    `init_process_group()` makes on a CUDA machine), this rank's current GPU, which device
    resolution made its own (never a bare "cuda", which is cuda:0)."""
    if device.type != "cpu" or not torch.cuda.is_available():
        return device
    if "cpu" in backends.lower() or "gloo" in backends.lower():
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _select(backend: Backend, index: int) -> None:
    """Make `index` the backend's current device (CUDA: `torch.cuda.set_device`), before anything
    touches it: whatever later runs on "the current device" (FSDP's device mesh, the pinning
    thread of a DataLoader, a synchronize without an index, NCCL's communicators) runs on this
    rank's GPU, not on cuda:0, which is rank 0's."""
    select = getattr(backend, "select", None)
    if callable(select):
        select(index)


def _too_few_gpus(index: int, count: int) -> str:
    return (
        f"device: this process is LOCAL_RANK {index} of a multi-process launch, but this machine "
        f"has {count} CUDA device(s); start at most {count} process(es) per node "
        "(torchrun --nproc_per_node), one per GPU"
    )


def available_devices(
    backends: dict[str, Backend] | None = None, system: SystemProbe | None = None
) -> list[str]:
    """Device specs that are available and pass the small computation, best first."""
    backends = {**default_backends(system), **(backends or {})}
    names = []
    for name in ACCELERATORS:
        backend = backends[name]
        if not backend.is_available():
            continue
        for index in range(backend.device_count()):
            try:
                backend.probe(index)
            except Exception:  # noqa: BLE001 - broken means not available
                continue
            names.append(f"cuda:{index}" if name == "cuda" else name)
    names.append("cpu")
    return names


def _why_unavailable(backend: Backend, index: int) -> str | None:
    name = backend.name
    if not backend.is_built():
        where = " (MPS is in the macOS arm64 wheels only)" if name == "mps" else ""
        return f"this torch build has no {name.upper()} support{where}"
    if not backend.is_available():
        if name == "mps":
            return (
                "MPS is built but not available: it needs an Apple Silicon Mac with macOS 14 "
                "or newer, an arm64 Python, and a reachable Metal device (not a VM or sandbox)"
            )
        return (
            f"torch was built with {name.upper()} but sees no device (check the driver and "
            "CUDA_VISIBLE_DEVICES)"
        )
    count = backend.device_count()
    if index >= count:
        return f"there is no {name}:{index}; this machine has {count} {name.upper()} device(s)"
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
