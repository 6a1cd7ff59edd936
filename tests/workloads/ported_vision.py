"""A vision training loop written as the PyTorch docs and timm write one, ported from them: a
conv net with BatchNorm and Dropout, AdamW with weight decay off for norms and biases (two param
groups), OneCycleLR stepped per batch, clipping at 1.0, an EMA of the weights (docs/porting.md),
and its own evaluation every 5 steps in a callback that forgets model.train(). Writes
RUN_DIR/final.pt (weights and EMA). argv: RUN_DIR [KILL_AT MARKER]: SIGKILLs itself after step
KILL_AT once (the file MARKER remembers it); saves are written in the step (async_save off),
so the kill after step 11 always finds step 8's."""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

import steadytrain
from steadytrain import Callback, TrainConfig, Trainer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.dropout, self.fc = nn.Dropout(0.25), nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(self.dropout(F.adaptive_avg_pool2d(x, 1).flatten(1)))


def param_groups(model, weight_decay):
    """timm's param_groups_weight_decay: no decay for norms and biases."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
    ]


class Ema(Callback):
    """docs/porting.md: the EMA updated after each step, in user_state with its two methods."""

    def __init__(self, model):
        self.model = model
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def on_step_end(self, state, control, info):
        self.averaged.update_parameters(self.model)

    def state_dict(self):
        return self.averaged.state_dict()

    def load_state_dict(self, saved):
        self.averaged.load_state_dict(saved)


class Evaluate(Callback):
    """The program's own evaluation every 5 steps; it forgets model.train() after it."""

    def __init__(self, model, images, labels):
        self.model, self.images, self.labels = model, images, labels

    def on_step_end(self, state, control, info):
        if state.step % 5 == 0:
            self.model.eval()
            with torch.no_grad():
                correct = (self.model(self.images).argmax(1) == self.labels).sum().item()
            print(f"step {state.step}: {correct}/{len(self.labels)} correct", flush=True)


class KillOnce(Callback):
    def __init__(self, step, marker):
        self.step, self.marker = step, Path(marker)

    def on_step_end(self, state, control, info):
        if state.step == self.step and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


@steadytrain.entrypoint
def main(run_dir, kill_at=None, marker=None):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(96, 1, 8, 8, generator=g), torch.randint(0, 10, (96,), generator=g)
    loader = DataLoader(TensorDataset(images, labels), batch_size=16, shuffle=True)
    model = Net()
    ema = Ema(model)
    epochs = 3
    optimizer = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.01, steps_per_epoch=len(loader), epochs=epochs
    )
    config = TrainConfig(
        run_dir=run_dir, effective_batch_size=16, micro_batch_size=16, epochs=epochs,
        max_grad_norm=1.0, seed=None, save_every_steps=4, device="cpu", progress="off",
        memory_watch=False, async_save=False,
    )  # fmt: skip
    callbacks = [Evaluate(model, images[:32], labels[:32])]
    callbacks += [KillOnce(int(kill_at), marker)] if kill_at else []
    loss_fn = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
    Trainer(
        model, optimizer, loss_fn, loader, config,
        scheduler=scheduler, user_state={"ema": ema}, callbacks=callbacks,
    ).fit()  # fmt: skip
    final = {"model": model.state_dict(), "ema": ema.averaged.state_dict()}
    torch.save(final, Path(run_dir) / "final.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
