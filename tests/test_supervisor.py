"""`steadytrain run`: the supervisor (reliability principles P7–P9, matrix rows 5, 18, 19), with
real child processes and real signals.

Every child is CHILD below, a tiny Python script that follows a plan of one action string per
attempt (the last one repeats): `exit:N`, `kill:SIGNAME` (itself), `ckpt:STEP` (commit a
checkpoint pointer), `ckpt-event:STEP` (a library's checkpoint event, no pointer), `handle` (SIGINT/SIGTERM write a marker and exit 128 + N), `ignore`
(SIGTERM), `spawn` (a grandchild that sleeps), `probe` (is that grandchild still running?),
`ready` (a marker file), `sleep:S`, `error:X` (the trainer's error event for error X, exit 5),
`ranks` (the ranks' events of a torchrun group, from state/ranks.json);
joined by `+`. It records the environment each attempt saw. Logic tests run the `Supervisor` in this process;
signal tests run `python -m steadytrain.cli run` and signal it.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from disks import tmpfs

from steadytrain.errors import BadInputError
from steadytrain.run.events import append_event
from steadytrain.run.files import ENV_START_WATCH
from steadytrain.supervisor import Supervisor, SupervisorOptions
from steadytrain.supervisor.attempt_end import RankEnd, failed_rank, rank_ends
from steadytrain.supervisor.child_exit import ChildExit
from steadytrain.supervisor.oom_counter import read_oom_kill_count
from steadytrain.supervisor.progress import checkpoint_step, last_micro_batch_size, progress_step
from steadytrain.telemetry.files import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "steadytrain.cli", "run"]
FAST = {"backoff_initial": 0.01, "backoff_max": 0.04}

CHILD = r"""
import json, os, signal, subprocess, sys, time
from pathlib import Path

state, run_dir, plan = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
counter = state / "count"
k = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(k + 1))
names = ("STEADYTRAIN_SUPERVISED", "STEADYTRAIN_RESTART", "STEADYTRAIN_MAX_MICRO_BATCH")
with open(state / "attempts.jsonl", "a") as f:
    f.write(json.dumps({"k": k, **{n: os.environ.get(n) for n in names}}) + "\n")
(state / "child.pid").write_text(str(os.getpid()))

def stop(signum, frame):
    with open(state / "signals", "a") as f:
        f.write(signal.Signals(signum).name + "\n")
    seen = (state / "signals").read_text().split()
    if seen.count(signal.Signals(signum).name) >= int(os.environ.get("CHILD_STOP_AFTER", "1")):
        sys.exit(128 + signum)

for action in plan[min(k, len(plan) - 1)].split("+"):
    verb, _, arg = action.partition(":")
    if verb == "exit":
        sys.exit(int(arg))
    elif verb == "kill":
        os.kill(os.getpid(), getattr(signal, arg))
    elif verb == "ckpt":
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints" / "tmp").write_text(f"step-{int(arg):08d}")
        os.replace(run_dir / "checkpoints" / "tmp", run_dir / "checkpoints" / "latest")
    elif verb == "ckpt-event":  # a library's verified save: a checkpoint event, no pointer
        run_dir.mkdir(parents=True, exist_ok=True)
        event = {"time": time.time(), "event": "checkpoint", "step": int(arg),
                 "checkpoint": str(run_dir / f"checkpoint-{arg}")}
        with open(run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
    elif verb == "handle":
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    elif verb == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif verb == "spawn":
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (state / "spawned.pid").write_text(str(p.pid))
    elif verb == "probe":  # is the grandchild an earlier attempt spawned still running?
        pid = (state / "spawned.pid").read_text()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            (state / "probe").write_text(stat.rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            (state / "probe").write_text("gone")
    elif verb == "ready":
        (state / "ready").write_text("")
    elif verb == "env":  # the variables named (comma-separated) as this attempt got them
        (state / f"env-{k}.json").write_text(json.dumps({n: os.environ.get(n) for n in arg.split(",")}))
    elif verb == "sleep":
        time.sleep(float(arg))
    elif verb == "error":  # the trainer's "error" event for an error ARG at step 1, then exit 5
        run_dir.mkdir(parents=True, exist_ok=True)
        event = {"time": time.time(), "event": "error", "step": 1, "exit_code": 5,
                 "error": "ValueError: " + arg, "where": "loss_fn (train.py:7)", "signature": arg}
        with open(run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
        sys.exit(5)
    elif verb == "ranks":  # the events of a torchrun group's ranks (state/ranks.json), stamped now
        for rank, events in json.loads((state / "ranks.json").read_text()).items():
            folder = run_dir if rank == "0" else run_dir / "ranks" / f"rank-{rank}"
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "events.jsonl", "a") as f:
                for event in events:
                    f.write(json.dumps({"time": time.time(), **event}) + "\n")
"""


@pytest.fixture
def job(tmp_path):
    """Paths of one supervised job: the child script, its state folder and the run dir."""
    (tmp_path / "state").mkdir()
    (tmp_path / "child.py").write_text(CHILD)

    class Job:
        state = tmp_path / "state"
        run_dir = tmp_path / "run"

        def command(self, *plan: str) -> list[str]:
            return [
                sys.executable,
                str(tmp_path / "child.py"),
                str(self.state),
                str(self.run_dir),
                *plan,
            ]

        def attempts(self) -> list[dict]:
            return read_jsonl(self.state / "attempts.jsonl")

        def events(self, name: str | None = None) -> list[dict]:
            records = read_jsonl(self.run_dir / "events.jsonl")
            return [e for e in records if name is None or e["event"] == name]

    return Job()


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}


def supervise(job, *plan: str, run_dir=True, oom_kill_count=lambda: None, **options):
    """Run the supervisor in this process; returns (exit code, what it printed)."""
    out = io.StringIO()
    opts = SupervisorOptions(run_dir=job.run_dir if run_dir else None, **{**FAST, **options})
    supervisor = Supervisor(
        job.command(*plan), opts, environ=clean_environ(), out=out, oom_kill_count=oom_kill_count
    )
    return supervisor.run(), out.getvalue()


def start_cli(job, *plan: str, args=(), env=None, prefix=()) -> subprocess.Popen:
    """The supervisor as a terminal starts it: SIGHUP at its default, whatever this test run
    was started with (under `nohup` it is ignored, and the supervisor keeps it ignored)."""
    return subprocess.Popen(
        [*prefix, *CLI, "--run-dir", str(job.run_dir), *args, "--", *job.command(*plan)],
        stderr=subprocess.PIPE,
        text=True,
        env={**clean_environ(), **(env or {})},
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )


def finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def wait_for(predicate, timeout: float = 15) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


# ---- restart rules -------------------------------------------------------------------------


def test_child_that_finishes_is_not_restarted(job):
    code, out = supervise(job, "exit:0")
    assert code == 0
    assert job.attempts() == [
        {
            "k": 0,
            "STEADYTRAIN_SUPERVISED": "1",
            "STEADYTRAIN_RESTART": "0",
            "STEADYTRAIN_MAX_MICRO_BATCH": None,
        }
    ]
    assert [e["event"] for e in job.events()] == ["supervisor_end"]
    assert job.events()[0]["exit_code"] == 0
    assert "starting attempt 1" in out


def test_crash_twice_then_succeed(job):
    code, out = supervise(job, "exit:1", "exit:1", "exit:0")
    assert code == 0
    assert [a["STEADYTRAIN_RESTART"] for a in job.attempts()] == ["0", "1", "2"]
    restarts = job.events("restart")
    assert [(e["attempt"], e["exit_code"], e["signal"]) for e in restarts] == [
        (1, 1, None),
        (2, 1, None),
    ]
    assert restarts[0]["reason"] == "child crashed with exit 1"
    assert "starting attempt 3" in out
    assert job.events()[-1]["event"] == "supervisor_end"


def test_sigkill_reported_as_memory_kill_and_micro_batch_halved(job):
    """SIGKILL is what the OOM killer and macOS jetsam send: the next child gets a cap of half
    the micro-batch metrics.jsonl last showed (16 → 8), then half again (→ 4)."""
    job.run_dir.mkdir()
    (job.run_dir / "metrics.jsonl").write_text(
        '{"step": 1, "micro_batch_size": 32}\n{"step": 2, "micro_batch_size": 16}\n{"step": 3, "mic'
    )
    counts = itertools.chain([0, 1, 1, 2], itertools.repeat(2))
    code, out = supervise(
        job, "kill:SIGKILL", "kill:SIGKILL", "exit:0", oom_kill_count=lambda: next(counts)
    )
    assert code == 0
    assert [a["STEADYTRAIN_MAX_MICRO_BATCH"] for a in job.attempts()] == [None, "8", "4"]
    restarts = job.events("restart")
    assert [(e["exit_code"], e["signal"], e["max_micro_batch"]) for e in restarts] == [
        (-9, "SIGKILL", 8),
        (-9, "SIGKILL", 4),
    ]
    assert [e["oom_kill_delta"] for e in restarts] == [1, 1]
    expected = (
        "child killed by SIGKILL (exit -9, shell 137): the OS out-of-memory killer; "
        "cgroup oom_kill count +1"
    )
    assert restarts[0]["reason"] == expected
    assert expected in out
    assert "STEADYTRAIN_MAX_MICRO_BATCH=8" in out


def memory_line(job, available: int) -> None:
    job.run_dir.mkdir()
    line = {"step": 7, "micro_batch_size": 16, "mem_system_available": available, "mem_rss": 2**30}
    (job.run_dir / "metrics.jsonl").write_text(json.dumps(line) + "\n")


def test_uncounted_sigkill_with_memory_high_at_the_last_step_halves_the_micro_batch(job):
    """systemd-oomd and earlyoom kill with SIGKILL and leave the kernel's counter unchanged:
    when the last metrics line shows little memory available, the kill is taken for theirs."""
    memory_line(job, available=1024)
    code, _ = supervise(job, "kill:SIGKILL", "exit:0", oom_kill_count=lambda: 0)
    assert code == 0
    assert [a["STEADYTRAIN_MAX_MICRO_BATCH"] for a in job.attempts()] == [None, "8"]
    reason = job.events("restart")[0]["reason"]
    assert (
        "not the kernel's out-of-memory killer (its cgroup oom_kill count is unchanged)" in reason
    )
    assert "memory was high at the last step (step 7: 0.0 GiB of " in reason
    assert "GiB available, 1.0 GiB used by the trainer): taken for a memory kill" in reason


def test_uncounted_sigkill_with_memory_low_at_the_last_step_is_a_plain_kill(job):
    memory_line(job, available=2**60)
    code, out = supervise(job, "kill:SIGKILL", "exit:0", oom_kill_count=lambda: 0)
    assert code == 0
    assert [a["STEADYTRAIN_MAX_MICRO_BATCH"] for a in job.attempts()] == [None, None]
    assert "memory was not high at the last step" in out
    assert "taken for a plain kill, no smaller micro-batch" in out


def test_the_same_error_at_the_same_step_is_not_restarted_again(job):
    code, out = supervise(job, "error:a", "error:a", "exit:0")
    assert code == 5
    assert len(job.attempts()) == 2
    assert "child exited 5: an error in your code" in out
    assert (
        "the same error as the attempt before, at the same step (step 1): ValueError: a in "
        "loss_fn (train.py:7); not restarting: a restart fails the same way" in out
    )
    end = job.events()[-1]
    assert (end["event"], end["exit_code"]) == ("supervisor_end", 5)


def test_a_different_error_or_none_is_restarted(job):
    code, _ = supervise(job, "error:a", "error:b", "kill:SIGKILL", "error:b", "exit:0")
    assert code == 0
    assert len(job.attempts()) == 5


def test_sigkill_without_metrics_sets_no_cap(job):
    supervise(job, "kill:SIGKILL", "exit:0")
    assert [a["STEADYTRAIN_MAX_MICRO_BATCH"] for a in job.attempts()] == [None, None]


def test_exit_76_restarts_at_half_the_micro_batch_of_the_childs_oom_event(job):
    """A library's loop (Lightning, Keras, RunGuard) exits 76 on an out-of-memory before it has
    written any metrics line; its last oom event names the micro-batch that failed."""
    job.run_dir.mkdir()
    (job.run_dir / "events.jsonl").write_text(
        '{"event": "fit_start", "micro_batch_size": 64}\n{"event": "oom", "micro_batch_size": 64}\n'
    )
    code, out = supervise(job, "exit:76", "exit:0", oom_kill_count=lambda: 0)
    assert code == 0
    assert [a["STEADYTRAIN_MAX_MICRO_BATCH"] for a in job.attempts()] == [None, "32"]
    restart = job.events("restart")[0]
    assert restart["reason"] == "out of memory; the child asks for a smaller micro-batch (exit 76)"
    assert "STEADYTRAIN_MAX_MICRO_BATCH=32" in out


GROUP = {"process_group": {"rank": 0, "world_size": 2, "backend": "cpu:gloo"}}
BROKEN = {"event": "exit", "step": 3, "exit_code": 1, "collective": "all-reduce (agreement)"}


def test_a_ranks_exit_76_under_torchrun_is_a_smaller_restart(job):
    """torchrun exits 1 whichever rank failed: the supervisor reads the ranks' events. Rank 1 ran
    out of memory where the ranks could not agree and exited 76; rank 0's collective broke
    (waiting for rank 1). The group is restarted as for a child's exit 76: half the micro-batch
    of rank 1's oom event."""
    ranks = {
        "0": [{"event": "fit_start", **GROUP}, {**BROKEN, "reason": "RuntimeError: peer gone"}],
        "1": [
            {"event": "fit_start", "process_group": {**GROUP["process_group"], "rank": 1}},
            {"event": "oom", "step": 3, "micro_batch_size": 16, "error": "CUDA out of memory"},
            {"event": "exit", "step": 3, "exit_code": 76, "reason": "OutOfMemory", "rank": 1},
        ],
    }
    (job.state / "ranks.json").write_text(json.dumps(ranks))
    code, out = supervise(job, "ranks+exit:1", "exit:0", oom_kill_count=lambda: 0)
    assert code == 0
    assert [a["STEADYTRAIN_MAX_MICRO_BATCH"] for a in job.attempts()] == [None, "8"]
    restart = job.events("restart")[0]
    assert (restart["failed_rank"], restart["rank_exit"], restart["exit_code"]) == (1, 76, 1)
    assert "rank 1 of 2 failed first: exit 76" in restart["reason"]
    assert "the launcher (torchrun) exited 1" in restart["reason"]
    assert "STEADYTRAIN_MAX_MICRO_BATCH=8" in out and "rank 1 of 2 failed first" in out


def ranks_out_of_memory_at_1(in_force: list[str], left: list[str]) -> dict:
    """A torchrun group whose rank 1 ran out of memory in the plan's trial pass at micro-batch 1
    and exited 76, with `in_force` and `left` its memory_savers record; rank 0 was ended by
    torchrun while it waited."""
    savers = {"event": "memory_savers", "step": 0, "in_force": in_force, "left": left}
    oom = {"event": "oom", "step": 0, "phase": "plan", "micro_batch_size": 1, "rank": 1}
    return {
        "0": [{"event": "fit_start", **GROUP}, savers, {**BROKEN, "exit_code": 143}],
        "1": [
            {"event": "fit_start", "process_group": {**GROUP["process_group"], "rank": 1}},
            savers,
            {**oom, "error": "DefaultCPUAllocator: can't allocate memory"},
            {"event": "exit", "step": 0, "exit_code": 76, "reason": "RankOutOfMemory", "rank": 1},
        ],
    }


def test_a_ranks_exit_76_at_micro_batch_1_restarts_the_group_with_the_next_saver(job):
    """Not micro-batch 1 again (the issue-40 run restarted 1, 1, 1 until the limit): the next
    attempt turns on the next saver the failed rank's memory_savers record leaves, and is not
    counted against --max-restarts."""
    (job.state / "ranks.json").write_text(
        json.dumps(ranks_out_of_memory_at_1([], ["activation_checkpointing", "chunked_loss"]))
    )
    code, out = supervise(job, "ranks+exit:1", "exit:0", oom_kill_count=lambda: 0, max_restarts=0)
    assert code == 0, out
    (restart,) = job.events("restart")
    assert (restart["failed_rank"], restart["rank_exit"]) == (1, 76)
    assert restart["memory_savers"] == 1 and restart["max_micro_batch"] == 1
    (escalation,) = job.events("memory_escalation")
    assert escalation["saver"] == "activation_checkpointing"
    assert "rank 1 of 2 ran out of memory (exit 76) with no smaller micro-batch left" in out
    assert "STEADYTRAIN_MEMORY_SAVERS=1" in out


def test_a_ranks_exit_76_at_micro_batch_1_with_no_saver_left_is_exit_3_naming_gpus(job):
    job.run_dir.mkdir()
    (job.run_dir / "config.json").write_text(json.dumps({"distributed": "ddp"}))
    (job.state / "ranks.json").write_text(
        json.dumps(ranks_out_of_memory_at_1(["activation_checkpointing"], []))
    )
    code, out = supervise(job, "ranks+exit:1", "exit:0", oom_kill_count=lambda: 0)
    assert code == 3, out
    assert not job.events("restart")
    (end,) = job.events("supervisor_end")
    assert end["exit_code"] == 3 and end["in_force"] == ["activation_checkpointing"]
    assert "2 ranks' memory is too little" in out
    assert "What would help: distributed: fsdp instead of ddp (each of the 2 ranks" in out


def test_a_sharded_group_out_of_memory_at_1_with_every_saver_on_next_puts_its_shards_on_the_host(
    job,
):
    """Sharded on GPUs (each rank's fit_start: distributed fsdp, its shards on the GPU), rank 1
    ran out at micro-batch 1 with every saver in force: the next start is asked for FSDP2's
    offload policy (ENV_FSDP_OFFLOAD), not counted against --max-restarts; when that start runs
    out the same way, nothing is left: exit 3, naming the offload among what was in force."""
    savers = ["activation_checkpointing", "chunked_loss"]
    ranks = ranks_out_of_memory_at_1(savers, [])
    for rank, records in ranks.items():
        start = records[0]
        start |= {"device": f"cuda:{rank}", "distributed": {"mode": "fsdp", "offload": False}}
    (job.state / "ranks.json").write_text(json.dumps(ranks))
    variable = "STEADYTRAIN_FSDP_OFFLOAD"
    code, out = supervise(
        job,
        f"env:{variable}+ranks+exit:1",
        f"env:{variable}+ranks+exit:1",
        oom_kill_count=lambda: 0,
        max_restarts=0,
    )
    assert code == 3, out
    first, second = (json.loads((job.state / f"env-{k}.json").read_text()) for k in (0, 1))
    assert (first[variable], second[variable]) == (None, "1")
    (escalation,) = job.events("memory_escalation")
    assert escalation["saver"] == "fsdp_offload" and escalation["in_force"] == savers
    assert "the next attempt puts the shards in host memory (FSDP2's offload policy, " in out
    assert f"{variable}=1" in out
    assert "in force: activation checkpointing, the chunked loss, the shards in host memory" in out
    (end,) = job.events("supervisor_end")
    assert end["exit_code"] == 3


def test_a_rank_the_os_killed_at_micro_batch_1_restarts_the_group_with_the_next_saver(job):
    """Rank 1 was killed without a word (the cgroup's oom_kill counter rose) while its last
    step ran at micro-batch 1: as for one process killed there, the next saver."""
    folder = job.run_dir / "ranks" / "rank-1"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 2, "micro_batch_size": 1}\n')
    savers = {"event": "memory_savers", "step": 0, "in_force": [], "left": ["chunked_loss"]}
    ranks = {
        "0": [{"event": "fit_start", **GROUP}, savers, {**BROKEN, "exit_code": 143}],
        "1": [
            {"event": "fit_start", "process_group": {**GROUP["process_group"], "rank": 1}},
            savers,
        ],
    }
    (job.state / "ranks.json").write_text(json.dumps(ranks))
    counts = iter([0, 1, 1, 1])
    code, out = supervise(job, "ranks+exit:1", "exit:0", oom_kill_count=lambda: next(counts))
    assert code == 0, out
    (restart,) = job.events("restart")
    assert (restart["failed_rank"], restart["memory_savers"]) == (1, 1), restart
    assert "the OS killed rank 1 of 2 for memory with no smaller micro-batch left" in out


def test_a_ranks_bad_input_under_torchrun_is_not_restarted(job):
    ranks = {
        "0": [{"event": "fit_start", **GROUP}, {**BROKEN, "reason": "RuntimeError: peer gone"}],
        "1": [{"event": "exit", "step": 0, "exit_code": 2, "reason": "BadInputError: x"}],
    }
    (job.state / "ranks.json").write_text(json.dumps(ranks))
    code, out = supervise(job, "ranks+exit:1", "exit:0")
    assert code == 2 and len(job.attempts()) == 1
    assert "child exited 2: bad input; rank 1 of 2 failed first" in out


def rank_end(rank, record, started=True, folder=Path("run")):
    return RankEnd(rank, 3, folder, record, started)


def test_the_rank_that_failed_first_is_the_one_not_waiting_for_another():
    """A hang or error of a rank's own comes before the ranks that broke waiting for it in a
    collective or were stopped by torchrun's SIGTERM; a started rank with no end record (a
    SIGKILL) comes before those; among the waiting ones, the earliest."""
    waiting = rank_end(0, {"event": "hang", "time": 1.0, "collective": "all-reduce (agreement)"})
    own_hang = rank_end(1, {"event": "hang", "time": 2.0, "exit_code": 75, "phase": "step"})
    stopped = rank_end(2, {"event": "fit_end", "time": 0.5, "exit_code": 143})
    silent = rank_end(2, None)
    finished = rank_end(2, {"event": "fit_end", "time": 0.1, "exit_code": 0})
    assert failed_rank([waiting, own_hang, stopped]) is own_hang
    assert failed_rank([waiting, silent, stopped]) is silent
    assert failed_rank([waiting, stopped, finished]) is stopped
    assert failed_rank([finished, rank_end(0, None, started=False)]) is None
    assert own_hang.exit_code == 75 and "hang in step" in own_hang.describe()
    assert rank_end(1, {"event": "oom", "time": 1.0}).exit_code == 76  # not recovered from
    assert rank_end(0, {"event": "oom", "time": 1.0, "phase": "rank 1"}).waiting  # rank 1's oom
    assert "without an exit record" in silent.describe()


class PeerGone(torch.nn.Module):
    """Step 2's forward fails as a rank's does when its peer died inside a collective: the error
    carries the collective's name (set by the watchdog's `waiting_in`)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1:
            error = RuntimeError("Connection closed by peer")
            error.steadytrain_collective = "all-reduce (sample count)"
            raise error
        return self.linear(x)


def test_a_rank_stopped_after_its_fit_end_is_still_seen_waiting_for_its_peer(tmp_path):
    """torchrun may stop a rank between its fit_end and its exit record: the fit_end names the
    collective a dead peer broke too, so the supervisor does not take that rank for the one
    that failed first."""
    from steadytrain import TrainConfig, Trainer

    config = TrainConfig(
        run_dir=str(tmp_path), effective_batch_size=2, micro_batch_size=2, max_steps=3,
        device="cpu", progress="off",
    )  # fmt: skip
    trainer = Trainer(
        PeerGone(),
        lambda params: torch.optim.SGD(params, lr=0.1),
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        [(torch.randn(2), torch.randn(1)) for _ in range(6)],
        config,
    )
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        trainer.fit()
    (end,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "fit_end"]
    assert end["collective"] == "all-reduce (sample count)" and end["exit_code"] != 0
    assert rank_end(0, end).waiting
    assert failed_rank([rank_end(0, end), rank_end(1, None)]).rank == 1


def test_several_ranks_killed_without_a_word_are_named_together_not_one_of_them_first():
    """A SIGKILLed rank and a peer that torchrun (or a native abort) ended before it could write
    its record: nothing tells which died first, so the line names both and says so, and the
    restart event names no rank."""
    dead = [rank_end(0, None), rank_end(1, None), rank_end(2, {"event": "fit_end", "time": 1.0,
                                                                "exit_code": 143})]  # fmt: skip
    chosen = failed_rank(dead)
    assert chosen.silent_with == (0, 1)
    assert chosen.describe().startswith("ranks 0, 1 of 3 ended without an exit record")
    assert "which failed first is not known" in chosen.describe()
    death = ChildExit.of(1, None, None, chosen)
    assert death.rank_fields == {"failed_rank": None, "rank_exit": None, "silent_ranks": [0, 1]}
    assert failed_rank([dead[1], dead[2]]) is dead[1]  # one silent rank is named


def test_rank_ends_read_each_ranks_folder_since_the_attempt_started(tmp_path):
    run = tmp_path / "run"
    (run / "ranks" / "rank-1").mkdir(parents=True)
    old = {"time": 1.0, "event": "exit", "exit_code": 5}
    shrunk = [{"time": 5.5, "event": "oom"}, {"time": 5.6, "event": "shrink", "old": 8, "new": 4}]
    (run / "events.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [{"time": 5.0, "event": "fit_start", **GROUP}, *shrunk])
    )
    (run / "ranks/rank-1/events.jsonl").write_text(
        json.dumps(old) + "\n" + json.dumps({"time": 6.0, "event": "fit_start"}) + "\n"
    )
    ends = rank_ends(run, since=4.0)
    assert [(e.rank, e.world_size, e.record, e.started) for e in ends] == [
        (0, 2, None, True),
        (1, 2, None, True),
    ]
    assert ends[1].folder == run / "ranks" / "rank-1"
    assert rank_ends(run, since=10.0) == []  # nothing of that attempt: one process, or none
    assert rank_ends(None, since=0.0) == []


def test_a_rank_records_its_exit_with_the_collective_it_broke_in(tmp_path):
    """Each rank of a torchrun group whose fit() ends by an error writes an exit event in its
    own folder, with the collective the error came out of (also through `raise ... from`); a
    single process writes none (its exit code reaches the supervisor itself)."""
    from steadytrain.errors import UserCodeError
    from steadytrain.safety.failure_record import record_exit

    broken = RuntimeError("Connection reset by peer")
    broken.steadytrain_collective = "all-reduce (sample count)"
    broken.steadytrain_step = 6
    record_exit(tmp_path, broken, {"rank": 1, "world_size": 2})
    theirs = UserCodeError("boom", where="loss_fn", step=2)
    theirs.__cause__ = broken
    record_exit(tmp_path, theirs, {"rank": 1, "world_size": 2})
    record_exit(tmp_path, broken, {"rank": 0, "world_size": 1})
    first, second = read_jsonl(tmp_path / "events.jsonl")
    assert (first["event"], first["exit_code"], first["step"], first["rank"]) == ("exit", 1, 6, 1)
    assert first["collective"] == "all-reduce (sample count)"
    assert first["reason"] == "RuntimeError: Connection reset by peer"
    assert (second["exit_code"], second["step"], second["collective"]) == (
        5,
        2,
        "all-reduce (sample count)",
    )


def test_hang_exit_75_is_restarted(job):
    code, out = supervise(job, "exit:75", "exit:0")
    assert code == 0
    assert job.events("restart")[0]["reason"] == "hang detected by the watchdog (exit 75)"
    assert "after a hang (exit 75)" in out


def test_crash_loop_backs_off_and_gives_up(job):
    """Row 18: a trainer that crashes at start-up every time."""
    code, out = supervise(job, "exit:1", max_restarts=4)
    assert code == 4
    assert len(job.attempts()) == 5
    delays = [e["delay_s"] for e in job.events("restart")]
    assert delays == [0.01, 0.02, 0.04, 0.04]  # doubling, capped at --backoff-max
    assert all(b >= a for a, b in itertools.pairwise(delays))
    gave_up = job.events()[-1]
    assert gave_up["event"] == "supervisor_gave_up"
    assert gave_up["exit_code"] == 4
    assert (
        "gave up after 4 restarts without a new checkpoint; last: child crashed with exit 1; "
        f"see {job.run_dir / 'events.jsonl'}"
    ) in out


def test_progress_resets_the_count_and_the_backoff(job):
    """A job that crashes every time but commits a newer checkpoint first eventually finishes,
    although it dies more often than --max-restarts allows without progress."""
    plan = ["ckpt:10+exit:1", "ckpt:20+exit:1", "ckpt:30+kill:SIGSEGV", "exit:0"]
    code, _ = supervise(job, *plan, max_restarts=1)
    assert code == 0
    restarts = job.events("restart")
    assert [(e["step"], e["delay_s"]) for e in restarts] == [(10, 0.01), (20, 0.01), (30, 0.01)]
    assert restarts[2]["signal"] == "SIGSEGV"


def test_a_long_healthy_run_resets_the_backoff_but_not_the_count(job):
    code, _ = supervise(job, "exit:1", max_restarts=3, healthy_run_s=0.0)
    assert code == 4
    assert [e["delay_s"] for e in job.events("restart")] == [0.01, 0.01, 0.01]


def test_without_run_dir_every_restart_counts_as_no_progress(job):
    code, out = supervise(
        job, "ckpt:10+exit:1", "ckpt:20+exit:1", "exit:0", run_dir=False, max_restarts=1
    )
    assert code == 4
    assert "no run dir" in out
    assert "progress could not be seen" in out


@pytest.mark.parametrize("exit_code", [2, 3])
def test_bad_input_and_does_not_fit_are_not_restarted(job, exit_code):
    code, out = supervise(job, f"exit:{exit_code}", "exit:0")
    assert code == exit_code
    assert len(job.attempts()) == 1
    assert job.events("restart") == []
    assert "not restarting: the same input fails the same way" in out


def test_processes_left_by_a_dead_child_are_killed_before_the_restart(job):
    """A grandchild (a data worker, say) would hold memory and the run directory's lock."""
    code, _ = supervise(job, "spawn+exit:1", "probe+exit:0")
    assert code == 0
    assert (job.state / "probe").read_text() in ("gone", "Z")  # Z: killed, not yet reaped


# ---- how deaths are described --------------------------------------------------------------


@pytest.mark.parametrize(
    ("returncode", "delta", "kind", "text"),
    [
        (0, None, "finished", "child finished (exit 0)"),
        (1, None, "restart", "child crashed with exit 1"),
        (1, 2, "restart", "child crashed with exit 1; cgroup oom_kill count +2"),
        (75, None, "restart", "hang detected by the watchdog (exit 75)"),
        (-6, None, "restart", "child aborted (exit -6, SIGABRT): on a Mac often a Metal assertion"),
        (-11, None, "restart", "child killed by SIGSEGV (exit -11): a crash in native code"),
        (-9, 0, "restart", "SIGKILL (exit -9, shell 137): not the kernel's out-of-memory killer"),
        (
            -9,
            None,
            "restart",
            "child killed by SIGKILL (exit -9, shell 137): most likely the OS out-of-memory killer "
            "(Linux) or macOS memory pressure (jetsam)",
        ),
        (137, None, "restart", "child exited 137 = 128 + SIGKILL (a shell or launcher"),
        (130, None, "stopped", "child stopped by SIGINT after saving (exit 130)"),
        (143, None, "stopped", "child stopped by SIGTERM after saving (exit 143)"),
        (-15, None, "stopped", "child stopped by SIGTERM (exit -15); it did not handle"),
        (2, None, "not_restartable", "child exited 2: bad input"),
        (3, None, "not_restartable", "child exited 3: does not fit even at micro-batch 1"),
    ],
)
def test_child_exit_descriptions(returncode, delta, kind, text):
    death = ChildExit(returncode, delta)
    assert death.kind == kind
    assert text in death.describe()


def test_memory_kill_suspected_on_sigkill_or_a_counted_oom_kill():
    assert ChildExit(-9).memory_kill_suspected
    assert ChildExit(137).memory_kill_suspected  # through a shell
    assert ChildExit(1, oom_kill_delta=1).memory_kill_suspected  # e.g. torchrun's exit 1
    assert not ChildExit(1, oom_kill_delta=0).memory_kill_suspected
    assert ChildExit(76, oom_kill_delta=0).memory_kill_suspected  # asked for by the child
    assert ChildExit(-15).exit_code == 143


# ---- the run directory and the cgroup counter ----------------------------------------------


def test_checkpoint_step_reads_the_latest_pointer(tmp_path):
    assert checkpoint_step(None) is None
    assert checkpoint_step(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-00000250\n")
    assert checkpoint_step(tmp_path) == 250
    (tmp_path / "checkpoints" / "latest").write_text("garbage")
    assert checkpoint_step(tmp_path) is None


def test_last_micro_batch_size_skips_a_torn_line(tmp_path):
    assert last_micro_batch_size(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text(
        '{"micro_batch_size": 8}\n{"micro_batch_size": 4}\n{"mi'
    )
    assert last_micro_batch_size(tmp_path) == 4


def test_events_are_appended_after_a_torn_line(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"event": "fit_start"}\n{"event": "oo')
    append_event(tmp_path, {"event": "restart"})
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert lines[-1] == '{"event": "restart"}'
    assert [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["fit_start", "restart"]


def fake_cgroup(tmp_path, proc_lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc = tmp_path / "cgroup"
    proc.write_text(proc_lines)
    root = tmp_path / "sys"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc, root


@pytest.mark.parametrize(
    ("proc_lines", "files", "expected"),
    [
        # cgroup v2
        ("0::/user.slice/job\n", {"user.slice/job/memory.events": "low 0\noom 2\noom_kill 3\n"}, 3),
        # v2 without a cgroup namespace: the path is not under the mount, its root is ours
        ("0::/docker/abc\n", {"memory.events": "oom 0\noom_kill 1\n"}, 1),
        # hybrid: v2 mounted at unified
        ("0::/job\n", {"unified/job/memory.events": "oom_kill 4\n"}, 4),
        # cgroup v1 (this machine's layout)
        (
            "4:memory:/api/x\n0::/\n",
            {"memory/api/x/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"},
            5,
        ),
        ("0::/job\n", {}, None),  # no counter: macOS-like
        ("0::/job\n", {"job/memory.events": "oom_kill many\n"}, None),
        ("garbage", {}, None),
    ],
)
def test_oom_kill_counter_on_a_fake_cgroup_tree(tmp_path, proc_lines, files, expected):
    proc, root = fake_cgroup(tmp_path, proc_lines, files)
    assert read_oom_kill_count(proc, root) == expected


def test_oom_kill_counter_without_proc_and_on_this_machine(tmp_path):
    assert read_oom_kill_count(tmp_path / "missing", tmp_path) is None
    count = read_oom_kill_count()
    assert count is None or count >= 0


def test_bad_options_are_reported_together():
    with pytest.raises(BadInputError) as info:
        SupervisorOptions(max_restarts=-1, backoff_initial=5, backoff_max=1, stop_timeout=0)
    message = str(info.value)
    assert "--max-restarts" in message
    assert "--backoff-max" in message
    assert "--stop-timeout" in message


# ---- signals, through the command line (P7) --------------------------------------------------


@pytest.mark.parametrize(
    ("signum", "times", "code"),
    [
        (signal.SIGTERM, 1, 143),
        (signal.SIGINT, 1, 130),
        (signal.SIGINT, 2, 130),
        (signal.SIGHUP, 1, 143),
    ],
)
def test_signal_to_the_supervisor_is_forwarded_and_nothing_restarts(job, signum, times, code):
    """The child handles the signal (it would save) and exits 128 + N; a second Ctrl-C while
    it is stopping is forwarded too (this child waits for the second one); a closed terminal's
    SIGHUP reaches the child as SIGTERM, so it saves."""
    forwarded = signal.SIGTERM if signum == signal.SIGHUP else signum
    proc = start_cli(job, "handle+ready+sleep:30", env={"CHILD_STOP_AFTER": str(times)})
    wait_for((job.state / "ready").exists)
    for n in range(1, times + 1):
        proc.send_signal(signum)
        wait_for(
            lambda n=n: (
                (job.state / "signals").exists()
                and len((job.state / "signals").read_text().split()) >= n
            )
        )
    rc, err = finish(proc)
    assert rc == code
    assert (job.state / "signals").read_text().split() == [forwarded.name] * times
    assert len(job.attempts()) == 1
    assert job.events("restart") == []
    assert job.events()[-1]["event"] == "supervisor_end"
    assert job.events()[-1]["exit_code"] == code
    assert f"got {signum.name}: forwarding {forwarded.name}" in err


def test_child_that_ignores_sigterm_is_killed_after_the_stop_timeout(job):
    proc = start_cli(job, "ignore+ready+sleep:60", args=["--stop-timeout", "0.5"])
    wait_for((job.state / "ready").exists)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 137
    assert time.monotonic() - started < 15
    assert "child still running 0.5 s after SIGTERM: sending SIGKILL" in err
    assert "child killed by our SIGKILL (exit -9): it did not stop within 0.5 s" in err
    assert len(job.attempts()) == 1


def test_sighup_stays_ignored_under_nohup(job):
    proc = start_cli(job, "handle+ready+sleep:1", "exit:0", prefix=["nohup"])
    wait_for((job.state / "ready").exists)
    proc.send_signal(signal.SIGHUP)
    rc, _ = finish(proc)
    assert rc == 0
    assert not (job.state / "signals").exists()


def test_sigterm_while_waiting_to_restart_stops(job):
    proc = start_cli(job, "exit:1", args=["--backoff-initial", "30", "--backoff-max", "30"])
    wait_for(lambda: (job.run_dir / "events.jsonl").exists())
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc, timeout=10)
    assert rc == 143
    assert "SIGTERM while waiting to restart: stopping" in err
    assert len(job.attempts()) == 1


def test_os_kill_of_the_child_is_restarted(job):
    """Row 5. The OS out-of-memory killer (and macOS jetsam) end a process with SIGKILL, which
    cannot be caught. Making the kernel do it for real means allocating until it kills, which is
    not safe on a shared machine, so the test sends the same SIGKILL from outside to the
    supervised child (found by the pid file it writes). Where this machine's cgroup counter is
    readable it stays unchanged, and the report says so; the counter rising is tested above
    with a fake tree and an injected counter."""
    proc = start_cli(job, "ready+sleep:60", "exit:0", args=["--backoff-initial", "0.05"])
    wait_for((job.state / "ready").exists)
    os.kill(int((job.state / "child.pid").read_text()), signal.SIGKILL)
    rc, err = finish(proc)
    assert rc == 0
    assert len(job.attempts()) == 2
    restart = job.events("restart")[0]
    assert (restart["exit_code"], restart["signal"]) == (-9, "SIGKILL")
    cause = (
        "most likely the OS out-of-memory killer (Linux) or macOS memory pressure (jetsam)"
        if read_oom_kill_count() is None
        else "not the kernel's out-of-memory killer (its cgroup oom_kill count is unchanged)"
    )
    assert f"child killed by SIGKILL (exit -9, shell 137): {cause}" in err
    assert restart["oom_kill_delta"] in (None, 0)
    assert "starting attempt 2" in err


# ---- the command line ----------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_environ(),
        cwd=ROOT,
    )


def test_cli_gives_up_with_exit_4():
    result = run_cli(
        "--max-restarts",
        "1",
        "--backoff-initial",
        "0.05",
        "--",
        sys.executable,
        "-c",
        "import sys; sys.exit(1)",
    )
    assert result.returncode == 4
    assert "gave up after 1 restart without a new checkpoint" in result.stderr


def test_cli_without_a_command_is_a_usage_error():
    result = run_cli()
    assert result.returncode == 2
    assert "give the command to supervise after --" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_bad_option_is_exit_2_without_traceback():
    result = run_cli("--backoff-initial", "5", "--backoff-max", "1", "--", "true")
    assert result.returncode == 2
    assert "--backoff-max" in result.stderr
    assert "Traceback" not in result.stderr


def test_supervisor_does_not_import_torch():
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
        "from steadytrain.cli import main\n"
        "main(['run', '--', sys.executable, '-c', 'pass'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_environ(),
    )
    assert result.returncode == 0, result.stderr
    assert "torch imported: False" in result.stdout


# -- the heartbeat backstop (the hang watchdog's file; end to end in tests/test_watchdog.py) -----


def heartbeat_child(run_dir: Path, pid: str, action: str, seconds: float) -> list[str]:
    """A child that writes RUN_DIR/heartbeat saying it has been stalled far past what it allows,
    then sleeps and exits 0."""
    beat = (
        f"{{'pid': {pid}, 'action': {action!r}, 'stale_after_s': 0.5, 'stalled_s': 99.0, "
        "'step': 7, 'phase': 'step', 'dump_signal': None, 'written': 1.0}"
    )
    code = (
        f"import json, os, time; from pathlib import Path; "
        f"Path({str(run_dir / 'heartbeat')!r}).write_text(json.dumps({beat})); "
        f"time.sleep({seconds})"
    )
    return [sys.executable, "-c", code]


@pytest.mark.parametrize(
    ("pid", "action"),
    [("os.getpid()", "report"), ("1", "exit")],
    ids=["report-mode", "not-our-child"],
)
def test_a_stale_heartbeat_is_left_alone_in_report_mode_or_from_another_process(
    tmp_path, pid, action
):
    out = io.StringIO()
    opts = SupervisorOptions(run_dir=tmp_path, max_restarts=0)
    command = heartbeat_child(tmp_path, pid, action, 2.5)
    code = Supervisor(command, opts, environ=clean_environ(), out=out).run()
    assert code == 0, out.getvalue()
    assert "treating it as a hang" not in out.getvalue()


def test_a_stale_heartbeat_of_our_child_is_killed_as_a_hang(tmp_path):
    out = io.StringIO()
    opts = SupervisorOptions(run_dir=tmp_path, max_restarts=0)
    command = heartbeat_child(tmp_path, "os.getpid()", "exit", 60)
    started = time.monotonic()
    code = Supervisor(command, opts, environ=clean_environ(), out=out).run()
    assert time.monotonic() - started < 30
    assert code == 4, out.getvalue()  # a hang, then no restart left without progress
    assert "treating it as a hang" in out.getvalue()
    # the line says who caught it: the supervisor killed it, the child's watchdog did not
    assert "hang detected by the supervisor: the child's heartbeat file stood still" in (
        out.getvalue()
    )
    assert "hang detected by the watchdog" not in out.getvalue()
    (hang,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["detected_by"] == "supervisor" and hang["step"] == 7 and hang["exit_code"] == -9
    gave_up = [
        e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "supervisor_gave_up"
    ]
    assert gave_up[0]["last_exit_code"] == 75


def test_an_attempt_without_a_heartbeat_is_killed_and_the_line_names_the_supervisor(tmp_path):
    """Issue 27: a steadytrain run (an older config.json) whose attempt writes no heartbeat (it
    hangs before importing steadytrain): killed after --first-heartbeat-timeout, and the line
    says the supervisor caught it, not the watchdog. The child is told where to watch itself
    from its start (ENV_START_WATCH: the run directory and that limit)."""
    (tmp_path / "config.json").write_text("{}")
    seen = tmp_path / "start-watch.txt"
    code = (
        "import os, sys, time; from pathlib import Path; "
        f"Path(sys.argv[1]).write_text(os.environ.get({ENV_START_WATCH!r}, '')); time.sleep(60)"
    )
    out = io.StringIO()
    opts = SupervisorOptions(run_dir=tmp_path, max_restarts=0, first_heartbeat_s=1.0)
    started = time.monotonic()
    command = [sys.executable, "-c", code, str(seen)]
    assert Supervisor(command, opts, environ=clean_environ(), out=out).run() == 4, out.getvalue()
    assert time.monotonic() - started < 30
    assert "hang detected by the supervisor: no heartbeat" in out.getvalue()
    assert "--first-heartbeat-timeout 1 s); killed" in out.getvalue()
    assert "hang detected by the watchdog" not in out.getvalue()
    assert json.loads(seen.read_text()) == {"run_dir": str(tmp_path), "limit_s": 1.0}
    (hang,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hang["detected_by"] == "supervisor" and hang["phase"] == "start-up"


def test_a_supervisor_started_by_a_supervisor_does_not_watch_itself(tmp_path):
    """`steadytrain run` under another one (ENV_START_WATCH in its environment: importing
    steadytrain starts the watch from the process start) trains nothing itself, so it stops that
    watch before its child starts: no heartbeat of its own is left in the outer run directory,
    where the outer supervisor would take it, once stale, for a hung child. The child waits for
    that file to go (exit 0) or for a deadline (exit 2, not restarted)."""
    outer = tmp_path / "outer"
    outer.mkdir()
    beat = outer / "heartbeat"
    child = (
        "import sys, time; from pathlib import Path; end = time.monotonic() + 20\n"
        "while Path(sys.argv[1]).exists() and time.monotonic() < end: time.sleep(0.05)\n"
        "sys.exit(2 if Path(sys.argv[1]).exists() else 0)\n"
    )
    watch = json.dumps({"run_dir": str(outer), "limit_s": 600})
    result = subprocess.run(
        [*CLI, "--", sys.executable, "-c", child, str(beat)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean_environ(), ENV_START_WATCH: watch},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert not beat.exists()
    assert list((outer / "hangs").glob("backstop-*")) == []


# ---- a library's checkpoint is progress (issue 24 item 2) ----------------------------------


def test_a_librarys_checkpoint_events_are_progress_without_a_latest_pointer(job):
    """Hugging Face, Lightning, Keras and RunGuard record a `checkpoint` event after each
    verified save and write no checkpoints/latest: killed three times, each after a newer one,
    under --max-restarts 2, the run is restarted every time and finishes."""
    plan = [f"ckpt-event:{step}+kill:SIGKILL" for step in (2, 4, 6)]
    code, out = supervise(job, *plan, "exit:0", max_restarts=2)
    assert code == 0, out
    restarts = job.events("restart")
    assert [(r["step"], r["progressed"]) for r in restarts] == [(2, True), (4, True), (6, True)]
    assert "new checkpoint at step 6, so the count without progress starts again" in out


def test_progress_is_the_latest_pointer_or_any_integrations_checkpoint_event(tmp_path):
    from steadytrain.integrations import RunGuard

    run = tmp_path / "run"
    assert progress_step(None) is None
    assert progress_step(run) is None
    with RunGuard(run, config={}, memory_watch=False) as guard:  # the own-loop integration
        saved = run / "checkpoints" / "step-00000004.pt"
        saved.parent.mkdir(parents=True)
        saved.write_bytes(b"weights")
        guard.checkpoint_saved(saved, 4)
    assert progress_step(run) == 4
    # what the Hugging Face, Lightning and Keras callbacks record after their manifest
    for step, where in ((6, "out/checkpoint-6"), (9, "epoch=0-step=9.ckpt"), (12, "step-12")):
        append_event(
            run, {"time": time.time(), "event": "checkpoint", "step": step, "checkpoint": where}
        )
        assert progress_step(run) == step
    append_event(run, {"time": time.time(), "event": "checkpoint_skipped", "step": 99})
    with open(run / "events.jsonl", "a") as handle:
        handle.write('{"event": "checkpoint", "step": 50')  # torn by a kill
    assert progress_step(run) == 12
    (run / "checkpoints" / "latest").write_text("step-00000020")  # the Trainer's pointer
    assert progress_step(run) == 20


def report_line(run_dir: Path) -> str:
    from steadytrain.telemetry.run_reading import load_run, summary_line

    return summary_line(load_run(run_dir))


def test_the_report_counts_a_resume_no_event_records_and_its_lost_steps(tmp_path):
    """A program of its own under RunGuard records no `resume`: the attempt whose first step
    follows a checkpoint resumed, and the steps the killed attempt had gone past it are lost."""
    run = tmp_path / "run"
    run.mkdir()
    lines, events = [], []
    events.append({"time": 1.0, "event": "fit_start", "step": 0})
    lines += [{"time": 1.0 + s, "step": s, "loss": 1.0} for s in range(1, 11)]
    events.append({"time": 2.5, "event": "checkpoint", "step": 2, "checkpoint": "step-2.pt"})
    events.append({"time": 20.0, "event": "fit_start", "step": 0})
    lines += [{"time": 20.0 + s, "step": s, "loss": 1.0} for s in range(3, 13)]
    events.append({"time": 40.0, "event": "fit_end", "step": 12, "exit_code": 0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    line = report_line(run)
    assert "1 resume(s)" in line
    assert "8 lost step(s)" in line


def test_the_report_counts_the_lost_steps_a_checkpoint_event_shows(tmp_path):
    """The killed attempt's last lines were not written (a step's line waits for the next step;
    a library logs every few steps), but its checkpoint event says it reached step 8; the next
    attempt took up at step 5 (resumed from step 4): steps 5 to 8 were lost."""
    run = tmp_path / "run"
    run.mkdir()
    events = [
        {"time": 1.0, "event": "fit_start", "step": 0},
        {"time": 5.0, "event": "checkpoint", "step": 4},
        {"time": 9.0, "event": "checkpoint", "step": 8},
        {"time": 20.0, "event": "resume", "step": 4},
        {"time": 21.0, "event": "fit_start", "step": 4},
    ]
    lines = [{"time": 1.0 + s, "step": s} for s in (1, 2, 3, 4)]
    lines += [{"time": 21.0 + s, "step": s} for s in (5, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    line = report_line(run)
    assert "1 resume(s)" in line
    assert "4 lost step(s)" in line


OWN_LOOP = r"""
import os, signal, sys
from pathlib import Path
import torch
from steadytrain.integrations import RunGuard

# Saves every 2 steps; attempt k (STEADYTRAIN_RESTART) is killed one step after its save of
# step 2k + 2, so each kill comes after a newer checkpoint and loses one step.
run_dir, restart = Path(sys.argv[1]), int(os.environ["STEADYTRAIN_RESTART"])
model = torch.nn.Linear(2, 1)
with RunGuard(run_dir, config={}, memory_watch=False) as guard:
    start = 0
    found = guard.newest_checkpoint()
    if found is not None:
        start = torch.load(found, weights_only=True)["step"]
    for step in range(start + 1, 11):
        with guard.step(step) as row:
            row.update(loss=1.0 / step, micro_batch_size=1)
        if step % 2 == 0:
            path = run_dir / "checkpoints" / f"step-{step:08d}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"step": step}, path)
            guard.checkpoint_saved(path, step)
        if restart < 3 and step == 2 * restart + 3:
            os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_runguard_loop_killed_three_times_after_newer_checkpoints_finishes(tmp_path):
    """Under `steadytrain run --max-restarts 2` with no --run-dir: the guard announces its run
    dir, each kill follows a newer checkpoint, so the run finishes (exit 4 before: only
    checkpoints/latest counted); the report counts its 3 resumes and 3 lost steps."""
    script, run_dir = tmp_path / "own_loop.py", tmp_path / "run"
    script.write_text(OWN_LOOP)
    result = subprocess.run(
        [
            *CLI,
            "--max-restarts",
            "2",
            "--backoff-initial",
            "0.05",
            "--",
            sys.executable,
            str(script),
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_environ(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "(announced by the child); counting progress there" in result.stderr
    restarts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restart"]
    assert [(r["step"], r["progressed"]) for r in restarts] == [(2, True), (4, True), (6, True)]
    line = report_line(run_dir)
    assert "10 steps" in line
    assert "3 resume(s), 3 restart(s), 3 lost step(s)" in line


FILLS_THE_DISK = """
import sys
with open(sys.argv[1], "ab", buffering=0) as handle:
    for block in (b"\\0" * 4096, b"\\0"):
        try:
            while True:
                handle.write(block)
        except OSError:
            pass
"""


def test_a_disk_full_when_the_run_ends_is_one_line_that_does_not_say_the_run_goes_on(tmp_path):
    """The child filled the run's disk and finished: the supervisor cannot append its
    `supervisor_end` event. It says so in one line (the error's first) and that the event is not
    recorded, not that "the run goes on", and ends with the child's 0."""
    with tmpfs(tmp_path / "tiny", "1m") as point:
        run_dir = point / "run"
        run_dir.mkdir()
        out = io.StringIO()
        (tmp_path / "fill.py").write_text(FILLS_THE_DISK)
        command = [sys.executable, str(tmp_path / "fill.py"), str(point / "filler")]
        opts = SupervisorOptions(run_dir=run_dir, **FAST)
        code = Supervisor(command, opts, environ=clean_environ(), out=out).run()
    assert code == 0, out.getvalue()
    said = out.getvalue().splitlines()
    unrecorded = [line for line in said if "supervisor_end" in line]
    assert len(unrecorded) == 1, said
    assert unrecorded[0].startswith("steadytrain run: disk full"), said
    assert unrecorded[0].endswith("it is not recorded (the supervisor_end event)"), said
    assert not any("goes on" in line for line in said), said
    assert all(line.startswith("steadytrain run: ") for line in said), said


@pytest.mark.parametrize("under", [False, True])
def test_a_run_directory_that_is_a_file_is_refused_before_the_command_runs(tmp_path, capsys, under):
    """`steadytrain run --run-dir FILE -- CMD`: the command ran, then the supervisor's events
    failed with '[Errno 17] File exists' and it ended with 0. Refused at the start (exit 2),
    naming the file; the command never runs."""
    from steadytrain.cli import main as cli_main

    file = tmp_path / "notes.txt"
    file.write_text("a file, not a run\n")
    given = file / "run" if under else file
    marker = tmp_path / "ran"
    with pytest.raises(SystemExit) as info:
        cli_main(["run", "--run-dir", str(given), "--", sys.executable, "-c",
                  f"open({str(marker)!r}, 'w')"])  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())
    assert info.value.code == 2, err
    where = f"is under {file}, a file" if under else "is a file"
    assert f"error: the run directory {given} (--run-dir, $STEADYTRAIN_RUN_DIR or" in err, err
    assert f"{where}: the run's checkpoints and events go in a folder there" in err, err
    assert not marker.exists()
    assert file.read_text() == "a file, not a run\n"
