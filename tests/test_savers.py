"""The memory savers' one owner (`memory.savers`), the device layer's one catch-free-retry for
out-of-memory, and the checkpoint state's load read back field by field from `TrainState`."""

from __future__ import annotations

import sys

import pytest
import torch

import steadytrain
from steadytrain.checkpoint.state import load_train_state
from steadytrain.device import OutOfMemory, call_or_oom, retry_on_oom
from steadytrain.engine import Loop
from steadytrain.engine.side_pass import trial_pass
from steadytrain.errors import BadInputError
from steadytrain.events import Control, Dispatcher, StepMetrics, TrainState
from steadytrain.memory.chunked_loss import CausalLMLoss
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.savers import MemorySavers, Savers

CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: you tried "
    "to allocate 4096 bytes."
)


class Switchable(torch.nn.Module):
    """A model with a Hugging Face style checkpointing switch that records its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.calls: list[tuple[str, dict]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.calls.append(("enable", kwargs))

    def gradient_checkpointing_disable(self) -> None:
        self.calls.append(("disable", {}))


class ChunkableLoss:
    """The chunked-loss protocol (`can_chunk`, `set_chunking`, `chunk_tokens`) on a toy loss."""

    def __init__(self) -> None:
        self.chunk_tokens: int | None = None

    def __call__(self, model, batch):
        return model(batch).pow(2).mean()

    def can_chunk(self, model) -> bool:
        return True

    def set_chunking(self, chunk_tokens: int | None) -> None:
        self.chunk_tokens = chunk_tokens


def test_ladder_turns_on_checkpointing_then_the_chunked_loss_then_nothing():
    model, loss, state = Switchable(), ChunkableLoss(), TrainState()
    savers = MemorySavers(model, loss, state)
    first = savers.next_rung("out of memory at micro-batch 1")
    assert first == {
        "saver": "activation_checkpointing",
        "reason": "out of memory at micro-batch 1",
    }
    assert state.activation_checkpointing is True
    assert model.calls == [("enable", {"gradient_checkpointing_kwargs": {"use_reentrant": False}})]
    second = savers.next_rung("again")
    assert second == {
        "saver": "chunked_loss",
        "chunk_tokens": DEFAULT_CHUNK_TOKENS,
        "reason": "again",
    }
    assert state.chunked_loss == loss.chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert savers.next_rung("once more") is None
    assert savers.describe() == (
        f"activation checkpointing on, the loss chunked by {DEFAULT_CHUNK_TOKENS} tokens"
    )


def test_config_false_keeps_checkpointing_off_for_the_ladder_and_the_planner():
    state = TrainState()
    savers = MemorySavers(Switchable(), lambda m, b: m(b).mean(), state, checkpointing=False)
    assert not savers.can_checkpoint and not savers.can_chunk_loss
    assert savers.next_rung("oom") is None
    assert state.activation_checkpointing is False
    assert savers.describe() == "activation checkpointing off by the config"


def test_snapshot_restore_and_trial_run_switch_only_what_differs():
    model, loss, state = Switchable(), ChunkableLoss(), TrainState()
    savers = MemorySavers(model, loss, state)
    before = savers.snapshot()
    ran: list[tuple[int, bool, int | None]] = []
    run = savers.trial_run(
        lambda size: ran.append((size, state.activation_checkpointing, loss.chunk_tokens)), 512
    )
    run(2, True)
    run(4, True)
    assert ran == [(2, True, 512), (4, True, 512)]
    assert [c for c, _ in model.calls] == ["enable"]  # the second pass found it on already
    savers.restore(before)
    assert savers.snapshot() == before == Savers(False, None)
    assert loss.chunk_tokens is None and [c for c, _ in model.calls] == ["enable", "disable"]


def test_start_restores_a_resumed_runs_savers_and_refuses_a_loss_without_its_chunking():
    model, loss = Switchable(), ChunkableLoss()
    state = TrainState(activation_checkpointing=True, chunked_loss=256)  # as a checkpoint said
    MemorySavers(model, loss, state).start(resumed=True)
    assert model.calls[0][0] == "enable" and state.activation_checkpointing is True
    assert loss.chunk_tokens == 256
    plain = TrainState(chunked_loss=256)
    with pytest.raises(BadInputError, match="chunks of 256 tokens"):
        MemorySavers(model, lambda m, b: m(b).mean(), plain).start(resumed=True)
    fresh = TrainState()
    MemorySavers(Switchable(), CausalLMLoss(chunk_tokens=128), fresh).start(resumed=False)
    assert fresh.chunked_loss == 128  # the loss came chunked: the state records it


def test_trial_pass_leaves_no_gradient():
    model = torch.nn.Linear(3, 1)
    trial_pass(model, lambda m, b: (m(b).sum(), 3), torch.ones(2, 3))
    assert all(p.grad is None for p in model.parameters())


def test_call_or_oom_frees_after_leaving_the_except_block_and_passes_other_errors():
    in_except: list[object] = []

    def fails() -> None:
        raise RuntimeError(CPU_OOM)

    value, oom = call_or_oom(fails, lambda: in_except.append(sys.exc_info()[1]))
    assert value is None and oom == OutOfMemory(CPU_OOM, 4096)
    assert in_except == [None]  # freed with no exception (and its frames) held
    assert call_or_oom(lambda: 7, lambda: in_except.append("freed")) == (7, None)
    assert in_except == [None]

    def other() -> None:
        raise ValueError("not memory")

    with pytest.raises(ValueError):
        call_or_oom(other, lambda: None)


def test_retry_on_oom_recovers_until_it_fits():
    sizes = [4]
    seen: list[str] = []

    def attempt() -> int:
        if sizes[-1] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return sizes[-1]

    def recover(oom: OutOfMemory) -> None:
        seen.append(oom.error)
        sizes.append(sizes[-1] // 2)

    assert retry_on_oom(attempt, lambda: None, recover) == 1
    assert sizes == [4, 2, 1] and len(seen) == 2
    assert OutOfMemory.of(RuntimeError("")).error == "out of memory"


def test_load_train_state_reads_an_old_checkpoint_and_keeps_this_runs_config_fields():
    saved = TrainState(step=7, epoch=1, micro_batch_size=4, max_steps=99, last_loss=1.5).to_dict()
    del saved["chunked_loss"]  # written before the field existed
    state = TrainState(max_steps=20, steps_per_epoch=5, effective_batch_size=8, chunked_loss=64)
    load_train_state(state, saved)
    assert (state.step, state.epoch, state.micro_batch_size, state.last_loss) == (7, 1, 4, 1.5)
    assert (state.max_steps, state.steps_per_epoch, state.effective_batch_size) == (20, 5, 8)
    assert state.chunked_loss is None


def test_step_metrics_is_exported_from_the_package_root():
    assert steadytrain.StepMetrics is StepMetrics


def test_the_loop_counts_the_steps_the_fp16_scaler_skipped():
    state = TrainState()
    loop = Loop(
        runner=None, batches=None, emit=Dispatcher([], state, Control()), fit_info={}, time_every=1
    )
    row = {"loss": 1.0, "tokens": 3, "step": 1, "epoch": 0}
    StepMetrics({**row, "skipped": torch.tensor(True)}, loop._account).resolve()
    StepMetrics({**row, "step": 2, "skipped": False}, loop._account)
    assert (state.skipped_steps, state.tokens_seen, state.last_loss) == (1, 6, 1.0)
