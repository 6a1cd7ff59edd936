"""The program's data as the `Trainer` reads it: the dataset, its collation and workers, its
order, and the optimizer batches drawn from it.

A map-style dataset is batched by steadytrain: `shuffle` and `drop_last` of the config (seeded
permutations, exact on resume). A `DataLoader` keeps its own sampler (its order, drawn as its own
iterator draws it), its `drop_last` and its collate_fn; a config that sets `shuffle` or
`drop_last` against it is refused, naming the field. The loop, the plan's trial passes and the
resume probe load a batch here, each as the others do (`loader_at`, `batch_at`); evaluation
reads its batches here too (`eval_batches`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate

from steadytrain._units import format_bytes
from steadytrain.config import TrainConfig
from steadytrain.engine import OptimizerBatchSampler
from steadytrain.engine.accumulation import check_callable
from steadytrain.engine.batching import SampleFirst
from steadytrain.engine.collate import collate
from steadytrain.engine.distributed import Group
from steadytrain.engine.sampler import LoaderOrder, SeededFetch
from steadytrain.engine.workers import owned_worker_init
from steadytrain.errors import BadInputError


@dataclass
class DataSource:
    """One data argument of the `Trainer` (`train_data`, `eval_data`), as it is read."""

    dataset: Any
    collate_fn: Callable
    workers: int
    worker_init_fn: Callable | None
    loader: DataLoader | None = None
    order: LoaderOrder | None = None  # a DataLoader's sampler order, drawn per epoch


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
    """The optimizer batches of each epoch: the config's order over the dataset, or the
    DataLoader's; refused when an epoch holds no whole optimizer batch."""
    seed = cfg.seed or 0
    if source.loader is None:
        sampler = OptimizerBatchSampler(
            len(source.dataset), cfg.effective_batch_size, seed, cfg.shuffle, cfg.drop_last
        )
    else:
        sampler = OptimizerBatchSampler(
            len(source.order),
            cfg.effective_batch_size,
            seed,
            True,
            source.loader.drop_last,
            source.order,
        )
    if sampler.steps_per_epoch == 0:
        raise BadInputError(
            f"train_data: {len(source.dataset)} sample(s), fewer than one optimizer batch of "
            f"effective_batch_size {cfg.effective_batch_size}; lower effective_batch_size "
            "or set drop_last: false"
        )
    return sampler


HELD_ORDER_BYTES = 8
"""Bytes a sample of an epoch's order held in memory: the config's shuffle keeps a permutation
tensor (int64); a DataLoader's sampler is drawn as its iterator yields, a chunk at a time, into
an int64 tensor too (engine/sampler.py `held_order`; a list of Python ints, an 8-byte pointer
and a 28-byte int each, only for a custom sampler's key past int64)."""


def check_order_fits(
    source: DataSource,
    sampler: OptimizerBatchSampler,
    budget: int | None,
    max_steps: int | None = None,
) -> None:
    """Refuse, before training, an epoch order that cannot be held within the memory budget (a
    stream of 10**12 samples, ported as docs/porting.md says, then shuffled; minGPT's "forever"
    sampler, `RandomSampler(replacement=True, num_samples=int(1e10))`): drawing it would fail
    with the allocator's error in the first step."""
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
    said = (
        f"train_data: {sampler.num_samples:,} samples shuffled by {what}: an epoch's order is "
        f"held in memory, {HELD_ORDER_BYTES} bytes a sample, {format_bytes(need)}, more "
        f"than the memory budget {format_bytes(budget)}. "
    )
    drawn = getattr(loader, "sampler", None) if loader is not None else None
    if isinstance(drawn, RandomSampler) and drawn._num_samples is not None:
        reads = (
            f"max_steps × effective_batch_size = {max_steps * sampler.batch_size:,}"
            if max_steps
            else "max_steps × effective_batch_size"
        )
        raise BadInputError(
            said + f"Its num_samples={drawn.num_samples:,} is how many samples it draws (a "
            f'"forever" sampler); give it the samples the run reads, num_samples={reads} '
            "(RandomSampler(data, replacement=True, num_samples=...)), and set max_steps"
        )
    raise BadInputError(
        said + f"Read them in order ({fix}), or give "
        "the dataset a __len__ of the samples the run reads (max_steps x effective_batch_size)"
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


def loader_at(
    source: DataSource,
    sampler: OptimizerBatchSampler,
    epoch: int,
    start: int,
    device: Any,
    group: Group,
    seed: int | None,
) -> DataLoader:
    """The loop's batches of `epoch` from optimizer batch `start` on, this rank's shares."""
    sampler.set_position(epoch, start)
    return DataLoader(
        SeededFetch(source.dataset),
        batch_sampler=group.shares(sampler),
        collate_fn=source.collate_fn,
        num_workers=source.workers,
        worker_init_fn=owned_worker_init(source.worker_init_fn),  # they outlive a stop signal
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed((seed or 0) * 7919 + epoch),
    )


def batch_at(
    source: DataSource,
    sampler: OptimizerBatchSampler,
    epoch: int,
    position: int,
    group: Group | None = None,
    ahead: bool = False,
) -> Any:
    """The collated optimizer batch at (`epoch`, `position`), as the loop will load it
    (with `group`: as its rank loads it, its share). `ahead`: an epoch whose order the
    DataLoader draws when it starts is drawn now, on copies, from the random streams as they
    stand (`OptimizerBatchSampler.batch_ahead`; the caller puts them back); None when its
    sampler cannot be copied."""
    if ahead:
        indices = sampler.batch_ahead(epoch, position, keep=(source.dataset, source.loader))
        if indices is None:
            return None
    else:
        indices = sampler.batch_at(epoch, position)
    indices = group.share(indices) if group is not None else indices
    return source.collate_fn(SeededFetch(source.dataset).__getitems__(indices))
