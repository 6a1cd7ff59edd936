"""The hang watchdog (safety/watchdog.py) and its supervisor backstop, with real hangs.

Every end-to-end test runs tests/workloads/hang.py in a child process whose step really blocks:
in C code with the GIL released (a lock acquired twice, a sleep), in a stuck DataLoader worker,
in C code that holds the GIL, or frozen by SIGSTOP. The workload writes the wall time the block
began into its --once marker, so detection time is measured from outside the watchdog.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import WORKLOADS

from steadytrain.events import Control, TrainState
from steadytrain.safety import watchdog as wd
from steadytrain.safety.hang_limits import FIRST_STEP_S, FLOOR_S, SAVE_FLOOR_S, STARTUP_S
from steadytrain.safety.watchdog import HangWatchdog, allowance, read_heartbeat
from steadytrain.telemetry.files import read_jsonl

TIMEOUT = 2.0
SLACK = 1.5  # polls (timeout / 8), the report and the exit: well under a second here
CLI = [sys.executable, "-m", "steadytrain.cli", "run", "--backoff-initial", "0.05"]


STARTING_S = 600.0
"""The most a hang workload may take to reach its block (`--once`'s marker): its imports and its
set-up (torch's first optimizer imports dynamo) take seconds alone and minutes on a machine
whose cores are busy, so the start is bounded only against a child that never gets there."""


def hang_run(run_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run tests/workloads/hang.py to its end: `timeout` seconds once its step blocked (the
    `--once` marker exists), `STARTING_S` before; the test's own time checks are measured from
    the block too."""
    cmd = [sys.executable, str(WORKLOADS / "hang.py"), str(run_dir), *args]
    marker = Path(args[args.index("--once") + 1]) if "--once" in args else None
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    started, blocked = time.monotonic(), None
    while True:
        try:
            out, err = proc.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if blocked is None and (marker is None or marker.exists()):
                blocked = now
            if now - (started if blocked is None else blocked) > (
                STARTING_S if blocked is None else timeout
            ):
                proc.kill()
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.ended = time.time()
    return result


def supervised(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *CLI,
            "--run-dir",
            str(run_dir),
            "--",
            sys.executable,
            WORKLOADS / "hang.py",
            run_dir,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def hangs(run_dir: Path) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "hang"]


def block_began(marker: Path) -> float:
    return json.loads(marker.read_text())["time"]


def report_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "hangs").glob("*.txt") if "backstop" not in p.name)


# -- real hangs in a child, no supervisor ------------------------------------------------------


def test_a_step_blocked_in_c_is_caught_in_time_and_exits_75(tmp_path):
    marker = tmp_path / "marker"
    result = hang_run(tmp_path, "--block", "lock", "--at", "3", "--once", str(marker))

    assert result.returncode == 75, result.stderr
    assert result.ended - block_began(marker) < TIMEOUT + SLACK + 1.0  # + the interpreter's exit
    (event,) = hangs(tmp_path)
    assert event["step"] == 2 and event["phase"] == "step" and event["action"] == "exit"
    assert TIMEOUT <= event["stalled_s"] < TIMEOUT + SLACK
    assert event["time"] - block_began(marker) < TIMEOUT + SLACK
    (report,) = report_files(tmp_path)
    assert event["file"] == f"hangs/{report.name}"
    text = report.read_text()
    assert "in deadlocked_on_lock" in text  # the blocking frame, named by faulthandler
    assert "in on_micro_step_end" in text
    assert "steps done: 2 (stuck in step 3)" in text
    assert '"event": "checkpoint", "step": 2' in text  # the last events
    assert '"rss":' in text  # the memory reading
    assert "hang: no progress" in result.stderr
    # the console's line for the event, printed aside from the watchdog's thread, is whole
    assert "hang: step 2, phase step, collective" not in result.stderr
    assert "hang: step 2, phase step, stalled_s" in result.stderr.replace("\n", "")
    assert not (
        tmp_path / "hangs" / f"backstop-{json.loads(marker.read_text())['pid']}.txt"
    ).exists()


def test_a_background_save_committed_just_before_a_hang_is_recorded_and_shown(tmp_path):
    """Step 2's checkpoint is written in the background and commits while step 3 hangs: its
    `checkpoint` record and console line come from the commit, not from a next step's end that
    never comes, so the report counts every checkpoint on disk."""
    from steadytrain.telemetry.run_reading import load_run

    marker = tmp_path / "marker"
    args = ("--block", "sleep", "--at", "3", "--async-save", "--once", str(marker))
    result = hang_run(tmp_path, *args, timeout=240)

    assert result.returncode == 75, result.stderr
    committed = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert committed == ["step-00000002"]
    saved = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "checkpoint"]
    assert [(e["step"], e["mode"]) for e in saved] == [(2, "async")]
    assert "checkpoint at step 2 (async" in result.stderr
    assert load_run(tmp_path).counts["checkpoint"] == len(committed)


def test_a_stuck_dataloader_worker_is_caught_and_the_worker_killed(tmp_path):
    marker = tmp_path / "marker"
    result = hang_run(tmp_path, "--block", "worker", "--workers", "1", "--once", str(marker))

    assert result.returncode == 75, result.stderr
    assert len(hangs(tmp_path)) == 1
    text = report_files(tmp_path)[0].read_text()
    assert "_try_get_data" in text  # the main thread waits on the worker's queue
    worker = json.loads(marker.read_text())["pid"]
    with pytest.raises(ProcessLookupError):  # killed on the way out, not left stuck
        for _ in range(50):
            os.kill(worker, 0)
            time.sleep(0.05)


def test_report_mode_goes_on_records_one_hang_and_a_slow_save_is_no_hang(tmp_path):
    # The save at step 4 takes 2.5 s, more than the 2 s timeout: it runs under the save
    # allowance. Step 2 sleeps 3.5 s: one stall, one report, and the run finishes.
    result = hang_run(
        tmp_path,
        "--action", "report", "--block", "sleep", "--at", "2", "--block-seconds", "3.5",
        "--slow-save", "2.5", "--steps", "4", "--save-every", "4", "--once", str(tmp_path / "m"),
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "done.json").read_text()) == {"steps": 4, "exit_code": 0}
    assert [
        e["step"] for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "checkpoint"
    ] == [4]
    (event,) = hangs(tmp_path)
    assert event["action"] == "report" and event["phase"] == "step"
    (report,) = report_files(tmp_path)
    assert "in blocked_in_sleep" in report.read_text()
    assert "the run goes on" in report.read_text()
    assert not (tmp_path / "heartbeat").exists()  # removed at the end of fit
    assert list((tmp_path / "hangs").glob("backstop-*")) == []


# -- under `steadytrain run` -------------------------------------------------------------------


def test_supervised_hang_restarts_resumes_and_finishes(tmp_path):
    result = supervised(tmp_path, "--block", "lock", "--once", str(tmp_path / "marker"))

    assert result.returncode == 0, result.stderr
    assert "hang detected by the watchdog (exit 75)" in result.stderr
    events = read_jsonl(tmp_path / "events.jsonl")
    names = [e["event"] for e in events]
    assert names.count("hang") == 1
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["exit_code"] == 75
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["step"] == 2  # the checkpoint before the hang
    assert json.loads((tmp_path / "done.json").read_text()) == {"steps": 6, "exit_code": 0}


def test_a_hang_holding_the_gil_is_dumped_by_the_backstop_and_reported_on_restart(tmp_path):
    # No Python thread can run: faulthandler's C timer dumps the stacks and exits 1; the
    # restarted attempt turns the dump into a hang report and one hang event.
    result = supervised(tmp_path, "--block", "gil", "--once", str(tmp_path / "marker"))

    assert result.returncode == 0, result.stderr
    assert "child crashed with exit 1" in result.stderr
    (event,) = hangs(tmp_path)
    assert event["detected_by"] == "faulthandler"
    assert event["pid"] == json.loads((tmp_path / "marker").read_text())["pid"]
    (report,) = report_files(tmp_path)
    assert "in holding_the_gil" in report.read_text()
    assert list((tmp_path / "hangs").glob("backstop-*")) == []


def test_a_frozen_child_is_killed_by_the_supervisor_from_its_stale_heartbeat(tmp_path):
    # SIGSTOP freezes every thread, the watchdog's and faulthandler's too: only the supervisor,
    # reading RUN_DIR/heartbeat, can act. It kills, records the hang, restarts.
    marker = tmp_path / "marker"
    result = supervised(tmp_path, "--block", "stop", "--timeout", "1", "--once", str(marker))

    assert result.returncode == 0, result.stderr
    assert "treating it as a hang" in result.stderr
    (event,) = hangs(tmp_path)
    assert event["detected_by"] == "supervisor" and event["exit_code"] == -9
    assert event["pid"] == json.loads(marker.read_text())["pid"]
    restart = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "restart")
    assert restart["exit_code"] == 75 and restart["max_micro_batch"] is None  # not an OOM kill
    assert json.loads((tmp_path / "done.json").read_text()) == {"steps": 6, "exit_code": 0}


# -- the watchdog object, in this process ------------------------------------------------------


class FakeReading:
    def to_dict(self) -> dict:
        return {"rss": 1}


class FakeDevice:
    def memory(self) -> FakeReading:
        return FakeReading()


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll for `condition` (the watching thread's work), not a sleep that a busy machine
    outlasts; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.02)


def make(tmp_path: Path, timeout, action: str = "exit") -> tuple[HangWatchdog, list]:
    recorded: list = []

    dog = HangWatchdog(tmp_path, timeout, action, FakeDevice(), lambda n, i: recorded.append(n))
    return dog, recorded


def test_limits_auto_median_first_step_and_saves(tmp_path):
    dog, _ = make(tmp_path, "auto")
    assert dog.limit() == (FIRST_STEP_S, "first step")
    dog.steps_done = 4
    dog.step_times[:4] = [100.0] * 4
    assert dog.limit() == (FLOOR_S, "step")  # too few steps to trust the median
    dog.steps_done = 9
    dog.step_times[:9] = [40.0, 50.0, 60.0, 50.0, 45.0, 55.0, 50.0, 1.0, 999.0]
    assert dog.limit() == (500.0, "step")  # 10 x the median, outliers ignored
    dog._longest_save = 200.0
    with allowance("checkpoint save"):  # no fit is running: a no-op
        assert dog.limit()[1] == "step"
    dog._saving = "checkpoint save"
    assert dog.limit() == (800.0, "checkpoint save")  # 4 x the longest save

    dog.steps_done, dog._startup, dog._saving = 0, "data fingerprint", None
    assert dog.limit() == (STARTUP_S, "data fingerprint")
    assert "may each go 600 s" in dog.allowance_text()

    fixed, _ = make(tmp_path, 3)
    assert fixed.limit() == (3.0, "first step")  # an explicit limit bounds the first step
    fixed._startup = "data fingerprint"
    assert fixed.limit() == (3.0, "data fingerprint")  # and the start-up phases
    fixed._startup = "set-up"
    assert fixed.limit() == (STARTUP_S, "set-up")  # first imports, a large model's move
    fixed._waiting = "broadcast (parameters)"
    assert fixed.limit() == (3.0, "broadcast (parameters) in set-up")  # a collective: bounded
    fixed._waiting = None
    fixed._startup, fixed.steps_done = None, 1
    assert fixed.limit() == (3.0, "step")  # a configured number is used as is
    fixed._saving = "checkpoint save"
    assert fixed.limit() == (SAVE_FLOOR_S, "checkpoint save")  # a save keeps its allowance
    fixed._saving = None
    assert "3 s without progress is a hang, in start-up, the first step and every collective" in (
        fixed.allowance_text()
    )
    assert fixed.poll_s == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="hang_action"):
        make(tmp_path, 3, "kill")
    with pytest.raises(ValueError, match="hang_timeout"):
        make(tmp_path, -1)


def test_a_rank_in_a_collective_names_it_and_the_error_that_comes_out_of_it(tmp_path):
    """Under torchrun the phase says which collective the rank waits in (under the step's
    limit), the report names the rank, and an error raised in a collective (a peer that died)
    carries its name out for the rank's exit event."""
    dog = HangWatchdog(tmp_path, 5, "exit", FakeDevice(), lambda n, i: None, 1, 2)
    dog.steps_done = 3
    with dog.waiting("all-reduce (agreement)"):
        assert dog.limit() == (5.0, "all-reduce (agreement) in step")
        header = dog._report_header(5.1, 5.0, "x", 3, "all-reduce (agreement)")
    assert dog.limit() == (5.0, "step")
    assert "rank: 1 of 2\n" in header and "waiting in: all-reduce (agreement)" in header
    with pytest.raises(RuntimeError) as info, dog.waiting("all-reduce (gradient sum)"):
        raise RuntimeError("Connection reset by peer")
    assert info.value.steadytrain_collective == "all-reduce (gradient sum)"
    with wd.waiting_in("all-reduce (agreement)"):  # no fit is running: a no-op
        assert dog.limit()[1] == "step"
    # With no watchdog running (hang_timeout off, or it stood down), an error raised in a
    # collective still carries the collective's name out: the exit event, not the watchdog,
    # is what tells `steadytrain run` this rank failed waiting for a peer.
    assert wd._active is None
    with pytest.raises(RuntimeError) as info, wd.waiting_in("all-reduce (sample count)"):
        raise RuntimeError("Connection reset by peer")
    assert info.value.steadytrain_collective == "all-reduce (sample count)"
    single, _ = make(tmp_path, 5)
    assert single.rank_text is None and "rank:" not in single._report_header(1, 5, "step", 0, None)


def test_report_mode_records_once_per_stall_and_nothing_after_fit_end(tmp_path):
    dog, recorded = make(tmp_path, 0.2, "report")
    state, control = TrainState(), Control()
    dog.on_fit_start(state, control, {})
    beat = read_heartbeat(tmp_path)
    assert beat["pid"] == os.getpid() and beat["action"] == "report"
    dog.on_step_start(state, control, {})
    dog.on_step_end(state, control, {})  # out of the first step: the 0.2 s limit applies
    wait_until(lambda: recorded, "the first stall is recorded")
    time.sleep(1.0)  # the same stall goes on for five limits more: still one record
    assert recorded == ["hang"]
    dog.on_micro_step_end(state, control, {})
    wait_until(lambda: len(recorded) == 2, "a second stall is recorded")
    assert recorded == ["hang", "hang"]
    assert len(report_files(tmp_path)) == 2

    dog.on_step_end(state, control, {})
    dog.on_fit_end(state, control, {"reason": "finished", "exit_code": 0})
    assert not any(t.name == "steadytrain-hang-watchdog" for t in threading.enumerate())
    time.sleep(0.6)  # stalled long past the limit, but the fit is over
    assert recorded == ["hang", "hang"]
    assert read_heartbeat(tmp_path) is None
    assert list((tmp_path / "hangs").glob("backstop-*")) == []


def test_a_fit_that_ended_without_fit_end_stops_the_watching(tmp_path):
    # An error before the loop's own handling means no fit_end: the thread must notice that the
    # loop is gone and stand down, or it would kill this (test) process.
    dog, recorded = make(tmp_path, 0.2)
    state, control = TrainState(), Control()

    def a_fit_that_returns_early():
        dog.on_fit_start(state, control, {})
        dog.on_step_start(state, control, {})
        dog.on_step_end(state, control, {})

    a_fit_that_returns_early()
    wait_until(
        lambda: not any(t.name == "steadytrain-hang-watchdog" for t in threading.enumerate()),
        "the watching thread stands down",
    )
    assert recorded == []
    assert read_heartbeat(tmp_path) is None
    assert list((tmp_path / "hangs").glob("backstop-*")) == []


def test_the_watch_from_the_process_start_beats_and_hands_over(tmp_path):
    """Under `steadytrain run` (ENV_START_WATCH), importing steadytrain starts a watch before
    fit(): the heartbeat names the phase and the supervisor's limit, the variable leaves the
    environment (data workers do not watch themselves), and stopping it (a fit's watchdog
    taking over, or a supervisor that a supervisor started) ends the thread, disarms the
    backstop and leaves neither heartbeat nor backstop file."""
    environ = {wd.ENV_START_WATCH: json.dumps({"run_dir": str(tmp_path), "limit_s": 60})}
    watch = wd.watch_from_start(environ)
    try:
        assert watch is not None and wd.ENV_START_WATCH not in environ
        beat = read_heartbeat(tmp_path)
        assert (beat["pid"], beat["phase"], beat["limit_s"]) == (os.getpid(), wd.BEFORE_FIT, 60.0)
        assert beat["stale_after_s"] > 60.0 and beat["step"] is None
        assert (tmp_path / "hangs" / f"backstop-{os.getpid()}.txt").exists()
        assert wd.watch_from_start(environ) is None  # read once
    finally:
        wd.stop_start_watch()
    assert not any(t.name == "steadytrain-start-watch" for t in threading.enumerate())
    assert read_heartbeat(tmp_path) is None
    assert list((tmp_path / "hangs").glob("backstop-*")) == []
