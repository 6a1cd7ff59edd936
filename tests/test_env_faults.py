"""Faults planted in the environment around a run, with real processes: the wall clock stepped
back mid-attempt (an NTP correction, a laptop's clock set right after waking).
"""

from __future__ import annotations

import io
import os
import sys

from test_signal_seams import FAST, SWALLOWS_STOPPED

from steadytrain.supervisor import Supervisor, SupervisorOptions
from steadytrain.telemetry.files import read_jsonl

# Loaded by the child's Python at start-up (a sitecustomize module on PYTHONPATH): its wall clock
# reads an hour earlier than the supervisor's, as after an NTP step back once the attempt began.
CLOCK_STEPPED_BACK = """
import time
_wall = time.time
time.time = lambda: _wall() - 3600.0
"""


def _child_environ(tmp_path, sitecustomize: str) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(sitecustomize)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEADYTRAIN_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    return environ


def test_a_stop_recorded_after_the_clock_stepped_back_is_still_a_stop(tmp_path):
    """The child caught `steadytrain.Stopped` at step 2 of 6 and exited 0, its clock an hour
    behind the attempt's start. The supervisor tells the attempt's fit_end by its place in
    events.jsonl, not its time: exit 143 as with a steady clock, not 0 ("finished")."""
    script = tmp_path / "train.py"
    script.write_text(SWALLOWS_STOPPED)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    supervisor = Supervisor(
        [sys.executable, str(script), str(run_dir)],
        SupervisorOptions(run_dir=run_dir, **FAST),
        environ=_child_environ(tmp_path, CLOCK_STEPPED_BACK),
        out=out,
        oom_kill_count=lambda: None,
    )
    assert supervisor.run() == 143, out.getvalue()
    said = out.getvalue()
    assert "starting attempt 2" not in said
    assert "child exited 0, but its run was stopped by SIGTERM at step 2" in said
    events = read_jsonl(run_dir / "events.jsonl")
    fit_end = next(e for e in events if e["event"] == "fit_end")
    assert fit_end["time"] < events[-1]["time"] - 3000  # the child's clock was behind
    assert (events[-1]["event"], events[-1]["exit_code"]) == ("supervisor_end", 143)
