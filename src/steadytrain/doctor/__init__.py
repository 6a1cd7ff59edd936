"""`steadytrain doctor`: what a user runs first, to learn whether this machine can train and why not.

Each check is a function of a `Context` (an injected `SystemProbe`, backends and environment) and
returns findings: a status (ok / warn / fail / info), what was found and, for warn and fail, the
fix. Exit 0 healthy, 1 warnings, 2 broken. Tests run it against `steadytrain.device.testing`'s
doubles to see a Rosetta Python, a broken MPS or a bad watermark on a Linux machine.

diagnosis.py      the doctor's run: every check in reading order, the exit code, the table or JSON
options.py        the options of `steadytrain doctor` (`DoctorOptions`), without torch
findings.py       what a check returns (`Finding`), what it reads (`Context`), shared thresholds
checks.py         the checks of platform, Python, torch, devices, memory, autocast, disk, self-test
environment.py    the checks of environment variables (MPS watermarks, CPU fallback, CUDA allocator)
threads.py        the thread check: torch's compute threads against the cores
process_group.py  the process group this machine would train in (one process, or torchrun's ranks)

The names load on first use: `DoctorOptions` (the command's options) imports without torch, so
the command line reads it without loading the checks; `diagnose` and `run_doctor` bring torch.
"""

from __future__ import annotations

from steadytrain._lazy import lazy_names

_WHERE = {
    "DoctorOptions": "options",
    "Finding": "findings",
    "diagnose": "diagnosis",
    "exit_code": "diagnosis",
    "run_doctor": "diagnosis",
}
__getattr__, __dir__ = lazy_names(__name__, _WHERE)
__all__ = sorted(_WHERE)
