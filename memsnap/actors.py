"""The Ray faces of memsnap's two actors: thin asyncio wrappers over plain objects.

``SnapshotAgent`` (one per node and job, detached, pinned to its node) wraps ``AgentCore``
(the RAM, the data plane) and ``NodeRelay`` (its ranks' calls toward the coordinator);
``Coordinator`` (one per job, detached) wraps ``CoordinatorCore``. Both are asyncio actors:
a barrier of N participants is N futures on one event loop, never a thread each, so no
concurrency setting limits the job's size. Blocking work (memory, sockets, Ray lookups)
runs in each actor's own thread pool. The call protocols are in ``agent.py`` and
``coordinator.py``; records cross this boundary as plain dicts (``records.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from memsnap import metrics, naming
from memsnap.config import SnapshotConfig, tunable
from memsnap.directory import find_agent
from memsnap.errors import CommitError
from memsnap.identity import Claim
from memsnap.job.coordinator import CoordinatorCore, adopt_late, rebuild_state
from memsnap.job.liveness import PING_CAP_S
from memsnap.node.agent import AgentCore
from memsnap.node.relay import NodeRelay
from memsnap.records import CommitNotice, RankRestore, RankSource
from memsnap.secret import job_secret
from memsnap.transport.objstore import ObjStoreTransport
from memsnap.waiting import Signal

log = logging.getLogger("memsnap.actors")

LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class _Pool:
    """An actor's own threads for blocking work, awaited from its event loop."""

    def __init__(self, threads: int, name: str):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


SLOT_RECHECK_S = 0.25  # a waiting begin looks again this often even when no change is signalled


async def begin_waiting(run, core: AgentCore, signal: Signal, step: int, rank: int, nbytes: int, wait_s: float) -> dict:
    """``core.begin`` in the actor's threads (``run``). With ``wait_s > 0`` a busy pipeline
    does not skip the step at once: the call waits (a future on the event loop, no thread) for
    a slot to free, asking again at each change of the agent's state, and skips the step only
    if none frees within ``wait_s``."""
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        left = deadline - time.monotonic()
        info = await run(core.begin, step, rank, nbytes, left > 0)
        if "busy" not in info:
            return info
        await signal.next(min(left, SLOT_RECHECK_S))


# --- the coordinator -----------------------------------------------------------------------------
@ray.remote
class Coordinator:
    """The Ray actor around ``CoordinatorCore``; see ``coordinator.py`` for the protocol."""

    def __init__(self, config: dict, world_size: int):
        logging.basicConfig(level=logging.INFO)
        self.core = CoordinatorCore(config, world_size)
        self.signal = Signal()
        self.core.changed = self.signal.notify
        self.pool = _Pool(8, "memsnap-coordinator")
        self.planning: dict[int, asyncio.Lock] = {}
        self._watcher: asyncio.Future | None = None  # the heartbeat watch, started by the first beat
        missing = rebuild_state(self.core)
        if missing:  # agents too busy to answer: asked again beside the coordinator's work
            threading.Thread(target=adopt_late, args=(self.core, missing), name="memsnap-adopt", daemon=True).start()
        metrics.refresh_every(tunable("metrics_interval_s"), self.core.cfg.job, self.core.status)

    async def config(self) -> dict:
        return {"config": self.core.cfg.to_dict(), "world_size": self.core.world}

    async def join(
        self, node: str, address: dict, ranks: list[int], world: int | None = None, claims: dict | None = None
    ) -> dict:
        rivals_left = await self._rivals_gone(ranks, world, claims or {})
        if not rivals_left and world in (None, self.core.world) and self.core.membership.needs_a_dead_node(node):
            await self._a_dead_node()
        return await self.pool.run(self.core.join, node, address, ranks, world, claims)

    async def _rivals_gone(self, ranks: list[int], world: int | None, claims: dict) -> bool:
        """Ranks a live rank of another run holds: wait (bounded) until those processes are
        gone, since a killed rank's process may still be exiting. True if some still run."""
        parsed = {rank: Claim.from_wire(claims.get(rank)) for rank in ranks}
        deadline = time.monotonic() + tunable("claim_wait_s")
        while await self.pool.run(self.core.refusals, parsed, world):
            if time.monotonic() >= deadline:
                return True
            await asyncio.sleep(0.25)  # a process's exit has no event to wait on from here
        return False

    async def _a_dead_node(self) -> None:
        """A new node is joining: wait (bounded) until Ray has marked a placed node dead. Ray
        Train can restart its workers before the GCS has declared the lost node dead."""
        timeout = tunable("membership_timeout_s")
        deadline = time.monotonic() + timeout
        placement = self.core.membership.placement
        assert placement is not None  # a node joins a placement's lost slot
        while time.monotonic() < deadline:
            alive = await self.pool.run(self.core._alive)
            if set(placement.holders) - alive:
                return
            await asyncio.sleep(0.5)  # Ray has no event for a node's death to wait on
        log.warning("a new node joined but no placed node was declared dead within %.0f s", timeout)

    async def answer(self, node: str, timeout: float) -> dict:
        if not await self.signal.wait_for(lambda: self.core.membership.decided(), timeout):  # (resize swaps it)
            missing = sorted(set(range(self.core.world)) - set(self.core.membership.members))
            raise CommitError(f"timed out after {timeout:.0f} s waiting for ranks {missing} to register")
        return self.core.answer(node)

    async def node_layout(self, node: str) -> dict:
        with self.core.lock:
            return self.core.membership.layout(node)

    async def node_ready(self, info: dict) -> None:
        self.core.node_ready(info)

    async def node_failed(self, step: int, node: str, why: str) -> None:
        await self.pool.run(self.core.node_failed, step, node, why)  # (may ask Ray which nodes live)

    async def node_skipped(self, step: int, node: str, why: str) -> None:
        self.core.node_skipped(step, node, why)

    async def recovered(self, record: dict) -> None:
        self.core.recovered(record)

    async def spare_joined(self, node: str, address: dict) -> bool:
        return await self.pool.run(self.core.spare_joined, node, address)  # (asks the spares' agents)

    async def node_lost(self, node: str, why: str) -> bool:
        fenced = await self.pool.run(self.core.node_lost, node, why)
        if fenced:
            await self.pool.run(self._stop_agent, node)
        return fenced

    def _stop_agent(self, node: str) -> None:
        """A fenced node's agent stops serving and committing, even if it was only paused."""
        agent = find_agent(self.core.cfg.job, node)
        if agent is not None:
            with contextlib.suppress(Exception):
                ray.kill(agent, no_restart=True)

    # --- heartbeats (liveness.py) ------------------------------------------------------------------
    async def beat(self, node: str) -> bool:
        """``node``'s agent is alive; False: it is fenced (and must stop)."""
        if self._watcher is None and tunable("heartbeat_s") > 0:
            self._watcher = asyncio.ensure_future(self._watch())
        return self.core.beat(node)

    async def suspect(self, node: str, why: str) -> bool:
        """The data plane saw ``node`` refuse or reset a connection: it is asked at once."""
        return self.core.suspect(node, why)

    async def _watch(self) -> None:
        """Every ``heartbeat_s``: ping each agent that fell silent (or was suspected)."""
        period = tunable("heartbeat_s")
        while True:
            await asyncio.sleep(period)  # a clock: silence is the absence of an event
            try:
                for node, why in self.core.heartbeats_due().items():
                    asyncio.ensure_future(self._probe(node, why))
            except Exception:  # never let one bad tick end the watch
                log.exception("heartbeat watch")

    async def _probe(self, node: str, why: str) -> None:
        floor_s = tunable("agent_ping_s")
        ping_s = await self.pool.run(self.core.ping_deadline, node, floor_s)
        outcome, answered_s = "silent", None
        try:
            agent = await self.pool.run(self.core.dir.agent, node)
            if agent is None:
                outcome = "died"
            else:
                control = asyncio.ensure_future(self._control_ping(node))
                t = time.monotonic()
                answer = asyncio.ensure_future(agent.ping.remote())
                try:
                    while True:  # the deadline grows while the job shows it is loaded
                        left = ping_s - (time.monotonic() - t)
                        done, _ = await asyncio.wait({answer}, timeout=max(0.0, left))
                        if done:
                            answer.result()
                            outcome, answered_s = "answered", time.monotonic() - t
                            break
                        ping_s = await self.pool.run(self.core.ping_deadline, node, floor_s)
                        if not control.done():  # a beating node has not answered either
                            ping_s = max(ping_s, min(PING_CAP_S, time.monotonic() - t + floor_s))
                        if time.monotonic() - t >= ping_s:
                            break
                finally:
                    answer.cancel()
        except ray.exceptions.ActorDiedError:
            outcome = "died"
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError):
            outcome = "silent"  # unreachable (ActorUnavailableError)
        if outcome == "died" and node not in await self.pool.run(self.core.dir.alive):
            outcome, why = "silent", f"{why}; Ray reports its node dead"
        verdict = await self.pool.run(self.core.heartbeat_verdict, node, outcome, why, ping_s, answered_s)
        if verdict.lost:
            await self.pool.run(self._stop_agent, node)

    async def _control_ping(self, node: str) -> None:
        """Ping a beating node beside the probe of ``node``: its answer time tells the probe how
        loaded the job is (``Liveness.control``). Its outcome judges nobody."""
        try:
            control = await self.pool.run(self.core.ping_control, node)
            agent = None if control is None else await self.pool.run(self.core.dir.agent, control)
            if agent is None:
                return
            t = time.monotonic()
            await asyncio.wait_for(agent.ping.remote(), PING_CAP_S)
            await self.pool.run(self.core.ping_answered, control, time.monotonic() - t)
        except Exception:  # (a control that is slow or gone is judged by its own beats)
            return

    async def wait_committed(self, step: int, timeout: float) -> int | None:
        await self.signal.wait_for(lambda: self.core.resolved(step), timeout)
        return self.core.newest()

    async def restore_arrive(self, node: str, attempt: int, ranks: list[int]) -> None:
        self.core.restore_arrive(attempt, ranks)

    async def cancel_restore(self, why: str) -> list[int]:
        return self.core.cancel_restore(why)

    def _not_cancelled(self, attempt: int) -> None:
        why = self.core.rounds.cancelled(attempt)
        if why is not None:
            raise CommitError(f"restore: the round was cancelled: {why}")

    async def restore_plans(self, node: str, attempt: int) -> dict:
        timeout = tunable("restore_timeout_s")
        rounds = self.core.rounds
        if not await self.signal.wait_for(lambda: rounds.all_arrived(attempt) or rounds.cancelled(attempt), timeout):
            raise CommitError(
                f"restore: timed out after {timeout:.0f} s waiting for ranks {self.core.rounds.missing(attempt)}"
            )
        self._not_cancelled(attempt)
        async with self.planning.setdefault(attempt, asyncio.Lock()):  # one plan, made once
            await self.pool.run(self.core.plan, attempt)
        return await self.pool.run(self.core.plans_for, node, attempt)

    async def restore_report(self, node: str, attempt: int, reports: dict) -> None:
        self.core.restore_report(attempt, {int(r): RankRestore.from_wire(rep) for r, rep in reports.items()})

    async def restore_result(self, node: str, attempt: int) -> dict:
        timeout = tunable("restore_timeout_s")
        rounds = self.core.rounds
        if not await self.signal.wait_for(lambda: rounds.all_done(attempt) or rounds.cancelled(attempt), timeout):
            raise CommitError(
                f"restore: timed out waiting for ranks {self.core.rounds.missing(attempt, 'done')} to finish"
            )
        self._not_cancelled(attempt)
        return self.core.restore_result(attempt).to_wire()

    async def spilled(self, step: int, ranks: list[int]) -> bool:
        return await self.pool.run(self.core.spilled, step, ranks)

    async def spill_now(self, step: int) -> None:
        self.core.broadcast("spill_now", step)

    async def wait_durable(self, step: int, timeout: float) -> int | None:
        await self.signal.wait_for(lambda: (self.core.durable_step() or -1) >= step, timeout)
        return self.core.durable_step()

    async def status(self) -> dict:
        out = await self.pool.run(self.core.status)
        out["coordinator_node"] = ray.get_runtime_context().get_node_id()  # (where a node loss would take it)
        return out


def coordinator_for(cfg: SnapshotConfig, world_size: int, node: str | None = None):
    """The job's coordinator: the existing one, or a new one (rebuilt from the agents).
    ``node``: where a new one must run (the in-place controller's node, which no rank runs on,
    so that no rank node's loss takes the coordinator with it). The affinity is hard: Ray
    placed a soft one elsewhere about half the time on a loopback cluster, often on a rank's
    node; and the controller runs there, so a loss of that node ends the job anyway."""
    extra = {}
    if node is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        extra["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    # @ray.remote turns the class into an ActorClass; ray's annotation keeps the bare class
    return Coordinator.options(  # type: ignore[attr-defined]
        name=naming.coordinator(cfg.job),
        namespace=naming.NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_concurrency=100_000,
        **extra,
    ).remote(cfg.to_dict(), world_size)


# --- the agent ----------------------------------------------------------------------------------
@ray.remote
class SnapshotAgent:
    """The Ray actor around ``AgentCore`` and ``NodeRelay``; see ``agent.py`` for the protocol."""

    def __init__(self, config: dict, node_id: str):
        logging.basicConfig(level=logging.INFO)
        cfg = SnapshotConfig.from_dict(config)
        self.core = AgentCore(config, node_id, job_secret(cfg.job), host=ray.util.get_node_ip_address())
        self.signal = Signal()
        self.core.changed = self.signal.notify
        self.core.coordinator = self._coordinator
        self.pool = _Pool(int(tunable("agent_threads")), "memsnap-agent")
        self.relay = NodeRelay(self.core, self._call, self.signal)
        if cfg.spill is not None:
            from memsnap.node.spill import Spiller

            self.core.spiller = Spiller.of(self.core, report=self.core.spilled)
        self._beating = threading.Event()
        if tunable("heartbeat_s") > 0:
            threading.Thread(target=self._beat, name="memsnap-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        """Beat to the coordinator every ``heartbeat_s`` from a thread of its own (so a busy
        agent still beats), until the coordinator answers that this node is fenced."""
        period, job = tunable("heartbeat_s"), self.core.cfg.job
        handle, last = None, None
        while not self._beating.wait(period):
            if last is not None:
                ready, _ = ray.wait([last], timeout=0)
                if ready:
                    try:
                        if not ray.get(ready[0]):
                            self._fenced()
                            return
                    except Exception:  # the coordinator is gone or restarting: find it again
                        handle = None
                    last = None
            if time.monotonic() < getattr(self.core, "heartbeats_held_until", 0.0):
                continue  # a test's slow agent (``testing.hold_heartbeats``)
            try:
                if handle is None:
                    handle = ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)
                ref = handle.beat.remote(self.core.node)
                last = last or ref  # one beat's answer is looked at a time
            except Exception:  # no coordinator yet (or it is being replaced)
                handle = None

    # --- the coordinator, found again (and this node re-joined) when it was lost -----------------
    def _coordinator(self):
        try:
            return ray.get_actor(naming.coordinator(self.core.cfg.job), namespace=naming.NAMESPACE)
        except ValueError:
            if self.core.world is None:
                raise
            log.warning("coordinator of job %s is gone; starting a new one", self.core.cfg.job)
            return coordinator_for(self.core.cfg, self.core.world)

    async def _call(self, method: str, *args, timeout: float):
        for attempt in range(6):  # a restarting coordinator is waited for ~30 s in all
            try:
                handle = await self.pool.run(self._coordinator)
                return await asyncio.wait_for(getattr(handle, method).remote(*args), timeout)
            except LOST as exc:
                log.warning("coordinator lost (%s); finding it again", type(exc).__name__)
                await asyncio.sleep(min(0.5 * 2**attempt, 10.0))
                if method != "join":
                    await self.relay.rejoin()
            except ray.exceptions.RayTaskError as exc:
                raise (exc.cause if isinstance(getattr(exc, "cause", None), Exception) else exc) from None
        handle = await self.pool.run(self._coordinator)
        return await asyncio.wait_for(getattr(handle, method).remote(*args), timeout)

    # --- for the node's ranks ---------------------------------------------------------------------
    async def ping(self) -> str:
        return self.core.node

    async def pid(self) -> int:
        """This agent's process id (diagnostics; fault drills freeze it)."""
        return os.getpid()

    async def address(self) -> dict:
        """This agent's data-plane address (the coordinator finds spare agents with it)."""
        return self.core.address

    async def config(self) -> dict:
        """The job configuration this agent was started with (a rank checks it matches its own)."""
        return self.core.cfg.to_dict()

    async def join(self, rank: int, world_size: int, claim: dict | None = None) -> dict:
        nbytes, run = await self.relay.join(rank, world_size, claim)
        direct = self.core.cfg.transport == "tcp" and bool(tunable("direct_restore"))
        if nbytes and not direct:  # the restore will land in an arena here: back it meanwhile
            asyncio.ensure_future(self.pool.run(self.core.prepare, rank, nbytes))
        return {"address": self.core.address, "run": run}

    async def running(self, tokens: list[str]) -> list[str]:
        """Which of these rank processes still run here (the coordinator asks before a rank of
        another run takes over one of theirs)."""
        return self.core.running(tokens)

    async def working(self, tokens: list[str]) -> list[str]:
        """Which of these processes run here and are not stopped (the in-place controller asks
        before it calls a silent member lost: a slow process is waited for)."""
        return self.core.working(tokens)

    async def members(self, timeout: float) -> dict:
        answer = await self.relay.answer(timeout)
        return {k: answer[k] for k in ("ranks", "peers", "why")}

    async def ready_slots(self, rank: int, nbytes: int) -> int:
        """Back ``rank``'s arena slots for ``nbytes`` now, ahead of its first saves."""
        return await self.pool.run(self.core.ready_slots, rank, nbytes)

    async def begin(self, step: int, rank: int, nbytes: int, wait_s: float = 0.0) -> dict:
        return await begin_waiting(self.pool.run, self.core, self.signal, step, rank, nbytes, wait_s)

    async def captured(self, step: int, rank: int, manifest_json: str, local_ranks: list[int]) -> None:
        return await self.pool.run(self.core.captured, step, rank, manifest_json, local_ranks)

    # the device tier (memsnap.device.runtime), opt-in
    async def device_begin(self, step: int, rank: int, device: str, nbytes: int) -> str | None:
        return await self.pool.run(self.core.device_begin, step, rank, device, nbytes)

    async def device_captured(
        self, step: int, rank: int, device: str, manifest_json: str, local_ranks: list[int]
    ) -> None:
        return await self.pool.run(self.core.device_captured, step, rank, device, manifest_json, local_ranks)

    async def device_source(self, rank: int, step: int) -> list | None:
        return await self.pool.run(self.core.device_source, rank, step)

    async def wait(self, step: int, timeout: float) -> int | None:
        return await self.relay.wait(step, timeout)

    async def report_failed(self, step: int, why: str) -> None:
        await self._call("node_failed", step, self.core.node, why, timeout=tunable("call_timeout_s"))

    async def restore_plan(self, rank: int, attempt: int) -> dict:
        return await self.relay.restore_plan(rank, attempt)

    async def restore_done(self, rank: int, attempt: int, report: dict) -> dict:
        return await self.relay.restore_done(rank, attempt, report)

    async def local(self, step: int, rank: int) -> dict | None:
        return await self.pool.run(self.core.local, step, rank)

    async def manifest(self, step: int, rank: int, source: dict) -> str:
        """``rank``'s manifest of ``step``: from this node, else from a holder of its owner."""
        return await self.pool.run(self.core.manifest_for, step, rank, RankSource.from_wire(source))

    async def recover(self, step: int, rank: int, source: dict) -> dict:
        return await self.pool.run(self.core.recover, step, rank, RankSource.from_wire(source))

    async def request_spill(self, step: int) -> None:
        await self._call("spill_now", step, timeout=tunable("call_timeout_s"))

    async def wait_durable(self, step: int, timeout: float) -> int | None:
        return await self._call("wait_durable", step, timeout, timeout=timeout + 30)

    async def job_status(self) -> dict:
        return await self._call("status", timeout=tunable("call_timeout_s") * 2)

    # --- from the coordinator and the other agents ---------------------------------------------------
    async def commit(self, notice: dict) -> None:
        await self.pool.run(self.core.commit, CommitNotice.from_wire(notice))

    async def abandon(
        self, step: int, why: str = "a node or holder failed before acknowledging", failed: bool = True
    ) -> None:
        await self.pool.run(self.core.abandon, step, why, failed)

    async def layout_changed(self) -> None:
        self.core.sender.layout = None
        self.relay.forget_answer()

    async def spill_now(self, step: int) -> bool:
        """Write committed ``step`` to durable storage now, unthrottled (preemption)."""
        if self.core.spiller is None:
            return False
        self.core.spiller.request(step)
        return True

    async def hold_manifests(self, step: int, owner: str, info: dict, manifests: dict) -> None:
        self.core.hold_manifests(step, owner, info, manifests)

    async def held_manifests(self, step: int, owner: str) -> dict:
        return self.core.held_manifests(step, owner)

    async def committed_infos(self) -> dict:
        return (await self.pool.run(self.core.committed_infos)).to_wire()

    async def rebuild_local(self, step: int, rank: int, source: dict, replace: bool = False) -> bool:
        return await self.pool.run(self.core.rebuild_local, step, rank, RankSource.from_wire(source), replace)

    async def rebuild(self, step: int, k: int, m: int, info: dict, addrs: dict, shard: int) -> int:
        return await self.pool.run(self.core.rebuild, step, k, m, info, addrs, shard)

    async def inventory(self) -> dict:
        return (await self.pool.run(self.core.inventory)).to_wire()

    async def objstore_push(self, packed_keys: list, data, lengths: list, checksums: list) -> list:
        transport = self.core.transport
        assert isinstance(transport, ObjStoreTransport), "objstore calls reach an agent of the objstore transport"
        return await self.pool.run(transport.handle_push, packed_keys, data, lengths, checksums)

    async def objstore_fetch(self, packed_keys: list) -> list:
        transport = self.core.transport
        assert isinstance(transport, ObjStoreTransport), "objstore calls reach an agent of the objstore transport"
        return await self.pool.run(transport.handle_fetch, packed_keys)

    async def fault(self, what: str, *args):
        """Fault injection for tests, refused unless the agent's process was started with
        ``MEMSNAP_TESTING_HOOKS=1`` (see ``memsnap.testing``)."""
        from memsnap import testing

        return await self.pool.run(testing.inject, self.core, what, *args)

    def _fenced(self) -> None:
        """This node was declared lost while it was paused or cut off, and came back: its agent
        must not serve or commit anything again. It frees what it holds and its process ends
        (its ranks' next call to it fails; a host that comes back joins as a new node)."""
        log.error("node %s was declared lost and is fenced: this agent stops", self.core.node[:12])
        with contextlib.suppress(Exception):
            self.core.shutdown()
        os._exit(1)

    async def shutdown(self) -> None:
        self._beating.set()
        await self.pool.run(self.core.shutdown)
        ray.actor.exit_actor()


def agent_for(cfg: SnapshotConfig, node_id: str):
    """The agent of ``cfg.job`` on ``node_id``: the existing one, or a new one pinned there.
    The secret is not an argument: the agent reads it from Ray's key-value store."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    extra = {}
    if cfg.device_buffer and cfg.device_backend != "cpu":
        # num_gpus=0 (no GPU taken from training), yet every GPU of the node visible to it
        from memsnap.device.visibility import agent_runtime_env

        extra["runtime_env"] = agent_runtime_env()
    # @ray.remote turns the class into an ActorClass; ray's annotation keeps the bare class
    return SnapshotAgent.options(  # type: ignore[attr-defined]
        name=naming.agent(cfg.job, node_id),
        namespace=naming.NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=100_000,
        memory=cfg.memory_budget,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        **extra,
    ).remote(cfg.to_dict(), node_id)


find = find_agent
