"""Several ranks through torchrun (gloo, CPU, 2 processes): the same script gives the same update
as one process, and an out-of-memory on one rank makes every rank shrink and redo the step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import MALLOC_ENV, WORKLOADS, real_oom, run_workload

from steadytrain.engine.distributed import Group, RanksOutOfMemory
from steadytrain.engine.sampler import OptimizerBatchSampler
from steadytrain.errors import BadInputError
from steadytrain.telemetry.files import read_jsonl


def torchrun_command(
    *args: str, env: dict | None = None, fork_ranks: bool = True
) -> tuple[list[str], dict]:
    """tests/workloads/ranks.py under `torchrun --nproc_per_node 2` on a free port, and the
    environment to run it with."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return forkserver.torchrun_command(
        WORKLOADS / "ranks.py", *args, env=env, fork_ranks=fork_ranks
    )


def torchrun(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command, env = torchrun_command(*args, env=env)
    return forkserver.run(command, env=env, timeout=300)


def supervised_torchrun(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    command, env = torchrun_command(str(run_dir), *args, fork_ranks=False)
    supervisor = [sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)]
    return forkserver.run(
        [*supervisor, "--backoff-initial", "0.1", "--", *command], env=env, timeout=300
    )


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "params.pt", weights_only=True)


def relative_differences(a: Path, b: Path) -> dict[str, float]:
    pa, pb = params(a), params(b)
    return {k: float((pa[k] - pb[k]).norm() / pb[k].norm()) for k in pb}


@pytest.mark.parametrize(
    ("loss", "batch", "micro_one", "micro_two"),
    [("mean", "16", "4", "4"), ("tokens", "12", "2", "4")],
)
def test_two_ranks_equal_one_process(tmp_path: Path, loss, batch, micro_one, micro_two):
    """Acceptance 1: 10 AdamW steps, fp32; the token-weighted loss has padding and sequences of
    uneven length, so it is exact only when divided by the global token count."""
    common = ("--loss", loss, "--batch", batch, "--steps", "10")
    one = run_workload("ranks.py", str(tmp_path / "one"), *common, "--micro", micro_one)
    assert one.returncode == 0, one.stderr
    two = torchrun(str(tmp_path / "two"), *common, "--micro", micro_two)
    assert two.returncode == 0, two.stderr + two.stdout

    differences = relative_differences(tmp_path / "two", tmp_path / "one")
    assert max(differences.values()) <= 1e-6, differences
    # The reported loss is the global batch's, on every rank.
    losses_one = [m["loss"] for m in read_jsonl(tmp_path / "one" / "metrics.jsonl")]
    for metrics in ("metrics.jsonl", "ranks/rank-1/metrics.jsonl"):
        rows = read_jsonl(tmp_path / "two" / metrics)
        assert [m["samples"] for m in rows] == [int(batch)] * 10
        assert rows[-1]["loss"] == pytest.approx(losses_one[-1], rel=1e-5)
    # Rank 0 owns the run directory; rank 1 writes only its own folder.
    assert (tmp_path / "two" / "checkpoints" / "latest").exists()
    assert not (tmp_path / "two" / "ranks" / "rank-1" / "checkpoints").exists()
    assert not (tmp_path / "two" / "ranks" / "rank-1" / "config.json").exists()
    start = next(
        e for e in read_jsonl(tmp_path / "two" / "ranks/rank-1/events.jsonl") if "config" in e
    )
    assert start["process_group"] == {"rank": 1, "world_size": 2, "backend": "cpu:gloo"}
    # The arithmetic line says each rank's share and accumulation, not one process's.
    (arithmetic,) = [
        e for e in read_jsonl(tmp_path / "two" / "events.jsonl") if e["event"] == "arithmetic"
    ]
    share = int(batch) // 2
    steps = -(-share // int(micro_two))
    assert (
        f"micro-batch {micro_two} × {steps} accumulated on each of 2 ranks to {batch}"
        in (arithmetic["message"])
    )


def test_out_of_memory_on_one_rank_shrinks_every_rank(tmp_path: Path):
    """Acceptance 2: rank 1's address space is capped (RLIMIT_AS) so that micro-batch 16 fails
    there with a real CPU out-of-memory error (the allocator's own, or oneDNN's when a kernel's
    scratchpad is the allocation that fails: which one comes first depends on the machine); both ranks take the same rungs together (16 -> 8,
    and lower where the cap is tighter on a busy machine), the run finishes, and its parameters
    equal bit for bit those of two ranks that ran each step at the micro-batch the capped ranks
    ended it at."""
    common = ("--loss", "wide", "--batch", "32", "--steps", "4")
    limited = torchrun(
        str(tmp_path / "limited"), *common, "--micro", "16", "--limit-mib", "12", env=MALLOC_ENV
    )
    assert limited.returncode == 0, limited.stderr + limited.stdout
    result = json.loads((tmp_path / "limited" / "result.json").read_text())
    assert result["steps"] == 4 and result["micro_batch_size"] < 16

    events_1 = read_jsonl(tmp_path / "limited" / "ranks/rank-1/events.jsonl")
    events_0 = read_jsonl(tmp_path / "limited" / "events.jsonl")
    oom_1 = [e for e in events_1 if e["event"] == "oom"]
    oom_0 = [e for e in events_0 if e["event"] == "oom"]
    assert oom_1
    assert real_oom(oom_1[0]["error"]), oom_1[0]["error"]
    assert "out of memory on rank 1 of 2" in oom_0[0]["error"]
    assert oom_0[0]["phase"] == "rank 1"
    shrinks = [
        [(e["old"], e["new"]) for e in ev if e["event"] == "shrink"] for ev in (events_0, events_1)
    ]
    assert shrinks[0] == shrinks[1] and shrinks[0][0] == (16, 8)  # the same rungs on both ranks
    assert shrinks[0][-1][1] == result["micro_batch_size"]
    for metrics in ("metrics.jsonl", "ranks/rank-1/metrics.jsonl"):
        rows = read_jsonl(tmp_path / "limited" / metrics)
        assert [m["samples"] for m in rows] == [32] * 4  # the optimizer saw the whole batch

    # The same two ranks without a cap, taking at each step the micro-batch the capped run ended
    # it at: the redo after an out-of-memory is exact, so the parameters are equal bit for bit.
    # (Against one process they differ in the last bits whenever the shrink went past 8, since
    # the ranks sum their shares in another order: acceptance 1 holds that comparison.)
    schedule = [m["micro_batch_size"] for m in read_jsonl(tmp_path / "limited" / "metrics.jsonl")]
    assert schedule[-1] == result["micro_batch_size"]
    fixed = torchrun(
        str(tmp_path / "fixed"),
        *common,
        "--micro",
        str(schedule[0]),
        "--micro-at",
        ",".join(map(str, schedule)),
    )
    assert fixed.returncode == 0, fixed.stderr + fixed.stdout
    assert json.loads((tmp_path / "fixed" / "result.json").read_text())["oom_count"] == 0
    limited_params, fixed_params = params(tmp_path / "limited"), params(tmp_path / "fixed")
    for name, value in fixed_params.items():
        assert torch.equal(limited_params[name], value), (name, schedule)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_takes_a_contiguous_share_with_the_batch_seed(world: int):
    sampler = OptimizerBatchSampler(num_samples=40, batch_size=10, seed=3)
    batch = sampler.batch_at(1, 2)
    shares = [Group(rank=r, world_size=world).share(batch) for r in range(world)]
    assert [i for share in shares for i in share] == list(batch)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(share.seed == batch.seed for share in shares)


def test_a_batch_smaller_than_the_ranks_is_refused_naming_the_field():
    group = Group(rank=0, world_size=4)
    group.check_batches(OptimizerBatchSampler(16, 4, seed=0))
    with pytest.raises(BadInputError, match=r"effective_batch_size.*last batch.*drop_last"):
        group.check_batches(OptimizerBatchSampler(18, 8, seed=0, drop_last=False))
    with pytest.raises(BadInputError, match="raise effective_batch_size to at least 4"):
        group.check_batches(OptimizerBatchSampler(16, 2, seed=0))


def test_the_group_of_one_needs_no_process_group(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    group = Group.from_env()
    assert (group.rank, group.world_size, group.active, group.owned) == (0, 1, False, False)
    group.close()  # nothing to destroy
    assert group.own_dir(tmp_path) == tmp_path
    assert group.total(7) == 7 and group.smallest(3) == 3
    assert Group(rank=2, world_size=3).own_dir(tmp_path) == tmp_path / "ranks" / "rank-2"
    assert issubclass(RanksOutOfMemory, MemoryError)  # the out-of-memory ladder takes it


def test_a_bad_world_size_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(BadInputError, match=r"WORLD_SIZE.*torchrun"):
        Group.from_env()


def test_resume_with_the_same_ranks_is_exact_and_with_one_says_what_changed(tmp_path: Path):
    """Rank 0 writes the checkpoint; both ranks resume from it and end bitwise equal to the
    uninterrupted 2-rank run. The same checkpoint resumed by one process (a GPU lost) finishes
    at the same parameters up to reduction order, with the change recorded."""
    common = ("--loss", "mean", "--batch", "16", "--micro", "4")
    whole = torchrun(str(tmp_path / "whole"), *common, "--steps", "10")
    assert whole.returncode == 0, whole.stderr + whole.stdout
    first = torchrun(str(tmp_path / "split"), *common, "--steps", "5")
    assert first.returncode == 0, first.stderr + first.stdout
    shutil.copytree(tmp_path / "split", tmp_path / "one")
    shutil.rmtree(tmp_path / "one" / "ranks")
    second = torchrun(str(tmp_path / "split"), *common, "--steps", "10")
    assert second.returncode == 0, second.stderr + second.stdout

    resumed, uninterrupted = params(tmp_path / "split"), params(tmp_path / "whole")
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    for events in ("events.jsonl", "ranks/rank-1/events.jsonl"):
        resumes = [e for e in read_jsonl(tmp_path / "split" / events) if e["event"] == "resume"]
        assert [e["step"] for e in resumes] == [5]

    alone = run_workload("ranks.py", str(tmp_path / "one"), *common, "--steps", "10")
    assert alone.returncode == 0, alone.stderr
    events = read_jsonl(tmp_path / "one" / "events.jsonl")
    changes = [e["change"] for e in events if e["event"] == "resume_override"]
    assert changes == ["world_size: 2 -> 1"]
    assert max(relative_differences(tmp_path / "one", tmp_path / "whole").values()) <= 1e-6


@pytest.mark.parametrize(
    ("environ", "status", "says"),
    [
        ({}, "info", "one process"),
        (
            {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost"}
            | {"MASTER_PORT": "29500"},
            "ok",
            "rank 1 of 2 (local rank 1)",
        ),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "fail", "MASTER_ADDR, MASTER_PORT not set"),
        ({"WORLD_SIZE": "x"}, "fail", "not a whole number"),
    ],
)
def test_doctor_reports_the_process_group(tmp_path: Path, environ, status, says):
    from steadytrain.device import SystemProbe
    from steadytrain.doctor.findings import Context
    from steadytrain.doctor.process_group import check_process_group

    (finding,) = check_process_group(Context(SystemProbe(), {}, environ, "cpu", tmp_path))
    assert finding.check == "process group" and finding.status == status
    assert says in finding.message
    assert "gloo (CPU)" in finding.data["backends"]
    if status == "fail":
        assert "torchrun" in finding.fix


def test_a_killed_rank_under_the_supervisor_restarts_the_group_bitwise_exact(tmp_path: Path):
    """Acceptance 3: `steadytrain run -- torchrun ...`; rank 1 is SIGKILLed after step 5 (the
    last checkpoint is step 3). torchrun ends the group, the supervisor restarts it, both ranks
    resume from step 3, and the final parameters equal the uninterrupted run's bit for bit."""
    common = (
        "--loss",
        "mean",
        "--batch",
        "16",
        "--micro",
        "4",
        "--steps",
        "8",
        "--save-every",
        "3",
    )
    whole = torchrun(str(tmp_path / "whole"), *common)
    assert whole.returncode == 0, whole.stderr + whole.stdout
    run_dir = tmp_path / "killed"
    supervised = supervised_torchrun(run_dir, *common, "--kill-rank", "1", "--kill-at", "5")
    assert supervised.returncode == 0, supervised.stderr + supervised.stdout
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["event"] for e in events].count("restart") == 1
    # The supervisor names the rank that died: it wrote no exit record (a SIGKILL), while rank
    # 0's collective broke waiting for it (or torchrun stopped it). Where rank 0 too ended
    # without a word (torchrun's kill, or gloo aborting in native code, came before its record),
    # nothing tells which died first: both are named and neither is called first.
    (restart,) = [e for e in events if e["event"] == "restart"]
    if restart["failed_rank"] is None:
        assert restart["silent_ranks"] == [0, 1], restart
        assert "ranks 0, 1 of 2 ended without an exit record" in restart["reason"]
    else:
        assert (restart["failed_rank"], restart["rank_exit"]) == (1, None), restart
    assert "rank 1 of 2 failed first" in restart["reason"]
    assert "rank 1 of 2 failed first: it ended without an exit record" in supervised.stderr
    for record in (e for e in events if e["event"] == "exit" and e["time"] < restart["time"]):
        assert record["rank"] == 0 and (record["collective"] or record["exit_code"] == 143)
    for folder in (run_dir, run_dir / "ranks" / "rank-1"):
        resumes = [e for e in read_jsonl(folder / "events.jsonl") if e["event"] == "resume"]
        assert [e["step"] for e in resumes] == [3]
    killed, uninterrupted = params(run_dir), params(tmp_path / "whole")
    assert all(torch.equal(killed[k], uninterrupted[k]) for k in uninterrupted)


def test_a_blocked_rank_is_caught_named_and_the_group_restarted(tmp_path: Path):
    """Acceptance 4: rank 1 sleeps forever in step 4 of the first attempt, hang_timeout 5 s
    (the first step and the start-up phases keep their own 600 s allowance, so the stall comes
    after step 1). Rank 1's watchdog writes a dump naming the rank and exits 75; rank 0, waiting
    for it in the step's agreement, names that collective (or breaks in it, or is stopped by
    torchrun). torchrun exits 1; the supervisor reads the ranks' events, names rank 1's hang,
    restarts the group as after a hang, and the run ends at the uninterrupted run's parameters."""
    common = ("--loss", "mean", "--batch", "16", "--micro", "8", "--steps", "6")
    common += ("--save-every", "2", "--hang-timeout", "5")
    whole = torchrun(str(tmp_path / "whole"), *common)
    assert whole.returncode == 0, whole.stderr + whole.stdout
    run_dir = tmp_path / "blocked"
    supervised = supervised_torchrun(run_dir, *common, "--block-rank", "1", "--block-at", "4")
    assert supervised.returncode == 0, supervised.stderr + supervised.stdout

    rank_1 = read_jsonl(run_dir / "ranks/rank-1/events.jsonl")
    (hang,) = [e for e in rank_1 if e["event"] == "hang"]
    assert (hang["rank"], hang["world_size"], hang["step"]) == (1, 2, 3)
    assert (hang["exit_code"], hang["limit_s"], hang["collective"]) == (75, 5.0, None)
    assert hang["stalled_s"] < 5.0 + 2 * 5.0 / 8 + 0.5  # within the limit and two polls
    dump = (run_dir / "ranks/rank-1" / hang["file"]).read_text()
    assert "rank: 1 of 2" in dump and "in on_micro_step_end" in dump  # BlockAt's frame

    events = read_jsonl(run_dir / "events.jsonl")
    (restart,) = [e for e in events if e["event"] == "restart"]
    assert (restart["failed_rank"], restart["rank_exit"], restart["exit_code"]) == (1, 75, 1)
    assert restart["reason"].startswith("hang detected by the watchdog (exit 75); rank 1 of 2")
    assert "stacks in ranks/rank-1/hangs/" in restart["reason"]
    assert "after a hang (exit 75)" in supervised.stderr
    first = [e for e in events if e["time"] < restart["time"]]
    rank_0 = [e for e in first if e["event"] in ("hang", "exit", "fit_end")]
    for record in rank_0:  # waiting for rank 1, or stopped by torchrun: never a failure of its own
        assert record.get("collective") == "all-reduce (agreement)" or record["exit_code"] == 143
    for record in (e for e in rank_0 if e["event"] == "hang"):
        assert record["phase"] == "all-reduce (agreement) in step" and record["rank"] == 0
        assert "waiting in: all-reduce (agreement)" in (run_dir / record["file"]).read_text()

    for folder in (run_dir, run_dir / "ranks" / "rank-1"):
        resumes = [e for e in read_jsonl(folder / "events.jsonl") if e["event"] == "resume"]
        assert [e["step"] for e in resumes] == [2]
    blocked, uninterrupted = params(run_dir), params(tmp_path / "whole")
    assert all(torch.equal(blocked[k], uninterrupted[k]) for k in uninterrupted)


def test_a_rank_stalled_before_the_first_step_is_caught_within_hang_timeout(tmp_path: Path):
    """Issue 26: rank 1 blocks 12 s at the start of its first step, before its first
    collective; rank 0 waits for it in the first step's first collective. hang_timeout 3 s
    bounds the first step (it had 600 s whatever hang_timeout said): each rank's watchdog
    reports within the limit and two polls, rank 0's report names the collective, both reports
    hold stacks, and the console said the allowance. hang_action report: the run then goes on
    and finishes, so one torchrun invocation shows both ranks' reports."""
    limit = 3.0
    run_dir = tmp_path / "run"
    done = torchrun(
        str(run_dir),
        *("--loss", "mean", "--batch", "16", "--micro", "8", "--steps", "2"),
        *("--hang-timeout", str(limit), "--hang-action", "report"),
        *("--block-rank", "1", "--block-at", "0", "--block-seconds", "12"),
    )
    assert done.returncode == 0, done.stderr + done.stdout
    said = f"{limit:g} s without progress is a hang, in start-up, the first step and every"
    assert said in done.stderr + done.stdout
    polls = 2 * limit / 8 + 0.5

    rank_1 = [e for e in read_jsonl(run_dir / "ranks/rank-1/events.jsonl") if e["event"] == "hang"]
    (blocked,) = [e for e in rank_1 if e["phase"] == "first step"]
    assert (blocked["rank"], blocked["limit_s"], blocked["collective"]) == (1, limit, None)
    assert blocked["stalled_s"] < limit + polls
    report = (run_dir / "ranks/rank-1" / blocked["file"]).read_text()
    assert "in blocked_before_first_collective" in report and "phase: first step" in report

    rank_0 = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "hang"]
    waiting = [e for e in rank_0 if e["collective"] is not None]
    assert waiting, rank_0
    hang = waiting[0]
    assert hang["phase"] == f"{hang['collective']} in first step", hang
    assert (hang["rank"], hang["limit_s"], hang["step"]) == (0, limit, 0)
    assert hang["stalled_s"] < limit + polls
    report = (run_dir / hang["file"]).read_text()
    assert f"waiting in: {hang['collective']}" in report and 'File "' in report
    assert not list(run_dir.glob("**/hangs/backstop-*.txt"))  # nothing left half-done


def test_out_of_memory_while_the_optimizer_is_built_is_an_out_of_memory_of_that_rank(
    tmp_path: Path,
):
    """Issue 26: under torchrun, rank 1's optimizer takes 512 MiB when it is built, in a
    process capped (RLIMIT_AS) 32 MiB above its size: a real out-of-memory in the Trainer's
    set-up. It is an out-of-memory of rank 1 (exit 76, its exit record naming it), not exit 5
    "an error in your code", and the rank that failed first, as `steadytrain run` reads the
    ranks' records, is rank 1. Before, it was exit 5 and rank 0's record was read first."""
    from steadytrain.supervisor.attempt_end import failed_rank, rank_ends

    run_dir = tmp_path / "run"
    common = ("--loss", "mean", "--batch", "16", "--micro", "8", "--steps", "2")
    done = torchrun(
        str(run_dir), *common, "--limit-mib", "32", "--optimizer-mib", "512", env=MALLOC_ENV
    )
    assert done.returncode != 0, done.stdout
    assert "out of memory on rank 1 of 2 before the first step" in done.stderr
    assert "error in your code" not in done.stderr

    (record,) = [
        e for e in read_jsonl(run_dir / "ranks/rank-1/events.jsonl") if e["event"] == "exit"
    ]
    assert record["exit_code"] == 76 and record["rank"] == 1, record
    assert real_oom(record["reason"]), record["reason"]
    first = failed_rank(rank_ends(run_dir, 0.0))
    assert first is not None and (first.rank, first.exit_code) == (1, 76), first


def test_rank_0_alone_prints_progress_and_the_report_shows_every_rank(tmp_path: Path):
    """Both ranks write their own metrics; only rank 0 prints the run's lines; the report reads
    ranks/rank-1/ too and gives each rank's peak memory, and draws each rank's line."""
    from steadytrain.telemetry.report import write_report
    from steadytrain.telemetry.run_reading import load_run, summary_rows

    run = torchrun(str(tmp_path / "two"), "--steps", "3")
    assert run.returncode == 0, run.stderr + run.stdout
    console = run.stderr + run.stdout
    assert console.count("steadytrain: 3 steps of 16 samples") == 1, console
    assert console.count("step 3/3") == 1, console
    assert console.count("finished at step 3") == 1, console

    loaded = load_run(tmp_path / "two")
    assert list(loaded.ranks) == [1] and len(loaded.ranks[1]) == 3
    rows = dict(summary_rows(loaded))
    for rank in (0, 1):
        assert "GiB resident set (RSS)" in rows[f"peak memory, rank {rank}"]
    report = write_report(tmp_path / "two")
    page = report.html.read_text()
    assert "peak memory, rank 0" in page and "peak memory, rank 1" in page


def test_the_end_of_a_fit_waits_until_gloos_workers_let_go_of_its_last_collectives(tmp_path):
    """A gloo worker lets go of a finished collective a moment after its caller moved on; one
    that does so during interpreter exit aborts the process after a run that finished. `settle`
    ends with `released`: the kept tensors of its rendezvous are held by no work any more."""
    import torch.distributed as dist

    from steadytrain.engine.distributed import _KEPT, released, rendezvous

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for _ in range(2):
            rendezvous("cpu")
        assert released(10.0)
        assert all(kept._use_count() == 1 for kept in _KEPT.values())
        # a holder that never lets go (here autograd, which saved it for a backward): the wait
        # ends at its limit
        held = torch.ones(1, requires_grad=True) * _KEPT["cpu"]
        assert not released(0.05)
        del held
        assert released(1.0)
    finally:
        dist.destroy_process_group()
