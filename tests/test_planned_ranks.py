"""micro_batch_size auto on several ranks (issue 40): under `distributed: fsdp` the plan's trial
passes run in lockstep on every rank and the group starts at a size that fits every rank, with
no out-of-memory restart; a rank that runs out of memory at micro-batch 1 makes `steadytrain
run` restart the group with the next memory saver on, and exit 3 naming GPUs when none is left;
under ddp each rank plans its share and the ranks agree on the smallest. Two gloo ranks on the
CPU, each under a real RLIMIT_AS (tests/workloads/planned_ranks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from conftest import MALLOC_ENV, WORKLOADS

from steadytrain.telemetry.files import read_jsonl

WHOLE_SHARE = 8  # effective batch 16 over 2 ranks
RANK_1 = Path("ranks") / "rank-1"


def torchrun_command(run_dir: Path, *args: str, fork_ranks: bool = True):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **MALLOC_ENV}
    return forkserver.torchrun_command(
        WORKLOADS / "planned_ranks.py", str(run_dir), *args, env=env, fork_ranks=fork_ranks
    )


def torchrun(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    command, env = torchrun_command(run_dir, *args)
    return forkserver.run(command, env=env, timeout=400)


def supervised(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`steadytrain run -- torchrun --nproc_per_node 2 planned_ranks.py RUN_DIR ARGS`."""
    command, env = torchrun_command(run_dir, *args, fork_ranks=False)
    supervisor = [sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)]
    return forkserver.run(
        [*supervisor, "--backoff-initial", "0.1", "--", *command], env=env, timeout=600
    )


def events(run_dir: Path, rank: int = 0) -> list[dict]:
    return read_jsonl(run_dir / (RANK_1 if rank else Path()) / "events.jsonl")


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]


def speaks_per_rank(plan: dict, run_dir: Path, printed: str, effective: int) -> None:
    """The plan says what each rank runs and what the group adds up to: its record has the
    ranks, a rank's share and its micro-steps (those the steps ran), and its line reads
    "micro-batch M per rank × S steps × 2 ranks (effective batch E)"."""
    micro, share = plan["micro_batch_size"], effective // 2
    steps = -(-share // micro)
    assert (plan["world_size"], plan["rank_batch"], plan["rank_micro_steps"]) == (2, share, steps)
    assert plan["effective_batch_size"] == effective, plan
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows and all(m["micro_steps"] == steps for m in rows), rows
    line = f"plan: micro-batch {micro} per rank × {steps} step{'s' if steps > 1 else ''} × 2 ranks"
    assert f"{line} (effective batch {effective})" in printed, printed[-4000:]
    runs = f"{steps} micro-batch{'es' if steps > 1 else ''} of {micro} of its share of {share}"
    reason = (
        f"accumulation {steps} on each of 2 ranks: {runs}, the effective batch stays {effective}"
    )
    assert reason in plan["reasons"], plan["reasons"]


def test_auto_under_fsdp_plans_in_lockstep_and_starts_without_an_out_of_memory(tmp_path: Path):
    """Each rank capped 200 MiB above its size: the whole share (8 samples, about 30 MiB each)
    does not fit. The ranks run the trial passes together and agree on one size below it;
    attempt 1 trains to the end with no out-of-memory and no restart, and its losses are those
    of two ranks started at that size by hand."""
    run_dir = tmp_path / "auto"
    done = supervised(run_dir, "--limit-mib", "200", "--steps", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    plans = [[e for e in events(run_dir, r) if e["event"] == "plan"] for r in (0, 1)]
    assert len(plans[0]) == len(plans[1]) == 1, plans
    (plan_0,), (plan_1,) = plans
    micro, checkpointing = plan_0["micro_batch_size"], plan_0["activation_checkpointing"]
    assert 1 <= micro < WHOLE_SHARE, plan_0
    assert (plan_1["micro_batch_size"], plan_1["activation_checkpointing"]) == (
        micro,
        checkpointing,
    )
    assert any("in lockstep on every rank" in r for r in plan_0["reasons"]), plan_0["reasons"]
    for rank in (0, 1):
        names = [e["event"] for e in events(run_dir, rank)]
        assert "oom" not in names and "shrink" not in names, names
    assert not [e for e in events(run_dir) if e["event"] == "restart"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["micro_batch_size"] for m in rows] == [micro] * 2
    speaks_per_rank(plan_0, run_dir, done.stderr, effective=16)

    by_hand = tmp_path / "by-hand"
    flags = ["--checkpointing"] if checkpointing else []
    started = torchrun(by_hand, "--micro", str(micro), "--steps", "2", *flags)
    assert started.returncode == 0, started.stderr[-4000:]
    assert losses(run_dir) == losses(by_hand)


def test_auto_under_fsdp_is_priced_per_rank_and_checkpoints_before_trying_plain(tmp_path: Path):
    """A tiny Hugging Face Llama (a family the estimate models; about 0.5 GiB of activations a
    sample plain, under 0.1 GiB checkpointed), each rank capped 550 MiB above its size. The
    per-rank estimate puts one sample plain over the limit and checkpointed under it, so the
    plan never runs the plain trial pass (which would run out of memory on a rank: exit 76 and
    a restart) and starts with activation checkpointing on; both ranks record the per-rank
    estimate. Under `steadytrain run`, each rank records the savers the plan turned on as in
    force (`memory_savers`, the supervisor reads the newest): an out-of-memory at micro-batch 1
    after it would restart with the next saver, not with checkpointing again."""
    run_dir = tmp_path / "priced"
    args = ("--model", "llama", "--batch", "4", "--steps", "1", "--limit-mib", "550")
    done = supervised(run_dir, *args)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        records = events(run_dir, rank)
        in_force = [e["in_force"] for e in records if e["event"] == "memory_savers"]
        assert in_force == [[], ["activation_checkpointing"]], in_force
        assert "oom" not in [e["event"] for e in records]
        (plan,) = [e for e in records if e["event"] == "plan"]
        assert plan["activation_checkpointing"] is True, plan
        assert any(
            r.startswith("plain: not probed; one sample is estimated at") for r in plan["reasons"]
        )
        assert any(r.startswith("per-rank estimate (fsdp over 2 ranks") for r in plan["reasons"])
        assert all(s["checkpointing"] for s in plan["probe"]["samples"]), plan["probe"]
        (estimate,) = [e for e in records if e["event"] == "estimate"]
        assert (estimate["world_size"], estimate["distributed"]) == (2, "fsdp"), estimate
        assert estimate["analytic_total"] > 0, estimate
        if rank == 0:
            speaks_per_rank(plan, run_dir, done.stderr, effective=4)
        # on the CPU the shards never go to the host: host memory is the device's
        (start,) = [e for e in records if e["event"] == "fit_start"]
        assert start["distributed"]["offload"] is False, start["distributed"]
        assert "offload_choice" not in start["distributed"] and not plan["fsdp_offload"]


def test_a_trial_pass_out_of_memory_counts_the_savers_it_had_on(tmp_path: Path):
    """The tiny Llama capped 80 MiB above its size: the per-rank estimate sends the plan
    straight to a checkpointed trial pass, which runs out of memory at micro-batch 1. The ranks
    record that pass's savers as in force, so `steadytrain run` stops with exit 3 after that
    one attempt (nothing is left on the CPU) instead of restarting to try checkpointing again."""
    run_dir = tmp_path / "counted"
    args = ("--model", "llama", "--batch", "4", "--steps", "1", "--limit-mib", "80")
    done = supervised(run_dir, *args)
    assert done.returncode == 3, done.stderr[-4000:]
    assert not [e for e in events(run_dir) if e["event"] == "restart"]
    ooms = [e for r in (0, 1) for e in events(run_dir, r) if e["event"] == "oom"]
    assert ooms and all(o["phase"] == "plan" and o["micro_batch_size"] == 1 for o in ooms)
    assert all(o["activation_checkpointing"] is True for o in ooms), ooms
    (end,) = [e for e in events(run_dir) if e["event"] == "supervisor_end"]
    assert end["exit_code"] == 3 and end["in_force"] == ["activation_checkpointing"], end


def test_out_of_memory_at_micro_batch_1_on_a_rank_climbs_the_ladder_then_exit_3_naming_gpus(
    tmp_path: Path,
):
    """Capped 20 MiB above their size, the ranks cannot run one sample: attempt 1 runs out in
    the plan's trial pass at micro-batch 1 (exit 76, named), attempt 2 starts with activation
    checkpointing on (recorded by every rank) and runs out too; with no saver left the
    supervisor stops with exit 3 and says what would help, in GPUs."""
    run_dir = tmp_path / "ladder"
    done = supervised(run_dir, "--limit-mib", "20", "--steps", "2")
    assert done.returncode == 3, done.stderr[-4000:]
    restarts = [e for e in events(run_dir) if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["memory_savers"] == 1, restarts
    (escalation,) = [e for e in events(run_dir) if e["event"] == "memory_escalation"]
    assert escalation["saver"] == "activation_checkpointing"
    ooms = []
    for rank in (0, 1):
        records = events(run_dir, rank)
        turned = [e for e in records if e["event"] == "memory_saver"]
        assert [e["saver"] for e in turned] == ["activation_checkpointing"], turned
        ooms += [e for e in records if e["event"] == "oom"]
    assert ooms and all(o["phase"] == "plan" and o["micro_batch_size"] == 1 for o in ooms), ooms
    (end,) = [e for e in events(run_dir) if e["event"] == "supervisor_end"]
    assert end["exit_code"] == 3 and end["in_force"] == ["activation_checkpointing"], end
    assert "in the plan's trial pass at micro-batch 1" in done.stderr
    assert "with no memory saver left" in done.stderr
    assert "more GPUs with distributed: fsdp (this run had 2" in done.stderr


def test_auto_under_ddp_each_rank_plans_its_share_and_the_ranks_agree(tmp_path: Path):
    """distributed: ddp under the same cap: each rank plans its own share (never more than it
    holds) and the ranks take the smallest size and every saver any of them chose; no
    out-of-memory."""
    run_dir = tmp_path / "ddp"
    done = torchrun(run_dir, "--distributed", "ddp", "--limit-mib", "200", "--steps", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    plans = [[e for e in events(run_dir, r) if e["event"] == "plan"] for r in (0, 1)]
    (plan_0,), (plan_1,) = plans
    for key in ("micro_batch_size", "activation_checkpointing", "chunked_loss"):
        assert plan_0[key] == plan_1[key], (plan_0, plan_1)
    assert 1 <= plan_0["micro_batch_size"] < WHOLE_SHARE
    for plan in (plan_0, plan_1):  # no candidate above the 8 samples a rank holds
        sizes = [c["micro"] for c in plan["candidates"]]
        assert sizes and max(sizes) <= WHOLE_SHARE, plan["candidates"]
    assert any("agreed on the smallest micro-batch" in r for r in plan_0["reasons"])
    for rank in (0, 1):
        assert "oom" not in [e["event"] for e in events(run_dir, rank)]


@pytest.mark.slow
def test_auto_under_fsdp_takes_the_whole_share_where_it_fits(tmp_path: Path):
    """Without a cap the whole share fits: the lockstep plan takes it after one pass."""
    run_dir = tmp_path / "free"
    done = torchrun(run_dir, "--steps", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    (plan,) = [e for e in events(run_dir) if e["event"] == "plan"]
    assert plan["micro_batch_size"] == WHOLE_SHARE, plan


@pytest.mark.parametrize(
    ("setting", "first"),
    [
        ("fsdp", "more GPUs with distributed: fsdp (this run had 2;"),
        ("ddp", "distributed: fsdp instead of ddp (each of the 2 ranks"),
        ("replicate", "distributed: fsdp instead of ddp (each of the 2 ranks"),
        ("auto", "distributed: fsdp instead of ddp (each of the 2 ranks"),
    ],
)
def test_the_group_s_advice_names_gpus_by_its_distributed_setting(tmp_path, setting, first):
    from steadytrain.supervisor.words import group_advice

    (tmp_path / "config.json").write_text(json.dumps({"distributed": setting}))
    advice = group_advice(tmp_path, 2)
    assert advice.startswith(first), advice
    assert ("4 GPUs" in advice) and (("then" in advice) == (setting in ("ddp", "replicate")))
