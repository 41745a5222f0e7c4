"""``Snapshotter``: the user API of one rank — save, restore, status, close.

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

import contextlib
import logging
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ray

from memsnap import actors, identity, metrics, naming
from memsnap.arena import Arena
from memsnap.config import SnapshotConfig, tcp_options, tunable
from memsnap.errors import ChecksumError, ConfigError, MemsnapError
from memsnap.manifest import Manifest
from memsnap.options import Device, Failures, Memory, Protection, Spill, When, Wire, resolve, resolve_options
from memsnap.policy import Policy, Scheduler, StalenessGuard
from memsnap.records import RankPlan
from memsnap.secret import job_secret

if TYPE_CHECKING:
    from memsnap.cuda_capture import SideStreamCapture
    from memsnap.preempt import PreemptionWatcher

log = logging.getLogger("memsnap")


def _unwrap(exc: BaseException) -> BaseException:
    """The memsnap error behind a Ray task error, so callers see the typed error."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, MemsnapError) else exc


def _get(ref, timeout: float | None = None):
    try:
        return ray.get(ref, timeout=timeout or tunable("call_timeout_s"))
    except ray.exceptions.RayTaskError as exc:
        raise _unwrap(exc) from None


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
        self._secret = job_secret(job)  # for this rank's own data-plane client (a peer restore)
        # every call goes to this node's agent, which speaks to the coordinator for the node
        self._agent = actors.agent_for(self.config, self.node)
        check_same_job(self.config, _get(self._agent.config.remote()))
        joined = _get(
            self._agent.join.remote(rank, world_size, claim.to_wire()),
            tunable("membership_timeout_s") + tunable("claim_wait_s") + 60,
        )
        self.run: str | None = joined.get("run")  # the run id this rank registered under
        # A peer restore reads straight into this rank's tensors over TCP; through the object
        # store it goes through the agent, whose arena is backed early on a new node.
        self._direct = wi.transport == "tcp" and bool(tunable("direct_restore"))
        self._receiver = None
        self._dirty = False  # a failed direct restore left the live state partly written
        self._local: list[int] | None = None
        self.peers: bool | None = None  # decided by the coordinator from the job's node count
        self._maps: dict[str, Arena] = {}
        from memsnap.capture import PlanCache

        self._plan = PlanCache()  # the layout is laid out again only when the tensors change
        self.counters = {"saves": 0, "failed_saves": 0, "skipped_saves": 0, "skipped_busy": 0}
        self.last_restore: dict = {"tier": "none", "step": None, "seconds": {}}
        self.last_plan: RankPlan | None = None  # this rank's part of the last restore plan
        self._durable_run: str | None = None  # the run that spilled the step a durable restore read
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
        self._guard = (
            None
            if fail.max_staleness_steps is None
            else StalenessGuard(fail.max_staleness_steps, start_step=-1, setting="max_staleness_steps")
        )
        self._on_error = fail.on_error
        self._optimizers = list(optimizers)
        self._cuda: SideStreamCapture | None = None
        self._pins: dict[str, Any] = {}
        self._device = None  # the device tier's rank side (memsnap.device.runtime), when device_buffer is on
        self._watcher = self._watch_preemption(fail.preemption_grace_s) if fail.preemption else None

    @classmethod
    def from_ray_train(cls, job: str | None = None, **kwargs: Any) -> Snapshotter:
        """A Snapshotter for this Ray Train worker (call inside ``train_loop_per_worker``): rank
        and world size from its Ray Train context, the run id from its run (a Tune trial's id),
        and, unless ``job`` names one, a job name of its own per run or trial
        (``integrations.ray_train.run_identity``), so trials of a sweep never share snapshots."""
        import ray.train

        from memsnap.integrations.ray_train import run_identity

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

    # --- calls through this node's agent ---------------------------------------------------------
    def _ask(self, method: str, *args, timeout: float | None = None):
        return _get(getattr(self._agent, method).remote(*args), timeout)

    def _local_ranks(self) -> list[int]:
        if self._local is None:
            timeout = tunable("membership_timeout_s")
            answer = self._ask("members", timeout, timeout=timeout + 60)
            self._local, self.peers = answer["ranks"], answer["peers"]
            if not self.peers and self.rank == min(self._local, default=self.rank):
                log.warning(
                    "memsnap job %r: no peer protection on this node's ranks (%s)", self.config.job, answer["why"]
                )
        return self._local

    def _map(self, path: str, nbytes: int) -> memoryview:
        arena = self._maps.get(path)
        if arena is None or arena.nbytes < nbytes:
            slot = naming.arena_gen(path)[0]  # the agent replaced this slot's file: drop the old mapping
            for old in [p for p in self._maps if p != path and naming.arena_gen(p)[0] == slot]:
                self._maps.pop(old).close(unlink=False)
            arena = self._maps[path] = Arena.attach(path, nbytes)
        return arena.view(0, nbytes)

    # --- save --------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False) -> bool:
        """After finishing ``step``: snapshot ``state`` if the policy says so. Returns whether a
        snapshot was captured; the rest (encode, send, commit, spill) runs in the background.

        ``force=True`` (every rank, the same step: the last step of a run, say) snapshots
        whatever the policy says, and where the node's pipeline is busy waits for a slot (up
        to the ``forced_save_wait_s`` tunable) instead of skipping the step."""
        if self._watcher is not None and self._watcher.preempted:
            self._final_save(step, state)
        if not force and not self._policy.due(step):
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
            self._report_failed(step)
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

    def _report_failed(self, step: int) -> None:
        """Tell the coordinator (without waiting) that ``step`` cannot commit: the other nodes
        free their copies of it and ``wait(step)`` returns at once on every rank."""
        with contextlib.suppress(Exception):
            self._agent.report_failed.remote(step, f"rank {self.rank}: {self.last_error}")

    def _check_staleness(self, step: int) -> None:
        if self._guard is not None:
            self._guard.check(step, self._ask("wait", step, 0.0))

    def _save(self, step: int, state: Mapping[str, Any], wait_s: float = 0.0) -> bool:
        """Capture ``step`` into this node's agent; False when the agent skipped it (busy, and
        no slot freed within ``wait_s``)."""
        from memsnap import cuda_capture
        from memsnap.capture import copy_into, snapshot_view

        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r}: must be an int >= 0")
        local = self._local_ranks()
        layout, sources = self._plan.plan(state)
        info = _get(
            self._agent.begin.remote(step, self.rank, layout.nbytes, wait_s), timeout=tunable("call_timeout_s") + wait_s
        )
        if "skipped" in info:
            log.debug("rank %d: step %d skipped: %s", self.rank, step, info["skipped"])
            return False
        out = self._map(info["path"], layout.nbytes)
        layout.meta.update(step=step, rank=self.rank, world_size=self.world, job=self.config.job)
        if self.options["device"].on and self._save_device(step, layout, sources, local):
            return True  # device tier: D2D into the agent's buffer, which the agent drains
        if cuda_capture.needs_async(sources):
            self._save_cuda(step, layout, sources, out, info["path"], local)
            return True
        copy_into(layout, sources, snapshot_view(out, layout.nbytes, writable=True))
        _get(self._agent.captured.remote(step, self.rank, layout.to_json().decode(), local))
        return True

    def _save_cuda(self, step, layout, sources, out, path, local) -> None:
        """D2H on a side stream; the agent hears of the step once the copy is done."""
        from memsnap import cuda_capture

        if self._cuda is None:
            self._cuda = cuda_capture.SideStreamCapture()
            self._cuda.attach(self._optimizers)
        if path not in self._pins:
            self._pins[path] = cuda_capture.HostRegistration(out)
        manifest_json = layout.to_json().decode()
        self._cuda.start(
            layout, sources, out, on_done=lambda: self._agent.captured.remote(step, self.rank, manifest_json, local)
        )

    # --- the device tier (opt-in; memsnap.device.runtime) ----------------------------------------
    def _device_side(self):
        if self._device is None:
            from memsnap.device.runtime import RankDevice

            self._device = RankDevice(self._agent, self.rank, self.options["device"].backend, self._optimizers, _get)
        return self._device

    def _save_device(self, step, layout, sources, local) -> bool:
        """Capture through the agent's device buffer; False: take the host path for this step."""
        return self._device_side().save(step, layout, sources, local)

    def _restore_device(self, step: int, state, seconds: dict) -> bool:
        """Load ``step`` from the agent's device buffer; False: it does not hold it."""
        if not self.options["device"].on:
            return False
        t = time.perf_counter()
        done = self._device_side().restore(step, state)
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
        if self._cuda is not None:
            self._cuda.wait()
        if self._device is not None:
            self._device.wait()
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
            step = self._ask("wait", -1, 0.0)
            if step is None:
                return None
        self._ask("request_spill", step)
        durable = self._ask("wait_durable", step, timeout, timeout=timeout + 60)
        return step if durable is not None and durable >= step else None

    def wait(self, step: int, timeout: float = 60.0) -> int | None:
        """Block until ``step`` (or a later one) is committed or failed; return the newest committed."""
        return self._ask("wait", step, timeout, timeout=timeout + 60)

    # --- restore -----------------------------------------------------------------------------
    def restore(self, state: Mapping[str, Any]) -> int | None:
        """(collective) Load the newest step every rank can load, through the fastest tier."""
        t0 = time.perf_counter()
        timeout = tunable("restore_timeout_s") + 10
        error: Exception | None = None
        for attempt in range(3):
            t = time.perf_counter()
            plan = RankPlan.from_wire(self._ask("restore_plan", self.rank, attempt, timeout=timeout))
            seconds = {"plan": time.perf_counter() - t}
            try:
                tier = self._load(plan, state, seconds)
                ok, report = True, {"tier": tier, "seconds": seconds}
            except Exception as exc:
                log.warning("rank %d: restore of step %s failed: %s", self.rank, plan.step, exc)
                ok, report, tier = False, {"error": f"{type(exc).__name__}: {exc}"}, None
                error = exc
            result = self._ask("restore_done", self.rank, attempt, ok, report, timeout=timeout)
            if result["ok"] and self._dirty and plan.tier == "none":
                raise MemsnapError(
                    f"rank {self.rank}: a restore from peers failed after it had begun writing into the "
                    "live state, and no other copy can be loaded; rebuild the state and call restore again"
                )
            if result["ok"]:
                self._dirty = False
                _get(self._agent.resume.remote(plan.step, result["gen"]))
                self._ready_slots(state)
                seconds["total"] = time.perf_counter() - t0
                assert tier is not None  # the round is ok only when every rank loaded
                return self._restored(plan, tier, seconds)
        raise (
            error
            if error is not None
            else MemsnapError(f"restore failed on ranks {sorted(result['failed'])}: {result['failed']}")
        )

    def _ready_slots(self, state) -> None:
        """Have the agent make and back this rank's arena slots now, in the background, so that
        the first saves do not pay for fresh pages (the layout is planned here once anyway)."""
        try:
            self._agent.ready_slots.remote(self.rank, self._plan.plan(state)[0].nbytes)
        except Exception as exc:  # only a head start: the first saves make what is missing
            log.info("rank %d: arena slots not made ahead: %s", self.rank, exc)

    def _restored(self, plan: RankPlan, tier: str, seconds: dict) -> int | None:
        self.last_restore = {"tier": tier, "step": plan.step, "seconds": seconds}
        if plan.plan == "durable" or tier == "durable":
            self.last_restore["run"] = self._durable_run  # the run that spilled it (its COMMITTED metadata)
        self.last_plan = plan
        metrics.restored(self.config.job, self.node, tier, seconds.get("total", 0.0))
        resumed = -1 if plan.step is None else plan.step
        self._policy.resume(resumed)
        if self._guard is not None:
            self._guard.start_step = resumed
        if plan.plan == "durable":
            wrote = self.last_restore.get("run")
            msg = (
                f"memsnap: restored step {plan.step} from durable storage {plan.spill}"
                f"{f' (spilled by run {wrote!r})' if wrote else ''}: the RAM tiers could not serve every rank"
            )
            self.last_restore["warning"] = msg
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.info(
            "rank %d restored step %s from %s in %s",
            self.rank,
            plan.step,
            tier,
            {k: round(v, 3) for k, v in seconds.items()},
        )
        return plan.step

    def _load(self, plan: RankPlan, state, seconds: dict) -> str:
        tier, step = plan.tier, plan.step
        if tier == "none":
            return "none"
        if tier == "durable":
            return self._load_durable(plan, state, seconds)
        if tier == "elastic":
            return self._load_elastic(plan, state, seconds)
        assert step is not None  # a RAM tier loads a step
        corrupt = False
        if tier == "local" and self._restore_device(step, state, seconds):
            return "device"  # the agent's device buffer still holds the step
        if tier == "local":
            info = _get(self._agent.local.remote(step, self.rank))
            if info is not None:
                try:
                    self._apply(info, state, seconds)
                    return "local"
                except ChecksumError as exc:
                    log.warning("rank %d: local copy of step %d is corrupt (%s); reading peers", self.rank, step, exc)
                    corrupt = True
        t = time.perf_counter()
        assert plan.source is not None  # a RAM tier names where its bytes live
        source = plan.source.to_wire()
        read = "copy" if tier == "copy" else "peer"  # copy: the old node's whole copy, else k of k+m
        if self._direct:
            self._receive(plan.source, self._ask("manifest", step, self.rank, source), state)
            seconds["fetch"] = time.perf_counter() - t
            if corrupt:  # the agent reads the node's copy back from the holders, in the background
                self._agent.rebuild_local.remote(step, self.rank, source, True)
            return read
        info = _get(self._agent.recover.remote(step, self.rank, source), tunable("restore_timeout_s"))
        seconds["fetch"] = time.perf_counter() - t
        self._apply(info, state, seconds)
        return read

    def _peers(self):
        """This rank's own data-plane client and codec, made on its first read from peers."""
        from memsnap import receive

        if self._receiver is None:
            from memsnap.codec import codec_for
            from memsnap.transport import make_transport

            client = make_transport(
                "tcp", secret=self._secret, host=ray.util.get_node_ip_address(), **tcp_options(self.config)
            )
            self._receiver = receive.Peers(client, codec_for(self.config.k, self.config.m))
        return self._receiver

    def _receive(self, source, manifest_json: str, state) -> None:
        """Read this rank's bytes from the holders straight into ``state`` (receive.py)."""
        from memsnap import receive
        from memsnap.errors import StateMismatchError

        try:
            stats = receive.into_state(self._peers(), source, manifest_json, state)
        except StateMismatchError:
            raise  # refused before anything was written
        except BaseException:
            self._dirty = True
            raise
        if stats.get("repaired"):
            self._agent.count.remote("repaired_chunks", stats["repaired"])

    def _apply(self, info: dict, state, seconds: dict) -> None:
        from memsnap.apply import apply

        t = time.perf_counter()
        apply(state, Manifest.from_json(info["manifest"]), self._map(info["path"], info["nbytes"]), verify=True)
        seconds["apply"] = time.perf_counter() - t

    def _load_elastic(self, plan: RankPlan, state, seconds: dict) -> str:
        """The step was taken by another world size: read the parts of every saved rank this
        rank needs from RAM, reshard them (``elastic.py``), and load; the live state is only
        written once everything was read and checked."""
        from memsnap import elastic
        from memsnap.apply import apply
        from memsnap.capture import plan as layout_of

        if not self._direct:
            raise ConfigError(
                "an elastic restore from RAM reads the saved ranks over the tcp transport; with "
                f"transport={self.config.transport!r} it loads from durable storage instead"
            )
        t = time.perf_counter()
        refs = [self._agent.manifest.remote(plan.step, src.rank, src.to_wire()) for src in plan.sources]
        manifests = [_get(ref) for ref in refs]
        seconds["manifests"] = time.perf_counter() - t
        t = time.perf_counter()
        man, buf, stats = elastic.assemble(self._peers(), plan.sources, manifests, layout_of(state), self.rank)
        seconds["fetch"] = time.perf_counter() - t
        if stats.get("repaired"):
            self._agent.count.remote("repaired_chunks", stats["repaired"])
        t = time.perf_counter()
        apply(state, man, buf, verify=False)  # (every tensor read was checked against its checksum)
        seconds["apply"] = time.perf_counter() - t
        log.info(
            "rank %d: step %d resharded from %d saved ranks in RAM (read %s of them, %.1f MiB)",
            self.rank,
            plan.step,
            len(plan.sources),
            stats["ranks_read"],
            stats["bytes"] / 2**20,
        )
        return "elastic"

    def _load_durable(self, plan: RankPlan, state, seconds: dict) -> str:
        """The spilled step, resharded when another world size took it (as ``memsnap.load``)."""
        from memsnap.apply import apply
        from memsnap.durable import read_step
        from memsnap.storage import Store

        t = time.perf_counter()
        assert plan.spill is not None and plan.step is not None  # a durable plan names both
        man, buf, marker = read_step(Store.open(plan.spill), plan.step, self.rank, self.world, state)
        seconds["fetch"] = time.perf_counter() - t
        self._durable_run = marker.get("metadata", {}).get("run")
        t = time.perf_counter()
        apply(state, man, buf, verify=True)
        seconds["apply"] = time.perf_counter() - t
        return "durable"

    # --- status / close ------------------------------------------------------------------------
    def status(self) -> dict:
        """JSON-serialisable state of the job's snapshots, as this rank sees it."""
        st = self._ask("job_status", timeout=tunable("call_timeout_s") * 3)
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
        st["last_restore"] = dict(self.last_restore)
        return st

    def close(self) -> None:
        """Finish a pending GPU copy, stop the preemption watcher, drop this rank's mappings
        (the agents keep the snapshots)."""
        if self._cuda is not None:
            self._cuda.close()
        if self._device is not None:
            self._device.close()
            self._device = None
        for pin in self._pins.values():
            pin.close()
        self._pins.clear()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        for arena in self._maps.values():
            arena.close(unlink=False)
        self._maps.clear()
        if self._receiver is not None:
            self._receiver.transport.close()
            self._receiver = None


def ensure_ray() -> None:
    """Connect to the Ray cluster in ``RAY_ADDRESS`` unless Ray is initialised already, or
    start a local one bound to 127.0.0.1."""
    import os

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=naming.NAMESPACE)
    else:
        from memsnap.localcluster import loopback_env

        loopback_env()
        ray.init(namespace=naming.NAMESPACE, include_dashboard=False)


def check_same_job(mine: SnapshotConfig, running: dict) -> None:
    """A job name reused with another configuration would silently run on the old agents:
    refuse it, naming what differs. (The world size is membership, not configuration: a job
    back with another number of ranks is an elastic restart.)"""
    theirs = SnapshotConfig.from_dict(running)
    diff = {k: (getattr(theirs, k), v) for k, v in mine.to_dict().items() if getattr(theirs, k) != v}
    if diff:
        fields_ = ", ".join(f"{k}={new!r} (running: {old!r})" for k, (old, new) in sorted(diff.items()))
        raise ConfigError(
            f"job {mine.job!r} is already running with another configuration: {fields_}. "
            f"Use the same options, another job name, or stop the old one first with "
            f"memsnap.shutdown({mine.job!r})"
        )


def job_config(job: str, opts: dict) -> SnapshotConfig:
    """The job-wide configuration the agents share, from a Snapshotter's resolved options."""
    pro, mem, sp, wi = opts["protection"], opts["memory"], opts["spill"], opts["wire"]
    dev = opts["device"]
    uri = None if sp.uri is None else sp.uri.replace("{job}", job)  # each job (a Tune trial) its own directory
    return SnapshotConfig(
        job,
        k=pro.k,
        m=pro.m,
        group_size=pro.group_size,
        local_copy=pro.local_copy,
        peers=pro.peers,
        keep=mem.keep,
        memory_budget=mem.budget,
        spill=uri,
        spill_every=sp.every,
        spill_every_seconds=sp.every_seconds,
        spill_bytes_per_s=sp.bytes_per_s,
        transport=wi.transport,
        chunk=wi.chunk,
        wire=wi.mode,
        device_buffer=dev.buffer,
        device_backend=dev.backend,
    )


def start_spare(job: str, node_id: str, **options: Any):
    """Start ``job``'s agent on ``node_id``, a node that runs no rank: a *spare* that holds
    erasure-coded pieces of the other nodes (and so lets a job on ``k+m`` nodes be protected).
    ``options`` are the job's Snapshotter options (``k``, ``m``, ``memory_budget``, ...); call
    it before the ranks start, e.g. from the driver. Returns the agent's actor handle."""
    if not ray.is_initialized():
        raise ConfigError("start_spare needs Ray: call it after ray.init()")
    cfg = job_config(job, resolve_options(options))
    job_secret(job)  # made now if no rank made it yet: the agent reads it from Ray's key-value store
    handle = actors.agent_for(cfg, node_id)
    address = _get(handle.address.remote())
    try:  # a job already placed takes the spare in now (a standby's node, a node added later)
        coordinator = ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)
    except ValueError:
        return handle  # no coordinator yet: the first placement finds the spare itself
    _get(coordinator.spare_joined.remote(node_id, address))
    return handle


def shutdown(job: str, timeout: float = 30.0) -> None:
    """Stop the job's coordinator and every agent (their shared memory is unlinked), and
    delete the job's secret."""
    from memsnap.secret import drop_secret

    for node in [n["NodeID"] for n in ray.nodes() if n.get("Alive")]:
        handle = actors.find(job, node)
        if handle is not None:
            try:
                ray.get(handle.shutdown.remote(), timeout=timeout)
            except Exception:  # exit_actor ends the call with an actor error
                pass
    try:
        ray.kill(ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE), no_restart=True)
    except ValueError:
        pass
    drop_secret(job)
