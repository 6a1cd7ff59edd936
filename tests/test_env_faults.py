"""Faults planted in the environment around a run, with real processes: the wall clock stepped
back mid-attempt (an NTP correction, a laptop's clock set right after waking); the files a
user's system leaves in the run directory (macOS's AppleDouble `._NAME` and `.DS_Store`); a low
limit on open files (`ulimit -n`).
"""

from __future__ import annotations

import io
import os
import sys

import forkserver
import pytest
import torch
from test_signal_seams import FAST, SWALLOWS_STOPPED

from steadytrain import TrainConfig, Trainer
from steadytrain.supervisor import Supervisor, SupervisorOptions
from steadytrain.telemetry.files import read_jsonl

# Loaded by the child's Python at start-up (a sitecustomize module on PYTHONPATH): its wall clock
# reads an hour earlier than the supervisor's, as after an NTP step back once the attempt began.
CLOCK_STEPPED_BACK = """
import time
_wall = time.time
time.time = lambda: _wall() - 3600.0
"""


def _child_environ(tmp_path, sitecustomize: str) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(sitecustomize)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    return environ


def test_a_stop_recorded_after_the_clock_stepped_back_is_still_a_stop(tmp_path):
    """The child caught `steadytrain.Stopped` at step 2 of 6 and exited 0, its clock an hour
    behind the attempt's start. The supervisor tells the attempt's fit_end by its place in
    events.jsonl, not its time: exit 143 as with a steady clock, not 0 ("finished")."""
    script = tmp_path / "train.py"
    script.write_text(SWALLOWS_STOPPED)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    supervisor = Supervisor(
        [sys.executable, str(script), str(run_dir)],
        SupervisorOptions(run_dir=run_dir, **FAST),
        environ=_child_environ(tmp_path, CLOCK_STEPPED_BACK),
        out=out,
        oom_kill_count=lambda: None,
    )
    assert supervisor.run() == 143, out.getvalue()
    said = out.getvalue()
    assert "starting attempt 2" not in said
    assert "child exited 0, but its run was stopped by SIGTERM at step 2" in said
    events = read_jsonl(run_dir / "events.jsonl")
    fit_end = next(e for e in events if e["event"] == "fit_end")
    assert fit_end["time"] < events[-1]["time"] - 3000  # the child's clock was behind
    assert (events[-1]["event"], events[-1]["exit_code"]) == ("supervisor_end", 143)


# -- files the user's system leaves in the run directory --------------------------------------


def _fit(run_dir, max_steps: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    )
    config = TrainConfig(
        run_dir=run_dir,
        effective_batch_size=8,
        micro_batch_size=8,
        max_steps=max_steps,
        save_every_steps=1,
        keep_last=2,
        device="cpu",
        progress="off",
        memory_watch=False,
    )
    return Trainer(
        torch.nn.Linear(4, 2),
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        data,
        config,
    ).fit()


def test_a_run_dir_copied_through_a_mac_drive_resumes_from_its_newest_checkpoint(tmp_path):
    """Finder copying a run directory onto an exFAT drive leaves an AppleDouble `._NAME` beside
    every file, and `.DS_Store` where it showed a folder. The newest checkpoint still verifies
    (they are not its files), the run resumes from it, and retention deletes none of them
    outside the checkpoints it removes."""
    run_dir = tmp_path / "run"
    _fit(run_dir, 3)
    checkpoints = run_dir / "checkpoints"
    planted = []
    for folder in [run_dir, checkpoints, *checkpoints.glob("step-*")]:
        for name in [*(f"._{p.name}" for p in folder.iterdir()), ".DS_Store"]:
            (folder / name).write_bytes(b"\x00\x05\x16\x07")
            planted.append(folder / name)

    result = _fit(run_dir, 6)

    assert (result.steps, result.exit_code) == (6, 0)
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [3]
    assert not [e for e in events if e["event"] == "checkpoint_skipped"]
    outside = [p for p in planted if not p.parent.name.startswith("step-")]
    assert all(p.read_bytes() == b"\x00\x05\x16\x07" for p in outside)
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000005", "step-00000006"]


# -- a low limit on open files ----------------------------------------------------------------

# `ulimit -n` set low in the shell that starts the run, here by the script itself once torch is
# imported: a few descriptors more than it holds, too few for two DataLoader workers.
LOW_OPEN_FILES = r"""
import os, resource, sys, torch
import steadytrain
from steadytrain import TrainConfig, Trainer

@steadytrain.entrypoint
def main():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    config = TrainConfig(run_dir=sys.argv[1], effective_batch_size=8, micro_batch_size=8,
                         max_steps=4, num_workers=2, device="cpu", progress="off")
    trainer = Trainer(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1),
                      lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), data, config)
    held = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return trainer.fit()

main()
"""


def test_too_few_open_files_for_the_loader_workers_is_exit_2_naming_the_limit(tmp_path):
    """Python's EMFILE where a worker's pipe cannot be made (or torch's "Too many open files"
    where a batch cannot be passed over) is the limit the shell set, not a bug (exit 1 with a
    traceback before): exit 2 naming `ulimit -n` and its value, and the two ways out."""
    script = tmp_path / "train.py"
    script.write_text(LOW_OPEN_FILES)
    done = forkserver.run([sys.executable, str(script), str(tmp_path / "run")], timeout=120)
    assert done.returncode == 2, done.stderr
    assert "too many open files: this process may hold" in done.stderr
    assert "(`ulimit -n` " in done.stderr and "`ulimit -n 4096`" in done.stderr
    assert "lower num_workers (now 2)" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_merge_into_a_folder_finder_has_shown_is_not_refused_as_non_empty(tmp_path):
    """`--out` made empty in Finder holds a `.DS_Store` (and `._NAME` files on a network drive):
    it is still an empty folder, so `steadytrain merge` writes there without --force (before:
    "exists and is not empty"). A file of the user's still needs --force (test_after_finetune)."""
    from peft import LoraConfig, get_peft_model
    from tiny_models import save_byte_llama
    from transformers import LlamaForCausalLM

    from steadytrain.recipes.merge import merge

    base = save_byte_llama(tmp_path / "base")
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    get_peft_model(LlamaForCausalLM.from_pretrained(base), lora).save_pretrained(
        tmp_path / "adapter"
    )
    out = tmp_path / "merged"
    out.mkdir()
    for name in (".DS_Store", "._.DS_Store"):
        (out / name).write_bytes(b"\x00\x05\x16\x07")

    result = merge(tmp_path / "adapter", out)

    assert result.out_dir == out and "model.safetensors" in result.files
    assert (out / "model.safetensors").is_file()


def test_a_demo_folder_finder_has_shown_counts_as_empty(tmp_path):
    """`steadytrain demo DIR` into a folder that holds only what Finder leaves: taken as new, not
    refused as "exists and is not empty" (with --force then refused as not the demo's)."""
    from steadytrain.errors import BadInputError
    from steadytrain.recipes.demo import check_run_dir

    shown = tmp_path / "demo"
    shown.mkdir()
    (shown / ".DS_Store").write_bytes(b"\x00\x05\x16\x07")
    assert check_run_dir(shown, force=False) is False
    (shown / "notes.txt").write_text("mine")
    with pytest.raises(BadInputError, match="exists and is not empty"):
        check_run_dir(shown, force=False)
    assert (shown / ".DS_Store").read_bytes() == b"\x00\x05\x16\x07"


def test_an_integrations_checkpoint_explorer_has_shown_still_verifies(tmp_path):
    """A library's checkpoint folder (hashed by `RunGuard.checkpoint_saved`) that Windows
    Explorer showed holds `Thumbs.db` / `desktop.ini`: still the checkpoint to resume from
    (before: refused as extra files, and the run started over)."""
    from steadytrain.integrations import RunGuard

    run_dir = tmp_path / "run"
    with RunGuard(run_dir, config={}, memory_watch=False) as guard:
        saved = run_dir / "checkpoints" / "checkpoint-4"
        saved.mkdir(parents=True)
        (saved / "model.safetensors").write_bytes(b"weights")
        guard.checkpoint_saved(saved, 4)
        for name in ("Thumbs.db", "desktop.ini", ".DS_Store", "._model.safetensors"):
            (saved / name).write_bytes(b"\x00\x05\x16\x07")
        assert guard.newest_checkpoint() == saved
    events = read_jsonl(run_dir / "events.jsonl")
    assert not [e for e in events if e["event"] == "checkpoint_skipped"]
