"""steadytrain for code that keeps its own trainer.

* `steadytrain.integrations.huggingface.SteadytrainCallback`: `transformers.Trainer`;
* `steadytrain.integrations.lightning.SteadytrainCallback`: Lightning (`lightning` and
  `pytorch_lightning`);
* `steadytrain.integrations.keras.SteadytrainCallback`: Keras 3;
* `RunGuard`: a loop of your own (a heartbeat and a guarded step). docs/integrations.md.

guard.py        `RunGuard`: the watchdog, memory watch, run files and signals of one run directory
core.py         what every integration shares: `Options`, the supervisor's cap (`max_micro_batch`),
                the one "halve or give up" after an out-of-memory
huggingface.py  the callback for `transformers.Trainer`
lightning.py    the callback for Lightning
keras.py        the callback for Keras 3, on any backend; keras_state.py: its RNG streams as JSON

Their checkpoints' manifests are the checkpoint package's (`steadytrain.checkpoint.manifest`, no
torch). Each module imports its library only when used, so this package imports without any of
them.
"""

from steadytrain.integrations.core import max_micro_batch
from steadytrain.integrations.guard import RunGuard

__all__ = ["RunGuard", "max_micro_batch"]
