"""The per-node ``SnapshotAgent`` actor: owns the node's snapshot RAM and its data plane.

One detached agent per node and job, pinned to its node, ``num_cpus=0``. It owns
(a) the arenas the node's ranks capture into (shared memory under /dev/shm, ``keep+1``
slots per rank), (b) the parity it computes and (c) the chunks it holds for its peers,
all charged against ``memory_budget``. Training processes never own snapshot bytes.

Data path of one save of step ``t`` (who makes each call in brackets):

  1. [rank]  ``begin(t, rank, nbytes)`` -> the path of an arena region; the rank maps it once.
  2. [rank]  capture the state into that region (``memsnap.capture.capture(out=...)``).
  3. [rank]  ``captured(t, rank, manifest_json)``; ``Snapshotter.save`` returns here.
  4. [agent, background, once every local rank of ``t`` has captured] fill the tensor
     checksums, stripe the node's stream (its ranks' regions back to back), encode parity
     with ``encode_into`` into the parity buffer, push shard ``j`` of every stripe to
     ``placement.holders[node][j]``.
  5. [holders] the transport acknowledges every chunk (``ChunkStore.complete``).
  6. [agent]  ``coordinator.node_ready(t, node, info)`` (rank regions + manifests).
  7. [coordinator] when every node is ready: ``agent.commit(t, record, keep)`` on every
     agent, which frees the versions and held chunks of steps it no longer keeps. In lean
     mode (``local_copy=False``) it frees ``t``'s own version too: its one arena slot is
     only the staging area of the next save, and its pages go back to the kernel meanwhile.

Restore: ``local(t, rank)`` names the arena still holding a rank's bytes. A rank restoring
from peers over TCP reads them itself (``memsnap.receive``); ``recover`` rebuilds a rank's
bytes from its peers into an arena instead (the objstore transport, and re-protection's
``rebuild_local``, which gives a restored node its local copy back); ``rebuild`` re-creates
the shards a lost holder had (re-protection). Spill runs on a background thread
(``memsnap.spill``).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray

from memsnap import encode, naming
from memsnap.arena import Arena, MemoryBudget, OwnedBuffer
from memsnap.checksum import fill_checksums
from memsnap.chunkstore import HeldChunks
from memsnap.config import SnapshotConfig, tunable
from memsnap.errors import CommitError, MemoryBudgetError
from memsnap.manifest import Manifest
from memsnap.transport.base import ChunkKey, make_transport

log = logging.getLogger("memsnap.agent")

LIVE = ("capturing", "encoding", "ready", "committed", "restoring")


@dataclass
class Version:
    """One step's bytes on this node: which slot, which ranks, how far it got."""

    step: int
    slot: int
    state: str = "capturing"  # capturing -> encoding -> ready -> committed | failed
    sizes: dict[int, int] = field(default_factory=dict)         # rank -> nbytes
    manifests: dict[int, str] = field(default_factory=dict)     # rank -> manifest JSON
    error: str | None = None
    gen: int = 0  # the restore generation it was taken in (see ``AgentCore.resume``)


class AgentCore:
    """Everything the agent does, as a plain object (the actor class below only wraps it)."""

    def __init__(self, config: dict, node_id: str, secret: bytes, host: str = "127.0.0.1"):
        self.cfg = SnapshotConfig.from_dict(config)
        self.node = node_id
        self.budget = MemoryBudget(self.cfg.memory_budget, node_id)
        self.store = HeldChunks(self.budget)
        self.transport = make_transport(self.cfg.transport, secret=secret, host=host,
                                        **self._transport_opts())
        self.address = self.transport.start(self.store)
        self.codec = codec_for(self.cfg.k, self.cfg.m)
        self.lock = threading.RLock()
        self.send_lock = threading.Lock()
        self.rebuild_lock = threading.Lock()
        self.versions: dict[int, Version] = {}
        self.arenas: dict[tuple[int, int], Arena] = {}
        self.parity: dict[int, OwnedBuffer] = {}
        self.records: dict[int, dict] = {}
        self.ranks: set[int] = set()
        self.world: int | None = None
        self.abandoned: dict[int, str] = {}
        self.gen = 0
        self.counters = {"failed_snapshots": 0, "pushed_bytes": 0, "repaired_chunks": 0}
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="memsnap-agent")
        self.spiller = None
        self.prepared: dict[int, Arena] = {}  # rank -> a touched arena its peer restore will fill
        self.preparing: dict[int, threading.Event] = {}

    def _transport_opts(self) -> dict:
        if self.cfg.transport == "objstore":
            return {"actor_name": naming.agent(self.cfg.job, self.node), "namespace": naming.NAMESPACE}
        return {}

    # --- 1. begin ----------------------------------------------------------------------------
    def begin(self, step: int, rank: int, nbytes: int) -> dict:
        with self.lock:
            self.ranks.add(rank)
            v = self.versions.get(step)
            if v is not None and v.state not in ("capturing", "failed"):
                raise CommitError(f"step {step} is already {v.state} on node {self.node[:12]}; "
                                  "save each step once, with a step number larger than the last")
            if v is None or v.state == "failed":
                v = self.versions[step] = Version(step, self._free_slot(step), gen=self.gen)
            try:
                arena = self._arena(rank, v.slot, nbytes)
            except MemoryBudgetError:
                if not v.sizes:
                    self.versions.pop(step)
                raise
            v.sizes[rank] = nbytes
            v.manifests.pop(rank, None)
            return {"path": arena.path, "nbytes": nbytes, "slot": v.slot}

    def _free_slot(self, step: int) -> int:
        self._supersede(step)
        free = self._free_slots()
        committed = sorted(s for s, v in self.versions.items() if v.state == "committed")
        if not free and len(committed) >= 2 and not self._pinned(committed[0]):
            self.versions.pop(committed[0])  # a newer committed version stays whole
            free = self._free_slots()
        if not free and (self.cfg.local_copy or self.cfg.spill is not None):  # sent but never
            # committed: a newer step replaces the oldest such version (in lean mode without a
            # spill a sent version holds no slot)
            waiting = sorted(s for s, v in self.versions.items() if v.state == "ready" and s < step)
            if waiting:
                self._fail(self.versions[waiting[0]], f"replaced by step {step} before it committed")
                self.versions.pop(waiting[0])
                free = self._free_slots()
        if not free:
            busy = sorted((v.step, v.state) for v in self.versions.values() if v.state in LIVE)
            raise MemoryBudgetError(
                f"node {self.node[:12]}: no free arena slot for step {step}; versions in use: {busy}. "
                "The previous snapshot is still being sent: save less often"
                + (", or raise keep" if self.cfg.local_copy else " (local_copy=False keeps one slot per rank)"))
        return free[0]

    def _supersede(self, step: int) -> None:
        """Give up older uncommitted versions and free committed ones beyond ``keep``."""
        for v in list(self.versions.values()):
            if v.step < step and v.state == "capturing":
                self._fail(v, f"superseded by step {step} before every rank captured")
        committed = sorted(s for s, v in self.versions.items() if v.state == "committed")
        for s in committed[:-self.cfg.keep] if len(committed) > self.cfg.keep else []:
            if not self._pinned(s):
                self.versions.pop(s)
        for s in [s for s, v in self.versions.items() if v.state == "failed"]:
            self.versions.pop(s)

    def _free_slots(self) -> list[int]:
        """Lean mode: a slot is free again once its chunks are acknowledged ("ready"), or, with
        a spill, once its commit arrives and no spill is due (else once it is spilled)."""
        # lean mode: a committed version is still here only while it waits for its spill; with a
        # spill, a sent ("ready") version keeps its slot until its commit says whether it is due
        # (the commit reaches this agent after the coordinator has answered the ranks' wait)
        live = LIVE if self.cfg.local_copy else ("capturing", "encoding", "restoring", "committed") + (
            ("ready",) if self.cfg.spill is not None else ())
        used = {v.slot for v in self.versions.values() if v.state in live}
        return [s for s in range(self.cfg.slots) if s not in used]

    def _pinned(self, step: int) -> bool:
        return self.spiller is not None and self.spiller.busy_with(step)

    def _arena(self, rank: int, slot: int, nbytes: int, prefault: bool = True) -> Arena:
        arena = self.arenas.get((rank, slot))
        if arena is not None and arena.nbytes >= nbytes:
            arena.ensure_backed()  # (lean mode released it: back it before the rank writes)
            return arena
        path = naming.arena_path(self.cfg.job, self.node, rank, slot, self._drop_arena(rank, slot))
        ready = self.prepared.pop(rank, None)
        if ready is not None and ready.nbytes == nbytes:
            ready.rename(path)  # already charged and touched
            arena = ready
        else:
            if ready is not None:
                ready.close(unlink=True)
                self.budget.release(ready.nbytes)
            self.budget.charge(nbytes, f"the arena of rank {rank} (slot {slot})")
            arena = Arena.create(path, nbytes, prefault)
        self.arenas[(rank, slot)] = arena
        return arena

    # --- 0. prepare a peer restore --------------------------------------------------------------
    def prepare(self, rank: int, nbytes: int) -> bool:
        """``rank`` just registered here and will restore ``nbytes`` from its peers (its node
        is new): create and touch the arena now, while the job gathers for the restore, so the
        fetch lands in memory that is already backed (fresh pages cost as much as the copy)."""
        with self.lock:
            if rank in self.prepared or rank in self.preparing or any(
                    r == rank and a.nbytes >= nbytes for (r, _), a in self.arenas.items()):
                return False
            try:
                self.budget.charge(nbytes, f"the restore arena of rank {rank}")
            except MemoryBudgetError as exc:
                log.info("not preparing a restore arena: %s", exc)
                return False
            done = self.preparing[rank] = threading.Event()
        try:
            arena = Arena.create(naming.arena_path(self.cfg.job, self.node, rank, "prep", 0), nbytes)
        except BaseException:
            self.budget.release(nbytes)
            raise
        finally:
            with self.lock:
                self.preparing.pop(rank, None)
            done.set()
        with self.lock:
            self.prepared[rank] = arena
        return True

    def _await_prepared(self, rank: int, timeout: float = 60.0) -> None:
        with self.lock:
            done = self.preparing.get(rank)
        if done is not None:
            done.wait(timeout)

    # --- 3. captured ---------------------------------------------------------------------------
    def captured(self, step: int, rank: int, manifest_json: str, local_ranks: list[int]) -> None:
        with self.lock:
            v = self.versions.get(step)
            if step in self.abandoned:
                log.info("step %d was abandoned (%s); its capture is dropped", step, self.abandoned[step])
                return
            if v is None or v.state != "capturing" or rank not in v.sizes:
                raise CommitError(f"captured(step={step}, rank={rank}) without a matching begin on "
                                  f"node {self.node[:12]}; call begin first")
            v.manifests[rank] = manifest_json
            if not set(local_ranks) <= set(v.manifests):
                return
            v.state = "encoding"
        self.pool.submit(self._send, v, sorted(local_ranks))

    # --- 4-6. encode, push, report ---------------------------------------------------------
    def _send(self, v: Version, local_ranks: list[int]) -> None:
        try:
            with self.send_lock:  # one snapshot is encoded and sent at a time: one parity buffer
                info = self._encode_and_push(v, local_ranks)
        except Exception as exc:  # reported, never raised into the pool
            log.warning("node %s: step %d not sent: %s", self.node[:12], v.step, exc)
            with self.lock:
                self._fail(v, f"{type(exc).__name__}: {exc}")
            _call(self._coordinator().node_failed.remote(v.step, self.node, v.error))
            return
        with self.lock:
            if v.state != "encoding":
                return
            v.state = "ready"
            if not self.cfg.local_copy and self.cfg.spill is None:
                self._release_slot(v)
        _call(self._coordinator().node_ready.remote(v.step, self.node, info))

    def _encode_and_push(self, v: Version, local_ranks: list[int]) -> dict:
        layout = _call(self._coordinator().node_layout.remote(self.node))
        sizes = {r: v.sizes[r] for r in local_ranks}
        chunk = self.cfg.chunk or _choose_chunk(max(sizes.values(), default=0), self.cfg.k)
        regs = encode.regions(sizes, self.cfg.k, chunk)
        encs, ranks = [], {}
        for reg in regs:
            data = self.arenas[(reg.rank, v.slot)].view(0, reg.nbytes)
            man = fill_checksums(Manifest.from_json(v.manifests[reg.rank]), data)
            v.manifests[reg.rank] = man.to_json().decode()
            encs.append(encode.Encoded(reg, data))
            ranks[reg.rank] = dict(reg.to_dict(), owner=self.node, manifest=v.manifests[reg.rank])
        if layout["holders"]:  # peers=False: the local copy (and the spill) is all there is
            self._push_all(v.step, encs, layout["addrs"], chunk)
        return {"chunk": chunk, "ranks": ranks, "holders": layout["holders"], "gen": v.gen}

    def _push_all(self, step: int, encs: list, addrs: list[dict], chunk: int) -> None:
        """Data shards stream to their holders straight from the arenas while parity is encoded
        a batch of stripes at a time into two halves of a small scratch buffer: a half is
        reused once the pushes of the batch it held are acknowledged."""
        k, m = self.cfg.k, self.cfg.m
        timeout = tunable("push_timeout_s")

        def push(j: int, items: list) -> None:
            self.transport.push(addrs[j], items, timeout=timeout)
            self.counters["pushed_bytes"] += sum(len(mv) for _, mv in items)

        total = sum(enc.lay.stripes for enc in encs)
        per = max(1, min(total, int(tunable("parity_window")) // max(1, m * chunk)))
        with ThreadPoolExecutor(max_workers=k + 2 * m) as ex:
            futures = [ex.submit(push, j, [it for enc in encs for it in enc.items(step, self.node, j)])
                       for j in range(k)]
            if m:
                scratch = self._parity(min(2, -(-total // per)) * per * m * chunk)
                halves: list[list] = [[], []]
                for b, members in enumerate(encode.batches(encs, per)):
                    for fut in halves[b % 2]:
                        fut.result()  # raises at once if a push of this half failed
                    half = scratch.view((b % 2) * per * m * chunk, len(members) * m * chunk)
                    batch = encode.ParityBatch(members, m, chunk, half)
                    batch.encode(self.codec)
                    halves[b % 2] = [ex.submit(push, j, batch.items(step, self.node, j)) for j in range(k, k + m)]
                futures += halves[0] + halves[1]
            for fut in futures:
                fut.result()

    def _parity(self, nbytes: int) -> OwnedBuffer:
        """The agent's parity scratch (reused by every snapshot), grown when needed."""
        buf = self.parity.get(0)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.free()
            buf = self.parity[0] = OwnedBuffer(self.budget, nbytes, "the parity scratch buffer")
        return buf

    def _fail(self, v: Version, why: str) -> None:
        if v.state in ("failed", "committed", "freed"):
            return
        v.state, v.error = "failed", why
        self.counters["failed_snapshots"] += 1

    # --- 7. commit -------------------------------------------------------------------------------
    def commit(self, step: int, record: dict, keep: list[int]) -> None:
        with self.lock:
            first = step not in self.records  # (re-protection tells the agents of a commit again)
            self.records[step] = record
            for s in list(self.records):
                if s not in keep:
                    del self.records[s]
            v = self.versions.get(step)
            hold = not self.cfg.local_copy and bool(record.get("spill"))  # lean: kept until spilled
            if hold:  # an older step held for a spill gives way, unless it is being written
                for old in [o for o in self.versions.values()
                            if o.step < step and o.state == "committed" and not self._pinned(o.step)]:
                    self.versions.pop(old.step)
            if v is not None and v.state in ("ready", "encoding", "restored"):
                v.state = "committed"
                if not hold:
                    self._drop_if_lean(v)
            for old in list(self.versions.values()):
                if old.step < step and old.step not in keep and not self._pinned(old.step):
                    if old.state not in ("committed", "freed"):
                        self._fail(old, f"step {step} committed first")
                    self.versions.pop(old.step)
        self.store.drop(lambda key: key.step in keep or key.step > step)
        if self.spiller is not None and first:
            self.spiller.committed(step, bool(record.get("spill")))

    def spilled(self, step: int, ranks: list[int]) -> None:
        """The spill thread wrote ``ranks`` of ``step``: tell the coordinator; in lean mode the
        version was held only for this, so its slot is free again."""
        ray.get(self._coordinator().spilled.remote(step, ranks), timeout=tunable("call_timeout_s"))
        if not self.cfg.local_copy:
            with self.lock:
                v = self.versions.get(step)
                if v is not None and v.state == "committed":
                    self.versions.pop(step)
                    self._release_slot(v)

    def _drop_if_lean(self, v: Version, release: bool = True) -> None:
        """Lean mode: a committed version is not kept as a local copy; its slot is free (and,
        with ``release``, its pages go back to the kernel)."""
        if not self.cfg.local_copy and self.versions.get(v.step) is v:
            self.versions.pop(v.step)
            if release:
                self._release_slot(v)

    def _release_slot(self, v: Version) -> None:
        """Lean mode: ``v``'s bytes are held by its peers (and spilled if that was due), so its
        arenas give their pages back until the next capture (RAM at rest: S(k+m)/k, not
        S(k+m)/k + S). Not when a newer version took the slot meanwhile. Call under the lock."""
        if any(o is not v and o.slot == v.slot and o.state in LIVE for o in self.versions.values()):
            return
        for (rank, slot), arena in self.arenas.items():
            if slot == v.slot:
                arena.release()

    def abandon(self, step: int) -> None:
        """The coordinator gave up on ``step``: forget it here."""
        with self.lock:
            self.abandoned[step] = "a node or holder failed before acknowledging"
            for s in sorted(self.abandoned)[:-16]:
                del self.abandoned[s]
            v = self.versions.get(step)
            if v is not None and v.state != "committed":
                self._fail(v, "abandoned by the coordinator")
                self.versions.pop(step)
        self.store.drop(lambda key: key.step != step)

    def resume(self, step: int | None, gen: int) -> None:
        """The job restored ``step`` (None: started fresh) in restore generation ``gen``: forget
        every uncommitted version after it, so the resumed run can take those steps again."""
        last = -1 if step is None else step
        log.info("node %s resumes from step %s in restore generation %d (was %d)", self.node[:12], step, gen, self.gen)
        with self.lock:
            self.gen = max(self.gen, gen)
            for v in [v for v in self.versions.values() if v.step > last and v.state != "committed"]:
                self._fail(v, f"the job resumed from step {step}")
                self.versions.pop(v.step)
            for s in [s for s in self.abandoned if s > last]:
                del self.abandoned[s]
            records = set(self.records)
        self.store.drop(lambda key: key.step <= last or key.step in records)

    # --- restore ---------------------------------------------------------------------------------
    def local(self, step: int, rank: int) -> dict | None:
        """Where this node still holds ``rank``'s committed bytes of ``step``, or None."""
        with self.lock:
            if not self._holds(step, rank):
                return None
            v = self.versions[step]
            arena = self.arenas.get((rank, v.slot))
            return {"path": arena.path, "nbytes": v.sizes[rank], "manifest": v.manifests[rank]}

    def recover(self, step: int, rank: int, record: dict) -> dict:
        """Rebuild ``rank``'s bytes of ``step`` from the peers into a local arena (now a local copy)."""
        from memsnap.restore import gather

        entry = record["ranks"][str(rank)]
        self._await_prepared(rank)
        with self.lock:
            self._clear_for_restore(step)
            v = self.versions.get(step)
            if v is None or v.state in ("failed", "freed"):
                v = self.versions[step] = Version(step, self._free_slot(step), state="restoring")
            arena = self._arena(rank, v.slot, entry["nbytes"], prefault=False)
            v.sizes[rank] = entry["nbytes"]
        stats = gather(self, record, entry, arena.view(0, entry["nbytes"]))
        with self.lock:
            v.manifests[rank] = entry["manifest"]
            v.state = "committed"
            self._drop_if_lean(v, release=False)  # the rank reads the arena now; the next save reuses it
        self.counters["repaired_chunks"] += stats.get("repaired", 0)
        return {"path": arena.path, "nbytes": entry["nbytes"], "manifest": entry["manifest"], "stats": stats}

    def rebuild_local(self, step: int, rank: int, record: dict, replace: bool = False) -> bool:
        """Re-protection: read ``rank``'s bytes of ``step`` back from the holders as this node's
        local copy (``replace``: over a copy found corrupt). True when it was installed.

        The rank trains on meanwhile, so the bytes are gathered into an arena of their own and
        installed only if the rank has not begun a newer step by then (its next commit leaves
        a newer local copy anyway); the slots its saves use are never touched while gathering."""
        with self.rebuild_lock:  # one at a time: a second request finds the first one's result
            return self._rebuild_local(step, rank, record, replace)

    def _rebuild_local(self, step: int, rank: int, record: dict, replace: bool) -> bool:
        from memsnap.restore import gather

        entry = record["ranks"][str(rank)]
        nbytes = entry["nbytes"]
        with self.lock:
            if self._newer_than(step) or (not replace and self._holds(step, rank)):
                return False
            self.budget.charge(nbytes, f"the rebuilt local copy of rank {rank} (step {step})")
        arena = None
        try:
            arena = Arena.create(naming.arena_path(self.cfg.job, self.node, rank, "rebuild", step), nbytes,
                                 prefault=False)
            stats = gather(self, record, entry, arena.view(0, nbytes))
            with self.lock:
                v = self.versions.get(step)
                if self._newer_than(step) or (v is not None and v.state != "committed"):
                    return False
                if v is None:
                    free = self._free_slots()
                    if not free:
                        return False
                    v = self.versions[step] = Version(step, free[0], state="committed", gen=self.gen)
                self._install(rank, v.slot, arena)
                arena = None
                v.sizes[rank], v.manifests[rank] = nbytes, entry["manifest"]
        finally:
            if arena is not None:  # not installed: give the memory back
                arena.close(unlink=True)
                self.budget.release(nbytes)
        self.counters["repaired_chunks"] += stats.get("repaired", 0)
        return True

    def _newer_than(self, step: int) -> bool:
        return any(s > step for s in self.versions)

    def _holds(self, step: int, rank: int) -> bool:
        v = self.versions.get(step)
        return v is not None and v.state == "committed" and rank in v.manifests

    def _install(self, rank: int, slot: int, arena: Arena) -> None:
        """Make ``arena`` (already charged) ``rank``'s arena of ``slot``, replacing the old one."""
        arena.rename(naming.arena_path(self.cfg.job, self.node, rank, slot, self._drop_arena(rank, slot)))
        self.arenas[(rank, slot)] = arena

    def _drop_arena(self, rank: int, slot: int) -> int:
        """Unlink and uncharge ``rank``'s arena of ``slot`` if there is one; return the
        generation its replacement's file takes (the rank maps the new file)."""
        old = self.arenas.pop((rank, slot), None)
        if old is None:
            return 0
        old.close(unlink=True)
        self.budget.release(old.nbytes)
        return naming.arena_gen(old.path)[1] + 1

    def _clear_for_restore(self, step: int) -> None:
        """Lean mode: the one slot may hold a step that was never committed here (the job
        resumes from ``step``, so it is dropped anyway); give it up so ``step`` can use it."""
        if self.cfg.local_copy:
            return
        for v in [v for v in self.versions.values() if (v.step, v.state) != (step, "restoring")]:
            self._fail(v, f"the job restores step {step}")
            self.versions.pop(v.step)

    def rebuild(self, step: int, owner: str, shard: int, record: dict) -> int:
        """Re-protection: recreate shard ``shard`` of every stripe of ``owner`` and hold it here."""
        from memsnap.restore import rebuild_shard

        n = rebuild_shard(self, record, owner, shard)
        with self.lock:
            if step in self.records:
                self.records[step]["holders"][owner][shard] = self.node
        return n

    # --- introspection -----------------------------------------------------------------------
    def inventory(self) -> dict:
        with self.lock:
            versions = {s: {"state": v.state, "ranks": sorted(v.manifests)} for s, v in self.versions.items()}
            arena_bytes = sum(a.nbytes for a in self.arenas.values() if a.resident)
            local_bytes = sum(v.sizes.get(r, 0) for v in self.versions.values()
                              if v.state == "committed" for r in v.manifests)
            return {
                "node": self.node, "address": self.address, "ranks": sorted(self.ranks), "gen": self.gen,
                "versions": versions, "held": self.store.inventory(),
                "records": sorted(self.records), "counters": dict(self.counters),
                "bytes": {"arena": arena_bytes, "local": local_bytes, "held": self.store.held_bytes(),
                          "parity": sum(max(p.nbytes, 0) for p in self.parity.values()),
                          "budget_used": self.budget.used, "budget": self.budget.budget},
                "spill": None if self.spiller is None else self.spiller.status(),
            }

    def _coordinator(self):
        """The job's coordinator; a new one (rebuilt from the agents) if it was lost."""
        try:
            return ray.get_actor(naming.coordinator(self.cfg.job), namespace=naming.NAMESPACE)
        except ValueError:
            if self.world is None:
                raise
            from memsnap import coordinator

            log.warning("coordinator of job %s is gone; starting a new one", self.cfg.job)
            return coordinator.get_or_create(self.cfg, self.world)

    def shutdown(self) -> None:
        if self.spiller is not None:
            self.spiller.stop()
        self.transport.close()
        with self.lock:
            for arena in [*self.arenas.values(), *self.prepared.values()]:
                arena.close(unlink=True)
            self.arenas.clear()
            self.prepared.clear()


def codec_for(k: int, m: int):
    if m == 0:
        return None
    from memsnap.codec import ReedSolomon

    return ReedSolomon(k, m)


def _choose_chunk(nbytes: int, k: int) -> int:
    from memsnap.stripes import choose_chunk

    return choose_chunk(nbytes, k, int(tunable("chunk_target")))


def _call(ref, timeout: float | None = None):
    return ray.get(ref, timeout=timeout or tunable("call_timeout_s"))


@ray.remote
class SnapshotAgent:
    """The Ray actor around ``AgentCore``; see the module docstring for the call protocol."""

    def __init__(self, config: dict, node_id: str, secret: bytes):
        logging.basicConfig(level=logging.INFO)
        host = ray.util.get_node_ip_address()
        self.core = AgentCore(config, node_id, secret, host=host)
        cfg = self.core.cfg
        if cfg.spill is not None:
            from memsnap.spill import Spiller

            self.core.spiller = Spiller(self.core, report=self.core.spilled)

    def ping(self) -> str:
        return self.core.node

    def register(self, rank: int, world_size: int) -> dict:
        with self.core.lock:
            self.core.ranks.add(rank)
            self.core.world = world_size
        return self.core.address

    def prepare(self, rank: int, nbytes: int) -> bool:
        return self.core.prepare(rank, nbytes)

    def begin(self, step: int, rank: int, nbytes: int) -> dict:
        return self.core.begin(step, rank, nbytes)

    def captured(self, step: int, rank: int, manifest_json: str, local_ranks: list[int]) -> None:
        return self.core.captured(step, rank, manifest_json, local_ranks)

    def commit(self, step: int, record: dict, keep: list[int]) -> None:
        return self.core.commit(step, record, keep)

    def abandon(self, step: int) -> None:
        return self.core.abandon(step)

    def resume(self, step: int | None, gen: int) -> None:
        return self.core.resume(step, gen)

    def spill_now(self, step: int) -> bool:
        """Write committed ``step`` to durable storage now, unthrottled (preemption)."""
        if self.core.spiller is None:
            return False
        self.core.spiller.request(step)
        return True

    def local(self, step: int, rank: int) -> dict | None:
        return self.core.local(step, rank)

    def recover(self, step: int, rank: int, record: dict) -> dict:
        return self.core.recover(step, rank, record)

    def rebuild_local(self, step: int, rank: int, record: dict, replace: bool = False) -> bool:
        return self.core.rebuild_local(step, rank, record, replace)

    def count(self, counter: str, n: int) -> None:
        """Add ``n`` to one of the agent's counters (a rank reports what its restore repaired)."""
        self.core.counters[counter] = self.core.counters.get(counter, 0) + n

    def rebuild(self, step: int, owner: str, shard: int, record: dict) -> int:
        return self.core.rebuild(step, owner, shard, record)

    def inventory(self) -> dict:
        return self.core.inventory()

    def records(self) -> dict:
        with self.core.lock:
            return {s: r for s, r in self.core.records.items()}

    def flip_chunk(self, step: int, owner: str, stripe: int, shard: int, offset: int = 0) -> None:
        """Fault injection: corrupt one byte of a held chunk."""
        self.core.store.flip_byte(ChunkKey(step, owner, stripe, shard), offset)

    def stall_receiving(self, step: int, after_chunks: int) -> None:
        """Fault injection: stop acknowledging chunks of ``step`` after ``after_chunks``."""
        self.core.store.stall(step, after_chunks)

    def stalled(self) -> bool:
        return self.core.store.stalled.is_set()

    def objstore_push(self, packed_keys: list, refs: list, checksums: list) -> list:
        return self.core.transport.handle_push(packed_keys, refs, checksums)

    def objstore_fetch(self, packed_keys: list) -> list:
        return self.core.transport.handle_fetch(packed_keys)

    def shutdown(self) -> None:
        self.core.shutdown()
        ray.actor.exit_actor()


def get_or_create(cfg: SnapshotConfig, node_id: str, secret: bytes):
    """The agent of ``cfg.job`` on ``node_id``: the existing one, or a new one pinned there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return SnapshotAgent.options(
        name=naming.agent(cfg.job, node_id), namespace=naming.NAMESPACE, lifetime="detached",
        get_if_exists=True, num_cpus=0, max_concurrency=int(tunable("agent_max_concurrency")),
        memory=cfg.memory_budget,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(cfg.to_dict(), node_id, secret)


def find(job: str, node_id: str):
    """The live agent of ``job`` on ``node_id``, or None."""
    try:
        return ray.get_actor(naming.agent(job, node_id), namespace=naming.NAMESPACE)
    except ValueError:
        return None
