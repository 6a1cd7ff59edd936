"""`steadytrain demo`: the whole product in about a minute, offline.

Nothing is downloaded. The demo builds a tiny Llama-style model with random weights and a
byte-level tokenizer, writes training and held-out text from the docstrings of Python's own
standard library, and then does what a user does with a real model, through the same code:

    1 model      build the base (seeded) and save it where `from_pretrained` loads it
    2 data       docstrings -> RUN_DIR/data/train.jsonl and eval.jsonl (every 20th docstring)
    3 before     loss and perplexity of the base on the held-out docstrings (`evaluate`)
    4 fine-tune  `steadytrain run -- steadytrain finetune --config RUN_DIR/finetune.json` as a
                 child process, with micro_batch_size auto: the run plans its micro-batch on
                 this device first (the `plan` event); once a checkpoint is committed and a few
                 more steps are done, the training process is killed with SIGKILL; the
                 supervisor restarts it and it resumes from the checkpoint, its first step
                 proving the state was restored
    5 after      base and base + adapter side by side on the held-out docstrings
    6 sample     text sampled from base + adapter (`generate`)
    7 report     RUN_DIR/report.html (`steadytrain report`)

and writes RUN_DIR/demo_summary.json with the numbers. The fine-tune's output folder is RUN_DIR
itself, so RUN_DIR is an ordinary run directory (config.json, metrics.jsonl, events.jsonl,
checkpoints/, final/) with the demo's inputs beside it (base/, data/, finetune.json).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from steadytrain.errors import BadInputError, DemoFailed
from steadytrain.recipes.options import DemoOptions
from steadytrain.run import files as run_files
from steadytrain.run.durable import make_folder, write_atomic
from steadytrain.run.records import Metric, Record

STEPS = 7
SEQ = 128
"""Tokens per sample: one byte per token, so a docstring chunk of up to 126 bytes plus <bos>
and <eos>."""
EFFECTIVE_BATCH = 16
MIN_STEPS = 10
"""Fewer leave no room for a checkpoint, a kill after it, and steps after the resume."""
SEED = 0
EVAL_EVERY = 20
"""Every 20th docstring is held out for evaluation (5%): the same distribution, unseen text."""
PROMPT = "Return a new "
TEMPERATURE, TOP_P = 0.7, 0.9
"""Sampled, not greedy: greedy decoding of a model this small repeats its likeliest word."""
MARKER = ".steadytrain-demo"
"""Written first into RUN_DIR: --force replaces only a folder that holds it."""

MODEL = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ,
    # 0.2, not Llama's 0.02: the output head stays frozen and random under LoRA, and at 0.02 its
    # logits cannot become confident (measured: loss 5.57 -> 5.22 in 60 steps, near uniform);
    # at 0.2 the adapter has a head it can use.
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
LEAK_THRESHOLD_MIB = 128
"""Not the default 32: this run's resident memory moves by +-20 MiB from step to step, and over
its short epochs (about 90 steps) four readings that happen to rise read as 40 MiB per epoch, a
leak warning about nothing (seen once in a few runs). A real leak still crosses 128."""
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}

MODULES = [
    "argparse",
    "collections",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "email",
    "functools",
    "heapq",
    "inspect",
    "json",
    "logging",
    "pathlib",
    "random",
    "re",
    "shutil",
    "statistics",
    "string",
    "textwrap",
    "threading",
    "unittest",
    "urllib",
]
"""Standard-library modules whose docstrings are the demo's text (and the quickstart's)."""


@dataclass
class Interruption:
    killed_at_step: int | None = None
    checkpoint_step: int | None = None
    pid: int | None = None
    resumed_at_step: int | None = None
    restarts: int = 0
    continuity: dict[str, Any] | None = None


@dataclass
class Demo:
    """One run of the demo; `run()` does the eight steps and returns the summary. Its settings
    are `DemoOptions`' (their defaults there)."""

    run_dir: Path
    device: str
    steps: int
    interrupt: bool
    threads: int | None
    force: bool
    console: Any = None
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from rich.console import Console

        self.run_dir = Path(self.run_dir)
        self.console = self.console or Console(highlight=False)
        self.started = time.monotonic()
        self.step = 0

    # -- the steps -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        check_settings(self.steps, self.threads)
        check_requirements()
        replace = check_run_dir(self.run_dir, self.force)
        import torch

        from steadytrain.device import resolve_device

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        self.dev = resolve_device(self.device)
        if replace:
            shutil.rmtree(self.run_dir)
        try:
            make_folder(self.run_dir, root=self.run_dir)
        except OSError as exc:
            raise BadInputError(
                f"RUN_DIR: cannot create {self.run_dir} ({exc.strerror}); choose a folder you "
                "can write to"
            ) from None
        write_atomic(self.run_dir / MARKER, "written by steadytrain demo\n", root=self.run_dir)
        self.summary = {
            "run_dir": str(self.run_dir),
            "device": str(self.dev.torch_device),
            "steps": self.steps,
        }
        base = self.build_model()
        train, held_out = self.write_data()
        before = self.evaluate_before(base, held_out)
        config = self.write_config(base, train, held_out)
        interruption = self.finetune(config)
        after = self.evaluate_after(held_out)
        self.sample(after)
        report = self.report()
        return self.finish(before, interruption, report)

    def build_model(self) -> Path:
        self._heading("model: a tiny Llama and a byte-level tokenizer, built here")
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from steadytrain.recipes.artifact import quiet_transformers
        from steadytrain.recipes.data import byte_tokenizer

        tokenizer = byte_tokenizer()
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **MODEL,
        )
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
        base = self.run_dir / "base"
        with quiet_transformers():  # its per-save progress bar would interleave with ours
            model.save_pretrained(base)
        tokenizer.save_pretrained(base)
        params = sum(p.numel() for p in model.parameters())
        self._say(
            f"{params:,} parameters: {MODEL['num_hidden_layers']} layers, hidden size "
            f"{MODEL['hidden_size']}, {MODEL['num_attention_heads']} heads, vocabulary "
            f"{len(tokenizer)} (256 bytes + <bos>, <eos>, <pad> and 3 chat roles); random "
            f"weights, seed {SEED}"
        )
        self._say(f"saved to {base} (AutoModelForCausalLM.from_pretrained loads it)")
        self.summary["base"] = str(base)
        self.summary["parameters"] = params
        return base

    def write_data(self) -> tuple[Path, Path]:
        self._heading("data: docstrings of Python's standard library")
        docs = stdlib_docstrings()
        train_docs = [d for i, d in enumerate(docs) if i % EVAL_EVERY != 0]
        eval_docs = [d for i, d in enumerate(docs) if i % EVAL_EVERY == 0]
        folder = self.run_dir / "data"
        paths = []
        for name, part in (("train", train_docs), ("eval", eval_docs)):
            chunks = [c for doc in part for c in chunk_text(doc, SEQ - 2)]
            path = folder / f"{name}.jsonl"
            text = "".join(json.dumps({"text": c}) + "\n" for c in chunks)
            write_atomic(path, text, root=self.run_dir)
            paths.append(path)
            self.summary[f"{name}_records"] = len(chunks)
            self.summary[f"{name}_docstrings"] = len(part)
        total = sum(len(d.encode()) for d in docs)
        self._say(
            f"{len(docs):,} distinct docstrings of {len(MODULES)} modules ({total / 1e3:,.0f} kB), "
            f"cut into records of at most {SEQ - 2} bytes:"
        )
        self._say(
            f"  {paths[0]}: {self.summary['train_records']:,} records from "
            f"{len(train_docs):,} docstrings"
        )
        self._say(
            f"  {paths[1]}: {self.summary['eval_records']:,} records from every "
            f"{_ordinal(EVAL_EVERY)} docstring ({len(eval_docs)}), held out"
        )
        return paths[0], paths[1]

    def evaluate_before(self, base: Path, held_out: Path) -> Any:
        self._heading("before: the base model on the held-out docstrings")
        from steadytrain.recipes.artifact import open_model
        from steadytrain.recipes.evaluate import score

        loaded = open_model(base, None, str(self.dev.torch_device), None, weights=False)
        report = score(loaded, held_out, max_seq_length=SEQ, batch_size=EFFECTIVE_BATCH)
        (result,) = report.results
        self._say(
            f"loss {result.loss:.4f}, perplexity {result.perplexity:,.2f} over "
            f"{result.tokens:,} target tokens (random weights are confidently wrong: above the "
            f"vocabulary's {len(loaded.tokenizer)})"
        )
        self.summary["before"] = {"loss": result.loss, "perplexity": result.perplexity}
        return result

    def write_config(self, base: Path, train: Path, held_out: Path) -> Path:
        save_steps = max(2, self.steps // 3)
        config = {
            # As the user named RUN_DIR: the fine-tune reads relative paths from the directory
            # it runs in, as Hugging Face scripts do, and runs in this one.
            "model_name_or_path": str(base),
            "train_file": str(train),
            "eval_file": str(held_out),
            "output_dir": str(self.run_dir),
            "max_seq_length": SEQ,
            "max_steps": self.steps,
            # The effective batch; micro_batch_size auto lets the run plan how to split it.
            "per_device_train_batch_size": EFFECTIVE_BATCH,
            "gradient_accumulation_steps": 1,
            "micro_batch_size": "auto",
            "learning_rate": 1e-2,
            "lr_scheduler_type": "cosine",
            "warmup_ratio": 0.05,
            "save_steps": save_steps,
            "save_total_limit": 2,
            "logging_steps": max(1, self.steps // 15),
            "seed": SEED,
            "device": str(self.dev.torch_device),
            "leak_threshold_mib": LEAK_THRESHOLD_MIB,
            "lora": {**LORA, "target_modules": "all-linear"},
        }
        path = self.run_dir / "finetune.json"
        write_atomic(path, json.dumps(config, indent=2) + "\n", root=self.run_dir)
        self.summary["config"] = str(path)
        self.summary["save_steps"] = save_steps
        return path

    def finetune(self, config: Path) -> Interruption:
        save_steps = self.summary["save_steps"]
        how = "interrupted with SIGKILL" if self.interrupt else "not interrupted (--no-interrupt)"
        self._heading(f"fine-tune: LoRA under the supervisor, {how}")
        shown = [
            "steadytrain", "run", "--run-dir", str(self.run_dir), "--",
            "steadytrain", "finetune", "--config", str(config),
        ]  # fmt: skip
        self._say(f"$ {shlex.join(shown)}")
        if self.interrupt:
            self._say(
                f"(a checkpoint every {save_steps} steps; the demo kills the training process "
                "once one is committed and a few more steps are done)"
            )
        cli = [sys.executable, "-m", "steadytrain.cli"]
        command = [
            *cli, "run", "--run-dir", str(self.run_dir), "--",
            *cli, "finetune", "--config", str(config),
        ]  # fmt: skip
        supervisor = subprocess.Popen(command, env=self._child_env())
        interruption = Interruption()
        try:
            if self.interrupt:
                kill_at = save_steps + max(1, save_steps // 5)
                self._interrupt(supervisor, kill_at, interruption)
            code = supervisor.wait()
        except KeyboardInterrupt:
            # The terminal sent SIGINT to the supervisor too: it stops the child after a
            # checkpoint. Wait for that, so the prompt comes back to a quiet terminal.
            supervisor.wait()
            self._say(f"stopped; to start the demo again: steadytrain demo {self.run_dir} --force")
            raise
        if code != 0:
            raise DemoFailed(
                f"fine-tune: `steadytrain run -- steadytrain finetune` exited with code {code}; "
                f"see the lines above and {self.run_dir / run_files.EVENTS}",
                code,
            )
        self._read_outcome(interruption)
        return interruption

    def _read_outcome(self, interruption: Interruption) -> None:
        """What the fine-tune's events say: the resume after the kill, the plan, the adapter."""
        from steadytrain.telemetry.files import read_jsonl

        events = read_jsonl(self.run_dir / run_files.EVENTS)
        self._read_resume(events, interruption)
        self._read_plan(events)
        final = self.run_dir / run_files.FINAL
        self.summary["adapter"] = str(final)
        self.summary["interruption"] = {
            "signal": "SIGKILL" if interruption.killed_at_step is not None else None,
            "pid": interruption.pid,
            "killed_at_step": interruption.killed_at_step,
            "checkpoint_step": interruption.checkpoint_step,
            "resumed_at_step": interruption.resumed_at_step,
            "restarts": interruption.restarts,
            "continuity": interruption.continuity,
        }
        if interruption.resumed_at_step is not None:
            self._say(self._resume_line(interruption))
        elif self.interrupt:
            self._say(
                "the fine-tune finished before the demo could interrupt it (a fast device); "
                f"rerun with more steps: --steps {self.steps * 4}"
            )

    def evaluate_after(self, held_out: Path) -> Any:
        self._heading("after: base and base + adapter on the held-out docstrings")
        from steadytrain.recipes.artifact import open_model
        from steadytrain.recipes.evaluate import comparison, score, table

        loaded = open_model(
            self.run_dir / run_files.FINAL,
            str(self.run_dir / "base"),  # as the user named it, not the absolute path recorded
            str(self.dev.torch_device),
            None,
            weights=False,
        )
        report = score(loaded, held_out, max_seq_length=SEQ, batch_size=EFFECTIVE_BATCH)
        self.console.print(table(report))
        self.console.print(comparison(report), markup=False, soft_wrap=True)
        base, adapted = report.results
        self.summary["after"] = {"loss": adapted.loss, "perplexity": adapted.perplexity}
        self.summary["base_rescored"] = {"loss": base.loss, "perplexity": base.perplexity}
        return loaded

    def sample(self, loaded: Any) -> None:
        self._heading("sample: text from base + adapter")
        from steadytrain.recipes.generate import complete

        (result,) = complete(
            loaded.model,
            loaded.tokenizer,
            [PROMPT],
            max_new_tokens=96,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            seed=SEED,
            device=loaded.device.torch_device,
        )
        shown = [
            "steadytrain", "generate", str(self.run_dir / run_files.FINAL), PROMPT,
            "--temperature", str(TEMPERATURE), "--top-p", str(TOP_P),
        ]  # fmt: skip
        self._say(f"$ {shlex.join(shown)}")
        self.console.print(
            f"[bold]{_printable(PROMPT)}[/]{_printable(result.completion)}", soft_wrap=True
        )
        passes = self.steps * EFFECTIVE_BATCH / max(1, self.summary["train_records"])
        self._say(
            f"({result.new_tokens} bytes: a {self.summary['parameters'] / 1e6:.2f}M-parameter "
            f"model with random weights, adapted for {passes:.1f} passes over the docstrings, "
            "has their letters, spaces and short words, not yet sense)"
        )
        self.summary["sample"] = {
            "prompt": PROMPT,
            "completion": result.completion,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "seed": SEED,
        }

    def report(self) -> Path:
        self._heading("report: what happened, from the run directory alone")
        from steadytrain.telemetry.report import write_report

        report = write_report(self.run_dir)
        self._say(f"wrote {report.html} (plots in {report.pngs[0].parent}/)")
        self._say(report.summary)
        self.summary["report"] = str(report.html)
        return report.html

    def finish(self, before: Any, interruption: Interruption, report: Path) -> dict[str, Any]:
        seconds = time.monotonic() - self.started
        after = self.summary["after"]
        self.summary["seconds"] = round(seconds, 1)
        text = json.dumps(self.summary, indent=2) + "\n"
        write_atomic(self.run_dir / "demo_summary.json", text, root=self.run_dir)
        self.console.rule(style="dim")
        killed = (
            f"killed at step {interruption.killed_at_step} and resumed from step "
            f"{interruption.resumed_at_step}, "
            if interruption.resumed_at_step is not None
            else ""
        )
        self._say(
            f"demo finished in {seconds:.0f}s: {self.steps} LoRA steps on "
            f"{self.dev.torch_device}, {killed}held-out perplexity "
            f"{before.perplexity:,.1f} -> {after['perplexity']:,.1f}"
        )
        self._say(
            f"adapter: {self.summary['adapter']}  report: {report}  numbers: "
            f"{self.run_dir / 'demo_summary.json'}"
        )
        return self.summary

    # -- the interruption ----------------------------------------------------------------

    def _interrupt(
        self, supervisor: subprocess.Popen, kill_at: int, interruption: Interruption
    ) -> None:
        """Wait until a checkpoint is committed and metrics.jsonl reaches `kill_at`, then
        SIGKILL the training process (the supervisor's child), as an OS out-of-memory kill or a
        power cut would end it: no signal handler runs, nothing is saved."""
        import psutil

        from steadytrain.supervisor import checkpoint_step

        metrics = self.run_dir / run_files.METRICS
        while supervisor.poll() is None:
            time.sleep(0.02)
            if checkpoint_step(self.run_dir) is None or (last_step(metrics) or 0) < kill_at:
                continue
            try:
                child = psutil.Process(supervisor.pid).children()[0]
            except (psutil.NoSuchProcess, IndexError):
                continue
            # Stopped first, so that the step and the checkpoint read below are the ones the
            # kill ends the process at; then killed with no chance to save.
            child.send_signal(signal.SIGSTOP)
            interruption.pid = child.pid
            interruption.killed_at_step = last_step(metrics)
            interruption.checkpoint_step = checkpoint_step(self.run_dir)
            if sys.stderr.isatty():
                sys.stderr.write("\x1b[?25h\n")  # the stopped progress bar hid the cursor
                sys.stderr.flush()
            self.console.print(
                f"[bold]killed the training process at step {interruption.killed_at_step} "
                f"(SIGKILL, pid {interruption.pid})[/] — the supervisor restarts it; it resumes "
                f"from the checkpoint at step {interruption.checkpoint_step}",
                soft_wrap=True,
            )
            child.send_signal(signal.SIGKILL)
            return

    def _read_plan(self, events: list[dict]) -> None:
        """The plan the fine-tune made before its first step (micro_batch_size auto)."""
        plan = next((e for e in events if e.get("event") == Record.PLAN), None)
        if plan is not None:
            self.summary["plan"] = {
                key: plan.get(key)
                for key in (
                    "micro_batch_size",
                    "accumulation",
                    "effective_batch_size",
                    "activation_checkpointing",
                    "chunked_loss",
                    "predicted_peak",
                    "limit",
                )
            }

    def _read_resume(self, events: list[dict], interruption: Interruption) -> None:
        restarted = False
        for event in events:
            name = event.get("event")
            if name == Record.RESTART:
                restarted = True
                interruption.restarts += 1
            elif name == Record.RESUME and restarted and interruption.resumed_at_step is None:
                interruption.resumed_at_step = event.get("step")
            elif (
                name == Record.CONTINUITY
                and interruption.resumed_at_step is not None
                and interruption.continuity is None
            ):
                interruption.continuity = {
                    k: event.get(k)
                    for k in ("step", "checked", "loss", "expected", "equal", "reason")
                    if k in event
                }

    def _resume_line(self, interruption: Interruption) -> str:
        resumed = interruption.resumed_at_step
        line = f"resumed from the checkpoint at step {resumed}"
        if interruption.killed_at_step is not None and resumed is not None:
            lost = interruption.killed_at_step - resumed
            line += (
                f" ({lost} step(s) done again: a kill costs at most the steps since the last "
                "checkpoint)"
            )
        check = interruption.continuity or {}
        if check.get("checked") is False:
            line += f"; its first step is not compared with the checkpoint: {check.get('reason')}"
        elif check.get("equal"):
            exact = "bit for bit" if self.dev.type == "cpu" else "within 1e-3"
            line += (
                f"; the first step after it, step {check['step']}, has loss "
                f"{check['loss']:.6f}, the loss the checkpoint recorded for it ({exact})"
            )
        return line

    # -- output --------------------------------------------------------------------------

    def _heading(self, title: str) -> None:
        self.step += 1
        self.console.print()
        self.console.rule(f"[bold]{self.step}/{STEPS}[/]  {title}", align="left", style="dim")

    def _say(self, text: str) -> None:
        self.console.print(text, markup=False, soft_wrap=True)

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.threads)
        return env


# -- inputs -------------------------------------------------------------------------------


def check_settings(steps: int, threads: int | None) -> None:
    problems = []
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < MIN_STEPS:
        problems.append(
            f"--steps: must be a whole number of at least {MIN_STEPS} (room for a checkpoint, "
            f"a kill and a resume), found {steps!r}"
        )
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        problems.append(f"--threads: must be a whole number >= 1, found {threads!r}")
    if problems:
        raise BadInputError("; ".join(problems))


def check_requirements() -> None:
    """transformers and peft (the `lora` extra) and matplotlib (the `report` extra)."""
    missing = [
        name
        for name in ("transformers", "peft", "matplotlib")
        if not importlib.util.find_spec(name)
    ]
    if missing:
        raise BadInputError(
            f"the demo needs {', '.join(missing)}, which this Python cannot import; install "
            "them with pip install 'steadytrain[lora,report]'"
        )


def check_run_dir(run_dir: Path, force: bool) -> bool:
    """RUN_DIR must be new or empty: the fine-tune resumes whatever checkpoint it finds there,
    and a finished one would train nothing. --force replaces an earlier demo's folder only.
    Returns whether RUN_DIR is to be replaced."""
    if run_dir.exists() and not run_dir.is_dir():
        raise BadInputError(
            f"RUN_DIR: {run_dir} is a file, not a folder; give a folder path for the demo's "
            "run (the default is runs/demo)"
        )
    if not run_dir.is_dir() or all(run_files.is_os_clutter(p.name) for p in run_dir.iterdir()):
        for ancestor in run_dir.resolve().parents:
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise BadInputError(
                        f"RUN_DIR: {run_dir} lies under {ancestor}, which is a file; give a "
                        "path inside a folder"
                    )
                break
        return False
    if not force:
        raise BadInputError(
            f"RUN_DIR: {run_dir} exists and is not empty; choose another folder, remove it, or "
            "pass --force to replace an earlier demo run there"
        )
    if not (run_dir / MARKER).is_file():
        raise BadInputError(
            f"RUN_DIR: {run_dir} is not a folder the demo wrote (no {MARKER} in it), so --force "
            "will not delete it; choose another folder"
        )
    return True


def stdlib_docstrings() -> list[str]:
    """The distinct docstrings of `MODULES` and their public members, in a fixed order, with
    runs of whitespace folded to one space. Many members share a docstring (inherited from
    `object` or `str`): each text is kept once, so none lands in both train and eval."""
    seen: set[str] = set()
    docs: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        texts = [module.__doc__]
        for attr in dir(module):
            if not attr.startswith("_"):
                texts.append(getattr(getattr(module, attr, None), "__doc__", None))
        for text in texts:
            if not isinstance(text, str):
                continue
            folded = " ".join(text.split())
            if len(folded) >= 40 and folded not in seen:
                seen.add(folded)
                docs.append(folded)
    return docs


def chunk_text(text: str, limit: int) -> list[str]:
    """`text` cut at spaces into pieces of at most `limit` UTF-8 bytes (a longer word is cut
    where it must); pieces shorter than 20 bytes are dropped."""
    pieces: list[str] = []
    current = ""
    for word in text.split(" "):
        while len(word.encode()) > limit:
            head = word.encode()[:limit].decode("utf-8", "ignore")
            pieces += [current, head] if current else [head]
            current, word = "", word[len(head) :]
        joined = f"{current} {word}" if current else word
        if len(joined.encode()) > limit:
            pieces.append(current)
            current = word
        else:
            current = joined
    pieces.append(current)
    return [p for p in pieces if len(p.encode()) >= 20]


def last_step(metrics: Path) -> int | None:
    """The step of the last complete line of metrics.jsonl (None before the first)."""
    try:
        data = metrics.read_bytes()
    except FileNotFoundError:
        return None
    for line in reversed(data.splitlines()):
        try:
            return int(json.loads(line)[Metric.STEP])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _printable(text: str) -> str:
    """Text safe for a terminal and for rich markup: control characters (a weak model can emit
    any byte) shown as '\ufffd', square brackets escaped."""
    from rich.markup import escape

    return escape("".join(c if c.isprintable() or c == "\n" else "\ufffd" for c in text))


def demo_command(**options: Any) -> int:
    """`steadytrain demo`: exit 0 when every step ran and the held-out perplexity fell. The
    options are `DemoOptions`'."""
    summary = Demo(**asdict(DemoOptions(**options))).run()
    if not summary["after"]["perplexity"] < summary["before"]["perplexity"]:
        raise DemoFailed(
            f"the held-out perplexity did not fall ({summary['before']['perplexity']:.2f} -> "
            f"{summary['after']['perplexity']:.2f}); this is a bug, please report it",
            1,
        )
    return 0


__all__ = ["Demo", "chunk_text", "demo_command", "stdlib_docstrings"]
