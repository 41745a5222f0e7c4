"""One rank's training loop for the demo: the same code runs under Ray Train and in the
reference processes, so the two loss curves can be compared bit for bit."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from memsnap.demo.model import FrozenTable, MarkovTokens, ModelConfig, TinyTransformer
from memsnap.sampler import ResumableLoader, ResumableSampler


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 40
    batch: int = 16
    lr: float = 3e-3
    seed: int = 0
    log_path: str = ""  # rank 0 appends one JSON line per step here
    step_delay: float = 0.0  # seconds of simulated extra compute per step
    frozen_mib: float = 0.0  # MiB of frozen state per rank beside the model (``FrozenTable``)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> TrainConfig:
        d = dict(d)
        d["model"] = ModelConfig(**d["model"])
        return cls(**d)


def build(cfg: TrainConfig, rank: int, world: int, ddp: bool | None = None) -> dict[str, Any]:
    """The whole training state of one rank. Data parallelism averages every gradient with
    one all-reduce per parameter, in parameter order (``_average_gradients``), when ``ddp``
    (by default when ``world > 1``; that needs an initialised process group). Unlike DDP's
    buckets, which it rebuilds after the first iteration of every process, the reduction
    order is the same in a run that restarted as in one that did not, so a resumed run can
    match an uninterrupted one bit for bit."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    model = TinyTransformer(cfg.model)
    parallel = world > 1 if ddp is None else ddp
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        **rank_parts(cfg, rank, world),
        "_world": world if parallel else 1,
    }


def rank_parts(cfg: TrainConfig, rank: int, world: int) -> dict[str, Any]:
    """The parts of a rank's state that depend on its rank: its data loader (its share of
    every epoch) and its frozen table."""
    data = MarkovTokens(cfg.model)
    sampler = ResumableSampler(data, shuffle=True, seed=cfg.seed, rank=rank, world_size=world)
    parts: dict[str, Any] = {
        "data": ResumableLoader(DataLoader(data, batch_size=cfg.batch, sampler=sampler, drop_last=True))
    }
    if cfg.frozen_mib > 0:
        parts["frozen"] = FrozenTable(int(cfg.frozen_mib * (1 << 20)), seed=cfg.seed, rank=rank)
    return parts


def snapshot_state(objs: dict[str, Any]) -> dict[str, Any]:
    """What memsnap captures: everything but the bookkeeping entries (``_world``)."""
    return {k: v for k, v in objs.items() if not k.startswith("_")}


def _batches(loader: ResumableLoader):
    while True:  # the loader moves on to the next epoch by itself when one runs out
        yield from loader


def _average_gradients(model: torch.nn.Module, world: int, all_reduce: Callable = dist.all_reduce) -> None:
    if world > 1:
        for p in model.parameters():
            if p.grad is not None:
                all_reduce(p.grad)
                p.grad /= world


def _global_mean(loss: torch.Tensor, world: int, all_reduce: Callable = dist.all_reduce) -> float:
    value = loss.detach().clone()
    if world > 1:
        all_reduce(value)
        value /= world
    return float(value)


def run(
    cfg: TrainConfig,
    rank: int,
    world: int,
    *,
    first_step: int = 0,
    objs=None,
    after_step: Callable[[int, dict], None] | None = None,
    attempt: int = 0,
    all_reduce: Callable = dist.all_reduce,
) -> dict[str, Any]:
    """Train steps ``first_step .. cfg.steps - 1``; ``after_step(step, objs)`` runs after each.
    ``all_reduce(tensor)`` sums a tensor across the ranks in place (``dist.all_reduce`` by
    default; the in-place recovery passes its re-formable group's, which runs the same gloo
    all-reduce on the same tensors, so the sums are bitwise the same)."""
    objs = objs or build(cfg, rank, world)
    model, optim, sched, parallel = objs["model"], objs["optim"], objs["sched"], objs["_world"]
    model.train()
    batches = _batches(objs["data"])
    for step in range(first_step, cfg.steps):
        x, y = next(batches)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        _average_gradients(model, parallel, all_reduce)
        optim.step()
        sched.step()
        mean = _global_mean(loss, world, all_reduce)
        if cfg.step_delay:
            time.sleep(cfg.step_delay)
        if rank == 0 and cfg.log_path:
            _log(
                cfg.log_path,
                {"step": step, "loss": mean.hex(), "attempt": attempt, "t": time.time(), "pid": os.getpid()},
            )
        if after_step is not None:
            after_step(step, objs)
    if cfg.log_path and first_step < cfg.steps:  # every rank: its frozen table is its own
        _log(cfg.log_path, {"final": state_digest(objs), "rank": rank, "t": time.time()})
    return objs


def state_digest(objs: dict[str, Any]) -> str:
    """xxh3-64 over every parameter's bytes, in order, then the frozen table's (if any):
    equal digests, bitwise-equal weights and frozen state."""
    import xxhash

    h = xxhash.xxh3_64()
    tensors = [p.detach() for p in objs["model"].parameters()]
    if "frozen" in objs:
        tensors.append(objs["frozen"].table)
    for t in tensors:
        h.update(memoryview(t.contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()


def _log(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def read_log(path: str) -> dict[int, float]:
    """step -> loss, the last attempt's value winning (a resumed run repeats no step it kept)."""
    losses: dict[int, float] = {}
    if not os.path.exists(path):
        return losses
    with open(path) as f:
        for line in f:
            r = json.loads(line) if line.strip() else {}
            if "step" in r:
                losses[r["step"]] = float.fromhex(r["loss"])
    return losses


def read_final(path: str) -> dict[int, str]:
    """rank -> the digest of its final state (``state_digest``) the run logged; a rank that
    did not finish is missing."""
    final: dict[int, str] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line) if line.strip() else {}
                if "final" in r:
                    final[r.get("rank", 0)] = r["final"]
    return final
