"""A run's checkpoint as one object: its named states (state.py), saved by `capture` and loaded
by `load`, one symmetric pair over the same dict, one rank or many (`Ranks`, ranks.py); and the
resume decision, `resume`: the newest checkpoint that verifies, belongs to this run and loads.

The Trainer registers its states (model, optimizer, scheduler, scaler, train state, RNG streams,
data order, the program's carried state) and adds one callback, the `CheckpointWriter`
(writer.py), which captures through this object. A field added to a checkpoint is one more
state here; nothing else changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from steadytrain.checkpoint.host import HostBuffers
from steadytrain.checkpoint.identity import check_identity, reapply_overrides
from steadytrain.checkpoint.ranks import SHARDED_STATES, Ranks, load_shards
from steadytrain.checkpoint.state import (
    DCP_METADATA,
    STATE_FILE,
    Host,
    ModelState,
    State,
    checked_document,
    loading,
)
from steadytrain.checkpoint.store import CheckpointStore, Payload
from steadytrain.errors import CheckpointError
from steadytrain.run.records import Record


@dataclasses.dataclass
class Resumed:
    """The checkpoint a resume loaded."""

    step: int
    path: Path
    overridden: list[str]
    """The identity differences `resume_overrides` let through, one line each."""
    expected_loss: float | None
    """The loss the first resumed step must reproduce (None: nothing to check)."""


@dataclasses.dataclass
class RunState:
    """Everything a checkpoint of this run holds: `states` by name, in load order."""

    states: dict[str, State]
    identity: dict[str, Any]
    """`run_identity` of this run (identity.py)."""
    ranks: Ranks = dataclasses.field(default_factory=Ranks)

    def capture(
        self, next_loss: float | None, buffers: HostBuffers | None = None, copy: bool = True
    ) -> Payload:
        """Every state in host memory at this step boundary: copied for a background write; for
        a synchronous one (`copy=False`) tensors already in host memory are written from where
        they are, so the save needs no second copy. `next_loss`: the continuity check's."""
        payload, host = Payload(), Host(buffers, copy)
        doc: dict[str, Any] = {}
        for name, state in self.states.items():
            if self.ranks.saves(name):
                state.save(payload, doc, host)
        if buffers is not None:
            buffers.finish()
        if self.ranks.rank == 0:
            doc |= {"identity": self.identity, "next_loss": next_loss, "torch": torch.__version__}
            payload.json[STATE_FILE] = doc
        return self.ranks.finish(payload, self._held("model"), self._held("optimizer"))

    def load(
        self, payload: Payload, source: Any, allowed: Collection[str] = ()
    ) -> tuple[list[str], float | None]:
        """Read `payload` (written by `capture`) back into the states, after checking that it
        belongs to this run. Returns the identity differences `allowed` let through, and the
        loss the first resumed step must reproduce (None when it cannot be checked). Content
        that does not load is a `CheckpointError` naming the state (see `loading`)."""
        doc = checked_document(payload, source)
        overridden = check_identity(doc["identity"], self.identity, allowed, source)
        sharded = DCP_METADATA in payload.sharded
        if sharded:
            with loading(source, lambda: "the model and optimizer shards (DCP)"):
                load_shards(self._held("model"), self._held("optimizer"), Path(source))
        for name, state in self.states.items():
            if not (sharded and name in SHARDED_STATES):
                with loading(source, lambda state=state: state.what):
                    state.load(payload, doc)
        fields = {line.split(":", 1)[0] for line in overridden}  # "optimizer: lr: 0.1 -> 0.01"
        schedule = getattr(self.states.get("scheduler"), "obj", None)
        reapply_overrides(doc["identity"], self.identity, fields, self._held("optimizer"), schedule)
        return overridden, None if overridden else doc.get("next_loss")

    def _held(self, name: str) -> Any:
        """The object the state `name` saves (the model, the optimizer), for DCP."""
        state = self.states.get(name)
        return state.model if isinstance(state, ModelState) else getattr(state, "obj", None)

    def resume(
        self,
        store: CheckpointStore,
        allowed: Collection[str],
        record: Callable[[str, dict], None],
    ) -> Resumed | None:
        """The newest verified checkpoint that loads, loaded into the states; a damaged one (it
        verifies, but its content does not load: a pickle weights_only refuses, a malformed RNG
        stream, a state of another step) is skipped with a `checkpoint_skipped` event and the
        one before it is tried; none left is a CheckpointError (exit 2). A checkpoint of
        another run is a BadInputError (exit 2), the same for every checkpoint."""
        refused: dict[str, list[str]] = {}
        while (found := store.latest(refused)) is not None:
            step, path = found
            try:
                overridden, expected = self.load(store.load(path), path, allowed)
            except CheckpointError as exc:
                problems = [(str(exc).strip().splitlines() or [""])[0]]
                record(
                    Record.CHECKPOINT_SKIPPED,
                    {"checkpoint": path.name, "path": str(path), "problems": problems},
                )
                refused[path.name] = problems
                continue
            return Resumed(step, path, overridden, expected)
        return None
