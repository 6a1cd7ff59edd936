"""The file system as users leave it, around what steadytrain writes: an export's final swap
killed half-way, places that are read-only or full, links planted where a writer goes. Each
case ends with every earlier file whole, nothing written outside the run directory, and the
documented exit code with a message naming the path."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import forkserver
import pytest
import torch
from disks import fill, mount_or_skip, tmpfs
from script_helpers import Data, loss_fn

from steadytrain import TrainConfig, Trainer
from steadytrain.checkpoint.store import CheckpointStore
from steadytrain.cli import main as cli_main
from steadytrain.errors import BadInputError, RunNotWritableError
from steadytrain.recipes.finetune import TRAINING_CONFIG, export_final
from steadytrain.recipes.finetune_config import FinetuneConfig
from steadytrain.run import durable as _durable
from steadytrain.run import files as run_files

EXPORTED = sorted(["adapter_model.safetensors", "tokenizer.json", TRAINING_CONFIG])


class Saves:
    """Stands for the adapter model or the tokenizer: `save_pretrained` writes one file whose
    bytes say which export wrote it."""

    def __init__(self, name: str, tag: str):
        self.name, self.tag = name, tag

    def save_pretrained(self, folder, **_):
        (Path(folder) / self.name).write_text(self.tag)


def export(run_dir: Path, tag: str) -> Path:
    config = FinetuneConfig.from_dict(
        {"model_name_or_path": "tiny", "train_file": "t.jsonl", "output_dir": str(run_dir)}
    )
    model, tokenizer = Saves("adapter_model.safetensors", tag), Saves("tokenizer.json", tag)
    return export_final(model, tokenizer, config, run_dir)


def export_tag(final: Path) -> str:
    """The one export `final` holds whole (its files all from it), else an AssertionError."""
    assert sorted(os.listdir(final)) == EXPORTED
    tags = {(final / name).read_text() for name in ("adapter_model.safetensors", "tokenizer.json")}
    assert len(tags) == 1, f"{final} mixes two exports: {tags}"
    assert json.loads((final / TRAINING_CONFIG).read_text())["output_dir"] == str(final.parent)
    return tags.pop()


EXPORT_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_fs_seams import export
export(Path(sys.argv[1]), sys.argv[2])
print("survived")
"""


def test_an_export_killed_inside_its_swap_leaves_a_whole_final_folder(tmp_path):
    """SIGKILL inside the swap of final/ (the old export out, the new one in): final/ is there
    and whole at once, never missing until the next export; the next export removes what the
    killed one left beside it."""
    run_dir = tmp_path / "run"
    export(run_dir, "first")
    script = tmp_path / "child.py"
    script.write_text(EXPORT_CHILD.format(tests=str(Path(__file__).parent)))

    done = forkserver.run(
        [sys.executable, str(script), str(run_dir), "second"],
        env={**os.environ, "STEADYTRAIN_FAULT_INJECT": "replace-dir"},
        timeout=120,
    )

    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "survived" not in done.stdout
    final = run_dir / run_files.FINAL
    assert final.is_dir(), sorted(os.listdir(run_dir))
    assert export_tag(final) == "second"  # swapped in one step: the new export is in place
    export(run_dir, "third")
    assert export_tag(final) == "third"
    assert sorted(os.listdir(run_dir)) == [run_files.FINAL]


def test_where_the_file_system_cannot_swap_the_export_moves_the_old_one_aside(
    tmp_path, monkeypatch
):
    """The fallback (a file system or system without an exchanging rename): two renames, the
    old export deleted only after the new one is in place."""
    monkeypatch.setattr(_durable, "_swap", lambda a, b: False)
    run_dir = tmp_path / "run"
    export(run_dir, "first")
    export(run_dir, "second")
    assert export_tag(run_dir / run_files.FINAL) == "second"
    assert sorted(os.listdir(run_dir)) == [run_files.FINAL]


def test_a_link_planted_where_the_fallback_sets_the_old_export_aside_is_not_followed(
    tmp_path, monkeypatch
):
    """Without the one-step swap, the old final/ goes to .final.old-PID first: a link planted
    under that name (to a folder outside the run) is removed as a link, its folder untouched,
    and the export goes on (not an OSError with a traceback)."""
    monkeypatch.setattr(_durable, "_swap", lambda a, b: False)
    run_dir = tmp_path / "run"
    export(run_dir, "first")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep")
    (run_dir / f".{run_files.FINAL}.old-{os.getpid()}").symlink_to(outside, True)

    export(run_dir, "second")

    assert export_tag(run_dir / run_files.FINAL) == "second"
    assert sorted(os.listdir(run_dir)) == [run_files.FINAL]
    assert os.listdir(outside) == ["precious"]
    assert (outside / "precious").read_bytes() == b"keep"


# -- read-only places --------------------------------------------------------------------------


@contextlib.contextmanager
def read_only_later(folder: Path) -> Iterator[Callable[[], None]]:
    """A function that makes `folder` read-only from then on (a read-only bind mount over
    itself: new opens there fail with EROFS, as on a disk remounted read-only); unmounted after."""
    done = []

    def now() -> None:
        mount_or_skip("--bind", str(folder), str(folder))
        done.append(folder)
        mount_or_skip("-o", "remount,bind,ro", str(folder))

    try:
        yield now
    finally:
        for point in done:
            subprocess.run(["umount", str(point)], check=False, timeout=20)


def fit(run_dir: Path, max_steps: int, hook=None):
    """A short run; `hook(model)` is called in each loss until it returns True."""

    def loss(model, batch):
        model.calls += 1
        if hook is not None and not model.hooked:
            model.hooked = hook(model)
        return loss_fn(model, batch)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model.calls, model.hooked = 0, False
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=4,
        micro_batch_size=4,
        max_steps=max_steps,
        save_every_steps=2,
        device="cpu",
        log_every_steps=100,
    )
    return Trainer(model, lambda p: torch.optim.SGD(p, lr=1e-3), loss, Data(), config).fit()


def test_a_run_directory_made_read_only_mid_run_is_exit_2_keeping_the_last_checkpoint(tmp_path):
    """The disk under the run turns read-only once step 2 is committed (as after an I/O
    error): the next save fails, and the run stops with exit 2 naming the folder and the
    checkpoint kept (not an OSError, exit 1 as a bug); started again while read-only it is exit 2
    at the lock, changing nothing; once writable again the same run resumes and finishes."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with read_only_later(run_dir) as make_read_only:

        def once_a_checkpoint_is_committed(model) -> bool:
            if model.calls >= 3 and CheckpointStore(run_dir).committed():  # step 2's, async
                make_read_only()
                return True
            return False

        with pytest.raises(RunNotWritableError) as info:
            fit(run_dir, max_steps=8, hook=once_a_checkpoint_is_committed)
        message = str(info.value)
        before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        with pytest.raises(BadInputError) as again:  # started again while still read-only
            fit(run_dir, max_steps=8)
        assert again.value.exit_code == 2
        assert f"run_dir {run_dir}: cannot write .lock there (Read-only file system)" in str(
            again.value
        )
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert info.value.exit_code == 2
    assert f"cannot write {run_dir / 'checkpoints'} (Read-only file system)" in message
    assert "step-00000002 (step 2), the last committed one, stays the latest" in message
    assert "remount it read-write" in message
    store = CheckpointStore(run_dir)
    assert [step for step, _ in store.committed()] == [2]
    assert leftovers(run_dir) == []

    assert fit(run_dir, max_steps=8).steps == 8  # writable again: it resumes from step 2


def leftovers(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def test_an_export_into_a_read_only_output_dir_is_exit_2_keeping_the_earlier_one(tmp_path):
    """output_dir turned read-only before the export (the fine-tune's own files were written):
    exit 2 naming the folder that could not be made there, not an OSError with a traceback;
    the earlier export stays whole in final/."""
    run_dir = tmp_path / "run"
    export(run_dir, "first")
    with read_only_later(run_dir) as make_read_only:
        make_read_only()
        with pytest.raises(RunNotWritableError) as info:
            export(run_dir, "second")
        assert info.value.exit_code == 2
        assert f"cannot write {run_dir}/.final.staging-" in str(info.value)
        assert "(Read-only file system)" in str(info.value)
        assert export_tag(run_dir / run_files.FINAL) == "first"
        assert sorted(os.listdir(run_dir)) == [run_files.FINAL]


# -- full disks --------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    with tmpfs(tmp_path / "tiny", "2m") as point:
        yield point


def test_a_report_on_a_full_disk_is_exit_6_keeping_the_page_before_and_offering_out(
    tiny_disk, capsys
):
    """The disk holding the run fills between two reports: `steadytrain report` exits 6 naming
    the file and says how to write the page elsewhere (not that "the run resumes", which a
    report has nothing to do with); the page and plots written before keep their bytes and no
    temporary is left beside them."""
    pytest.importorskip("matplotlib", reason="the report draws with matplotlib")
    run_dir = tiny_disk / "run"
    fit(run_dir, max_steps=2)
    assert cli(capsys, "report", str(run_dir))[0] == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    fill(tiny_disk / "filler")

    code, err = cli(capsys, "report", str(run_dir))

    assert code == 6, err
    assert f"disk full: could not write {run_dir / 'report'}" in err
    assert "steadytrain report RUN_DIR --out DIR" in err
    assert "resumes" not in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def cli(capsys, *args: str) -> tuple[int, str]:
    """`steadytrain ARGS` in this process; (exit code, stderr)."""
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    return info.value.code, capsys.readouterr().err


ADAPTER_CHILD = """
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from steadytrain.recipes.data import byte_tokenizer

root = Path(sys.argv[1])
tokenizer = byte_tokenizer()
torch.manual_seed(0)
base = LlamaForCausalLM(LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
))
base.save_pretrained(root / "base")
tokenizer.save_pretrained(root / "base")
lora = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
get_peft_model(base, lora).save_pretrained(root / "adapter")
tokenizer.save_pretrained(root / "adapter")
"""


def test_a_merge_that_fills_the_disk_is_exit_6_keeping_the_merge_before(tiny_disk, tmp_path):
    """`steadytrain merge --force` over an earlier merge, on a disk that fills while it writes
    the weights (safetensors says so in its own error, not an OSError): exit 6 naming the file
    and the space left, no traceback; the earlier merge keeps its bytes, no staging is left.
    The first merge removes what merges killed mid-way had left beside --out."""
    script = tmp_path / "adapter.py"
    script.write_text(ADAPTER_CHILD)
    made = forkserver.run([sys.executable, str(script), str(tmp_path)], timeout=120)
    assert made.returncode == 0, made.stderr
    out = tiny_disk / "merged"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    for left in (f".merged.staging-{gone.pid}", f".merged.old-{gone.pid}"):
        (tiny_disk / left).mkdir()  # what merges killed mid-way left: a whole model each
        (tiny_disk / left / "model.safetensors").write_bytes(b"left")
    merge = [sys.executable, "-m", "steadytrain.cli", "merge", str(tmp_path / "adapter")]
    merge += ["--base", str(tmp_path / "base"), "--out", str(out)]
    assert forkserver.run(merge, timeout=120).returncode == 0
    assert sorted(os.listdir(tiny_disk)) == ["merged"]  # the leftovers removed
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert before["model.safetensors"]
    filler = tiny_disk / "filler"
    fill(filler)
    os.truncate(filler, filler.stat().st_size - 64 * 1024)  # room for a file, not the weights

    done = forkserver.run([*merge, "--force"], timeout=120)

    assert done.returncode == 6, done.stderr
    assert f"disk full: could not write {out / 'model.safetensors'}" in done.stderr
    assert "free on that filesystem" in done.stderr and "--out DIR" in done.stderr
    assert "Traceback" not in done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tiny_disk)) == ["filler", "merged"]
