"""The device layer: resolution, budgets, memory readings, RNG streams, autocast probing, the OS
probes, and the MPS / CUDA doubles that stand in for hardware this machine does not have."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from steadytrain.device import (
    CgroupMemory,
    Device,
    RNGStateError,
    SystemProbe,
    get_rng_state,
    is_oom,
    oom_request_bytes,
    resolve_device,
    seed_everything,
    set_rng_state,
)
from steadytrain.device.testing import (
    AUTOCAST_DISABLED,
    RUNNER_OOM,
    FakeCUDABackend,
    FakeMPSBackend,
    FakeSystem,
    format_mps_size,
)
from steadytrain.errors import BadInputError, DeviceUnavailableError

GiB = 1024**3
MiB = 1024**2

# mps.md §3.2, the two allocator OOM templates, as patterns
MPS_OOM_WATERMARK = re.compile(
    r"^MPS backend out of memory \(MPS allocated: (.+), other allocations: (.+), max allowed: "
    r"(.+)\)\. Tried to allocate (.+) on (shared|private) pool\. Use "
    r"PYTORCH_MPS_HIGH_WATERMARK_RATIO=0\.0 to disable upper limit for memory allocations \(may "
    r"cause system failure\)\.$"
)
MPS_OOM_NO_LIMIT = re.compile(
    r"^MPS backend out of memory \(MPS allocated: (.+), other allocations: (.+)\)\. Tried to "
    r"allocate (.+) on (shared|private) pool\.$"
)
RUNNER_TEXT = (
    "MPS backend out of memory (MPS allocated: 0 bytes, other allocations: 0 bytes, max "
    "allowed: 7.93 GB). Tried to allocate 256 bytes on private pool."
)  # mps.md §9


def no_cuda() -> FakeCUDABackend:
    return FakeCUDABackend([], built=False)


def mac(mps: FakeMPSBackend, cuda: FakeCUDABackend | None = None) -> dict:
    """resolve_device arguments for a Mac with this MPS double and no CUDA."""
    return {"backends": {"mps": mps, "cuda": cuda or no_cuda()}, "system": mps.system}


# -- resolution -------------------------------------------------------------------------------


def test_auto_on_this_machine_is_a_working_device():
    device = resolve_device("auto")
    assert device.type in ("cuda", "mps", "cpu")
    torch.ones(2, device=device.torch_device).sum().item()


def test_auto_without_accelerators_is_cpu():
    device = resolve_device(
        "auto", backends={"cuda": no_cuda(), "mps": FakeMPSBackend("not_built")}
    )
    assert device.type == "cpu" and device.torch_device == torch.device("cpu")
    assert device.skipped == ()


def test_cpu_resolves_everywhere():
    device = resolve_device("cpu")
    assert isinstance(device, Device) and device.type == "cpu"


def test_auto_prefers_cuda_then_mps():
    mps = FakeMPSBackend()
    assert resolve_device("auto", **mac(mps, FakeCUDABackend())).type == "cuda"
    assert resolve_device("auto", **mac(mps)).type == "mps"


def test_auto_skips_a_broken_gpu_and_says_why():
    device = resolve_device("auto", **mac(FakeMPSBackend(), FakeCUDABackend(mode="broken")))
    assert device.type == "mps"
    assert device.skipped and "illegal memory access" in device.skipped[0]


def test_unavailable_device_is_exit_2_and_lists_what_is_available():
    with pytest.raises(DeviceUnavailableError) as raised:
        resolve_device("cuda", **mac(FakeMPSBackend()))
    assert raised.value.exit_code == 2
    message = str(raised.value)
    assert "no CUDA support" in message
    assert "Available here: mps, cpu" in message


def test_missing_gpu_index_names_the_ones_that_exist():
    with pytest.raises(DeviceUnavailableError, match="there is no cuda:2") as raised:
        resolve_device("cuda:2", **mac(FakeMPSBackend("not_built"), FakeCUDABackend()))
    assert "Available here: cuda:0, cpu" in str(raised.value)


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "mps:1", "CPU", ""])
def test_unknown_spec_is_refused(spec):
    with pytest.raises(DeviceUnavailableError, match="unknown device"):
        resolve_device(spec)


def test_fake_mps_resolves_to_mps():
    device = resolve_device("mps", **mac(FakeMPSBackend()))
    assert device.type == "mps" and device.torch_device == torch.device("mps")
    assert "FakeMPSBackend double" in device.name


def test_runner_mode_auto_falls_back_to_cpu():
    device = resolve_device("auto", **mac(FakeMPSBackend("runner")))
    assert device.type == "cpu"
    assert RUNNER_TEXT in device.skipped[0]


def test_runner_mode_explicit_mps_is_unavailable():
    with pytest.raises(DeviceUnavailableError) as raised:
        resolve_device("mps", **mac(FakeMPSBackend("runner")))
    message = str(raised.value)
    assert "reports available but failed a small computation" in message
    assert RUNNER_TEXT in message
    assert "Available here: cpu." in message


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("not_built", "this torch build has no MPS support"),
        ("unavailable", "MPS is built but not available"),
    ],
)
def test_mps_that_is_not_there_says_why(mode, why):
    with pytest.raises(DeviceUnavailableError, match=why):
        resolve_device("mps", **mac(FakeMPSBackend(mode)))


# -- budgets ----------------------------------------------------------------------------------


def test_mps_budget_is_a_fraction_of_recommended_max_memory():
    mps = FakeMPSBackend(total=16 * GiB)
    assert mps.recommended_max_memory() == 12 * GiB  # ~75% of the scripted total
    device = resolve_device("mps", 0.9, **mac(mps))
    assert device.usable == 12 * GiB
    assert device.budget == int(12 * GiB * 0.9)
    assert Device(device.backend, device.index, 0.5, device.system).budget == 6 * GiB


def test_explicit_bytes_win():
    device = resolve_device("mps", 3 * GiB, **mac(FakeMPSBackend(total=16 * GiB)))
    assert device.budget == 3 * GiB
    assert device.memory().budget == 3 * GiB


def test_high_watermark_below_one_caps_the_mps_budget():
    env = {"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "0.5", "PYTORCH_MPS_LOW_WATERMARK_RATIO": "0.4"}
    mps = FakeMPSBackend(total=16 * GiB, environ=env)
    device = resolve_device("mps", 1.0, **mac(mps))
    assert device.usable == 6 * GiB  # 0.5 × 12 GiB: the allocator refuses anything above


def test_cuda_budget_honours_the_memory_fraction_cap():
    cuda = FakeCUDABackend([("GPU", 80 * GiB)], memory_fraction=0.25)
    device = resolve_device("cuda:0", 0.9, **mac(FakeMPSBackend(), cuda))
    assert device.usable == 20 * GiB
    assert device.budget == int(20 * GiB * 0.9)


def test_cpu_budget_honours_the_tightest_ceiling():
    plain = FakeSystem(os_name="Linux", memsize=64 * GiB, available=40 * GiB, rss=1 * GiB)
    assert resolve_device("cpu", 0.5, system=plain).budget == int(41 * GiB * 0.5)

    rlimited = FakeSystem(
        os_name="Linux", available=40 * GiB, rss=1 * GiB, vms=6 * GiB, rlimit_as=8 * GiB
    )
    assert resolve_device("cpu", 1.0, system=rlimited).usable == 1 * GiB + 2 * GiB

    contained = FakeSystem(
        os_name="Linux",
        available=40 * GiB,
        rss=1 * GiB,
        cgroup=CgroupMemory(limit=4 * GiB, usage=3 * GiB, path="/sys/fs/cgroup"),
    )
    assert resolve_device("cpu", 1.0, system=contained).usable == 2 * GiB


@pytest.mark.parametrize("spec", [0, -5, 0.0, 1.5, True, "12GiB"])
def test_invalid_budget_spec_names_the_field(spec):
    with pytest.raises(BadInputError, match="memory_budget"):
        resolve_device("cpu", spec)


REAL_RLIMIT_BUDGET = textwrap.dedent("""
    import json, resource
    import torch
    from steadytrain.device import resolve_device

    x = torch.randn(64, 64, requires_grad=True)
    (x @ x).sum().backward()
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + 512 * 2**20, hard))
    device = resolve_device("cpu", 0.9)
    print(json.dumps({"budget": device.budget, "reading": device.memory().to_dict()}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_real_cpu_budget_honours_rlimit_as():
    done = subprocess.run(
        [sys.executable, "-c", REAL_RLIMIT_BUDGET], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    reading = result["reading"]
    ceiling = reading["rss"] + 512 * MiB  # at most what the limit leaves, whatever RAM is free
    assert reading["usable"] <= ceiling
    assert result["budget"] == int(reading["usable"] * 0.9)
    assert reading["system_available"] > 2 * ceiling, "the limit, not free RAM, must be binding"


# -- memory readings --------------------------------------------------------------------------


def test_cpu_memory_reading_has_every_field():
    reading = resolve_device("cpu").memory()
    fields = reading.to_dict()
    assert set(fields) == {
        "allocated",
        "reserved",
        "peak",
        "total",
        "budget",
        "rss",
        "system_available",
        "swap_used",
        "alloc_retries",
        "pressure",
        "usable",
    }
    assert reading.rss > 0 and reading.total > 0 and reading.system_available > 0
    assert reading.swap_used >= 0
    assert 0 < reading.budget <= reading.usable <= reading.total + reading.rss
    assert reading.allocated is None and reading.peak is None  # torch keeps no CPU counters


def test_fake_mps_counters_are_consistent():
    mps = FakeMPSBackend(total=16 * GiB)
    device = resolve_device("mps", **mac(mps))
    device.empty_cache()  # the resolution probe left its 256 bytes in the cache
    a = mps.allocate(1 * GiB)
    mps.allocate(512 * MiB)
    mps.free(a)
    mps.leak(100 * MiB)
    reading = device.memory()
    assert reading.allocated == 512 * MiB  # live tensors only
    assert reading.reserved == 512 * MiB + 1 * GiB + 100 * MiB  # driver: live + cache + other
    assert reading.peak is None  # torch.mps keeps no peak
    assert reading.total == 16 * GiB and reading.usable == 12 * GiB
    device.empty_cache()
    assert device.memory().reserved == 512 * MiB + 100 * MiB  # the leak is not cache
    assert device.memory().reserved >= device.memory().allocated


def test_fake_mps_pressure_levels_follow_the_script():
    device = resolve_device("mps", **mac(FakeMPSBackend(pressure=[1, 2, 4])))
    assert [device.memory().pressure for _ in range(4)] == [1, 2, 4, 4]


def test_fake_cuda_reading_counts_peak_and_retries():
    cuda = FakeCUDABackend([("GPU", 8 * GiB)])
    device = resolve_device("cuda", **mac(FakeMPSBackend(), cuda))
    cuda.allocate(2 * GiB)
    cuda.free(2 * GiB)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        cuda.allocate(7 * GiB)
    assert oom_request_bytes(raised.value) == 7 * GiB
    reading = device.memory()
    assert reading.peak == 2 * GiB and reading.allocated == 0 and reading.alloc_retries == 1
    device.reset_peak()
    assert device.memory().peak == 0


# -- the MPS double reproduces mps.md -----------------------------------------------------------


def test_fake_mps_oom_over_the_high_watermark_is_the_documented_text():
    mps = FakeMPSBackend(total=16 * GiB)  # max allowed = 1.7 × 12 GiB = 20.4 GiB
    mps.allocate(7 * GiB)
    mps.allocate(7 * GiB)
    with pytest.raises(RuntimeError) as raised:
        mps.allocate(7 * GiB)
    exc = raised.value
    assert type(exc) is RuntimeError  # not torch.OutOfMemoryError (mps.md §3.2)
    match = MPS_OOM_WATERMARK.match(str(exc))
    assert match, str(exc)
    assert match.groups() == ("14.00 GB", "0 bytes", "20.40 GB", "7.00 GB", "private")
    assert is_oom(exc) and oom_request_bytes(exc) == 7 * GiB


def test_fake_mps_releases_its_cache_before_failing():
    mps = FakeMPSBackend(total=16 * GiB)  # max allowed 20.4 GiB
    first = mps.allocate(7 * GiB)
    mps.allocate(7 * GiB)
    mps.free(first)
    mps.allocate(3 * GiB)  # reuses the cache: 4 GiB of it stays in the heap
    assert mps.reserved(0) == 14 * GiB
    mps.allocate(7 * GiB)  # 14 + 7 is over the limit; it fits once the cache is released
    assert (mps.allocated(0), mps.reserved(0)) == (17 * GiB, 17 * GiB)


def test_fake_mps_with_watermark_disabled_fails_at_physical_memory():
    mps = FakeMPSBackend(total=16 * GiB, environ={"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "0.0"})
    mps.allocate(6 * GiB)
    mps.allocate(6 * GiB)
    with pytest.raises(RuntimeError) as raised:
        mps.allocate(6 * GiB, pool="shared")
    assert MPS_OOM_NO_LIMIT.match(str(raised.value)), str(raised.value)
    assert is_oom(raised.value)


def test_fake_mps_invalid_buffer_size():
    with pytest.raises(RuntimeError, match=r"^Invalid buffer size: 8\.00 GB$") as raised:
        FakeMPSBackend(total=16 * GiB).allocate(8 * GiB)
    assert is_oom(raised.value)


def test_fake_mps_runner_mode_fails_every_allocation_with_the_runner_text():
    mps = FakeMPSBackend("runner")
    assert mps.is_available() and mps.device_count() == 1
    with pytest.raises(RuntimeError) as raised:
        mps.probe(0)
    assert str(raised.value) == RUNNER_TEXT == RUNNER_OOM.format(size="256 bytes")
    with pytest.raises(RuntimeError, match="MPS backend out of memory"):
        mps.allocate(1 * GiB)


def test_fake_mps_refuses_bad_watermarks_at_the_first_allocation():
    mps = FakeMPSBackend(environ={"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "0.7"})
    with pytest.raises(RuntimeError, match=r"^invalid low watermark ratio 1\.4$"):
        mps.allocate(256)
    with pytest.raises(RuntimeError, match=r"^invalid high watermark ratio 2\.5$"):
        FakeMPSBackend(environ={"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "2.5"}).allocate(256)


def test_fake_mps_not_built_raises_like_a_build_without_mps():
    mps = FakeMPSBackend("not_built")
    assert not mps.is_built() and not mps.is_available() and mps.device_count() == 0
    with pytest.raises(RuntimeError, match="without MPS backend"):
        mps.recommended_max_memory()
    with pytest.raises(RuntimeError, match="not linked with support for mps"):
        mps.allocate(256)


def test_mps_size_format_matches_the_allocator():
    assert [format_mps_size(n) for n in (256, 1024, 1025, 3 * MiB, int(7.93 * GiB))] == [
        "256 bytes",
        "1024 bytes",
        "1.00 KB",
        "3.00 MB",
        "7.93 GB",
    ]


# -- RNG streams --------------------------------------------------------------------------------


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_round_trip_reproduces_the_draws():
    seed_everything(123)
    _draws()
    snapshot = get_rng_state()
    before = _draws()
    _draws()
    set_rng_state(snapshot)
    assert _draws() == before


def test_rng_snapshot_with_a_stream_this_machine_lacks_is_refused():
    snapshot = get_rng_state()
    if "mps" not in snapshot:
        snapshot["mps"] = torch.zeros(8, dtype=torch.uint8)
        with pytest.raises(RNGStateError, match="MPS stream"):
            set_rng_state(snapshot)
        del snapshot["mps"]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    snapshot["cuda"] = [torch.zeros(8, dtype=torch.uint8)] * (have + 1)
    with pytest.raises(RNGStateError, match="CUDA device stream") as raised:
        set_rng_state(snapshot)
    assert isinstance(raised.value, BadInputError) and raised.value.exit_code == 2


def test_rng_refusal_changes_nothing():
    seed_everything(7)
    snapshot = get_rng_state()
    snapshot["xla"] = b"from another machine"
    random.seed(99)
    expected = random.getstate()
    with pytest.raises(RNGStateError, match="unknown stream"):
        set_rng_state(snapshot)
    assert random.getstate() == expected  # nothing half-restored


# -- autocast -----------------------------------------------------------------------------------


def test_cpu_autocast_dtypes_are_probed_by_running():
    device = resolve_device("cpu")
    assert set(device.autocast_dtypes) == {torch.bfloat16, torch.float16}
    assert all(r.works and r.reason == "" for r in device.autocast_results)


def test_probing_autocast_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    assert resolve_device("cpu").autocast_results
    assert torch.equal(torch.rand(4), expected)


def test_mps_autocast_that_silently_disables_itself_is_not_counted():
    mps = FakeMPSBackend(autocast_dtypes={torch.float16})
    device = resolve_device("mps", **mac(mps))
    assert device.autocast_dtypes == (torch.float16,)
    bf16 = next(r for r in device.autocast_results if r.dtype == torch.bfloat16)
    assert "did not engage" in bf16.reason
    assert AUTOCAST_DISABLED.splitlines()[0] in bf16.reason


def test_mps_bf16_needs_macos_14():
    device = resolve_device("mps", **mac(FakeMPSBackend(macos="13.6")))
    assert device.autocast_dtypes == (torch.float16,)
    bf16 = next(r for r in device.autocast_results if r.dtype == torch.bfloat16)
    assert "macOS 14" in bf16.reason and "13.6" in bf16.reason


# -- OS probes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sysctl", "translated"),
    [
        ({}, False),
        ({"sysctl.proc_translated": "0"}, False),
        ({"sysctl.proc_translated": "1"}, True),
    ],
)
def test_rosetta_detection_reads_the_sysctl_value(sysctl, translated):
    assert FakeSystem(machine="x86_64", sysctl=sysctl).proc_translated() is translated


def test_macos_probes_parse_versions_and_memsize():
    system = FakeSystem(macos="15", memsize=24 * GiB)
    assert system.macos_version() == (15, 0)
    assert system.memsize() == 24 * GiB
    assert FakeSystem(os_name="Linux").macos_version() is None
    assert FakeSystem(os_name="Linux").pressure_level() is None


def test_real_probe_off_macos_reads_no_sysctl():
    probe = SystemProbe()
    if probe.is_macos():
        pytest.skip("this checks the non-macOS path")
    assert probe.sysctl("hw.memsize") is None
    assert probe.proc_translated() is False and probe.pressure_level() is None


def _cgroup_fixture(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> SystemProbe:
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(proc_cgroup)
    for name, text in files.items():
        path = tmp_path / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return SystemProbe(cgroup_root=tmp_path / "cgroup", proc_self=proc)


def test_cgroup_v2_limit_is_read(tmp_path):
    probe = _cgroup_fixture(
        tmp_path,
        "0::/user.slice/job\n",
        {
            "user.slice/job/memory.max": "max\n",
            "user.slice/job/memory.current": "100\n",
            "user.slice/memory.max": f"{4 * GiB}\n",
            "user.slice/memory.current": f"{1 * GiB}\n",
        },
    )
    assert probe.cgroup_memory() == CgroupMemory(
        4 * GiB, 1 * GiB, str(tmp_path / "cgroup" / "user.slice")
    )


def test_cgroup_v1_limit_inside_a_container_is_read(tmp_path):
    # The path in /proc/self/cgroup is the host's; the container sees its cgroup at the root.
    probe = _cgroup_fixture(
        tmp_path,
        "4:memory:/docker/abc123\n1:cpu:/\n",
        {
            "memory/memory.limit_in_bytes": f"{2 * GiB}\n",
            "memory/memory.usage_in_bytes": f"{512 * MiB}\n",
        },
    )
    limit = probe.cgroup_memory()
    assert (limit.limit, limit.headroom) == (2 * GiB, 2 * GiB - 512 * MiB)


def test_cgroup_without_limit_is_none(tmp_path):
    probe = _cgroup_fixture(
        tmp_path,
        "4:memory:/\n",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "1000\n",
        },
    )
    assert probe.cgroup_memory() is None
