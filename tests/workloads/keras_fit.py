"""A Keras 3 fit (torch backend) with steadytrain's callback as its one added line.

    python keras_fit.py RUN_DIR [--batch B] [--epochs E] [--samples N] [--limit-mib M]
                        [--hang-at N] [--hang-timeout T] [--slow S]

The model and the memory cap are those of hf_trainer.py, as Keras layers; --hang-at and --slow act
in a layer of the user's (its N-th call in training blocks on the first attempt).
Writes RUN_DIR/params.pt and RUN_DIR/result.json when fit() returns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap
from _common import vm_size

from steadytrain.integrations.keras import SteadytrainCallback

FEATURES, WIDTH, TOKENS = 64, 1024, 128


class UserLayer(keras.layers.Layer):
    """The user's own code inside the step: may block (a stuck lock) or be slow."""

    def __init__(self, hang_at=None, slow=0.0, **kwargs):
        super().__init__(**kwargs)
        self.hang_at, self.slow, self.calls = hang_at, slow, 0

    def call(self, x, training=False):
        if training:
            self.calls += 1
            if self.hang_at == self.calls and os.environ.get("STEADYTRAIN_RESTART", "0") == "0":
                while True:
                    time.sleep(0.5)
            if self.slow:
                time.sleep(self.slow)
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--hang-timeout", type=float, default=300.0)
    parser.add_argument("--slow", type=float, default=0.0)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((TOKENS, FEATURES)),
            UserLayer(args.hang_at, args.slow),
            keras.layers.Dense(WIDTH, activation="gelu"),
            keras.layers.Dense(WIDTH, activation="gelu"),
            keras.layers.Dense(FEATURES),
        ]
    )
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.samples, TOKENS, FEATURES), dtype=np.float32)
    y = rng.standard_normal((args.samples, TOKENS, FEATURES), dtype=np.float32)
    warm = torch.nn.Sequential(torch.nn.Linear(FEATURES, WIDTH), torch.nn.GELU())
    warm(torch.from_numpy(x[:1])).sum().backward()  # warm up before any limit (conftest)
    if args.limit_mib:
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    model.fit(
        x,
        y,
        batch_size=args.batch,
        epochs=args.epochs,
        shuffle=True,
        verbose=0,
        callbacks=[SteadytrainCallback(args.run_dir, hang_timeout=args.hang_timeout)],  # the line
    )
    out = Path(args.run_dir)
    weights = {f"w{i}": torch.from_numpy(np.array(w)) for i, w in enumerate(model.get_weights())}
    torch.save(weights, out / "params.pt")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = max(json.loads(line)["step"] for line in lines)
    (out / "result.json").write_text(json.dumps({"global_step": steps}))


if __name__ == "__main__":
    main()
