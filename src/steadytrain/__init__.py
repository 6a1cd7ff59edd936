"""steadytrain: a training run on a memory-constrained machine finishes.

The public face: `Trainer` and `FitResult` (trainer), `TrainConfig` (config), `Callback`,
`Control`, `Event`, `StepMetrics` and `TrainState` (events), the errors (errors), `entrypoint`
(entry), `CarriedState` and `UserState` (user_state). The command line is `steadytrain` (cli).

The packages, highest layer first (each imports only those below it; pyproject.toml's
import-linter contracts, tests/test_layers):

cli           one entry point, `steadytrain`, thin over the rest
integrations  callbacks for code that keeps its own trainer (Hugging Face, Lightning, Keras,
              `RunGuard` for a loop of one's own), sharing one core
recipes       LoRA / QLoRA fine-tuning, merge, generate, evaluate, the offline demo
doctor        `steadytrain doctor`: can this machine train, and why not
entry         a script's errors as the documented exits: `@steadytrain.entrypoint`, and the
              exit hook importing steadytrain installs for a script without it
trainer       the run assembled from its parts, and `fit()`
checkpoint    the whole checkpoint concern: what is saved, the store, the resume decision
safety        callbacks that keep a run alive: signals, hang watchdog, memory watch, leaks
supervisor    `steadytrain run`: restarts a dead or hung run, climbs the memory ladder (no torch)
telemetry     callbacks that record and show: metrics, events, progress, the report
memory        estimate, probe, plan, advice and the memory savers
engine        the optimizer step, the loop, the sampler, the ranks' agreement; knows events only
config        the one validated config tree, its files and its words
user_state    state the program carries across steps, saved with the checkpoint
events        the callback protocol and the loop's events
device        the only code that knows cuda / mps / cpu
run           what the supervisor and its child both know: the run directory's names and records,
              the environment, durable writes (no torch)
errors        every error a user can cause, with its exit code
_lazy, _options, _terminal, _units, _version
              names loaded on first use, how a command declares its options, console writes that
              survive a closed terminal, sizes in words, the version
"""

from steadytrain._version import __version__
from steadytrain.config import TrainConfig
from steadytrain.entry import entrypoint
from steadytrain.entry import install_exit_hook as _install_exit_hook
from steadytrain.errors import (
    BadInputError,
    ConfigError,
    DeviceUnavailableError,
    DoesNotFitError,
    SteadytrainError,
    Stopped,
)
from steadytrain.events import Callback, Control, Event, StepMetrics, TrainState
from steadytrain.run import env as _run_env

_install_exit_hook()  # a plain script's uncaught refusal exits with its documented code too

if _run_env.start_watch() is not None:  # under `steadytrain run`, which asks for the watch
    from steadytrain.safety.watchdog import watch_from_start

    watch_from_start()  # a hang before fit() is caught too


def __getattr__(name: str):
    # The trainer imports torch; the CLI's light commands (config, report) should not pay for it.
    if name in ("Trainer", "FitResult"):
        from steadytrain import trainer

        return getattr(trainer, name)
    if name in ("CarriedState", "UserState"):  # torch too
        from steadytrain import user_state

        return getattr(user_state, name)
    raise AttributeError(f"module 'steadytrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The names loaded on first use (Trainer, CarriedState, ...) show in dir() and completion too.
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BadInputError",
    "Callback",
    "CarriedState",
    "ConfigError",
    "Control",
    "DeviceUnavailableError",
    "DoesNotFitError",
    "Event",
    "FitResult",
    "SteadytrainError",
    "StepMetrics",
    "Stopped",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "UserState",
    "__version__",
    "entrypoint",
]
