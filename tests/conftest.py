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


# Repeats moved to `make test-all` to keep `make test` under 10 minutes on CI's 2 cores. Each is a
# second real test of a fault or an integration that keeps one in `make test`; the value names
# that one. Measured with STEADYTRAIN_TEST_CPU (bench/test_cpu.py): they cost about 1,000 of
# the suite's 2,150 CPU seconds (measured under load; what stays, idle: about 950). A name here
# that matches no test is an error, so a rename cannot quietly bring a repeat back.
REPEATS = {
    "test_kill_storm.py::test_kill_storm_finishes_with_the_uninterrupted_result[6-kills]": (
        "SIGKILL mid-run: test_resume.py, test_distributed.py's killed rank, the ports"
    ),
    "test_integrations_lightning.py::test_oom_restarts_at_half_the_batch_and_matches_a_clean_run": (
        "Lightning: its SIGTERM mid-epoch test; out-of-memory: test_engine_oom.py"
    ),
    "test_integrations_hf.py::test_sigkill_resumes_from_a_verified_checkpoint_to_the_same_parameters": (
        "Hugging Face: its out-of-memory test; SIGKILL: test_resume.py"
    ),
    "test_ports.py::test_the_port_survives_a_real_out_of_memory_and_two_sigkills[plateau_regression]": (
        "the ports' bit-exact runs; out-of-memory and kills: test_engine_oom.py, test_resume.py"
    ),
    "test_seed_night.py::test_the_seed_night_under_run_without_run_dir_resumes_bitwise": (
        "the seed night's other tests; a supervised resume: test_watchdog.py, test_report.py"
    ),
    "test_seed_night.py::test_resume_goes_on_when_the_effective_batch_is_kept_and_names_the_field_when_not": (
        "a refused resume: test_resume.py"
    ),
    "test_families.py::test_the_gpu_bench_runs_in_smoke_mode": "the families' estimate tests",
    "test_offload.py::test_the_gpu_bench_times_both_ways_of_copying_in_one_call": (
        "offload's own tests"
    ),
    "test_offload.py::test_the_gpu_bench_runs_in_smoke_mode": "offload's own tests",
    "test_bench_overhead.py::test_the_overhead_bench_runs_every_arm_it_compares_in_smoke_mode": (
        "test_bench_overhead.py's other tests"
    ),
    "test_integrations_own_loop.py::test_a_blocked_step_exits_75_and_the_restart_finishes": (
        "RunGuard: its out-of-memory test; a blocked step: test_watchdog.py"
    ),
    "test_engine_oom.py::test_surviving_leaves_no_growing_memory[300]": (
        "test_engine_oom.py's real out-of-memory test"
    ),
    "test_ported_programs_more.py::test_a_vision_loop_with_an_ema_killed_under_steadytrain_run_ends_as_the_uninterrupted_run": (
        "a killed port: test_ported_programs.py"
    ),
    "test_ported_programs_third.py::test_the_siamese_network_over_a_concat_of_subsets_killed_under_run_ends_as_run_through": (
        "a killed port: test_ported_programs.py"
    ),
    "test_after_finetune.py::test_evaluate_survives_a_real_out_of_memory": (
        "test_eval_out_of_memory_halves_the_batch_and_gives_the_same_loss"
    ),
    "test_signal_seams.py::test_a_child_that_ends_0_after_its_run_failed_is_restarted_as_that_failure": (
        "test_a_child_that_ends_0_after_its_run_was_stopped_is_a_stop_not_a_finish"
    ),
    "test_resume_seams.py::test_sigterm_ends_a_plain_script_with_143_before_its_final_save": (
        "SIGTERM: test_stop_workers.py"
    ),
    "test_edges.py::test_a_read_that_blocks_before_the_first_step_is_a_hang_named_by_its_phase": (
        "test_a_hang_before_fit_in_a_new_run_dir_is_caught_from_the_process_start"
    ),
    "test_seed_users.py::test_a_keras_fit_started_again_says_where_it_resumes": (
        "Keras: test_integrations_keras.py"
    ),
    "test_seed_users.py::test_the_ladders_lora_rank_on_a_finished_run_is_refused_as_a_finished_run": (
        "a finished run: test_resume.py"
    ),
    "test_start_kill.py::test_a_run_that_loads_once_savers_are_on_trains_to_the_end": (
        "test_killed_while_loading_every_time_turns_on_each_saver_then_exits_3"
    ),
    "test_plan.py::test_plan_command_plans_for_compiled_layers_when_asked": (
        "test_estimate_compiled.py; the plan command: test_plan_output.py"
    ),
    "test_fused_projections.py::test_each_lora_term_is_added_inside_its_frozen_product[True]": (
        "the same test's [False]"
    ),
    "test_resume_seams.py::test_an_lstm_killed_right_after_an_epoch_end_save_finishes_as_the_uninterrupted_run": (
        "test_the_loss_check_is_made_after_an_epoch_end_save_of_a_shuffling_dataloader"
    ),
    "test_supervisor.py::test_a_runguard_loop_killed_three_times_after_newer_checkpoints_finishes": (
        "RunGuard: test_integrations_own_loop.py; kills: test_resume.py"
    ),
    "test_watchdog.py::test_report_mode_goes_on_records_one_hang_and_a_slow_save_is_no_hang": (
        "test_supervised_hang_restarts_resumes_and_finishes"
    ),
    "test_stop_workers.py::test_sighup_after_the_terminal_closed_saves_the_step_and_exits_129[pty]": (
        "the same test's [pipe]"
    ),
    "test_user_errors.py::test_supervised_script_exits_5_and_is_not_restarted_when_the_error_repeats": (
        "test_user_errors.py's exit-5 tests; not restarted: test_signal_seams.py"
    ),
    "test_own_programs.py::test_under_a_cap_with_no_room_for_a_second_copy_saves_are_written_without_a_shrink": (
        "saves under a cap: test_checkpoint_store.py"
    ),
    "test_edges.py::test_the_supervisor_does_not_restart_a_run_stopped_by_a_full_disk": (
        "test_disk_full_while_training_stops_with_exit_6_and_keeps_the_last_checkpoint"
    ),
    "test_env_faults.py::test_a_stop_recorded_after_the_clock_stepped_back_is_still_a_stop": (
        "test_signal_seams.py's stop-not-finish test"
    ),
    "test_supervisor_env.py::test_the_hugging_face_callback_reads_the_cap_as_the_trainer_does[4]": (
        "the same test's [abc]"
    ),
    "test_supervisor_env.py::test_the_hugging_face_callback_reads_the_cap_as_the_trainer_does[-1]": (
        "the same test's [abc]"
    ),
    "test_supervisor_env.py::test_the_hugging_face_callback_reads_the_cap_as_the_trainer_does[0]": (
        "the same test's [abc]"
    ),
    "test_planned_ranks.py::test_auto_under_ddp_each_rank_plans_its_share_and_the_ranks_agree": (
        "test_auto_under_fsdp_is_priced_per_rank_and_checkpoints_before_trying_plain; the ranks' "
        "agreement: test_distributed.py"
    ),
    "test_planned_ranks.py::test_auto_under_fsdp_plans_in_lockstep_and_starts_without_an_out_of_memory": (
        "test_auto_under_fsdp_is_priced_per_rank_and_checkpoints_before_trying_plain (its trial "
        "passes run in lockstep, under steadytrain run, and start without an out-of-memory)"
    ),
    "test_fresh_process_oom.py::test_a_resnet_that_shrank_to_1_and_still_fails_is_restarted_fresh_and_finishes": (
        "test_a_supervised_process_that_shrank_then_fails_at_1_hands_over_exit_76; a real CPU "
        "out-of-memory: test_engine_oom.py"
    ),
    "test_compile.py::test_a_compiled_layer_keeps_what_its_matrix_multiplies_made_and_recomputes_the_rest": (
        "test_a_compiled_run_resumes_to_the_bit"
    ),
    "test_fused_projections.py::test_compiled_fused_layers_trace_as_one_graph_and_train_the_same": (
        "test_compile.py's compiled run; the fused layers: the same file's [False]"
    ),
    "test_planned_ranks.py::test_out_of_memory_at_micro_batch_1_on_a_rank_climbs_the_ladder_then_exit_3_naming_gpus": (
        "test_supervisor.py's ranks that exit 76 or are killed at micro-batch 1"
    ),
    "test_compile.py::test_a_compiled_run_resumes_to_the_bit": (
        "test_a_model_without_named_blocks_is_compiled_whole; a bitwise resume: test_resume.py"
    ),
    "test_user_programs.py::test_ctrl_c_before_the_first_step_exits_130_without_a_traceback": (
        "test_signal_seams.py's Ctrl-C while auto plans (before the loop)"
    ),
    "test_estimate_compiled.py::test_a_run_that_does_not_fit_is_told_of_compile_and_offload": (
        "test_advice.py's does-not-fit advice"
    ),
    "test_report.py::test_report_renders_in_a_headless_browser": (
        "test_the_first_hour_page_in_a_headless_browser"
    ),
    "test_integrations_keras.py::test_sigkill_with_dropout_resumes_to_the_same_weights_bit_for_bit": (
        "Keras: test_sigterm_mid_epoch_saves_exits_143_and_the_next_start_is_the_uninterrupted_run"
    ),
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark `REPEATS` slow before `-m 'not slow'` deselects."""
    found = set()
    for item in items:
        name = item.nodeid.split("tests/", 1)[-1]
        if name in REPEATS:
            item.add_marker(pytest.mark.slow)
            found.add(name)
    files = {item.nodeid.split("::")[0].split("tests/", 1)[-1] for item in items}
    missing = [n for n in REPEATS if n.split("::")[0] in files and n not in found]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py REPEATS names no test: {missing}")
    _skip_gpu_tests(items)


def pytest_unconfigure(config):
    """The run's fork servers (tests/forkserver.py) are shared by its workers: their folder goes
    when the run ends, in the process that runs the session (not in a worker)."""
    if not hasattr(config, "workerinput"):
        forkserver.remove_shared_folder()


def _skip_gpu_tests(items) -> None:
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
