"""A Keras 3 fit on any backend (KERAS_BACKEND), no torch imported by this script: a small
network with two Dropout layers (one unseeded: torch's own stream on the torch backend, Keras's
SeedGenerator on the others; one seeded: its SeedGenerator everywhere), steadytrain's callback as
its one added line.

    python keras_any.py RUN_DIR [--batch B] [--epochs E] [--samples N] [--slow S]
                        [--limit-mib M] [--width W] [--term-at N] [--val-batch V]
                        [--callback-batch C]

--slow sleeps S seconds per training batch (time to SIGKILL mid-run); --term-at sends the process
SIGTERM as its Nth training batch begins (a stop at a known batch); --limit-mib caps the address
space at the process's own size plus M MiB for fit (a real out-of-memory of the backend's
allocator where the batch's activations do not fit), lifted again before the results are
written. The batch size passed to fit is --batch, or the cap `steadytrain run` sets after an
out-of-memory (`max_micro_batch()`), whichever is less. --val-batch validates on V samples (the
training data repeated) at each epoch end in one batch (in batches of the cap where it is less):
fit's validation, outside the compiled train step. --callback-batch has a callback of the user's
predict on C samples (capped the same way) at each epoch end: a callback's own work.
Writes RUN_DIR/weights.npz and RUN_DIR/result.json (the batch size, the epochs' losses of this
process's fit, whether torch got loaded) when fit() returns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

import keras
import numpy as np
from _common import vm_size

from steadytrain.integrations import max_micro_batch
from steadytrain.integrations.keras import SteadytrainCallback

FEATURES = 16


class EpochEndPredict(keras.callbacks.Callback):
    """The user's own epoch-end code: a prediction over `samples` in one batch."""

    def __init__(self, samples: np.ndarray):
        super().__init__()
        self.samples = samples

    def on_epoch_end(self, epoch, logs=None):
        self.model.predict(self.samples, batch_size=len(self.samples), verbose=0)


class UserBatches(keras.callbacks.Callback):
    """The user's own per-batch code: slow enough to be killed mid-run, or stopped by a SIGTERM
    at its `term_at`-th batch."""

    def __init__(self, slow: float, term_at: int | None):
        super().__init__()
        self.slow, self.term_at, self.batches = slow, term_at, 0

    def on_train_batch_begin(self, batch, logs=None):
        self.batches += 1
        if self.batches == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.slow)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=36)  # a short last batch
    parser.add_argument("--width", type=int, default=32, help="the first layer's")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--term-at", type=int)
    parser.add_argument("--val-batch", type=int)
    parser.add_argument("--callback-batch", type=int)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.3, seed=7),  # its SeedGenerator's stream on every backend
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.samples, FEATURES), dtype=np.float32)
    y = rng.standard_normal((args.samples, 1), dtype=np.float32)
    callbacks = [SteadytrainCallback(args.run_dir)]  # the line
    if args.slow or args.term_at:
        callbacks.append(UserBatches(args.slow, args.term_at))
    cap = max_micro_batch()
    batch = min(args.batch, cap or args.batch)
    validation = {}
    if args.val_batch:
        size = args.val_batch  # one batch of V samples, in pieces of the cap where it is less
        validation = {
            "validation_data": (np.resize(x, (size, FEATURES)), np.resize(y, (size, 1))),
            "validation_batch_size": min(size, cap or size),
        }
    if args.callback_batch:
        size = min(args.callback_batch, cap or args.callback_batch)
        callbacks.append(EpochEndPredict(np.resize(x, (size, FEATURES))))
    uncapped = resource.getrlimit(resource.RLIMIT_AS)
    if args.limit_mib:
        model.predict(x[:1], verbose=0)  # the backend's start-up, before the cap
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, uncapped[1]))
    history = model.fit(
        x,
        y,
        batch_size=batch,
        epochs=args.epochs,
        shuffle=True,
        verbose=0,
        callbacks=callbacks,
        **validation,
    )
    resource.setrlimit(resource.RLIMIT_AS, uncapped)  # the cap is the training's, not ours
    out = Path(args.run_dir)
    np.savez(out / "weights.npz", *[np.asarray(w) for w in model.get_weights()])
    torch_loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    result = {
        "batch": batch,
        # Keras's running mean at each epoch's end (none when a resumed fit had nothing left)
        "epoch_losses": history.history.get("loss", []),
        "torch_loaded": bool(torch_loaded),
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
