"""Shared pieces of the runtime tests: a training actor per node and a loopback cluster fixture.

(No tests here: the ``test_runtime_*`` modules import it.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from functools import partial

import ray
import torch
import xxhash

from memsnap.localcluster import LocalCluster, wait_for
from memsnap.memory import shmdir
from support import states

FEATURES = 256
# A ~6 MiB state (after one step): MLP weights, AdamW moments, an LR schedule.
make_state = partial(states.make_state, widths=(FEATURES, 1024, FEATURES), sched=True)
train_step = partial(states.train_step, batch=16)


def digest(state: dict, rng: bool = True) -> str:
    """One hash over the parameters, the optimizer's tensors, the schedule (when the state has
    one) and, with ``rng``, this process's torch RNG: equal iff bitwise equal."""
    h = xxhash.xxh3_64()
    for t in state["model"].state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for per_param in state["optim"].state_dict()["state"].values():
        for v in per_param.values():
            h.update(v.contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    if "sched" in state:
        h.update(repr(sorted(state["sched"].state_dict().items())).encode())
    if rng:
        h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


class _Extra(torch.nn.Module):
    def __init__(self, nbytes: int):
        super().__init__()
        self.blob = torch.nn.Parameter(torch.zeros(nbytes // 4), requires_grad=False)


@ray.remote(num_cpus=0)
class Trainer:
    """One rank: its own state and Snapshotter, on the node it was pinned to."""

    def __init__(self, job: str, rank: int, world: int, seed: int, opts: dict):
        from memsnap.rank import Snapshotter

        self.state = make_state(seed)
        self.snap = Snapshotter(job=job, rank=rank, world_size=world, **opts)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def step_and_save(self, step: int) -> str:
        train_step(self.state)
        self.snap.save(step, self.state)
        return digest(self.state)

    def save(self, step: int) -> str:
        self.snap.save(step, self.state)
        return digest(self.state)

    def save_too_big(self, step: int) -> str:
        """Try to save the state plus a tensor larger than the memory budget; return the error."""
        big = dict(self.state, extra=_Extra(300 << 20))
        try:
            self.snap.save(step, big)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "saved"

    def save_and_die(self, step: int) -> None:
        """Die in the middle of capturing ``step`` (half the bytes written)."""
        import memsnap.state.capture as capture

        def half(manifest, sources, out):
            view = memoryview(out).cast("B")
            view[: len(view) // 2] = b"\x5a" * (len(view) // 2)
            os._exit(1)

        capture.copy_into = half
        train_step(self.state)
        self.snap.save(step, self.state)

    def wait(self, step: int, timeout: float = 60.0):
        return self.snap.wait(step, timeout)

    def restore(self) -> tuple:
        step = self.snap.restore(self.state)
        return step, digest(self.state), self.snap.last_restore.to_wire()

    def digest(self) -> str:
        return digest(self.state)

    def status(self) -> dict:
        return self.snap.status()


def start_trainer(job: str, rank: int, world: int, node_index: int, opts: dict, seed: int | None = None):
    trainer = Trainer.options(resources={f"memsnap_node_{node_index}": 0.01}).remote(  # type: ignore[attr-defined]  # @ray.remote makes an ActorClass; ray's annotation keeps the bare class
        job, rank, world, rank if seed is None else seed, opts
    )
    ray.get(trainer.node.remote(), timeout=120)
    return trainer


def start_all(job: str, nodes: list[int], opts: dict, seed_offset: int = 0) -> list:
    """One trainer per node index (rank i on ``nodes[i]``), created together so they register together."""
    world = len(nodes)
    trainers = [
        Trainer.options(resources={f"memsnap_node_{n}": 0.01}).remote(job, r, world, r + seed_offset, opts)  # type: ignore[attr-defined]  # @ray.remote makes an ActorClass; ray's annotation keeps the bare class
        for r, n in enumerate(nodes)
    ]
    ray.get([t.node.remote() for t in trainers], timeout=180)
    return trainers


def restore_all(trainers: list, timeout: float = 240) -> list[tuple]:
    return ray.get([t.restore.remote() for t in trainers], timeout=timeout)


def kill(actor) -> None:
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


def node_dead(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and not n["Alive"] for n in ray.nodes())


def lose_nodes(c, node_ids: list[str]) -> None:
    """Kill the nodes ``node_ids`` of cluster ``c`` abruptly; return once Ray declared them dead."""
    for n in [n for n in c.nodes if n.node_id in node_ids]:
        c.kill_node(n)
    wait_for(
        lambda: all(node_dead(n) for n in node_ids),
        timeout=60,
        what=f"{len(node_ids)} killed node(s) to be declared dead",
    )


def remove_arenas(job: str) -> None:
    """Unlink ``job``'s shared-memory files (those of killed nodes' agents stay behind otherwise)."""
    shmdir.remove_job(job)


@contextlib.contextmanager
def cluster(job: str, nodes: int, system_config: dict | None = None):
    """A loopback cluster of ``nodes`` for one test module; torn down (and /dev/shm cleaned) after.
    ``system_config``: Ray system config keys for the head (e.g. a short metrics report interval)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: workers import support.*
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    c = LocalCluster(nodes=nodes, cpus_per_node=1, object_store_mb=96, system_config=system_config)
    try:
        yield c
    finally:
        with contextlib.suppress(Exception):
            from memsnap.rank import shutdown

            shutdown(job, timeout=10)
        c.close()
        remove_arenas(job)


@dataclass(frozen=True)
class JobSpec:
    """The job a test module runs on its own loopback cluster, named ``JOB_SPEC`` in the module:
    the shared ``job`` fixture (tests/conftest.py) starts it once per module (``running_job``).

    ``ranks``: one trainer per rank, rank ``i`` pinned to node ``ranks[i]`` (None: one per
    node; ``()``: none, the module starts its own). ``spill``: the spill directory, a path
    under the module's temporary directory (its first part is made, the rest left to the
    spill), added to ``opts`` as ``spill=``. ``env``: environment variables for the cluster's
    processes while it runs. ``system_config``: Ray system config keys for the head."""

    name: str
    nodes: int
    opts: dict = field(default_factory=dict)
    ranks: tuple[int, ...] | None = None
    spill: str | None = None
    env: dict = field(default_factory=dict)
    system_config: dict | None = None


@contextlib.contextmanager
def running_job(spec: JobSpec, tmp_path_factory):
    """``spec``'s cluster and trainers. Yields a dict: ``cluster``, ``trainers``, ``nodes``
    (their node ids), ``node_index`` (their node numbers), ``opts``, ``spill`` (its path, or
    None) and ``digests`` (empty: for the tests' own record)."""
    opts, spill = dict(spec.opts), None
    if spec.spill is not None:
        head, _, rest = spec.spill.partition("/")
        spill = str(tmp_path_factory.mktemp(head) / rest) if rest else str(tmp_path_factory.mktemp(head))
        opts["spill"] = spill
    ranks = list(range(spec.nodes)) if spec.ranks is None else list(spec.ranks)
    old = {k: os.environ.get(k) for k in spec.env}
    os.environ.update(spec.env)  # inherited by the cluster's workers
    try:
        with cluster(spec.name, spec.nodes, system_config=spec.system_config) as c:
            trainers = start_all(spec.name, ranks, opts) if ranks else []
            yield {
                "cluster": c,
                "trainers": trainers,
                "opts": opts,
                "spill": spill,
                "digests": {},
                "node_index": ranks,
                "nodes": ray.get([t.node.remote() for t in trainers], timeout=60),
            }
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = [
    "JobSpec",
    "running_job",
    "cluster",
    "remove_arenas",
    "start_all",
    "start_trainer",
    "restore_all",
    "kill",
    "node_dead",
    "lose_nodes",
    "wait_for",
    "shutil",
]
