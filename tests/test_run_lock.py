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
    assert "wait for it, stop it, or use another run_dir" in message
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
