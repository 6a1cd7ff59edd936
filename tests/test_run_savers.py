"""The memory savers' registry (`steadytrain.run.savers`): every part that names a saver reads
it, so a saver added there (with its implementation) is climbed by the ladder, named by the
supervisor, counted in a `memory_savers` record and listed in the docs' table; the entries agree
with what they point at (the implementation, the estimate's flag, the fine-tune config's key)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_estimate import tiny

from steadytrain.events import TrainState
from steadytrain.memory import savers as memory_savers
from steadytrain.memory.advice import FLAGS, knobs
from steadytrain.memory.choice import Mode
from steadytrain.memory.savers import MemorySavers, Rung
from steadytrain.memory.settings import Settings, flag_of
from steadytrain.recipes.finetune_config import FinetuneConfig
from steadytrain.run import savers as run_savers
from steadytrain.safety.supervised import savers_from_supervisor
from steadytrain.supervisor.words import saver_name

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plan.md"
TABLE = re.compile(r"<!-- savers: [^\n]*-->\n(.*?)\n<!-- /savers -->", re.S)


class Switchable(torch.nn.Module):
    """A model with a Hugging Face style checkpointing switch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        pass

    def gradient_checkpointing_disable(self) -> None:
        pass


class ChunkableLoss:
    """The chunked-loss protocol on a toy loss."""

    chunk_tokens: int | None = None

    def can_chunk(self, model) -> bool:
        return True

    def set_chunking(self, chunk_tokens: int | None) -> None:
        self.chunk_tokens = chunk_tokens


def test_the_docs_table_of_savers_is_the_registry_s():
    found = TABLE.search(DOCS.read_text(encoding="utf-8"))
    assert found is not None, f"{DOCS}: the <!-- savers --> table is missing"
    assert found.group(1) == run_savers.markdown_table(), (
        f"{DOCS}: the table of savers differs from the registry; paste "
        "steadytrain.run.savers.markdown_table() between its markers"
    )


@pytest.mark.parametrize("saver", run_savers.SAVERS, ids=lambda s: s.name)
def test_each_entry_agrees_with_what_it_names(saver):
    """Its implementation is a `Rung`; the estimate prices it through a bool field of
    `Settings` whose flag is the entry's; its fine-tune keys are the config's; a saver it comes
    after is registered before it."""
    module, _, name = saver.switch.partition(":")
    assert isinstance(getattr(__import__(module, fromlist=[name]), name), Rung)
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    assert fields[saver.estimate_field].type == "bool"
    assert flag_of(saver.estimate_field) == saver.flag
    for key, value in saver.finetune:
        FinetuneConfig(model_name_or_path="m", train_file="t.jsonl", **{key: value})
    if saver.after is not None:
        names = [s.name for s in run_savers.SAVERS]
        assert names.index(saver.after) < names.index(saver.name)
    assert saver_name(saver.name) == saver.words


def test_the_plan_s_modes_have_one_field_per_registered_saver():
    """A plan's candidate runs with a `Mode`; the planner prices it through the estimate's
    fields, so each registered saver is a field of both (both are made from the registry)."""
    assert set(Mode._fields) == {s.estimate_field for s in run_savers.SAVERS}
    assert Mode(checkpointing=True, offload=True).savers == 2


ADDED_SAVER = """
import dataclasses, sys
from steadytrain.run import savers as run_savers
run_savers.SAVERS = (*run_savers.SAVERS, run_savers.Saver(
    name="smaller_chunks", words="the chunked loss at 256 tokens", config="chunk_tokens=256",
    finetune=(("chunked_loss", 256),), flag="--smaller-chunks", estimate_field="smaller_chunks",
    estimate_help="The chunked loss at 256 tokens a chunk.", prices="one 256-token chunk",
    needs=(), switch="steadytrain.memory.savers:CHUNKED_LOSS_RUNG", after="chunked_loss"))
from steadytrain.memory.choice import Mode
from steadytrain.memory.settings import Settings, flag_of, from_options, options
field = {f.name: f for f in dataclasses.fields(Settings)}["smaller_chunks"]
assert field.type == "bool" and field.default is False, field
assert flag_of("smaller_chunks") == "--smaller-chunks"
assert "smaller_chunks" in {f.name for f in options("estimate")}
settings = from_options("estimate", {"smaller_chunks": True})
assert settings.smaller_chunks and settings.chunked_loss  # the saver it comes after is on
assert settings.estimate_fields()["smaller_chunks"] is True
assert Mode._fields[-1] == "smaller_chunks" and Mode(smaller_chunks=True).savers == 1
assert Mode(True)._asdict() == {**Mode()._asdict(), "checkpointing": True}
print("ok")
"""


def test_a_registered_saver_is_a_field_of_the_estimate_and_of_the_plan():
    """The registration is the one place: a saver added to `SAVERS` (before the estimate's and
    the plan's modules load, as a new entry in the file would be) is a bool field of `Settings`
    and of `Mode`, an option of `steadytrain estimate` under its own flag, and in the estimate's
    JSON, with nothing else written."""
    done = subprocess.run(
        [sys.executable, "-c", ADDED_SAVER], capture_output=True, text=True, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr


def test_the_registry_imports_without_torch():
    """The supervisor reads it, and the supervisor never loads torch."""
    code = "import sys, steadytrain.run.savers; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_advice_offers_the_registry_s_savers_in_its_order():
    settings = Settings(seq=4096, device_type="cuda")
    offered = [k.flags for k in knobs(tiny(), settings, 2**30, FLAGS) if k.flags in _flags()]
    assert offered == ["--checkpointing", "--chunked-loss"]  # offload waits for checkpointing
    settings = dataclasses.replace(settings, checkpointing=True)
    offered = [k.flags for k in knobs(tiny(), settings, 2**30, FLAGS) if k.flags in _flags()]
    assert offered == ["--offload", "--chunked-loss"]
    settings = dataclasses.replace(settings, device_type="mps")
    offered = [k.flags for k in knobs(tiny(), settings, 2**30, FLAGS) if k.flags in _flags()]
    assert offered == ["--chunked-loss"]  # no memory of the GPU's own: offload frees nothing


def _flags() -> set[str]:
    return {s.flag for s in run_savers.SAVERS}


LOWER_PRECISION = Rung(
    on=lambda s: getattr(s.model, "lowered", False),
    can=lambda s: True,
    turn_on=lambda s: setattr(s.model, "lowered", True) or {"dtype": "bf16"},
)
"""A saver added for the test: its implementation, as a module of memory/ would hold it."""


def test_a_saver_added_to_the_registry_is_climbed_named_recorded_and_listed(monkeypatch):
    added = run_savers.Saver(
        name="lower_precision",
        words="the weights in bf16",
        config="precision: bf16",
        finetune=(("bf16", True),),
        flag="--precision bf16",
        estimate_field="autocast",
        estimate_help="Weights in bf16.",
        prices="two bytes a weight",
        needs=("a device with bf16",),
        switch=f"{__name__}:LOWER_PRECISION",
    )
    monkeypatch.setattr(run_savers, "SAVERS", (*run_savers.SAVERS, added))
    savers = MemorySavers(Switchable(), ChunkableLoss(), TrainState())
    assert savers.left() == ["activation_checkpointing", "chunked_loss", "lower_precision"]

    records: list[tuple[str, dict]] = []
    environ = {"STEADYTRAIN_SUPERVISED": "1", "STEADYTRAIN_MEMORY_SAVERS": "3"}
    savers_from_supervisor(savers, lambda name, info: records.append((name, info)), 0, environ)
    turned = [info["saver"] for name, info in records if name == "memory_saver"]
    assert turned == ["activation_checkpointing", "chunked_loss", "lower_precision"]
    assert records[-1][1]["in_force"] == turned and records[-1][1]["left"] == []
    assert records[-2][1]["dtype"] == "bf16"  # what its rung adds to the event
    assert savers.next_rung("again") is None

    assert saver_name("lower_precision") == "the weights in bf16"
    rung = len(run_savers.SAVERS)  # the added saver is the ladder's last rung
    assert f"| {rung} | `lower_precision`: the weights in bf16 | `precision: bf16` |" in (
        run_savers.markdown_table()
    )


def test_the_ladder_is_the_registry_s_order(monkeypatch):
    """The chunked loss registered before checkpointing is climbed before it: nothing else
    holds the order."""
    swapped = (run_savers.by_name("chunked_loss"), run_savers.by_name("activation_checkpointing"))
    monkeypatch.setattr(run_savers, "SAVERS", swapped)
    savers = MemorySavers(Switchable(), ChunkableLoss(), TrainState())
    assert savers.next_rung("oom")["saver"] == "chunked_loss"
    assert savers.next_rung("oom")["saver"] == "activation_checkpointing"
    assert memory_savers.ladder()[0][0].name == "chunked_loss"
