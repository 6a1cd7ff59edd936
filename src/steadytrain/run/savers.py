"""The memory savers, registered in one place: one `Saver` per saver, in the order of the ladder
that turns them on one at a time when a single sample does not fit (inside one process, an
out-of-memory caught at micro-batch 1; across restarts, the supervisor's escalation after the OS
killed a run at micro-batch 1).

Everything that names a saver reads it from `SAVERS`:

* the ladder in the trainer (`memory.savers.MemorySavers.next_rung`, `in_force`, `left`) climbs
  them in this order, each switched by the implementation its `switch` names;
* the supervisor names them in its lines (`supervisor.words.saver_name`) and asks for "one more"
  by count (STEADYTRAIN_MEMORY_SAVERS), so its ladder is this one;
* the estimate's `memory.settings.Settings` and the plan's `memory.choice.Mode` have one bool
  field per saver, its `estimate_field`, made from this table (the estimate prices a saver
  through that field; a plan's candidate runs with the savers its mode has on);
* the advisor (`memory.advice`) offers each one the run has not on yet, as the estimate's flag
  or the fine-tune config's key, priced by the estimate through its `estimate_field`;
* the docs' table of savers (docs/plan.md, "The memory savers") is `markdown_table()`, which
  tests/test_run_savers.py pins.

Standard library only: the supervisor, which imports nothing of training, reads it too. The
savers' implementations (what switches them on a model and a loss) stay in `steadytrain.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DISCRETE_MEMORY = "a GPU with memory of its own (CUDA)"
"""A need: host memory is another memory than the device's, so moving a tensor there frees
some (on MPS and CPU it is the same memory)."""


@dataclass(frozen=True)
class Saver:
    """One memory saver, as every part of steadytrain that names it knows it."""

    name: str
    """The `saver` of its `memory_saver` event, and its name in a `memory_savers` record."""
    words: str
    """How a message names it ("activation checkpointing")."""
    config: str
    """How a TrainConfig (or the Trainer's loss) asks for it from the start."""
    finetune: tuple[tuple[str, Any], ...]
    """(fine-tune config key, value) pairs that turn it on, for the advisor's config advice."""
    flag: str
    """`steadytrain estimate`'s flag that prices it."""
    estimate_field: str
    """The bool field (True: on) that this entry adds to the estimate's `memory.settings.Settings`
    and to the plan's `memory.choice.Mode`: the estimate prices the saver through it, and a
    plan's candidate runs with it on or off. Where `flag` is the field's own (`--chunked-loss`
    for `chunked_loss`), it is an option of `steadytrain estimate`; otherwise another option sets
    it (`--activation-checkpointing on` sets `checkpointing`)."""
    estimate_help: str
    """That field's help: the `steadytrain estimate --help` line of its own option."""
    prices: str
    """What the estimate counts with it on, in a few words (the docs' table)."""
    needs: tuple[str, ...]
    """What the run must have for the ladder to turn it on; `DISCRETE_MEMORY` is also the
    advisor's and the planner's test (CUDA only)."""
    switch: str
    """"module:name" of its implementation in `steadytrain.memory`: a `memory.savers.Rung`
    (whether it is on, whether it can be, how to turn it on)."""
    after: str | None = None
    """A saver that must be on before this one is (offload is a way of checkpointing)."""
    worth_above_tokens: bool = False
    """The advisor offers it only where a micro-batch holds more tokens than one chunk."""
    piece: str = "chunk_tokens"
    """With `worth_above_tokens`: the estimate's field that holds the tokens of one chunk (the
    chunked loss's `chunk_tokens`, the tiled MLP's `tile_tokens`)."""


SAVERS: tuple[Saver, ...] = (
    Saver(
        name="activation_checkpointing",
        words="activation checkpointing",
        config="activation_checkpointing: true",
        finetune=(("gradient_checkpointing", True),),
        flag="--checkpointing",
        estimate_field="checkpointing",
        estimate_help="Activation checkpointing of every decoder layer.",
        prices="the layer inputs instead of every layer's activations; one layer recomputed "
        "at a time in the backward",
        needs=("a model with its own checkpointing switch (Hugging Face models)",),
        switch="steadytrain.memory.savers:CHECKPOINTING_RUNG",
    ),
    Saver(
        name="activation_offload",
        words="activation checkpointing with its inputs offloaded to host memory",
        config="activation_checkpointing: offload",
        finetune=(("gradient_checkpointing", "offload"),),
        flag="--offload",
        estimate_field="offload",
        estimate_help="Activation checkpointing with each layer's kept input in pinned host memory.",
        prices="the checkpointed layer inputs in pinned host memory, all but two",
        needs=(
            DISCRETE_MEMORY,
            "layers that take a checkpoint function (a Hugging Face gradient_checkpointing flag)",
        ),
        switch="steadytrain.memory.savers:OFFLOAD_RUNG",
        after="activation_checkpointing",
    ),
    Saver(
        name="chunked_loss",
        words="the chunked loss",
        config="loss_fn=CausalLMLoss(chunk_tokens=1024) (a fine-tune's chunked_loss: true)",
        finetune=(("chunked_loss", True),),
        flag="--chunked-loss",
        estimate_field="chunked_loss",
        estimate_help="The loss a chunk of tokens at a time (large vocabularies).",
        prices="one chunk's logits (the fused kernel's: a few hundred tokens') instead of "
        "every token's",
        needs=("a loss with a chunked mode (memory.chunked_loss.CausalLMLoss)",),
        switch="steadytrain.memory.savers:CHUNKED_LOSS_RUNG",
        worth_above_tokens=True,
    ),
    Saver(
        name="tiled_mlp",
        words="the tiled MLP",
        config="tiled_mlp: true",
        finetune=(("tiled_mlp", True),),
        flag="--tiled-mlp",
        estimate_field="tiled_mlp",
        estimate_help="Each decoder layer's MLP over 8,192 tokens at a time, each piece "
        "checkpointed (long sequences).",
        prices="one piece's MLP activations (8,192 tokens') in the recomputed layer instead of "
        "every token's, and the MLP's input kept",
        needs=("decoder layers whose MLP is token-wise (gate, up and down projections)",),
        switch="steadytrain.memory.savers:TILED_MLP_RUNG",
        worth_above_tokens=True,
        piece="tile_tokens",
    ),
)
"""The savers, in the ladder's order."""


def by_name(name: str) -> Saver | None:
    """The registered saver of that name; None where there is none (a record written by
    another version)."""
    return next((saver for saver in SAVERS if saver.name == name), None)


def saver_words(name: str) -> str:
    """How a message names saver `name` (the name itself where it is not registered)."""
    saver = by_name(name)
    return saver.words if saver is not None else name


def markdown_table() -> str:
    """The docs' table of the savers (docs/plan.md), one row per saver in the ladder's order."""
    rows = [
        "| rung | saver (`memory_saver` event) | turn it on from the start | estimate | what the "
        "estimate counts | needs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for rung, saver in enumerate(SAVERS, 1):
        needs = list(saver.needs)
        if saver.after is not None:
            needs.append(f"{saver_words(saver.after)} on")
        rows.append(
            f"| {rung} | `{saver.name}`: {saver.words} | `{saver.config}` | `{saver.flag}` | "
            f"{saver.prices} | {'; '.join(needs)} |"
        )
    return "\n".join(rows)


__all__ = ["DISCRETE_MEMORY", "SAVERS", "Saver", "by_name", "markdown_table", "saver_words"]
