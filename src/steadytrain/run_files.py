"""The run directory's names: every file and folder a run writes, and the environment variables
the supervisor and its child agree on. One place, so the writer (trainer, callbacks), the readers
(report, supervisor, demo) and the docs cannot drift apart. Events layer: imports nothing.

    RUN_DIR/
      config.json            CONFIG          the resolved config
      metrics.jsonl          METRICS         one line per optimizer step
      events.jsonl           EVENTS          oom, shrink, checkpoint, resume, hang, ...
      estimate.json          ESTIMATE        optional: the planner's estimated peak, for the report
      checkpoints/           CHECKPOINTS     step-NNNNNNNN/ folders
      checkpoints/latest     LATEST          name of the newest committed checkpoint
      hangs/                 HANGS           stack dumps of detected hangs
      heartbeat              HEARTBEAT       rewritten by the hang watchdog, read by the supervisor
      .lock                  LOCK            one writer per run directory
      report.html            REPORT_HTML     `steadytrain report`
      final/                 FINAL           the exported model or adapter
      ranks/rank-N/          RANKS           rank N's (N > 0) metrics, events, lock, hangs
      training_config.json   TRAINING_CONFIG a fine-tune's resolved config (also in final/)
      adapters/step-N/       ADAPTERS        a fine-tune checkpoint exported as a peft adapter
      training.log           TRAINING_LOG    a fine-tune's console output
"""

from __future__ import annotations

CONFIG = "config.json"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
ESTIMATE = "estimate.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
HANGS = "hangs"
HEARTBEAT = "heartbeat"
LOCK = ".lock"
REPORT_HTML = "report.html"
FINAL = "final"
RANKS = "ranks"
TRAINING_CONFIG = "training_config.json"
ADAPTERS = "adapters"
TRAINING_LOG = "training.log"

# The supervisor sets these in its child's environment.
ENV_SUPERVISED = "STEADYTRAIN_SUPERVISED"  # "1": a supervisor restarts this process
ENV_RESTART = "STEADYTRAIN_RESTART"  # how many times the supervisor has restarted it
ENV_MAX_MICRO_BATCH = "STEADYTRAIN_MAX_MICRO_BATCH"  # cap after the OS killed it for memory
ENV_RUN_DIR = "STEADYTRAIN_RUN_DIR"  # where the supervisor looks for progress
ENV_MEMORY_SAVERS = "STEADYTRAIN_MEMORY_SAVERS"  # rungs of the saver ladder to have in force
# A pipe's write end, open in the child while the supervisor does not know the run directory:
# a Trainer writes its run_dir there, one line, when fit() starts (safety.child.announce_run_dir).
ENV_ANNOUNCE_FD = "STEADYTRAIN_ANNOUNCE_FD"

__all__ = [
    "ADAPTERS",
    "CHECKPOINTS",
    "CONFIG",
    "ENV_ANNOUNCE_FD",
    "ENV_MAX_MICRO_BATCH",
    "ENV_MEMORY_SAVERS",
    "ENV_RESTART",
    "ENV_RUN_DIR",
    "ENV_SUPERVISED",
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
    "TRAINING_CONFIG",
    "TRAINING_LOG",
]
