"""The per-node ``SnapshotAgent`` actor: owns the node's snapshot RAM and its data plane.

One detached agent per node and job, pinned to its node, ``num_cpus=0``. It owns
(a) the arenas the node's ranks capture into (shared memory under /dev/shm, ``keep+1``
slots per rank), (b) the parity it computes and (c) the chunks it holds for its peers,
all charged against ``memory_budget``. Training processes never own snapshot bytes.

Call protocol (who makes each call in brackets; the Ray face is ``actors.SnapshotAgent``,
and ``relay.NodeRelay`` speaks to the coordinator for the node's ranks, once per node):

  0. [rank]  ``join(rank, world)`` then ``members(timeout)``: registration and the placement
     answer, through the agent (the agent's own address never travels through a rank).
  1. [rank]  ``begin(t, rank, nbytes)`` -> the path of an arena region (the rank maps it
     once), or ``{"skipped": why}`` when every slot is busy (newest wins, see ``_free_slot``).
  2. [rank]  capture the state into that region (``memsnap.capture.copy_into``).
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
TCP reads its bytes itself (``memsnap.receive``); ``recover`` rebuilds a rank's bytes from its
peers into an arena instead (the objstore transport, and re-protection's ``rebuild_local``,
which gives a restored node its local copy back); ``rebuild`` re-creates the shards a lost
holder had (re-protection). Spill runs on a background thread (``memsnap.spill``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
import xxhash

from memsnap import encode, naming
from memsnap import arena as arena_files
from memsnap.arena import Arena, MemoryBudget, OwnedBuffer
from memsnap.checksum import fill_checksums
from memsnap.chunkstore import HeldChunks
from memsnap.config import SnapshotConfig, tunable
from memsnap.errors import CommitError, MemoryBudgetError
from memsnap.directory import Directory
from memsnap.manifest import Manifest
from memsnap.records import CommitNotice, Inventory, NodeReady, RankSource, Region
from memsnap.transport.base import make_transport

log = logging.getLogger("memsnap.agent")

LIVE = ("capturing", "queued", "sending", "ready", "committed", "restoring")
BUSY_WARN_S = 60.0  # at most one "saves arrive faster than the pipeline" warning a minute


@dataclass
class Version:
    """One step's bytes on this node: which slot, which ranks, how far it got."""

    step: int
    slot: int
    state: str = "capturing"  # capturing -> queued -> sending -> ready -> committed | failed
    #                                 (queued: every local rank captured, waiting for the sender;
    #                                  a newer capture may take its slot: newest wins)
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
        self.store.own = self._serve_own
        self.address = self.transport.start(self.store)
        swept = arena_files.sweep()  # arenas of agents killed by SIGKILL or the OOM killer
        if swept:
            log.warning("removed %d shared-memory file(s) of agents that are gone: %s", len(swept), swept[:4])
        arena_files.check_capacity(self.cfg.memory_budget)
        self.codec = codec_for(self.cfg.k, self.cfg.m)
        self.lock = threading.RLock()
        self.send_lock = threading.Lock()
        self.rebuild_lock = threading.Lock()
        self.versions: dict[int, Version] = {}
        self.arenas: dict[tuple[int, int], Arena] = {}
        self.parity: dict[int, OwnedBuffer] = {}
        self.committed: dict[int, CommitNotice] = {}  # the commit notices of the steps kept
        self.newest: int | None = None  # the newest committed step this node heard of
        self.infos: dict[int, NodeReady] = {}  # this node's own NodeReady, by step
        self.held_meta: dict[tuple[int, str], tuple[NodeReady, dict[int, str]]] = {}  # held owners'
        self.layout: dict | None = None  # this node's holders and addresses, until the placement changes
        self.dir = Directory(self.cfg.job)
        self.coordinator = None  # -> the coordinator's handle (set by the Ray face)
        self.changed = lambda: None  # wakes the relay's waiters (set by the Ray face)
        self.ranks: set[int] = set()
        self.world: int | None = None
        self.abandoned: dict[int, str] = {}
        self.gen = 0
        self.counters = {"failed_snapshots": 0, "pushed_bytes": 0, "repaired_chunks": 0,
                         "superseded": 0, "skipped_busy": 0}
        self.throughput = Throughput()
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
            if step in self.abandoned:  # skipped or replaced on this node already: every rank skips it
                return {"skipped": self.abandoned[step]}
            v = self.versions.get(step)
            if v is not None and v.state not in ("capturing", "failed"):
                raise CommitError(f"step {step} is already {v.state} on node {self.node[:12]}; "
                                  "save each step once, with a step number larger than the last")
            if v is None or v.state == "failed":
                slot = self._free_slot(step)
                if slot is None:
                    return {"skipped": self._skip(step)}
                v = self.versions[step] = Version(step, slot, gen=self.gen)
            try:
                arena = self._arena(rank, v.slot, nbytes)
            except MemoryBudgetError:
                if not v.sizes:
                    self.versions.pop(step)
                raise
            v.sizes[rank] = nbytes
            v.manifests.pop(rank, None)
            return {"path": arena.path, "nbytes": nbytes, "slot": v.slot}

    def _free_slot(self, step: int) -> int | None:
        """A slot for ``step``, or None when the pipeline is busy (the save is skipped, not
        failed). Under pressure the newest capture wins: it takes the slot of an older one
        that has not started sending, or of one sent but not yet committed."""
        self._supersede(step)
        free = self._free_slots()
        committed = sorted(s for s, v in self.versions.items() if v.state == "committed")
        if not free and len(committed) >= 2 and not self._pinned(committed[0]):
            self.versions.pop(committed[0])  # a newer committed version stays whole
            free = self._free_slots()
        for state in ("queued", "ready", "capturing"):
            if free:
                break
            if state == "ready" and not (self.cfg.local_copy or self.cfg.spill is not None):
                continue  # lean mode without a spill: a sent version holds no slot
            older = sorted(s for s, v in self.versions.items() if v.state == state and s < step)
            if older:
                self._replace(self.versions[older[0]], step)
                free = self._free_slots()
        return free[0] if free else None

    def _replace(self, v: Version, step: int) -> None:
        """``step`` takes ``v``'s slot: ``v`` is dropped here and, through the coordinator, on
        every node (not a failure: a newer snapshot replaces it). Call under the lock."""
        was = {"queued": "not yet sent", "ready": "sent, not yet committed"}.get(v.state, "still capturing")
        v.state, v.error = "superseded", f"replaced by step {step}"
        self.versions.pop(v.step)
        self.abandoned[v.step] = v.error  # a rank still capturing it drops its capture quietly
        self.counters["superseded"] += 1
        self._busy_warning(f"step {v.step} ({was}) was replaced by step {step}")
        self.pool.submit(self._tell, "node_skipped", v.step, self.node, v.error)

    def _skip(self, step: int) -> str:
        """No slot for ``step``: the save is skipped and counted, the older ones go on."""
        busy = sorted((v.step, v.state) for v in self.versions.values() if v.state in LIVE)
        why = f"node {self.node[:12]}: step {step} skipped, every arena slot is busy {busy}"
        self.counters["skipped_busy"] += 1
        self._busy_warning(why)
        self.abandoned[step] = "skipped: the pipeline was busy"
        self.pool.submit(self._tell, "node_skipped", step, self.node, why)
        return why

    def _busy_warning(self, what: str) -> None:
        now = time.monotonic()
        if now - getattr(self, "_warned_busy", -BUSY_WARN_S) < BUSY_WARN_S:
            return
        self._warned_busy = now
        rate, per = self.throughput.describe()
        log.warning("node %s: snapshots arrive faster than the pipeline sends them (%s; %d replaced, %d skipped "
                    "so far). The pipeline moves %s, one snapshot per %s: snapshot less often (every_steps=N "
                    "or every_seconds=T above that), or auto=True to let the policy choose", self.node[:12],
                    what, self.counters["superseded"], self.counters["skipped_busy"], rate, per)

    def _tell(self, method: str, *args) -> None:
        try:
            _call(getattr(self._coordinator(), method).remote(*args))
        except Exception as exc:  # the coordinator learns it from the next commit anyway
            log.warning("could not tell the coordinator %s%s: %s", method, args[:2], exc)

    def _supersede(self, step: int) -> None:
        """Free committed versions beyond ``keep`` and forget failed ones."""
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
        live = LIVE if self.cfg.local_copy else ("capturing", "queued", "sending", "restoring", "committed") + (
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
            try:
                arena = Arena.create(path, nbytes, prefault)
            except BaseException:  # (a full /dev/shm): the charge goes back with the refusal
                self.budget.release(nbytes)
                raise
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
            v.state = "queued"
        self.pool.submit(self._send, v, sorted(local_ranks))

    # --- 4-6. encode, push, report ---------------------------------------------------------
    def _send(self, v: Version, local_ranks: list[int]) -> None:
        try:
            with self.send_lock:  # one snapshot is encoded and sent at a time: one parity buffer
                with self.lock:
                    if v.state != "queued":
                        return  # replaced by a newer capture while it waited
                    v.state = "sending"
                t = time.monotonic()
                info = self._encode_and_push(v, local_ranks)
                self.throughput.add(sum(v.sizes[r] for r in local_ranks), time.monotonic() - t)
        except Exception as exc:  # reported, never raised into the pool
            log.warning("node %s: step %d not sent: %s", self.node[:12], v.step, exc)
            with self.lock:
                self._fail(v, f"{type(exc).__name__}: {exc}")
                self.layout = None  # a holder may be gone: ask for the layout again
            self._tell("node_failed", v.step, self.node, v.error)
            return
        with self.lock:
            if v.state != "sending":
                return
            v.state = "ready"
            self.infos[v.step] = info
            if not self.cfg.local_copy and self.cfg.spill is None:
                self._release_slot(v)
        _call(self._coordinator().node_ready.remote(info.to_wire()))

    def _layout(self) -> dict:
        with self.lock:
            layout = self.layout
        if layout is None:
            layout = _call(self._coordinator().node_layout.remote(self.node))
            with self.lock:
                self.layout = layout
        return layout

    def _encode_and_push(self, v: Version, local_ranks: list[int]) -> NodeReady:
        layout = self._layout()
        sizes = {r: v.sizes[r] for r in local_ranks}
        chunk = self.cfg.chunk or _choose_chunk(max(sizes.values(), default=0), self.cfg.k)
        regs = encode.regions(sizes, self.cfg.k, chunk)
        encs, digest = [], xxhash.xxh3_64()
        for reg in regs:
            data = self.arenas[(reg.rank, v.slot)].view(0, reg.nbytes)
            man = fill_checksums(Manifest.from_json(v.manifests[reg.rank]), data)
            v.manifests[reg.rank] = man.to_json().decode()
            digest.update(v.manifests[reg.rank].encode())
            encs.append(encode.Encoded(reg, data))
        info = NodeReady(v.step, self.node, v.gen, chunk, tuple(Region(r.rank, r.nbytes, r.stripe_base) for r in regs),
                         tuple(layout["holders"]), digest.hexdigest())
        if layout["holders"]:  # without peers the local copy (and the spill) is all there is
            self._push_all(v.step, encs, layout["addrs"], chunk)
            self._hand_manifests(info, {r: v.manifests[r] for r in local_ranks})
        return info

    def _hand_manifests(self, info: NodeReady, manifests: dict[int, str]) -> None:
        """The ranks' manifests go to every holder with the chunks (a restore on another node
        reads them there); a holder that does not take them fails the step like a lost push."""
        got = self.dir.call_all(info.holders, "hold_manifests", info.step, self.node, info.to_wire(), manifests,
                                timeout=tunable("call_timeout_s"))
        missing = sorted(set(info.holders) - set(got))
        if missing:
            raise CommitError(f"step {info.step}: holders {[h[:12] for h in missing]} did not take the manifests")

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
    def commit(self, notice: CommitNotice) -> None:
        step, keep = notice.step, set(notice.keep)
        with self.lock:
            first = step not in self.committed  # (re-protection tells the agents of a commit again)
            self.committed[step] = notice
            self.newest = max(step, -1 if self.newest is None else self.newest)
            for s in [s for s in self.committed if s < step and s not in keep]:
                del self.committed[s]
            self._moved(step, notice.moved)
            v = self.versions.get(step)
            hold = not self.cfg.local_copy and notice.spill  # lean: kept until spilled
            if hold:  # an older step held for a spill gives way, unless it is being written
                for old in [o for o in self.versions.values()
                            if o.step < step and o.state == "committed" and not self._pinned(o.step)]:
                    self.versions.pop(old.step)
            if v is not None and v.state in ("ready", "queued", "sending", "restored"):
                v.state = "committed"
                if not hold:
                    self._drop_if_lean(v)
            for old in list(self.versions.values()):
                if old.step < step and old.step not in keep and not self._pinned(old.step):
                    if old.state not in ("committed", "freed"):
                        self._fail(old, f"step {step} committed first")
                    self.versions.pop(old.step)
            self._forget_meta(lambda s: s in keep or s > step)
        self.store.drop(lambda key: key.step in keep or key.step > step)
        self.changed()
        if self.spiller is not None and first:
            self.spiller.committed(step, notice.spill)

    def _moved(self, step: int, moved) -> None:
        """Re-protection rebuilt some owners' shards on new holders: keep the records true."""
        from dataclasses import replace

        for owner, holders in moved.items():
            if owner == self.node and step in self.infos:
                self.infos[step] = replace(self.infos[step], holders=tuple(holders))
            meta = self.held_meta.get((step, owner))
            if meta is not None:
                self.held_meta[(step, owner)] = (replace(meta[0], holders=tuple(holders)), meta[1])

    def _forget_meta(self, keep) -> None:
        for s in [s for s in self.infos if not keep(s)]:
            del self.infos[s]
        for key in [key for key in self.held_meta if not keep(key[0])]:
            del self.held_meta[key]

    def resolved(self, step: int) -> bool:
        """Whether a ``wait(step)`` may return: committed (or a newer step), failed, or skipped."""
        with self.lock:
            return (self.newest is not None and self.newest >= step) or step in self.abandoned

    # --- manifests held beside the chunks ----------------------------------------------------------
    def _serve_own(self, key) -> tuple[memoryview, int] | None:
        """Data shard ``key`` of this node's own committed stream, read from its arena: a rank
        that moved to another node reads its whole copy here (one source, no decode)."""
        if key.owner != self.node or key.shard >= self.cfg.k:
            return None
        with self.lock:
            v, info = self.versions.get(key.step), self.infos.get(key.step)
            if v is None or v.state != "committed" or info is None:
                return None
            for r in info.regions:
                reg = encode.Region(r.rank, r.nbytes, r.stripe_base, self.cfg.k, info.chunk)
                arena = self.arenas.get((r.rank, v.slot))
                if reg.stripe_base <= key.stripe < reg.stripe_base + reg.stripes and arena is not None:
                    view = encode.shard_of(reg, arena.view(0, r.nbytes), key.stripe - reg.stripe_base, key.shard)
                    return view, xxhash.xxh3_64_intdigest(view)
        return None

    def hold_manifests(self, step: int, owner: str, info: dict, manifests: dict) -> None:
        with self.lock:
            self.held_meta[(step, owner)] = (NodeReady.from_wire(info), {int(r): m for r, m in manifests.items()})

    def held_manifests(self, step: int, owner: str) -> dict[int, str]:
        with self.lock:
            meta = self.held_meta.get((step, owner))
            return {} if meta is None else dict(meta[1])

    def manifest_for(self, step: int, rank: int, src: RankSource) -> str:
        """``rank``'s manifest of ``step``: this node's own copy, or one held here for its owner,
        or one read from another holder of its owner."""
        with self.lock:
            v = self.versions.get(step)
            if v is not None and v.state == "committed" and rank in v.manifests:
                return v.manifests[rank]
            held = self.held_manifests(step, src.owner).get(rank)
        if held is not None:
            return held
        for node in [src.owner, *src.holders]:
            handle = self.dir.agent(node) if node != self.node else None
            if handle is None:
                continue
            try:
                found = ray.get(handle.held_manifests.remote(step, src.owner) if node != src.owner
                                else handle.local.remote(step, rank), timeout=tunable("call_timeout_s"))
            except Exception as exc:
                log.info("no manifest of rank %d from %s: %s", rank, node[:12], exc)
                continue
            man = (found or {}).get("manifest") if node == src.owner else (found or {}).get(rank)
            if man is not None:
                return man
        raise CommitError(f"step {step}: no live agent holds rank {rank}'s manifest (owner {src.owner[:12]}, "
                          f"holders {[h[:12] for h in src.holders]})")

    def committed_infos(self) -> dict:
        """What a rebuilt coordinator needs from this agent: its ranks, address, restore
        generation, the steps it heard committed and every NodeReady it keeps (its own and
        those of the owners it holds for)."""
        with self.lock:
            infos = [i.to_wire() for i in self.infos.values()] + [m[0].to_wire() for m in self.held_meta.values()]
            return {"address": self.address, "gen": self.gen, "ranks": sorted(self.ranks),
                    "committed": sorted(self.committed), "infos": infos}

    def joined(self, rank: int, world: int) -> None:
        with self.lock:
            self.ranks.add(rank)
            self.world = world

    def placed(self, answer: dict) -> None:
        """The coordinator's placement answer: cache this node's layout for its sends."""
        with self.lock:
            self.world = answer.get("world", self.world)
            self.layout = answer.get("layout") or {"holders": [], "addrs": [], "epoch": answer.get("epoch")}

    def spilled(self, step: int, ranks: list[int]) -> None:
        """The spill thread wrote ``ranks`` of ``step``: tell the coordinator; in lean mode the
        version was held only for this, so its slot is free again."""
        _call(self._coordinator().spilled.remote(step, ranks))
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

    def abandon(self, step: int, why: str = "a node or holder failed before acknowledging",
                failed: bool = True) -> None:
        """The coordinator gave up on ``step`` (``failed=False``: a node skipped or replaced it,
        which is not a failure): forget it here."""
        with self.lock:
            self.abandoned[step] = why
            for s in sorted(self.abandoned)[:-16]:
                del self.abandoned[s]
            v = self.versions.get(step)
            if v is not None and v.state != "committed":
                if failed:
                    self._fail(v, f"abandoned: {why}")
                self.versions.pop(step)
            if step not in self.committed:
                self._forget_meta(lambda s: s != step)
        self.store.drop(lambda key: key.step != step)
        self.changed()

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
            for s in [s for s in self.committed if s > last]:
                del self.committed[s]
            self.newest = max(self.committed, default=None)
            records = set(self.committed)
            self._forget_meta(lambda s: s <= last or s in records)
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

    def recover(self, step: int, rank: int, src: RankSource) -> dict:
        """Rebuild ``rank``'s bytes of ``step`` from the peers into a local arena (now a local copy)."""
        from memsnap.restore import gather

        manifest = self.manifest_for(step, rank, src)
        entry = {"nbytes": src.nbytes, "manifest": manifest}
        self._await_prepared(rank)
        with self.lock:
            self._clear_for_restore(step)
            v = self.versions.get(step)
            if v is None or v.state in ("failed", "freed"):
                slot = self._free_slot(step)
                if slot is None:
                    raise CommitError(f"node {self.node[:12]}: no arena slot is free for the restore of step {step}")
                v = self.versions[step] = Version(step, slot, state="restoring")
            arena = self._arena(rank, v.slot, entry["nbytes"], prefault=False)
            v.sizes[rank] = entry["nbytes"]
        stats = gather(self, src, arena.view(0, entry["nbytes"]))
        with self.lock:
            v.manifests[rank] = entry["manifest"]
            v.state = "committed"
            self._drop_if_lean(v, release=False)  # the rank reads the arena now; the next save reuses it
        self.counters["repaired_chunks"] += stats.get("repaired", 0)
        return {"path": arena.path, "nbytes": entry["nbytes"], "manifest": entry["manifest"], "stats": stats}

    def rebuild_local(self, step: int, rank: int, src: RankSource, replace: bool = False) -> bool:
        """Re-protection: read ``rank``'s bytes of ``step`` back from the holders as this node's
        local copy (``replace``: over a copy found corrupt). True when it was installed.

        The rank trains on meanwhile, so the bytes are gathered into an arena of their own and
        installed only if the rank has not begun a newer step by then (its next commit leaves
        a newer local copy anyway); the slots its saves use are never touched while gathering."""
        with self.rebuild_lock:  # one at a time: a second request finds the first one's result
            return self._rebuild_local(step, rank, src, replace)

    def _rebuild_local(self, step: int, rank: int, src: RankSource, replace: bool) -> bool:
        from memsnap.restore import gather

        nbytes = src.nbytes
        with self.lock:
            if self._newer_than(step) or (not replace and self._holds(step, rank)):
                return False
        entry = {"nbytes": nbytes, "manifest": self.manifest_for(step, rank, src)}
        with self.lock:
            if self._newer_than(step) or (not replace and self._holds(step, rank)):
                return False
            self.budget.charge(nbytes, f"the rebuilt local copy of rank {rank} (step {step})")
        arena, installed = None, False
        try:
            arena = Arena.create(naming.arena_path(self.cfg.job, self.node, rank, "rebuild", step), nbytes,
                                 prefault=False)
            stats = gather(self, src, arena.view(0, nbytes))
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
                installed = True
                v.sizes[rank], v.manifests[rank] = nbytes, entry["manifest"]
        finally:
            if not installed:  # refused, failed, or not created at all: give the memory back
                if arena is not None:
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

    def rebuild(self, step: int, k: int, m: int, info: dict, addrs: dict, shard: int) -> int:
        """Re-protection: recreate shard ``shard`` of every stripe of the owner ``info`` names
        and hold it here, with the owner's manifests (read from another holder)."""
        from memsnap.restore import rebuild_shard

        ready = NodeReady.from_wire(info)
        n = rebuild_shard(self, step, k, m, ready, addrs, shard)
        manifests = {}
        for node in ready.holders:
            handle = self.dir.agent(node) if node != self.node else None
            if handle is not None and not manifests:
                try:
                    manifests = ray.get(handle.held_manifests.remote(step, ready.node), timeout=tunable("call_timeout_s"))
                except Exception as exc:
                    log.info("no manifests of %s at %s: %s", ready.node[:12], node[:12], exc)
        holders = ready.holders[:shard] + (self.node,) + ready.holders[shard + 1:]
        from dataclasses import replace

        self.hold_manifests(step, ready.node, replace(ready, holders=holders).to_wire(), manifests)
        return n

    # --- introspection -----------------------------------------------------------------------
    def inventory(self) -> Inventory:
        """What this agent holds (the coordinator's coverage map) and what its RAM is used for."""
        with self.lock:
            versions = {s: (v.state, tuple(sorted(v.manifests))) for s, v in self.versions.items()}
            arena_bytes = sum(a.nbytes for a in self.arenas.values() if a.resident)
            local_bytes = sum(v.sizes.get(r, 0) for v in self.versions.values()
                              if v.state == "committed" for r in v.manifests)
            return Inventory(
                self.node, self.address, versions, self.store.inventory(), tuple(sorted(self.committed)),
                {"arena": arena_bytes, "local": local_bytes, "held": self.store.held_bytes(),
                 "parity": sum(max(p.nbytes, 0) for p in self.parity.values()),
                 "budget_used": self.budget.used, "budget": self.budget.budget},
                dict(self.counters), None if self.spiller is None else self.spiller.status())

    def _coordinator(self):
        """The job's coordinator (found again, or a new one, by the Ray face)."""
        if self.coordinator is None:
            raise CommitError("this agent has no coordinator to talk to (not inside its Ray actor)")
        return self.coordinator()

    def shutdown(self) -> None:
        if self.spiller is not None:
            self.spiller.stop()
        self.transport.close()
        with self.lock:
            for arena in [*self.arenas.values(), *self.prepared.values()]:
                arena.close(unlink=True)
            self.arenas.clear()
            self.prepared.clear()


class Throughput:
    """The send pipeline's measured rate over its last few snapshots (for the busy warning)."""

    def __init__(self, window: int = 8):
        self.sends: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, nbytes: int, seconds: float) -> None:
        self.sends.append((nbytes, max(seconds, 1e-6)))

    def describe(self) -> tuple[str, str]:
        if not self.sends:
            return "nothing yet (no snapshot sent)", "? s"
        nbytes = sum(b for b, _ in self.sends)
        seconds = sum(s for _, s in self.sends)
        return f"{nbytes / seconds / 2**20:.0f} MiB/s", f"{seconds / len(self.sends):.2f} s"


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
