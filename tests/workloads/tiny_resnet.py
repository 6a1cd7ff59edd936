"""A small ResNet-like image classifier (convolutions, BatchNorm2d, residual blocks), the shape of
torchvision's resnet18 at a size a test can train on the CPU, built here (no download).

    python tiny_resnet.py RUN_DIR [--limit-mib M] [--image PX] [--batch B] [--steps S] [--micro N]
                          [--held-after-shrink]

The micro-batch starts at the whole batch (or N). With --limit-mib the address space is capped at
(current size + M MiB) after one warm-up forward and backward at one sample, so the larger
micro-batches fail with the CPU's real out-of-memory errors (PyTorch's allocator's, or oneDNN's
"could not create a primitive" when a convolution's kernel is what fails). Writes
RUN_DIR/result.json when the run finishes. --held-after-shrink: `HeldAfterShrink`.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap
from _common import vm_size

from steadytrain import TrainConfig, Trainer, entrypoint

CLASSES = 10


class Block(torch.nn.Module):
    """resnet18's BasicBlock: two 3×3 convolutions with BatchNorm, and the input added back
    (through a 1×1 convolution where the shape changes)."""

    def __init__(self, inp: int, out: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(out)
        self.conv2 = torch.nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(out)
        self.down = None
        if stride != 1 or inp != out:
            self.down = torch.nn.Sequential(
                torch.nn.Conv2d(inp, out, 1, stride, bias=False), torch.nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


def tiny_resnet() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        Block(16, 16, 1),
        Block(16, 32, 2),
        Block(32, 64, 2),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, CLASSES),
    )


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


class HeldAfterShrink:
    """`loss_fn` with the out-of-memory pattern issue 41 measured on torchvision's resnet18 under
    an address-space cap, without the cap's dependence on the machine's load: every micro-batch
    above 1 runs out (oneDNN's error), and so does micro-batch 1 in a process that ran a larger
    one (what that freed stays held), while a fresh process at micro-batch 1 trains."""

    def __init__(self) -> None:
        self.ran_larger = False

    def __call__(self, model, batch):
        x, _ = batch
        self.ran_larger |= len(x) > 1
        if self.ran_larger:
            raise RuntimeError("could not create a primitive")
        return loss_fn(model, batch)


@entrypoint
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--image", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro", type=int, help="the micro-batch to start at (the whole batch)")
    parser.add_argument("--held-after-shrink", action="store_true", help="see HeldAfterShrink")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_resnet()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(args.batch * args.steps, 3, args.image, args.image, generator=g)
    labels = torch.randint(0, CLASSES, (args.batch * args.steps,), generator=g)
    data = list(zip(images, labels, strict=True))
    # Warm up thread pools and allocator arenas before any limit: started under a tight limit
    # they abort the process instead of raising.
    loss_fn(model, (images[:1], labels[:1])).backward()
    model.zero_grad(set_to_none=True)
    if args.limit_mib:
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=args.batch,
        micro_batch_size=args.micro or args.batch,
        max_steps=args.steps,
        save_every_steps=1,
        device="cpu",
        precision="fp32",
    )
    loss = HeldAfterShrink() if args.held_after_shrink else loss_fn
    result = Trainer(model, lambda p: torch.optim.SGD(p, lr=0.05), loss, data, config).fit()
    (Path(args.run_dir) / "result.json").write_text(
        json.dumps({"steps": result.steps, "micro_batch_size": result.micro_batch_size})
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
