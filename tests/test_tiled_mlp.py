"""The tiled MLP (memory/tiled_mlp.py): each decoder layer's MLP over a piece of the tokens at a
time gives the untiled model's loss and gradients; the ladder reaches it last, a resumed run
keeps it; the estimate prices it at long sequences only; the planner turns it on where one
sample does not fit otherwise, and `plan` says the longer --seq it allows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_plan import PassClock, llama_1b_dir
from transformers import LlamaConfig, LlamaForCausalLM

from steadytrain.events import TrainState
from steadytrain.memory.choice import Mode
from steadytrain.memory.chunked_loss import CausalLMLoss
from steadytrain.memory.savers import MemorySavers
from steadytrain.memory.settings import DEFAULT_TILE_TOKENS
from steadytrain.memory.tiled_mlp import set_tiling, tiled_tokens, token_wise_mlps

GiB = 2**30
VOCAB = 96


@pytest.fixture
def clock(monkeypatch) -> PassClock:
    """The planner's clock: a pass takes the seconds it spends (test_plan.py's)."""
    import steadytrain.memory.probe as probe_module

    fake = PassClock()
    monkeypatch.setattr(probe_module, "time", fake)
    return fake


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).train()


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_the_tiled_mlp_gives_the_untiled_loss_and_gradients(checkpointing):
    """2 × 40 tokens in pieces of 16 (the last one 16 of 80 rows, then 16: uneven on purpose,
    and each piece spans both samples' rows in turn): the loss and every gradient but the MLP
    weights' are bitwise the untiled model's (the MLP is token-wise: each row's values are
    the whole's); the MLP weights' gradients are the same sums over the same tokens, added in
    pieces, equal to fp32's rounding of the order."""
    model = tiny_llama()
    if checkpointing:  # the pieces' checkpoints nested in the layers' own (inputs offloaded)
        MemorySavers(model, CausalLMLoss(), discrete_memory=True).set_checkpointing(checkpointing)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(model, ids)
    assert set_tiling(model, 16) == 2 and tiled_tokens(model) == 16
    tiled_loss, tiled_grads = loss_and_grads(model, ids)
    assert torch.equal(tiled_loss, loss)
    for name, grad in grads.items():
        if ".mlp." in name:
            torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-6, atol=1e-8)
        else:
            assert torch.equal(tiled_grads[name], grad), name
    set_tiling(model, None)  # off: the class's forward again, nothing left on the instances
    assert tiled_tokens(model) is None
    assert all("forward" not in vars(mlp) for mlp in token_wise_mlps(model))
    assert torch.equal(loss_and_grads(model, ids)[0], loss)


def test_the_ladder_turns_the_tiled_mlp_on_last_and_a_resumed_run_keeps_it():
    """At micro-batch 1 the out-of-memory ladder climbs checkpointing, then the chunked loss
    (no offload on the CPU), then the tiled MLP; the state records its tokens a piece, and a
    run resumed from that state tiles a fresh model the same way; `tiled_mlp: false` never."""
    model, state = tiny_llama(), TrainState()
    savers = MemorySavers(model, CausalLMLoss(), state)
    assert savers.left() == ["activation_checkpointing", "chunked_loss", "tiled_mlp"]
    climbed = [savers.next_rung("test")["saver"] for _ in range(3)]
    assert climbed == ["activation_checkpointing", "chunked_loss", "tiled_mlp"]
    assert state.tiled_mlp == DEFAULT_TILE_TOKENS == tiled_tokens(model)
    assert "the MLPs tiled by 8192 tokens" in savers.describe()
    assert savers.next_rung("test") is None

    fresh, resumed = tiny_llama(), TrainState(tiled_mlp=DEFAULT_TILE_TOKENS, chunked_loss=1024)
    MemorySavers(fresh, CausalLMLoss(), resumed).start(resumed=True)
    assert tiled_tokens(fresh) == DEFAULT_TILE_TOKENS

    asked = tiny_llama()
    MemorySavers(asked, CausalLMLoss(), TrainState(), tiled_mlp=64).start(resumed=False)
    assert tiled_tokens(asked) == 64
    never = MemorySavers(tiny_llama(), CausalLMLoss(), TrainState(), tiled_mlp=False)
    assert "tiled_mlp" not in never.left() and not never.set_tiled_mlp(16)


def test_the_ladder_offers_the_tiled_mlp_only_for_samples_longer_than_a_piece():
    """Samples no longer than one piece run in one piece tiled or not: where the plan saw the
    run's batch, the ladder leaves the tiled MLP out of what is left (a supervised run out of
    memory at micro-batch 1 ends with its advice instead of restarting to tile nothing)."""
    savers = MemorySavers(tiny_llama(), CausalLMLoss(), TrainState())
    savers.see_batch({"input_ids": torch.zeros(2, DEFAULT_TILE_TOKENS, dtype=torch.long)})
    assert savers.left() == ["activation_checkpointing", "chunked_loss"]
    savers.see_batch({"input_ids": torch.zeros(1, DEFAULT_TILE_TOKENS + 1, dtype=torch.long)})
    assert savers.left() == ["activation_checkpointing", "chunked_loss", "tiled_mlp"]
    savers.see_batch([torch.zeros(3)])  # not input_ids: what was seen stays
    assert "tiled_mlp" in savers.left()


def test_a_trainer_with_tiled_mlp_on_trains_the_untiled_run_s_losses(tmp_path: Path):
    """`TrainConfig(tiled_mlp=16)`: the run tiles from the start, its checkpoint's state says
    so, and its losses are the untiled run's (the first bitwise; the steps after differ by the
    MLP gradients' summation order only)."""
    from steadytrain import TrainConfig, Trainer
    from steadytrain.telemetry.files import read_jsonl

    ids = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(3))
    samples = [{"input_ids": row.clone(), "labels": row.clone()} for row in ids]

    def run(name, tiled):
        Trainer(
            model=tiny_llama(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=CausalLMLoss(),
            train_data=samples,
            config=TrainConfig(
                run_dir=str(tmp_path / name),
                effective_batch_size=4,
                micro_batch_size=2,
                max_steps=2,
                save_every_steps=2,
                device="cpu",
                seed=0,
                tiled_mlp=tiled,
            ),
        ).fit()
        state = json.loads(
            next((tmp_path / name).glob("checkpoints/step-*/trainer_state.json")).read_text()
        )
        losses = [m["loss"] for m in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in m]
        return losses, state

    plain, plain_state = run("plain", False)
    tiled, tiled_state = run("tiled", 16)
    assert tiled[0] == plain[0] and tiled == pytest.approx(plain, rel=1e-6)
    assert tiled_state["state"]["tiled_mlp"] == 16 and plain_state["state"]["tiled_mlp"] is None


LORA_1B = {
    "precision": "bf16",
    "weights_dtype": "bf16",
    "method": "lora",
    "lora_targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    "device_type": "cuda",
}


def test_the_estimate_prices_the_tiled_mlp_at_long_sequences_only(tmp_path: Path):
    """The 1B Llama shape, LoRA r16, offloaded checkpointing and the chunked loss: at 131,072
    tokens the tiled MLP takes the recomputed layer's MLP inside (3 × 8,192 bf16 values a token,
    6 GiB) down to one piece's, so the total falls by more than 4 GiB; at 8,192 tokens (one
    piece) it changes nothing."""
    from steadytrain.memory.estimate import Settings, estimate, load_config

    config = load_config(llama_1b_dir(tmp_path))
    savers = {"checkpointing": True, "offload": True, "chunked_loss": True}

    def total(seq: int, tiled: bool) -> int:
        return estimate(config, Settings(seq=seq, tiled_mlp=tiled, **LORA_1B, **savers)).total

    assert total(131072, False) - total(131072, True) > 4 * GiB
    assert total(DEFAULT_TILE_TOKENS, True) == total(DEFAULT_TILE_TOKENS, False)
    found = estimate(config, Settings(seq=131072, tiled_mlp=True, **LORA_1B, **savers))
    assert any("the MLP tiled by 8,192 tokens" in row.formula for row in found.rows)


class TiledEstimate:
    """A long sequence's estimate by mode (GiB at micro 1, +1 GiB a sample): every mode is over
    the 16 GiB budget untiled; with the tiled MLP, checkpointing with offload and the chunked
    loss is within it."""

    def total(self, size: int, mode: Mode) -> float:
        base = 40 if not mode.checkpointing else 24 if not mode.chunked_loss else 20
        base -= 2 if mode.offload else 0
        return (base - (6 if mode.tiled_mlp else 0) + size - 1) * GiB

    def of(self, size: int, mode: Mode):
        return None


def test_the_planner_turns_the_tiled_mlp_on_where_one_sample_does_not_fit_otherwise(
    clock: PassClock,
):
    """Before any pass, the analytic estimate puts one sample with every other saver over the
    limit and the tiled MLP within it: the planner switches it on for every pass, the plan has
    it (with the reason), and the modes still over the limit are not probed. Where one sample
    fits untiled, it stays off and is never switched."""
    from steadytrain.device import resolve_device
    from steadytrain.device.testing import FakeCUDABackend, FakeMPSBackend
    from steadytrain.memory.plan import plan

    def planned(estimate):
        cuda = FakeCUDABackend([("GPU", 16 * GiB)])
        device = resolve_device(
            "cuda", backends={"mps": FakeMPSBackend(), "cuda": cuda}, system=FakeMPSBackend().system
        )
        cuda.allocate(2 * GiB)  # the weights
        tiled, ran = [], []

        def tile(on: bool) -> bool:
            tiled.append(on)
            return True

        def passes(chunked: bool):
            def run(size: int, checkpointing) -> None:
                ran.append((checkpointing, chunked, bool(tiled and tiled[-1])))
                need = int(size * 3 * GiB)
                cuda.allocate(need)
                clock.spend(4.0)
                cuda.free(need)
                cuda.empty_cache()

            return run

        chosen = plan(
            passes(False),
            device,
            effective_batch_size=4,
            can_checkpoint=True,
            can_offload=True,
            chunked_run=passes(True),
            analytic=estimate,
            tile=tile,
        )
        return chosen, tiled, ran

    chosen, tiled, ran = planned(TiledEstimate())
    assert tiled == [True] and all(on for _, _, on in ran) and ran
    assert chosen.tiled_mlp and chosen.to_event()["tiled_mlp"] is True
    assert any(r.startswith("tiled MLP: on") for r in chosen.reasons), chosen.reasons
    assert {(c, k) for c, k, _ in ran} == {("offload", True)}, chosen.reasons

    class Short(TiledEstimate):
        def total(self, size: int, mode: Mode) -> float:
            return super().total(size, mode) - 10 * GiB

    chosen, tiled, ran = planned(Short())
    assert tiled == [] and not chosen.tiled_mlp and ran


def test_plan_turns_the_tiled_mlp_on_at_98304_tokens_and_says_the_longer_seq(
    tmp_path: Path, capsys
):
    """`steadytrain plan` for the 1B shape at 98,304 tokens under 16 GiB: untiled, one sample
    with every saver is over the budget; the plan takes the tiled MLP, and the longest --seq it
    says is past 98,304 (with it) where it was under (without)."""
    from steadytrain.cli.memory_commands import plan_command
    from steadytrain.memory.config_plan import longest_seq
    from steadytrain.memory.estimate import Settings, load_config

    model = llama_1b_dir(tmp_path)
    assert plan_command(model, 4, memory="16GiB", json_output=True, seq=98304, **LORA_1B) == 0
    event = json.loads(capsys.readouterr().out)
    assert event["micro_batch_size"] == 1 and event["tiled_mlp"] is True
    assert (event["activation_checkpointing"], event["chunked_loss"]) == ("offload", True)
    assert event["longest_seq"]["seq"] > 98304 and "tiled MLP" in event["longest_seq"]["mode"]
    settings = Settings(seq=1024, activation_checkpointing="auto", **LORA_1B)
    untiled = longest_seq(load_config(model), settings, 16 * GiB, tiled=False)
    assert untiled["seq"] < 98304 < event["longest_seq"]["seq"]


def test_the_advice_offers_the_tiled_mlp_past_one_piece_of_tokens():
    """The advisor offers `--tiled-mlp` (`tiled_mlp: true` in a config) where a micro-batch holds
    more tokens than one piece, and not at 8,192 tokens or fewer, where it changes nothing."""
    from test_estimate import tiny

    from steadytrain.memory.advice import FLAGS, knobs
    from steadytrain.memory.estimate import Settings

    def offered(seq: int) -> list[str]:
        settings = Settings(seq=seq, device_type="cuda", checkpointing=True)
        return [k.flags for k in knobs(tiny(), settings, 2**30, FLAGS)]

    assert "--tiled-mlp" in offered(16384)
    assert "--tiled-mlp" not in offered(DEFAULT_TILE_TOKENS)
