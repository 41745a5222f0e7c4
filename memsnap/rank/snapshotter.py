"""``Snapshotter``: the user API of one rank — save, restore, status, close.

The rank side is ``memsnap.rank``: this module (the API and the restore loop), ``save.py``
(a snapshot's capture into the agent), ``load.py`` (the load tiers), ``client.py`` (every
call to the node's agent, returning records), ``maps.py`` (the arena mappings) and
``job.py`` (job-wide calls).

Call protocol (every rank of the job, each in its own Ray worker or driver):

  1. ``snap = Snapshotter(job=..., rank=r, world_size=n, ...)`` — finds or creates the job's
     coordinator and this node's agent, registers the rank under its run id (``run=``, else
     the launcher's, else the job's; see ``memsnap.identity``): a rank of another run that still
     runs under the same job name is refused (``JobInUseError``).
  2. ``snap.restore(state)`` at start (collective: every rank calls it) -> the restored step
     or None.
  3. ``snap.save(step, state)`` after every step; the policy decides which steps are
     snapshotted (a skipped step costs two comparisons). A snapshot returns once the bytes are
     in the agent's RAM (encoding, sending and the commit run in the background). A snapshot
     that fails is logged and counted and training goes on (``on_error="raise"`` to stop).
     After a preemption notice (SIGTERM, or Ray draining the node) the next ``save`` takes a
     last snapshot, spills it unthrottled and exits the process cleanly (``SystemExit(0)``).
  4. ``snap.status()`` any time; ``snap.close()`` at the end (agents stay up; see ``shutdown``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ray

from memsnap import actors, identity, metrics
from memsnap.config import tunable
from memsnap.errors import ConfigError, MemsnapError
from memsnap.options import Device, Failures, Memory, Protection, Spill, When, Wire, resolve
from memsnap.policy import Policy, Scheduler, StalenessGuard
from memsnap.rank.client import AgentClient
from memsnap.rank.job import check_same_job, ensure_ray, job_config
from memsnap.rank.load import Loader
from memsnap.rank.maps import ArenaMaps
from memsnap.rank.save import Capture
from memsnap.records import LastRestore, RankPlan, RankRestore
from memsnap.secret import job_secret

if TYPE_CHECKING:
    from memsnap.collective.plan import SharedPlan
    from memsnap.preempt import PreemptionWatcher

log = logging.getLogger("memsnap")


class Snapshotter:
    """Snapshots of one rank's ``state`` into the job's erasure-coded RAM tier (and spill)."""

    def __init__(
        self,
        job: str,
        rank: int,
        world_size: int,
        *,
        protection: Protection | None = None,
        memory: Memory | None = None,
        spill: Spill | str | None = None,
        when: When | None = None,
        failures: Failures | None = None,
        wire: Wire | None = None,
        device: Device | None = None,
        optimizers=(),
        run: str | None = None,
        **shorthand: Any,
    ):
        """Options come in groups (``memsnap.options``: ``protection``, ``memory``, ``spill``,
        ``when``, ``failures``, ``wire``), or as their flat shorthand keywords (``k=2, m=1,
        spill="s3://...", spill_every=100, every_steps=1, on_error="raise"``, ...).
        ``optimizers``: for CUDA state, the optimizers whose step must wait for the side-stream copy.
        ``run``: this run's id, the same on every rank and every restart of the run (default
        ``MEMSNAP_RUN_ID`` or torchrun's ``TORCHELASTIC_RUN_ID``; without one the job's run id,
        made at its first registration, is taken): a rank of another run that still runs
        under ``job`` is refused."""
        opts = resolve(
            {
                "protection": protection,
                "memory": memory,
                "spill": spill,
                "when": when,
                "failures": failures,
                "wire": wire,
                "device": device,
            },
            shorthand,
        )
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r}: must be an int >= 1")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank!r}: must be an int in [0, world_size={world_size})")
        wh, fail, wi = opts["when"], opts["failures"], opts["wire"]
        self.options = opts
        self.config = job_config(job, opts)
        if not ray.is_initialized():
            raise ConfigError("Snapshotter needs Ray: create it inside a Ray task/actor or after ray.init()")
        self.rank, self.world = rank, world_size
        claim = identity.Claim(identity.check_run(run) or identity.run_from_env(), identity.process_token())
        self.node = ray.get_runtime_context().get_node_id()
        secret = job_secret(job)  # made first if need be: a new agent reads it from Ray's key-value store
        # every call goes to this node's agent, which speaks to the coordinator for the node
        self.client = AgentClient(actors.agent_for(self.config, self.node), rank)
        check_same_job(self.config, self.client.config())
        self.run: str | None = self.client.join(world_size, claim.to_wire()).run  # the run id it registered under
        self._local: list[int] | None = None
        self.peers: bool | None = None  # decided by the coordinator from the job's node count
        maps = ArenaMaps()
        self.capture = Capture(self.client, maps, job, world_size, opts["device"], optimizers)
        # A peer restore reads straight into this rank's tensors over TCP; through the object
        # store it goes through the agent, whose arena is backed early on a new node.
        self.loader = Loader(
            self.client,
            maps,
            self.config,
            world_size,
            secret,  # for this rank's own data-plane client (a peer restore)
            direct=wi.transport == "tcp" and bool(tunable("direct_restore")),
            device_restore=self._restore_device if opts["device"].on else None,
        )
        self._maps = maps
        self.counters = {"saves": 0, "failed_saves": 0, "skipped_saves": 0, "skipped_busy": 0}
        self.last_restore = LastRestore()  # the newest restore this rank took part in
        self.last_plan: RankPlan | None = None  # this rank's part of the last restore plan
        self.last_error: str | None = None
        self._policy = Scheduler(
            Policy(
                every_steps=wh.every_steps,
                every_seconds=wh.every_seconds,
                auto=wh.auto,
                mtbf_hours=wh.mtbf_hours,
                nodes=world_size,
            ),
            start_step=-1,
        )
        self._plan: SharedPlan | None = None  # steps named by rank 0 (an in-place job), else the policy's
        self._guard = (
            None
            if fail.max_staleness_steps is None
            else StalenessGuard(fail.max_staleness_steps, start_step=-1, setting="max_staleness_steps")
        )
        self._on_error = fail.on_error
        self._watcher = self._watch_preemption(fail.preemption_grace_s) if fail.preemption else None

    @classmethod
    def from_ray_train(cls, job: str | None = None, **kwargs: Any) -> Snapshotter:
        """A Snapshotter for this Ray Train worker (call inside ``train_loop_per_worker``): rank
        and world size from its Ray Train context, the run id from its run (a Tune trial's id),
        and, unless ``job`` names one, a job name of its own per run or trial
        (``identity.run_identity``), so trials of a sweep never share snapshots."""
        import ray.train

        from memsnap.identity import run_identity

        ctx = ray.train.get_context()
        name, run = run_identity(ctx)
        kwargs.setdefault("run", run)
        return cls(job=job or name, rank=ctx.get_world_rank(), world_size=ctx.get_world_size(), **kwargs)

    @classmethod
    def from_env(cls, job: str, **kwargs: Any) -> Snapshotter:
        """A Snapshotter for a torchrun process (``RANK``/``WORLD_SIZE``) or a single process.

        Connects to the Ray cluster in ``RAY_ADDRESS`` if Ray is not initialised yet, or starts
        a local one bound to 127.0.0.1."""
        import os

        ensure_ray()
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        return cls(job=job, rank=rank, world_size=world, **kwargs)

    def _watch_preemption(self, grace_s: float) -> PreemptionWatcher | None:
        from memsnap.preempt import PreemptionWatcher

        try:
            return PreemptionWatcher(
                lambda deadline: log.warning(
                    "rank %d: preemption notice (%.0f s left): the next save takes a last snapshot, "
                    "spills it and exits",
                    self.rank,
                    deadline,
                ),
                grace_seconds=grace_s,
                poll_seconds=tunable("preemption_poll_s"),
                node_id=self.node,
            ).start()
        except Exception as exc:  # never let the watcher stop training from starting
            log.warning("rank %d: preemption watcher not started: %s", self.rank, exc)
            return None

    def _local_ranks(self) -> list[int]:
        if self._local is None:
            members = self.client.members()
            self._local, self.peers = members.ranks, members.peers
            if not self.peers and self.rank == min(self._local, default=self.rank):
                log.warning(
                    "memsnap job %r: no peer protection on this node's ranks (%s)", self.config.job, members.why
                )
        return self._local

    # --- save --------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False) -> bool:
        """After finishing ``step``: snapshot ``state`` if the policy says so. Returns whether a
        snapshot was captured; the rest (encode, send, commit, spill) runs in the background.

        ``force=True`` (every rank, the same step: the last step of a run, say) snapshots
        whatever the policy says, and where the node's pipeline is busy waits for a slot (up
        to the ``forced_save_wait_s`` tunable) instead of skipping the step."""
        try:
            return self._save_if_due(step, state, force)
        finally:
            if self._plan is not None:
                self._plan.passed(step, self._policy)

    def _save_if_due(self, step: int, state: Mapping[str, Any], force: bool) -> bool:
        if self._watcher is not None and self._watcher.preempted:
            self._final_save(step, state)
        due = self._policy.due(step) if self._plan is None else self._plan.due(step, self._policy)
        if not force and not due:
            self.counters["skipped_saves"] += 1
            metrics.training_step(self.config.job, self.node, step, every_s=1.0)
            return False
        metrics.training_step(self.config.job, self.node, step)
        t = time.perf_counter()
        try:
            captured = self._save(step, state, tunable("forced_save_wait_s") if force else 0.0)
        except Exception as exc:
            self.counters["failed_saves"] += 1
            self.last_error = f"step {step}: {type(exc).__name__}: {exc}"
            self.client.report_failed(step, f"rank {self.rank}: {self.last_error}")
            if self._on_error == "raise":
                raise
            log.warning("rank %d: snapshot of step %d failed, training goes on: %s", self.rank, step, exc)
            self._check_staleness(step)
            return False
        if not captured:  # the node's pipeline was busy: skipped, not failed
            self.counters["skipped_busy"] += 1
            self._check_staleness(step)
            return False
        self._policy.taken(step, time.perf_counter() - t)
        metrics.capture_took(self.config.job, self.node, time.perf_counter() - t)
        self.counters["saves"] += 1
        self._check_staleness(step)
        return True

    def _check_staleness(self, step: int) -> None:
        if self._guard is not None:
            self._guard.check(step, self.client.wait(step, 0.0))

    def _save(self, step: int, state: Mapping[str, Any], wait_s: float = 0.0) -> bool:
        """Capture ``step`` into this node's agent (``save.Capture``); False when it skipped it."""
        return self.capture.take(step, state, self._local_ranks(), wait_s)

    def _restore_device(self, step: int, state, seconds: dict) -> bool:
        """Load ``step`` from the agent's device buffer; False: it does not hold it."""
        t = time.perf_counter()
        done = self.capture.device().restore(step, state)
        seconds["apply"] = time.perf_counter() - t
        return done

    def _final_save(self, step: int, state: Mapping[str, Any]) -> None:
        """Preemption: snapshot ``step``, commit it, spill it unthrottled, exit cleanly."""
        assert self._watcher is not None  # called on its notice
        left = max(1.0, self._watcher.seconds_left() or 30.0)
        deadline = time.monotonic() + 0.9 * left
        log.warning("rank %d: preempted; last snapshot of step %d, %.0f s left", self.rank, step, left)
        try:  # a busy pipeline is waited for, a third of the time left at most
            if not self._save(step, state, wait_s=(deadline - time.monotonic()) / 3):
                log.warning(
                    "rank %d: no slot freed for the last snapshot of step %d in time; spilling "
                    "the newest committed step instead",
                    self.rank,
                    step,
                )
        except Exception as exc:  # still spill the newest committed step and exit cleanly
            self.counters["failed_saves"] += 1
            self.last_error = f"step {step}: {type(exc).__name__}: {exc}"
            log.warning(
                "rank %d: last snapshot of step %d failed (%s); spilling the newest committed step instead",
                self.rank,
                step,
                exc,
            )
        self.capture.drain()
        committed = self.wait(step, timeout=max(1.0, deadline - time.monotonic()) / 2)
        if committed is not None and self.config.spill is not None:
            if self.spill(committed, timeout=max(0.0, deadline - time.monotonic())) is not None:
                log.warning("rank %d: step %d is spilled to %s", self.rank, committed, self.config.spill)
            else:
                log.warning("rank %d: step %d was not spilled before the deadline", self.rank, committed)
        self.close()
        raise SystemExit(0)

    def spill(self, step: int | None = None, timeout: float = 300.0) -> int | None:
        """Write committed ``step`` (default: the newest) to the spill URI now, unthrottled, and
        wait until it is durable. Returns the step, or None if it was not durable in time.
        Any one rank may call it; the agents of every node write their ranks."""
        if self.config.spill is None:
            raise ConfigError("spill() needs a spill URI: Snapshotter(..., spill='file:///...' or 's3://...')")
        if step is None:
            step = self.client.wait(-1, 0.0)
            if step is None:
                return None
        self.client.request_spill(step)
        durable = self.client.wait_durable(step, timeout)
        return step if durable is not None and durable >= step else None

    def wait(self, step: int, timeout: float = 60.0) -> int | None:
        """Block until ``step`` (or a later one) is committed or failed; return the newest committed."""
        return self.client.wait(step, timeout)

    # --- restore -----------------------------------------------------------------------------
    def restore(self, state: Mapping[str, Any]) -> int | None:
        """(collective) Load the newest step every rank can load, through the fastest tier:
        the plan is the job's, one per round; a round in which any rank failed is tried again
        with the next plan (up to three). When a round succeeds, the agent has resumed its node
        from the round's step (uncommitted newer versions forgotten) before this returns."""
        t0 = time.perf_counter()
        error: Exception | None = None
        result = None
        for attempt in range(3):
            t = time.perf_counter()
            plan = self.client.restore_plan(attempt)
            seconds = {"plan": time.perf_counter() - t}
            try:
                tier = self.loader.load(plan, state, seconds)
                report = RankRestore.loaded(tier, seconds, self.loader.repaired, self.loader.rebuild)
            except Exception as exc:
                log.warning("rank %d: restore of step %s failed: %s", self.rank, plan.step, exc)
                report, tier = RankRestore.failed(exc, self.loader.repaired), None
                error = exc
            t = time.perf_counter()
            result = self.client.restore_done(attempt, report)
            seconds["done"] = time.perf_counter() - t  # until every rank of the round loaded
            if result.ok and self.loader.dirty and plan.tier == "none":
                raise MemsnapError(
                    f"rank {self.rank}: the live state was partly written (a read from peers or an "
                    "in-place takeover failed halfway), and no copy can be loaded; rebuild the state and "
                    "call restore again"
                )
            if result.ok:
                self.loader.dirty = False
                self._ready_slots(state)
                seconds["total"] = time.perf_counter() - t0
                assert tier is not None  # the round is ok only when every rank loaded
                return self._restored(plan, tier, seconds)
        raise (
            error
            if error is not None
            else MemsnapError(f"restore failed on ranks {sorted(result.failed) if result else []}: {result}")
        )

    def _ready_slots(self, state) -> None:
        """Have the agent make and back this rank's arena slots now, in the background, so that
        the first saves do not pay for fresh pages (the layout is planned here once anyway)."""
        try:
            self.client.ready_slots(self.capture.nbytes(state))
        except Exception as exc:  # only a head start: the first saves make what is missing
            log.info("rank %d: arena slots not made ahead: %s", self.rank, exc)

    def state_written(self) -> None:
        """The live tensors were partly written outside a restore (an in-place takeover that was
        refused halfway): the next ``restore`` must load a snapshot into them, and raises where
        none can be loaded instead of handing them back for a fresh start."""
        self.loader.dirty = True

    def steer(self, plan: SharedPlan | None, after: int | None = None) -> None:
        """Let ``plan`` name the steps to snapshot instead of this rank's own policy (None: the
        policy again): every rank of an in-place generation follows rank 0's scheduler
        (``collective.plan``); the generation trains from the step after ``after``."""
        self._plan = plan
        if plan is not None:
            plan.start(self._policy, after)

    def recovered(self, total: int, rolled_back: int, age_s: float | None = None) -> None:
        """The job has recovered in place ``total`` times, ``rolled_back`` of them by rolling
        back to a snapshot, and has run ``age_s`` seconds (``memsnap.inplace`` tells every rank
        the same): with ``auto``, each recovery counts as a failure and the interval is set
        against the failures that roll back (``policy.Scheduler.set_recoveries``)."""
        self._policy.set_recoveries(total, rolled_back, age_s)

    def _restored(self, plan: RankPlan, tier: str, seconds: dict) -> int | None:
        # a durable step names the run that spilled it (its COMMITTED metadata)
        run = self.loader.durable_run if plan.plan == "durable" or tier == "durable" else None
        self.last_restore = LastRestore(tier, plan.step, dict(seconds), run)
        self.last_plan = plan
        metrics.restored(self.config.job, self.node, tier, seconds.get("total", 0.0))
        resumed = -1 if plan.step is None else plan.step
        self._policy.resume(resumed)
        if self._guard is not None:
            self._guard.start_step = resumed
        if plan.plan == "durable":
            msg = (
                f"memsnap: restored step {plan.step} from durable storage {plan.spill}"
                f"{f' (spilled by run {run!r})' if run else ''}: the RAM tiers could not serve every rank"
            )
            self.last_restore = dataclasses.replace(self.last_restore, warning=msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.info(
            "rank %d restored step %s from %s in %s",
            self.rank,
            plan.step,
            tier,
            {k: round(v, 3) for k, v in seconds.items()},
        )
        return plan.step

    # --- status / close ------------------------------------------------------------------------
    def status(self) -> dict:
        """JSON-serialisable state of the job's snapshots, as this rank sees it."""
        st = self.client.job_status()
        agents_ = st.pop("agents")
        st["bytes"] = {
            "local": sum(a["arena"] for a in agents_.values()),
            "peer": sum(a["held"] + a["parity"] for a in agents_.values()),
            "durable_step": st["durable_step"],
        }
        st["agents"] = agents_
        st["failed_snapshots"] += sum(a["counters"]["failed_snapshots"] for a in agents_.values())
        st["failed_saves"] = self.counters["failed_saves"]
        st["skipped_busy"] = st["skipped_snapshots"]  # steps skipped or replaced under load, job-wide
        st["last_restore"] = self.last_restore.to_wire()
        return st

    def close(self) -> None:
        """Finish a pending GPU copy, stop the preemption watcher, drop this rank's mappings
        and its data-plane client (the agents keep the snapshots)."""
        self.capture.close()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self._maps.close()
        self.loader.close()
