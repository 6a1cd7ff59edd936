"""What keeps a run safe to stop, kill and restart: signals, the run directory's lock, the hang
watchdog, the memory watch, and the child's side of `steadytrain run`.

signals.py         Ctrl-C, SIGTERM and SIGHUP: finish the step, commit a checkpoint, exit
lock.py            one process per run directory: RUN_DIR/.lock
watchdog.py        the hang watchdog: a step without progress for too long caught, written, ended
hang_limits.py     how long the hang watching waits before it acts, phase by phase
backstop.py        the second layer of hang watching (no GIL needed), and the end of a hung process
hang_files.py      what a hang leaves on disk (RUN_DIR/hangs/), and what the supervisor reads back
start_watch.py     a process under `steadytrain run` watched from import till a fit's watchdog
supervised.py      the child's side of `steadytrain run`: what it reads and what it tells
failure_record.py  what a failed `fit()` leaves: the traceback in RUN_DIR/errors/, an error event
memory_watch.py    the memory watch callback: leaks, swap and pressure, cache policy
leaks.py           leaks: readings at the same point of the step, and the steady rise
thrash.py          thrashing: a run that slid into swap, told from one reading per step

It imports none of its siblings (checkpoint, supervisor, telemetry, memory) nor anything above
them (the layers contract in pyproject.toml, run by tests/test_layers).
"""
