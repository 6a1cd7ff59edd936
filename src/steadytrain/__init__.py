"""steadytrain: a training run on a memory-constrained machine finishes."""

from steadytrain.config import TrainConfig
from steadytrain.entry import entrypoint
from steadytrain.errors import (
    BadInputError,
    ConfigError,
    DeviceUnavailableError,
    DoesNotFitError,
    SteadytrainError,
)
from steadytrain.events import Callback, Control, Event, TrainState
from steadytrain.trainer import FitResult, Trainer

__version__ = "0.1.0"

__all__ = [
    "BadInputError",
    "Callback",
    "ConfigError",
    "Control",
    "DeviceUnavailableError",
    "DoesNotFitError",
    "Event",
    "FitResult",
    "SteadytrainError",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "__version__",
    "entrypoint",
]
