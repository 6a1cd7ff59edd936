"""Nothing is written outside the run directory: a symbolic link planted at any path a run
writes (the file, or a folder on the way) is refused, never written through; the run stops with
exit 2 naming the link, and the link's target keeps its bytes.

The paths come from `run_files.WRITTEN`, the list the one writer (`steadytrain.run.durable`)
serves; `test_a_run_writes_only_the_listed_paths` fails when a run writes a path that list does
not name, so a new file is covered here as soon as it exists.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKLOADS
from script_helpers import Data

from steadytrain import TrainConfig, Trainer
from steadytrain.errors import BadInputError
from steadytrain.run import files as run_files
from steadytrain.run.durable import make_folder, open_in_run, write_atomic
from steadytrain.safety.lock import RunLock

SRC = Path(__file__).resolve().parents[1] / "src" / "steadytrain"
SECRET = b"outside the run: keep these bytes\n"


def concrete(pattern: str) -> str:
    """A path of `pattern` with each {...} filled in."""
    out, depth = "", 0
    for char in pattern:
        if char == "{":
            depth += 1
            out += "1" if depth == 1 else ""
        elif char == "}":
            depth -= 1
        elif depth == 0:
            out += char
    return out


def write_as_listed(run_dir: Path, relative: str, how: str) -> None:
    """Write `relative` the way `run_files.WRITTEN` says the run writes it."""
    path = run_dir / relative
    if how == "atomic":
        write_atomic(path, b"new bytes", root=run_dir)
    elif how in ("append", "new", "exclusive"):
        os.close(open_in_run(path, how, root=run_dir))
    elif how == "lock":
        RunLock(path.parent).acquire()
    elif how == "folder":
        make_folder(path, root=run_dir)
    else:
        raise AssertionError(f"run_files.WRITTEN: {relative}: no writer for {how!r}")


def plants():
    """(relative path, how, where the link goes): each listed path, each folder on its way,
    and the same inside rank 1's folder (ranks/ and ranks/rank-1 as links too)."""
    for pattern, how in run_files.WRITTEN:
        relative = concrete(pattern)
        for prefix in ("", f"{run_files.RANKS}/rank-1/"):
            if prefix and pattern.startswith(run_files.RANKS):
                continue
            full = prefix + relative
            parts = Path(full).parts
            for depth in range(1, len(parts) + 1):
                yield pytest.param(full, how, "/".join(parts[:depth]), id=f"{full}@{depth}")


@pytest.mark.parametrize("relative,how,link", list(plants()))
def test_a_link_planted_at_any_written_path_is_refused(tmp_path, relative, how, link):
    run_dir = tmp_path / "run"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(SECRET)
    planted = run_dir / link
    planted.parent.mkdir(parents=True, exist_ok=True)
    is_folder = link != relative
    target = outside if is_folder else outside / "precious"
    planted.symlink_to(target, target_is_directory=is_folder)
    before = sorted(p.name for p in outside.iterdir())

    with pytest.raises(BadInputError, match="symbolic link") as info:
        write_as_listed(run_dir, relative, how)

    assert info.value.exit_code == 2
    assert str(planted) in str(info.value)
    assert (outside / "precious").read_bytes() == SECRET
    assert sorted(p.name for p in outside.iterdir()) == before  # nothing made there


# -- real runs through the Trainer -----------------------------------------------------------


def fit(run_dir: Path, fail_at: int | None = None, **overrides):
    def loss_fn(model, batch):
        if fail_at is not None and model.calls == fail_at:
            raise ValueError("the user's loss failed on purpose")
        model.calls += 1
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model.calls = 0
    config = {
        "run_dir": str(run_dir),
        "effective_batch_size": 4,
        "micro_batch_size": 4,
        "max_steps": 4,
        "save_every_steps": 2,
        "device": "cpu",
        "log_every_steps": 100,
        **overrides,
    }
    return Trainer(
        model, lambda p: torch.optim.SGD(p, lr=1e-3), loss_fn, Data(), TrainConfig(**config)
    ).fit()


def listed_or_why(run_dir: Path) -> list[str]:
    return [
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if not run_files.listed(p.relative_to(run_dir))
    ]


def test_a_run_writes_only_the_listed_paths(tmp_path):
    """A run, a failed run (errors/) and its report write nothing that run_files.WRITTEN does
    not name: a new file must be listed, and so is planted above."""
    from steadytrain.telemetry.report import write_report

    run_dir = tmp_path / "run"
    fit(run_dir)
    with pytest.raises(Exception, match="failed on purpose"):
        fit(run_dir, fail_at=1, max_steps=8)
    assert any((run_dir / run_files.ERRORS).iterdir())
    pytest.importorskip("matplotlib", reason="the report draws with matplotlib")
    write_report(run_dir)
    assert listed_or_why(run_dir) == []


def planted_outside(tmp_path: Path, run_dir: Path, relative: str, folder: bool) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "precious").write_bytes(SECRET)
    link = run_dir / relative
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside if folder else outside / "precious", target_is_directory=folder)
    return link


def assert_untouched(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    assert (outside / "precious").read_bytes() == SECRET
    assert [p.name for p in outside.iterdir()] == ["precious"]


@pytest.mark.parametrize(
    "relative,folder",
    [
        (f"{run_files.HANGS}/backstop-{{pid}}.txt", False),  # this process's backstop
        (run_files.HANGS, True),
        (run_files.HEARTBEAT, False),  # would switch the supervisor's hang backstop off
    ],
)
def test_a_run_with_a_planted_watchdog_link_stops_with_exit_2(tmp_path, relative, folder):
    run_dir = tmp_path / "run"
    link = planted_outside(tmp_path, run_dir, relative.format(pid=os.getpid()), folder)
    with pytest.raises(BadInputError, match="symbolic link") as info:
        fit(run_dir)
    assert info.value.exit_code == 2 and str(link) in str(info.value)
    assert_untouched(tmp_path)


def test_a_failing_run_with_errors_planted_as_a_link_stops_with_exit_2(tmp_path):
    """The traceback of a failure is not written into the folder errors/ points at."""
    run_dir = tmp_path / "run"
    link = planted_outside(tmp_path, run_dir, run_files.ERRORS, True)
    with pytest.raises(BadInputError, match="symbolic link") as info:
        fit(run_dir, fail_at=1)
    assert info.value.exit_code == 2 and str(link) in str(info.value)
    assert_untouched(tmp_path)


def test_the_supervisor_stops_a_run_whose_hangs_folder_is_a_link(tmp_path):
    """Through the CLI: `steadytrain run` does not restart it, and exits 2 naming the link."""
    run_dir = tmp_path / "run"
    link = planted_outside(tmp_path, run_dir, run_files.HANGS, True)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "steadytrain.cli", "run", "--run-dir", str(run_dir)),
            *("--max-restarts", "2", "--backoff-initial", "0.01", "--"),
            *(sys.executable, str(WORKLOADS / "hang.py"), str(run_dir), "--block", "none"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    assert str(link) in done.stderr and "symbolic link" in done.stderr
    assert "Traceback" not in done.stderr
    assert_untouched(tmp_path)


# -- every write in src goes through the one writer -----------------------------------------

# Writes that are not a run directory's file, or have a writer of their own, with the reason.
ALLOWED = {
    "run/durable.py": "the writer itself",
    "_terminal.py": "os.devnull, where a stream whose terminal is gone writes",
    "device/system.py": "/proc/self/clear_refs",
    "device/selftest.py": "a temporary folder of its own",
    "checkpoint/store.py": "the checkpoint store: its own folder, checked, files made O_EXCL",
    "checkpoint/file_io.py": "the checkpoint store's files, made O_EXCL in its checked folder",
    "safety/lock.py": "the lock: O_NOFOLLOW, a hard link refused, its folder via make_folder",
    "checkpoint/state.py": "torch.save into the checkpoint store's sink",
    "config/__init__.py": "TrainConfig.dump: write_atomic into the file's own folder",
}


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("write_text", "write_bytes", "mkdir"):
            found.append((node.lineno, name))
        elif name == "open" and isinstance(func, ast.Name):
            modes = node.args[1:2] + [k.value for k in node.keywords if k.arg == "mode"]
            if any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in modes):
                found.append((node.lineno, "open for writing"))
        elif (
            name == "open"
            and isinstance(func, ast.Attribute)
            and getattr(func.value, "id", "") == "os"
        ):
            flags = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
            if any(f in flags for f in ("O_WRONLY", "O_RDWR", "O_CREAT")):
                found.append((node.lineno, "os.open for writing"))
        elif name in ("write_atomic", "open_for_append") and not any(
            k.arg == "root" for k in node.keywords
        ):  # make_folder and open_in_run require it
            found.append((node.lineno, f"{name} without root="))
    return found


def test_every_write_in_steadytrain_goes_through_the_one_writer():
    """A write of a file or folder (open for writing, write_text, mkdir, os.open) outside the
    writer is a place a planted link could be followed: each one left is named with its
    reason in ALLOWED."""
    stray = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if relative in ALLOWED:
            continue
        for line, what in _writes(ast.parse(path.read_text())):
            stray.append(f"{relative}:{line}: {what}")
    assert stray == []
