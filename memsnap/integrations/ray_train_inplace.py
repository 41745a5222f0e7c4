"""In-place recovery inside a Ray Train ``TorchTrainer``: Ray Train replaces only the lost
worker; the surviving workers keep their processes and go on, bitwise as if nothing had been
lost: where the workers are replicas (data parallel) the new worker takes the survivors' live
state and nothing is rolled back, otherwise every worker rolls back in place (survivors from
their own node's RAM, the new worker from its peers).

    from memsnap.integrations.ray_train_inplace import InplaceTorchConfig, run

    def train_loop_per_worker(config):
        run(setup, train, k=1, m=1, every_steps=1)   # setup(ctx) -> state; train(ctx, state)

    TorchTrainer(train_loop_per_worker, torch_config=InplaceTorchConfig(),
                 scaling_config=ScalingConfig(num_workers=4),
                 run_config=RunConfig(failure_config=FailureConfig(max_failures=3))).fit()

``setup`` and ``train`` are those of ``memsnap.inplace.InplaceJob`` (the same ``Context``:
``ctx.restore``, ``ctx.save``, ``ctx.average_gradients``, ``ctx.all_reduce``, ``ctx.ddp``,
``ctx.store``). ``setup`` runs once per process; ``train`` once per generation.

How it works: the backend (``InplaceTorchConfig``) declares replica groups of one worker
each, so Ray Train's controller replaces only a failed worker (not the whole group) when
the others still run. It runs in Ray Train's controller process and hosts the job's
rendezvous store there (no worker's loss takes it), writes each generation's membership
(``memsnap.rank.member``), with the recoveries before it, which of them rolled back (from the
members' reports) and the job's age, which every rank's ``auto`` interval reads, and, instead of Ray Train's own ``init_process_group``, leaves
the process group to the workers' ``RecoverableGroup``, which forms it again per generation.
On a replacement it ends the current generation for the survivors (those blocked in a
collective get out at once), fences the lost worker's node if its memsnap agent is silent,
and writes the next generation with the same ranks: the new worker takes the lost rank (from
the survivors' live state, or restored from its peers). A restart of the whole group (every worker failed) is a new
generation of new processes, restored the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ray.train.backend import BackendConfig
from ray.train.torch.config import TorchConfig, _TorchBackend

if TYPE_CHECKING:
    from memsnap.collective.report import MemberReport

log = logging.getLogger("memsnap.inplace")

STORE_ENV = "MEMSNAP_INPLACE_STORE"  # host:port of the rendezvous store
JOB_ENV = "MEMSNAP_INPLACE_JOB"
GEN_ENV = "MEMSNAP_INPLACE_GEN"  # the first generation this worker is a member of
MEMBER_ENV = "MEMSNAP_INPLACE_MEMBER"  # this worker's member name (one per process)
NODE_ENV = "MEMSNAP_INPLACE_CONTROLLER_NODE"  # where the coordinator runs
BACKEND_ENV = "MEMSNAP_INPLACE_BACKEND"
TIMEOUT_ENV = "MEMSNAP_INPLACE_BACKEND_TIMEOUT_S"


@dataclasses.dataclass
class InplaceTorchConfig(TorchConfig):
    """``TorchConfig`` for memsnap's in-place recovery (``torch_config=InplaceTorchConfig()``).

    ``job``: the memsnap job name (default: one per trainer run, the run's name and id, as
    ``Snapshotter.from_ray_train`` names it); ``backend``: the process
    group's backend (gloo on CPU, as Ray Train picks by default); ``group_timeout_s``: the
    backend's own timeout for a collective nobody reported failed (a lost worker's
    survivors are told at once, long before it)."""

    job: str | None = None
    group_timeout_s: float = 60.0

    @property
    def backend_cls(self):
        return _InplaceBackend


def _run_job_name(worker_group) -> str:
    """The job name ``Snapshotter.from_ray_train`` gives this run (its name and id), read from
    the worker group Ray Train starts first; a name of its own where that cannot be read."""
    from types import SimpleNamespace

    from memsnap.identity import run_identity

    run: Any = getattr(worker_group, "_train_run_context", None)  # Ray Train v2's, private
    try:
        return run_identity(SimpleNamespace(get_experiment_name=lambda: run.run_config.name), lambda: str(run.run_id))[
            0
        ]
    except Exception:  # noqa: BLE001 (not readable: any failure means a name of our own)
        return f"raytrain-{uuid.uuid4().hex[:8]}"


def _set_env(values: dict[str, str]) -> None:
    """On a worker, before its training function runs: memsnap's variables, and RANK,
    WORLD_SIZE, LOCAL_RANK... as Ray Train's torch backend sets them (without its process group)."""
    os.environ.update(values)
    try:
        from ray.train.torch.config import _set_torch_distributed_env_vars
    except ImportError:  # a private helper of Ray Train's: the variables are a courtesy
        return
    _set_torch_distributed_env_vars()


class _InplaceBackend(_TorchBackend):
    """Runs in Ray Train's controller: ``on_start`` with the whole worker group at the start
    (and on a full restart), with one replica group (one worker) on a replacement."""

    has_replica_groups: bool = True

    def __init__(self) -> None:
        super().__init__()
        self.store: Any = None  # the rendezvous store's master, for the run's whole life
        self.job: str | None = None
        self.gen = -1
        self.world = 0
        self.members: dict[int, str] = {}  # world rank -> member name
        self.nodes: dict[int, str] = {}  # world rank -> Ray node id
        self.started: float | None = None  # the first generation was written (monotonic clock)
        self.reports: dict[
            int, dict[int, MemberReport]
        ] = {}  # generation -> rank -> its member's report, as read so far

    def _ensure_store(self, config: BackendConfig, worker_group) -> None:
        if self.store is not None:
            return
        import ray
        import torch.distributed as dist

        self.job = getattr(config, "job", None) or _run_job_name(worker_group)
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        self.controller_node = ray.get_runtime_context().get_node_id()
        log.info("memsnap job %r: rendezvous store at %s:%d", self.job, host, self.store.port)

    def on_start(self, worker_group, backend_config: BackendConfig):
        import ray
        from ray.train.v2._internal.execution.worker_group import ReplicaGroup

        from memsnap.collective.assignment import Assignment, fenced_key, gen_key

        if not hasattr(worker_group, "get_workers"):
            raise RuntimeError(
                "InplaceTorchConfig needs Ray Train v2 (RAY_TRAIN_V2_ENABLED=1): Ray Train v1 "
                "restarts the whole worker group after a failure"
            )
        # Ray Train's controller calls its backend from one thread (start, replacements, shutdown)
        self._ensure_store(backend_config, worker_group)
        assert self.job is not None
        workers = worker_group.get_workers()
        if self.gen >= 0:  # a replacement (or a full restart): the generation is over
            self._end_generation(
                f"worker(s) {sorted(w.distributed_context.world_rank for w in workers)} replaced by Ray Train", workers
            )
        self.gen += 1
        if not isinstance(worker_group, ReplicaGroup):  # the whole group: every rank is new
            self.members.clear()
            self.nodes.clear()
        for w in workers:
            rank = w.distributed_context.world_rank
            self.world = w.distributed_context.world_size
            self.members[rank] = f"w{rank}g{self.gen}"
            self.nodes[rank] = w.metadata.node_id
        # the new workers learn where and who they are before their training function runs
        refs = [
            worker_group.execute_single_async(
                i,
                _set_env,
                {
                    STORE_ENV: f"{self.store.host}:{self.store.port}",
                    JOB_ENV: self.job,
                    GEN_ENV: str(self.gen),
                    MEMBER_ENV: self.members[w.distributed_context.world_rank],
                    NODE_ENV: self.controller_node,
                    BACKEND_ENV: getattr(backend_config, "backend", None) or "gloo",
                    TIMEOUT_ENV: str(getattr(backend_config, "group_timeout_s", 60.0)),
                },
            )
            for i, w in enumerate(workers)
        ]
        ray.get(refs, timeout=120)
        members = {name: rank for rank, name in self.members.items()}
        recoveries, rollbacks, age = self._history()
        self.store.set(
            gen_key(self.job, self.gen), Assignment(self.world, members, False, recoveries, rollbacks, age).to_json()
        )
        self.store.set(fenced_key(self.job, self.gen), "1")  # (the lost nodes were fenced above)
        (log.warning if self.gen else log.info)("memsnap job %r: generation %d: %s", self.job, self.gen, members)

    def _history(self) -> tuple[int, int, float]:
        """For the generation being written: the job's recoveries before it (each generation
        after the first followed one), how many of those rolled back (from the members' reports
        of the generation each formed, as ``InplaceJob``'s controller reads them) and the job's
        age in seconds: every rank's ``auto`` interval is set from them."""
        from memsnap.collective.report import read_reports, rolled_back

        assert self.job is not None
        now = time.monotonic()
        if self.started is None:
            self.started = now
        rollbacks = 0
        for gen in range(1, self.gen):
            reports = read_reports(self.store, self.job, gen, self.world, self.reports.setdefault(gen, {}))
            rollbacks += rolled_back(reports.values())
        return max(self.gen - 1, 0), rollbacks, now - self.started

    def on_shutdown(self, worker_group, backend_config):
        """A replica group is shut down before it is replaced (its worker may be dead): its
        generation is over, which the survivors learn now rather than when the new worker
        starts. The whole group's shutdown (the end of the run) needs nothing."""
        from ray.train.v2._internal.execution.worker_group import ReplicaGroup

        if isinstance(worker_group, ReplicaGroup) and self.store is not None:
            self._end_generation("a worker failed", worker_group.get_workers())

    def _end_generation(self, why: str, lost) -> None:
        """Tell the current generation's members it is over; let the coordinator fence the
        lost workers' nodes whose agent is silent and leave any restore round in flight."""
        from memsnap.collective.group import failed_key, publish_failure

        assert self.job is not None
        if self.store.check([failed_key(self.job, self.gen)]):
            return  # told already (the replica group's shutdown came first)
        publish_failure(self.store, self.job, self.gen, f"Ray Train: {why}")
        try:
            self._fence(why, lost)
        except Exception as exc:  # the coordinator learns of the loss from its agents anyway
            log.warning("memsnap job %r: the coordinator was not told of the loss: %s", self.job, exc)

    def _fence(self, why: str, lost) -> None:
        import ray

        from memsnap import naming
        from memsnap.inplace.controller import silent_nodes

        assert self.job is not None
        try:
            coord = ray.get_actor(naming.coordinator(self.job), namespace=naming.NAMESPACE)
        except ValueError:
            return  # no rank registered yet
        lost_ranks = {w.distributed_context.world_rank for w in lost if w.distributed_context is not None}
        live = {node for rank, node in self.nodes.items() if rank not in lost_ranks}
        candidates = sorted({self.nodes[r] for r in lost_ranks if r in self.nodes} - live)
        for node in silent_nodes(self.job, candidates, 0.5):
            ray.get(coord.node_lost.remote(node, why), timeout=60)
        ray.get(coord.cancel_restore.remote(why), timeout=60)


def run(setup: Callable, train: Callable, *, live_takeover: str = "verified", **snapshot_options: Any):
    """This worker's part of an in-place job (call it in ``train_loop_per_worker``, under a
    ``TorchTrainer`` with ``torch_config=InplaceTorchConfig()``): ``setup(ctx)`` once, then
    ``train(ctx, state)`` for each generation this process is a member of. What ``train``
    returned, or None where this process was left out of the job (replaced).
    ``live_takeover``: as ``InplaceJob``'s (replicas go on from the survivors' live state)."""
    import ray.train

    from memsnap.identity import run_identity
    from memsnap.inplace.controller import pin_coordinator
    from memsnap.rank.member import Member

    missing = [k for k in (STORE_ENV, JOB_ENV, GEN_ENV, MEMBER_ENV) if k not in os.environ]
    if missing:
        raise RuntimeError(
            "memsnap.integrations.ray_train_inplace.run needs a TorchTrainer with "
            f"torch_config=InplaceTorchConfig() (no {', '.join(missing)} here)"
        )
    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    job, name = os.environ[JOB_ENV], os.environ[MEMBER_ENV]
    ctx = ray.train.get_context()
    options = dict(snapshot_options)
    options.setdefault("run", run_identity(ctx)[1])
    node = os.environ.get(NODE_ENV)
    if node:  # beside the store, on no worker's node (so no worker node's loss takes it)
        pin_coordinator(job, options, ctx.get_world_size(), node)
    member = Member(
        job,
        name,
        (host, int(port)),
        setup,
        train,
        options,
        backend=os.environ.get(BACKEND_ENV, "gloo"),
        backend_timeout_s=float(os.environ.get(TIMEOUT_ENV, "60")),
        watch_preemption=False,
        live_takeover=live_takeover,
    )
    try:
        member.prepare()
        out = member.run(first_gen=int(os.environ[GEN_ENV]))
    finally:
        member.close()
    if out["outcome"] == "finished":
        return out["result"]
    log.warning("member %s: %s (the job goes on without this process)", name, out["outcome"])
    return None
