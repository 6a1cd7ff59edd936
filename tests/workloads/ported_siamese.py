"""pytorch/examples `siamese_network` ported from docs/porting.md: two images in, whether they
show the same class out (BCE on one logit), Adadelta at lr 1.0 and StepLR(gamma=0.7) once per
epoch (given in steps, as the docs say). Its pairs come from a dataset shaped as none before:
a ConcatDataset of two Subsets of a dataset whose samples are NumPy arrays with a Python float
target, shuffled by the DataLoader. Writes RUN_DIR/final.pt (the weights). argv: RUN_DIR
[KILL_AT MARKER]: SIGKILLs itself after step KILL_AT once (the file MARKER remembers it); saves
are written in the step (async_save off), so a kill after step 7 always finds step 6's."""

import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

import steadytrain
from steadytrain import Callback, TrainConfig, Trainer


class Pairs(Dataset):
    """Item i: two 8x8 images as float32 NumPy arrays and 1.0 when their classes match."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self):
        return 2 * len(self.images)

    def __getitem__(self, i):
        a, b = i % len(self.images), (7 * i + 3) % len(self.images)
        return self.images[a], self.images[b], float(self.labels[a] == self.labels[b])


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16), nn.ReLU()
        )
        self.head = nn.Linear(32, 1)

    def forward(self, a, b):
        return self.head(torch.cat([self.features(a), self.features(b)], 1)).squeeze(1)


def loss_fn(model, batch):
    a, b, target = batch
    return F.binary_cross_entropy_with_logits(model(a.unsqueeze(1), b.unsqueeze(1)), target.float())


class KillOnce(Callback):
    def __init__(self, step, marker):
        self.step, self.marker = step, Path(marker)

    def on_step_end(self, state, control, info):
        if state.step == self.step and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


@steadytrain.entrypoint
def main(run_dir, kill_at=None, marker=None):
    torch.manual_seed(1)
    rng = np.random.default_rng(0)
    images = rng.random((40, 8, 8), dtype=np.float32)
    labels = rng.integers(0, 3, 40)
    pairs = Pairs(images, labels)
    train = ConcatDataset([Subset(pairs, range(0, 30)), Subset(pairs, range(50, 80))])
    loader = DataLoader(train, batch_size=12, shuffle=True)
    model = SiameseNetwork()
    config = TrainConfig(
        run_dir=run_dir, effective_batch_size=12, micro_batch_size=12, epochs=3, seed=None,
        save_every_steps=3, device="cpu", progress="off", memory_watch=False, async_save=False,
    )  # fmt: skip
    callbacks = [KillOnce(int(kill_at), marker)] if kill_at else []
    Trainer(
        model,
        lambda params: torch.optim.Adadelta(params, lr=1.0),
        loss_fn,
        loader,
        config,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, len(loader), gamma=0.7),
        callbacks=callbacks,
    ).fit()
    torch.save(model.state_dict(), Path(run_dir) / "final.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
