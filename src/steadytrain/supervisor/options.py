"""`steadytrain run`'s options (SupervisorOptions: the restart limit, the backoff, the stop and
first-heartbeat timeouts, the run directory) with their reasons and checks, and where the run
directory comes from when --run-dir is not given."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from steadytrain.errors import BadInputError
from steadytrain.run import env as run_env


@dataclass(frozen=True)
class SupervisorOptions:
    max_restarts: int = 5
    """Give up (exit 4) after this many restarts in a row without a new checkpoint (a restart
    that starts smaller after a memory kill or exit 76 is not counted). Five, as
    systemd's StartLimitBurst: enough for bad luck, few enough that a broken job stops soon."""
    backoff_initial: float = 1.0
    """Seconds before the first restart: quick, the usual crash is a one-off."""
    backoff_max: float = 60.0
    """The delay doubles on each failure in a row without progress, up to this many seconds."""
    stop_timeout: float = 120.0
    """After forwarding SIGINT/SIGTERM, how long the child may take to save and exit before it
    gets SIGKILL. Saving a large checkpoint takes a while; two minutes covers most."""
    healthy_run_s: float = 600.0
    """A child that ran this long before dying resets the backoff (not the no-progress count),
    as Kubernetes resets CrashLoopBackOff after 10 minutes of running."""
    run_dir: Path | None = None
    """Where the run writes checkpoints/latest, metrics.jsonl and events.jsonl; None: unknown."""
    first_heartbeat_s: float = 3600.0
    """An attempt of a steadytrain run that has written no heartbeat this long after it started
    is hung before its watchdog began (importing, building the model, a blocked read) and is
    killed and restarted. An hour, as nvidia-resiliency-ext's first-heartbeat default: a model
    download or a cold import on a slow disk must not look like a hang. Applies once the run
    directory holds a config.json or an earlier attempt wrote a heartbeat (a steadytrain run)."""

    advice: Callable[[Path, list[str]], list[str]] | None = field(default=None, repr=False)
    """What would make a run the OS killed with every memory saver on fit, from its run
    directory and the savers in force; None: the general list. The command line passes the
    fine-tune advisor (this module imports nothing of the training side)."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_restarts < 0:
            problems.append(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if not self.backoff_initial >= 0:
            problems.append(f"--backoff-initial must be 0 s or more, got {self.backoff_initial}")
        if not self.backoff_max >= self.backoff_initial:
            problems.append(
                f"--backoff-max ({self.backoff_max} s) must be at least --backoff-initial "
                f"({self.backoff_initial} s)"
            )
        if not self.stop_timeout > 0:
            problems.append(f"--stop-timeout must be more than 0 s, got {self.stop_timeout}")
        if not self.first_heartbeat_s > 0:
            problems.append(
                f"--first-heartbeat-timeout must be more than 0 s, got {self.first_heartbeat_s}"
            )
        if self.run_dir is not None and (file := _file_on_the_way(self.run_dir)) is not None:
            where = "is a file" if file == self.run_dir else f"is under {file}, a file"
            problems.append(
                f"the run directory {self.run_dir} (--run-dir, $STEADYTRAIN_RUN_DIR or the "
                f"fine-tune's output_dir) {where}: the run's checkpoints and events go in a "
                "folder there; give a folder"
            )
        if problems:
            raise BadInputError("; ".join(problems))


def _file_on_the_way(path: Path) -> Path | None:
    """The first of `path` and its parents that exists, where it is not a folder; else None."""
    for place in (path, *path.parents):
        if place.exists():
            return None if place.is_dir() else place
    return None


def resolve_run_dir(value: str | os.PathLike | None, environ: Mapping[str, str]) -> Path | None:
    """--run-dir, else $STEADYTRAIN_RUN_DIR, else None (progress cannot be seen)."""
    if value is None:
        return run_env.run_dir(environ)
    return Path(value)
