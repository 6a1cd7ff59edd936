"""A Lightning fit with steadytrain's callback as its one added line.

    python lightning_fit.py ROOT_DIR [--batch B] [--accum A] [--epochs E] [--samples N] [--limit-mib M]
                            [--hang-at N] [--hang-timeout T] [--slow S] [--term-at N]

Lightning's default checkpointing (a ModelCheckpoint at every epoch end, in ROOT_DIR/checkpoints)
is what the run resumes from. The model and the memory cap are those of hf_trainer.py.
`--term-at N` sends the process SIGTERM from its Nth training step (a stop at a known batch).
Writes ROOT_DIR/params.pt and ROOT_DIR/result.json when fit() returns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import time
from pathlib import Path

import lightning as L
import torch
import torch._dynamo  # building an optimizer imports it: too big to load under a cap
from _common import vm_size

from steadytrain.integrations.lightning import SteadytrainCallback

FEATURES, WIDTH, TOKENS = 64, 1024, 128


class WideMLP(L.LightningModule):
    def __init__(self, hang_at: int | None = None, slow: float = 0.0, term_at: int | None = None):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(WIDTH, FEATURES),
        )
        self.hang_at, self.slow, self.term_at, self.calls = hang_at, slow, term_at, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.hang_at == self.calls and os.environ.get("STEADYTRAIN_RESTART", "0") == "0":
            while True:  # blocked in user code
                time.sleep(0.5)
        if self.slow:
            time.sleep(self.slow)
        if self.term_at == self.calls:
            os.kill(os.getpid(), signal.SIGTERM)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root_dir")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--limit-mib", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--hang-timeout", type=float, default=300.0)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--term-at", type=int)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = WideMLP(args.hang_at, args.slow, args.term_at)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, TOKENS, FEATURES, generator=g)
    y = torch.randn(args.samples, TOKENS, FEATURES, generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=args.batch, shuffle=True
    )
    model.net(x[:1]).sum().backward()  # warm up before any limit (see conftest.MALLOC_ENV)
    model.zero_grad(set_to_none=True)
    if args.limit_mib:
        limit = vm_size() + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    trainer = L.Trainer(
        default_root_dir=args.root_dir,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accum,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SteadytrainCallback(hang_timeout=args.hang_timeout)],  # the one line
    )
    trainer.fit(model, loader)
    out = Path(args.root_dir)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "params.pt")
    (out / "result.json").write_text(json.dumps({"global_step": trainer.global_step}))


if __name__ == "__main__":
    main()
