"""Data of every shape: the fingerprint and the collation accept whatever a map-style dataset
returns (property-based, over generated sample structures), and `fit()` trains on it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import numpy as np
import pytest
import torch
from conftest import WORKLOADS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steadytrain import TrainConfig, Trainer
from steadytrain.checkpoint.fingerprint import data_fingerprint, digest_value
from steadytrain.device.batches import to_device
from steadytrain.engine.batching import batch_len, split_batch
from steadytrain.engine.collate import PerSample, collate


@dataclasses.dataclass
class Record:
    name: str
    weight: float


class Opaque:
    """An object that shows only its address: the fingerprint falls back to its type."""

    __slots__ = ()


class Bag:
    def __init__(self, value):
        self.value = value


DTYPES = [
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(tuple(shape), generator=g) * 4
    if dtype.is_complex:
        return torch.complex(value, value.flip(-1) if value.dim() else value).to(dtype)
    return value.to(dtype)


LEAVES = st.one_of(
    tensors(),
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.complex_numbers(allow_nan=False),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.integers(-100, 100).map(np.int16),
    st.floats(-1, 1, width=32).map(np.float32),
    st.integers(0, 5).map(lambda n: np.arange(n, dtype=np.float64)),
    st.text(max_size=3).map(np.str_),
    st.builds(Record, st.text(max_size=3), st.floats(allow_nan=False)),
    st.just(Opaque()),
    st.integers().map(Bag),
)

STRUCTURES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.frozensets(st.text(max_size=3), max_size=3),
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STRUCTURES, min_size=1, max_size=5))
def test_the_fingerprint_digests_any_sample_the_same_way_twice(samples):
    notes: list[str] = []
    first = data_fingerprint(samples, notes)
    assert first == data_fingerprint(list(samples))
    assert len(first) == 16
    assert len(notes) <= 1 and all("\n" not in note for note in notes)


def test_the_fingerprint_tells_samples_apart_and_notes_the_weak_ones():
    labels = [torch.tensor(3), torch.tensor(4)]
    assert data_fingerprint(labels) != data_fingerprint([torch.tensor(3), torch.tensor(5)])
    assert data_fingerprint([{"a": {1, 2}}]) != data_fingerprint([{"a": {1, 3}}])
    assert data_fingerprint([Bag(1)]) != data_fingerprint([Bag(2)])
    assert data_fingerprint([np.int8(1)]) != data_fingerprint([np.int16(1)])
    notes: list[str] = []
    data_fingerprint([Opaque()], notes)
    assert len(notes) == 1 and "Opaque" in notes[0] and "by type only" in notes[0]


def test_a_set_of_strings_digests_the_same_in_another_process():
    code = (
        "import hashlib; from steadytrain.checkpoint.fingerprint import digest_value; "
        "d = hashlib.sha256(); digest_value(d, {'alpha', 'beta', 'gamma', 'delta'}, set()); "
        "print(d.hexdigest())"
    )
    here = hashlib.sha256()
    digest_value(here, {"alpha", "beta", "gamma", "delta"}, set())
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**__import__("os").environ, "PYTHONHASHSEED": hash_seed},
            check=True,
        )
        assert out.stdout.strip() == here.hexdigest()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STRUCTURES, min_size=2, max_size=6), st.integers(1, 6))
def test_collation_of_any_samples_splits_into_micro_batches_of_the_same_samples(samples, micro):
    n = len(samples)
    x = torch.arange(n, dtype=torch.float32)
    batch = collate([(x[i], s) for i, s in enumerate(samples)])
    assert batch_len(batch) == n
    pieces = split_batch(batch, micro)
    assert [batch_len(p) for p in pieces] == [min(micro, n - i) for i in range(0, n, micro)]
    assert torch.equal(torch.cat([p[0] for p in pieces]), x)  # every sample once, in order
    to_device(pieces[0], torch.device("cpu"))


def test_collation_equals_default_collate_where_that_succeeds_and_goes_on_where_it_fails():
    samples = [(torch.randn(3), torch.tensor(i), "s", {"k": i}) for i in range(4)]
    expected = torch.utils.data.default_collate(samples)
    got = collate(samples)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[2] == expected[2] and torch.equal(got[3]["k"], expected[3]["k"])
    mixed = collate([{"x": torch.ones(2), "meta": None}, {"x": torch.zeros(2), "meta": Bag(1)}])
    assert isinstance(mixed["meta"], PerSample) and mixed["meta"][0] is None
    assert torch.equal(mixed["x"], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    ragged = collate([torch.ones(2), torch.ones(3)])
    assert isinstance(ragged, PerSample) and len(split_batch(ragged, 1)) == 2


class Shapes(torch.utils.data.Dataset):
    """Inputs and labels with any extra structure beside them."""

    def __init__(self, extras):
        self.extras = extras
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(len(extras), 3, generator=g)

    def __len__(self):
        return len(self.extras)

    def __getitem__(self, i):
        return self.x[i], torch.tensor(i % 2), self.extras[i]


def classify(model, batch):
    x, label = batch[0], batch[1]
    return torch.nn.functional.cross_entropy(model(x), label)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extras=st.lists(STRUCTURES, min_size=4, max_size=4))
def test_fit_trains_on_samples_of_any_structure(tmp_path_factory, extras):
    run_dir = tmp_path_factory.mktemp("shapes")
    torch.manual_seed(0)
    config = TrainConfig(
        run_dir=str(run_dir),
        effective_batch_size=4,
        micro_batch_size=2,
        max_steps=2,
        save_every_steps=1,
        device="cpu",
        progress="off",
        memory_watch=False,
    )
    model = torch.nn.Linear(3, 2)
    result = Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), classify, Shapes(extras), config)
    assert result.fit().steps == 2


def test_integer_labels_train_are_killed_and_resume_to_the_bit(tmp_path: Path):
    golden = tmp_path / "golden"
    run = forkserver.run([sys.executable, str(WORKLOADS / "labels.py"), str(golden)])
    assert run.returncode == 0, run.stderr
    killed = tmp_path / "killed"
    first = forkserver.run(
        [sys.executable, str(WORKLOADS / "labels.py"), str(killed), "--kill-at", "5"]
    )
    assert first.returncode == -signal.SIGKILL, first.stderr
    second = forkserver.run([sys.executable, str(WORKLOADS / "labels.py"), str(killed)])
    assert second.returncode == 0, second.stderr
    events = [json.loads(line) for line in (killed / "events.jsonl").read_text().splitlines()]
    resumed = [e["step"] for e in events if e["event"] == "resume"]
    assert resumed in ([2], [4])  # step 4's save may still be in flight at the kill
    want = torch.load(golden / "params.pt", weights_only=True)
    got = torch.load(killed / "params.pt", weights_only=True)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("value", [torch.tensor(True), torch.tensor(2.5, dtype=torch.float16)])
def test_zero_dim_tensors_of_any_dtype_are_digested(value):
    assert data_fingerprint([value]) != data_fingerprint([value.clone().zero_()])
