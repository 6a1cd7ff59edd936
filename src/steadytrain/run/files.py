"""The run directory's names: every file and folder a run writes, and the environment variables
the supervisor and its child agree on. One place, so the writer (trainer, callbacks), the readers
(report, supervisor, demo) and the docs cannot drift apart. Events layer: imports nothing but the
environment variables' names (`run_env`).

    RUN_DIR/
      config.json            CONFIG          the resolved config
      metrics.jsonl          METRICS         one line per optimizer step
      events.jsonl           EVENTS          oom, shrink, checkpoint, resume, hang, ...
      estimate.json          ESTIMATE        optional: the planner's estimated peak, for the report
      checkpoints/           CHECKPOINTS     step-NNNNNNNN/ folders
      checkpoints/latest     LATEST          name of the newest committed checkpoint
      hangs/                 HANGS           stack dumps of detected hangs
      errors/                ERRORS          the whole traceback of a fit that failed
      heartbeat              HEARTBEAT       rewritten by the hang watchdog, read by the supervisor
      .lock                  LOCK            one writer per run directory
      report.html            REPORT_HTML     `steadytrain report`
      report/                REPORT_PLOTS    its PNGs
      final/                 FINAL           the exported model or adapter
      ranks/rank-N/          RANKS           rank N's (N > 0) metrics, events, lock, hangs
      training_config.json   TRAINING_CONFIG a fine-tune's resolved config (also in final/)
      adapters/step-N/       ADAPTERS        a fine-tune checkpoint exported as a peft adapter
      training.log           TRAINING_LOG    a fine-tune's console output

Every file a run writes goes through `steadytrain.run.durable`'s one writer (`open_in_run`,
`write_atomic`, `make_folder`), which never follows a symbolic link planted at the file or at a
folder on the way: the run stops with exit 2 naming the link. `WRITTEN` lists those paths;
tests/test_planted_links.py plants a link at each, and checks that a real run writes nothing
that is not listed.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

# The variables the supervisor sets in its child's environment: named, and read, in run_env.
from steadytrain.run.env import (
    ENV_ANNOUNCE_FD,
    ENV_FSDP_OFFLOAD,
    ENV_MAX_MICRO_BATCH,
    ENV_MEMORY_SAVERS,
    ENV_RESTART,
    ENV_RUN_DIR,
    ENV_START_WATCH,
    ENV_SUPERVISED,
)

CONFIG = "config.json"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
ESTIMATE = "estimate.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
HANGS = "hangs"
ERRORS = "errors"
HEARTBEAT = "heartbeat"
LOCK = ".lock"
REPORT_HTML = "report.html"
REPORT_PLOTS = "report"
FINAL = "final"
RANKS = "ranks"
TRAINING_CONFIG = "training_config.json"
ADAPTERS = "adapters"
TRAINING_LOG = "training.log"

OS_CLUTTER = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})  # Finder/Explorer droppings
APPLE_DOUBLE = "._"
"""macOS writes `._NAME` beside each file it copies onto a drive that cannot hold its extended
attributes (exFAT, FAT, SMB, NFS): a run directory carried on such a drive has one per file.
steadytrain names no file so."""


def is_os_clutter(name: str) -> bool:
    """A file the operating system leaves in a folder it shows or copies, not one of ours nor
    one the user put there."""
    return name in OS_CLUTTER or name.startswith(APPLE_DOUBLE)


# Every path a run directory gets, relative to it, with how it is written: "atomic" (a
# temporary renamed over it), "append" (a stream: JSONL, a log), "new" (made afresh; what was
# there is removed, a link refused), "exclusive" (a fresh name), "lock" (steadytrain.safety.lock),
# "folder" (a folder whose content another writer fills: the checkpoint store, an export
# published by a rename). `{...}` stands for a number, a time or a name; ranks/rank-{rank}/ holds
# the same files as the top for rank N > 0.
WRITTEN: tuple[tuple[str, str], ...] = (
    (CONFIG, "atomic"),
    (METRICS, "append"),
    (EVENTS, "append"),
    (HEARTBEAT, "atomic"),
    (LOCK, "lock"),
    (f"{HANGS}/backstop-{{pid}}.txt", "new"),
    (f"{HANGS}/{{stamp}}.txt", "exclusive"),
    (f"{ERRORS}/{{stamp}}-{{pid}}.txt", "new"),
    (CHECKPOINTS, "folder"),
    (REPORT_HTML, "atomic"),
    (f"{REPORT_PLOTS}/{{plot}}.png", "atomic"),
    (TRAINING_CONFIG, "atomic"),
    (TRAINING_LOG, "append"),
    (FINAL, "folder"),
    (f"{ADAPTERS}/step-{{step}}", "folder"),
    (f"{RANKS}/rank-{{rank}}", "folder"),
)


def listed(relative: str | os.PathLike) -> bool:
    """Whether `relative` (a path inside a run directory) is one `WRITTEN` names, or lies in a
    folder it names (checkpoints/..., final/...); a rank's folder holds the top's names."""
    parts = Path(relative).parts
    if len(parts) >= 2 and parts[0] == RANKS:
        parts = parts[2:] if len(parts) > 2 else ()
        if not parts:
            return True
    for pattern, how in WRITTEN:
        glob = _glob(pattern)
        depth = len(Path(pattern).parts)
        if fnmatch.fnmatchcase("/".join(parts), glob):
            return True
        if how == "folder" and fnmatch.fnmatchcase("/".join(parts[:depth]), glob):
            return True
        if 0 < len(parts) < depth and fnmatch.fnmatchcase(
            "/".join(parts), "/".join(Path(glob).parts[: len(parts)])
        ):
            return True  # a folder on the way (hangs/, errors/)
    name = parts[-1] if parts else ""
    if name.startswith(".") and name.endswith(".tmp"):  # write_atomic's temporary of a name
        inner = name[1:].rsplit(".", 2)[0]
        return listed(Path(*parts[:-1], inner)) if inner else False
    return False


def _glob(pattern: str) -> str:
    out, depth = "", 0
    for char in pattern:
        if char == "{":
            depth += 1
            out += "*" if depth == 1 else ""
        elif char == "}":
            depth -= 1
        elif depth == 0:
            out += char
    return out


def top(run_dir: str | os.PathLike) -> Path:
    """The run directory that holds `run_dir`: itself, or for rank N's folder
    (RUN_DIR/ranks/rank-N) RUN_DIR, so that a link at ranks/ or rank-N/ is refused too."""
    run_dir = Path(run_dir)
    if run_dir.parent.name == RANKS and run_dir.name.startswith("rank-"):
        return run_dir.parent.parent
    return run_dir


__all__ = [
    "ADAPTERS",
    "CHECKPOINTS",
    "CONFIG",
    "ENV_ANNOUNCE_FD",
    "ENV_FSDP_OFFLOAD",
    "ENV_MAX_MICRO_BATCH",
    "ENV_MEMORY_SAVERS",
    "ENV_RESTART",
    "ENV_RUN_DIR",
    "ENV_START_WATCH",
    "ENV_SUPERVISED",
    "ERRORS",
    "ESTIMATE",
    "EVENTS",
    "FINAL",
    "HANGS",
    "HEARTBEAT",
    "LATEST",
    "LOCK",
    "METRICS",
    "RANKS",
    "REPORT_HTML",
    "REPORT_PLOTS",
    "TRAINING_CONFIG",
    "TRAINING_LOG",
]
