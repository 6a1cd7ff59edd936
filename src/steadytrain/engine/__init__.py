"""The optimizer step, the loop and the resumable sampler. Emits events; knows no files.

loop.py               the training loop: read it top to bottom; everything cross-cutting is an event
step.py               one optimizer step that survives out-of-memory (micro-batches, shrink, redo)
sampler.py            the resumable sampler: one item per optimizer step, exact on resume
precision.py          the arithmetic: autocast dtype and grad scaler, refused when the device cannot
accumulation.py       exact gradient accumulation, one micro-batch at a time, whatever the split
batching.py           collated batches as nested tensors: their length and micro-batch splits
collate.py            collation of whatever samples a map-style dataset returns
side_pass.py          a pass outside the training leaves no trace: what it changes is put back
evaluation.py         evaluation during training, at a cadence of steps and/or epochs
agreement.py          how the ranks agree on a step: one strategy per mode
distributed.py        several processes through torchrun: the process group as the engine sees it
sharding.py           `distributed: fsdp`: the model sharded over the ranks with FSDP2
compiling.py          `compile: true`: the model's repeated blocks compiled in place
fused_projections.py  the LoRA products of projections that read the same input, as one each
lora_product.py       a LoRA linear's output as one matrix product
workers.py            the stop path owns the DataLoader's worker processes
open_files.py         the open-files limit reached while training, said in the run's terms
one_sample.py         BatchNorm refusing a batch of one sample, said in the run's terms
"""

from steadytrain._lazy import lazy_names

# Loaded on first use: `engine.workers` (the stop path's DataLoader workers) is imported by the
# safety callbacks that RunGuard gives programs without torch (Keras on TensorFlow).
_WHERE = {
    "Loop": "loop",
    "OptimizerBatchSampler": "sampler",
    "Precision": "precision",
    "StepRunner": "step",
    "resolve_precision": "precision",
}
__getattr__, __dir__ = lazy_names(__name__, _WHERE)
__all__ = sorted(_WHERE)
