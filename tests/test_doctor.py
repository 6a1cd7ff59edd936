"""`steadytrain doctor`: for real on this machine through the CLI, and against the doubles for the
Mac situations this machine cannot be (Rosetta, a VM whose MPS fails, bad watermarks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from steadytrain.device import CgroupMemory
from steadytrain.device.testing import FakeCUDABackend, FakeMPSBackend, FakeSystem
from steadytrain.doctor import diagnose, exit_code, run_doctor

GiB = 1024**3
HIGH, LOW = "PYTORCH_MPS_HIGH_WATERMARK_RATIO", "PYTORCH_MPS_LOW_WATERMARK_RATIO"


def cli_doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def mac_doctor(
    tmp_path,
    mps: FakeMPSBackend | None = None,
    cuda: FakeCUDABackend | None = None,
    environ: dict | None = None,
    device: str = "auto",
    **system_kwargs,
):
    """Findings for a Mac described by the doubles (a working M2 on macOS 14.5 by default)."""
    mps = mps or FakeMPSBackend(**system_kwargs)
    backends = {"mps": mps, "cuda": cuda or FakeCUDABackend([], built=False)}
    return diagnose(device, tmp_path, False, mps.system, backends, environ or {})


def linux_doctor(
    tmp_path,
    environ: dict | None = None,
    cuda: FakeCUDABackend | None = None,
    device: str = "auto",
    **system_kwargs,
):
    system = FakeSystem(os_name="Linux", machine="x86_64", **system_kwargs)
    backends = {
        "mps": FakeMPSBackend("not_built", system=system),
        "cuda": cuda or FakeCUDABackend([], built=False),
    }
    return diagnose(device, tmp_path, False, system, backends, environ or {})


def by_check(findings, check: str):
    matches = [f for f in findings if f.check == check]
    assert matches, f"no {check!r} finding in {[f.check for f in findings]}"
    return matches[0]


# -- for real, on this machine --------------------------------------------------------------


def test_cli_doctor_prints_a_table_with_torch_and_the_device(tmp_path):
    done = cli_doctor("--run-dir", str(tmp_path))
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert f"torch {torch.__version__}" in done.stdout
    assert "device cpu" in done.stdout or "device cuda:0" in done.stdout
    assert "status" in done.stdout and "finding" in done.stdout


def test_cli_doctor_json_is_only_json(tmp_path):
    done = cli_doctor("--json", "--run-dir", str(tmp_path))
    payload = json.loads(done.stdout)  # nothing but JSON on stdout
    checks = {f["check"] for f in payload["findings"]}
    assert {
        "os",
        "python",
        "architecture",
        "torch",
        "cuda",
        "mps",
        "device",
        "memory",
        "autocast",
        "disk",
    } <= checks
    assert all(f["status"] in ("ok", "warn", "fail", "info") for f in payload["findings"])
    assert all(f["fix"] for f in payload["findings"] if f["status"] in ("warn", "fail"))
    assert payload["summary"]["exit_code"] == done.returncode
    assert done.returncode in (0, 1)


def test_cli_selftest_passes_on_cpu(tmp_path):
    done = cli_doctor("--selftest", "--json", "--device", "cpu", "--run-dir", str(tmp_path))
    payload = json.loads(done.stdout)
    selftest = {f["check"]: f for f in payload["findings"] if f["check"].startswith("selftest.")}
    assert set(selftest) == {"selftest.matmul", "selftest.train_step", "selftest.checkpoint"}
    assert all(f["status"] == "ok" for f in selftest.values()), selftest
    losses = selftest["selftest.train_step"]["data"]["losses"]
    assert losses[-1] < losses[0]
    assert "bitwise identical" in selftest["selftest.checkpoint"]["message"]
    assert all(f["data"]["seconds"] >= 0 for f in selftest.values())
    assert list(tmp_path.iterdir()) == []  # the checkpoint went to a temporary folder, now gone
    assert done.returncode in (0, 1)


# -- with the doubles: a Mac ------------------------------------------------------------------


def test_healthy_mac_is_exit_0(tmp_path):
    findings = mac_doctor(tmp_path)
    assert exit_code(findings) == 0, [(f.check, f.status, f.message) for f in findings]
    assert by_check(findings, "mps").status == "ok"
    device = by_check(findings, "device")
    assert device.data["device"] == "mps"
    assert device.data["memory"]["budget"] == int(12 * GiB * 0.9)


def test_rosetta_python_is_broken_with_the_fix(tmp_path, capsys):
    system = FakeSystem(machine="x86_64", proc_translated=1)
    backends = {
        "mps": FakeMPSBackend("unavailable", system=system),
        "cuda": FakeCUDABackend([], built=False),
    }
    code = run_doctor(
        json_output=True,
        selftest=False,
        device="auto",
        run_dir=str(tmp_path),
        system=system,
        backends=backends,
        environ={},
    )
    assert code == 2
    payload = json.loads(capsys.readouterr().out)
    arch = next(f for f in payload["findings"] if f["check"] == "architecture")
    assert arch["status"] == "fail"
    assert "Rosetta" in arch["message"]
    assert "install an arm64 Python" in arch["fix"] and "brew install python" in arch["fix"]
    assert "torch ≥ 2.3 has no x86_64 macOS wheels" in arch["fix"]
    assert payload["summary"]["exit_code"] == 2


def test_native_arm64_is_ok_and_intel_mac_is_a_warning(tmp_path):
    assert by_check(mac_doctor(tmp_path), "architecture").status == "ok"
    intel = mac_doctor(tmp_path, mps=FakeMPSBackend("unavailable", machine="x86_64"))
    assert by_check(intel, "architecture").status == "warn"


def test_runner_mps_is_available_but_not_working(tmp_path):
    findings = mac_doctor(tmp_path, mps=FakeMPSBackend("runner"))
    mps = by_check(findings, "mps")
    assert mps.status == "warn"
    assert "available but not working" in mps.message
    assert "virtual machine" in mps.message
    assert "physical Apple Silicon Mac" in mps.fix
    assert by_check(findings, "device").data["device"] == "cpu"  # auto fell back
    assert exit_code(findings) == 1


def test_runner_mps_requested_explicitly_is_broken(tmp_path):
    findings = mac_doctor(tmp_path, mps=FakeMPSBackend("runner"), device="mps")
    assert by_check(findings, "mps").status == "fail"
    assert by_check(findings, "device").status == "fail"
    assert exit_code(findings) == 2


def test_old_macos_warns_and_bf16_is_not_offered(tmp_path):
    findings = mac_doctor(tmp_path, macos="13.6")
    assert by_check(findings, "os").status == "warn"
    autocast = by_check(findings, "autocast")
    assert autocast.data["bf16"]["works"] is False and autocast.data["fp16"]["works"] is True


@pytest.mark.parametrize(("levels", "status"), [([1], "ok"), ([2], "warn"), ([4], "fail")])
def test_memory_pressure(tmp_path, levels, status):
    assert by_check(mac_doctor(tmp_path, pressure=levels), "memory").status == status


# -- with the doubles: environment variables ---------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "allocator_says", "fix_says"),
    [
        ({HIGH: "0.7"}, "invalid low watermark ratio 1.4", "LOW"),
        ({HIGH: "2.5"}, "invalid high watermark ratio 2.5", "at most 2.0"),
        ({LOW: "1.8"}, "invalid low watermark ratio 1.8", "must be ≤"),
        ({HIGH: "1.0", LOW: "1.2"}, "invalid low watermark ratio 1.2", "must be ≤"),
    ],
)
def test_watermarks_the_allocator_refuses_are_broken_on_a_mac(
    tmp_path, environ, allocator_says, fix_says
):
    mps = FakeMPSBackend(environ=environ)
    findings = mac_doctor(tmp_path, mps=mps, environ=environ)
    watermark = by_check(findings, "env.mps_watermarks")
    assert watermark.status == "fail"
    assert allocator_says in watermark.message and fix_says in watermark.fix
    assert by_check(findings, "mps").status == "warn"  # and the probe really fails the same way
    assert allocator_says in by_check(findings, "mps").message
    assert exit_code(findings) == 2


def test_watermark_zero_warns_of_system_failure(tmp_path):
    environ = {HIGH: "0.0"}
    watermark = by_check(
        mac_doctor(tmp_path, mps=FakeMPSBackend(environ=environ), environ=environ),
        "env.mps_watermarks",
    )
    assert watermark.status == "warn" and "system failure" in watermark.message


def test_a_consistent_lower_watermark_pair_is_fine(tmp_path):
    environ = {HIGH: "0.7", LOW: "0.5"}
    findings = mac_doctor(tmp_path, mps=FakeMPSBackend(environ=environ), environ=environ)
    assert by_check(findings, "env.mps_watermarks").status == "info"
    assert by_check(findings, "device").data["memory"]["usable"] == int(12 * GiB * 0.7)
    assert exit_code(findings) == 0


def test_watermark_that_is_not_a_number(tmp_path):
    findings = mac_doctor(tmp_path, environ={HIGH: "high"})
    bad = [f for f in findings if f.check == "env.mps_watermarks" and f.status == "warn"]
    assert any("not a number" in f.message and "disables the limit" in f.message for f in bad)


def test_bad_watermarks_on_a_machine_without_mps_only_warn(tmp_path):
    watermark = by_check(linux_doctor(tmp_path, environ={HIGH: "0.7"}), "env.mps_watermarks")
    assert watermark.status == "warn" and "no effect on this machine" in watermark.message


@pytest.mark.parametrize(("value", "status"), [("1", "info"), ("0", "info"), ("yes", "warn")])
def test_mps_fallback_variable(tmp_path, value, status):
    finding = by_check(
        mac_doctor(tmp_path, environ={"PYTORCH_ENABLE_MPS_FALLBACK": value}), "env.mps_fallback"
    )
    assert finding.status == status
    assert "before" in (finding.message + (finding.fix or "")) and "Python starts" in (
        finding.message + (finding.fix or "")
    )


def test_cuda_machine_is_told_about_expandable_segments(tmp_path):
    findings = linux_doctor(tmp_path, cuda=FakeCUDABackend())
    assert by_check(findings, "cuda").status == "ok"
    assert by_check(findings, "device").data["device"] == "cuda:0"
    advice = by_check(findings, "env.cuda_alloc_conf")
    assert advice.status == "info" and "expandable_segments:True" in advice.message


def test_cuda_visible_devices_hiding_every_gpu_warns(tmp_path):
    findings = linux_doctor(
        tmp_path, environ={"CUDA_VISIBLE_DEVICES": ""}, cuda=FakeCUDABackend([])
    )
    assert by_check(findings, "env.cuda_visible_devices").status == "warn"


# -- with the doubles: disk and limits -----------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "status"), [(100 * GiB, "ok"), (5 * GiB, "warn"), (GiB // 2, "fail")]
)
def test_disk_space(tmp_path, free, status):
    disk = by_check(linux_doctor(tmp_path, disk_free=free), "disk")
    assert disk.status == status
    assert status == "ok" or "run_dir" in disk.fix


def test_memory_caps_are_reported(tmp_path):
    findings = linux_doctor(
        tmp_path, rlimit_as=8 * GiB, cgroup=CgroupMemory(4 * GiB, 1 * GiB, "/sys/fs/cgroup")
    )
    memory = by_check(findings, "memory")
    assert "RLIMIT_AS" in memory.message and "cgroup limit" in memory.message
    assert by_check(findings, "device").data["memory"]["usable"] <= 512 * 1024**2 + 3 * GiB


def test_selftest_without_a_device_fails(tmp_path):
    system = FakeSystem(os_name="Linux", machine="x86_64")
    backends = {"mps": FakeMPSBackend("not_built", system=system), "cuda": FakeCUDABackend([])}
    findings = diagnose("cuda", tmp_path, True, system, backends, {})
    assert by_check(findings, "device").status == "fail"
    assert by_check(findings, "selftest").status == "fail"
    assert exit_code(findings) == 2


def test_table_output_in_process(tmp_path, capsys):
    system = FakeSystem(os_name="Linux", machine="x86_64")
    backends = {
        "mps": FakeMPSBackend("not_built", system=system),
        "cuda": FakeCUDABackend([], built=False),
    }
    code = run_doctor(
        run_dir=str(tmp_path), system=system, backends=backends, environ={HIGH: "[bold]x"}
    )
    out = capsys.readouterr().out
    assert code == 1
    assert f"torch {torch.__version__}" in out and "device cpu" in out
    assert "[bold]x" in out  # user text is shown as text, never read as markup
