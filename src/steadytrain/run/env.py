"""The environment variables `steadytrain run` sets for its child, and their one reader.

The supervisor writes them (`steadytrain.supervisor.child_process`); every other part of
steadytrain that reads one (the Trainer, the integrations, the watchdog, the memory savers, the
checkpoint writer's fault injection) reads it through the function here, so that a value means
the same under the Trainer as under `RunGuard` or a callback. Imports `errors` alone: every layer
above may read the environment through it, without torch.

    variable                       reader             value                  unset
    STEADYTRAIN_SUPERVISED         supervised()       "1" (yes) or "0"       not supervised
    STEADYTRAIN_RESTART            restart()          whole number >= 0      0
    STEADYTRAIN_MAX_MICRO_BATCH    max_micro_batch()  whole number >= 1      no cap (None)
    STEADYTRAIN_MEMORY_SAVERS      memory_savers()    whole number >= 0      0
    STEADYTRAIN_FSDP_OFFLOAD       fsdp_offload()     "1" (yes) or "0"       no
    STEADYTRAIN_RUN_DIR            run_dir()          a path                 None
    STEADYTRAIN_START_WATCH        start_watch()      {"run_dir", "limit_s"} None
    STEADYTRAIN_ANNOUNCE_FD        announce_fd()      "FD:INODE"             None
    STEADYTRAIN_OFFLOAD_STREAM     offload_stream()   "1" (yes) or "0"       yes
    STEADYTRAIN_FAULT_INJECT       fault_inject()     a phase name (tests)   None

An empty value is the same as an unset one. A value the supervisor would never write (one set by
hand: "abc", "-1", and "0" for the micro-batch cap, which would train on no samples) raises
`BadInputError` (exit 2) naming the variable, what it holds and the fix, wherever it is read. The
two handshakes (START_WATCH, ANNOUNCE_FD) are the exception: the supervisor makes them for one
child, a process that inherited a stale or foreign one (a torchrun rank) must still train, so one
that does not parse is taken as absent: the watch or the announcement is not made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from steadytrain.errors import BadInputError

ENV_SUPERVISED = "STEADYTRAIN_SUPERVISED"  # "1": a supervisor restarts this process
ENV_RESTART = "STEADYTRAIN_RESTART"  # how many times the supervisor has restarted it
ENV_MAX_MICRO_BATCH = "STEADYTRAIN_MAX_MICRO_BATCH"  # cap after the OS killed it for memory
ENV_RUN_DIR = "STEADYTRAIN_RUN_DIR"  # where the supervisor looks for progress
ENV_MEMORY_SAVERS = "STEADYTRAIN_MEMORY_SAVERS"  # rungs of the saver ladder to have in force
# "1": shard with FSDP2's offload policy, a sharded group's rung after every saver (a rank ran
# out of memory at micro-batch 1 with all of them in force)
ENV_FSDP_OFFLOAD = "STEADYTRAIN_FSDP_OFFLOAD"
# JSON {"run_dir": ..., "limit_s": ...} when the run directory is known: a process that imports
# steadytrain with it set watches itself for a hang from then on (safety.start_watch).
ENV_START_WATCH = "STEADYTRAIN_START_WATCH"
# "FD:INODE", a pipe's write end open in the child until the supervisor learns where the run
# writes (also beside a given --run-dir: a script's own run_dir may differ): a Trainer writes its
# run_dir there, one line, when fit() starts, if the file at FD is that pipe
# (safety.supervised.announce_run_dir).
ENV_ANNOUNCE_FD = "STEADYTRAIN_ANNOUNCE_FD"
# "0": offloaded checkpointing copies on the compute stream (memory.offload), for a benchmark.
ENV_OFFLOAD_STREAM = "STEADYTRAIN_OFFLOAD_STREAM"
# tests: "phase" or "phase:N" SIGKILLs the process at a save phase (checkpoint.file_io.fault).
ENV_FAULT_INJECT = "STEADYTRAIN_FAULT_INJECT"

Environ = Mapping[str, str]


class StartWatch(NamedTuple):
    """What ENV_START_WATCH asks: watch `run_dir` for a hang, `limit_s` seconds before fit()."""

    run_dir: Path
    limit_s: float


def supervised(environ: Environ = os.environ) -> bool:
    """Whether a `steadytrain run` restarts this process."""
    return _switch(environ, ENV_SUPERVISED, default=False)


def restart(environ: Environ = os.environ) -> int:
    """How many times `steadytrain run` restarted this command (0: first attempt, unsupervised)."""
    value = _whole(environ, ENV_RESTART, least=0, what="the restart number `steadytrain run` sets")
    return 0 if value is None else value


def max_micro_batch(environ: Environ = os.environ) -> int | None:
    """The largest micro-batch the run may start with, which `steadytrain run` sets after an
    out-of-memory or a memory kill (or the user, as the starting cap); None: no cap."""
    return _whole(
        environ, ENV_MAX_MICRO_BATCH, least=1, what="the largest micro-batch to start with"
    )


def memory_savers(environ: Environ = os.environ) -> int:
    """How many rungs of the memory savers' ladder to have in force before the first step (the
    OS killed an earlier attempt with no smaller micro-batch left); 0: none asked."""
    value = _whole(environ, ENV_MEMORY_SAVERS, least=0, what="how many memory savers to turn on")
    return 0 if value is None else value


def fsdp_offload(environ: Environ = os.environ) -> bool:
    """Whether `steadytrain run` asks a sharded run (`distributed: fsdp`) for its shards in host
    memory (FSDP2's offload policy, as the config's `fsdp_offload`): a rank of the attempt before
    ran out of memory at micro-batch 1 with every memory saver in force."""
    return _switch(environ, ENV_FSDP_OFFLOAD, default=False)


def run_dir(environ: Environ = os.environ) -> Path | None:
    """Where the supervisor looks for progress, when the command line does not say."""
    value = environ.get(ENV_RUN_DIR)
    return Path(value) if value else None


def start_watch(environ: Environ = os.environ) -> StartWatch | None:
    """What the supervisor asks a process that imports steadytrain to watch before fit(); None
    when it asks nothing, or the value does not parse (a handshake: never fatal)."""
    text = environ.get(ENV_START_WATCH)
    if not text:
        return None
    try:
        spec = json.loads(text)
        return StartWatch(Path(spec["run_dir"]), float(spec["limit_s"]))
    except (ValueError, KeyError, TypeError):
        return None


def announce_fd(environ: Environ = os.environ) -> tuple[int, int] | None:
    """(file descriptor, inode) of the pipe the supervisor reads the run directory from; None
    when it asks nothing, or the value is not "FD:INODE" (a handshake: never fatal)."""
    fd, _, inode = environ.get(ENV_ANNOUNCE_FD, "").partition(":")
    if not (fd.isdigit() and inode.isdigit()):
        return None
    return int(fd), int(inode)


def offload_stream(environ: Environ = os.environ) -> bool:
    """Whether offloaded checkpointing copies on a side stream (default) or on the compute one."""
    return _switch(environ, ENV_OFFLOAD_STREAM, default=True)


def fault_inject(environ: Environ = os.environ) -> str | None:
    """The save phase at which the tests' fault injection kills this process ("phase" or
    "phase:N"); its reader checks the phase against the phases it has."""
    return environ.get(ENV_FAULT_INJECT) or None


def _whole(environ: Environ, name: str, least: int, what: str) -> int | None:
    text = environ.get(name)
    if not text:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < least:
        raise BadInputError(
            f"{name}={text!r}: expected a whole number of at least {least} ({what}). "
            f"`steadytrain run` sets it for its child; set by hand, give such a number or "
            f"unset it (`unset {name}`)."
        )
    return value


def _switch(environ: Environ, name: str, default: bool) -> bool:
    text = environ.get(name)
    if not text:
        return default
    if text.strip() in ("0", "1"):
        return text.strip() == "1"
    raise BadInputError(
        f"{name}={text!r}: expected 1 (on) or 0 (off). Set it to one of them, or unset it "
        f"(`unset {name}`)."
    )
