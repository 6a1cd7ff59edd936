"""A native crash (SIGSEGV, SIGABRT) of a child whose address space was near its cap (RLIMIT_AS)
is taken for an out-of-memory by `steadytrain run`: TensorFlow's oneDNN kernels crash when an
allocation fails under the cap instead of raising. Before, the supervisor restarted the same
size until it gave up (exit 4). Torch- and TensorFlow-free: the child is a tiny Python script
that crashes itself for real (the supervisor samples its real /proc); the crash of TensorFlow
itself is in test_keras_tensorflow.py."""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

import pytest

from steadytrain.supervisor import Supervisor, SupervisorOptions
from steadytrain.supervisor.address_space import AddressSpace, read_address_space
from steadytrain.supervisor.child_exit import ChildExit
from steadytrain.telemetry.files import read_jsonl

GIB = 1024**3

CHILD = r"""
import json, os, resource, signal, sys, time
from pathlib import Path

run_dir, crash, cap_share = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
run_dir.mkdir(exist_ok=True)
cap = os.environ.get("STEADYTRAIN_MAX_MICRO_BATCH")
micro = min(8, int(cap)) if cap else 8
with open(run_dir / "events.jsonl", "a") as f:  # what a trainer's fit() records first
    f.write(json.dumps({"time": time.time(), "event": "fit_start", "step": 0,
                        "micro_batch_size": micro}) + "\n")
if micro < 8:
    sys.exit(0)  # the smaller batch fits
if cap_share:
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                if l.startswith("VmPeak:"))
    limit = int(peak / cap_share)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
time.sleep(0.6)  # the supervisor samples /proc every 0.1 s
os.kill(os.getpid(), getattr(signal, crash))
"""


def supervise(tmp_path: Path, crash: str, cap_share: float) -> tuple[int, Path, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    options = SupervisorOptions(
        run_dir=run_dir, max_restarts=1, backoff_initial=0.01, backoff_max=0.02
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    command = [sys.executable, str(script), str(run_dir), crash, str(cap_share)]
    code = Supervisor(command, options, environ=environ, out=out).run()
    return code, run_dir, out.getvalue()


def test_a_segfault_near_the_address_space_cap_restarts_at_half_the_batch(tmp_path: Path):
    code, run_dir, said = supervise(tmp_path, "SIGSEGV", 0.95)
    assert code == 0, said
    restarts = [r for r in read_jsonl(run_dir / "events.jsonl") if r["event"] == "restart"]
    assert [(r["signal"], r["max_micro_batch"]) for r in restarts] == [("SIGSEGV", 4)]
    assert "cap (RLIMIT_AS): taken for an allocation that failed there" in restarts[0]["reason"]
    assert "STEADYTRAIN_MAX_MICRO_BATCH=4" in said


@pytest.mark.slow  # the judgment of SIGABRT: test_only_a_native_crash_near_the_cap_counts_...
def test_an_abort_near_the_cap_is_one_too(tmp_path: Path):
    """TensorFlow aborts when a thread cannot get its stack under the cap; a C++ bad_alloc
    aborts too."""
    code, _run_dir, said = supervise(tmp_path, "SIGABRT", 0.95)
    assert code == 0, said


@pytest.mark.slow  # the same judgment in-process: test_only_a_native_crash_near_the_cap_...
def test_a_segfault_far_from_any_cap_is_restarted_as_a_crash_then_given_up(tmp_path: Path):
    code, run_dir, said = supervise(tmp_path, "SIGSEGV", 0.0)  # no cap: a bug in native code
    assert code == 4, said
    restarts = [r for r in read_jsonl(run_dir / "events.jsonl") if r["event"] == "restart"]
    assert [r["max_micro_batch"] for r in restarts] == [None]
    assert restarts[0]["reason"].endswith("a crash in native code")


def fake_proc(tmp_path: Path, limit: str, peak_kib: int) -> Path:
    folder = tmp_path / "proc" / "42"
    folder.mkdir(parents=True)
    (folder / "limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        "Max stack size            8388608              unlimited            bytes     \n"
        f"Max address space         {limit:<20} unlimited            bytes     \n"
    )
    (folder / "status").write_text(f"Name:\tpython\nVmPeak:\t{peak_kib} kB\nVmSize:\t1 kB\n")
    return tmp_path / "proc"


def test_the_address_space_is_read_from_proc(tmp_path: Path):
    proc = fake_proc(tmp_path, str(4 * GIB), 3_800_000)
    space = read_address_space(42, proc)
    assert space == AddressSpace(3_800_000 * 1024, 4 * GIB) and space.near
    assert "3.62 GiB of its 4.00 GiB cap (RLIMIT_AS)" in space.text
    assert not AddressSpace(GIB, 4 * GIB).near
    assert read_address_space(43, proc) is None  # gone


def test_no_cap_is_no_reading(tmp_path: Path):
    assert read_address_space(42, fake_proc(tmp_path, "unlimited", 3_800_000)) is None


def test_only_a_native_crash_near_the_cap_counts_as_memory():
    near, far = AddressSpace(95, 100), AddressSpace(10, 100)
    segv = -signal.SIGSEGV
    assert ChildExit(segv, None, address_space=near).memory_kill_suspected
    assert ChildExit(128 + signal.SIGABRT, None, address_space=near).memory_kill_suspected
    assert not ChildExit(segv, None, address_space=far).memory_kill_suspected
    assert not ChildExit(segv, None).memory_kill_suspected
    assert not ChildExit(1, None, address_space=near).memory_kill_suspected  # a Python error
    assert "out of memory" in ChildExit(segv, None, address_space=near).describe()
