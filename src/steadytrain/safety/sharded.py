"""Checkpoints of several ranks: every rank's RNG streams and, under `distributed: fsdp`, every
rank's shard of the model and optimizer through torch.distributed.checkpoint (DCP).

Rank 0 stages the checkpoint as a single process does (safety/checkpoint.py). Inside its
staging, the payload's `shards` hook tells the other ranks the staging folder (a broadcast);
every rank writes its own files there: ``rng-rank-R.safetensors`` and, sharded, DCP's
``__R_0.distcp`` (and rank 0's ``.metadata``). After a barrier rank 0 lists every file of the
folder in the manifest and commits by rename, so a checkpoint is whole or absent. The other
ranks save through `RankStore`, which takes part in the same sequence.

Resume: with the same world size each rank takes its own RNG streams back; with another world
size every rank takes rank 0's (said in a `note` event). DCP loads across world sizes, so
a sharded checkpoint also resumes in one process, into the plain model.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.device import set_rng_state
from steadytrain.device.core import wait_on_host
from steadytrain.safety.checkpoint import Payload, write_tensor_file
from steadytrain.safety.state import (
    DCP_METADATA,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    HostBuffers,
    RunState,
    capture_payload,
    check_identity,
    checked_document,
    frozen_base,
    load_model_tensors,
    load_train_state,
    loading,
    rng_from_files,
    rng_to_files,
)

_PLAIN = "plain.json"


_KEPT: dict[str, torch.Tensor] = {}


def _rendezvous(device: torch.device) -> None:
    """Every rank's files are written. An all-reduce of a tensor kept for the life of the
    process, not gloo's barrier, which holds the works queued before it (DCP's, FSDP's) and
    can free them in a worker thread during interpreter exit (engine/distributed.py says more)."""
    kept = _KEPT.get(str(device))
    if kept is None:  # made once: setdefault would allocate a new one at every call
        kept = _KEPT[str(device)] = torch.zeros(1, device=device)
    dist.all_reduce(kept)
    wait_on_host(device)  # on NCCL the all-reduce alone returns before the other ranks arrive


def rng_rank_file(rank: int) -> str:
    return f"rng-rank-{rank}.safetensors"


def rng_tensors() -> dict[str, torch.Tensor]:
    """Every RNG stream of this process as tensors (python's and numpy's as JSON bytes)."""
    tensors, plain = rng_to_files()
    tensors[_PLAIN] = torch.tensor(list(json.dumps(plain).encode()), dtype=torch.uint8)
    return tensors


def rng_from_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    plain = json.loads(bytes(tensors[_PLAIN].tolist()).decode())
    return rng_from_files({k: v for k, v in tensors.items() if k != _PLAIN}, plain)


def _state_dict_options(model: torch.nn.Module) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # A frozen base is not saved (as model_tensors does): its fingerprint identifies it.
    return StateDictOptions(ignore_frozen_params=frozen_base(model), strict=False)


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """This rank's shard of the model and optimizer into `folder` (collective: every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=_state_dict_options(model))
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, sync_files=True)
    dcp.save({"model": msd, "optimizer": osd}, storage_writer=writer)


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """A DCP checkpoint into the model and optimizer, sharded or plain (one process: DCP
    reshards into whole tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _state_dict_options(model)
    msd, osd = get_state_dict(model, optimizer, options=options)
    state = {"model": msd, "optimizer": osd}
    with warnings.catch_warnings():  # one process loading on purpose: DCP's no_dist warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=options)


class _NoOptimizerState:
    """Stands for a sharded run's optimizer in rank 0's capture: its state goes through DCP."""

    def state_dict(self) -> dict:
        return {}


@dataclasses.dataclass
class RanksState(RunState):
    """`RunState` of one rank: rank 0 writes the single-process files (less the model and
    optimizer when sharded); every rank adds its RNG streams and, sharded, its DCP shard."""

    rank: int = 0
    world_size: int = 1
    sharded: bool = False
    rng_note: str | None = None
    """Set by `load` when the world size changed and this rank took rank 0's streams."""

    def capture(
        self, next_loss: float | None, buffers: HostBuffers | None = None, copy: bool = True
    ) -> Payload:
        if self.world_size == 1:
            return super().capture(next_loss, buffers, copy)
        if self.rank == 0 and self.sharded:
            # The model and optimizer go through DCP (`_write_shards`): their sharded tensors
            # (DTensors, which a host buffer cannot take on CUDA) are not copied here at all.
            payload = capture_payload(
                self.state, torch.nn.Module(), _NoOptimizerState(), self.scheduler, self.scaler,
                self.identity, next_loss, buffers, copy=copy,
            )  # fmt: skip
            del payload.tensors[MODEL_FILE], payload.objects[OPTIMIZER_FILE]
        elif self.rank == 0:
            payload = super().capture(next_loss, buffers, copy)
        else:
            payload = Payload()
        own = rng_tensors()
        payload.shards = lambda folder: self._write_shards(folder, own)
        return payload

    def _write_shards(self, folder: Path | None, rng: dict[str, torch.Tensor]) -> None:
        """Every rank at once: learn rank 0's staging folder, write this rank's files there,
        and wait until every rank has (rank 0 then hashes them all into the manifest)."""
        box = [None if folder is None else str(folder)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        folder = Path(box[0])
        write_tensor_file(folder / rng_rank_file(self.rank), rng)
        if self.sharded:
            save_shards(self.model, self.optimizer, folder)
        _rendezvous(next(self.model.parameters()).device)

    def load(
        self, payload: Payload, source: Any, allowed: Collection[str] = ()
    ) -> tuple[list[str], float | None]:
        """As `RunState.load`, reading a sharded checkpoint through DCP, and this rank's RNG
        streams when the world size is the one that wrote them."""
        doc = checked_document(payload, source)
        overridden = check_identity(doc["identity"], self.identity, allowed, source)
        part = MODEL_FILE
        with loading(source, lambda: part):
            if DCP_METADATA in payload.sharded:
                part = "the model and optimizer shards (DCP)"
                load_shards(self.model, self.optimizer, Path(source))
            else:
                load_model_tensors(self.model, payload.tensors[MODEL_FILE])
                part = OPTIMIZER_FILE
                self.optimizer.load_state_dict(payload.objects[OPTIMIZER_FILE])
            part = SCHEDULER_FILE
            if self.scheduler is not None:
                self.scheduler.load_state_dict(payload.objects[SCHEDULER_FILE])
            part = SCALER_FILE
            if self.scaler is not None and SCALER_FILE in payload.objects:
                self.scaler.load_state_dict(payload.objects[SCALER_FILE])
            part = f"{STATE_FILE} (state)"
            load_train_state(self.state, doc["state"])
            part = "the RNG streams"
            saved_world = doc["identity"].get("world_size", 1)
            own = payload.tensors.get(rng_rank_file(self.rank))
            if own is not None and saved_world == self.world_size:
                set_rng_state(rng_from_tensors(own))
            else:
                set_rng_state(rng_from_files(payload.tensors[RNG_FILE], doc["rng"]))
                if saved_world != self.world_size:
                    self.rng_note = (
                        f"RNG streams: saved by {saved_world} rank(s), resumed on "
                        f"{self.world_size}: every rank takes rank 0's streams"
                    )
        return overridden, None if overridden else doc.get("next_loss")


class RankStore:
    """The checkpoint store of a rank other than 0: it writes its files into rank 0's staging
    folder (`RanksState.capture`'s shards) and commits nothing; rank 0 commits for all."""

    def save(self, step: int, payload: Payload) -> None:
        if payload.shards is not None:
            payload.shards(None)  # the folder comes from rank 0

    def save_async(self, step: int, payload: Payload) -> None:
        self.save(step, payload)

    def wait(self) -> None:
        return None

    def in_flight(self) -> bool:
        return False
