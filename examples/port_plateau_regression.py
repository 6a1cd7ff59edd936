"""A program with a validation loop and ReduceLROnPlateau: its own loop, and the same program on
steadytrain.

Origin: the loop of the example in PyTorch's ReduceLROnPlateau documentation
(pytorch/pytorch, torch/optim/lr_scheduler.py; BSD 3-Clause License, Copyright (c) 2016-
Facebook, Inc and its affiliates): ``for epoch in range(...): train(...); val_loss =
validate(...); scheduler.step(val_loss)``, completed as such programs are: a shuffling
DataLoader, Adam, an MLP regressor with dropout, the validation loss as the mean over the
validation samples, and the best model kept. Written here; the data is made here.

    python examples/port_plateau_regression.py [RUN_DIR]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


@dataclass(frozen=True)
class Sizes:
    features: int = 8
    hidden: int = 32
    samples: int = 120
    val_samples: int = 40
    batch_size: int = 16
    epochs: int = 4
    lr: float = 0.05
    seed: int = 0


def regression(sizes: Sizes, count: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, sizes.features, generator=g)
    w = torch.linspace(-1, 1, sizes.features)
    y = (x @ w).sin().unsqueeze(1) + 0.1 * torch.randn(count, 1, generator=g)
    return TensorDataset(x, y)


def build(sizes: Sizes):
    torch.manual_seed(sizes.seed)
    train_loader = DataLoader(
        regression(sizes, sizes.samples, 1), batch_size=sizes.batch_size, shuffle=True
    )
    val_loader = DataLoader(regression(sizes, sizes.val_samples, 2), batch_size=sizes.batch_size)
    model = nn.Sequential(
        nn.Linear(sizes.features, sizes.hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(sizes.hidden, sizes.hidden),
        nn.ReLU(),
        nn.Linear(sizes.hidden, 1),
    )
    return model, train_loader, val_loader


def plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=1)


def validate(model, batches, count: int) -> float:
    total = 0.0
    for x, y in batches:
        total += F.mse_loss(model(x), y, reduction="sum").item()
    return total / count


# -- the program's own loop --------------------------------------------------------------------


def original(sizes: Sizes = Sizes()) -> tuple[nn.Module, list[float], list[float]]:
    model, train_loader, val_loader = build(sizes)
    optimizer = torch.optim.Adam(model.parameters(), lr=sizes.lr)
    scheduler = plateau(optimizer)
    losses, val_losses, best = [], [], None
    for _ in range(sizes.epochs):
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            val_loss = validate(model, val_loader, sizes.val_samples)
        scheduler.step(val_loss)
        val_losses.append(val_loss)
        if best is None or val_loss < best:
            best = val_loss  # the program saves its best model here
    return model, losses, val_losses


# -- the same program on steadytrain -----------------------------------------------------------


def port(run_dir: str, sizes: Sizes = Sizes(), callbacks=(), **settings):
    from steadytrain import TrainConfig, Trainer

    model, train_loader, val_loader = build(sizes)

    def loss_fn(model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    config = TrainConfig(
        run_dir=run_dir,
        effective_batch_size=sizes.batch_size,
        epochs=sizes.epochs,
        seed=None,  # the program seeded torch itself; keep its stream (order, dropout)
        eval_metric="val_loss",
        keep_best=True,
        **settings,
    )
    result = Trainer(
        model,
        lambda params: torch.optim.Adam(params, lr=sizes.lr),
        loss_fn,
        train_loader,
        config,
        scheduler=plateau,
        eval_data=val_loader,
        eval_fn=lambda model, batches: {"val_loss": validate(model, batches, sizes.val_samples)},
        callbacks=callbacks,
    ).fit()
    return model, result


if __name__ == "__main__":
    port(sys.argv[1] if len(sys.argv) > 1 else "runs/plateau-regression", device="cpu")
