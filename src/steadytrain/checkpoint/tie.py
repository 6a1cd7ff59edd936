"""A checkpoint's files tied to each other, so a file copied in from another checkpoint is found.

The manifest's hashes say each file is the one the manifest lists; they cannot say the files
belong together. A file copied from step 15's checkpoint into step 20's, and its manifest line
re-signed (by hand, by a script that re-hashes a folder, by a bug), verifies, and the run would
resume at step 20 with step 15's weights. So each save draws a random id for its checkpoint
(`Tie`: the step and the id), names it in MANIFEST.json ("checkpoint") and writes it into every
file that can carry it:

    a safetensors file    two entries of its ``__metadata__`` header: ``steadytrain_checkpoint``
                          (the id) and ``steadytrain_step``
    a pickled dict        the key ``steadytrain_checkpoint``: {"step": N, "id": "..."}
    a JSON object         the same key (trainer_state.json)

A pickled value or JSON value that is not a dict carries no tie (the Trainer writes none). On
load every file that carries one must carry this checkpoint's (`tie_problems`); the key is
taken out again, so what a load returns is what was saved. A checkpoint written before the tie
existed carries none anywhere and loads as it did.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter
from typing import Any

TIE_KEY = "steadytrain_checkpoint"
"""The key of the tie in a pickled or JSON dict, and of the id in a safetensors header."""
STEP_KEY = "steadytrain_step"
"""The key of the tie's step in a safetensors header (its values are strings)."""


@dataclasses.dataclass(frozen=True)
class Tie:
    """Which checkpoint a file was written for: its step and the id drawn for that save."""

    step: int
    id: str

    @classmethod
    def new(cls, step: int) -> Tie:
        return cls(step, secrets.token_hex(8))

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "id": self.id}

    def metadata(self) -> dict[str, str]:
        """The entries of a safetensors header's ``__metadata__``."""
        return {TIE_KEY: self.id, STEP_KEY: str(self.step)}

    def __str__(self) -> str:
        return f"step {self.step} (id {self.id})"


def tied(value: Any, tie: Tie) -> Any:
    """`value` with the tie in it, for a pickled or JSON file: a dict gets the key (a copy; the
    caller's dict is not changed), anything else is written as it is."""
    if isinstance(value, dict):
        return {**value, TIE_KEY: tie.as_dict()}
    return value


def untied(value: Any) -> tuple[Any, Tie | None]:
    """A loaded pickled or JSON value without its tie, and the tie (None: it carries none).
    Raises ValueError for a tie that is not the shape `tied` writes."""
    if not isinstance(value, dict) or TIE_KEY not in value:
        return value, None
    value = dict(value)
    said = value.pop(TIE_KEY)
    if (
        not isinstance(said, dict)
        or type(said.get("step")) is not int
        or not isinstance(said.get("id"), str)
    ):
        raise ValueError(f"its {TIE_KEY!r} entry is {said!r}, not a step and an id")
    return value, Tie(said["step"], said["id"])


def header_tie(metadata: dict[str, str] | None) -> Tie | None:
    """The tie in a safetensors header's ``__metadata__`` (None: it carries none). Raises
    ValueError for a tie that is not the shape `Tie.metadata` writes."""
    metadata = metadata or {}
    if TIE_KEY not in metadata:
        return None
    step = metadata.get(STEP_KEY, "")
    if not step.isdigit():
        raise ValueError(f"its header's {STEP_KEY!r} is {step!r}, not a step")
    return Tie(int(step), metadata[TIE_KEY])


def tie_problems(step: int, said: Any, ties: dict[str, Tie | None]) -> list[str]:
    """What ties the files of the checkpoint of `step` to other checkpoints ([]: none).

    `said`: the id MANIFEST.json names (None: it names none); `ties`: each file that can carry
    a tie, by name, with the one it carries (None: none). The checkpoint's own tie is the
    manifest's; a manifest without one (re-written by a tool that does not know it) takes the
    id most files carry. A checkpoint none of whose files carries a tie, and whose manifest
    names none, was written before ties: nothing to compare."""
    carried = [tie for tie in ties.values() if tie is not None]
    if said is None and not carried:
        return []
    if said is not None and not isinstance(said, str):
        return [f"MANIFEST.json: its 'checkpoint' is {said!r}, not a checkpoint id"]
    own = Tie(
        step, said if said is not None else Counter(t.id for t in carried).most_common(1)[0][0]
    )
    problems = []
    for name, tie in ties.items():
        if tie is None:
            problems.append(
                f"{name}: carries no checkpoint tie while this checkpoint is {own} (a file of a "
                "checkpoint written before files were tied, copied in)"
            )
        elif tie != own:
            problems.append(
                f"{name}: was written for the checkpoint of {tie}, not for this one of {own} "
                "(a file copied in from another checkpoint)"
            )
    return problems
