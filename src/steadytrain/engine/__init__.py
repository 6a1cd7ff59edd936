"""The optimizer step, the loop and the resumable sampler. Emits events; knows no files."""

from steadytrain.engine.loop import Loop
from steadytrain.engine.precision import Precision, resolve_precision
from steadytrain.engine.sampler import OptimizerBatchSampler
from steadytrain.engine.step import StepRunner

__all__ = ["Loop", "OptimizerBatchSampler", "Precision", "StepRunner", "resolve_precision"]
