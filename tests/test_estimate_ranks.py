"""The estimate per rank (`--gpus N --distributed replicate|fsdp`): the arithmetic of a
Qwen2-1.5B-shaped model on two ranks, the command's verdict and its fewest-GPUs line, the plan
of one rank's share, and each rank's model state measured on two gloo ranks under the run's own
FSDP2 sharding."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import forkserver
import pytest
from conftest import WORKLOADS
from transformers import Qwen2Config

from steadytrain.cli.memory_commands import estimate_command, plan_command
from steadytrain.errors import BadInputError
from steadytrain.memory.estimate import Settings, estimate, per_rank

ROOT = 151_936 * 1536 + 1536
"""Qwen2-1.5B's root unit: the (tied) embedding and the final norm."""
LAYER = (
    (1536 * 1536 + 1536)  # q_proj with its bias
    + 2 * (256 * 1536 + 256)  # k_proj, v_proj (2 kv heads of 128)
    + 1536 * 1536  # o_proj
    + 3 * 1536 * 8960  # gate, up, down
    + 2 * 1536  # the two norms
)
PARAMS = ROOT + 28 * LAYER


def qwen2_1_5b() -> Qwen2Config:
    config = Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151_936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return config


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2-1.5b")
    qwen2_1_5b().save_pretrained(folder)
    return folder


GPU = {"device_type": "cuda", "precision": "bf16", "memory_budget": "16GiB"}


def test_fsdp_divides_the_model_state_and_adds_the_gathered_layers():
    """fp32 weights, AdamW, 2 ranks: every first dimension of this shape is even, so each rank
    holds exactly half of every parameter, gradient and state; the root (embedding, final
    norm) and two decoder layers are gathered whole, and the backward holds the root's gradient
    and two of a layer's."""
    settings = Settings(**{k: v for k, v in GPU.items() if k != "memory_budget"})
    one = estimate(qwen2_1_5b(), settings)
    ranks = per_rank(qwen2_1_5b(), settings, world_size=2, distributed="fsdp")
    assert one.params == PARAMS
    rows = {r.name: r.bytes for r in ranks.rows}
    assert rows["weights"] == PARAMS // 2 * 4
    assert rows["gradients"] == PARAMS // 2 * 4
    assert rows["optimizer states"] == 2 * PARAMS // 2 * 4
    assert rows["optimizer step temporaries"] == PARAMS // 2 * 4
    assert rows["FSDP gathered parameters"] == (ROOT + 2 * LAYER) * 4
    assert rows["FSDP gradient buffers (backward)"] == (ROOT + 2 * LAYER) * 4
    assert rows["unsharded gradients between micro-batches"] == 0
    assert rows["activations"] == one.row("activations")  # each rank's own micro-batch
    assert (ranks.world_size, ranks.distributed) == (2, "fsdp")
    assert ranks.total < one.total
    # More micro-batches a step: every layer's gradient is held whole until the last backward.
    held = per_rank(qwen2_1_5b(), settings, world_size=2, distributed="fsdp", accumulation=4)
    assert held.row("unsharded gradients between micro-batches") == PARAMS * 4
    assert held.peak - ranks.peak >= PARAMS * 4 - (ROOT + 2 * LAYER) * 4
    # Replicated, a rank holds what one process holds; offloaded, the shards leave the device.
    replicated = per_rank(qwen2_1_5b(), settings, world_size=2, distributed="ddp")
    assert (replicated.distributed, replicated.total) == ("replicate", one.total)
    offloaded = per_rank(qwen2_1_5b(), replace(settings, fsdp_offload=True), 2, "fsdp")
    assert offloaded.row("optimizer states") == 0
    assert offloaded.host == PARAMS // 2 * 4 * 5  # weights, gradients, 2 states, temporaries


def test_estimate_gpus_2_fsdp_says_per_rank_and_the_fewest_gpus_with_the_savers(qwen_dir, capsys):
    """The issue's case: the whole state of a 1.5B full fine-tune over two 16 GiB GPUs."""
    code = estimate_command(str(qwen_dir), json_output=True, gpus=2, distributed="fsdp", **GPU)
    found = json.loads(capsys.readouterr().out)
    assert code == 3
    assert (found["world_size"], found["distributed"], found["per_rank"]) == (2, "fsdp", True)
    assert found["settings"]["gpus"] == 2
    fewest = found["fewest_gpus"]
    assert fewest[-1]["gpus"] == 2 and "--fsdp-offload" in fewest[-1]["savers"]
    assert fewest[-1]["total_bytes_per_rank"] <= 16 * 2**30
    assert fewest[-1]["line"].startswith("fits on 2 GPUs of 16.0 GiB with fsdp and")
    # the command it names is the one that fits: the savers' flags in it
    command = fewest[-1]["line"].rsplit("`", 2)[-2]
    assert command.startswith("--gpus 2 --distributed fsdp") and "--fsdp-offload" in command
    assert len(fewest) == 1 or (fewest[0]["gpus"] > 2 and fewest[0]["savers"] == [])

    code = estimate_command(
        str(qwen_dir), gpus=2, distributed="fsdp", fsdp_offload=True, checkpointing=True, **GPU
    )
    said = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "fits on 2 GPUs of 16.00 GiB with fsdp" in said
    assert "each of 2 ranks (fsdp)" in said
    assert "in pinned host memory" in said


def test_ddp_whose_replicated_state_exceeds_a_gpu_does_not_fit_and_names_fsdp(
    qwen_dir, capsys, monkeypatch
):
    """Replicated, the 1.5B model's state alone is 23 GiB a rank; the ranks come from torchrun's
    WORLD_SIZE when --gpus is not given."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = estimate_command(str(qwen_dir), distributed="ddp", **GPU)
    said = " ".join(capsys.readouterr().out.split())
    assert code == 3
    assert "does not fit on 2 GPUs of 16.00 GiB with replicate" in said
    assert "no micro-batch fits; shard it with --distributed fsdp" in said
    assert "`--distributed fsdp` →" in said
    assert "fits on 2 GPUs of 16.0 GiB with fsdp and" in said


def test_distributed_auto_shards_where_the_state_exceeds_a_rank(qwen_dir, capsys):
    estimate_command(str(qwen_dir), json_output=True, gpus=2, distributed="auto", **GPU)
    found = json.loads(capsys.readouterr().out)
    assert found["distributed"] == "fsdp"
    assert "exceed one rank's budget" in found["distributed_reason"]
    estimate_command(str(qwen_dir), json_output=True, gpus=2, **{**GPU, "memory_budget": "80GiB"})
    assert json.loads(capsys.readouterr().out)["distributed"] == "replicate"


def test_the_plan_on_two_ranks_plans_each_ranks_share_from_the_estimate(qwen_dir, capsys):
    code = plan_command(
        str(qwen_dir),
        16,
        json_output=True,
        gpus=2,
        distributed="fsdp",
        fsdp_offload=True,
        **GPU,
    )
    found = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (found["world_size"], found["distributed"], found["per_rank"]) == (2, "fsdp", True)
    assert found["effective_batch_size"] == 8  # each rank's share of 16
    assert (found["rank_batch"], found["fsdp_offload"]) == (8, True), found
    assert any("2 ranks (fsdp" in r for r in found["reasons"])
    # each size at its own total: the whole share (micro 8, one micro-batch) holds no whole
    # gradients between micro-batches, which micro 4 (two) does; a line through 1 and 2 keeps them
    by_size = {
        c["micro"]: c["peak"]
        for c in found["candidates"]
        if c["mode"] == "checkpointed, inputs offloaded to host, chunked loss"
    }
    settings = Settings(**{k: v for k, v in GPU.items() if k != "memory_budget"})
    settings = replace(settings, checkpointing=True, offload=True, chunked_loss=True)
    settings = replace(settings, fsdp_offload=True, micro_batch_size=8)
    whole = per_rank(qwen2_1_5b(), settings, world_size=2, distributed="fsdp", accumulation=1)
    assert by_size[8] == int(whole.total), (by_size, whole.total)
    assert by_size[8] < by_size[4] - 4 * 2**30, by_size
    # and a sharded pass costs more than its samples (every layer gathered): the whole share,
    # one pass a step, where it fits (was micro 1 × 8 with checkpointing at 96 % of the budget)
    assert (found["micro_batch_size"], found["rank_micro_steps"]) == (8, 1), found["reasons"]
    with pytest.raises(BadInputError, match="--probe: a probe measures one process"):
        plan_command(str(qwen_dir), 16, gpus=2, distributed="fsdp", probe=True, **GPU)


def test_the_plan_on_two_ranks_says_what_each_rank_runs_and_the_group_s_batch(qwen_dir, capsys):
    """The table's title speaks per rank, as a run's plan line does: the micro-batch and the
    steps are each rank's (its share is 8 of 16), the effective batch the group's."""
    args = {"gpus": 2, "distributed": "fsdp", "fsdp_offload": True, **GPU}
    assert plan_command(str(qwen_dir), 16, **args) == 0
    printed = capsys.readouterr().out
    title = printed.splitlines()[0]
    micro = int(re.search(r"micro-batch (\d+) per rank", title)[1])
    steps = -(-8 // micro)
    says = f"plan: micro-batch {micro} per rank × {steps} step{'s' * (steps > 1)} × 2 ranks"
    assert title.startswith(f"{says} (effective batch 16)"), title
    # the reasons count the same way (they said "the effective batch stays 8", a rank's share)
    runs = f"{steps} micro-batch{'es' * (steps > 1)} of {micro} of its share of 8"
    reason = f"accumulation {steps} on each of 2 ranks: {runs}, the effective batch stays 16"
    assert reason in " ".join(printed.split()), printed


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"gpus": 2, "distributed": "none"}, "--distributed: none (one process) with --gpus 2"),
        ({"gpus": 0}, "--gpus: 0 is not positive"),
        ({"gpus": 2, "distributed": "ddp", "fsdp_offload": True}, "--fsdp-offload: FSDP2's"),
        ({"distributed": "zero3"}, "--distributed: 'zero3' is not one of"),
    ],
)
def test_bad_ranks_settings_are_refused_naming_the_flag(qwen_dir, given, says):
    with pytest.raises(BadInputError, match=re.escape(says)):
        estimate_command(str(qwen_dir), **{**GPU, **given})


def test_each_gloo_rank_holds_what_the_estimate_says(tmp_path: Path):
    """Two gloo ranks shard a tiny Llama as a run does (odd first dimensions: FSDP2 pads them)
    and take one AdamW step of two micro-batches: the storages behind each rank's parameters
    and gradients, its AdamW moments (rank 0 holds the larger half of an odd dimension) and the
    unsharded gradients it held between the micro-batches are the estimate's rows."""
    command, env = forkserver.torchrun_command(WORKLOADS / "fsdp_state.py", str(tmp_path))
    done = forkserver.run(command, env=env, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    sys.path.insert(0, str(WORKLOADS))
    try:
        from fsdp_state import LENGTH, config
    finally:
        sys.path.remove(str(WORKLOADS))
    settings = Settings(seq=LENGTH, device_type="cpu")
    expected = per_rank(config(), settings, world_size=2, distributed="fsdp", accumulation=2)
    for rank in (0, 1):
        measured = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert measured["weights"] == expected.row("weights")
        assert measured["gradients"] == expected.row("gradients")
        assert measured["held"] == expected.row("unsharded gradients between micro-batches")
        assert measured["states"] <= expected.row("optimizer states")
    assert measured["states"] < expected.row("optimizer states")  # rank 1: the smaller half
    rank0 = json.loads((tmp_path / "rank-0.json").read_text())
    assert rank0["states"] == expected.row("optimizer states")


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"device": "cpu"}, "fsdp_offload: needs a GPU with memory of its own (CUDA); on cpu"),
        ({"device": "mps"}, "fsdp_offload: needs a GPU with memory of its own (CUDA); on mps"),
        ({"distributed": "ddp"}, "fsdp_offload: FSDP2's offload policy needs a sharded model"),
    ],
)
def test_fsdp_offload_is_refused_where_it_frees_nothing(fields, said):
    """The run's `fsdp_offload` (the estimate's `--fsdp-offload`) is refused, naming the field,
    on a device whose memory is the host's and with a replicated model."""
    from steadytrain.config import TrainConfig
    from steadytrain.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        TrainConfig(effective_batch_size=4, fsdp_offload=True, **fields)
    assert said in str(raised.value), raised.value


def tiny_llama():
    """A two-layer Llama of hidden 64 (vocab 256), random init: a live model to shard."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
    )
    return LlamaForCausalLM(config)


def test_the_sharded_plan_is_priced_per_rank_with_the_shards_on_the_host():
    """The plan's per-rank estimate of a live sharded model (`analytic_for(..., sharding=)`):
    one rank's shard of the state on the device, and with fsdp_offload none of it (the host
    holds it); the gathered layers and the activations stay."""
    import torch

    from steadytrain.memory.analytic import Sharding, analytic_for
    from steadytrain.memory.choice import Mode

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = {"input_ids": torch.zeros(2, 128, dtype=torch.long)}
    found = {}
    for name, sharding in (
        ("one", None),
        ("fsdp", Sharding(2, 2)),
        ("offload", Sharding(2, 2, fsdp_offload=True)),
    ):
        analytic, why = analytic_for(
            model,
            batch,
            precision="bf16",
            optimizer=optimizer,
            device_type="cuda",
            sharding=sharding,
        )
        assert analytic is not None, why
        found[name] = analytic.of(1, Mode())
    one, fsdp, offload = found["one"], found["fsdp"], found["offload"]
    assert (fsdp.world_size, fsdp.distributed) == (2, "fsdp")
    assert 0 < fsdp.row("optimizer states") < one.row("optimizer states")
    assert offload.row("weights") == offload.row("optimizer states") == 0
    assert offload.row("FSDP gathered parameters") == fsdp.row("FSDP gathered parameters") > 0
    assert offload.ranks.host > 0 and offload.total < fsdp.total


def test_shard_hands_fsdp2_the_offload_policy(monkeypatch):
    """`fsdp_offload` reaches FSDP2: every unit (each decoder layer and the root) is sharded
    with `CPUOffloadPolicy`, and the `sharding` record says so. FSDP2 refuses that policy on a
    machine without an accelerator, so `fully_shard` is stood in for here; the GPU runs it."""
    import torch
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    from steadytrain.engine import sharding
    from steadytrain.engine.distributed import Group

    calls = []

    class Unit:
        pass

    monkeypatch.setattr(sharding, "_fsdp2", lambda gloo: (Unit, lambda m, **kw: calls.append(kw)))
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *a, **kw: "mesh")

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

    model = torch.nn.Sequential(torch.nn.ModuleList([Layer(), Layer()]))
    found = sharding.shard(model, Group(world_size=2), offload=True)
    assert found["offload"] is True and found["blocks"] == 2
    assert len(calls) == 3, calls
    assert all(isinstance(kw["offload_policy"], CPUOffloadPolicy) for kw in calls), calls
    calls.clear()
    assert sharding.shard(model, Group(world_size=2))["offload"] is False
    assert calls and all("offload_policy" not in kw for kw in calls), calls


def test_the_shards_go_to_the_host_before_sharding_where_only_that_fits(tmp_path, monkeypatch):
    """`micro_batch_size: auto` under fsdp on a GPU: where the per-rank estimate puts one sample
    with every saver over a rank's budget with the shards on the GPU, and within it with them in
    host memory, the run shards with FSDP2's offload policy by itself (it must be decided before
    sharding: no pass can run before). Recorded in fit_start's `distributed` with both figures;
    never on a device without memory of its own; a rerun shards as its checkpoint's run did.
    FSDP2 refuses the policy without an accelerator and the ranks are one process here, so
    `fully_shard`, the mesh and the ranks' collectives are stood in for, and the device is a
    stand-in GPU (its tensors stay on the CPU); the GPU runs the real thing."""
    import types

    import torch
    import torch.distributed.device_mesh as device_mesh

    from steadytrain import TrainConfig
    from steadytrain.engine import sharding
    from steadytrain.engine.distributed import Group
    from steadytrain.trainer import parts
    from steadytrain.trainer.data import make_sampler
    from steadytrain.trainer.program import Program

    calls = []

    class Unit:
        pass

    monkeypatch.setattr(sharding, "_fsdp2", lambda gloo: (Unit, lambda m, **kw: calls.append(kw)))
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *a, **kw: "mesh")
    monkeypatch.setattr(Group, "broadcast_module", lambda self, model: None)
    monkeypatch.setattr(Group, "broadcast_object", lambda self, obj: obj)
    monkeypatch.setattr(Group, "largest", lambda self, values: values)
    model = tiny_llama()
    rows = [{"input_ids": torch.zeros(128, dtype=torch.long)} for _ in range(8)]
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"), effective_batch_size=4, distributed="fsdp", compile=False
    )
    program = Program.check(
        cfg,
        model=model,
        optimizer=lambda params: torch.optim.AdamW(params),
        loss_fn=lambda m, b: m(**b, labels=b["input_ids"]).loss,
        train_data=rows,
        scheduler=None,
        callbacks=(),
        collate_fn=None,
        eval_data=None,
        eval_fn=None,
        user_state=None,
    )
    estimating = parts._Estimating(
        program, types.SimpleNamespace(name="bf16"), make_sampler(program.data, cfg)
    )

    def place(budget: int, kind: str = "cuda") -> dict:
        calls.clear()
        device = types.SimpleNamespace(
            type=kind, discrete_memory=kind == "cuda", budget=budget, torch_device="cpu"
        )
        _, found = parts._place(cfg, model, Group(world_size=2), device, estimating)
        assert [("offload_policy" in kw) for kw in calls] == [found["offload"]] * 3, calls
        return found

    roomy = place(2**40)  # fits with the shards on the GPU: they stay there
    choice = roomy["offload_choice"]
    assert roomy["offload"] is False and choice["on"] is False, roomy
    assert choice["on_host"] < choice["on_device"], choice
    assert choice["mode"] == "checkpointed, inputs offloaded to host", choice
    between = (choice["on_host"] + choice["on_device"]) // 2
    chosen = place(between)
    assert chosen["offload"] is True and chosen["offload_choice"]["on"] is True, chosen
    assert "fsdp_offload: on, chosen before sharding" in chosen["reason"], chosen["reason"]
    too_small = place(choice["on_host"] - 1)  # nothing fits either way: the plan says so
    assert too_small["offload"] is False and too_small["offload_choice"]["on"] is False
    on_cpu = place(between, "cpu")  # host memory is the device's: nothing to free
    assert on_cpu["offload"] is False and "offload_choice" not in on_cpu, on_cpu

    saved = tmp_path / "run" / "checkpoints" / "step-00000002"
    saved.mkdir(parents=True)
    (saved / "trainer_state.json").write_text(json.dumps({"state": {"fsdp_offload": True}}))
    rerun = place(2**40)  # the checkpoint's run had the shards on the host: so does its rerun
    assert rerun["offload"] is True and "offload_choice" not in rerun, rerun
    assert "as the run that saved the checkpoint had them" in rerun["reason"], rerun["reason"]
