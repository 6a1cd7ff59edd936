"""The supervised command's process, one attempt at a time: started in its own session (process
group) with the environment the supervisor gives it, waited for while the signals the supervisor
gets are forwarded to its group (SIGKILL if it is still there --stop-timeout later) and its
heartbeat is watched and its address space sampled (`address_space`), its leftovers killed after
it ended, and the backoff before the next attempt, which a stop signal cuts short. Learns the run
directory when the child announces it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from steadytrain.errors import BadInputError
from steadytrain.run.files import (
    ENV_ANNOUNCE_FD,
    ENV_FSDP_OFFLOAD,
    ENV_MAX_MICRO_BATCH,
    ENV_MEMORY_SAVERS,
    ENV_RESTART,
    ENV_START_WATCH,
    ENV_SUPERVISED,
)
from steadytrain.supervisor.address_space import AddressSpace, read_address_space
from steadytrain.supervisor.heartbeat_watch import HeartbeatWatch
from steadytrain.supervisor.options import SupervisorOptions
from steadytrain.supervisor.words import seconds

POLL_S = 0.1  # how often the wait loop looks at forwarded signals and the stop deadline
LEFTOVER_WAIT_S = 2.0  # killed processes go in milliseconds; a zombie counts until it is reaped


class ChildProcess:
    """`command` run under `environ` (its base environment), with `options` (the run directory
    in them replaced by the one the child announces); `say` prints a supervisor line, `record`
    appends an event (name, step, fields)."""

    def __init__(
        self,
        command: Sequence[str],
        environ: Mapping[str, str],
        options: SupervisorOptions,
        say: Callable[[str], None],
        record: Callable[..., None],
    ):
        self.command, self.environ, self.options = list(command), dict(environ), options
        self.say = say
        self.proc: subprocess.Popen | None = None
        self.stop_signal: int | None = None  # the first stop signal we got
        self.sent_kill = False  # the stop timeout ran out and we sent SIGKILL
        self.heartbeat = HeartbeatWatch(say, record, self.signal)
        self.address_space: AddressSpace | None = None  # the attempt's last reading
        self._pending: list[int] = []  # signals received, not yet forwarded
        self._forwarded = 0
        self._announced: int | None = None  # read end of the ENV_ANNOUNCE_FD pipe
        self._said_unlocated = False
        self._given_run_dir = options.run_dir  # --run-dir, $STEADYTRAIN_RUN_DIR, output_dir

    def run(
        self, attempt: int, max_micro: int | None, savers: int | None, fsdp_offload: bool = False
    ) -> int:
        """Start attempt `attempt` (0 first) and wait for its end: its `Popen.returncode`.
        `fsdp_offload`: a sharded group's shards in host memory (ENV_FSDP_OFFLOAD)."""
        env = {**self.environ, ENV_SUPERVISED: "1", ENV_RESTART: str(attempt)}
        if self.options.run_dir is not None:  # the child watches itself from its start
            start = {
                "run_dir": str(self.options.run_dir),
                "limit_s": self.options.first_heartbeat_s,
            }
            env[ENV_START_WATCH] = json.dumps(start)
        self.heartbeat.new_attempt()
        self.address_space = None
        if max_micro is not None:
            env[ENV_MAX_MICRO_BATCH] = str(max_micro)
        if savers is not None:
            env[ENV_MEMORY_SAVERS] = str(savers)
        if fsdp_offload:
            env[ENV_FSDP_OFFLOAD] = "1"
        self.proc = self._start(env)
        self.say(f"attempt {attempt + 1} runs as pid {self.proc.pid}")
        returncode = self._wait(self.proc)
        self._learn_run_dir()  # what it said before it ended
        return returncode

    def _start(self, env: dict[str, str]) -> subprocess.Popen:
        write_end = None
        if self._announced is not None:  # a grandchild of the last attempt kept it open
            os.close(self._announced)
            self._announced = None
        if self.options.run_dir == self._given_run_dir:  # nothing learned yet
            # Ask the child's Trainer where it writes, also where a run dir was given: a
            # script's own run_dir beside a different --run-dir is where its checkpoints are.
            # The pipe's inode goes with its number, so that only a process that inherited this
            # pipe writes to it (a torchrun rank has another file at that number, if any).
            self._announced, write_end = os.pipe()
            os.set_blocking(self._announced, False)
            env[ENV_ANNOUNCE_FD] = f"{write_end}:{os.fstat(write_end).st_ino}"
        try:
            # Own session: a terminal's Ctrl-C reaches only us, and we forward it once.
            return subprocess.Popen(
                self.command,
                env=env,
                start_new_session=True,
                pass_fds=() if write_end is None else (write_end,),
            )
        except OSError as exc:
            raise BadInputError(f"cannot start {shlex.join(self.command)}: {exc}") from exc
        finally:
            if write_end is not None:
                os.close(write_end)

    def _learn_run_dir(self) -> None:
        """Take the run directory the child announced (ENV_ANNOUNCE_FD), once it did or ended."""
        if self._announced is None:
            return
        try:  # the path's own bytes, one line: a space at its end or a name not in UTF-8 kept
            line = os.fsdecode(os.read(self._announced, 65536).partition(b"\n")[0])
        except BlockingIOError:
            return  # nothing yet, and the child is still there
        except OSError:
            line = ""
        os.close(self._announced)
        self._announced = None
        if line:
            given = self._given_run_dir
            if given is not None and Path(line).resolve() == Path(given).resolve():
                return
            self.options = dataclasses.replace(self.options, run_dir=Path(line))
            if given is None:
                self.say(f"run dir {line} (announced by the child); counting progress there")
            else:
                self.say(
                    f"the child writes its run to {line}, not to the run dir given ({given}): "
                    "counting progress there (pass that as --run-dir, or give the script the "
                    "same run_dir)"
                )
        elif self._given_run_dir is None and not self._said_unlocated:
            self._said_unlocated = True
            self.say(
                "the child announced no run dir (it trains through neither steadytrain's "
                "Trainer nor an integration's RunGuard): pass --run-dir to count its "
                "checkpoints as progress (checkpoints/latest, or checkpoint events in "
                "events.jsonl)"
            )

    def _wait(self, proc: subprocess.Popen) -> int:
        deadline: float | None = None
        while True:
            self._forward_pending()
            if self.stop_signal is not None and deadline is None:
                deadline = time.monotonic() + self.options.stop_timeout
            if deadline is not None and not self.sent_kill and time.monotonic() >= deadline:
                name = signal.Signals(self.stop_signal).name
                self.say(
                    f"child still running {seconds(self.options.stop_timeout)} s after {name}: "
                    "sending SIGKILL"
                )
                self.signal(signal.SIGKILL)
                self.sent_kill = True
            if self.stop_signal is None:
                self._learn_run_dir()
                self.heartbeat.check(proc, self.options)
            self.address_space = read_address_space(proc.pid) or self.address_space
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                continue

    def on_signal(self, signum: int, frame: object) -> None:
        # Only record: the wait loop forwards within POLL_S (no race with starting a child).
        self._pending.append(signum)
        if self.stop_signal is None:
            self.stop_signal = signal.SIGTERM if signum == signal.SIGHUP else signum

    def _forward_pending(self) -> None:
        while self._pending:
            signum = self._pending.pop(0)
            forward = signal.SIGTERM if signum == signal.SIGHUP else signal.Signals(signum)
            self._forwarded += 1
            if self._forwarded == 1:
                self.say(
                    f"got {signal.Signals(signum).name}: forwarding {forward.name} to the child "
                    f"(pid {self.proc.pid if self.proc else '-'}) and not restarting it; "
                    f"waiting up to {seconds(self.options.stop_timeout)} s for it to save and stop"
                )
            else:
                self.say(f"got {signal.Signals(signum).name} again: forwarding {forward.name}")
            self.signal(forward)

    def signal(self, signum: int) -> None:
        """Send to the child's process group: the child and what it started (data workers,
        torchrun's workers), as a terminal's Ctrl-C would."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(self.proc.pid, signum)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_leftovers(self) -> None:
        """Processes the dead child left in its group (data workers) would hold memory the next
        attempt needs, and inherited file descriptors such as the run directory's lock. The
        group id stays reserved while any member lives, so this cannot hit an unrelated
        process. Waits (briefly: members not yet reaped still count) until they are gone."""
        if self.proc is None:
            return
        self.signal(signal.SIGKILL)
        end = time.monotonic() + LEFTOVER_WAIT_S
        while time.monotonic() < end:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.01)

    def sleep(self, delay: float) -> bool:
        """Sleep `delay` seconds, unless a stop signal comes first (then False)."""
        end = time.monotonic() + delay
        while self.stop_signal is None:
            left = end - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, POLL_S))
        self._pending.clear()  # no child to forward to
        return False
