"""Every rank of a multi-process launch works on its own GPU only (CI has no GPU: a CUDA double).

On two real GPUs, rank 1 held memory on GPU 0 and hung in NCCL's communicator set-up: the
device resolved for "auto"/"cuda" was cuda:0 on every rank outside the Trainer (the fine-tune
loads its base there), and nothing made the rank's GPU current, so FSDP's device mesh and
fully_shard (which take "the current device") ran rank 1's all-gathers on cuda:0. Here torch's
CUDA calls are recorded instead of made.
"""

from __future__ import annotations

import pytest
import torch

from steadytrain.device import core
from steadytrain.device.backends import CUDABackend
from steadytrain.errors import DeviceUnavailableError


class TwoGPUs(CUDABackend):
    """Two CUDA devices that compute nothing: `select` is the real one (torch.cuda.set_device,
    recorded by the fixture); probes are recorded in the same list, so the order shows."""

    def __init__(self, calls: list):
        self.calls = calls

    def is_built(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def probe(self, index: int) -> None:
        self.calls.append(("probe", index))


@pytest.fixture
def calls(monkeypatch) -> list:
    made: list = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda device: made.append(("set_device", _index(device)))
    )
    return made


def _index(device) -> int:
    return device if isinstance(device, int) else torch.device(device).index


def _launched(monkeypatch, local_rank: int, world_size: int = 2) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


@pytest.mark.parametrize("spec", ["auto", "cuda"])
@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_each_rank_resolves_and_selects_its_own_gpu(monkeypatch, calls, spec, rank):
    _launched(monkeypatch, rank)
    device = core.resolve_device(spec, backends={"cuda": TwoGPUs(calls)})
    assert device.torch_device == torch.device("cuda", rank)
    # current before anything runs on it: the probe's matmul included
    assert calls == [("set_device", rank), ("probe", rank)]


def test_one_process_keeps_cuda_0_and_makes_it_current(monkeypatch, calls):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # left over, without a launch of several processes
    device = core.resolve_device("auto", backends={"cuda": TwoGPUs(calls)})
    assert device.torch_device == torch.device("cuda", 0)
    assert calls == [("set_device", 0), ("probe", 0)]


def test_an_explicit_index_is_kept_and_made_current(monkeypatch, calls):
    _launched(monkeypatch, 1)
    device = core.resolve_device("cuda:0", backends={"cuda": TwoGPUs(calls)})
    assert device.torch_device == torch.device("cuda", 0)
    assert calls == [("set_device", 0), ("probe", 0)]


@pytest.mark.parametrize("spec", ["auto", "cuda"])
def test_more_processes_than_gpus_is_refused_naming_the_launch(monkeypatch, calls, spec):
    _launched(monkeypatch, 2, world_size=3)
    with pytest.raises(DeviceUnavailableError, match=r"LOCAL_RANK 2.*nproc_per_node"):
        core.resolve_device(spec, backends={"cuda": TwoGPUs(calls)})
    assert calls == []  # nothing touched GPU 0 on the way


def test_fsdp_makes_the_rank_s_gpu_current_before_its_device_mesh(monkeypatch, calls):
    """`init_device_mesh("cuda", ...)` and `fully_shard` run their collectives on the current
    device; on rank 1 that must be cuda:1 before the mesh exists."""
    import torch.distributed.device_mesh as device_mesh

    from steadytrain.engine import sharding
    from steadytrain.engine.distributed import Group

    class MeshBuilt(Exception):
        pass

    def mesh(device_type, shape, **kw):
        calls.append(("mesh", device_type))
        raise MeshBuilt

    monkeypatch.setattr(device_mesh, "init_device_mesh", mesh)
    group = Group(rank=1, world_size=2, local_rank=1, backend="cuda:nccl", device="cuda:1")
    with pytest.raises(MeshBuilt):
        sharding.shard(torch.nn.Linear(2, 2), group)
    assert calls == [("set_device", 1), ("mesh", "cuda")]


def test_the_trainer_s_rank_group_collects_on_the_resolved_gpu(monkeypatch, calls):
    """The group's small collectives (sample count, agreement) live on the device the rank
    resolved, and that device is the rank's own GPU."""
    from steadytrain.engine.distributed import Group

    _launched(monkeypatch, 1)
    group = Group(rank=1, world_size=2, local_rank=1, backend="cpu:gloo,cuda:nccl")
    device = core.resolve_device(group.device_name("auto"), backends={"cuda": TwoGPUs(calls)})
    assert group.on(device.torch_device).device == "cuda:1"
    assert calls[0] == ("set_device", 1)


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("cuda:nccl", "cuda:1"), ("nccl", "cuda:1"), ("cpu:gloo,cuda:nccl", "cpu"), ("gloo", "cpu")],
)
def test_the_end_of_fit_rendezvous_uses_a_device_the_backend_serves(monkeypatch, backend, expected):
    """`settle` runs on the group `from_env` made (device "cpu"); with a script's NCCL-only
    group a CPU tensor fails ("No backend type associated with device type cpu", seen on two
    GPUs after a run that finished): it must take this rank's current GPU, not cuda:0."""
    import torch.distributed as dist

    from steadytrain.engine import distributed
    from steadytrain.engine.distributed import Group

    met: list = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(distributed, "rendezvous", lambda device="cpu": met.append(str(device)))
    monkeypatch.setattr(distributed, "released", lambda timeout: True)
    Group(rank=1, world_size=2, local_rank=1, backend=backend).settle()
    assert met == [expected, expected]


def test_a_sharded_rank_0_copies_no_model_or_optimizer_state_into_its_capture():
    """Sharded, the model and optimizer are written through DCP; rank 0 copied its DTensor
    shards into the host buffers first (then dropped them), which on CUDA fails: "aten.copy_
    got mixed torch.Tensor and DTensor" at the first checkpoint on two GPUs."""
    from steadytrain.checkpoint.host import HostBuffers
    from steadytrain.checkpoint.ranks import Ranks, RngState
    from steadytrain.checkpoint.run_state import RunState
    from steadytrain.checkpoint.state import ModelState, ObjectState, TrainStateState
    from steadytrain.events import TrainState

    class Untouchable(torch.nn.Module):
        def state_dict(self, *args, **kwargs):
            raise AssertionError("the sharded model was captured")

    class Optimizer:
        def state_dict(self):
            raise AssertionError("the sharded optimizer was captured")

    ranks = Ranks(rank=0, world_size=2, sharded=True)
    train = TrainState(steps_per_epoch=4, max_steps=8, effective_batch_size=8, micro_batch_size=1)
    states = {
        "model": ModelState(Untouchable()),
        "optimizer": ObjectState("optimizer.pt", Optimizer(), "opt", buffered=True),
        "train_state": TrainStateState(train),
        "rng": RngState(ranks),
    }
    state = RunState(states, {"world_size": 2}, ranks)
    payload = state.capture(None, HostBuffers())
    assert "model.safetensors" not in payload.tensors
    assert "optimizer.pt" not in payload.objects
    assert payload.shards is not None


@pytest.mark.parametrize("where", ["engine", "safety"])
def test_a_rendezvous_on_a_gpu_waits_on_the_host_for_every_rank(monkeypatch, where):
    """NCCL's all-reduce returns once queued: the checkpoint's barrier let rank 0 hash the
    folder before rank 1's files were there (a resume then refused the checkpoint)."""
    import torch.distributed as dist

    from steadytrain.checkpoint import ranks as sharded
    from steadytrain.engine import distributed

    order: list = []
    module, function = (
        (distributed, distributed.rendezvous)
        if where == "engine"
        else (sharded, sharded._rendezvous)
    )
    monkeypatch.setitem(module._KEPT, "cuda:1", torch.zeros(1))  # no GPU here: a stand-in
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: order.append("all_reduce"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append(str(device)))
    function(torch.device("cuda", 1))
    assert order == ["all_reduce", "cuda:1"]
