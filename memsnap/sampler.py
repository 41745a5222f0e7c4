"""The data position: a sampler whose state is (epoch, seed, samples consumed), and a loader
wrapper that counts only the batches actually handed to the training loop.

A DataLoader draws indices from its sampler ahead of the loop (``num_workers *
prefetch_factor`` batches), so the sampler cannot know by itself what was trained on. The
loop tells it, either through ``ResumableLoader`` (counts yielded batches) or by calling
``sampler.advance(batch_size)`` after each batch with a plain ``DataLoader``::

    sampler = ResumableSampler(dataset, seed=0, rank=rank, world_size=world)
    loader = ResumableLoader(DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2))
    state = {"model": model, "optim": opt, "data": loader}   # loader.state_dict() has the sampler's
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)       # keeps the position when resuming inside this epoch
        for batch in loader: ...

A restored run sees exactly the samples the uninterrupted run would have seen, with any
number of workers. Any object with ``state_dict()`` (e.g. torchdata's ``StatefulDataLoader``)
can be put into the state instead; capture treats it generically.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from memsnap.errors import ConfigError, StateMismatchError


def _length(data: int | Sized) -> int:
    n = data if isinstance(data, int) and not isinstance(data, bool) else None
    if n is None:
        try:
            n = len(data)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                f"ResumableSampler needs a dataset length or a sized dataset, got {type(data).__qualname__}"
            ) from None
    if n < 0:
        raise ConfigError(f"dataset length must be >= 0, got {n}")
    return n


class ResumableSampler(Sampler[int]):
    """Shuffled (per ``seed + epoch``), rank-strided indices that resume at ``consumed``."""

    def __init__(
        self,
        data: int | Sized,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.n, self.shuffle, self.seed = _length(data), bool(shuffle), int(seed)
        self.rank, self.world_size, self.drop_last = rank, world_size, bool(drop_last)
        per_rank = self.n // world_size if drop_last else math.ceil(self.n / world_size)
        self.num_samples = per_rank  # this rank's samples per epoch
        self.epoch, self.consumed = 0, 0

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's whole index sequence for ``epoch`` (the same on every run)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.world_size
        if order and len(order) < total:  # pad by wrapping, as DistributedSampler does
            order = (order * math.ceil(total / len(order)))[:total]
        return order[self.rank : total : self.world_size]

    def __iter__(self) -> Iterator[int]:
        if self.consumed >= self.num_samples > 0:  # the last epoch ran out: go on to the next
            self.set_epoch(self.epoch + 1)
        return iter(self.epoch_indices(self.epoch)[self.consumed :])

    def __len__(self) -> int:
        return self.num_samples - self.consumed

    def advance(self, n: int) -> None:
        """Count ``n`` more samples as consumed by the training loop."""
        if n < 0 or self.consumed + n > self.num_samples:
            raise ConfigError(
                f"advance({n}) with {self.consumed} of {self.num_samples} samples consumed in epoch "
                f"{self.epoch} would overrun the epoch; call set_epoch() when an epoch ends"
            )
        self.consumed += n

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch keeps its position."""
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "seed": self.seed, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "seed", "consumed"} - set(state)
        if missing:
            raise StateMismatchError(f"sampler state lacks {sorted(missing)}; got keys {sorted(state)}")
        if not 0 <= int(state["consumed"]) <= self.num_samples:
            raise StateMismatchError(
                f"sampler state has consumed={state['consumed']} but this rank's epoch has "
                f"{self.num_samples} samples; the dataset length or world size changed"
            )
        self.epoch, self.seed, self.consumed = int(state["epoch"]), int(state["seed"]), int(state["consumed"])


def _find_sampler(loader: DataLoader) -> ResumableSampler:
    batch_sampler = getattr(loader, "batch_sampler", None)
    for s in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(s, ResumableSampler):
            return s
    raise ConfigError("ResumableLoader needs a DataLoader built with sampler=ResumableSampler(...)")


class ResumableLoader:
    """A DataLoader whose ``state_dict`` is its sampler's position after the batches it yielded.

    Creating a DataLoader iterator draws worker seeds from torch's global generator; this
    wrapper does that under ``torch.random.fork_rng`` so that resuming (which creates an
    iterator where the uninterrupted run did not) leaves the global RNG stream unchanged.
    Randomness inside workers is not part of the snapshot.
    """

    def __init__(self, loader: DataLoader):
        if loader.batch_size is None:
            raise ConfigError(
                "ResumableLoader needs a DataLoader with batch_size set; with a custom "
                "batch_sampler call sampler.advance(n) yourself after each batch"
            )
        self.loader, self.sampler = loader, _find_sampler(loader)
        self._batch_size: int = loader.batch_size

    def _batch_samples(self) -> int:
        left = self.sampler.num_samples - self.sampler.consumed
        return min(self._batch_size, left)

    def __iter__(self) -> Iterator[Any]:
        with torch.random.fork_rng(devices=[]):
            it = iter(self.loader)
        for batch in it:
            self.sampler.advance(self._batch_samples())
            yield batch
        if self.loader.drop_last:  # the dropped tail counts as seen, so the next pass starts a new epoch
            self.sampler.advance(self.sampler.num_samples - self.sampler.consumed)

    def __len__(self) -> int:
        left = len(self.sampler)
        bs = self._batch_size
        return left // bs if self.loader.drop_last else math.ceil(left / bs)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
