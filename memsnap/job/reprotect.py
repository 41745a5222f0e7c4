"""Re-protection: after a node is replaced, rebuild every shard its holders lost onto other
nodes, and give a node whose rank restored from peers its local copy back, so the
protection level returns to full before the next snapshot. One background thread per
coordinator; it lets the job's restore go first (both move bytes over the same nodes).

Newest step first: the newest committed step is the one a second loss would restore, and the
older ones are kept behind it only until newer steps commit (``keep``). A step pruned while
it waits, or while its shards are rebuilt, is dropped: its holders have let its chunks go,
and rebuilding it would only take the data plane from the snapshots being sent.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import ray

from memsnap.config import tunable
from memsnap.job import coverage
from memsnap.records import CommitRecord

log = logging.getLogger("memsnap.coordinator")


def new_holders(
    record: CommitRecord, owner: str, holders: list[str], live: set[str], members: dict[int, str]
) -> list[tuple[int, str]]:
    """``(j, node)`` for every shard ``j`` of ``owner`` whose holder is gone. Never the owner,
    never a node already holding a shard of the same stripes; a node running the owner's
    ranks now (Ray Train moves ranks between nodes) only when no other is left."""
    hosting = {members.get(r) for r in record.ranks_of(owner)}
    taken, out = set(holders) | {owner}, []
    for j, h in enumerate(holders):
        if h in live:
            continue
        cands = sorted(live - taken - hosting) or sorted(live - taken)
        if cands:
            out.append((j, cands[0]))
            taken.add(cands[0])
    return out


@dataclass
class Progress:
    """What re-protection is doing and has done (``status()["reprotect"]``)."""

    running: bool = False
    again: bool = False  # asked again while it ran: one more round
    rebuilt_chunks: int = 0
    local_copies: int = 0
    dropped: int = 0  # steps pruned before re-protection had rebuilt them (no longer needed)
    errors: list[str] = field(default_factory=list)


class Reprotector:
    """``core``: the ``CoordinatorCore`` (its lock, membership, commit log, agents)."""

    def __init__(self, core):
        self.core = core
        self.state = Progress()

    def kick(self) -> None:
        """Start the thread unless it runs (then it goes round once more)."""
        with self.core.lock:
            if self.state.running:
                self.state.again = True
                return
            self.state.running = True
        threading.Thread(target=self._loop, name="memsnap-reprotect", daemon=True).start()

    def _loop(self) -> None:
        try:
            self.core.wait_for_a_restore(tunable("reprotect_defer_s"))
            while True:
                self.state.again = False
                for step in sorted(self.core.log.records, reverse=True):
                    self._step(step)
                self._local_copies()
                if not self.state.again:
                    return
        finally:
            with self.core.lock:
                self.state.running = False

    def _step(self, step: int) -> None:
        core = self.core
        if not self._kept(step):  # pruned while a newer step was re-protected
            return
        with core.lock:
            record = core.log.records.get(step)
            if record is None:
                return
            live, members = set(core.membership.live_nodes()), dict(core.membership.members)
            moves = [
                (owner, j, new)
                for owner in record.nodes
                for j, new in new_holders(record, owner, list(record.holders(owner)), live, members)
            ]
            addrs = dict(core.membership.addrs)
        for owner, j, new in moves:
            if not self._kept(step) or not self._rebuild_on(record, owner, j, new, addrs):
                return
        if moves:
            with core.lock:
                rec = core.log.records.get(step)
                if rec is None:
                    return
                moved = {o: rec.holders(o) for o, _, _ in moves}
                notice = core.log.notice(rec, spill=False, moved=moved)  # told again: no new spill
            core.broadcast("commit", notice.to_wire())

    def _kept(self, step: int) -> bool:
        """Whether ``step`` is still committed and kept; logs its re-protection dropped if not."""
        with self.core.lock:
            kept = step in self.core.log.records
        if not kept:
            self.state.dropped += 1
            log.info("re-protection of step %d dropped: newer steps committed and it is no longer kept", step)
        return kept

    def _rebuild_on(self, record: CommitRecord, owner: str, j: int, new: str, addrs: dict) -> bool:
        """Rebuild ``owner``'s shard ``j`` of the step on ``new``; False only when the step was
        pruned meanwhile (the rebuild failed because its holders let the chunks go)."""
        core = self.core
        handle = core.dir.agent(new)
        info = record.nodes[owner]
        try:
            n = ray.get(
                handle.rebuild.remote(
                    record.step, record.k, record.m, info.to_wire(), {h: addrs.get(h) for h in info.holders}, j
                ),
                timeout=tunable("push_timeout_s"),
            )
        except Exception as exc:
            if not self._kept(record.step):
                return False  # pruned while it was rebuilt: not a failure
            self.state.errors.append(f"step {record.step} owner {owner[:12]} shard {j}: {exc}")
            log.warning("re-protection of step %d owner %s shard %d failed: %s", record.step, owner[:12], j, exc)
            return True
        with core.lock:
            live = core.log.records.get(record.step)
            if live is not None:
                core.log.records[record.step] = live.with_holder(owner, j, new)
            self.state.rebuilt_chunks += n
        log.info("re-protected step %d owner %s shard %d on %s (%d chunks)", record.step, owner[:12], j, new[:12], n)
        return True

    def _local_copies(self) -> None:
        """A rank restored from peers holds its bytes only in its live state (receive.py), so
        its node has no local copy of the newest step: that node's agent reads them from the
        holders once more (one more loss survived, a crash restored with no network)."""
        core = self.core
        if not core.cfg.local_copy:
            return
        with core.lock:
            step = core.log.newest()
            if step is None:
                return
            record, members, addrs = core.log.records[step], dict(core.membership.members), dict(core.membership.addrs)
            if record.world != core.world:  # taken by the former world size: its ranks are not today's
                return
        inventories = core.inventories()
        for rank in record.ranks:
            node = members.get(rank)
            inv = inventories.get(node)
            if (
                node is None
                or inv is None
                or coverage.has_local(inv, step, rank)
                or any(s > step for s in inv.versions)
            ):
                continue  # nothing to do, or the rank moved on: its next commit leaves a local copy
            self._local_copy(node, step, rank, record.source(rank, addrs))

    def _local_copy(self, node: str, step: int, rank: int, source) -> None:
        try:
            ok = ray.get(
                self.core.dir.agent(node).rebuild_local.remote(step, rank, source.to_wire()),
                timeout=tunable("push_timeout_s"),
            )
        except Exception as exc:
            self.state.errors.append(f"local copy of rank {rank} at step {step}: {exc}")
            log.warning("could not rebuild rank %s's local copy of step %d: %s", rank, step, exc)
            return
        if ok:
            with self.core.lock:
                self.state.local_copies += 1

    def status(self) -> dict:
        st = self.state
        return {
            "running": int(st.running),
            "again": st.again,
            "rebuilt_chunks": st.rebuilt_chunks,
            "local_copies": st.local_copies,
            "dropped": st.dropped,
            "errors": list(st.errors[-5:]),
        }
