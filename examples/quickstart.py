"""Quickstart: a run that would die of out-of-memory finishes anyway.

Trains a small byte-level transformer language model on the docstrings of Python's own standard
library (no download). On Linux the process's address space is capped a little above its size
after a warm-up step, so starting at the whole effective batch of 64 runs out of memory for real;
steadytrain halves the micro-batch and redoes the same optimizer step until it fits, and the
optimizer still sees 64 samples per step. Elsewhere (or with --no-cap) it runs without the cap,
on the best device (cuda, mps, cpu).

    python examples/quickstart.py [RUN_DIR] [--no-cap]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys

import torch

from steadytrain import TrainConfig, Trainer, entrypoint
from steadytrain.recipes.demo import stdlib_docstrings

SEQ = 256


def stdlib_text() -> bytes:
    """The docstrings of standard-library modules and their public members (the demo's text)."""
    return "\n\n".join(stdlib_docstrings()).encode("utf-8", "replace")


class ByteLM(torch.nn.Module):
    def __init__(self, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, dim))
        layer = torch.nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        x = self.embed(ids) + self.pos[:n]
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def loss_fn(model: torch.nn.Module, batch: torch.Tensor):
    """Next-byte cross-entropy, summed over tokens, with the token count: exact accumulation."""
    logits = model(batch[:, :-1])
    targets = batch[:, 1:]
    loss_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="sum"
    )
    return loss_sum, targets.numel()


# Under an address-space cap, glibc's malloc must hand freed memory back to the OS for the cap to
# measure live memory (large blocks by mmap, a single arena); these only apply at process start.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}


def cap_address_space(extra_mib: int) -> None:
    with open("/proc/self/status") as status:
        vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    limit = vm + extra_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(
        f"capped this process's address space at {limit / 2**30:.2f} GiB "
        f"({extra_mib} MiB above its size)"
    )


@entrypoint
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="runs/quickstart")
    parser.add_argument("--no-cap", action="store_true", help="do not cap memory")
    parser.add_argument("--cap-mib", type=int, default=160)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    capped = platform.system() == "Linux" and not args.no_cap
    if capped and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})

    data = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
    windows = list(data[: len(data) // (SEQ + 1) * (SEQ + 1)].view(-1, SEQ + 1))
    print(f"{len(data) / 1e6:.1f} MB of standard-library docstrings, {len(windows)} windows")
    torch.manual_seed(0)
    model = ByteLM()
    loss_fn(model, windows[0][None])[0].backward()  # warm up thread pools before any cap
    model.zero_grad(set_to_none=True)
    if capped:
        cap_address_space(args.cap_mib)
    config = TrainConfig(
        run_dir=args.run_dir,
        effective_batch_size=64,
        # Start at the whole batch so the out-of-memory path shows; "auto" (the default) would
        # plan a size that fits before the first step instead (steadytrain plan, docs/plan.md).
        micro_batch_size=64,
        max_steps=args.steps,
        save_every_steps=args.steps,
        device="cpu" if capped else "auto",  # the cap is on host memory
        log_every_steps=5,
    )
    result = Trainer(model, lambda p: torch.optim.AdamW(p, lr=3e-3), loss_fn, windows, config).fit()
    print(
        f"\n{result.steps} optimizer steps of 64 samples, final loss {result.final_loss:.3f}, "
        f"micro-batch {result.micro_batch_size}, {result.oom_count} out-of-memory event(s) "
        f"survived. Metrics and events: {result.run_dir}/metrics.jsonl, events.jsonl"
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
