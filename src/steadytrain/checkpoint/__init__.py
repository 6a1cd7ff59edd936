"""The checkpoint concern, one owner (DESIGN.md's "checkpoint" layer).

run_state.py    a run's checkpoint as one object: its states saved and loaded, and the resume
                decision (the newest checkpoint that verifies, is this run's and loads)
state.py        what a checkpoint holds: named stateful objects, saved and loaded by one pair
ranks.py        one rank or many: the same states, each rank's RNG streams and DCP shards
writer.py       the callback that writes checkpoints (when, sync or in the background)
store.py        the store: a checkpoint folder committed atomically, verified on load, last K kept
payload.py      what one checkpoint holds as files, checked before it is saved, and its size on disk
manifest.py     what a committed checkpoint folder is (MANIFEST.json), verified before it is read;
                also a library's save (steadytrain-manifest.json); no torch
file_io.py      every byte of a checkpoint file written, hashed, fsynced and read back
tie.py          a checkpoint's files tied to each other (its step and id in each), so a file
                copied in from another checkpoint is refused even where its hash was re-signed
host.py         host copies of the tensors for a background write, checked to read back
leftovers.py    what killed saves leave in the checkpoints folder, and its removal
identity.py     the run's identity, checked before a checkpoint is loaded
fingerprint.py  the data fingerprint, part of the identity
continuity.py   the callback that checks the first resumed step's loss
export.py       a checkpoint's trainable tensors into a rebuilt model (the adapter export)

It imports neither the engine's loop nor safety, telemetry or memory (tests/test_layers).
"""
