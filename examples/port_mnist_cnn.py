"""A CNN classifier with BatchNorm and dropout: its own loop, and the same program on steadytrain.

Origin: the MNIST program of pytorch/examples (mnist/main.py; BSD 3-Clause License, Copyright
(c) 2017 PyTorch contributors): two 3×3 convolutions with ReLU, a 2×2 max-pool, dropout 0.25,
a linear layer with ReLU, dropout 0.5, a linear layer to 10 classes and log-softmax; Adadelta at
lr 1.0 with StepLR(gamma 0.7) stepped after each epoch; `train()` over an ordered DataLoader,
`test()` after each epoch summing the NLL loss and counting correct predictions. Written again
here, not copied. Changed: a BatchNorm after each convolution (the original has none), images,
channels and widths as parameters (small by default, so it runs in seconds on a CPU), and the
data made here instead of downloaded.

    python examples/port_mnist_cnn.py [RUN_DIR]     # the port; RUN_DIR defaults to runs/mnist-cnn

`original()` is the program's loop; `port()` the port. With the same seed they give the same
losses and parameters bit for bit on CPU: docs/porting.md shows the two side by side.
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
    image: int = 12
    channels: tuple[int, int] = (8, 16)
    hidden: int = 32
    samples: int = 96
    test_samples: int = 40
    batch_size: int = 16
    test_batch_size: int = 20
    epochs: int = 2
    seed: int = 1


class Net(nn.Module):
    def __init__(self, sizes: Sizes):
        super().__init__()
        c1, c2 = sizes.channels
        self.conv1 = nn.Conv2d(1, c1, 3, 1)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 3, 1)
        self.bn2 = nn.BatchNorm2d(c2)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        pooled = (sizes.image - 4) // 2
        self.fc1 = nn.Linear(c2 * pooled * pooled, sizes.hidden)
        self.fc2 = nn.Linear(sizes.hidden, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def digits(sizes: Sizes, count: int, seed: int) -> TensorDataset:
    """Images whose class shows as a brighter band, plus noise: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=g)
    images = torch.randn(count, 1, sizes.image, sizes.image, generator=g) * 0.5
    rows = (labels * sizes.image) // 10
    images[torch.arange(count), 0, rows, :] += 2.0
    return TensorDataset(images, labels)


def loaders(sizes: Sizes) -> tuple[DataLoader, DataLoader]:
    train = DataLoader(digits(sizes, sizes.samples, 0), batch_size=sizes.batch_size)
    test = DataLoader(digits(sizes, sizes.test_samples, 1), batch_size=sizes.test_batch_size)
    return train, test


# -- the program's own loop --------------------------------------------------------------------


def original(sizes: Sizes = Sizes()) -> tuple[Net, list[float], list[dict]]:
    torch.manual_seed(sizes.seed)
    train_loader, test_loader = loaders(sizes)
    model = Net(sizes)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses, tests = [], []
    for _ in range(sizes.epochs):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        tests.append(test(model, test_loader))
        scheduler.step()
    return model, losses, tests


def test(model, test_loader) -> dict:
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    return {"test_loss": test_loss / len(test_loader.dataset), "correct": float(correct)}


# -- the same program on steadytrain -----------------------------------------------------------


def port(run_dir: str, sizes: Sizes = Sizes(), callbacks=(), **settings):
    from steadytrain import TrainConfig, Trainer

    torch.manual_seed(sizes.seed)
    train_loader, test_loader = loaders(sizes)
    model = Net(sizes)
    steps_per_epoch = len(train_loader)

    def loss_fn(model, batch):
        data, target = batch
        return F.nll_loss(model(data), target)

    def metrics(model, batches):  # test(), over the micro-batches steadytrain hands it
        test_loss, correct = 0.0, 0
        for data, target in batches:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
        return {"test_loss": test_loss / len(test_loader.dataset), "correct": float(correct)}

    config = TrainConfig(
        run_dir=run_dir,
        effective_batch_size=sizes.batch_size,
        epochs=sizes.epochs,
        seed=None,  # the program seeded torch itself; keep its stream (dropout masks)
        eval_metric="test_loss",
        **settings,
    )
    result = Trainer(
        model,
        lambda params: torch.optim.Adadelta(params, lr=1.0),
        loss_fn,
        train_loader,
        config,
        # StepLR stepped once per epoch is StepLR stepped every step with step_size an epoch
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, steps_per_epoch, gamma=0.7),
        eval_data=test_loader,
        eval_fn=metrics,
        callbacks=callbacks,
    ).fit()
    return model, result


if __name__ == "__main__":
    port(sys.argv[1] if len(sys.argv) > 1 else "runs/mnist-cnn", device="cpu")
