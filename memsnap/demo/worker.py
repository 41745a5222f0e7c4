"""The demo's ``train_loop_per_worker``: restore, train, snapshot every step, report events."""
from __future__ import annotations

import json
import os
import time

from memsnap.demo.train import TrainConfig, build, run, snapshot_state


def event(path: str, **record) -> None:
    """Append one event (worker start, restore, ...) to the demo's event log."""
    record["t"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_loop_per_worker(config: dict) -> None:
    import ray

    from memsnap.integrations.ray_train import from_ray_train

    cfg = TrainConfig.from_json(config["train"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    event(config["events"], ev="start", rank=rank, node=node, pid=os.getpid())
    objs = build(cfg, rank, world)
    snap = from_ray_train(config["job"], **config["snapshotter"])
    t0 = time.perf_counter()
    restored = snap.restore(snapshot_state(objs))
    last = snap.status()["last_restore"]
    event(config["events"], ev="restored", rank=rank, node=node, step=restored, tier=last["tier"],
          seconds=last["seconds"], wall=time.perf_counter() - t0)
    first = 0 if restored is None else restored + 1

    def after_step(step: int, o: dict) -> None:
        snap.save(step, snapshot_state(o))

    run(cfg, rank, world, first_step=first, objs=objs, after_step=after_step,
        attempt=0 if restored is None else 1)
    if rank == 0:
        snap.wait(cfg.steps - 1, timeout=60)
        event(config["events"], ev="status", rank=rank, status=snap.status())
    snap.close()
