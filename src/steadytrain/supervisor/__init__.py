"""`steadytrain run`: the supervisor, a separate process that restarts a training command when
it dies, and imports nothing of the training loop (no torch): it must outlive whatever kills the
trainer. Its modules, by concern:

    options          SupervisorOptions and where the run directory comes from
    restart_loop     Supervisor: the loop over attempts and its decisions (the whole story is
                     in that module's docstring)
    child_process    one attempt's process: start, wait, forward signals, kill, back off
    heartbeat_watch  the out-of-process hang check on RUN_DIR/heartbeat
    address_space    the child's address space against its RLIMIT_AS, sampled while it runs:
                     a native crash near that cap is taken for an out-of-memory
    child_exit       how the child ended (ChildExit), in words
    attempt_end      what the run directory says about that end: the memory at a kill, the
                     error the trainer recorded, which rank of a torchrun group failed first
    progress         the newest checkpoint's step, the last micro-batch, the savers recorded
    restart_size     how big the next attempt starts after a memory kill
    start_kill       a kill before the first step (while the model loads): how it is told,
                     the savers' ladder it climbs, what the run directory says of its size
    oom_counter      the OS out-of-memory killer's counter
    words            the console lines' phrasing

The child's side (what the trainer writes for the supervisor, and reads from it) is in
`steadytrain.safety.supervised` and `steadytrain.safety.failure_record`; the names both sides
agree on are in `steadytrain.run.files` and `steadytrain.run.events`, below both.

This package's names are its public face; other layers import nothing else of it (a forbidden
contract in pyproject.toml): `checkpoint_step(run_dir)` is the progress the supervisor counts
(the step of the newest committed checkpoint), for a program that drives it (the demo).
"""

from steadytrain.supervisor.options import SupervisorOptions, resolve_run_dir
from steadytrain.supervisor.progress import checkpoint_step
from steadytrain.supervisor.restart_loop import Supervisor

__all__ = ["Supervisor", "SupervisorOptions", "checkpoint_step", "resolve_run_dir"]
