"""The agent's Ray face: one detached asyncio actor per node and job around ``AgentCore``
(``memsnap.node.agent``: the protocol) and ``NodeRelay`` (its ranks' calls toward the
coordinator), its heartbeat thread, and ``agent_for``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time

import ray

from memsnap import identity, naming
from memsnap.actors.coordinator import coordinator_for
from memsnap.actors.pool import LOST, Pool, log_to_stderr
from memsnap.config import SnapshotConfig, tunable
from memsnap.directory import find_agent
from memsnap.node.agent import AgentCore
from memsnap.node.relay import NodeRelay
from memsnap.records import CommitNotice, RankSource
from memsnap.secret import job_secret
from memsnap.transport.objstore import ObjStoreTransport
from memsnap.waiting import Signal

log = logging.getLogger("memsnap.actors")

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


@ray.remote
class SnapshotAgent:
    """The Ray actor around ``AgentCore`` and ``NodeRelay``; see ``agent.py`` for the protocol."""

    def __init__(self, config: dict, node_id: str):
        log_to_stderr()
        cfg = SnapshotConfig.from_dict(config)
        self.core = AgentCore(config, node_id, job_secret(cfg.job), host=ray.util.get_node_ip_address())
        self.signal = Signal()
        self.core.changed = self.signal.notify
        self.core.coordinator = self._coordinator
        self.pool = Pool(int(tunable("agent_threads")), "memsnap-agent")
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
            asyncio.ensure_future(self.pool.run(self.core.slots.prepare, rank, nbytes))
        return {"address": self.core.address, "run": run}

    async def running(self, tokens: list[str]) -> list[str]:
        """Which of these rank processes still run here (the coordinator asks before a rank of
        another run takes over one of theirs)."""
        return identity.running(tokens)

    async def working(self, tokens: list[str]) -> list[str]:
        """Which of these processes run here and are not stopped (the in-place controller asks
        before it calls a silent member lost: a slow process is waited for)."""
        return identity.working(tokens)

    async def members(self, timeout: float) -> dict:
        answer = await self.relay.answer(timeout)
        return {"ranks": list(answer.ranks), "peers": answer.peers, "why": answer.why}

    async def ready_slots(self, rank: int, nbytes: int) -> int:
        """Back ``rank``'s arena slots for ``nbytes`` now, ahead of its first saves."""
        return await self.pool.run(self.core.ready_slots, rank, nbytes)

    async def ready_standby(self, nbytes: int) -> int:
        """Back the arena slots of the warm standby on this node (any rank of at most ``nbytes``)."""
        return await self.pool.run(self.core.ready_standby, nbytes)

    async def begin(self, step: int, rank: int, nbytes: int, wait_s: float = 0.0) -> dict:
        return await begin_waiting(self.pool.run, self.core, self.signal, step, rank, nbytes, wait_s)

    async def captured(self, step: int, rank: int, manifest_json: str, local_ranks: list[int]) -> None:
        return await self.pool.run(self.core.captured, step, rank, manifest_json, local_ranks)

    # the device tier (memsnap.device.runtime), opt-in
    async def device_begin(self, step: int, rank: int, device: str, nbytes: int) -> str | None:
        return await self.pool.run(self.core.device.begin, step, rank, device, nbytes)

    async def device_captured(
        self, step: int, rank: int, device: str, manifest_json: str, local_ranks: list[int]
    ) -> None:
        return await self.pool.run(self.core.device.captured, step, rank, device, manifest_json, local_ranks)

    async def device_source(self, rank: int, step: int) -> list | None:
        return await self.pool.run(self.core.device.source, rank, step)

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
        return await self.pool.run(self.core.repair.manifest_for, step, rank, RankSource.from_wire(source))

    async def recover(self, step: int, rank: int, source: dict) -> dict:
        return await self.pool.run(self.core.repair.recover, step, rank, RankSource.from_wire(source))

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
        self.core.sender.holders = None
        self.relay.forget_answer()

    async def spill_now(self, step: int) -> bool:
        """Write committed ``step`` to durable storage now, unthrottled (preemption)."""
        if self.core.spiller is None:
            return False
        self.core.spiller.request(step)
        return True

    async def hold_manifests(self, step: int, owner: str, info: dict, manifests: dict) -> None:
        self.core.repair.hold_manifests(step, owner, info, manifests)

    async def held_manifests(self, step: int, owner: str) -> dict:
        return self.core.repair.held_manifests(step, owner)

    async def committed_infos(self) -> dict:
        return (await self.pool.run(self.core.committed_infos)).to_wire()

    async def rebuild_local(self, step: int, rank: int, source: dict, replace: bool = False) -> bool:
        return await self.pool.run(self.core.rebuild_local, step, rank, RankSource.from_wire(source), replace)

    async def rebuild(self, step: int, k: int, m: int, info: dict, addrs: dict, shard: int) -> int:
        return await self.pool.run(self.core.repair.rebuild, step, k, m, info, addrs, shard)

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
