"""The checkpoint concern, one owner (DESIGN.md's "checkpoint" layer).

store.py        the store: a checkpoint folder committed atomically, verified on load, the last K kept
manifest.py     the manifest of hashes and its check, also of a library's save (no torch)
state.py        what a checkpoint holds: named stateful objects, saved and loaded by one pair
ranks.py        one rank or many: the same state, each rank's RNG streams and DCP shards
identity.py     the run's identity, checked before a checkpoint is loaded
fingerprint.py  the data fingerprint, part of the identity
writer.py       the callback that writes checkpoints (when, sync or in the background)
continuity.py   the callback that checks the first resumed step's loss
resume.py       the resume decision: the newest checkpoint that verifies, is this run's and loads
export.py       a checkpoint's trainable tensors into a rebuilt model (the adapter export)

It imports neither the engine's loop nor safety, telemetry or memory (tests/test_layers.py).
"""
