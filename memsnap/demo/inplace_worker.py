"""One member of the demo's in-place job (``memsnap.inplace.InplaceJob``): ``setup`` builds the
model, optimizer and data loader once per process (ranks and the warm standby alike);
``train`` runs once per generation: restore (a survivor from its own node's RAM, the standby
from its peers'), then the same training loop as the Ray Train path, its sums through the
job's re-formable process group."""

from __future__ import annotations

import os
import time

from memsnap.demo.train import TrainConfig, build, rank_parts, run, snapshot_state
from memsnap.demo.worker import event, failure_due, hold_for_failure, spill_final


def setup(config: dict, ctx) -> dict:
    """The whole state, built before any rank is known (a standby does not know which rank it
    will take): built as rank 0; ``train`` points the data loader at the member's own rank."""
    cfg = TrainConfig.from_json(config["train"])
    objs = build(cfg, 0, config["world"], ddp=True)
    objs["_rank"] = 0
    return objs


def _own_rank(cfg: TrainConfig, objs: dict, rank: int, world: int) -> None:
    """A member that takes a rank other than the one its state was built as gets that rank's
    data loader and frozen table (the restore then sets both to the rank's snapshot)."""
    if objs["_rank"] != rank:
        objs.update(rank_parts(cfg, rank, world))
        objs["_rank"] = rank


def train(config: dict, ctx, objs: dict) -> str:
    """One generation: roll back, train to the end; returns the final state's digest."""
    import ray

    from memsnap.demo.train import state_digest
    from memsnap.state.capture import plan

    cfg = TrainConfig.from_json(config["train"])
    rank, world, snap = ctx.rank, ctx.world_size, ctx.snapshotter
    _own_rank(cfg, objs, rank, world)
    node = ray.get_runtime_context().get_node_id()
    event(config["events"], ev="start", rank=rank, node=node, pid=os.getpid(), gen=ctx.generation)
    t0 = time.perf_counter()
    first = ctx.restore(snapshot_state(objs))
    last = snap.status()["last_restore"]
    event(
        config["events"],
        ev="restored",
        rank=rank,
        node=node,
        step=first - 1 if first else None,
        tier=last["tier"],
        seconds=last["seconds"],
        wall=time.perf_counter() - t0,
        nbytes=plan(snapshot_state(objs)).nbytes,
        gen=ctx.generation,
        pid=os.getpid(),
    )

    def after_step(step: int, o: dict) -> None:
        ctx.save(step, snapshot_state(o), force=step == cfg.steps - 1)  # the last step waits for a busy pipeline
        if failure_due(config, step):
            hold_for_failure(snap, step, rank, config)

    run(
        cfg,
        rank,
        world,
        first_step=first,
        objs=objs,
        after_step=after_step,
        attempt=ctx.generation or 0,
        all_reduce=ctx.all_reduce,
    )
    if rank == 0:
        spill_final(snap, config, rank, cfg.steps - 1)  # for the demo's comparison with a restore from disk
        event(config["events"], ev="status", rank=rank, status=snap.status())
    return state_digest(objs)
