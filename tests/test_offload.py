"""Activation checkpointing with offloaded inputs (`activation_checkpointing: "offload"`,
memory/offload.py): the same gradients as plain checkpointing through a real path of the hooks
(on CPU the host copy is a plain copy), only the layers' inputs packed, refused where host
memory is the device's memory, a candidate of the plan on CUDA (the backend double) and never on
MPS, the ladder's rung after checkpointing, and kept by a resume."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import forkserver
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from steadytrain import TrainConfig, Trainer
from steadytrain.checkpoint.state import load_train_state
from steadytrain.device import resolve_device
from steadytrain.device.testing import FakeCUDABackend, FakeMPSBackend
from steadytrain.errors import ConfigError
from steadytrain.events import TrainState
from steadytrain.memory import offload
from steadytrain.memory.chunked_loss import CausalLMLoss
from steadytrain.memory.estimate import DEFAULT_CHUNK_TOKENS
from steadytrain.memory.plan import Mode, plan
from steadytrain.memory.savers import MemorySavers, Savers
from steadytrain.recipes.finetune_config import FinetuneConfig

GiB = 2**30
LAYERS, HIDDEN, SEQ, VOCAB = 3, 64, 16, 128


def tiny_llama(lora: bool = False) -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=176,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zero at the start: the A gradients would prove nothing
                torch.nn.init.normal_(p, std=0.02)
    model.train()
    return model


def grads(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_offloaded_checkpointing_gives_plain_checkpointings_gradients_packing_only_inputs(
    monkeypatch,
):
    model = tiny_llama(lora=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    savers = MemorySavers(model, CausalLMLoss(), discrete_memory=True)
    assert savers.set_checkpointing(True)
    want = grads(model, ids)
    packed: list[tuple[tuple[int, ...], str]] = []

    def spy(layer, tensor: torch.Tensor):
        packed.append((tuple(tensor.shape), tensor.device.type))
        return pack(layer, tensor)

    pack = offload._Layer.pack
    monkeypatch.setattr(offload._Layer, "pack", spy)
    assert (
        savers.set_checkpointing("offload") and savers.state.activation_checkpointing == "offload"
    )
    got = grads(model, ids)
    # Each checkpointed layer keeps only its input, and the hooks move exactly that: one
    # hidden-state tensor per layer, nothing of the layers' inside.
    assert packed == [((2, SEQ, HIDDEN), "cpu")] * LAYERS
    assert want.keys() == got.keys() and any("lora_A" in name for name in got)
    for name, grad in got.items():
        assert torch.equal(grad, want[name]), name
    # Back to plain checkpointing: the model's own checkpoint function again, nothing packed.
    packed.clear()
    assert savers.set_checkpointing(True) and savers.state.activation_checkpointing is True
    grads(model, ids)
    assert packed == []


class DeferredSideStream:
    """A double of the side-stream copier (`offload._SideStream`) on CPU tensors. Its copies
    run in the order they were queued (one stream), but only when a consumer waits on an event
    recorded after them, as a GPU's side stream may still be copying when the compute stream
    reaches a tensor: a copy read before its wait holds NaN. It logs, by layer in forward
    order, each copy back to the device ("fetch") and each hand-over to the backward ("use").
    `overlaps=False` stands for the serial copier: nothing is prefetched."""

    def __init__(self, overlaps: bool = True) -> None:
        self.overlaps = overlaps
        self.queue: list = []
        self.ran = 0
        self.host_layer: dict[int, int] = {}
        self.copy_layer: dict[int, int] = {}
        self.log: list[tuple[str, int]] = []

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.full_like(tensor, float("nan"))
        self.queue.append(lambda: host.copy_(tensor))
        self.host_layer[id(host)] = len(self.host_layer)  # one input a layer (test above)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device):
        tensor = torch.full_like(host, float("nan"))
        self.queue.append(lambda: tensor.copy_(host))
        self.copy_layer[id(tensor)] = self.host_layer[id(host)]
        self.log.append(("fetch", self.host_layer[id(host)]))
        return tensor, len(self.queue)

    def hand_over(self, tensor: torch.Tensor, ready: int) -> torch.Tensor:
        while self.ran < ready:
            self.queue[self.ran]()
            self.ran += 1
        self.log.append(("use", self.copy_layer[id(tensor)]))
        return tensor


@pytest.mark.parametrize("overlaps", [True, False], ids=["side-stream", "serial"])
def test_each_layers_inputs_are_fetched_while_the_layer_after_it_runs_its_backward(
    monkeypatch, overlaps
):
    model = tiny_llama(lora=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    savers = MemorySavers(model, CausalLMLoss(), discrete_memory=True)
    savers.set_checkpointing(True)
    want = grads(model, ids)
    side = DeferredSideStream(overlaps)
    monkeypatch.setattr(offload, "_copier", lambda device: side)
    savers.set_checkpointing("offload")
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    assert side.log == [] and len(side.host_layer) == LAYERS
    # Twice through the same graph: each backward fetches every layer's inputs anew.
    loss.backward(retain_graph=True)
    first = list(side.log)
    loss.backward()
    # The backward reaches the layers last first. With the side stream, unpacking layer k
    # fetches its own inputs (already fetched, but for the last layer) and then starts the
    # copy of layer k-1's, before layer k's are handed over: that copy runs while layer k
    # recomputes and back-propagates. Serial: each layer's copy when it is unpacked.
    last = LAYERS - 1
    if overlaps:
        order = [("fetch", last)]
        for k in range(last, -1, -1):
            order += [("fetch", k - 1)] if k else []
            order += [("use", k)]
    else:
        order = [step for k in range(last, -1, -1) for step in (("fetch", k), ("use", k))]
    assert first == order and side.log == order * 2
    # Every copy the backward read had been waited on (NaN otherwise): plain checkpointing's
    # gradients, twice.
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name, grad in got.items():
        assert torch.equal(grad, want[name] * 2), name


def test_the_side_stream_is_the_default_on_cuda_and_the_serial_copies_stay_reachable(
    monkeypatch,
):
    made: list[torch.device] = []
    monkeypatch.setattr(offload, "_SideStream", lambda device: made.append(device) or device)
    monkeypatch.setattr(offload, "_SIDE_STREAMS", {})
    monkeypatch.delenv(offload.STREAM_SWITCH, raising=False)
    gpu, other = torch.device("cuda", 0), torch.device("cuda", 1)
    # One side stream a GPU, made when a layer first packs there, then reused.
    assert [offload._copier(d) for d in (gpu, gpu, other)] == [gpu, gpu, other]
    assert made == [gpu, other]
    assert offload._copier(torch.device("cpu")) is offload._PLAIN
    monkeypatch.setenv(offload.STREAM_SWITCH, "0")
    assert offload._copier(gpu) is offload._SERIAL and not offload._SERIAL.overlaps


def test_offload_is_refused_where_host_memory_is_the_device_memory(tmp_path):
    for device in ("cpu", "mps"):
        with pytest.raises(ConfigError) as raised:
            TrainConfig(
                run_dir=tmp_path,
                effective_batch_size=2,
                activation_checkpointing="offload",
                device=device,
            )
        (line,) = raised.value.problems
        assert line.startswith("activation_checkpointing: ") and device in line
        assert "use true" in line and raised.value.exit_code == 2
    # device "auto" resolves to the CPU here: refused by the trainer before anything runs.
    model = torch.nn.Linear(4, 4)
    data = [(torch.ones(4), torch.ones(4))] * 4
    trainer = Trainer(
        model=model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        train_data=data,
        config=TrainConfig(
            run_dir=tmp_path / "run", effective_batch_size=2, activation_checkpointing="offload"
        ),
    )
    with pytest.raises(ConfigError, match="activation_checkpointing: 'offload' needs a GPU"):
        trainer.fit()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # The fine-tune recipe's field takes the value and hands it to the engine.
    recipe = FinetuneConfig(
        model_name_or_path="m", train_file="t.jsonl", gradient_checkpointing="offload"
    )
    assert recipe.to_train_config().activation_checkpointing == "offload"


def fake(kind: str):
    """A device of `kind` on a backend double with 16 GiB, 2.4 GiB of it in use (weights)."""
    cuda = FakeCUDABackend([("GPU", 16 * GiB)])
    mps = FakeMPSBackend(total=16 * GiB)
    device = resolve_device(kind, backends={"mps": mps, "cuda": cuda}, system=mps.system)
    held = int(2.4 * GiB)
    cuda.allocate(held) if kind == "cuda" else mps.allocate(held)
    return device, cuda, mps


GROWTH = {False: 8.0, True: 5.0, "offload": 1.0}  # GiB a sample
SECONDS = {False: 0.010, True: 0.013, "offload": 0.017}  # a sample, above 40 ms of launches


@pytest.fixture
def clock(monkeypatch):
    """The planner's clock (test_plan.py's PassClock): a pass "takes" the seconds it spends."""
    from test_plan import PassClock

    import steadytrain.memory.probe as probe_module

    fake = PassClock()
    monkeypatch.setattr(probe_module, "time", fake)
    return fake


def passes(kind: str, cuda, mps, ran: list, clock):
    def run(size: int, checkpointing) -> None:
        need = int(size * GROWTH[checkpointing] * GiB)
        if kind == "cuda":
            cuda.allocate(need)
        else:
            handle = mps.allocate(need)
        clock.spend(max(0.04, size * SECONDS[checkpointing]))
        cuda.free(need) if kind == "cuda" else mps.free(handle)
        cuda.empty_cache()
        ran.append((size, checkpointing))

    return run


def test_the_plan_chooses_offload_on_cuda_only_where_checkpointing_does_not_fit_the_size(clock):
    """On the CUDA double: plain fits micro 1, checkpointed micro 2 (both bound by launches),
    offloaded micro 8, the fastest that fits. Without `can_offload` (or on MPS) it is never
    run, and checkpointed micro 2 is chosen."""
    device, cuda, mps = fake("cuda")
    ran: list = []
    chosen = plan(
        passes("cuda", cuda, mps, ran, clock),
        device,
        effective_batch_size=64,
        can_checkpoint=True,
        can_offload=True,
    )
    assert (chosen.micro_batch_size, chosen.activation_checkpointing) == (8, "offload")
    assert chosen.to_event()["activation_checkpointing"] == "offload"
    assert (8, "offload") in ran
    assert any(r.startswith("activation offload: on") for r in chosen.reasons), chosen.reasons
    assert any(Mode(True, offload=True).describe() in r for r in chosen.reasons)

    ran.clear()
    chosen = plan(
        passes("cuda", cuda, mps, ran, clock), device, effective_batch_size=64, can_checkpoint=True
    )
    assert (chosen.micro_batch_size, chosen.activation_checkpointing) == (2, True)
    assert not any(c == "offload" for _, c in ran)

    device, cuda, mps = fake("mps")
    ran.clear()
    chosen = plan(
        passes("mps", cuda, mps, ran, clock),
        device,
        effective_batch_size=64,
        can_checkpoint=True,
        can_offload=True,
    )
    assert not any(c == "offload" for _, c in ran) and not chosen.offload
    assert any("activation offload: not a candidate (mps" in r for r in chosen.reasons)


def test_offload_is_not_probed_when_checkpointing_fits_the_largest_size(clock):
    device, cuda, mps = fake("cuda")
    ran: list = []
    chosen = plan(
        passes("cuda", cuda, mps, ran, clock),
        device,
        effective_batch_size=2,
        can_checkpoint=True,
        can_offload=True,
    )
    assert not any(c == "offload" for _, c in ran)
    assert chosen.activation_checkpointing is True and chosen.micro_batch_size == 2
    assert any("inputs offloaded to host: not probed" in r for r in chosen.reasons)


def test_the_ladder_goes_checkpointing_then_offload_then_the_chunked_loss_on_cuda_only():
    model, loss, state = tiny_llama(), CausalLMLoss(), TrainState()
    savers = MemorySavers(model, loss, state, discrete_memory=True)
    rungs = [savers.next_rung("oom") for _ in range(5)]
    assert [r and r["saver"] for r in rungs] == [
        "activation_checkpointing",
        "activation_offload",
        "chunked_loss",
        "tiled_mlp",  # the samples' length unknown here: offered last
        None,
    ]
    assert state.activation_checkpointing == "offload"
    assert state.chunked_loss == DEFAULT_CHUNK_TOKENS
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers and all(
        m._gradient_checkpointing_func is offload.offloaded_checkpoint for m in layers
    )
    assert "inputs offloaded to host memory" in savers.describe()

    unified = MemorySavers(tiny_llama(), CausalLMLoss(), TrainState())  # MPS, CPU
    assert not unified.can_offload
    rungs = [unified.next_rung("oom") for _ in range(4)]
    names = [r and r["saver"] for r in rungs]
    assert names == ["activation_checkpointing", "chunked_loss", "tiled_mlp", None]
    assert unified.state.activation_checkpointing is True


def test_a_resume_keeps_offload_and_old_checkpoints_with_bools_still_load():
    saved = json.loads(json.dumps(TrainState(activation_checkpointing="offload").to_dict()))
    state = TrainState()
    load_train_state(state, saved)
    assert state.activation_checkpointing == "offload"
    model = tiny_llama()
    savers = MemorySavers(model, CausalLMLoss(), state, "auto", discrete_memory=True)
    savers.start(resumed=True)
    assert state.activation_checkpointing == "offload"
    assert savers.snapshot() == Savers("offload", None)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert all(m._gradient_checkpointing_func is offload.offloaded_checkpoint for m in layers)
    # The same checkpoint resumed where offload cannot be: plain checkpointing, same values.
    moved = TrainState()
    load_train_state(moved, saved)
    MemorySavers(tiny_llama(), CausalLMLoss(), moved).start(resumed=True)
    assert moved.activation_checkpointing is True
    old = TrainState()
    load_train_state(old, {**saved, "activation_checkpointing": True})
    assert old.activation_checkpointing is True
    # The config's "offload" on a fresh run puts it in force from the start.
    fresh = TrainState()
    MemorySavers(tiny_llama(), CausalLMLoss(), fresh, "offload", True).start(resumed=False)
    assert fresh.activation_checkpointing == "offload"


def test_the_gpu_bench_runs_in_smoke_mode(tmp_path):
    script = Path(__file__).resolve().parents[1] / "bench" / "offload.py"
    out = tmp_path / "offload.json"
    done = forkserver.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    # plain checkpointing, offloaded, plain again (the nondeterminism floor on a GPU)
    assert [r["in_force"] for r in runs] == [True, "offload", True] and runs[2]["repeat"]
    assert runs[1]["grad_max_rel_diff"] == 0.0 and runs[1]["losses"] == runs[0]["losses"]
    assert runs[2]["grad_max_rel_diff"] == 0.0


def test_the_gpu_bench_times_both_ways_of_copying_in_one_call(tmp_path):
    script = Path(__file__).resolve().parents[1] / "bench" / "offload.py"
    out = tmp_path / "offload.json"
    args = ["--smoke", "--copies", "serial,overlapped", "--steps", "1", "--out", str(out)]
    done = forkserver.run([sys.executable, str(script), *args], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["in_force"], r["copies"]) for r in runs] == [
        (True, None),
        ("offload", "serial"),
        ("offload", "overlapped"),
        (True, None),
    ]
    assert all(r["grad_max_rel_diff"] == 0.0 for r in runs)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_under_compiled_layers_the_inputs_are_still_offloaded_with_the_same_gradients(
    monkeypatch,
):
    """`compile` compiles each decoder layer in place; dynamo does not trace into the hooks'
    context manager (a graph break there), so the checkpoint and its hooks run as they do
    eagerly, the layer's body compiled beneath them (aot_eager here: dynamo's path, no C++
    compiler needed)."""
    torch._dynamo.reset()
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    savers = MemorySavers(model, CausalLMLoss(), discrete_memory=True)
    savers.set_checkpointing(True)
    want = grads(model, ids)
    packed: list[tuple[int, ...]] = []
    pack = offload._Layer.pack
    monkeypatch.setattr(
        offload._Layer, "pack", lambda layer, t: packed.append(tuple(t.shape)) or pack(layer, t)
    )
    savers.set_checkpointing("offload")
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    try:
        got = [grads(model, ids) for _ in range(2)][-1]
    finally:
        torch._dynamo.reset()
    assert packed == [(2, SEQ, HIDDEN)] * (2 * LAYERS)
    for name, grad in got.items():
        assert torch.allclose(grad, want[name], rtol=1e-5, atol=1e-7), name
