"""What a user's own program brings to the `Trainer`, taken as its author meant it: the data
(dataset, collation, order), the state it carries across steps, its evaluation.

A map-style dataset is batched by steadytrain: `shuffle` and `drop_last` of the config (seeded
permutations, exact on resume). A `DataLoader` keeps its own sampler (its order, drawn as its own
iterator draws it), its `drop_last` and its collate_fn; a config that sets `shuffle` or
`drop_last` against it is refused, naming the field. `arithmetic_event` is the one line at the
start of a run that lists every setting that changes the arithmetic (what a checkpoint holds of
the program, a DataLoader's drawn orders and each user_state's state_dict(), is
checkpoint/state.py's). Evaluation is built from the config, `eval_data` and `eval_fn`; the
optimizer and the scheduler from what was given (an object, a factory or a scheduler class), an
optimizer that needs a closure refused. `RunParts` holds the parts of one fit() that the
Trainer's modules share.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate

from steadytrain._units import format_bytes
from steadytrain.checkpoint.run_state import RunState
from steadytrain.config import TrainConfig
from steadytrain.device import Device
from steadytrain.engine import OptimizerBatchSampler, Precision, StepRunner
from steadytrain.engine.accumulation import check_callable
from steadytrain.engine.batching import SampleFirst
from steadytrain.engine.collate import collate
from steadytrain.engine.distributed import Group
from steadytrain.engine.evaluation import EvalFn, Evaluation, takes_metric
from steadytrain.engine.sampler import LoaderOrder
from steadytrain.errors import BadInputError, UserCodeError
from steadytrain.events import Dispatcher, TrainState
from steadytrain.memory.savers import MemorySavers


@dataclass
class DataSource:
    dataset: Any
    collate_fn: Callable
    workers: int
    worker_init_fn: Callable | None
    loader: DataLoader | None = None
    order: LoaderOrder | None = None  # a DataLoader's sampler order, drawn per epoch


def check_model(model: Any) -> Any:
    """`model`; its class given for it (`Trainer(Net, ...)`) is refused, which failed deep in
    the device placement ('torch.device' object has no attribute '_apply')."""
    if isinstance(model, type):
        raise UserCodeError(
            f"model is the class {model.__name__}, not a model: build it first, "
            f"model={model.__name__}(...)",
            where="model",
        )
    return model


def data_source(
    train_data: Any, collate_fn: Callable | None, cfg: TrainConfig | None, field: str = "train_data"
) -> DataSource:
    """The dataset, collation, workers and (for a DataLoader) its order; refuses what cannot be
    trained exactly (an iterable dataset, an empty one, a config against the loader). Without
    `cfg` (evaluation data) the samples are loaded in the training process."""
    if collate_fn is not None:  # a name, 'default', fails at the first batch
        check_callable(collate_fn, ("samples",), "collate_fn")
    loader, worker_init_fn, workers = None, None, cfg.num_workers if cfg is not None else 0
    if isinstance(train_data, DataLoader):
        loader = train_data
        train_data = loader.dataset
        if loader.collate_fn is not default_collate:
            collate_fn = collate_fn or loader.collate_fn
        if cfg is not None:
            workers = max(workers, loader.num_workers)
            worker_init_fn = loader.worker_init_fn
            _check_loader(loader, cfg, field)
    if isinstance(train_data, IterableDataset) or not hasattr(train_data, "__getitem__"):
        raise BadInputError(
            f"{field}: steadytrain needs a map-style dataset (len() and indexing) so that it can "
            "choose, split and resume batches exactly; an iterable dataset cannot be resumed "
            "mid-epoch. Wrap the data in a list or a torch.utils.data.Dataset; for a stream, "
            "a Dataset with a __len__ whose __getitem__(i) makes sample i (seeded by i), and "
            "max_steps for the length of the run: see docs/porting.md, 'Streams'"
        )
    if isinstance(train_data, Mapping) and any(isinstance(k, str) for k in train_data):
        columns = ", ".join(f"{k!r}: {_rows(v)}" for k, v in list(train_data.items())[:4])
        raise BadInputError(
            f"{field}: a mapping of columns ({columns}), whose len() {len(train_data)} counts "
            "its columns, not samples; give a dataset of samples: TensorDataset(x, y), or a "
            "Dataset whose __getitem__(i) returns {name: column[i]} (docs/porting.md, 'Data')"
        )
    try:
        size = len(train_data)
    except TypeError:
        raise BadInputError(f"{field}: has no len(); give a map-style dataset") from None
    if size == 0:
        raise BadInputError(
            f"{field}: the dataset is empty (len() 0), nothing to train or evaluate on; check "
            "what built it (a filter or Subset that kept no sample, a path with no files)"
        )
    order = LoaderOrder(loader) if loader is not None else None
    collate_fn = SampleFirst(collate_fn, field) if collate_fn is not None else collate
    return DataSource(train_data, collate_fn, workers, worker_init_fn, loader, order)


def _rows(column: Any) -> str:
    return f"{len(column)} rows" if hasattr(column, "__len__") else type(column).__name__


def _check_loader(loader: DataLoader, cfg: TrainConfig, field: str) -> None:
    if loader.batch_size is None:
        given = "its own batch_sampler" if loader.batch_sampler is not None else "batch_size=None"
        raise BadInputError(
            f"{field}: a DataLoader with {given}; steadytrain makes the optimizer "
            "batches itself (effective_batch_size). Pass a DataLoader with a sampler and "
            "batch_size, or the dataset"
        )
    given = cfg.model_fields_set
    shuffles = not isinstance(loader.sampler, SequentialSampler)
    if "shuffle" in given and cfg.shuffle != shuffles:
        raise BadInputError(
            f"shuffle: the config says {cfg.shuffle} and the DataLoader's sampler "
            f"({type(loader.sampler).__name__}) {'shuffles' if shuffles else 'does not'}; the "
            "DataLoader's order is used, so remove shuffle from the config or change the loader"
        )
    if "drop_last" in given and cfg.drop_last != loader.drop_last:
        raise BadInputError(
            f"drop_last: the config says {cfg.drop_last} and the DataLoader "
            f"{loader.drop_last}; the DataLoader's is used, so remove drop_last from the config "
            "or change the loader"
        )


def make_sampler(source: DataSource, cfg: TrainConfig) -> OptimizerBatchSampler:
    seed = cfg.seed or 0
    if source.loader is None:
        return OptimizerBatchSampler(
            len(source.dataset), cfg.effective_batch_size, seed, cfg.shuffle, cfg.drop_last
        )
    order = source.order
    return OptimizerBatchSampler(
        len(order), cfg.effective_batch_size, seed, True, source.loader.drop_last, order
    )


HELD_ORDER_BYTES = 8
"""Bytes a sample of an epoch's order held in memory: the config's shuffle keeps a permutation
tensor (int64); a DataLoader's sampler is drawn as its iterator yields, a chunk at a time, into
an int64 tensor too (engine/sampler.py `held_order`; a list of Python ints, an 8-byte pointer
and a 28-byte int each, only for a custom sampler's key past int64)."""


def check_order_fits(
    source: DataSource, sampler: OptimizerBatchSampler, budget: int | None
) -> None:
    """Refuse, before training, an epoch order that cannot be held within the memory budget (a
    stream of 10**12 samples, ported as docs/porting.md says, then shuffled): drawing it would
    fail with the allocator's error in the first step."""
    loader = source.loader
    if loader is None and not sampler.shuffle:
        return
    if loader is not None and type(loader.sampler) is SequentialSampler:
        return
    need = sampler.num_samples * HELD_ORDER_BYTES
    if budget is None or need <= budget:
        return
    what, fix = (
        ("the config's shuffle", "shuffle: false")
        if loader is None
        else (f"the DataLoader's {type(loader.sampler).__name__}", "a DataLoader without shuffle")
    )
    raise BadInputError(
        f"train_data: {sampler.num_samples:,} samples shuffled by {what}: an epoch's order is "
        f"held in memory, {HELD_ORDER_BYTES} bytes a sample, {format_bytes(need)}, more "
        f"than the memory budget {format_bytes(budget)}. Read them in order ({fix}), or give "
        "the dataset a __len__ of the samples the run reads (max_steps x effective_batch_size)"
    )


def budget_note(device: Device) -> str | None:
    """A note, at the start, where `memory_budget` was given as a size below what this process
    already holds with the model in place (on CPU its resident memory: the interpreter and torch
    alone are hundreds of MiB; elsewhere the device's allocated memory): no micro-batch or
    memory saver brings the run under it. A note, not a refusal: the fine-tune refuses a budget
    its estimate does not fit before loading anything, and a process that holds more than a
    fresh one (a notebook's data) would otherwise be refused where its dry-run said it fits. A
    fraction of usable memory is left to the plan."""
    budget = device.budget
    if not isinstance(device.budget_spec, int) or budget is None:
        return None
    reading = device.memory()
    held = reading.rss if device.type == "cpu" else reading.allocated
    if held is None or held <= budget:
        return None
    what = "resident memory" if device.type == "cpu" else f"memory allocated on {device.type}"
    return (
        f"memory_budget: {format_bytes(budget)} is less than this process already holds with "
        f"the model in place ({format_bytes(held)} of {what}): the run cannot keep within it "
        "and trains over it. Give a memory_budget above that (steadytrain estimate shows what "
        "training adds), or leave it out (auto: 0.9 of usable memory)"
    )


def order_identity(source: DataSource, cfg: TrainConfig) -> dict[str, Any]:
    """shuffle and drop_last as the run uses them (a DataLoader's, or the config's)."""
    if source.loader is None:
        return {"shuffle": cfg.shuffle, "drop_last": cfg.drop_last}
    sampler = source.loader.sampler
    shuffle: bool | str = isinstance(sampler, RandomSampler)
    if not isinstance(sampler, RandomSampler | SequentialSampler):
        shuffle = type(sampler).__name__
    return {"shuffle": shuffle, "drop_last": source.loader.drop_last}


def arithmetic_event(
    cfg: TrainConfig,
    source: DataSource,
    sampler: OptimizerBatchSampler,
    state: TrainState,
    precision: str,
    world_size: int = 1,
) -> dict[str, Any]:
    """Every setting that changes the arithmetic of training, as one event with one sentence;
    under torchrun each of the `world_size` ranks accumulates its share of the batch."""
    micro, batch = state.micro_batch_size, state.effective_batch_size
    dropped = sampler.num_samples % batch if sampler.drop_last else 0
    if source.loader is not None:
        order = f"the DataLoader's {type(source.loader.sampler).__name__}"
    else:
        order = f"shuffled each epoch (seed {cfg.seed or 0})" if cfg.shuffle else "in order"
    clipping = (
        "off" if cfg.max_grad_norm is None else f"gradient norm clipped to {cfg.max_grad_norm}"
    )
    share = -(-batch // world_size)  # the largest rank's share
    accumulation = f"micro-batch {micro} × {-(-share // micro)} accumulated to {batch}"
    if world_size > 1:
        accumulation = (
            f"micro-batch {micro} × {-(-share // micro)} accumulated on each of {world_size} "
            f"ranks to {batch} (a share of {share} per rank)"
        )
    seeding = (
        "RNG streams as the program left them"
        if cfg.seed is None
        else f"RNG streams reseeded from seed {cfg.seed}"
    )
    parts = [
        f"clipping {clipping}",
        f"order {order}",
        f"{dropped} sample(s) dropped per epoch",
        f"precision {precision}",
        accumulation,
        seeding,
    ]
    if source.loader is not None and source.loader.batch_size != batch:
        parts.append(
            f"the DataLoader's batch_size {source.loader.batch_size} replaced by "
            f"effective_batch_size {batch}"
        )
    return {
        "clipping": cfg.max_grad_norm,
        "order": order,
        "dropped_per_epoch": dropped,
        "precision": precision,
        "micro_batch_size": micro,
        "effective_batch_size": batch,
        "seed": cfg.seed,
        "message": "; ".join(parts),
    }


def eval_batches(source: DataSource, batch_size: int, index: int) -> Iterator[Any]:
    """The collated batches of the `index`-th evaluation: a DataLoader's order and batch_size
    (its order drawn as its iterator draws it) or the dataset's, in batches of `batch_size`."""
    order = source.order(index) if source.order is not None else range(len(source.dataset))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        chunk = chunk.tolist() if isinstance(chunk, torch.Tensor) else chunk  # ints, not 0-d
        if source.loader is not None and source.loader.drop_last and len(chunk) < batch_size:
            return
        yield source.collate_fn([source.dataset[i] for i in chunk])


def dropout_note(model: torch.nn.Module, cfg: TrainConfig) -> str | None:
    """A note naming the modules that draw random masks per forward (dropout), when the batch
    may be split: masks are drawn per micro-batch, so a run split differently (after a shrink)
    is a different sample of the same training, not the same numbers."""
    if cfg.micro_batch_size == cfg.effective_batch_size:
        return None
    names = [
        name
        for name, module in model.named_modules()
        if (isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0)
        or (isinstance(module, torch.nn.RNNBase) and module.dropout > 0)
    ]
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"dropout in {shown} draws its masks per micro-batch: when the batch is split (or "
        "split again after an out-of-memory) the masks differ from those of the whole batch, "
        "so the losses differ from an unsplit run (their expectation does not)"
    )


def check_evaluation(
    cfg: TrainConfig, scheduler: Any, eval_data: DataSource | None, eval_fn: EvalFn | None
) -> None:
    """Evaluation settings without evaluation data, and a metric-driven scheduler without
    evaluation, are refused before training, naming the field."""
    wanted = [f for f in ("eval_every_steps", "eval_every_epochs", "keep_best") if getattr(cfg, f)]
    if eval_data is None and (wanted or eval_fn is not None):
        raise BadInputError(
            f"eval_data: {', '.join(wanted) or 'eval_fn'} given, but no evaluation data; "
            "pass Trainer(eval_data=...) or remove the evaluation settings"
        )
    if takes_metric(scheduler) and eval_data is None:
        raise BadInputError(
            f"scheduler: {type(scheduler).__name__}.step() needs a metric; give "
            "Trainer(eval_data=...) so that each evaluation steps it with eval_metric "
            f"({cfg.eval_metric!r}), evaluating every epoch unless eval_every_steps or "
            "eval_every_epochs says otherwise"
        )


def make_evaluation(
    cfg: TrainConfig,
    runner: StepRunner,
    scheduler: Any,
    source: DataSource | None,
    eval_fn: EvalFn,
) -> Evaluation | None:
    """The loop's evaluation (None without eval_data): each epoch (and after the last step)
    unless a cadence is set."""
    if source is None:
        return None
    every_epochs = cfg.eval_every_epochs
    default = every_epochs is None and cfg.eval_every_steps is None
    if default:  # each epoch's end, and the end of a run that max_steps ends mid-epoch
        every_epochs = 1
    loader_batch = source.loader.batch_size if source.loader is not None else None
    batch = cfg.eval_batch or loader_batch or cfg.effective_batch_size
    return Evaluation(
        runner=runner,
        batches=lambda index: eval_batches(source, batch, index),
        eval_fn=eval_fn,
        every_steps=cfg.eval_every_steps,
        every_epochs=every_epochs,
        scheduler=scheduler if takes_metric(scheduler) else None,
        metric=cfg.eval_metric,
        mode=cfg.eval_mode,
        at_end=default,
        needs_metric=cfg.keep_best,
    )


def build_optimizer(optimizer: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer: `optimizer` itself, or built by the factory from the parameters
    that require grad; refused when it is several, or steps with a closure."""
    return _one_step_per_batch(_make_optimizer(optimizer, model))


def _make_optimizer(given: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    if isinstance(given, torch.optim.Optimizer):
        _check_holds_the_model(given, model)
        return given
    if isinstance(given, list | tuple | Mapping):  # a GAN's {'g': .., 'd': ..}
        raise BadInputError(
            f"optimizer: {len(given)} optimizers given; steadytrain takes one "
            "optimizer step per batch. Parameters that step together belong in one optimizer "
            "(param groups for their own lr); alternating updates (a GAN's generator and "
            "discriminator) need your own loop: see docs/porting.md, 'Several optimizers'"
        )
    if callable(given):
        optimizer = given([p for p in model.parameters() if p.requires_grad])
        if isinstance(optimizer, torch.optim.Optimizer | list | tuple | Mapping):
            return _make_optimizer(optimizer, model)  # checked as if given itself
        found = f"the function returned {type(optimizer).__name__}"
    else:
        found = f"got {type(given).__name__}"
    raise BadInputError(
        f"optimizer: expected a torch.optim.Optimizer or a function params -> optimizer; {found}"
    )


def _check_holds_the_model(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Refuse an optimizer that holds none of the model's trainable parameters (built on another
    instance of the model): every step would update that one, and this model would not train."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not held or not trainable or any(id(p) in held for p in trainable):
        return
    raise BadInputError(
        f"optimizer: this {type(optimizer).__name__} holds {len(held)} parameter tensor(s), none "
        f"of them the model's ({len(trainable)} trainable): it was built on another instance of "
        "the model, so the run would update that one and this model would not train. Build it "
        "on this model's parameters, or pass a function: "
        f"optimizer=lambda params: {type(optimizer).__name__}(params, ...)"
    )


def make_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The scheduler, built here where `scheduler` is a factory `optimizer -> scheduler` or
    a scheduler class (`scheduler=MySchedule`, called with the optimizer alone)."""
    factory = isinstance(scheduler, type) or (
        callable(scheduler) and not hasattr(scheduler, "state_dict")
    )
    if not factory:
        _check_same_optimizer(scheduler, optimizer)
        return scheduler
    try:
        return scheduler(optimizer)
    except TypeError as error:
        if not isinstance(scheduler, type):
            raise  # the user's own factory failed: their traceback says where
        name = scheduler.__name__
        raise BadInputError(
            f"scheduler: {name}(optimizer) cannot be built from the optimizer alone ({error}); "
            f"pass a function, e.g. scheduler=lambda opt: {name}(opt, ...), or a scheduler "
            "built on the same optimizer"
        ) from None


def _check_same_optimizer(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a scheduler built on another optimizer than the run's (a loop's own optimizer,
    with a function given for the Trainer's): it would set that one's learning rate, and the
    run would train at the first one throughout, silently."""
    own = getattr(scheduler, "optimizer", None)
    if not isinstance(own, torch.optim.Optimizer) or own is optimizer:
        return
    name = type(scheduler).__name__
    raise BadInputError(
        f"scheduler: this {name} was built on an optimizer ({type(own).__name__}) that is not "
        f"the run's ({type(optimizer).__name__}, from `optimizer`): stepping it would change "
        "that one's learning rate and the run would keep its first learning rate throughout. "
        "Pass the optimizer it was built on as `optimizer`, or the scheduler as a function of "
        f"the run's optimizer: scheduler=lambda opt: {name}(opt, ...)"
    )


def _one_step_per_batch(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer`, refused when its step() needs a closure (LBFGS): it would evaluate the loss
    several times per step, and the engine's step computes the gradients once, then steps."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without a readable signature takes no closure
        return optimizer
    if closure is None or closure.default is not inspect.Parameter.empty:
        return optimizer
    name = type(optimizer).__name__
    raise BadInputError(
        f"optimizer: {name}.step() needs a closure (it evaluates the loss several times per "
        "step); steadytrain computes the gradients of each batch once, then calls step() "
        "without one. Use an optimizer whose closure is optional (SGD, Adam, AdamW), or keep "
        f"your own loop for {name}: see docs/porting.md, 'Optimizers that need a closure'"
    )


class BatchDependentModelWarning(UserWarning):
    """The model's forward depends on the batch, so splitting a batch changes the result."""


def warn_if_batch_dependent(model: torch.nn.Module, cfg: TrainConfig) -> None:
    norms = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    ]
    if norms and cfg.micro_batch_size != cfg.effective_batch_size:
        warnings.warn(
            f"model: {len(norms)} BatchNorm layer(s) (first: {norms[0]}) compute statistics per "
            "micro-batch, so accumulation over micro-batches is not exactly the full batch. Set "
            "micro_batch_size equal to effective_batch_size if it fits, or use GroupNorm/LayerNorm.",
            BatchDependentModelWarning,
            stacklevel=3,
        )


@dataclass
class RunParts:
    """The parts of one `fit()`, built by `Trainer._set_up` and wired by the phases after it."""

    device: Device
    precision: Precision
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: OptimizerBatchSampler
    state: TrainState
    savers: MemorySavers
    runner: StepRunner
    emit: Dispatcher
    group: Group
    scheduler: Any = None
    checkpoint: RunState | None = None  # set by `Trainer._run_state`, under the watchdog
    resumed: bool = False
