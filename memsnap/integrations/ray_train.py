"""memsnap inside a Ray Train ``TorchTrainer``: rank, world size and node from the Ray Train
context, and memsnap's spilled snapshots registered with Ray Train's checkpoint bookkeeping.

    def train_loop_per_worker(config):
        snap = memsnap.Snapshotter.from_ray_train(k=2, m=1, spill="s3://bucket/ckpt/{job}")
        start = snap.restore(state)
        for step in range(0 if start is None else start + 1, total):
            ...
            snap.save(step, state)

Ray Train restarts the worker group after a node dies (``FailureConfig(max_failures=...)``);
the new workers' ``restore`` then reads the lost node's state from its peers' RAM.
The job name defaults to one per run or trial (``memsnap.identity.run_identity``), so the trials of a Ray Tune
sweep never share snapshots; ``{job}`` in the spill URI gives each its own directory.
"""

from __future__ import annotations

import json
import os
import tempfile

POINTER_FILE = "memsnap.json"


def report(metrics: dict, *, spilled_uri: str | None = None, spilled_step: int | None = None) -> None:
    """``ray.train.report(metrics)``, attaching a checkpoint that *points at* a spilled memsnap
    step when one is given, so ``result.checkpoint`` names the last durable step. The pointer
    is a few bytes of JSON: snapshot bytes never go through Ray Train's storage.

    Ray Train's ``report`` is collective: every worker must call it with the same arguments.
    """
    import ray.train

    if spilled_uri is None or spilled_step is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="memsnap-ckpt-") as d:
        with open(os.path.join(d, POINTER_FILE), "w") as f:
            json.dump({"uri": spilled_uri, "step": int(spilled_step)}, f)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def spilled_step(checkpoint) -> tuple[str, int] | None:
    """The ``(uri, step)`` a Ray Train checkpoint made by :func:`report` points at."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        path = os.path.join(d, POINTER_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            doc = json.load(f)
    return doc["uri"], int(doc["step"])
