"""steadytrain for code that keeps its own trainer.

* `steadytrain.integrations.huggingface.SteadytrainCallback`: `transformers.Trainer`;
* `steadytrain.integrations.lightning.SteadytrainCallback`: Lightning (`lightning` and
  `pytorch_lightning`);
* `steadytrain.integrations.keras.SteadytrainCallback`: Keras 3;
* `RunGuard`: a loop of your own (a heartbeat and a guarded step). docs/integrations.md.

Each module imports its library only when used, so this package imports without any of them.
"""

from steadytrain.integrations.guard import RunGuard, max_micro_batch

__all__ = ["RunGuard", "max_micro_batch"]
