"""Progress lines on the console: one every `every` steps, and every OOM, shrink and saver."""

from __future__ import annotations

import sys
import time

from rich.console import Console

from steadytrain._units import format_bytes
from steadytrain.events import Callback, Control, TrainState


class ConsoleLog(Callback):
    def __init__(self, every: int = 10, console: Console | None = None):
        self.every = every
        self.console = console or Console(file=sys.stderr, highlight=False, soft_wrap=True)
        self._start = time.perf_counter()

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self._start = time.perf_counter()
        for reason in info.get("device_skipped", ()):
            self.console.print(f"[yellow]device auto skipped[/] {reason}")
        self.console.print(
            f"steadytrain: {state.max_steps} steps of {state.effective_batch_size} samples on "
            f"{info.get('device')} ({info.get('precision')}), micro-batch "
            f"{state.micro_batch_size}, budget {format_bytes(info.get('budget'))}"
            + (f", resuming at step {state.step}" if state.step else "")
        )

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        if state.step % self.every and state.step != state.max_steps:
            return
        m = info["metrics"]
        mem = m.get("memory") or {}
        used = mem.get("peak") or mem.get("allocated") or mem.get("rss")
        rate = m["samples"] / m["step_time"] if m["step_time"] else 0.0
        self.console.print(
            f"step {state.step}/{state.max_steps}  epoch {state.epoch}  loss {m['loss']:.4f}  "
            f"micro {m['micro_batch_size']}×{m['micro_steps']}  {rate:.1f} samples/s  "
            f"mem {format_bytes(used)}"
        )

    def on_oom(self, state: TrainState, control: Control, info: dict) -> None:
        self.console.print(
            f"[yellow]out of memory[/] in {info['phase']} at micro-batch "
            f"{info['micro_batch_size']} (step {state.step + 1})"
        )

    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None:
        self.console.print(
            f"[yellow]micro-batch {info['old']} → {info['new']}[/] "
            f"({info['reason']}); effective batch stays {state.effective_batch_size}"
        )

    def on_memory_saver(self, state: TrainState, control: Control, info: dict) -> None:
        self.console.print(f"[yellow]{info['saver'].replace('_', ' ')} on[/] ({info['reason']})")

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        took = time.perf_counter() - self._start
        self.console.print(
            f"{info['reason']} at step {state.step} in {took:.1f}s; final micro-batch "
            f"{state.micro_batch_size}, {state.oom_count} out-of-memory event(s)"
        )
