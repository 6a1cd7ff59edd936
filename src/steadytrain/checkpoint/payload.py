"""What one checkpoint holds (`Payload`: files by name), the check of one before it is saved,
and about how many bytes it takes on disk (for the disk-full message)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from steadytrain.checkpoint.file_io import json_bytes
from steadytrain.checkpoint.manifest import FILE_NAME, MANIFEST, file_kind
from steadytrain.checkpoint.tie import TIE_KEY, Tie

_MAX_STEP = 10**12 - 1


@dataclass
class Payload:
    """What one checkpoint holds, by file name.

    `tensors` files end in .safetensors, `json` files in .json; `objects` files (anything else,
    e.g. optimizer.pt) must hold only what torch.load(weights_only=True) accepts: tensors,
    numbers, strings and plain containers.
    """

    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    json: dict[str, Any] = field(default_factory=dict)
    shards: Callable[[Path | None, Tie | None], None] | None = None
    """Saving: writes the files other writers put into the staging folder (every rank's
    shards, through torch.distributed.checkpoint), called with the folder and the checkpoint's
    tie (tie.py: each rank's own files carry it) after the payload's own files and before the
    manifest, which then lists every file in the folder; called with None, None when the step
    is committed already (nothing to write). Saved synchronously only."""
    sharded: list[str] = field(default_factory=list)
    """Loading: the verified files that torch.distributed.checkpoint reads from the folder."""

    def names(self) -> list[str]:
        return [*self.tensors, *self.objects, *self.json]


def all_tensors(payload: Payload) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor of the payload, with the file (and key) it goes into."""
    for file, tensors in payload.tensors.items():
        for key, tensor in tensors.items():
            yield f"{file}:{key}", tensor
    for file, obj in payload.objects.items():
        for tensor in tensors_in(obj):
            yield file, tensor


def check_payload(step: int, payload: Payload) -> None:
    """Refuse (ValueError) a step or payload the store cannot save as given: a step out of
    range, a file name that repeats or is not plain, a file whose name says another kind, a
    tensors file holding something else than named tensors."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
        raise ValueError(f"step must be an integer in 0..{_MAX_STEP}, got {step!r}")
    names = payload.names()
    if len(set(names)) != len(names):
        raise ValueError(f"payload file names repeat: {sorted(names)}")
    for name in names:
        if not FILE_NAME.match(name) or name == MANIFEST:
            raise ValueError(
                f"payload file name {name!r}: use letters, digits, '.', '_' or '-', "
                f"not starting with '.', and not {MANIFEST}"
            )
    for kind, files in (("tensors", payload.tensors), ("objects", payload.objects)):
        for name in files:
            if file_kind(name) != kind:
                raise ValueError(
                    f"payload.{kind}[{name!r}]: tensors files end in .safetensors, json files "
                    "in .json, objects files in anything else (e.g. .pt)"
                )
    for name in payload.json:
        if file_kind(name) != "json":
            raise ValueError(f"payload.json[{name!r}]: json file names end in .json")
    for name, value in (*payload.objects.items(), *payload.json.items()):
        if isinstance(value, dict) and TIE_KEY in value:
            raise ValueError(f"{name}: the key {TIE_KEY!r} is the checkpoint's own (tie.py)")
    for name, tensors in payload.tensors.items():
        for key, tensor in tensors.items():
            if not isinstance(key, str) or key == "__metadata__":
                raise ValueError(f"{name}: tensor name {key!r} is not allowed")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name}: {key!r} is a {type(tensor).__name__}, not a tensor")


def payload_bytes(payload: Payload) -> int:
    """About how many bytes the payload's files take on disk."""
    total = 4096  # manifest
    for tensors in payload.tensors.values():
        total += 64 + sum(128 + t.nelement() * t.element_size() for t in tensors.values())
    total += sum(_object_bytes(obj) for obj in payload.objects.values())
    total += sum(len(json_bytes(value)) for value in payload.json.values())
    return total


def _object_bytes(obj: Any) -> int:
    """Roughly what torch.save will write for `obj`: its tensors' bytes plus some overhead."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size() + 64
    if isinstance(obj, dict):
        return 64 + sum(_object_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return 64 + sum(_object_bytes(v) for v in obj)
    return 64


def tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
