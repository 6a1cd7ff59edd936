"""RunLock, reliability-tests.md row 22: one process per run directory; a killed holder's lock
is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from steadytrain.errors import BadInputError
from steadytrain.safety import lock as lock_module
from steadytrain.safety.lock import RunLock

HOLDER = """
import sys, time
from steadytrain.safety.lock import RunLock
with RunLock(sys.argv[1]):
    print("LOCKED", flush=True)
    time.sleep(600)
"""


def holder_of(run_dir) -> dict:
    text = (run_dir / ".lock").read_text()
    return json.loads(text) if text else {}


def test_second_holder_in_this_process_is_refused_with_the_pid(tmp_path):
    with RunLock(tmp_path):
        assert holder_of(tmp_path)["pid"] == os.getpid()
        with pytest.raises(BadInputError) as info:
            RunLock(tmp_path).acquire()
    message = str(info.value)
    assert f"run directory {tmp_path} is in use by PID {os.getpid()}" in message
    assert socket.gethostname() in message and "(started " in message
    assert "wait for it, stop it, or use another run_dir (a fine-tune's output_dir)" in message
    assert info.value.exit_code == 2
    assert holder_of(tmp_path) == {}  # released: no stale holder on file
    with RunLock(tmp_path):  # and free again
        pass


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "LOCKED"
        with pytest.raises(BadInputError, match=rf"in use by PID {child.pid} "):
            RunLock(tmp_path).acquire()

        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
        child.communicate()
    assert holder_of(tmp_path)["pid"] == child.pid  # the dead holder's record is still there

    with RunLock(tmp_path):  # the kernel released the flock: no stale lock to clear by hand
        assert holder_of(tmp_path)["pid"] == os.getpid()


HOLDER_WITH_A_WORKER = """
import os, sys, time
from pathlib import Path
from steadytrain.safety.lock import RunLock
RunLock(sys.argv[1]).acquire()
parent, release = os.getpid(), Path(sys.argv[2])
if os.fork() == 0:  # a DataLoader worker: it shares the lock, and leaves once its parent is gone
    while os.getppid() == parent or not release.exists():
        time.sleep(0.02)
    os._exit(0)
print("LOCKED", flush=True)
time.sleep(600)
"""


def test_a_killed_holders_forked_worker_is_waited_for_not_taken_for_the_holder(
    tmp_path, monkeypatch
):
    """After a SIGKILL of the trainer, its DataLoader workers hold the inherited lock until they
    notice (up to 5 s): a restart in that window waits for them instead of exiting 2 with
    'in use by' a PID that has ended. The worker here leaves only once the new holder has been
    refused once, so the test does not depend on who is faster."""
    release = tmp_path / "release"
    real_fcntl = lock_module.fcntl

    class Fcntl:
        LOCK_EX, LOCK_NB = real_fcntl.LOCK_EX, real_fcntl.LOCK_NB

        @staticmethod
        def flock(fd, operation):
            try:
                return real_fcntl.flock(fd, operation)
            except BlockingIOError:
                release.touch()
                raise

    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_WITH_A_WORKER, str(run_dir), str(release)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()  # the worker keeps its copy open until it leaves
    monkeypatch.setattr(lock_module, "fcntl", Fcntl)
    with RunLock(run_dir):
        assert holder_of(run_dir)["pid"] == os.getpid()
    assert release.exists()  # the worker did hold the lock when the new holder first asked


def test_run_dir_is_created(tmp_path):
    with RunLock(tmp_path / "new" / "run") as held:
        assert held.path.is_file()


def test_without_fcntl_a_dead_holder_is_taken_over(tmp_path, monkeypatch):
    """The Windows path (O_EXCL and a PID check), exercised here by hiding fcntl."""
    monkeypatch.setattr(lock_module, "fcntl", None)
    with RunLock(tmp_path), pytest.raises(BadInputError, match=f"PID {os.getpid()}"):
        RunLock(tmp_path).acquire()
    assert not (tmp_path / ".lock").exists()

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    (tmp_path / ".lock").write_text(json.dumps({"pid": int(done.stdout), "host": "h"}))
    with RunLock(tmp_path):
        assert holder_of(tmp_path)["pid"] == os.getpid()
