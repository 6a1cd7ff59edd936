"""The file system as users leave it, around what steadytrain writes: an export's final swap
killed half-way, places that are read-only or full, links planted where a writer goes. Each
case ends with every earlier file whole, nothing written outside the run directory, and the
documented exit code with a message naming the path."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import forkserver

from steadytrain import _durable, run_files
from steadytrain.recipes.finetune import TRAINING_CONFIG, export_final
from steadytrain.recipes.finetune_config import FinetuneConfig

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
