"""One rank or many: the strategy `RunState` saves and loads through (the same states, the same
pair of functions; what differs is said here).

One process: every state goes into the payload, rank 0's files are the checkpoint.

Several ranks: rank 0 stages the checkpoint as one process does (store.py), less the model and
optimizer when they are sharded (`distributed: fsdp`). Inside its staging, the payload's
`shards` hook tells the other ranks the staging folder (a broadcast); every rank writes its own
files there: ``rng-rank-R.safetensors`` and, sharded, its shard of the model and optimizer
through torch.distributed.checkpoint (DCP: ``__R_0.distcp``, rank 0's ``.metadata``). After a
rendezvous rank 0 lists every file of the folder in the manifest and commits by rename, so a
checkpoint is whole or absent. The other ranks save through `RankStore`, which takes part in
the same sequence.

Resume: with the same world size each rank takes its own RNG streams back; with another world
size every rank takes rank 0's (said in a `note` event). DCP loads across world sizes, so a
sharded checkpoint also resumes in one process, into the plain model.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.checkpoint.file_io import write_tensor_file
from steadytrain.checkpoint.state import (
    RNG_FILE,
    Host,
    frozen_base,
    rng_from_files,
    rng_to_files,
)
from steadytrain.checkpoint.store import Payload
from steadytrain.checkpoint.tie import Tie
from steadytrain.device import set_rng_state
from steadytrain.device.core import collective_device, wait_on_host

SHARDED_STATES = ("model", "optimizer")
"""The states a sharded checkpoint holds in DCP's files instead of their own."""
_PLAIN = "plain.json"
_KEPT: dict[str, torch.Tensor] = {}


@dataclasses.dataclass
class Ranks:
    """Which rank of how many this process is, and whether the model is sharded."""

    rank: int = 0
    world_size: int = 1
    sharded: bool = False
    rng_note: str | None = None
    """Set when a load took rank 0's RNG streams because the world size changed."""

    def saves(self, name: str) -> bool:
        """Whether the state `name` goes into this rank's payload (the others' reach the
        checkpoint through `shards`, or rank 0 holds them)."""
        if self.world_size == 1:
            return True
        return self.rank == 0 and not (self.sharded and name in SHARDED_STATES)

    def finish(self, payload: Payload, model: Any, optimizer: Any) -> Payload:
        """Several ranks: the hook every rank runs inside rank 0's staging."""
        if self.world_size == 1:
            return payload
        own = rng_tensors()
        payload.shards = lambda folder, tie: self._write_shards(folder, tie, own, model, optimizer)
        return payload

    def _write_shards(
        self, folder: Path | None, tie: Tie | None, rng: dict, model: Any, optimizer: Any
    ) -> None:
        """Every rank at once: learn rank 0's staging folder and the checkpoint's tie, write
        this rank's files there (its RNG streams tied to the checkpoint; DCP's files are
        torch's format and carry no tie), and wait until every rank has (rank 0 then hashes
        them all into the manifest)."""
        box = [None if folder is None or tie is None else (str(folder), tie.step, tie.id)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        name, step, tie_id = box[0]
        folder = Path(name)
        write_tensor_file(folder / rng_rank_file(self.rank), rng, Tie(step, tie_id).metadata())
        if self.sharded:
            save_shards(model, optimizer, folder)
        backends = str(dist.get_backend_config())
        _rendezvous(collective_device(next(model.parameters()).device, backends))


@dataclasses.dataclass
class RngState:
    """Every RNG stream: rank 0's (or the one process's) in rng.safetensors and
    trainer_state.json, each rank's own in rng-rank-R.safetensors (written by `Ranks`)."""

    ranks: Ranks
    what: str = f"the RNG streams ({RNG_FILE}, trainer_state.json)"

    def save(self, out: Payload, doc: dict[str, Any], host: Host) -> None:
        out.tensors[RNG_FILE], doc["rng"] = rng_to_files()

    def load(self, saved: Payload, doc: dict[str, Any]) -> None:
        saved_world = doc["identity"].get("world_size", 1)
        own = saved.tensors.get(rng_rank_file(self.ranks.rank))
        if own is not None and saved_world == self.ranks.world_size:
            set_rng_state(rng_from_tensors(own))
            return
        set_rng_state(rng_from_files(saved.tensors[RNG_FILE], doc["rng"]))
        if saved_world != self.ranks.world_size:
            self.ranks.rng_note = (
                f"RNG streams: saved by {saved_world} rank(s), resumed on "
                f"{self.ranks.world_size}: every rank takes rank 0's streams"
            )


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


class RankStore:
    """The checkpoint store of a rank other than 0: it writes its files into rank 0's staging
    folder (`Ranks.finish`'s shards) and commits nothing; rank 0 commits for all."""

    def save(self, step: int, payload: Payload) -> None:
        if payload.shards is not None:
            payload.shards(None, None)  # the folder and the tie come from rank 0

    def save_async(self, step: int, payload: Payload, on_commit=None) -> None:
        self.save(step, payload)  # nothing committed here: `on_commit` is rank 0's

    def wait(self) -> None:
        return None

    def in_flight(self) -> bool:
        return False
