"""CheckpointStore against reliability-tests.md rows 1, 6a, 7-12, 20, 21: real files, and real
child processes wherever a process dies."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from disks import mount
from safetensors.torch import load_file

from steadytrain.checkpoint import file_io
from steadytrain.checkpoint.file_io import FAULT_ENV
from steadytrain.checkpoint.store import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    DiskFullError,
    Payload,
)
from steadytrain.errors import BadInputError

TESTS = Path(__file__).resolve().parent
FILES = ("model.safetensors", "optimizer.pt", "trainer_state.json")


# ------------------------------------------------------------------------------------- helpers


def make_payload(step: int, n: int = 4096) -> Payload:
    """A small checkpoint whose every byte depends on `step` (children import this too)."""
    gen = torch.Generator().manual_seed(step)
    return Payload(
        tensors={
            "model.safetensors": {
                "w": torch.randn(n, generator=gen),
                "b": torch.arange(step, step + 7, dtype=torch.int64),
                "h": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
            }
        },
        objects={
            "optimizer.pt": {
                "state": {
                    0: {
                        "step": torch.tensor(float(step)),
                        "exp_avg": torch.randn(64, generator=gen),
                    }
                },
                "param_groups": [{"lr": 0.1 / (step + 1), "params": [0]}],
            }
        },
        json={"trainer_state.json": {"step": step, "rng": [step, 7]}},
    )


def same(a, b) -> bool:
    """Bitwise equality of nested payload values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def same_payload(a: Payload, b: Payload) -> bool:
    return same(a.tensors, b.tensors) and same(a.objects, b.objects) and a.json == b.json


class Log:
    def __init__(self):
        self.records: list[tuple[str, dict]] = []

    def __call__(self, event: str, info: dict) -> None:
        self.records.append((event, info))

    def of(self, event: str) -> list[dict]:
        return [info for name, info in self.records if name == event]


def store_with_log(run_dir: Path, keep_last: int = 2) -> tuple[CheckpointStore, Log]:
    log = Log()
    return CheckpointStore(run_dir, keep_last=keep_last, log=log), log


def pointer(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def leftovers(run_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(run_dir / "checkpoints") if n.startswith("."))


def rewrite_manifest(folder: Path, **changes) -> None:
    """Make the manifest match the folder's files again (or change a field), as an attacker or
    a bug could."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"] = {
        f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "bytes": f.stat().st_size}
        for f in folder.iterdir()
        if f.name != MANIFEST
    }
    manifest.update(changes)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def run_child(code: str, *args: str, env: dict | None = None, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        **kwargs,
    )


CHILD_PRELUDE = f"""
import os, sys, time
sys.path.insert(0, {str(TESTS)!r})
from test_checkpoint_store import make_payload
from steadytrain.checkpoint import file_io
from steadytrain.checkpoint.store import CheckpointStore
"""


# ---------------------------------------------------------------------------------- round trip


def test_round_trip_is_bitwise_and_the_layout_is_the_documented_one(tmp_path):
    extra = {
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "half": torch.randn(4).half(),
        "f64": torch.randn(2, dtype=torch.float64),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
    }
    payload = make_payload(250)
    payload.tensors["model.safetensors"].update(extra)
    store = CheckpointStore(tmp_path, keep_last=2, fingerprint="abc123")

    folder = store.save(250, payload)

    assert folder == tmp_path / "checkpoints" / "step-00000250"
    assert sorted(os.listdir(folder)) == sorted([*FILES, MANIFEST])
    assert pointer(tmp_path) == "step-00000250"
    assert leftovers(tmp_path) == []
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 1
    assert manifest["step"] == 250 and manifest["fingerprint"] == "abc123"
    assert manifest["created"].endswith("+00:00")
    for name in FILES:
        data = (folder / name).read_bytes()
        assert manifest["files"][name] == {
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
        }
    # the tensors file is plain safetensors: the library reads it without us
    assert same(load_file(folder / "model.safetensors"), payload.tensors["model.safetensors"])
    assert store.latest() == (250, folder)
    assert store.committed() == [(250, folder)]
    assert same_payload(store.load(folder), payload)


def test_wide_steps_and_step_zero(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    for step in (0, 7, 123_456_789_012):
        store.save(step, make_payload(1, n=8))
    names = [p.name for _, p in store.committed()]
    assert names == ["step-00000000", "step-00000007", "step-123456789012"]
    assert store.latest()[0] == 123_456_789_012


def test_saving_a_committed_step_again_is_a_no_op(tmp_path):
    store, log = store_with_log(tmp_path)
    folder = store.save(5, make_payload(5))
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}

    again = store.save(5, make_payload(99))  # a resumed run saving the step it resumed from

    assert again == folder
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before
    assert log.of("checkpoint_exists") == [{"step": 5, "checkpoint": "step-00000005"}]
    assert leftovers(tmp_path) == []


def test_a_corrupt_folder_of_the_same_step_is_replaced_not_written_into(tmp_path):
    store, log = store_with_log(tmp_path)
    folder = store.save(5, make_payload(5))
    (folder / "optimizer.pt").write_bytes(b"garbage")

    store.save(5, make_payload(5))

    assert log.of("checkpoint_replaced")[0]["checkpoint"] == "step-00000005"
    assert store.latest() == (5, folder)
    assert same_payload(store.load(folder), make_payload(5))


def test_no_checkpoints_means_none(tmp_path):
    assert CheckpointStore(tmp_path).latest() is None
    (tmp_path / "checkpoints").mkdir()
    assert CheckpointStore(tmp_path).latest() is None
    assert CheckpointStore(tmp_path).committed() == []


def test_programming_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)
    store = CheckpointStore(tmp_path)
    for step in (-1, 1.5, True, 10**12):
        with pytest.raises(ValueError, match="step"):
            store.save(step, make_payload(1))
    for bad in (
        Payload(json={"../x.json": 1}),
        Payload(json={MANIFEST: 1}),
        Payload(objects={"state.json": 1}),
        Payload(tensors={"model.pt": {}}),
        Payload(tensors={"m.safetensors": {"__metadata__": torch.ones(1)}}),
        Payload(json={"a.json": 1}, objects={"a.json": 2}),
    ):
        with pytest.raises(ValueError):
            store.save(1, bad)
    on_meta = Payload(tensors={"m.safetensors": {"w": torch.empty(2, device="meta")}})
    with pytest.raises(ValueError, match="host memory"):
        store.save_async(1, on_meta)
    assert store.committed() == []


def test_an_unknown_fault_phase_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "mid-wrte")
    with pytest.raises(ValueError, match="mid-write"):
        CheckpointStore(tmp_path).save(1, make_payload(1))
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------ row 1: kill -9 at each phase

ROW1_CHILD = (
    CHILD_PRELUDE
    + """
run_dir, fault, mode = sys.argv[1:4]
store = CheckpointStore(run_dir, keep_last=1)
if mode == "from-start":
    os.environ["STEADYTRAIN_FAULT_INJECT"] = fault
store.save(1, make_payload(1))
os.environ["STEADYTRAIN_FAULT_INJECT"] = fault
store.save(2, make_payload(2))
print("survived")
"""
)

ROW1_CASES = {
    # fault spec, when it is armed, the step latest() must return afterwards
    "mid-write": ("mid-write", "between", 1),
    "before-manifest": ("before-manifest", "between", 1),
    "after-manifest": ("after-manifest", "between", 1),
    "after-publish": ("after-publish", "between", 2),
    "during-retention": ("during-retention", "between", 2),
    "before-manifest:2 armed from the start": ("before-manifest:2", "from-start", 1),
}


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    """Every row-1 child, started at once (they are independent; 2 cores do them in parallel)."""
    runs = {}
    for case, (fault, mode, _) in ROW1_CASES.items():
        run_dir = tmp_path_factory.mktemp("row1")
        runs[case] = (run_dir, run_child(ROW1_CHILD, run_dir, fault, mode))
    yield runs
    for _, proc in runs.values():
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("case", list(ROW1_CASES))
def test_kill_during_save_leaves_only_committed_checkpoints(case, killed_saves):
    run_dir, proc = killed_saves[case]
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, (out, err)
    _, _, expected = ROW1_CASES[case]
    root = run_dir / "checkpoints"
    left = leftovers(run_dir)
    # the pointer never names a partial checkpoint
    store, log = store_with_log(run_dir, keep_last=1)
    assert same_payload(
        store.load(root / pointer(run_dir)), make_payload(int(pointer(run_dir)[5:]))
    )

    if case.startswith("mid-write"):
        full = json.loads((root / "step-00000001" / MANIFEST).read_text())["files"]
        (staging,) = left
        assert staging.startswith(".staging-step-00000002-")
        assert os.listdir(root / staging) == ["model.safetensors"]
        half = full["model.safetensors"]["bytes"] // 2
        assert (root / staging / "model.safetensors").stat().st_size == half
    if case.startswith("after-manifest"):
        assert MANIFEST in os.listdir(root / left[0])  # complete, but never published

    assert store.latest()[0] == expected
    assert same_payload(store.load(store.latest()[1]), make_payload(expected))
    published = [1, 2] if case == "after-publish" else [expected]  # retention did not run
    assert [s for s, _ in store.committed()] == published  # a half-deleted one never counts
    assert leftovers(run_dir) == []
    removed = [Path(r["path"]).name for r in log.of("checkpoint_leftover_removed")]
    assert removed == left
    if case == "during-retention":
        assert left[0].startswith(".deleting-step-00000001-")
    if case == "after-publish":
        assert pointer(run_dir) == "step-00000001"
        assert log.of("checkpoint_pointer_ignored")[0]["using"] == "step-00000002"
    # and the run goes on
    store.save(3, make_payload(3))
    assert store.latest()[0] == 3 and pointer(run_dir) == "step-00000003"


STORM_CHILD = (
    CHILD_PRELUDE
    + """
import json, random, signal
from test_checkpoint_store import same_payload
run_dir, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
scratch = CheckpointStore(run_dir + "-timing")
start = time.perf_counter()
for step in range(3):
    scratch.save(step, make_payload(step, n=65536))
window = time.perf_counter() - start  # as long as three saves: kills land all over a save
report = {"trials": 0, "lost_commits": [], "mismatch": [], "leftovers": [], "steps": [], "seen": {}}
for trial in range(trials):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            store = CheckpointStore(run_dir, keep_last=2)
            found = store.latest()
            step = found[0] + 1 if found else 1
            os.write(w, b"go\\n")
            while True:
                if step % 2:
                    store.save_async(step, make_payload(step, n=65536))
                    store.wait()
                else:
                    store.save(step, make_payload(step, n=65536))
                os.write(w, f"{step}\\n".encode())
                step += 1
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 3) == b"go\\n"  # resumed: from here on it only saves
    time.sleep(rng.uniform(0.0, window))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    reported = b""
    while chunk := os.read(r, 4096):
        reported += chunk
    os.close(r)
    done = [int(s) for s in reported.split()]
    for name in os.listdir(os.path.join(run_dir, "checkpoints")):
        if name.startswith("."):
            kind = name[1:].split("-")[0]
            report["seen"][kind] = report["seen"].get(kind, 0) + 1
    store = CheckpointStore(run_dir, keep_last=2)
    found = store.latest()
    got = found[0] if found else None
    report["steps"].append(got)
    if done and (got is None or got < done[-1]):
        report["lost_commits"].append((trial, done[-1], got))
    if found and not same_payload(store.load(found[1]), make_payload(got, n=65536)):
        report["mismatch"].append(trial)
    left = [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith(".")]
    if left:
        report["leftovers"].append(left)
    report["trials"] += 1
print(json.dumps(report))
"""
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_random_kills_never_lose_a_commit_nor_publish_a_partial_checkpoint(tmp_path):
    """Row 1, random time: 50 SIGKILLs at random moments of a save loop (sync and async)."""
    proc = run_child(STORM_CHILD, tmp_path / "run", 50, 1234)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["trials"] == 50
    assert report["lost_commits"] == []  # every save that returned is found again
    assert report["mismatch"] == []  # what latest() returns is exactly what was saved
    assert report["leftovers"] == []  # latest() cleaned every killed save's leftovers
    # Progress: kills land within a window measured once at the start, so a busy machine commits
    # fewer saves per trial; what matters is that commits keep coming, and the lists above.
    assert report["steps"][-1] is not None and report["steps"][-1] > 2
    assert report["seen"].get("staging", 0) >= 1  # some kills did land in the middle of a save


# ------------------------------------------------------------------ row 6a: durability order


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fds")
def test_fsync_rename_order_is_the_durable_one(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(1, make_payload(1))
    root = tmp_path / "checkpoints"
    calls: list[tuple[str, ...]] = []

    def short(path) -> str:
        rel = os.path.relpath(path, root)
        first, *rest = rel.split(os.sep)
        for prefix in (".staging-", ".deleting-", ".latest-"):
            if first.startswith(prefix):
                first = prefix[1:-1]
        return os.path.join(first, *rest) if rest else first

    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        calls.append(("fsync", short(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def rename(src, dst):
        calls.append(("rename", short(src), short(dst)))
        real_rename(src, dst)

    def replace(src, dst):
        calls.append(("replace", short(src), short(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)

    store.save(2, make_payload(2))

    assert calls == [
        ("fsync", "staging/model.safetensors"),  # every file
        ("fsync", "staging/optimizer.pt"),
        ("fsync", "staging/trainer_state.json"),
        ("fsync", "staging/MANIFEST.json"),  # the manifest, last
        ("fsync", "staging"),  # the staging folder's entries
        ("rename", "staging", "step-00000002"),  # publish
        ("fsync", "."),  # the rename is durable
        ("fsync", "latest"),  # the pointer, under its temporary name
        ("replace", "latest", "latest"),
        ("fsync", "."),
        ("rename", "step-00000001", "deleting"),  # retention only after all that
    ]


# ---------------------------------------------------------------------------- row 7: disk full


def inject_enospc(monkeypatch, file: str, after: int = 10) -> None:
    """The store's writes to `file` put `after` bytes on disk, then fail as a full disk does."""
    real = file_io._write

    def write(handle, data):
        if str(handle.name).endswith(os.sep + file):
            real(handle, data[:after])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(handle, data)

    monkeypatch.setattr(file_io, "_write", write)


def assert_previous_intact(run_dir: Path, step: int = 1) -> None:
    store = CheckpointStore(run_dir, keep_last=1)
    assert [s for s, _ in store.committed()] == [step]  # retention deleted nothing
    assert pointer(run_dir) == f"step-{step:08d}"
    assert store.latest()[0] == step
    assert same_payload(store.load(store.latest()[1]), make_payload(step))
    assert leftovers(run_dir) == []  # staging removed


@pytest.mark.parametrize("file", [*FILES, MANIFEST])
def test_disk_full_names_the_path_and_sizes_and_keeps_the_previous(tmp_path, monkeypatch, file):
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(1, make_payload(1))
    inject_enospc(monkeypatch, file)

    with pytest.raises(DiskFullError) as info:
        store.save(2, make_payload(2))

    message = str(info.value)
    assert str(tmp_path / "checkpoints" / "step-00000002") in message
    assert f"{info.value.needed} bytes" in message and f"{info.value.free} bytes" in message
    assert info.value.needed > 4096 * 4  # the payload's tensors at least
    assert info.value.free == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.1)
    assert "step-00000001 is untouched" in message
    assert info.value.exit_code == 2
    assert_previous_intact(tmp_path)


def test_disk_full_in_a_background_save_surfaces_in_wait_and_next_save(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep_last=1)
    store.save(1, make_payload(1))
    inject_enospc(monkeypatch, "model.safetensors")

    store.save_async(2, make_payload(2))
    with pytest.raises(DiskFullError):
        store.wait()
    assert store.wait() is None  # raised once

    store.save_async(3, make_payload(3))
    with pytest.raises(DiskFullError, match="step-00000003"):
        store.save_async(4, make_payload(4))  # the next save raises the one before
    monkeypatch.undo()
    assert_previous_intact(tmp_path)


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB tmpfs, where the kernel itself says ENOSPC."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mount(mount_point, "size=1m")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False, timeout=20)


def test_disk_full_on_a_real_full_disk(tiny_disk):
    run_dir = tiny_disk / "run"
    store = CheckpointStore(run_dir, keep_last=1)
    store.save(1, make_payload(1))  # about 20 KB

    with pytest.raises(DiskFullError) as info:
        store.save(2, make_payload(2, n=512 * 1024))  # 2 MiB of float32

    assert "step-00000002" in str(info.value)
    assert info.value.needed > 2 * 1024 * 1024 > info.value.free
    assert_previous_intact(run_dir)


# ------------------------------------------------------------------ rows 8-10: bad checkpoints


def two_checkpoints(run_dir: Path) -> tuple[CheckpointStore, Log, Path, Path]:
    store, log = store_with_log(run_dir)
    first, second = store.save(1, make_payload(1)), store.save(2, make_payload(2))
    return store, log, first, second


def truncate(path: Path, how: str) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size - 1 if how == "1 byte" else size // 2)


@pytest.mark.parametrize("how", ["1 byte", "50%"])
@pytest.mark.parametrize("file", FILES)
def test_truncated_file_is_refused_and_the_older_verified_one_is_used(tmp_path, file, how):
    store, log, first, second = two_checkpoints(tmp_path)
    truncate(second / file, how)

    assert store.latest() == (1, first)
    (skipped,) = log.of("checkpoint_skipped")
    assert skipped["checkpoint"] == "step-00000002"
    assert any(p.startswith(f"{file}: size") for p in skipped["problems"])
    with pytest.raises(CheckpointError, match=rf"{file}: size \d+ bytes, manifest says \d+"):
        store.load(second)

    truncate(first / file, how)
    with pytest.raises(CheckpointError) as info:
        store.latest()
    message = str(info.value)
    assert "no checkpoint" in message and "does not start over silently" in message
    assert f"step-00000001: {file}: size" in message and f"step-00000002: {file}: size" in message
    assert isinstance(info.value, BadInputError) and info.value.exit_code == 2


@pytest.mark.parametrize("how", ["1 byte", "50%"])
def test_truncated_manifest_is_refused(tmp_path, how):
    store, log, first, second = two_checkpoints(tmp_path)
    truncate(second / MANIFEST, how)
    assert store.latest() == (1, first)
    assert "MANIFEST.json: does not parse" in log.of("checkpoint_skipped")[0]["problems"][0]


def test_flipped_byte_in_tensor_data_is_a_sha256_mismatch(tmp_path):
    store, log, first, second = two_checkpoints(tmp_path)
    model = second / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0x01  # inside the tensor data, not the header
    model.write_bytes(bytes(data))
    load_file(model)  # safetensors alone loads it without a word (P3)

    assert store.latest() == (1, first)
    assert log.of("checkpoint_skipped")[0]["problems"] == [
        "model.safetensors: sha256 differs from the manifest (content changed)"
    ]
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256"):
        store.load(second)


def test_missing_file_is_reported_as_a_manifest_diff(tmp_path):
    store, log, first, second = two_checkpoints(tmp_path)
    (second / "optimizer.pt").unlink()
    assert store.latest() == (1, first)
    assert log.of("checkpoint_skipped")[0]["problems"] == [
        "files differ from the manifest: missing ['optimizer.pt'], extra none"
    ]
    with pytest.raises(CheckpointError, match=r"missing \['optimizer.pt'\]"):
        store.load(second)


def test_extra_file_is_reported_as_a_manifest_diff(tmp_path):
    store, log, first, second = two_checkpoints(tmp_path)
    (second / "stray.bin").write_bytes(b"x")
    (second / ".DS_Store").write_bytes(b"finder")  # what macOS Finder drops: tolerated
    assert store.latest() == (1, first)
    assert log.of("checkpoint_skipped")[0]["problems"] == [
        "files differ from the manifest: missing none, extra ['stray.bin']"
    ]
    (second / "stray.bin").unlink()
    assert store.latest() == (2, second)


def test_missing_manifest_and_unknown_format(tmp_path):
    store, _, first, second = two_checkpoints(tmp_path)
    rewrite_manifest(first, format_version=0)
    (second / MANIFEST).unlink()
    with pytest.raises(CheckpointError) as info:
        store.latest()
    assert "step-00000002: MANIFEST.json: missing (the save did not finish)" in str(info.value)
    assert "step-00000001: MANIFEST.json: format_version 0" in str(info.value)


def test_checkpoint_from_a_newer_steadytrain_is_refused_naming_the_writer(tmp_path):
    store, _, _, second = two_checkpoints(tmp_path)
    rewrite_manifest(second, format_version=FORMAT_VERSION + 1, steadytrain="9.1.0")
    for call in (store.latest, lambda: store.load(second), lambda: store.save(2, make_payload(2))):
        with pytest.raises(CheckpointError, match=r"written by steadytrain 9\.1\.0.*Upgrade"):
            call()  # no silent fallback to step 1: that would throw work away


def test_a_pointer_naming_a_broken_or_missing_checkpoint_falls_back_loudly(tmp_path):
    store, log, first, second = two_checkpoints(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_text("step-00000009\n")
    assert store.latest() == (2, second)
    assert log.of("checkpoint_pointer_ignored")[0]["pointer"] == "step-00000009"

    shutil.rmtree(first)
    shutil.rmtree(second)
    with pytest.raises(CheckpointError, match="latest: names step-00000009; no checkpoint folder"):
        store.latest()  # the checkpoints are gone: say so, do not start over silently


# ------------------------------------------------------------------------ row 11: bad pickles


class Touch:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class EvalTouch(Touch):
    def __reduce__(self):
        return (eval, (f"__import__('os').system('touch {self.marker}')",))


@pytest.mark.parametrize("attack", [Touch, EvalTouch])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, monkeypatch, attack):
    store, _, _, second = two_checkpoints(tmp_path)
    marker = tmp_path / "marker"
    torch.save({"state": attack(marker)}, second / "optimizer.pt")
    rewrite_manifest(second)  # the hashes match: only weights_only stands in the way
    loads = []
    real_load = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k), raising=True
    )

    assert store.latest() == (2, second)
    with pytest.raises(CheckpointError) as info:
        store.load(second)

    assert not marker.exists()
    message = str(info.value)
    assert str(second / "optimizer.pt") in message and "weights_only=True" in message
    assert "never retries with weights_only=False" in message
    assert loads == [{"map_location": "cpu", "weights_only": True}]  # no second, unsafe try


# ---------------------------------------------------------------------- row 12: path traversal


_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event in ("open", "os.listdir", "os.scandir"):
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            _opened.append(os.path.realpath(os.fsdecode(path)))


sys.addaudithook(_audit)


@pytest.fixture
def outside(tmp_path):
    """A valid checkpoint (step 9) of another run, outside this run's directory."""
    other = tmp_path / "other"
    CheckpointStore(other).save(9, make_payload(9))
    return other / "checkpoints"


def io_under(root: Path, call) -> list[str]:
    global _opened
    _opened = []
    try:
        call()
    except CheckpointError:
        pass
    finally:
        seen, _opened = _opened, None
    return [p for p in seen if p.startswith(os.path.realpath(root))]


def test_pointer_with_a_path_is_ignored(tmp_path, outside):
    run = tmp_path / "run"
    store, log = store_with_log(run)
    first = store.save(1, make_payload(1))
    (run / "checkpoints" / "latest").write_text("../../other/checkpoints/step-00000009")

    assert io_under(outside, store.latest) == []
    assert store.latest() == (1, first)
    assert "not a checkpoint folder name" in log.of("checkpoint_pointer_ignored")[0]["reason"]


def test_symlinked_pointer_is_not_followed(tmp_path, outside):
    run = tmp_path / "run"
    store, log = store_with_log(run)
    first = store.save(1, make_payload(1))
    (outside / "evil").write_text("step-00000009")
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").symlink_to(outside / "evil")

    assert io_under(outside, store.latest) == []
    assert store.latest() == (1, first)
    assert "symlink" in log.of("checkpoint_pointer_ignored")[0]["reason"]


def test_symlinked_checkpoint_folder_is_refused_before_reading_it(tmp_path, outside):
    run = tmp_path / "run"
    store, log = store_with_log(run)
    first = store.save(1, make_payload(1))
    link = run / "checkpoints" / "step-00000009"
    link.symlink_to(outside / "step-00000009", target_is_directory=True)
    (run / "checkpoints" / "latest").write_text("step-00000009")

    assert io_under(outside, store.latest) == []
    assert io_under(outside, lambda: store.load(link)) == []
    assert store.latest() == (1, first)
    assert "step-00000009 is a symlink" in log.of("checkpoint_skipped")[0]["problems"][0]
    assert store.committed() == [(1, first)]
    with pytest.raises(CheckpointError, match="symlink"):
        store.load(link)
    with pytest.raises(CheckpointError, match="not inside"):
        store.load(outside / "step-00000009")
    link.unlink()
    (run / "checkpoints" / "step-00000001").rename(run / "checkpoints" / "moved")
    link.symlink_to(outside / "step-00000009", target_is_directory=True)
    with pytest.raises(CheckpointError, match="step-00000009 is a symlink"):
        store.latest()  # the only candidate is refused: an error, not a fresh start


def test_symlinked_file_is_refused_before_reading_it(tmp_path, outside):
    run = tmp_path / "run"
    store, log, first, second = two_checkpoints(run)
    target = outside / "step-00000009" / "optimizer.pt"
    shutil.copy(second / "optimizer.pt", target)  # same bytes: a followed link would verify
    (second / "optimizer.pt").unlink()
    (second / "optimizer.pt").symlink_to(target)

    assert io_under(outside, store.latest) == []
    assert io_under(outside, lambda: store.load(second)) == []
    assert store.latest() == (1, first)
    assert log.of("checkpoint_skipped")[0]["problems"] == [
        "optimizer.pt is a symlink; checkpoints hold plain files, refused"
    ]


def test_manifest_listing_a_path_is_refused(tmp_path):
    store, log, first, second = two_checkpoints(tmp_path)
    manifest = json.loads((second / MANIFEST).read_text())
    manifest["files"]["../../x"] = {"sha256": "0" * 64, "bytes": 1}
    (second / MANIFEST).write_text(json.dumps(manifest))
    assert store.latest() == (1, first)
    assert "'../../x'; refused" in log.of("checkpoint_skipped")[0]["problems"][0]


# --------------------------------------------------------------------- row 20: async saves

EXIT_CHILD = (
    CHILD_PRELUDE
    + """
real = file_io._write
def slow(handle, data):
    time.sleep(0.01)
    real(handle, data)
file_io._write = slow
store = CheckpointStore(sys.argv[1])
store.save_async(1, make_payload(1))
print("in flight:", not os.path.exists(os.path.join(sys.argv[1], "checkpoints", "step-00000001")))
"""
)


def test_normal_exit_waits_for_the_background_save(tmp_path):
    proc = run_child(EXIT_CHILD, tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "in flight: True" in out  # the script ended while the save was still running
    store = CheckpointStore(tmp_path)
    assert store.latest()[0] == 1 and pointer(tmp_path) == "step-00000001"
    assert same_payload(store.load(store.latest()[1]), make_payload(1))


KILL_ASYNC_CHILD = (
    CHILD_PRELUDE
    + """
store = CheckpointStore(sys.argv[1])
store.save(1, make_payload(1))
real = file_io._write
def stuck(handle, data):
    real(handle, data[: len(data) // 2])
    print("IN FLIGHT", flush=True)  # from the writer thread, half-way through a file
    time.sleep(600)
file_io._write = stuck
store.save_async(2, make_payload(2))
time.sleep(600)
"""
)


def test_sigkill_during_a_background_save_leaves_the_previous_latest(tmp_path):
    proc = run_child(KILL_ASYNC_CHILD, tmp_path)
    try:
        assert proc.stdout.readline().strip() == "IN FLIGHT"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert any(n.startswith(".staging-step-00000002") for n in leftovers(tmp_path))
    store, log = store_with_log(tmp_path)
    assert store.latest()[0] == 1 and pointer(tmp_path) == "step-00000001"
    assert leftovers(tmp_path) == [] and log.of("checkpoint_leftover_removed")


def test_two_background_saves_never_overlap(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep_last=3)
    writing, release = threading.Event(), threading.Event()
    active, peak, order = [0], [0], []
    lock = threading.Lock()
    real_write, real_commit = file_io._write, CheckpointStore._commit

    def slow_write(handle, data):
        if "step-00000001" in str(handle.name):
            writing.set()
            assert release.wait(30)
        real_write(handle, data)

    def commit(self, step, payload):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            order.append(step)
        try:
            return real_commit(self, step, payload)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(file_io, "_write", slow_write)
    monkeypatch.setattr(CheckpointStore, "_commit", commit)

    store.save_async(1, make_payload(1))
    assert writing.wait(30)
    second = threading.Thread(target=store.save_async, args=(2, make_payload(2)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waiting for the first, not writing beside it
    assert order == [1]
    # a leftover scan while a save is in flight keeps that save's staging folder
    (tmp_path / "checkpoints" / ".staging-step-00000007-999999999-ab12").mkdir()
    alive = os.getppid()  # a live process that is not us: its staging may be in flight
    (tmp_path / "checkpoints" / f".staging-step-00000008-{alive}-ab12").mkdir()
    assert store.latest() is None
    in_flight, other = leftovers(tmp_path)
    assert in_flight.startswith(f".staging-step-00000001-{os.getpid()}-")
    assert other == f".staging-step-00000008-{alive}-ab12"  # the dead process's one is gone
    release.set()
    second.join(30)
    assert store.wait() == tmp_path / "checkpoints" / "step-00000002"
    assert peak[0] == 1 and order == [1, 2]
    assert [s for s, _ in store.committed()] == [1, 2]


# ------------------------------------------------------------------------ row 21: retention


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_last_keeps_the_newest_k(tmp_path, keep):
    store, log = store_with_log(tmp_path, keep_last=keep)
    for step in range(1, 6):
        store.save(step, make_payload(step, n=16))
        assert store.committed()[-1][0] == step  # the newest is never deleted
    assert [s for s, _ in store.committed()] == list(range(6 - keep, 6))
    deleted = [r["checkpoint"] for r in log.of("checkpoint_deleted")]
    assert deleted == [f"step-{s:08d}" for s in range(1, 6 - keep)]
    assert store.latest()[0] == 5 and leftovers(tmp_path) == []


def test_a_failed_delete_is_logged_not_raised(tmp_path, monkeypatch):
    store, log = store_with_log(tmp_path, keep_last=1)
    store.save(1, make_payload(1))
    real_rmtree = shutil.rmtree

    def stuck(path, *args, **kwargs):
        if ".deleting-" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", stuck)
    assert store.save(2, make_payload(2)).name == "step-00000002"
    (failed,) = log.of("checkpoint_delete_failed")
    assert failed["checkpoint"] == "step-00000001" and "Permission denied" in failed["error"]
    assert [s for s, _ in store.committed()] == [2]  # the half-deleted one does not count

    monkeypatch.undo()
    store.save(3, make_payload(3))  # the next save cleans it up
    assert leftovers(tmp_path) == []
    assert [s for s, _ in store.committed()] == [3]


def test_a_half_deleted_folder_is_never_a_checkpoint(tmp_path):
    store, _, first, second = two_checkpoints(tmp_path)
    half = tmp_path / "checkpoints" / ".deleting-step-00000003-999999999-ab12"
    shutil.copytree(second, half)
    (half / "optimizer.pt").unlink()
    assert store.committed() == [(1, first), (2, second)]
    assert store.latest() == (2, second)
    assert not half.exists()
