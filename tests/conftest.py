from __future__ import annotations

import os
import sys
from pathlib import Path

import forkserver
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = Path(__file__).resolve().parent / "workloads"

# Under RLIMIT_AS the address space is what runs out. A workload warms up (one forward and
# backward) and imports what the run will import (torch._dynamo, which building an optimizer
# loads) before it sets the cap: a thread pool or a module loaded under a tight cap fails. These
# make glibc hand freed memory back to the OS (large blocks by mmap, one arena), so the limit
# measures live memory, not allocator slack.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}


def real_oom(message: str) -> bool:
    """True when `message` is an out-of-memory error the product itself recognises. The CPU has
    more than one real text (the allocator's own, oneDNN's when a kernel's scratchpad is what
    fails): which comes first depends on the machine and its load, so a test that names one of
    them fails where the product works."""
    from steadytrain.device.oom import oom_kind

    return oom_kind(RuntimeError(message)) is not None


def run_workload(script: str, *args: str, env: dict | None = None, timeout: float = 300):
    """Run tests/workloads/SCRIPT in a fresh process (forked from a warm one: tests/forkserver.py);
    returns the CompletedProcess."""
    return forkserver.run(
        [sys.executable, str(WORKLOADS / script), *args],
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# STEADYTRAIN_TEST_CPU=FILE appends one JSON line per test: the CPU seconds it cost, the worker's
# own and its child processes' (reaped children count their own reaped descendants). Unlike
# wall time, this does not grow when the machine is busy, so it says where the suite's time goes
# on any machine: `STEADYTRAIN_TEST_CPU=/tmp/cpu.jsonl make test`, then bench/test_cpu.py.
_CPU_REPORT = os.environ.get("STEADYTRAIN_TEST_CPU")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_REPORT:
        return (yield)
    import json
    import resource
    import time

    def cpu() -> tuple[float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime + forkserver.forked_cpu

    own0, kids0 = cpu()
    start = time.monotonic()
    try:
        return (yield)
    finally:
        own1, kids1 = cpu()
        row = {
            "test": item.nodeid,
            "own": round(own1 - own0, 3),
            "children": round(kids1 - kids0, 3),
            "wall": round(time.monotonic() - start, 3),
        }
        with open(_CPU_REPORT, "a") as out:
            out.write(json.dumps(row) + "\n")
