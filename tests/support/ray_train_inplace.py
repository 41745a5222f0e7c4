"""The training loop of the Ray Train in-place test: ``support.inplace_job``'s toy job under
``memsnap.integrations.ray_train_inplace.run``, recording in a store of the test's own (it
outlives the run's rendezvous store, which lives in Ray Train's controller) each process's
pid, each restore's tier and step, the first step after each restore, and the final digests."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

from support import inplace_job


class Recorded:
    """The in-place ``Context`` with the test's store as ``ctx.store``, its restores and the
    first step after each recorded."""

    def __init__(self, ctx, store):
        self._ctx, self.store = ctx, store

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def restore(self, state) -> int:
        start = self._ctx.restore(state)
        import psutil

        report = self._ctx._m._report.to_wire()
        times = {k: v for k, v in report.items() if k in ("assigned", "formed", "registered")}
        self.store.set(
            f"test/restored/{self._ctx.generation}/{self._ctx.rank}",
            json.dumps(
                {
                    "pid": os.getpid(),
                    "tier": report.get("tier"),  # "kept"/"live": nothing rolled back
                    "start": start,
                    "times": {**times, "process": psutil.Process().create_time(), "restored": time.time()},
                }
            ),
        )
        return start

    def save(self, step: int, state, **kwargs):
        out = self._ctx.save(step, state, **kwargs)
        self.store.compare_set(f"test/first_step/{self._ctx.generation}/{self._ctx.rank}", "", repr(time.time()))
        return out


def loop(config: dict) -> None:
    """``train_loop_per_worker``: ``config`` has ``store`` (host, port), ``steps``, ``options``."""
    import ray.train
    import torch.distributed as dist

    from memsnap.integrations.ray_train_inplace import run

    host, port = config["store"]
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    rank = ray.train.get_context().get_world_rank()
    store.set(f"test/pid/{rank}", str(os.getpid()))
    store.set(f"test/node/{rank}", ray.get_runtime_context().get_node_id())
    inner = inplace_job.make_train(config["steps"], step_s=config.get("step_s", 0.05))

    def train(ctx, state):
        return inner(Recorded(ctx, store), state)

    result = run(inplace_job.setup, train, **config["options"])
    store.set(f"test/final/{rank}", json.dumps({**(result or {}), "pid": os.getpid()}))
