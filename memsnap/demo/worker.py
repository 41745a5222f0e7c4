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


def gate_path(out: str, step: int) -> str:
    return os.path.join(out, f"failure-{step}.done")


def hold_for_failure(snap, step: int, rank: int, config: dict, timeout: float = 300.0) -> bool:
    """Inject the failure after ``step`` if ``step`` committed: tell the driver, then hold until
    it has killed a node and opened the gate. The kill thus lands right after a committed step
    however fast the steps run. Returns False (train on, try again after the next step) when
    ``step``'s snapshot failed; every rank gets the same answer from the coordinator."""
    committed = snap.wait(step, timeout=timeout)
    if committed is None or committed < step:
        return False
    event(config["events"], ev="at_failure_step", rank=rank, step=step)
    gate = gate_path(config["out"], step)
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: the demo driver did not inject the failure after step {step} within {timeout:.0f} s"
            )
        time.sleep(0.05)
    return True


def spill_final(snap, config: dict, rank: int, last: int) -> None:
    """Make the final step durable for the demo's restore from disk, and log what happened
    (an ``ev="final"`` event: the step committed, whether it became durable, the waits and the
    spill thread's status), so that a disk read of an older step says why."""
    t = time.monotonic()
    final = snap.wait(last, timeout=60)
    waited = time.monotonic() - t
    durable = snap.spill(final, timeout=120) if final is not None else None
    event(
        config["events"],
        ev="final",
        rank=rank,
        last=last,
        committed=final,
        durable=durable,
        wait_s=waited,
        spill_s=time.monotonic() - t - waited,
        spill={node: a.get("spill") for node, a in snap.status()["agents"].items()},
    )


def failure_due(config: dict, step: int) -> bool:
    """The first failure step not yet injected is ``step`` or earlier."""
    for f in config["failure_steps"]:
        if not any(os.path.exists(gate_path(config["out"], s)) for s in range(f, config["steps"])):
            return step >= f
    return False


def train_loop_per_worker(config: dict) -> None:
    import ray

    from memsnap.rank import Snapshotter
    from memsnap.state.capture import plan

    cfg = TrainConfig.from_json(config["train"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    event(config["events"], ev="start", rank=rank, node=node, pid=os.getpid())
    objs = build(cfg, rank, world)
    snap = Snapshotter.from_ray_train(config["job"], **config["snapshotter"])
    t0 = time.perf_counter()
    restored = snap.restore(snapshot_state(objs))
    last = snap.status()["last_restore"]
    wall = time.perf_counter() - t0
    event(
        config["events"],
        ev="restored",
        rank=rank,
        node=node,
        step=restored,
        tier=last["tier"],
        seconds=last["seconds"],
        wall=wall,
        nbytes=plan(snapshot_state(objs)).nbytes,
    )
    first = 0 if restored is None else restored + 1

    def after_step(step: int, o: dict) -> None:
        snap.save(step, snapshot_state(o), force=step == cfg.steps - 1)  # the last step waits for a busy pipeline
        if failure_due(config, step):
            hold_for_failure(snap, step, rank, config)

    run(cfg, rank, world, first_step=first, objs=objs, after_step=after_step, attempt=0 if restored is None else 1)
    if rank == 0:
        spill_final(snap, config, rank, cfg.steps - 1)  # for the demo's comparison with a restore from disk
        event(config["events"], ev="status", rank=rank, status=snap.status())
    snap.close()
