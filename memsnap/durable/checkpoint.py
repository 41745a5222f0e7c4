"""The public ``memsnap.save`` / ``memsnap.load``: whole training state <-> a durable step.

``save`` lays the state out (``capture.plan_sources``), writes this rank's files through
``storage.Store`` straight from the tensors (``stream.TensorStream``: no staging copy, each
byte read once for both checksums and the write) and, after a barrier, rank 0 commits the
step and applies retention. ``load`` picks the step (when ``step`` is None: the newest
commit, i.e. the newest step of the newest lineage), reads and verifies this rank's bytes
(``Store.read_rank``: the whole file's xxh3 against the commit marker and every tensor's
checksum in one pass), checks the manifest against the live state (``apply.plan``) and applies
them (``apply.apply_plan``); a checkpoint saved by a different number of ranks goes through
``reshard``. With ``step=None`` a damaged or malformed step is skipped, with a warning, for
the one it descends from; under ``torch.distributed`` the ranks agree on the step (and on raising)
before anything is applied.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from memsnap.durable import meta, reshard
from memsnap.durable.storage import Progress, Retention, Store
from memsnap.errors import (
    ChecksumError,
    ConfigError,
    MemsnapError,
    SnapshotNotFoundError,
    StateMismatchError,
    UnsupportedStateError,
    WeightsOnlyError,
)
from memsnap.state import apply as applying
from memsnap.state import validate
from memsnap.state.capture import plan_sources
from memsnap.state.manifest import Manifest
from memsnap.state.stream import TensorStream

BAR_MIN_BYTES = 256 << 20  # a progress bar for transfers likely to take a second or more


def progress_bar(desc: str, total: int, enabled: bool | None = None) -> tuple[Progress | None, Callable[[], None]]:
    """A ``(done, total)`` callback drawing a tqdm bar, and a function that closes it."""
    if enabled is False or (enabled is None and total < BAR_MIN_BYTES):
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)

    def update(done: int, _total: int) -> None:
        bar.update(done - bar.n)

    return update, bar.close


def release_buffer() -> None:
    """Kept for compatibility: ``save`` writes straight from the tensors and keeps no staging
    buffer any more, so there is nothing to free."""


def _background(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """Start ``fn(*args)`` on a thread; return a function that waits for and returns its result
    (or raises its exception)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller by result()
            out["error"] = exc

    thread = threading.Thread(target=run, name="memsnap-save-meta", daemon=True)
    thread.start()

    def result() -> Any:
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def _dist() -> Any | None:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = _dist()
    if rank is None and world_size is None and dist is not None:
        return dist.get_rank(), dist.get_world_size()
    rank, world = (0 if rank is None else rank), (1 if world_size is None else world_size)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            f"rank={rank}, world_size={world} is not a valid rank of the job; need 0 <= rank < world_size"
        )
    return rank, world


def _barrier(world: int, barrier: Callable[[], None] | None) -> Callable[[], None]:
    if barrier is not None:
        return barrier
    dist = _dist()
    if dist is not None:
        return dist.barrier
    if world > 1:
        raise ConfigError(
            f"saving with world_size={world} outside torch.distributed needs barrier=, "
            "a function that returns once every rank reached it"
        )
    return lambda: None


def _check_save(state: Mapping[str, Any], step: int, weights_only: bool) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    if not meta.has_optimizer(state) and not weights_only:
        raise WeightsOnlyError(
            f"state has no optimizer (keys: {sorted(state)}): resuming from it would restart the "
            "optimizer from scratch; add the optimizer to state, or pass weights_only=True if that is meant"
        )


def save(
    uri: str,
    state: Mapping[str, Any],
    step: int,
    metadata: Mapping[str, Any] | None = None,
    *,
    weights_only: bool = False,
    milestone: bool = False,
    keep_last: int | None = None,
    milestone_every: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    barrier: Callable[[], None] | None = None,
    endpoint: str | None = None,
    throttle_bps: float | None = None,
    progress: bool | None = None,
) -> None:
    """Write ``state`` (a dict of objects with ``state_dict()``, plus RNGs) as step ``step``.

    Every rank calls it; rank and world size come from ``torch.distributed`` when initialised.
    ``metadata`` (JSON: loss, config...) is recorded with the automatic metadata
    (``meta.describe``). ``keep_last`` turns on retention: the newest ``keep_last`` steps of
    this run's lineage, the step it resumed from, plus milestones (``milestone_every``, or
    ``milestone=True`` on this save) are kept (``storage.Retention``). After a ``load`` of an
    older step the run is a new lineage: a step of another lineage with this number is
    replaced, and ``load(step=None)`` resumes this lineage from then on.
    """
    _check_save(state, step, weights_only)
    rank, world = _rank_world(rank, world_size)
    sync = _barrier(world, barrier)
    info = meta.describe(step, world, state, metadata, milestone, git=False)
    policy = Retention(keep_last, milestone_every) if keep_last is not None else None
    store = Store.open(uri, endpoint)
    if store.descends_from(step):
        raise ConfigError(
            f"step {step} is already committed under {uri} and this run continues "
            "from it; save under a new step (a run never overwrites the steps it "
            "descends from; load an earlier step first to roll back)"
        )
    git = _background(meta.git_commit, os.getcwd()) if rank == 0 else None  # runs during the write
    layout, sources = plan_sources(state)
    if len(layout.tensors) > validate.MAX_TENSORS:  # a load would refuse such a manifest
        raise UnsupportedStateError(
            f"state has {len(layout.tensors)} tensors, more than the "
            f"{validate.MAX_TENSORS} one memsnap manifest holds; save fewer, "
            "larger tensors (e.g. flatten parameter groups)"
        )
    layout.meta.update(step=step, rank=rank, world_size=world)
    update, close = progress_bar(f"save step {step}", layout.nbytes, progress)
    try:  # one pass over the tensors' memory: both checksums and the write (see stream.py)
        store.write_rank_stream(step, rank, TensorStream(layout, sources), throttle_bps=throttle_bps, progress=update)
    finally:
        close()
    sync()
    if rank == 0:
        assert git is not None
        info["git"] = git()
        store.commit(step, world, info)
        if policy is not None:
            store.retain(policy)
    sync()


_OK, _DAMAGED, _FATAL = 0, 1, 2  # how a step fared on one rank; ranks agree on the worst


def _outcome(error: BaseException | None) -> int:
    """_OK, _DAMAGED (a bad or unreadable step: try the previous one) or _FATAL (the live state
    does not fit, bad arguments, or an unexpected failure: no older step would fare better)."""
    if error is None:
        return _OK
    if isinstance(error, (ConfigError, StateMismatchError)):
        return _FATAL
    return _DAMAGED if isinstance(error, (MemsnapError, OSError, ValueError)) else _FATAL


def _agree(outcome: int, world: int) -> int:
    """The worst outcome over all ranks (every rank calls this once per candidate step)."""
    dist = _dist()
    if dist is None or world == 1:
        return outcome
    flag = torch.tensor([outcome])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _failed_elsewhere(step: int, uri: str, worst: int) -> MemsnapError:
    cls = ChecksumError if worst == _DAMAGED else MemsnapError
    return cls(f"step {step} under {uri} failed to load on another rank (its log says why)")


def read_step(
    store: Store, step: int, rank: int, world: int, state: Mapping[str, Any], progress: bool | None = None
) -> tuple[Manifest, Any, dict]:
    """This rank's verified manifest and bytes of ``step`` (``Store.read_rank``), in the live
    state's layout."""
    marker = store.marker(step)
    if marker["world_size"] != world:
        manifest, buf = reshard.assemble(store, step, marker, state, rank)
        return manifest, buf, marker
    manifest = store.manifest(step, rank, marker)
    update, close = progress_bar(f"load step {step}", manifest.nbytes, progress)
    try:  # on a local disk the page cache is mapped instead of copied into fresh pages
        _, buf = store.read_rank(step, rank, marker=marker, manifest=manifest, progress=update)
    finally:
        close()
    return manifest, buf, marker


def _candidates(store: Store, step: int | None) -> list[int]:
    if step is not None:
        return [step]
    steps = store.resume_order()
    if not steps:
        raise SnapshotNotFoundError(
            f"no committed step under {store.uri}; nothing to load (check the URI, or start fresh)"
        )
    return steps


def load(
    uri: str,
    state: Mapping[str, Any],
    step: int | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    strict: bool = True,
    rng: bool = True,
    endpoint: str | None = None,
    progress: bool | None = None,
) -> int:
    """Load step ``step`` (None: the newest intact step of the newest lineage, then the steps
    it descends from) into ``state``; return it. This process's next save continues from it."""
    rank, world = _rank_world(rank, world_size)
    store = Store.open(uri, endpoint)
    last_error: Exception | None = None
    for s in _candidates(store, step):
        try:  # bytes verified on read; the plan refuses a malformed or mismatched manifest
            manifest, buf, marker = read_step(store, s, rank, world, state, progress)
            pl = applying.plan(state, manifest, rng=rng, strict=strict)
            error = None
        except Exception as exc:  # every rank reaches the agreement below, also the failing one
            error = exc
        worst = _agree(_outcome(error), world)
        if worst == _OK:
            _warn_weights_only(marker, manifest, s, uri)
            applying.apply_plan(state, pl, buf)
            store.resumed(s)
            return s
        if worst == _FATAL or step is not None:
            raise error or _failed_elsewhere(s, uri, worst)
        last_error = error or last_error
        warnings.warn(
            f"step {s} under {uri} cannot be loaded ({error or 'damaged on another rank'}); "
            "falling back to the previous committed step",
            stacklevel=2,
        )
    raise SnapshotNotFoundError(f"no intact committed step under {uri}; the last error was: {last_error}")


def _has_optimizer_tree(manifest: Manifest) -> bool:
    """Whether a snapshot holds an optimizer's state dict (``state`` + ``param_groups``)."""
    top = manifest.tree if isinstance(manifest.tree, dict) else {}
    return any(isinstance(v, dict) and "param_groups" in v and "state" in v for v in top.values())


def _warn_weights_only(marker: dict, manifest: Manifest, step: int, uri: str) -> None:
    flag = marker.get("metadata", {}).get("has_optimizer")
    if not (_has_optimizer_tree(manifest) if flag is None else flag):
        warnings.warn(
            f"step {step} under {uri} holds no optimizer state (saved weights-only); the optimizer starts from scratch",
            stacklevel=3,
        )
