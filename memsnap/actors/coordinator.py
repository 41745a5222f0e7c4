"""The coordinator's Ray face: one detached asyncio actor per job around ``CoordinatorCore``
(``memsnap.job.coordinator``: the protocol), its heartbeat watch, and ``coordinator_for``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import ray

from memsnap import metrics, naming
from memsnap.actors.pool import Pool, log_to_stderr
from memsnap.config import SnapshotConfig, tunable
from memsnap.directory import find_agent
from memsnap.errors import CommitError
from memsnap.identity import Claim
from memsnap.job.coordinator import CoordinatorCore, adopt_late, rebuild_state
from memsnap.job.liveness import PING_CAP_S
from memsnap.records import RankRestore
from memsnap.waiting import Signal

log = logging.getLogger("memsnap.actors")


@ray.remote
class Coordinator:
    """The Ray actor around ``CoordinatorCore``; see ``coordinator.py`` for the protocol."""

    def __init__(self, config: dict, world_size: int):
        log_to_stderr()
        self.core = CoordinatorCore(config, world_size)
        self.signal = Signal()
        self.core.changed = self.signal.notify
        self.pool = Pool(8, "memsnap-coordinator")
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
        return (await self.pool.run(self.core.join, node, address, ranks, world, claims)).to_wire()

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
        return self.core.answer(node).to_wire()

    async def node_holders(self, node: str) -> dict:
        with self.core.lock:
            return self.core.membership.holders_of(node).to_wire()

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

    async def rank_bytes(self) -> int | None:
        return self.core.rank_bytes()

    async def doubt(self, nodes: list[str], why: str) -> list[str]:
        return self.core.doubt(nodes, why)

    async def cleared(self, node: str) -> bool:
        return self.core.cleared(node)

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

    async def _round_reached(self, attempt: int, table: str) -> None:
        """Until every rank of restore round ``attempt`` has ``arrived`` or is ``done`` (``table``);
        a ``CommitError`` naming the ranks missing at the deadline, or why the round was cancelled."""
        timeout = tunable("restore_timeout_s")
        rounds = self.core.rounds
        reached = rounds.all_arrived if table == "arrived" else rounds.all_done
        if not await self.signal.wait_for(lambda: reached(attempt) or rounds.cancelled(attempt), timeout):
            raise CommitError(
                f"restore: timed out after {timeout:.0f} s waiting for ranks {rounds.missing(attempt, table)}"
                + (" to finish" if table == "done" else "")
            )
        why = rounds.cancelled(attempt)
        if why is not None:
            raise CommitError(f"restore: the round was cancelled: {why}")

    async def restore_plans(self, node: str, attempt: int) -> dict:
        await self._round_reached(attempt, "arrived")
        async with self.planning.setdefault(attempt, asyncio.Lock()):  # one plan, made once
            if await self.pool.run(self.core.plan_early, attempt) is None:  # a doubted node might better it
                rounds = self.core.rounds
                await self.signal.wait_for(
                    lambda: not self.core.doubted or rounds.cancelled(attempt), tunable("doubt_wait_s")
                )
                await self.pool.run(self.core.plan, attempt)
        return await self.pool.run(self.core.plans_for, node, attempt)

    async def restore_report(self, node: str, attempt: int, reports: dict) -> None:
        self.core.restore_report(attempt, {int(r): RankRestore.from_wire(rep) for r, rep in reports.items()})

    async def restore_result(self, node: str, attempt: int) -> dict:
        await self._round_reached(attempt, "done")
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
