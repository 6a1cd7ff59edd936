"""Progress on stderr: a live bar on an interactive terminal, plain lines elsewhere, or nothing.

Reading a step's loss makes the host wait for the device (steadytrain.events.StepMetrics). The run
files read step k when step k+1 ends; the console reads the same step at the same moment (or a
step some other callback already read, such as a checkpoint step), so it never adds a wait. The
bar's fields change at every step end, but rich redraws it on its own timer, a few times a
second, and the fields are handed over at most that often.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.text import Text

from steadytrain._terminal import Surviving
from steadytrain._units import format_bytes
from steadytrain.events import Callback, Control, StepMetrics, TrainState, oom_step
from steadytrain.run.hangs import print_aside, wait_for_aside
from steadytrain.run.records import Metric, Record

ASIDE_WAIT_S = 1.0
"""The most the run's last line waits for lines other threads are printing (a blocked stderr
must not hold the end of the run)."""

BAR_REFRESH_PER_SECOND = 4
LOSS_SMOOTHING = 0.9  # EMA weight of the past: about the last ten steps' losses
GIB = 1024**3


def console_callback(cfg, console: Console | None = None, errors_only: bool = False) -> ConsoleLog:
    """The progress display the config asks for (``progress``: auto, bar, lines or off).
    `errors_only`: a rank other than 0 under torchrun, whose lines would repeat rank 0's."""
    console = console or Console(file=Surviving(sys.stderr), highlight=False, soft_wrap=True)
    if errors_only:
        return ErrorsOnly(cfg.log_every_steps, console)
    mode = cfg.progress
    if mode == "auto":
        mode = "bar" if console.is_interactive else "lines"
    if mode == "bar":
        return ProgressBar(cfg.log_every_steps, console)
    return ConsoleLog(cfg.log_every_steps, console, steps=mode == "lines")


class ConsoleLog(Callback):
    """Plain lines: one every `every` steps (and the last), each OOM, shrink and memory saver,
    and the events recorded outside the loop. `steps=False` (``progress: off``) keeps all but
    the per-step lines."""

    def __init__(self, every: int = 10, console: Console | None = None, steps: bool = True):
        self.every, self.steps = every, steps
        self.console = console or Console(
            file=Surviving(sys.stderr), highlight=False, soft_wrap=True
        )
        self._start = time.perf_counter()
        self._pending: tuple[int, int, int, StepMetrics] | None = None
        self._loop_thread = threading.current_thread()

    # -- what every mode prints ------------------------------------------------------------

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self._start = time.perf_counter()
        self._loop_thread = threading.current_thread()
        for reason in info.get("device_skipped", ()):
            self.console.print(f"[yellow]device auto skipped[/] {reason}")
        self.console.print(
            f"steadytrain: {state.max_steps} steps of {state.effective_batch_size} samples on "
            f"{info.get('device')} ({info.get('precision')}), micro-batch "
            f"{state.micro_batch_size}, budget {format_bytes(info.get('budget'))}"
            + (f", resuming at step {state.step}" if state.step else "")
        )

    def on_oom(self, state: TrainState, control: Control, info: dict) -> None:
        self._print_pending()
        self.console.print(
            f"[yellow]out of memory[/] in {info['phase']} at micro-batch "
            f"{info['micro_batch_size']} (step {oom_step(state, info)})"
        )

    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None:
        self._print_pending()
        self.console.print(
            f"[yellow]micro-batch {info['old']} → {info['new']}[/] "
            f"({info['reason']}); effective batch stays {state.effective_batch_size}"
        )

    def on_memory_saver(self, state: TrainState, control: Control, info: dict) -> None:
        self._print_pending()
        self.console.print(f"[yellow]{info['saver'].replace('_', ' ')} on[/] ({info['reason']})")

    def on_eval_end(self, state: TrainState, control: Control, info: dict) -> None:
        self._print_pending()
        values = ", ".join(f"{k} {v:.5g}" for k, v in info["metrics"].items())
        self.console.print(f"evaluation at step {state.step} (epoch {info['epoch']}): {values}")

    def note(self, name: str, info: dict) -> None:
        """An event recorded outside the loop's dispatch (checkpoint, resume, hang, leak, ...).

        From another thread (the hang watchdog) the line is printed by a daemon thread of its
        own: the loop's thread may be stuck holding the console (a blocked stderr), and the
        watchdog must not wait for it. A signal is left out: its handler has said what it does."""
        if name == Record.SIGNAL:
            return
        line = describe_note(name, info)
        if threading.current_thread() is self._loop_thread:
            self.console.print(line, markup=False)
        else:
            print_aside(functools.partial(self.console.print, line, markup=False))

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        self._print_pending(only_resolved=True)
        wait_for_aside(ASIDE_WAIT_S)  # a background save's line (its thread's) comes first
        took = time.perf_counter() - self._start
        self.console.print(
            f"{_ended(info, state.step)} in {took:.1f}s; final micro-batch "
            f"{state.micro_batch_size}, {state.oom_count} out-of-memory event(s)"
            + (
                f", {state.skipped_steps} step(s) skipped by fp16 (inf/NaN gradients)"
                if state.skipped_steps
                else ""
            ),
            markup=False,
        )

    # -- the lines -------------------------------------------------------------------------

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        self._print_pending()
        if not self.steps or (state.step % self.every and state.step != state.max_steps):
            return
        self._pending = (state.step, state.max_steps, state.epoch, info["metrics"])
        if info["metrics"].resolved:  # read already (a checkpoint step): no wait to save
            self._print_pending()

    def _print_pending(self, only_resolved: bool = False) -> None:
        """Print the held line: called from the next step's end, where the run files resolve
        that step anyway, or from an OOM, where waiting costs nothing. At the end of a run that
        failed, a line whose step never resolved is dropped rather than read from the device."""
        if self._pending is None:
            return
        step, max_steps, epoch, metrics = self._pending
        self._pending = None
        if only_resolved and not metrics.resolved:
            return
        self.console.print(step_line(step, max_steps, epoch, metrics.resolve()), markup=False)


class ErrorsOnly(ConsoleLog):
    """The console of a rank other than 0 under torchrun: rank 0 prints the progress (the ranks
    train in lockstep on the same global batch, so their lines would be the same), this rank
    prints only what is its own: a hang it detected. Its exceptions reach stderr as usual."""

    SHOWN = (Record.HANG,)

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        self._loop_thread = threading.current_thread()

    def on_oom(self, state: TrainState, control: Control, info: dict) -> None:
        pass  # rank 0 prints every rank's out-of-memory (the ranks agree on it)

    def on_shrink(self, state: TrainState, control: Control, info: dict) -> None:
        pass

    def on_memory_saver(self, state: TrainState, control: Control, info: dict) -> None:
        pass

    def on_eval_end(self, state: TrainState, control: Control, info: dict) -> None:
        pass

    def note(self, name: str, info: dict) -> None:
        if name in self.SHOWN:
            super().note(name, info)

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        pass

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        pass


class ProgressBar(ConsoleLog):
    """A live rich bar on stderr: step and epoch, smoothed loss, throughput, micro size ×
    accumulation, ETA, and below it memory against the budget and the step-time split."""

    def __init__(self, every: int = 10, console: Console | None = None):
        super().__init__(every, console, steps=False)
        self.progress = _Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[stats]}"),
            console=self.console,
            transient=False,
            auto_refresh=True,
            refresh_per_second=BAR_REFRESH_PER_SECOND,
        )
        self.task = None
        self._current: StepMetrics | None = None
        self._previous: StepMetrics | None = None
        self._loss: float | None = None
        self._peak = 0
        self._split = ""
        self._rate = "… samples/s"
        self._samples = self._tokens = 0
        self._window_start = self._last_update = time.perf_counter()
        self._first_step = 0

    def on_fit_start(self, state: TrainState, control: Control, info: dict) -> None:
        super().on_fit_start(state, control, info)
        self._first_step = state.step
        self._window_start = self._last_update = time.perf_counter()
        self.task = self.progress.add_task(
            f"step {state.step}/{state.max_steps}  epoch {state.epoch}",
            total=state.max_steps,
            completed=state.step,
            stats="",
        )
        self.progress.start()

    def on_step_end(self, state: TrainState, control: Control, info: dict) -> None:
        metrics = self._current = info["metrics"]
        mem = metrics.get(Metric.MEMORY) or {}  # host readings: no wait
        self._peak = max(self._peak, mem.get("peak") or 0, _used(mem) or 0)
        if self._previous is not None:  # the run files resolve it in this same dispatch
            self._take(self._previous.resolve())
        self._previous = None
        if metrics.resolved:
            self._take(metrics)
        else:
            self._previous = metrics
        now = time.perf_counter()
        if now - self._last_update >= 1 / BAR_REFRESH_PER_SECOND or state.step == state.max_steps:
            self._show(state, metrics, now)

    def _take(self, m: StepMetrics) -> None:
        """Fold in one resolved step: the loss average, the counts for the rates, the split."""
        loss = m[Metric.LOSS]
        self._loss = (
            loss
            if self._loss is None
            else (LOSS_SMOOTHING * self._loss + (1 - LOSS_SMOOTHING) * loss)
        )
        self._samples += m[Metric.SAMPLES]
        self._tokens += m[Metric.TOKENS]
        if Metric.DEVICE_COMPUTE_TIME in m:  # a timed step: the device's clock
            self._split = step_split(m)

    def _show(self, state: TrainState, metrics: StepMetrics, now: float) -> None:
        elapsed = now - self._window_start
        done = state.step - self._first_step
        window = max(now - self._last_update, 1e-9)
        if self._tokens:
            self._rate = f"{self._tokens / window:,.0f} tokens/s"
        elif self._samples:
            self._rate = f"{self._samples / window:.1f} samples/s"
        self._samples = self._tokens = 0
        self._last_update = now
        eta = (state.max_steps - state.step) * elapsed / done if done else None
        loss = f"loss {self._loss:.4f}" if self._loss is not None else "loss …"
        self.progress.update(
            self.task,
            completed=state.step,
            description=f"step {state.step}/{state.max_steps}  epoch {metrics[Metric.EPOCH]}",
            stats=(
                f"{loss}  {self._rate}  micro {metrics[Metric.MICRO_BATCH_SIZE]}×"
                f"{metrics[Metric.MICRO_STEPS]}  ETA {_clock(eta)}"
            ),
        )
        self.progress.below = "  ".join(p for p in (self._memory(metrics), self._split) if p)

    def _memory(self, metrics: StepMetrics) -> str:
        mem = metrics.get(Metric.MEMORY) or {}
        used = _used(mem)
        if used is None:
            return ""
        budget = mem.get("budget")
        share = f"{100 * used / budget:.0f} % of budget, " if budget else ""
        return f"mem {_gib(used)} ({share}peak {_gib(self._peak)})"

    def on_fit_end(self, state: TrainState, control: Control, info: dict) -> None:
        if self._previous is not None and self._previous.resolved:
            self._take(self._previous)
        self._previous = None
        if self._current is not None:
            self._show(state, self._current, time.perf_counter())
        self.progress.stop()
        super().on_fit_end(state, control, info)


class _Progress(Progress):
    """rich's Progress with one more line under the bar (memory and the step-time split)."""

    below = ""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if self.below:
            yield Text(self.below)


def _ended(info: dict, step: int) -> str:
    """How the run ended, for its last line. An error names the step it happened in (the one
    after the last finished step, or that step's own saving) and its kind; its message is the
    error's own, printed whole once, after this line (`error: ...`, or the traceback)."""
    if "error" not in info:
        return f"{info['reason']} at step {step}"
    kind, at = info["error"], info.get("error_step")
    where = f"at step {at}" if at else "before the first step"
    if at:  # the steps before it; a later one may have run already (a loss read while it ran)
        step = min(step, at - 1)
    done = f"{step} step(s) done" if step else "no step done"
    if kind == "KeyboardInterrupt":
        return f"stopped {where} by Ctrl-C (KeyboardInterrupt, exit 130; {done})"
    return f"stopped {where} by {kind} (exit {info['exit_code']}; {done}; the error follows)"


def step_line(step: int, max_steps: int, epoch: int, m: StepMetrics) -> str:
    """One progress line, as the README shows it, with the step-time split at the end."""
    mem = m.get(Metric.MEMORY) or {}
    used = mem.get("peak") or mem.get("allocated") or mem.get("rss")
    rate = m[Metric.SAMPLES] / m[Metric.STEP_TIME] if m[Metric.STEP_TIME] else 0.0
    return (
        f"step {step}/{max_steps}  epoch {epoch}  loss {m[Metric.LOSS]:.4f}  "
        f"micro {m[Metric.MICRO_BATCH_SIZE]}×{m[Metric.MICRO_STEPS]}  {rate:.1f} samples/s  "
        f"mem {format_bytes(used)}  {step_split(m)}"
    )


def step_split(m: dict[str, Any]) -> str:
    """'data 0.4ms fwd+bwd 31.2ms opt 2.1ms ckpt 0.41s': the device-clock phase times where the
    step was timed (see steadytrain.engine.step._PhaseMarks), the host's otherwise."""
    compute = m.get(Metric.DEVICE_COMPUTE_TIME, m.get(Metric.COMPUTE_TIME))
    optimizer = m.get(Metric.DEVICE_OPTIMIZER_TIME, m.get(Metric.OPTIMIZER_TIME))
    parts = [
        f"data {_ms(m.get(Metric.DATA_TIME))}",
        f"fwd+bwd {_ms(compute)}",
        f"opt {_ms(optimizer)}",
    ]
    if m.get(Metric.CHECKPOINT_TIME) is not None:
        parts.append(f"ckpt {_ms(m[Metric.CHECKPOINT_TIME])}")
    return " ".join(parts)


def describe_note(name: str, info: dict) -> str:
    """One line for an event recorded outside the loop."""
    if name == Record.CHECKPOINT:
        return (
            f"checkpoint at step {info.get('step')} ({info.get('mode')}, loop held "
            f"{_ms(info.get('stall_s'))})"
        )
    if name == Record.RESUME:
        return (
            f"resumed from {info.get('checkpoint')} at step {info.get('step')}, micro-batch "
            f"{info.get('micro_batch_size')}"
        )
    if name == Record.PLAN:
        line = (
            f"plan: {plan_batches(info)}, activation checkpointing "
            f"{_checkpointing(info.get('activation_checkpointing'))}"
            + (", chunked loss" if info.get("chunked_loss") else "")
            + (", tiled MLP" if info.get("tiled_mlp") else "")
            + (", the shards in host memory (fsdp_offload)" if info.get("fsdp_offload") else "")
            + f", predicted peak {format_bytes(info.get('predicted_peak'))} of "
            f"{format_bytes(info.get('limit'))} allowed"
        )
        return "\n".join([line, *(f"  - {reason}" for reason in info.get("reasons") or [])])
    if name == Record.ESTIMATE:
        return (
            f"estimate ({info.get('source')}): peak {format_bytes(info.get('peak'))}, total "
            f"{format_bytes(info.get('total'))} at micro-batch {info.get('micro_batch_size')}"
        )
    if isinstance(info.get("message"), str):  # the watcher wrote its own sentence
        return f"{name.replace('_', ' ')}: {info['message']}"
    fields = ", ".join(  # a field with no value, or a record of its own (memory), says nothing
        f"{k} {_short(v)}"
        for k, v in info.items()
        if k not in ("time", "event") and v is not None and not isinstance(v, dict)
    )
    return f"{name.replace('_', ' ')}: {fields}" if fields else name.replace("_", " ")


def plan_batches(plan: dict) -> str:
    """A plan's micro-batch and accumulation: "micro-batch 2 × 8 (effective batch 16)" on one
    process; under torchrun what each rank runs and what the group adds up to, "micro-batch 2
    per rank × 4 steps × 2 ranks (effective batch 16)" (a record without `world_size` is one
    process's). `steadytrain plan --gpus N` titles its table with the same words."""
    micro, effective = plan.get("micro_batch_size"), plan.get("effective_batch_size")
    ranks = plan.get("world_size") or 1
    if ranks == 1:
        return f"micro-batch {micro} × {plan.get('accumulation')} (effective batch {effective})"
    steps = plan.get("rank_micro_steps")
    uneven = "" if effective % ranks == 0 else f", shares of up to {plan.get('rank_batch')}"
    return (
        f"micro-batch {micro} per rank × {steps} step{'s' if steps != 1 else ''} × {ranks} ranks "
        f"(effective batch {effective}{uneven})"
    )


def _checkpointing(value: Any) -> str:
    """A plan's `activation_checkpointing` (false, true, "offload") in words."""
    return "on, inputs offloaded to host memory" if value == "offload" else "on" if value else "off"


def _used(mem: dict) -> int | None:
    """Memory in use: the device allocator's count (CUDA, MPS), else the process's resident size."""
    return mem.get("allocated") if mem.get("allocated") is not None else mem.get("rss")


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return "{…}"
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1000:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n < 10 * GIB else f"{n / GIB:.1f} GiB"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    seconds = int(seconds + 0.5)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
