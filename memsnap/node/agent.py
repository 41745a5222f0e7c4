"""The per-node ``SnapshotAgent`` actor: owns the node's snapshot RAM and its data plane.

One detached agent per node and job, pinned to its node, ``num_cpus=0``. It owns
(a) the arenas the node's ranks capture into (shared memory under /dev/shm, ``keep+1``
slots per rank), (b) the parity it computes and (c) the chunks it holds for its peers,
all charged against ``memory_budget``. Training processes never own snapshot bytes.

``AgentCore`` composes one object per concern: ``versions.Versions`` (the node's version
table, its only writer: each step's state, and which version gives way under pressure),
``versions.SlotPolicy`` (what lean mode changes), ``slots.Slots`` (the arenas behind the
slots), ``sender.Sender`` (one snapshot out to the holders), ``repair.Repair`` (bytes back
in, and this node's own copy out to a rank that moved), and the held chunks
(``chunkstore``) behind the transport.

Call protocol (who makes each call in brackets; the Ray face is ``actors.SnapshotAgent``,
and ``relay.NodeRelay`` speaks to the coordinator for the node's ranks, once per node):

  0. [rank]  ``join(rank, world)`` then ``members(timeout)``: registration and the placement
     answer, through the agent (the agent's own address never travels through a rank).
  1. [rank]  ``begin(t, rank, nbytes)`` -> the path of an arena region (the rank maps it
     once), or ``{"skipped": why}`` when every slot is busy (newest wins: ``Slots.free_slot``).
  2. [rank]  capture the state into that region (``memsnap.state.capture.copy_into``).
  3. [rank]  ``captured(t, rank, manifest_json)``; ``Snapshotter.save`` returns here.
  4. [agent, background, once every local rank of ``t`` has captured] fill the tensor
     checksums, stripe the node's stream (its ranks' regions back to back), encode parity
     with ``encode_into`` into the parity buffer, push shard ``j`` of every stripe to
     holder ``j`` (the layout is cached until the placement changes), and hand the holders
     the ranks' manifests (``hold_manifests``: metadata stays with the data).
  5. [holders] the transport acknowledges every chunk (``ChunkStore.complete``).
  6. [agent]  ``coordinator.node_ready(NodeReady)``: a few hundred bytes, whatever the tensor count.
  7. [coordinator] when every node is ready: ``commit(CommitNotice)`` on every agent, which
     frees the versions and held chunks of steps it no longer keeps. In lean mode
     (``local_copy=False``) it frees ``t``'s own version too: its one arena slot is only the
     staging area of the next save, and its pages go back to the kernel meanwhile.
  8. [rank]  ``wait(t)``: answered from the commit notices this agent received.

Restore: ``local(t, rank)`` names the arena still holding a rank's bytes; ``manifest_for``
finds a rank's manifest here or at a holder of its owner. A rank restoring from peers over
TCP reads its bytes itself (``memsnap.coding.receive``); ``recover`` rebuilds a rank's bytes from its
peers into an arena instead (the objstore transport, and re-protection's ``rebuild_local``,
which gives a restored node its local copy back); ``rebuild`` re-creates the shards a lost
holder had (re-protection). Spill runs on a background thread (``memsnap.node.spill``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import ray

from memsnap import metrics, naming
from memsnap.config import SnapshotConfig, tcp_options, tunable
from memsnap.directory import Directory
from memsnap.errors import CommitError, ConfigError, MemoryBudgetError
from memsnap.memory import arena as arenas
from memsnap.memory.arena import MemoryBudget
from memsnap.node.chunkstore import HeldChunks
from memsnap.node.repair import Repair
from memsnap.node.sender import Sender
from memsnap.node.slots import Slots
from memsnap.node.versions import CAPTURING, FAILED, SlotPolicy, Version, Versions
from memsnap.policy import agent_ram
from memsnap.records import AgentState, CommitNotice, Holders, Inventory, NodeReady, Placed, RankSource
from memsnap.transport import make_transport

if TYPE_CHECKING:
    from memsnap.device.runtime import AgentDevice
    from memsnap.node.spill import Spiller

log = logging.getLogger("memsnap.agent")

BUSY_WARN_S = 60.0  # at most one "saves arrive faster than the pipeline" warning a minute


class AgentCore:
    """Everything the agent does, as a plain object (``actors.SnapshotAgent`` only wraps it)."""

    def __init__(self, config: dict, node_id: str, secret: bytes, host: str = "127.0.0.1"):
        self.cfg = SnapshotConfig.from_dict(config)
        self.node = node_id
        self.lock = threading.RLock()
        self.counters = {
            "failed_snapshots": 0,
            "pushed_bytes": 0,
            "repaired_chunks": 0,
            "superseded": 0,
            "skipped_busy": 0,
        }
        self.budget = MemoryBudget(self.cfg.memory_budget, node_id)
        self.policy = SlotPolicy.of(self.cfg)  # what lean mode changes
        self.versions = Versions(self.policy, self.cfg.slots, self.cfg.keep, self.counters, self._replaced)
        self.slots = Slots(self.cfg, node_id, self.budget, self.lock, self.versions, self._pinned)
        self.arenas = self.slots.arenas  # (the same table)
        self.infos: dict[int, NodeReady] = {}  # this node's own NodeReady, by step
        from memsnap.coding.codec import codec_for  # (the native kernels load with the first agent)

        self.codec = codec_for(self.cfg.k, self.cfg.m)
        self.store = HeldChunks(self.budget)
        self.transport = make_transport(self.cfg.transport, secret=secret, host=host, **self._transport_opts())
        self.dir = Directory(self.cfg.job)
        # (the coordinator, the directory and the generation are looked up at each use: the
        # Ray face, and tests, set them after this)
        self.sender = Sender(
            node=node_id,
            cfg=self.cfg,
            lock=self.lock,
            versions=self.versions,
            slots=self.slots,
            transport=self.transport,
            codec=self.codec,
            budget=self.budget,
            counters=self.counters,
            infos=self.infos,
            call=lambda *a: self.call(*a),
            tell=lambda *a: self.tell(*a),
            call_all=lambda *a, **kw: self.dir.call_all(*a, **kw),
            world=lambda: self.world,
        )
        self.repair = Repair(
            node=node_id,
            cfg=self.cfg,
            lock=self.lock,
            versions=self.versions,
            slots=self.slots,
            infos=self.infos,
            store=self.store,
            transport=self.transport,
            codec=self.codec,
            budget=self.budget,
            counters=self.counters,
            agent=lambda node: self.dir.agent(node),
            gen=lambda: self.gen,
        )
        self.store.own = self.repair.serve_own
        self.address = self.transport.start(self.store)
        swept = arenas.sweep()  # arenas of agents killed by SIGKILL or the OOM killer
        if swept:
            log.warning("removed %d shared-memory file(s) of agents that are gone: %s", len(swept), swept[:4])
        arenas.check_capacity(self.cfg.memory_budget)
        self.committed: dict[int, CommitNotice] = {}  # the commit notices of the steps kept
        self.newest: int | None = None  # the newest committed step this node heard of
        self.coordinator: Callable[[], Any] | None = None  # -> the coordinator's handle (set by the Ray face)
        self.changed = lambda: None  # wakes the relay's waiters (set by the Ray face)
        self.ranks: set[int] = set()
        self.holders: dict[int, dict] = {}  # rank -> {"run", "process"} of the rank registered here
        self.run: str | None = None  # the job's run id, as the coordinator answered this node's last join
        self._rank_bytes: dict[int, int] = {}  # each rank's newest snapshot size (the budget check)
        self._began: dict[int, int] = {}  # each rank's newest step begun here (``_departed``)
        self._warned_need = 0  # the largest budget need warned about so far
        self.world: int | None = None
        self.abandoned: dict[int, str] = {}  # steps dropped here (failed anywhere, skipped, replaced)
        self.skipped: set[int] = set()  # of those, the ones skipped or replaced under load: a rank that
        # begins one skips it too (a failed step is still attempted: each rank's own error is its own)
        self.gen = 0
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="memsnap-agent")
        self.spiller: Spiller | None = None
        self._device: AgentDevice | None = None  # the device tier (memsnap.device.runtime), made on first use when on

    # --- the device tier (opt-in: cfg.device_buffer) ---------------------------------------------
    @property
    def device(self):
        if self._device is None:
            if not self.cfg.device_buffer:
                raise ConfigError(
                    "the device tier is off for this job; turn it on with device_buffer=True "
                    "(or a byte budget) on every rank"
                )
            from memsnap.device.runtime import AgentDevice

            with self.lock:
                if self._device is None:
                    self._device = AgentDevice(
                        self.node,
                        self.cfg.job,
                        self.cfg.device_backend,
                        self.cfg.device_buffer,
                        submit=self.pool.submit,
                        arena=self._arena_of,
                        captured=self.captured,
                        failed=lambda step, why: self.tell("node_failed", step, self.node, why),
                    )
        return self._device

    def _arena_of(self, step: int, rank: int):
        """The host arena of ``rank``'s slot of ``step`` and its byte count, or None when the
        step is no longer here (abandoned or replaced meanwhile)."""
        with self.lock:
            v = self.versions.get(step)
            nbytes = None if v is None else v.sizes.get(rank)
            return None if v is None or nbytes is None else (self.slots.arena(rank, v.slot, nbytes), nbytes)

    def _transport_opts(self) -> dict:
        if self.cfg.transport == "objstore":
            return {"actor_name": naming.agent(self.cfg.job, self.node), "namespace": naming.NAMESPACE}
        return tcp_options(self.cfg)

    # --- 1. begin ----------------------------------------------------------------------------
    def begin(self, step: int, rank: int, nbytes: int, wait: bool = False) -> dict:
        """An arena for ``rank``'s capture of ``step``: ``{"path", "nbytes", "slot"}``; or
        ``{"skipped": why}`` when every slot is busy (the job drops the step); with ``wait``,
        ``{"busy": why}`` instead, nothing recorded, so the caller may ask again once a slot frees."""
        self.slots.await_ahead(rank)  # a slot being made ahead for this rank: take it, not a fresh one
        with self.lock:
            self.ranks.add(rank)
            self.counters["newest_begun"] = max(step, self.counters.get("newest_begun", -1))  # (metrics: lag)
            metrics.begun(self.cfg.job, self.node, self.counters["newest_begun"], self.newest)
            if step in self.skipped:  # skipped or replaced under load: every rank of the job skips it
                return {"skipped": self.abandoned.get(step, "skipped under load")}
            v = self.versions.get(step)
            if v is not None and v.state not in (CAPTURING, FAILED):
                raise CommitError(
                    f"step {step} is already {v.state} on node {self.node[:12]}; "
                    "save each step once, with a step number larger than the last"
                )
            if v is None or v.state is FAILED:
                slot = self.slots.free_slot(step)
                if slot is None:
                    if wait:
                        return {"busy": f"every arena slot is busy {self.versions.busy()}"}
                    return {"skipped": self._skip(step)}
                v = self.versions.begin(step, slot, gen=self.gen)
            try:
                arena = self.slots.arena(rank, v.slot, nbytes)
            except MemoryBudgetError:
                self.versions.withdraw(v)
                raise
            self.versions.add_rank(v, rank, nbytes)
            self._began[rank] = max(step, self._began.get(rank, step))
            self._check_budget_size(rank, nbytes)
        self.store.announce(step)  # holders accept pushes up to store_step_window above it
        return {"path": arena.path, "nbytes": nbytes, "slot": v.slot}

    def _replaced(self, v: Version, was: str, step: int) -> None:
        """``step`` took ``v``'s slot: ``v`` is dropped here and, through the coordinator, on
        every node (not a failure: a newer snapshot replaces it). Called under the lock."""
        why = v.error or f"replaced by step {step}"  # (Slots set it just before)
        self.abandoned[v.step] = why  # a rank still capturing it drops its capture quietly
        self.skipped.add(v.step)
        self.counters["superseded"] += 1
        self._busy_warning(f"step {v.step} ({was}) was replaced by step {step}")
        self.pool.submit(self.tell, "node_skipped", v.step, self.node, why)

    def _skip(self, step: int) -> str:
        """No slot for ``step``: the save is skipped and counted, the older ones go on."""
        why = f"node {self.node[:12]}: step {step} skipped, every arena slot is busy {self.versions.busy()}"
        self.counters["skipped_busy"] += 1
        self._busy_warning(why)
        self.abandoned[step] = "skipped: the pipeline was busy"
        self.skipped.add(step)
        self.pool.submit(self.tell, "node_skipped", step, self.node, why)
        return why

    def _check_budget_size(self, rank: int, nbytes: int) -> None:
        """Warn once (again only if it grows) when ``memory_budget`` is below what this node's
        state needs with peer protection (``memsnap plan``): full holders would refuse snapshots
        taken back to back. Called under the lock."""
        self._rank_bytes[rank] = nbytes
        state = sum(self._rank_bytes.values())
        need = int(agent_ram(state, self.cfg.k, self.cfg.m, self.cfg.keep))
        if need <= self.cfg.memory_budget or need <= self._warned_need:
            return
        self._warned_need = need
        log.warning(
            "node %s: memory_budget=%d bytes is below the %d this node needs for %d bytes of its ranks' "
            "state with keep=%d and RS(%d,%d) (its keep+1 slots and its peers' pieces, memsnap plan); "
            "holders will refuse snapshots taken back to back: raise memory_budget to %d, or lower keep",
            self.node[:12],
            self.cfg.memory_budget,
            need,
            state,
            self.cfg.keep,
            self.cfg.k,
            self.cfg.m,
            need,
        )

    def _busy_warning(self, what: str) -> None:
        now = time.monotonic()
        if now - getattr(self, "_warned_busy", -BUSY_WARN_S) < BUSY_WARN_S:
            return
        self._warned_busy = now
        rate, per = self.sender.throughput.describe()
        log.warning(
            "node %s: snapshots arrive faster than the pipeline sends them (%s; %d replaced, %d skipped "
            "so far). The pipeline moves %s, one snapshot per %s: snapshot less often (every_steps=N "
            "or every_seconds=T above that), or auto=True to let the policy choose",
            self.node[:12],
            what,
            self.counters["superseded"],
            self.counters["skipped_busy"],
            rate,
            per,
        )

    def _pinned(self, step: int) -> bool:
        return self.spiller is not None and self.spiller.busy_with(step)

    def tell(self, method: str, *args) -> None:
        """``method(*args)`` on the coordinator, logged instead of raised when it fails (the
        coordinator learns the same from the next commit anyway)."""
        try:
            self.call(method, *args)
        except Exception as exc:
            log.warning("could not tell the coordinator %s%s: %s", method, args[:2], exc)

    def call(self, method: str, *args):
        """``method(*args)`` on the coordinator, waited for (a bounded small call)."""
        return _call(getattr(self._coordinator(), method).remote(*args))

    # --- 3. captured ---------------------------------------------------------------------------
    def captured(self, step: int, rank: int, manifest_json: str, local_ranks: list[int]) -> None:
        with self.lock:
            v = self.versions.get(step)
            if step in self.abandoned:
                log.info("step %d was abandoned (%s); its capture is dropped", step, self.abandoned[step])
                self.versions.capture_dropped(step)
                return
            if v is None or v.state is not CAPTURING or rank not in v.sizes:
                raise CommitError(
                    f"captured(step={step}, rank={rank}) without a matching begin on "
                    f"node {self.node[:12]}; call begin first"
                )
            if not self.versions.captured(v, rank, manifest_json, local_ranks):
                return
        metrics.captured(self.cfg.job, step)
        self.pool.submit(self.sender.send, v, sorted(local_ranks))  # 4-6: sender.py

    # --- 7. commit -------------------------------------------------------------------------------
    def commit(self, notice: CommitNotice) -> None:
        step, keep = notice.step, set(notice.keep)
        self.store.announce(step)
        with self.lock:
            first = step not in self.committed  # (re-protection tells the agents of a commit again)
            self.committed[step] = notice
            self.newest = max(step, -1 if self.newest is None else self.newest)
            for s in [s for s in self.committed if s < step and s not in keep]:
                del self.committed[s]
            self._moved(step, notice.moved)
            v = self.versions.get(step)
            if first:
                for rank in self._departed(step, v):
                    self._depart(rank, step)
            self.versions.committed(step, keep, bool(notice.spill), self._pinned, self.slots.release)
            self._forget_meta(lambda s: s in keep or s > step)
        self.store.drop(lambda key: key.step in keep or key.step > step)
        self.changed()
        if first:
            metrics.committed_here(self.cfg.job, self.node, step, self.counters.get("newest_begun"))
        if self.spiller is not None and first:
            self.spiller.committed(step, notice.spill)

    def _departed(self, step: int, v: Version | None) -> list[int]:
        """The ranks that no longer run here, as the commit of ``step`` shows: a rank that began
        a step here, an older one than ``step``, and took no part in ``step`` here. A committed
        step holds every rank's bytes, and a rank placed on this node can only have saved it
        here, so it saved ``step`` on another node (it moved: a standby took it, or a restart
        placed it elsewhere). Not while the spill is writing a version that holds it. Called
        under the lock."""
        here = set(v.sizes) if v is not None else set()
        return [
            rank
            for rank, began in sorted(self._began.items())
            if began < step
            and rank not in here
            and not any(rank in o.sizes and self._pinned(o.step) for o in self.versions.values())
        ]

    def _depart(self, rank: int, step: int) -> None:
        """``rank`` runs on another node now: its arenas go (their RAM and their share of the
        memory budget, which a rank that comes to this node next needs), with its bytes in the
        older versions here (step ``step``, newer, is committed without them) and its
        registration (a rebuilt coordinator must not place it here). Called under the lock."""
        freed = self.slots.forget_rank(rank)
        self.ranks.discard(rank)
        for table in (self._began, self._rank_bytes, self.holders):
            table.pop(rank, None)
        log.info(
            "node %s: rank %d saved step %d on another node; its %d arena(s) here (%.1f MiB) are freed",
            self.node[:12],
            rank,
            step,
            freed[0],
            freed[1] / 2**20,
        )

    def _moved(self, step: int, moved) -> None:
        """Re-protection rebuilt some owners' shards on new holders: keep the records true."""
        from dataclasses import replace

        for owner, holders in moved.items():
            if owner == self.node and step in self.infos:
                self.infos[step] = replace(self.infos[step], holders=tuple(holders))
            self.repair.moved(step, owner, holders)

    def _forget_meta(self, keep) -> None:
        for s in [s for s in self.infos if not keep(s)]:
            del self.infos[s]
        self.repair.forget(keep)

    def resolved(self, step: int) -> bool:
        """Whether a ``wait(step)`` may return: committed (or a newer step); or failed or skipped
        with no older step of this node still on its way to a commit (one that commits moments
        later is the newest committed step ``wait`` answers)."""
        with self.lock:
            if self.newest is not None and self.newest >= step:
                return True
            return step in self.abandoned and not self.versions.in_flight_before(step)

    # --- manifests held beside the chunks ----------------------------------------------------------
    def committed_infos(self) -> AgentState:
        """What a rebuilt coordinator needs from this agent: its ranks, address, restore
        generation, the steps it heard committed and every NodeReady it keeps (its own and
        those of the owners it holds for)."""
        with self.lock:
            return AgentState(
                self.address,
                self.gen,
                tuple(sorted(self.ranks)),
                tuple(sorted(self.committed)),
                tuple(self.infos.values()) + tuple(m[0] for m in self.repair.held_meta.values()),
                self.run,
                {r: (h.get("run"), h.get("process", "")) for r, h in self.holders.items()},
            )

    def joined(self, rank: int, world: int, claim: dict | None = None, gen: int = 0) -> None:
        """The coordinator accepted ``rank`` (of ``world``) here; ``claim``: its run id and process;
        ``gen``: the job's restore generation now. The steps this node takes from here on carry
        it: a node that joins a running job without a restore round (a standby that took a live
        state) must not send steps the commit ignores as older than the last restore."""
        with self.lock:
            self.gen = max(self.gen, gen)
            if self.world is not None and world != self.world:
                self.ranks = set()  # the job came back with another world size: its ranks are new
                self.holders = {}
            self.ranks.add(rank)
            self.world = world
            if claim is not None:
                self.holders[rank] = {"run": claim.get("run"), "process": claim.get("process", "")}
                self.run = claim.get("run") or self.run

    def placed(self, answer: Placed) -> None:
        """The coordinator's placement answer: cache this node's holders for its sends."""
        with self.lock:
            self.world = answer.world
            self.sender.holders = answer.holders or Holders((), (), answer.epoch)

    def spilled(self, step: int, ranks: list[int]) -> None:
        """The spill thread wrote ``ranks`` of ``step``: tell the coordinator; in lean mode the
        version was held only for this, so its slot is free again."""
        self.call("spilled", step, ranks)
        with self.lock:
            v = self.versions.spilled(step)  # (lean mode: the version was held only for this)
            if v is not None:
                self.slots.release(v)

    def abandon(
        self, step: int, why: str = "a node or holder failed before acknowledging", failed: bool = True
    ) -> None:
        """The coordinator gave up on ``step`` (``failed=False``: a node skipped or replaced it,
        which is not a failure): forget it here."""
        with self.lock:
            self.abandoned[step] = why
            if not failed:
                self.skipped.add(step)
            for s in sorted(self.abandoned)[:-16]:
                del self.abandoned[s]
            self.skipped &= set(self.abandoned)
            self.versions.abandoned(step, why, failed)
            if step not in self.committed:
                self._forget_meta(lambda s: s != step)
        self.store.give_up(step)
        self.changed()

    def roll_back(self, step: int | None) -> list[int]:
        """The job's restore plan loads ``step`` (None: a fresh start). Every step above it that
        is not committed here can no longer be the one the job resumes from, so it is given up
        now, not when the round completes: its sender stops at its next chunk, a rank still
        capturing it drops the capture, and holders refuse its chunks (the data plane is the
        restore's). Not a failure: the job resumes below it. The steps given up."""
        last = -1 if step is None else step
        with self.lock:
            steps = [s for s in self.versions.uncommitted_after(last) if s not in self.abandoned]
        for s in steps:
            self.abandon(s, f"the job rolls back to step {step}", failed=False)
        if steps:
            log.info("node %s: steps %s given up: the job rolls back to step %s", self.node[:12], steps, step)
        return steps

    def count(self, counter: str, n: int) -> None:
        """Add ``n`` to one of this node's counters (e.g. chunks a rank's restore repaired)."""
        with self.lock:
            self.counters[counter] = self.counters.get(counter, 0) + n

    def resume(self, step: int | None, gen: int) -> None:
        """The job restored ``step`` (None: started fresh) in restore generation ``gen``: forget
        every uncommitted version after it, so the resumed run can take those steps again."""
        last = -1 if step is None else step
        log.info("node %s resumes from step %s in restore generation %d (was %d)", self.node[:12], step, gen, self.gen)
        with self.lock:
            self.gen = max(self.gen, gen)
            self.counters["newest_begun"] = min(self.counters.get("newest_begun", -1), last)  # (metrics: lag)
            self.versions.resumed(last, f"the job resumed from step {step}")
            for s in [s for s in self.abandoned if s > last]:
                del self.abandoned[s]
            self.skipped &= set(self.abandoned)
            for s in [s for s in self.committed if s > last]:
                del self.committed[s]
            self.newest = max(self.committed, default=None)
            records = set(self.committed)
            self._forget_meta(lambda s: s <= last or s in records)
        self.store.reopen(last)
        self.store.drop(lambda key: key.step <= last or key.step in records)

    # --- restore ---------------------------------------------------------------------------------
    def local(self, step: int, rank: int) -> dict | None:
        """Where this node still holds ``rank``'s committed bytes of ``step``, or None."""
        with self.lock:
            v = self.versions.committed_version(step)
            if v is None or rank not in v.manifests:
                return None
            arena = self.arenas.get((rank, v.slot))
            assert arena is not None  # holds() checked it
            return {"path": arena.path, "nbytes": v.sizes[rank], "manifest": v.manifests[rank]}

    # --- slots and repair (slots.py, repair.py: the Ray face calls them straight) ---------------
    def ready_slots(self, rank: int, nbytes: int) -> int:
        with self.lock:
            self.ranks.add(rank)
        return self.slots.ready_slots(rank, nbytes)

    def ready_standby(self, nbytes: int) -> int:
        return self.slots.ready_standby(nbytes)

    def rebuild_local(self, step: int, rank: int, src: RankSource, replace: bool = False) -> bool:
        return self.repair.rebuild_local(step, rank, src, replace)

    # --- introspection -----------------------------------------------------------------------
    def inventory(self) -> Inventory:
        """What this agent holds (the coordinator's coverage map) and what its RAM is used for."""
        with self.lock:
            versions = self.versions.summary()
            arena_bytes = sum(a.nbytes for a in self.arenas.values() if a.resident)
            local_bytes = self.versions.local_bytes()
            return Inventory(
                self.node,
                self.address,
                versions,
                self.store.inventory(),
                tuple(sorted(self.committed)),
                {
                    "arena": arena_bytes,
                    "local": local_bytes,
                    "held": self.store.held_bytes(),
                    "parity": self.sender.parity_bytes(),
                    "budget_used": self.budget.used,
                    "budget": self.budget.budget,
                },
                dict(self.counters),
                None if self.spiller is None else self.spiller.status(),
            )

    def _coordinator(self):
        """The job's coordinator (found again, or a new one, by the Ray face)."""
        if self.coordinator is None:
            raise CommitError("this agent has no coordinator to talk to (not inside its Ray actor)")
        return self.coordinator()

    def shutdown(self) -> None:
        if self.spiller is not None:
            self.spiller.stop()
        self.transport.close()
        if self._device is not None:
            self._device.close()
        with self.lock:
            self.slots.close_all()


def _call(ref, timeout: float | None = None):
    return ray.get(ref, timeout=timeout or tunable("call_timeout_s"))
