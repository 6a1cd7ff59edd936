"""Memory watch: a real leak is reported with its rate, a clean run is not; thrashing is told apart
from its look-alikes on recorded reading sequences, and a thrash signal in a real run shrinks the
micro-batch through the engine's own shrink path; the cache policy empties only when it helps."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch
from conftest import run_workload

from steadytrain import Callback, TrainConfig, Trainer
from steadytrain.device import resolve_device
from steadytrain.device.testing import FakeCUDABackend, FakeMPSBackend, FakeSystem, GiB
from steadytrain.events import Control, TrainState
from steadytrain.safety.leaks import LeakDetector, MiB, largest_tensors
from steadytrain.safety.memory_watch import MemoryWatch
from steadytrain.safety.thrash import ThrashDetector
from steadytrain.telemetry.files import read_jsonl


def events(run_dir, name):
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


# -- leaks, for real, in a child process (clean RSS readings) ------------------------------------


def test_real_leak_is_reported_with_its_rate_within_two_epochs(tmp_path):
    run_dir = tmp_path / "leaky"
    done = run_workload("leaky.py", str(run_dir), "--leak-mib", "4", "--epochs", "2")
    assert done.returncode == 0, done.stderr
    leaks = events(run_dir, "leak")
    assert len(leaks) == 1, "reported once, not at every reading"
    leak = leaks[0]
    true_rate = 4 * 16  # MiB per step × steps per epoch
    assert leak["counter"] == "rss"
    assert leak["step"] <= 32
    assert leak["rate_mib_per_epoch"] == pytest.approx(true_rate, rel=0.3)
    text = leak["message"]
    assert text.startswith("memory leak suspected: rss rose ")
    assert f"{leak['rate_mib_per_epoch']:.1f} MiB per epoch" in text
    assert "at this rate it reaches the budget of " in text and " epochs (step " in text
    assert "tensors kept in a Python list" in text and "model or optimizer rebuilt" in text
    biggest = leak["largest_tensors"][0]
    assert (biggest["shape"], biggest["dtype"], biggest["device"]) == ([2**20], "float32", "cpu")
    assert biggest["count"] >= leak["step"] - 2
    assert "× float32[1048576] on cpu" in text


def test_clean_five_epoch_run_reports_no_leak(tmp_path):
    run_dir = tmp_path / "clean"
    done = run_workload("leaky.py", str(run_dir), "--leak-mib", "0", "--epochs", "5")
    assert done.returncode == 0, done.stderr
    assert len(events(run_dir, "epoch_end")) == 5
    assert events(run_dir, "leak") == []
    assert events(run_dir, "swap") == []


# -- leak rule on readings ----------------------------------------------------------------------


def test_leak_rule_needs_a_steady_rise_above_the_threshold():
    def verdicts(values, threshold=32 * MiB, steps_per_epoch=16):
        detector = LeakDetector("rss", steps_per_epoch, threshold)
        return [detector.add(4 * (i + 1), v) for i, v in enumerate(values)]

    base = 300 * MiB
    # one jump (optimizer state at step 1, a checkpoint's buffers), then flat: not a trend
    assert not any(verdicts([base, base + 80 * MiB, base + 80 * MiB, base + 80 * MiB] * 2))
    # rising every reading, but 4 MiB per epoch: drift, below the threshold
    assert not any(verdicts([base + i * MiB for i in range(8)]))
    # rising 16 MiB per 4 steps = 64 MiB per epoch: a leak, at the 4th reading
    found = verdicts([base + i * 16 * MiB for i in range(6)])
    assert found[:3] == [None] * 3 and found[3] is not None
    assert found[3].rate_per_epoch == pytest.approx(64 * MiB)
    # a dip inside the window breaks the run of rises
    assert not any(verdicts([base, base + 20 * MiB, base + 10 * MiB, base + 30 * MiB]))
    # a counter that moves ±20 MiB by itself (it fell 24 MiB once), then four readings that
    # happen to rise 10 MiB each: 30 MiB in all is within its own swing, no leak
    noisy = [base, base + 20 * MiB, base - 4 * MiB, base + 6 * MiB, base + 16 * MiB]
    assert not any(verdicts([*noisy, base + 26 * MiB]))
    # the same noise, then a real leak of 32 MiB a reading: found once the rise outgrows it
    leaking = verdicts([*noisy, *(base + 16 * MiB + i * 32 * MiB for i in range(1, 4))])
    assert not any(leaking[: len(noisy) + 1]) and leaking[-1] is not None


def test_largest_tensors_groups_live_tensors_by_kind():
    kept = [torch.zeros(3, 1000, dtype=torch.float64) for _ in range(7)]
    view = kept[0][0]  # shares the storage of kept[0]: counted once
    # every kind: other tests in this worker may have left more than 50 larger ones alive
    kinds = largest_tensors(limit=100_000)
    mine = [k for k in kinds if k["shape"] == [3, 1000] and k["dtype"] == "float64"]
    assert mine == [
        {"shape": [3, 1000], "dtype": "float64", "device": "cpu", "count": 7, "bytes": 7 * 24000}
    ]
    assert view.shape == (1000,)


# -- thrash rule on recorded readings ----------------------------------------------------------


def replay(readings, **kwargs):
    """Feed (step_time, memory, swap_in) per step, one second apart; return every verdict."""
    detector = ThrashDetector(**kwargs)
    return [
        detector.observe(step_time, memory, swap_in, now=float(i))
        for i, (step_time, memory, swap_in) in enumerate(readings)
    ]


def mac(pressure=1, swap_used=0):
    return {"pressure": pressure, "swap_used": swap_used, "alloc_retries": None}


def healthy_then(later, *, steps=13, step_time=0.2, swap_in=5 * GiB):
    """13 healthy steps (3 warm-up, 10 baseline at 0.2 s), then `later`."""
    return [(step_time, mac(), swap_in)] * steps + later


def test_swap_used_high_without_swap_in_is_not_thrash():
    # 6 GiB parked in swap long ago, step time 5× its baseline, but nothing is swapped back in
    slow = [(1.0, mac(swap_used=6 * GiB), 5 * GiB)] * 10
    assert not any(replay(healthy_then(slow)))


def test_step_time_inflation_alone_is_not_thrash():
    slow = [(1.0, mac(), 5 * GiB)] * 10  # a slow data source or a throttled CPU
    assert not any(replay(healthy_then(slow)))


def test_swap_in_without_inflation_is_not_thrash():
    swapping = [(0.21, mac(), 5 * GiB + i * 64 * MiB) for i in range(1, 11)]
    assert not any(replay(healthy_then(swapping)))


def test_swap_in_rising_with_inflated_steps_is_thrash():
    thrashing = [(0.9, mac(swap_used=6 * GiB), 5 * GiB + i * 64 * MiB) for i in range(1, 11)]
    verdicts = replay(healthy_then(thrashing))
    # the median of the last 5 step times turns at the 3rd inflated step, the swap-in
    # counter has risen at two samples in a row by then
    assert not any(verdicts[:15])
    verdict = verdicts[15]
    assert verdict is not None
    assert verdict.slowdown == pytest.approx(4.5)
    assert verdict.signal == "swap-in 64.0 MiB/s"
    assert verdict.reason == "thrashing: step time 4.5× its baseline with swap-in 64.0 MiB/s"
    assert verdict.evidence["baseline_step_time"] == pytest.approx(0.2)


def test_a_trickle_of_swap_in_is_not_thrash():
    trickle = [(0.9, mac(), 5 * GiB + i * 100 * 1024) for i in range(1, 11)]  # 100 KiB/s
    assert not any(replay(healthy_then(trickle)))


@pytest.mark.parametrize(
    ("pressure", "step_time", "expected"),
    [
        (1, 0.9, None),
        (2, 0.9, "memory pressure warning (2)"),
        (2, 0.2, None),
        (4, 0.2, "memory pressure critical (4)"),
    ],
)
def test_macos_pressure_levels(pressure, step_time, expected):
    later = [(step_time, mac(pressure=pressure), 5 * GiB)] * 10
    verdicts = [v for v in replay(healthy_then(later)) if v is not None]
    assert (verdicts[0].signal if verdicts else None) == expected


def cuda(retries):
    return {"pressure": None, "swap_used": 0, "alloc_retries": retries}


def test_cuda_allocator_retries_rising_each_step_with_inflation_is_thrash():
    early = [(0.1, cuda(0), None)] * 13
    rising = [(0.35, cuda(i), None) for i in range(1, 11)]
    verdicts = replay(early + rising)
    found = next(v for v in verdicts if v is not None)
    assert found.signal.startswith("CUDA allocator retries rising")
    # one burst of retries, then none: the allocator recovered, not thrash
    burst = [(0.35, cuda(5 if i else 0), None) for i in range(10)]
    assert not any(replay(early + burst))
    # retries rising but steps at full speed: not thrash
    assert not any(replay(early + [(0.1, cuda(i), None) for i in range(1, 11)]))


# -- the callback: shrink requests, micro-batch 1, cool-down, cache policy ----------------------


class Recorded(list):
    def __call__(self, name, info):
        self.append((name, info))


def drive(watch, state, steps, step_time, memory, control=None):
    control = control or Control()
    for _ in range(steps):
        state.step += 1
        watch.on_step_end(state, control, {"metrics": {"step_time": step_time, "memory": memory}})
    return control


def rising_swap_device(**kwargs):
    script = [0] * 13 + [i * 64 * MiB for i in range(1, 200)]
    return resolve_device("cpu", system=FakeSystem(os_name="Linux", swap_in=script), **kwargs)


def fake_clock():
    return itertools.count(0.0, 1.0).__next__


def test_watch_at_micro_batch_one_warns_once_and_requests_nothing():
    record = Recorded()
    watch = MemoryWatch(rising_swap_device(), record, clock=fake_clock())
    state = TrainState(steps_per_epoch=1000, effective_batch_size=8, micro_batch_size=1)
    watch.on_fit_start(state, Control(), {})
    drive(watch, state, 13, 0.1, {})
    control = drive(watch, state, 40, 1.0, {})
    assert control.shrink_reason is None
    swaps = [info for name, info in record if name == "swap"]
    assert len(swaps) == 1 and swaps[0]["action"] == "none"
    assert "at micro-batch 1: nothing left to shrink" in swaps[0]["message"]


def test_watch_waits_for_the_new_size_before_shrinking_again():
    record = Recorded()
    watch = MemoryWatch(rising_swap_device(), record, clock=fake_clock())
    state = TrainState(steps_per_epoch=1000, effective_batch_size=64, micro_batch_size=64)
    watch.on_fit_start(state, Control(), {})
    drive(watch, state, 13, 0.1, {})
    shrinks = []
    for _ in range(30):
        control = drive(watch, state, 1, 1.0, {})
        if control.shrink_reason:
            shrinks.append(state.step)
            state.micro_batch_size //= 2
            watch.on_shrink(state, control, {})
    assert shrinks[0] == 16
    assert all(b - a >= MemoryWatch.cooldown_steps for a, b in itertools.pairwise(shrinks))


def mps_watch(policy, cached):
    mps = FakeMPSBackend(total=16 * GiB)
    device = resolve_device("mps", backends={"mps": mps}, system=mps.system)
    device.empty_cache()  # the resolution probe left its 256 bytes in the cache
    handles = [mps.allocate(64 * MiB) for _ in range(cached // (64 * MiB) + 2)]
    for handle in handles[2:]:
        mps.free(handle)
    record = Recorded()
    watch = MemoryWatch(device, record, empty_cache=policy, clock=fake_clock())
    state = TrainState(steps_per_epoch=4, effective_batch_size=8, micro_batch_size=8)
    watch.on_fit_start(state, Control(), {})
    return mps, device, watch, state, record


def test_auto_cache_policy_empties_only_when_the_cache_dwarfs_the_tensors():
    mps, device, watch, state, record = mps_watch("auto", cached=1 * GiB)
    calls = mps.empty_cache_calls
    drive(watch, state, 4, 0.1, device.memory().to_dict())
    assert mps.empty_cache_calls == calls, "never per step"
    watch.on_epoch_end(state, Control(), {"epoch": 0, "memory": device.memory().to_dict()})
    assert mps.empty_cache_calls == calls + 1
    [info] = [info for name, info in record if name == "cache"]
    assert info["freed"] == 1 * GiB and info["reserved_after"] == 128 * MiB
    assert info["message"].startswith("emptied the allocator cache at step 4 (epoch end)")

    mps, device, watch, state, record = mps_watch("auto", cached=64 * MiB)  # small cache
    calls = mps.empty_cache_calls
    watch.on_epoch_end(state, Control(), {"epoch": 0, "memory": device.memory().to_dict()})
    assert mps.empty_cache_calls == calls and record == []


def test_auto_cache_policy_keeps_the_cache_a_cuda_step_reuses():
    cuda = FakeCUDABackend([("NVIDIA H100 80GB HBM3", 80 * GiB)])
    device = resolve_device("cuda", backends={"cuda": cuda}, system=FakeSystem(os_name="Linux"))
    cuda.allocate(512 * MiB)  # weights and optimizer state
    cuda.allocate(3 * GiB)  # one step's activations, freed at its end: the cache keeps them
    cuda.free(3 * GiB)
    record = Recorded()
    watch = MemoryWatch(device, record, clock=fake_clock())
    state = TrainState(steps_per_epoch=4, step=4)
    watch.on_fit_start(state, Control(), {})
    watch.on_epoch_end(state, Control(), {"epoch": 0, "memory": device.memory().to_dict()})
    assert record == [] and device.memory().reserved > 3 * GiB, "the next step reuses it"

    device.reset_peak()  # a later step peaked at 512 MiB: the 3 GiB are left over from before
    watch.on_epoch_end(state, Control(), {"epoch": 1, "memory": device.memory().to_dict()})
    [info] = [info for name, info in record if name == "cache"]
    assert info["peak"] == 512 * MiB and info["freed"] == 3 * GiB + 256
    assert device.memory().reserved == 512 * MiB


@pytest.mark.parametrize(("policy", "per_step"), [("every_step", 1), ("never", 0)])
def test_every_step_and_never_cache_policies(policy, per_step):
    mps, device, watch, state, record = mps_watch(policy, cached=1 * GiB)
    calls = mps.empty_cache_calls
    drive(watch, state, 4, 0.1, device.memory().to_dict())
    watch.on_epoch_end(state, Control(), {"epoch": 0, "memory": device.memory().to_dict()})
    assert mps.empty_cache_calls == calls + 4 * per_step
    assert [r for r in record if r[0] == "cache"] == []


def test_from_config_follows_the_config(tmp_path):
    device = resolve_device("cpu")
    off = TrainConfig(run_dir=str(tmp_path), effective_batch_size=8, memory_watch=False)
    assert MemoryWatch.from_config(off, device, Recorded()) is None
    cfg = TrainConfig(
        run_dir=str(tmp_path),
        effective_batch_size=8,
        empty_cache="never",
        leak_check_every_steps=7,
        leak_threshold_mib=10,
        thrash_slowdown=3,
    )
    watch = MemoryWatch.from_config(cfg, device, Recorded())
    watch.on_fit_start(TrainState(steps_per_epoch=100), Control(), {})
    assert (watch.empty_cache, watch.leak_every, watch.leak_threshold) == ("never", 7, 10 * MiB)
    assert watch.thrash.slowdown == 3
    watch = MemoryWatch.from_config(
        TrainConfig(run_dir=str(tmp_path), effective_batch_size=8), device, Recorded()
    )
    watch.on_fit_start(TrainState(steps_per_epoch=10_000), Control(), {})
    assert watch.leak_every == 500


# -- a thrash signal in a real run shrinks through the engine ---------------------------------


class SlowWhileSwapping(Callback):
    """Marks the steps during which the machine 'swaps' (the loss function then sleeps)."""

    def __init__(self, first, last):
        self.first, self.last, self.slow = first, last, False

    def on_step_start(self, state, control, info):
        self.slow = self.first <= state.step + 1 <= self.last


def test_thrash_signal_in_a_real_run_shrinks_through_the_engine(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(1))
    data = list(zip(x, x.sum(1, keepdim=True), strict=True))
    swapping = SlowWhileSwapping(14, 24)

    def loss_fn(model, batch):
        if swapping.slow:
            time.sleep(0.05)  # a step that waits on pages coming back from swap
        inputs, targets = batch
        return torch.nn.functional.mse_loss(model(inputs), targets)

    # The machine's swap-in counter: still until step 13, then 64 MiB more at every reading
    # (one per step, one second apart on the watch's clock) until step 24.
    script = [0] * 13 + [i * 64 * MiB for i in range(1, 12)]
    device = resolve_device("cpu", system=FakeSystem(os_name="Linux", swap_in=script))
    record = Recorded()
    watch = MemoryWatch(device, record, clock=fake_clock())
    watch.swap_sample_s = 0.0
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"),
        effective_batch_size=16,
        micro_batch_size=16,
        max_steps=40,
        save_every_steps=40,
        device="cpu",
        precision="fp32",
        memory_watch=False,
        log_every_steps=100,
    )
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    result = Trainer(model, sgd, loss_fn, data, cfg, callbacks=[swapping, watch]).fit()

    assert result.steps == 40 and result.exit_code == 0
    [swap] = [info for name, info in record if name == "swap"]
    assert swap["action"] == "shrink" and swap["signal"] == "swap-in 64.0 MiB/s"
    run_dir = tmp_path / "run"
    [shrink] = events(run_dir, "shrink")
    assert (shrink["old"], shrink["new"]) == (16, 8)
    assert shrink["reason"] == swap["reason"]
    assert shrink["reason"].startswith("thrashing: step time ")
    assert shrink["reason"].endswith("× its baseline with swap-in 64.0 MiB/s")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    after = [r for r in rows if r["step"] > shrink["step"]]
    assert after and all(r["micro_batch_size"] == 8 for r in after)
    assert all(r["samples"] == 16 for r in rows), "the effective batch never changes"
    assert json.loads((run_dir / "config.json").read_text())["memory_watch"] is False
