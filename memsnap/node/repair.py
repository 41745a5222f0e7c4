"""Bytes back into this node, and this node's own bytes out to a rank that moved:

- the manifests this node holds for the owners it protects (``hold_manifests``), and a
  rank's manifest found here or at a holder of its owner (``manifest_for``);
- a rank's bytes gathered from the holders into a local arena (``recover``: the objstore
  restore; ``rebuild_local``: re-protection gives a restored node its local copy back);
- a lost holder's shards recreated here (``rebuild``: re-protection);
- this node's own committed data shards served from its arenas (``serve_own``), so a rank
  that moved to another node reads its whole copy here with no decode.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

import ray
import xxhash

from memsnap import naming
from memsnap.coding import encode
from memsnap.config import tunable
from memsnap.errors import CommitError
from memsnap.memory.arena import Arena
from memsnap.node.versions import FAILED
from memsnap.records import NodeReady, RankSource

log = logging.getLogger("memsnap.agent")


class Repair:
    """Bytes back into this node. What it uses, and nothing else:

    - ``node``, ``cfg``: this node and the job's configuration;
    - ``lock``: the agent's lock, under which ``versions`` (the version table: a restore's
      version goes restoring -> committed; a rebuilt local copy comes in committed) and the
      held manifests change; ``infos``: this node's ``NodeReady`` by step (read);
    - ``slots``: the arenas (a restore's is made in a free slot, a rebuilt copy installed);
    - ``store``: the chunks held here (a rebuilt shard goes in); ``transport``, ``codec``: the
      data plane (``restore.gather`` and ``restore.rebuild_shard`` take this object for it);
    - ``budget``: charged for a rebuilt copy; ``counters``: ``repaired_chunks``;
    - ``agent(node)``: another node's agent handle (None when it is gone or this node);
    - ``gen()``: the job's restore generation as this node knows it."""

    def __init__(
        self,
        *,
        node: str,
        cfg,
        lock,
        versions,
        slots,
        infos: dict,
        store,
        transport,
        codec,
        budget,
        counters: dict,
        agent: Callable,
        gen: Callable[[], int],
    ):
        self.node, self.cfg, self.lock, self.versions, self.slots, self.infos = node, cfg, lock, versions, slots, infos
        self.store, self.transport, self.codec, self.budget, self.counters = store, transport, codec, budget, counters
        self.agent, self.gen = agent, gen
        self.held_meta: dict[tuple[int, str], tuple[NodeReady, dict[int, str]]] = {}  # (step, owner) ->
        self.rebuild_lock = threading.Lock()

    # --- manifests ---------------------------------------------------------------------------------
    def hold_manifests(self, step: int, owner: str, info: dict, manifests: dict) -> None:
        with self.lock:
            self.held_meta[(step, owner)] = (NodeReady.from_wire(info), {int(r): m for r, m in manifests.items()})

    def held_manifests(self, step: int, owner: str) -> dict[int, str]:
        with self.lock:
            meta = self.held_meta.get((step, owner))
            return {} if meta is None else dict(meta[1])

    def forget(self, keep) -> None:
        """Drop what is held for steps ``keep(step)`` rejects. Call under the agent's lock."""
        for key in [key for key in self.held_meta if not keep(key[0])]:
            del self.held_meta[key]

    def moved(self, step: int, owner: str, holders: tuple[str, ...]) -> None:
        meta = self.held_meta.get((step, owner))
        if meta is not None:
            self.held_meta[(step, owner)] = (replace(meta[0], holders=tuple(holders)), meta[1])

    def manifest_for(self, step: int, rank: int, src: RankSource) -> str:
        """``rank``'s manifest of ``step``: this node's own copy, or one held here for its owner,
        or one read from the owner's node or another holder of its owner."""
        with self.lock:
            v = self.versions.committed_version(step)
            if v is not None and rank in v.manifests:
                return v.manifests[rank]
        held = self.held_manifests(step, src.owner).get(rank)
        if held is not None:
            return held
        for node in [src.owner, *src.holders]:
            handle = self.agent(node) if node != self.node else None
            if handle is None:
                continue
            try:
                found = ray.get(
                    handle.held_manifests.remote(step, src.owner)
                    if node != src.owner
                    else handle.local.remote(step, rank),
                    timeout=tunable("call_timeout_s"),
                )
            except Exception as exc:
                log.info("no manifest of rank %d from %s: %s", rank, node[:12], exc)
                continue
            man = (found or {}).get("manifest") if node == src.owner else (found or {}).get(rank)
            if man is not None:
                return man
        raise CommitError(
            f"step {step}: no live agent holds rank {rank}'s manifest (owner {src.owner[:12]}, "
            f"holders {[h[:12] for h in src.holders]})"
        )

    # --- this node's own bytes, for a rank that moved ------------------------------------------------
    def serve_own(self, key) -> tuple[memoryview, int] | None:
        """Data shard ``key`` of this node's own committed stream, read from its arena."""
        if key.owner != self.node or key.shard >= self.cfg.k:
            return None
        with self.lock:
            v, info = self.versions.committed_version(key.step), self.infos.get(key.step)
            if v is None or info is None:
                return None
            for r in info.regions:
                reg = encode.StripedRegion(r.rank, r.nbytes, r.stripe_base, self.cfg.k, info.chunk)
                arena = self.slots.arenas.get((r.rank, v.slot))
                if reg.stripe_base <= key.stripe < reg.stripe_base + reg.stripes and arena is not None:
                    view = encode.shard_of(reg, arena.view(0, r.nbytes), key.stripe - reg.stripe_base, key.shard)
                    return view, xxhash.xxh3_64_intdigest(view)
        return None

    # --- a rank's bytes into an arena here --------------------------------------------------------------
    def recover(self, step: int, rank: int, src: RankSource) -> dict:
        """Rebuild ``rank``'s bytes of ``step`` from the peers into a local arena (now a local copy)."""
        from memsnap.coding.restore import gather

        slots, versions = self.slots, self.versions
        manifest = self.manifest_for(step, rank, src)
        slots.await_prepared(rank)
        with self.lock:
            versions.clear_for_restore(step)
            v = versions.get(step)
            if v is None or v.state is FAILED:
                slot = slots.free_slot(step)
                if slot is None:
                    raise CommitError(f"node {self.node[:12]}: no arena slot is free for the restore of step {step}")
                v = versions.restoring(step, slot)
            arena = slots.arena(rank, v.slot, src.nbytes, prefault=False)
            versions.restore_rank(v, rank, src.nbytes)
        stats = gather(self, src, arena.view(0, src.nbytes))
        with self.lock:
            versions.restored(v, rank, manifest)  # (lean mode: the rank reads the arena now; the next save reuses it)
        self.counters["repaired_chunks"] += stats.get("repaired", 0)
        return {"path": arena.path, "nbytes": src.nbytes, "manifest": manifest, "stats": stats}

    def rebuild_local(self, step: int, rank: int, src: RankSource, replace_corrupt: bool = False) -> bool:
        """Re-protection: read ``rank``'s bytes of ``step`` back from the holders as this node's
        local copy (``replace_corrupt``: over a copy found corrupt). True when it was installed.

        The rank trains on meanwhile, so the bytes are gathered into an arena of their own and
        installed only if the rank has not begun a newer step by then (its next commit leaves
        a newer local copy anyway); the slots its saves use are never touched while gathering."""
        with self.rebuild_lock:  # one at a time: a second request finds the first one's result
            return self._rebuild_local(step, rank, src, replace_corrupt)

    def _rebuild_local(self, step: int, rank: int, src: RankSource, replace_corrupt: bool) -> bool:
        from memsnap.coding.restore import gather

        slots, versions, nbytes = self.slots, self.versions, src.nbytes

        def pointless() -> bool:
            return versions.newer_than(step) or (not replace_corrupt and versions.holds(step, rank))

        with self.lock:
            if pointless():
                return False
        manifest = self.manifest_for(step, rank, src)
        with self.lock:
            if pointless():
                return False
            self.budget.charge(nbytes, f"the rebuilt local copy of rank {rank} (step {step})")
        arena, installed = None, False
        try:
            arena = Arena.create(
                naming.arena_path(self.cfg.job, self.node, rank, "rebuild", step), nbytes, prefault=False
            )
            stats = gather(self, src, arena.view(0, nbytes))
            with self.lock:
                v = versions.get(step)
                if versions.newer_than(step) or (v is not None and versions.committed_version(step) is None):
                    return False
                if v is None:
                    free = versions.free_slots()
                    if not free:
                        return False
                    v = versions.rebuilt(step, free[0], self.gen())
                slots.install(rank, v.slot, arena)
                installed = True
                versions.add_copy(v, rank, nbytes, manifest)
        finally:
            if not installed:  # refused, failed, or not created at all: give the memory back
                if arena is not None:
                    arena.close(unlink=True)
                self.budget.release(nbytes)
        self.counters["repaired_chunks"] += stats.get("repaired", 0)
        return True

    # --- a lost holder's shards -----------------------------------------------------------------------
    def rebuild(self, step: int, k: int, m: int, info: dict, addrs: dict, shard: int) -> int:
        """Re-protection: recreate shard ``shard`` of every stripe of the owner ``info`` names
        and hold it here, with the owner's manifests (read from another holder)."""
        from memsnap.coding.restore import rebuild_shard

        ready = NodeReady.from_wire(info)
        n = rebuild_shard(self, step, k, m, ready, addrs, shard)
        manifests: dict = {}
        for node in ready.holders:
            handle = self.agent(node) if node != self.node else None
            if handle is not None and not manifests:
                try:
                    manifests = ray.get(
                        handle.held_manifests.remote(step, ready.node), timeout=tunable("call_timeout_s")
                    )
                except Exception as exc:
                    log.info("no manifests of %s at %s: %s", ready.node[:12], node[:12], exc)
        holders = ready.holders[:shard] + (self.node,) + ready.holders[shard + 1 :]
        self.hold_manifests(step, ready.node, replace(ready, holders=holders).to_wire(), manifests)
        return n
