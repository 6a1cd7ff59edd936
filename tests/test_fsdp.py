"""`distributed: fsdp` (FSDP2 on CPU/gloo, 2 processes) with a small Llama and LoRA, its
checkpoints through torch.distributed.checkpoint, the ranks' own RNG streams, and the
`distributed` config field (tests/workloads/fsdp_llama.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import WORKLOADS, real_oom, run_workload

from steadytrain import TrainConfig
from steadytrain.engine.distributed import Group
from steadytrain.engine.sharding import choose, repeated_blocks, state_bytes
from steadytrain.errors import BAD_INPUT_EXIT, SHRINK_EXIT, ConfigError
from steadytrain.telemetry.files import read_jsonl

DCP_FILES = {".metadata", "__0_0.distcp", "__1_0.distcp"}
RNG_FILES = {"rng.safetensors", "rng-rank-0.safetensors", "rng-rank-1.safetensors"}


def torchrun(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """tests/workloads/fsdp_llama.py under `torchrun --nproc_per_node 2` on a free port."""
    command, env = forkserver.torchrun_command(
        WORKLOADS / "fsdp_llama.py",
        *args,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    return forkserver.run(command, env=env, timeout=300)


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "params.pt", weights_only=True)


def largest_difference(a: Path, b: Path) -> float:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    return max(float((pa[k] - pb[k]).norm() / pb[k].norm()) for k in pb)


def bitwise_equal(a: Path, b: Path) -> bool:
    pa, pb = params(a), params(b)
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pb)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """4 steps of the Llama with LoRA under distributed: fsdp, a checkpoint every 2 steps."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    done = torchrun(str(run_dir))
    assert done.returncode == 0, done.stderr + done.stdout
    return run_dir


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The same run with rank 1 SIGKILLed at the end of step 3: the step-2 checkpoint stays."""
    run_dir = tmp_path_factory.mktemp("fsdp-killed") / "run"
    done = torchrun(str(run_dir), "--kill-at", "3")
    assert done.returncode != 0, done.stdout
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    return run_dir


def test_fsdp_shards_the_blocks_and_checkpoints_through_dcp(uninterrupted: Path):
    """Acceptance 5: every rank wrote its shard and its RNG streams into the checkpoint, the
    manifest lists every file, and no whole-model file was written."""
    for events in ("events.jsonl", "ranks/rank-1/events.jsonl"):
        start = next(e for e in read_jsonl(uninterrupted / events) if e["event"] == "fit_start")
        assert start["distributed"]["mode"] == "fsdp"
        assert start["distributed"]["blocks"] == 2
        assert start["distributed"]["kinds"] == "LlamaDecoderLayer"
    folder = uninterrupted / "checkpoints" / "step-00000004"
    present = {p.name for p in folder.iterdir()} - {"MANIFEST.json"}
    assert present == DCP_FILES | RNG_FILES | {"trainer_state.json"}
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == present
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (folder / name).stat().st_size
    assert not (uninterrupted / "ranks" / "rank-1" / "checkpoints").exists()
    assert json.loads((uninterrupted / "result.json").read_text())["steps"] == 4


def test_fsdp_equals_one_process(uninterrupted: Path, tmp_path: Path):
    """The reduce-scatter sums (the losses carry the global weights): 2 sharded ranks give one
    process's LoRA update up to reduction order."""
    one = run_workload("fsdp_llama.py", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    assert largest_difference(uninterrupted, tmp_path / "one") <= 1e-6


def test_fsdp_resume_with_the_same_world_size_is_bitwise_exact(
    uninterrupted: Path, killed: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    resumed = torchrun(str(run_dir), env={"STEADYTRAIN_RESTART": "1"})
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    for events in ("events.jsonl", "ranks/rank-1/events.jsonl"):
        rows = read_jsonl(run_dir / events)
        assert [e["step"] for e in rows if e["event"] == "resume"] == [2]
        assert not [e for e in rows if e["event"] == "resume_override"]
    assert bitwise_equal(run_dir, uninterrupted)


def test_fsdp_checkpoint_resumes_on_one_process(uninterrupted: Path, killed: Path, tmp_path: Path):
    """A GPU lost: DCP loads the shards of 2 ranks into the plain model of one process."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    one = run_workload("fsdp_llama.py", str(run_dir))
    assert one.returncode == 0, one.stderr
    events = read_jsonl(run_dir / "events.jsonl")
    changes = [e["change"] for e in events if e["event"] == "resume_override"]
    assert changes == ["world_size: 2 -> 1"]
    notes = [e["message"] for e in events if e["event"] == "note" and "RNG" in e["message"]]
    assert notes == [
        "RNG streams: saved by 2 rank(s), resumed on 1: every rank takes rank 0's streams"
    ]
    assert [e["step"] for e in events if e["event"] == "resume"] == [2]
    assert largest_difference(run_dir, uninterrupted) <= 1e-6
    # One process writes the single-process format from then on.
    assert (run_dir / "checkpoints" / "step-00000004" / "model.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_shards_in_host_memory_on_two_gpus_give_one_process_s_update(tmp_path: Path):
    """`fsdp_offload: true` (FSDP2's CPUOffloadPolicy, which needs an accelerator): the shards of
    parameters, gradients and AdamW's state in pinned host memory, the chunked loss through the
    root's gathered head; two NCCL ranks give one GPU process's update."""
    # plain processes: a rank forked from the warm server cannot initialise CUDA
    command, env = forkserver.torchrun_command(
        WORKLOADS / "fsdp_llama.py",
        str(tmp_path / "two"),
        "--device",
        "cuda",
        "--fsdp-offload",
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        fork_ranks=False,
    )
    two = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-4000:] + two.stdout[-2000:]
    for events in ("events.jsonl", "ranks/rank-1/events.jsonl"):
        start = next(e for e in read_jsonl(tmp_path / "two" / events) if e["event"] == "fit_start")
        assert start["distributed"]["offload"] is True, start["distributed"]
        assert "nccl" in str(start["process_group"]["backend"]), start["process_group"]
    script = [sys.executable, str(WORKLOADS / "fsdp_llama.py"), str(tmp_path / "one")]
    one = subprocess.run([*script, "--device", "cuda"], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-4000:]
    assert largest_difference(tmp_path / "two", tmp_path / "one") <= 1e-5


def test_out_of_memory_under_fsdp_exits_76_with_the_event(tmp_path: Path):
    """The forward's all-gather leaves no point where the ranks could agree: the rank that ran
    out records its `oom` event and exits 76; torchrun ends the other rank."""
    done = torchrun(str(tmp_path / "run"), "--oom-rank", "1")
    assert done.returncode != 0
    assert f"exitcode  : {SHRINK_EXIT}" in done.stderr  # torchrun's summary of rank 1
    events = read_jsonl(tmp_path / "run" / "ranks/rank-1/events.jsonl")
    (oom,) = [e for e in events if e["event"] == "oom"]
    assert oom["rank"] == 1 and real_oom(oom["error"])
    assert oom["phase"] == "forward"
    assert not [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "oom"]


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("dropout") / "run"
    done = torchrun(str(run_dir), "--model", "dropout", "--distributed", "replicate")
    assert done.returncode == 0, done.stderr + done.stdout
    return run_dir


def test_each_rank_draws_its_own_dropout_masks(dropout_run: Path):
    """Seeded with seed + rank: the ranks' first dropout masks differ."""
    masks = [torch.load(dropout_run / f"mask-rank-{r}.pt", weights_only=True) for r in (0, 1)]
    assert masks[0].shape == masks[1].shape and not torch.equal(masks[0], masks[1])
    folder = dropout_run / "checkpoints" / "step-00000004"
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert set(manifest["files"]) >= RNG_FILES and "model.safetensors" in manifest["files"]


def test_dropout_resume_with_the_same_world_size_is_bitwise_exact(
    dropout_run: Path, tmp_path: Path
):
    """Each rank takes its own RNG streams back, so the masks after the resume are the ones the
    uninterrupted run drew."""
    run_dir = tmp_path / "run"
    common = ("--model", "dropout", "--distributed", "replicate")
    first = torchrun(str(run_dir), *common, "--kill-at", "3")
    assert first.returncode != 0
    resumed = torchrun(str(run_dir), *common, env={"STEADYTRAIN_RESTART": "1"})
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert bitwise_equal(run_dir, dropout_run)


# -- the config field and the choice (no processes) ------------------------------------------


@pytest.mark.parametrize("value", ["zero3", "FSDP", 2])
def test_a_bad_distributed_value_is_refused_naming_the_field_and_values(value):
    with pytest.raises(ConfigError) as error:
        TrainConfig.from_dict({"run_dir": "r", "distributed": value})
    assert error.value.exit_code == BAD_INPUT_EXIT
    message = str(error.value)
    assert "distributed" in message
    assert all(v in message for v in ("auto", "replicate", "ddp", "fsdp"))


def test_ddp_is_replicate():
    model = torch.nn.Linear(4, 4)
    two = Group(rank=0, world_size=2)
    assert choose("ddp", model, two, None)["mode"] == "replicate"
    assert choose("fsdp", model, two, None)["mode"] == "fsdp"


def test_a_torch_without_what_fsdp_needs_is_refused_naming_the_field(monkeypatch):
    """A torch whose FSDP2 lacks the gloo sum (older releases) is exit 2 naming `distributed`,
    not an AttributeError in the middle of the first step."""
    from torch.distributed.fsdp import FSDPModule

    from steadytrain.engine import sharding

    assert sharding._fsdp2(gloo=True)[0] is FSDPModule  # this torch has it
    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(ConfigError) as info:
        sharding._fsdp2(gloo=True)
    assert info.value.exit_code == 2
    assert "distributed: fsdp needs FSDP2" in str(info.value) and "distributed: replicate" in str(
        info.value
    )
    assert sharding._fsdp2(gloo=False)[0] is FSDPModule  # NCCL does not need it


def test_auto_shards_only_what_does_not_fit_one_rank():
    model = torch.nn.Linear(100, 100)  # 10,100 parameters of 4 bytes, all trainable
    need = state_bytes(model)
    assert need == 10_100 * 4 * 4  # parameters, gradients, AdamW's two moments
    two = Group(rank=0, world_size=2)
    assert choose("auto", model, two, need)["mode"] == "replicate"
    assert choose("auto", model, two, need - 1)["mode"] == "fsdp"
    assert choose("auto", model, Group(), 1)["mode"] == "replicate"  # one process
    assert choose("fsdp", model, Group(), 1)["mode"] == "replicate"
    model.weight.requires_grad_(False)  # a frozen base counts once
    assert state_bytes(model) == 10_000 * 4 + 100 * 4 * 4


def test_the_repeated_blocks_are_sharded_one_by_one():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    blocks = repeated_blocks(LlamaForCausalLM(config))
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 3

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
            self.extra = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()])

    stack = Stack()
    assert repeated_blocks(stack) == list(stack.layers)


def test_a_sharded_checkpoint_missing_a_shard_is_skipped(uninterrupted: Path, tmp_path: Path):
    """The manifest lists every rank's files: one shard gone, the checkpoint does not verify
    and the one before it is used."""
    from steadytrain.checkpoint.state import REQUIRED_FILES
    from steadytrain.checkpoint.store import CheckpointStore

    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted / "checkpoints", run_dir / "checkpoints")
    (run_dir / "checkpoints" / "step-00000004" / "__1_0.distcp").unlink()
    logged = []
    store = CheckpointStore(
        run_dir, 2, log=lambda e, i: logged.append((e, i)), required=REQUIRED_FILES
    )
    step, path = store.latest()
    assert step == 2
    (skipped,) = [i for e, i in logged if e == "checkpoint_skipped"]
    assert "__1_0.distcp" in " ".join(skipped["problems"])
    assert set(store.load(path).sharded) == DCP_FILES  # verified, left for DCP to read


def test_the_fine_tune_config_passes_distributed_through():
    from steadytrain.recipes.finetune_config import FinetuneConfig

    config = FinetuneConfig(model_name_or_path="m", train_file="t.jsonl", distributed="fsdp")
    assert config.to_train_config().distributed == "fsdp"
    with pytest.raises(ConfigError, match=r"distributed: must be 'auto', 'replicate', 'ddp'"):
        FinetuneConfig(model_name_or_path="m", train_file="t.jsonl", distributed="zero")


@pytest.mark.parametrize(
    ("backends", "expected"),
    [("nccl", "cuda:1"), ("cpu:gloo,cuda:nccl", "cpu"), ("gloo", "cpu")],
)
def test_a_collective_of_host_memory_shards_goes_where_the_group_serves_it(
    monkeypatch, backends, expected
):
    """With `fsdp_offload` the parameters and gradients are CPU tensors; an NCCL-only group (what
    `init_process_group()` makes on a CUDA machine) takes none: the checkpoint's rendezvous and
    the sharded gradient norm's all-reduce go to this rank's GPU there (two GPUs: "No backend
    type associated with device type cpu" at the first save), and stay on the CPU where the
    group has gloo."""
    from steadytrain.device.core import collective_device
    from steadytrain.engine.distributed import Group

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert collective_device(torch.device("cpu"), backends) == torch.device(expected)
    assert collective_device(torch.device("cuda", 0), backends) == torch.device("cuda", 0)
    # the group's own collectives (its end-of-fit rendezvous) go the same way
    group = Group(rank=0, world_size=2, device="cpu", backend=backends)
    assert group.collective_device() == expected
