"""Out-of-memory classification against every message the reference (mps.md §3, §9) quotes, the
cause chain, look-alikes that are not OOM, and one real CPU out-of-memory under RLIMIT_AS."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from steadytrain.device import is_oom, oom_kind, oom_request_bytes

# mps.md §3.2, watermark on (the template, filled in with sizes as MPSAllocator formats them)
MPS_OOM_WATERMARK = (
    "MPS backend out of memory (MPS allocated: 18.10 GB, other allocations: 605.34 MB, max "
    "allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool. Use "
    "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may cause "
    "system failure)."
)
# mps.md §3.2, ratio 0.0
MPS_OOM_NO_LIMIT = (
    "MPS backend out of memory (MPS allocated: 30.00 GB, other allocations: 2.00 GB). Tried to "
    "allocate 4.00 GB on shared pool."
)
# mps.md §9, GitHub-hosted macOS runner (actions/runner-images#9918), verbatim
MPS_OOM_RUNNER = (
    "MPS backend out of memory (MPS allocated: 0 bytes, other allocations: 0 bytes, max allowed: "
    "7.93 GB). Tried to allocate 256 bytes on private pool."
)
# mps.md §3.1: buffer over Metal's maximum size
MPS_INVALID_BUFFER = "Invalid buffer size: 20.00 GB"
# mps.md §3.3, real text from torch 2.11 on an 80 GB GPU, verbatim
CUDA_ALLOCATOR_OOM = (
    "CUDA out of memory. Tried to allocate 4096.00 GiB. GPU 0 has a total capacity of 79.18 GiB "
    "of which 78.66 GiB is free. Including non-PyTorch memory, this process has 518.00 MiB memory "
    "in use. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by "
    "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments..."
)
# mps.md §3.1: the driver's OOM, raised as torch.AcceleratorError
CUDA_DRIVER_OOM = "CUDA error: out of memory"
# mps.md §3.4, real text, verbatim
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"
)
# mps.md §3.4: Windows / Android say "not enough memory" after the same prefix
CPU_OOM_WINDOWS = (
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried "
    "to allocate 1073741824 bytes."
)

# mps.md §3.2 failures that are not out-of-memory, verbatim
MISSING_OP = (
    "The operator 'aten::upsample_bicubic2d.out' is not currently implemented for the MPS device. "
    "If you want this op to be added in priority during the prototype phase of this feature, "
    "please comment on https://github.com/pytorch/pytorch/issues/77764. As a temporary fix, you "
    "can set the environment variable `PYTORCH_ENABLE_MPS_FALLBACK=1` to use the CPU as a "
    "fallback for this op. WARNING: this will be slower than running natively on MPS."
)
COMMAND_BUFFER = (
    "Error: command buffer exited with error status. The Metal Performance Shaders operations "
    "encoded on it may not have completed."
)
NO_FLOAT64 = (
    "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64. "
    "Please use float32 instead."
)
MACOS_TOO_OLD = (
    "The MPS backend is supported on macOS 14.0+. Current OS version can be queried using sw_vers"
)


def _shape_error() -> RuntimeError:
    try:
        torch.ones(4, 3) @ torch.ones(4, 5)
    except RuntimeError as exc:
        return exc
    raise AssertionError("the mismatched matmul did not raise")


@pytest.mark.parametrize(
    ("exc", "request_bytes"),
    [
        pytest.param(RuntimeError(MPS_OOM_WATERMARK), 256 * 1024**2, id="mps-watermark"),
        pytest.param(RuntimeError(MPS_OOM_NO_LIMIT), 4 * 1024**3, id="mps-no-limit"),
        pytest.param(RuntimeError(MPS_OOM_RUNNER), 256, id="mps-github-runner"),
        pytest.param(RuntimeError(MPS_INVALID_BUFFER), None, id="mps-invalid-buffer"),
        pytest.param(torch.OutOfMemoryError(CUDA_ALLOCATOR_OOM), 4096 * 1024**3, id="cuda-type"),
        pytest.param(RuntimeError(CUDA_ALLOCATOR_OOM), 4096 * 1024**3, id="cuda-torchscript-plain"),
        pytest.param(torch.AcceleratorError(CUDA_DRIVER_OOM), None, id="cuda-driver"),
        pytest.param(RuntimeError(CPU_OOM), 4294967296, id="cpu"),
        pytest.param(RuntimeError(CPU_OOM_WINDOWS), 1073741824, id="cpu-windows"),
        pytest.param(RuntimeError("could not create a primitive"), None, id="cpu-onednn"),
        pytest.param(MemoryError(), None, id="python-memoryerror"),
    ],
)
def test_every_documented_oom_is_recognised(exc, request_bytes):
    assert is_oom(exc)
    assert oom_request_bytes(exc) == request_bytes


def test_mps_oom_is_a_plain_runtime_error_recognised_by_message_not_type():
    exc = RuntimeError(MPS_OOM_WATERMARK)
    assert not isinstance(exc, torch.OutOfMemoryError)
    assert oom_kind(exc).startswith("MPS allocator")


def test_the_oom_type_alone_is_enough():
    assert oom_kind(torch.OutOfMemoryError("no message at all")) == "torch.OutOfMemoryError"
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError


@pytest.mark.parametrize(
    "exc",
    [
        pytest.param(NotImplementedError(MISSING_OP), id="mps-missing-op"),
        pytest.param(RuntimeError(COMMAND_BUFFER), id="mps-command-buffer"),
        pytest.param(TypeError(NO_FLOAT64), id="mps-float64"),
        pytest.param(RuntimeError(MACOS_TOO_OLD), id="mps-macos-too-old"),
        pytest.param(_shape_error(), id="shape-mismatch"),
        pytest.param(
            torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
            id="cuda-illegal-access",
        ),
        pytest.param(ValueError("batch size must be positive"), id="value-error"),
    ],
)
def test_failures_that_are_not_out_of_memory(exc):
    assert not is_oom(exc)
    assert oom_request_bytes(exc) is None


def test_oom_found_through_cause():
    try:
        try:
            raise RuntimeError(MPS_OOM_WATERMARK)
        except RuntimeError as inner:
            raise ValueError("the training step failed") from inner
    except ValueError as outer:
        assert is_oom(outer)
        assert oom_request_bytes(outer) == 256 * 1024**2


def test_oom_found_through_context():
    try:
        try:
            raise RuntimeError(CPU_OOM)
        except RuntimeError:
            raise KeyError("raised while handling the OOM") from None
    except KeyError as outer:
        assert outer.__cause__ is None and outer.__suppress_context__
        assert is_oom(outer)  # the context is still there, and it is the real reason


def test_a_cycle_in_the_chain_terminates():
    a, b = RuntimeError("first"), RuntimeError("second")
    a.__context__, b.__context__ = b, a
    assert not is_oom(a)


def test_request_size_units():
    assert oom_request_bytes(RuntimeError("Tried to allocate 2.00 GiB")) == 2 * 1024**3
    assert oom_request_bytes(RuntimeError("Tried to allocate 512.00 KiB")) == 512 * 1024
    # MPS prints binary sizes with decimal labels (MPSAllocator format_size divides by 1024**n)
    assert oom_request_bytes(RuntimeError("Tried to allocate 1.50 GB on private pool.")) == int(
        1.5 * 1024**3
    )
    assert oom_request_bytes(RuntimeError("you tried to allocate 123 bytes.")) == 123


REAL_CPU_OOM = textwrap.dedent("""
    import resource
    import torch
    from steadytrain.device import is_oom, oom_request_bytes

    # Thread pools must start before the limit, or OpenMP aborts instead of torch raising.
    x = torch.randn(64, 64, requires_grad=True)
    (x @ x).sum().backward()
    vm_kib = next(int(line.split()[1]) for line in open("/proc/self/status")
                  if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_kib * 1024 + 256 * 2**20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        torch.ones(2**30, dtype=torch.uint8)
    except Exception as exc:
        print(is_oom(exc))
        print(oom_request_bytes(exc))
        print(type(exc).__name__)
        print(exc)
    else:
        print("no error")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_real_cpu_oom_under_rlimit_as_is_classified():
    done = subprocess.run(
        [sys.executable, "-c", REAL_CPU_OOM], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "True", done.stdout
    assert lines[1] == str(2**30)
    assert lines[2] == "RuntimeError"  # plain RuntimeError, not torch.OutOfMemoryError
    assert "DefaultCPUAllocator" in "\n".join(lines[3:])
