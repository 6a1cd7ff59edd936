"""The resumable sampler: one item per optimizer step, the indices of `batch_size` samples.

Each epoch's order is a permutation drawn from its own generator seeded by (seed, epoch), so the
order of epoch e never depends on what ran before, and resuming at (epoch, position) is exact.

Random draws a dataset makes while loading (augmentation, random crops) are made exact the same
way: each batch carries its own seed, and `SeededFetch` seeds the RNG streams with it before
loading the batch — in a worker process as in the training process, where the training's own
streams are put back afterwards. So a batch's draws do not depend on which worker loads it, how
many workers there are, or where the run was resumed.
"""

from __future__ import annotations

import copy
import itertools
import operator
import pickle
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import SequentialSampler, get_worker_info

from steadytrain.errors import (
    BadInputError,
    SteadytrainError,
    UserCodeError,
    _theirs_class,
    user_code_error,
)


class SeededBatch(list):
    """The indices of one optimizer batch, with the seed its loading draws from."""

    seed: int = 0


def batch_seed(seed: int, epoch: int, step: int) -> int:
    return (seed * 1_000_003 + epoch) * 1_000_033 + step


class OptimizerBatchSampler:
    """Yields lists of dataset indices, one optimizer batch each, from (epoch, start) on."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        order: LoaderOrder | None = None,
    ):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.loader_order = order
        self.epoch, self.start = 0, 0
        self._drawn: tuple[int, torch.Tensor] | None = None

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> Sequence[int]:
        """Epoch `epoch`'s indices: a range in order; a permutation tensor (8 bytes a sample,
        drawn once per epoch and kept) when shuffled; a DataLoader's drawn order (`LoaderOrder`)."""
        if self.loader_order is not None:
            return self.loader_order(epoch)
        if not self.shuffle:
            return range(self.num_samples)
        if self._drawn is None or self._drawn[0] != epoch:
            self._drawn = None  # the previous epoch's permutation is freed before the next one
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._drawn = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._drawn[1]

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        for step in range(self.start, self.steps_per_epoch):
            yield self._batch(order, self.epoch, step)

    def batch_ahead(self, epoch: int, step: int, keep: Iterable[Any] = ()) -> SeededBatch | None:
        """The batch at (epoch, step), an epoch whose DataLoader order is not drawn yet
        included: then drawn ahead, on copies, as it will be drawn from the random streams as
        they stand now (`LoaderOrder.ahead`; the caller puts the streams back). None when the
        sampler cannot be copied."""
        if self.has_order(epoch):
            return self.batch_at(epoch, step)
        order = self.loader_order.ahead(epoch, keep)
        return None if order is None else self._batch(order, epoch, step)

    def has_order(self, epoch: int) -> bool:
        """Whether the order of `epoch` is known without drawing it (a DataLoader's sampler
        draws from the training's RNG streams when its epoch starts)."""
        return self.loader_order is None or epoch in self.loader_order.drawn

    def batch_at(self, epoch: int, step: int) -> SeededBatch:
        """The batch the sampler yields at (epoch, step), without moving it."""
        return self._batch(self.order(epoch), epoch, step)

    def _batch(self, order: Sequence[int], epoch: int, step: int) -> SeededBatch:
        indices = order[step * self.batch_size : (step + 1) * self.batch_size]
        batch = SeededBatch(indices.tolist() if isinstance(indices, torch.Tensor) else indices)
        batch.seed = batch_seed(self.seed, epoch, step) % 2**63
        return batch

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start


class LoaderOrder:
    """The order of a user's DataLoader: its sampler's indices for an epoch, drawn when the epoch
    starts and as `iter(DataLoader)` draws them: first the workers' base seed, then the sampler
    (a RandomSampler without a generator takes its seed from torch's global stream). A program
    whose loop is `for batch in loader` therefore sees the same order and the same random
    stream afterwards. The drawn order is saved in checkpoints (`drawn`): a resume mid-epoch
    cannot draw it again. It is held as an int64 tensor (`held_order`)."""

    def __init__(self, loader: torch.utils.data.DataLoader):
        self.sampler, self.generator = loader.sampler, loader.generator
        self.drawn: dict[int, torch.Tensor | Sequence[int]] = {}

    def __len__(self) -> int:
        return len(self.sampler)

    def __call__(self, epoch: int) -> torch.Tensor | Sequence[int]:
        if epoch not in self.drawn:
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            self.drawn = {epoch: self._draw(epoch)}
        return self.drawn[epoch]

    def ahead(self, epoch: int, keep: Iterable[Any] = ()) -> torch.Tensor | Sequence[int] | None:
        """Epoch `epoch`'s order as `self(epoch)` will draw it if the random streams stay as
        they stand now, drawn on copies of the sampler and of the loader's generator: the
        sampler (its generator, its epoch, any state its iteration changes), the loader's
        generator and `drawn` are left as they were, so the run later draws the same order
        itself. The global streams of torch, numpy and python it draws from are the caller's to
        put back (`side_pass`). `keep`: what the copy shares instead of copying (the dataset a
        RandomSampler holds). None when the sampler cannot be copied (it holds a lock, a file)."""
        if type(self.sampler) is SequentialSampler:
            return range(len(self.sampler))
        copied = LoaderOrder.__new__(LoaderOrder)
        try:
            copied.sampler = copy.deepcopy(self.sampler, {id(obj): obj for obj in keep})
            copied.generator = copy.deepcopy(self.generator)
        except (TypeError, copy.Error, pickle.PicklingError):
            return None
        copied.drawn = {}
        return copied(epoch)

    def _draw(self, epoch: int) -> torch.Tensor | Sequence[int]:
        if type(self.sampler) is SequentialSampler:  # 0..n-1: nothing to hold, whatever n is
            return range(len(self.sampler))
        if callable(getattr(self.sampler, "set_epoch", None)):  # as a loop calls it each epoch
            self.sampler.set_epoch(epoch)
        return held_order(self.sampler, len(self.sampler), type(self.sampler).__name__)


DRAW_CHUNK = 65_536
"""Indices a drawn order is converted at a time (a 512 KiB list of Python ints at most)."""


def held_order(
    keys: Iterable[Any], size: int, sampler: str = "sampler"
) -> torch.Tensor | list[int]:
    """The indices `keys` yields, each as ``int(key)`` makes it, in an int64 tensor of `size`
    (8 bytes a sample), filled `DRAW_CHUNK` at a time: a list of Python ints held instead took
    36 bytes a sample (an 8-byte pointer and a 28-byte int), a checkpoint copied it into a
    tensor at each save and a resume made the list again. A 10,000,000-index RandomSampler
    (bench/loader_order.py, 2 shared CPU cores): 83 MB resident instead of 404 MB, the save's
    part 0.03 ms instead of 0.6 s, the load 1 ms instead of 0.44 s; the draw 2.4 s instead of
    1.9 s once an epoch, a batch taken from it 3.5 us instead of 1.3 us once a step. A sampler
    that yields more or fewer than its len() gets what it yields; a key past int64 (a custom
    sampler's 64-bit hash) keeps the whole order a list of ints, as it was. A key that is not
    an integer (a string, a float, a tuple) is refused (`index_keys`)."""
    out, filled, stream = torch.empty(size, dtype=torch.int64), 0, iter(keys)
    while chunk := index_keys(list(itertools.islice(stream, DRAW_CHUNK)), sampler):
        if filled + len(chunk) > len(out):  # more than len(): grow by half at least
            grown = max(filled + len(chunk), len(out) + len(out) // 2)
            out = torch.cat([out, torch.empty(grown - len(out), dtype=torch.int64)])
        try:
            out.numpy()[filled : filled + len(chunk)] = chunk
        except OverflowError:  # past int64
            return out[:filled].tolist() + chunk + index_keys(list(stream), sampler)
        filled += len(chunk)
    return out if filled == len(out) else out[:filled].clone()


def index_keys(keys: list[Any], sampler: str) -> list[int]:
    """`keys` as Python ints (`operator.index`: ints, NumPy integers, 0-d integer tensors);
    BadInputError (exit 2) naming the first other key: the order is kept in checkpoints as
    integers, and turning "12" or 12.0 into 12 would hand the dataset another key than the
    program's own loop gives it."""
    try:
        return list(map(operator.index, keys))
    except TypeError:
        bad = next(k for k in keys if not _is_index(k))
        raise BadInputError(
            f"the DataLoader's {sampler} yielded {bad!r} ({type(bad).__name__}) where a dataset "
            "index belongs: the Trainer keeps a sampler's order in its checkpoints as integers. "
            "Give the DataLoader a sampler of integer indices (a dataset whose samples have "
            "other keys can map index i to its i-th key in __getitem__)"
        ) from None


def _is_index(key: Any) -> bool:
    try:
        operator.index(key)
    except TypeError:
        return False
    return True


class RandomDraws(torch.utils.data.Sampler[int]):
    """Batches drawn at random each step, with replacement: for each of `steps` optimizer steps,
    ``torch.randint(num_items, (batch_size,), generator=g)``, the draw of nanoGPT's
    `get_batch`. Give it to a DataLoader of the same `batch_size` over a dataset whose item i
    is what the loop builds from index i (a window of tokens starting at i), and pass that
    DataLoader as `train_data`::

        loader = DataLoader(windows, batch_size=12, sampler=RandomDraws(len(windows), 12, 5000, seed=1337))

    `seed`: epoch 0 draws from ``torch.Generator().manual_seed(seed)``, so a loop that draws
    from such a generator gets the same batches, in the same order; epoch e from seed + e (the
    Trainer calls `set_epoch`, so a resumed run draws the epochs it would have drawn). None:
    from torch's global stream when the epoch starts, as ``torch.randint`` without a generator
    does. The Trainer draws an epoch's indices when it starts (steps x batch_size of them) and
    saves them in checkpoints: a resume mid-epoch continues with the same batches."""

    def __init__(self, num_items: int, batch_size: int, steps: int, seed: int | None = None):
        for name, value in (("num_items", num_items), ("batch_size", batch_size), ("steps", steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RandomDraws: {name} must be a whole number >= 1, got {value!r}")
        self.num_items, self.batch_size, self.steps, self.seed = num_items, batch_size, steps, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps * self.batch_size

    def __iter__(self) -> Iterator[int]:
        generator = None
        if self.seed is not None:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
        for _ in range(self.steps):
            yield from torch.randint(
                self.num_items, (self.batch_size,), generator=generator
            ).tolist()


class SeededFetch(torch.utils.data.Dataset):
    """Loads a `SeededBatch` with every RNG stream seeded from the batch's seed."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        seed = getattr(indices, "seed", None)
        if seed is None:
            return Fetched(self.dataset, indices)
        if get_worker_info() is not None:  # a worker process: its streams serve only loading
            _seed_host(seed)
            return Fetched(self.dataset, indices)
        saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            _seed_host(seed)
            return Fetched(self.dataset, indices)
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.set_rng_state(saved[2])


class Fetched(list):
    """The samples of `indices`, a list that knows their dataset indices (`indices`): the
    default collation names them when samples of different shapes meet (engine/collate.py)."""

    def __init__(self, dataset: Any, indices: Sequence[Any]):
        self.indices = list(indices)  # as the sampler gave them: ints, or a custom sampler's keys
        super().__init__(_sample(dataset, i) for i in self.indices)


def _sample(dataset: Any, index: Any) -> Any:
    """`dataset[index]`. An error raised inside a library's dataset (torch's `Subset` over
    indices its dataset lacks, a `TensorDataset`, a `ConcatDataset`), with no frame of the user's
    own code in it, is still the user's data: exit 5 naming the dataset, the index and the fix,
    not a traceback of steadytrain's."""
    try:
        return dataset[index]
    except (LookupError, TypeError, ValueError) as exc:
        if isinstance(exc, SteadytrainError) or user_code_error(exc) is not None:
            raise
        name = type(dataset).__name__
        error = f"{type(exc).__name__}: {str(exc).strip()}".rstrip(": ")
        problem = f"{name}[{index!r}] raised {error}"
        if isinstance(exc, LookupError):
            size = _length(dataset)
            problem += (
                f". The sampler drew index {index!r} of the dataset's len() {size}: every index "
                "below len() must give a sample (a Subset's indices must lie inside its "
                "dataset; a dataset's __len__ must count the samples it holds)"
            )
        # also of the error's own type: `except IndexError` around it (the data fingerprint's
        # check of a dataset keyed otherwise, the user's own code) still catches it; in a
        # loader worker a plain UserCodeError, the class torch can send back to the run
        worker = get_worker_info() is not None
        theirs = UserCodeError if worker else _theirs_class(type(exc), UserCodeError)
        where = f"the dataset, {name}[{index!r}]"
        try:
            raised = theirs(problem, where=where, error=error)
        except TypeError:  # a class whose constructor wants more than a message
            raised = UserCodeError(problem, where=where, error=error)
        raise raised from exc


def _length(dataset: Any) -> str:
    try:
        return str(len(dataset))
    except Exception:  # noqa: BLE001 - the message only
        return "unknown"


def _seed_host(seed: int) -> None:
    """The host streams a dataset draws from while loading (device streams are not touched)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
