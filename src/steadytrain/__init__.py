"""steadytrain: a training run on a memory-constrained machine finishes."""

from steadytrain import run_env as _run_env
from steadytrain._version import __version__
from steadytrain.config import TrainConfig
from steadytrain.entry import entrypoint
from steadytrain.errors import (
    BadInputError,
    ConfigError,
    DeviceUnavailableError,
    DoesNotFitError,
    SteadytrainError,
    Stopped,
)
from steadytrain.events import Callback, Control, Event, StepMetrics, TrainState

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
