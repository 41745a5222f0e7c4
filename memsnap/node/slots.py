"""A node's arena slots: the arenas each rank captures into, made, reused and given back.

Each rank has ``cfg.slots`` arenas (``keep`` committed versions plus the one being captured;
lean mode: one staging arena, and with a spill a second one for a step held until written).
Which step's bytes sit in which slot, in which state, is the version table's
(``versions.Versions``); a slot is free when no version holds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from memsnap import naming
from memsnap.config import SnapshotConfig
from memsnap.errors import MemoryBudgetError
from memsnap.memory.arena import Arena, MemoryBudget
from memsnap.node.versions import IN_FLIGHT, LIVE, State, Version, Versions  # noqa: F401 (re-exported)

log = logging.getLogger("memsnap.agent")


class Slots:
    """The arenas behind the version table. Every method is called under ``lock`` (shared
    with the agent), except ``prepare``, which takes it itself.

    ``pinned(step)``: the spill thread is writing ``step`` (it may not be freed)."""

    def __init__(
        self,
        cfg: SnapshotConfig,
        node: str,
        budget: MemoryBudget,
        lock: threading.RLock,
        versions: Versions,
        pinned: Callable[[int], bool],
    ):
        self.cfg, self.node, self.budget, self.lock = cfg, node, budget, lock
        self.versions, self.pinned = versions, pinned
        self.arenas: dict[tuple[int, int], Arena] = {}
        self.prepared: dict[int, Arena] = {}  # rank -> a touched arena its peer restore will fill
        self.preparing: dict[int, threading.Event] = {}
        self.making: dict[int, threading.Event] = {}  # rank -> set when the slot being made ahead is in
        self.standby: list[Arena] = []  # made ahead on a warm standby's node, for whichever rank it takes

    # --- which slot (the version table decides) --------------------------------------------------
    def free_slot(self, step: int) -> int | None:
        """A slot for ``step``, or None when the pipeline is busy (``Versions.free_slot``)."""
        return self.versions.free_slot(step, self.pinned)

    def free_slots(self) -> list[int]:
        return self.versions.free_slots()

    def busy(self) -> list[tuple[int, str]]:
        return self.versions.busy()

    def clear_for_restore(self, step: int) -> None:
        self.versions.clear_for_restore(step)

    def holds(self, step: int, rank: int) -> bool:
        return self.versions.holds(step, rank)

    def newer_than(self, step: int) -> bool:
        return self.versions.newer_than(step)

    # --- the arenas ------------------------------------------------------------------------------
    def arena(self, rank: int, slot: int, nbytes: int, prefault: bool = True) -> Arena:
        """``rank``'s arena of ``slot``, at least ``nbytes``, backed and charged."""
        arena = self.arenas.get((rank, slot))
        if arena is not None and arena.nbytes >= nbytes:
            arena.ensure_backed()  # (lean mode released it: back it before the rank writes)
            return arena
        path = naming.arena_path(self.cfg.job, self.node, rank, slot, self.drop_arena(rank, slot))
        ready = self.prepared.pop(rank, None)
        spare = None if ready is not None else self._take_standby(nbytes)
        if ready is not None and ready.nbytes == nbytes:
            ready.rename(path)  # already charged and touched
            arena = ready
        elif spare is not None:
            spare.rename(path)  # made ahead for the standby that is now this rank: charged, touched
            arena = spare
        else:
            if ready is not None:
                self._discard(ready)
            self.budget.charge(nbytes, f"the arena of rank {rank} (slot {slot})")
            try:
                arena = Arena.create(path, nbytes, prefault)
            except BaseException:  # (a full /dev/shm): the charge goes back with the refusal
                self.budget.release(nbytes)
                raise
        self.arenas[(rank, slot)] = arena
        return arena

    def prepare(self, rank: int, nbytes: int) -> bool:
        """``rank`` just registered here and will restore ``nbytes`` from its peers (its node
        is new): create and touch the arena now, while the job gathers for the restore, so the
        fetch lands in memory that is already backed (fresh pages cost as much as the copy)."""
        with self.lock:
            if (
                rank in self.prepared
                or rank in self.preparing
                or any(r == rank and a.nbytes >= nbytes for (r, _), a in self.arenas.items())
            ):
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

    def ready_slots(self, rank: int, nbytes: int) -> int:
        """Create and back every slot of ``rank`` that has no arena yet, for ``nbytes`` each, now:
        off the training thread (a rank asks when it restores, before its first save), so the
        first ``keep+1`` snapshots cost what later ones do instead of touching fresh pages on the
        way of a save. One slot at a time, under a name of its own until it is backed (a save
        that gets there first waits for it: ``await_ahead``). Returns how many were made; stops
        (logged) at the memory budget."""
        made, started = 0, time.monotonic()
        for slot in range(self.cfg.slots):
            with self.lock:
                if (rank, slot) in self.arenas:
                    continue
                spare = self._take_standby(nbytes)
                if spare is not None:  # made before the takeover: only renamed
                    self.install(rank, slot, spare)
                    made += 1
                    continue
                try:
                    self.budget.charge(nbytes, f"the arena of rank {rank} (slot {slot}), made ahead")
                except MemoryBudgetError as exc:
                    log.info("not making the remaining arena slots of rank %d ahead: %s", rank, exc)
                    break
                done = self.making[rank] = threading.Event()
            try:
                made += self._make_ahead(rank, slot, nbytes)
            finally:
                with self.lock:
                    self.making.pop(rank, None)
                done.set()
        with self.lock:  # (a standby's arenas too small for the rank it took: never used now)
            for arena in self.standby:
                self._discard(arena)
            self.standby.clear()
        if made:
            log.info(
                "rank %d: %d arena slot(s) of %.1f MiB made and backed ahead of its saves in %.2f s",
                rank,
                made,
                nbytes / 2**20,
                time.monotonic() - started,
            )
        return made

    def ready_standby(self, nbytes: int) -> int:
        """This node runs a warm standby, which takes a lost rank of at most ``nbytes`` per
        snapshot: make and back ``cfg.slots`` arenas now, before any rank is known, so that its
        first saves after a takeover cost what later ones do (``arena`` and ``ready_slots``
        rename them to the rank's slots). Not once a rank has arenas here; stops (logged) at
        the memory budget. Returns how many were made."""
        made = 0
        for i in range(self.cfg.slots):
            with self.lock:
                if self.arenas or len(self.standby) >= self.cfg.slots:
                    break
                try:
                    self.budget.charge(nbytes, f"a standby's arena (slot {i}), made ahead")
                except MemoryBudgetError as exc:
                    log.info("not making the standby's arena slots ahead: %s", exc)
                    break
            try:
                arena = Arena.create(naming.arena_path(self.cfg.job, self.node, 0, f"standby{i}", 0), nbytes)
            except OSError as exc:  # (a full /dev/shm): the takeover's saves make them as before
                self.budget.release(nbytes)
                log.warning("not making the standby's arena slots ahead: %s", exc)
                break
            except BaseException:
                self.budget.release(nbytes)
                raise
            with self.lock:
                if self.arenas:  # a rank took this node while the arena was made: never used now
                    self._discard(arena)
                    break
                self.standby.append(arena)
            made += 1
        return made

    def _take_standby(self, nbytes: int) -> Arena | None:
        """One of the standby's arenas made ahead that holds ``nbytes``, taken (under the lock)."""
        for i, arena in enumerate(self.standby):
            if arena.nbytes >= nbytes:
                return self.standby.pop(i)
        return None

    def _make_ahead(self, rank: int, slot: int, nbytes: int) -> int:
        """Back one arena (already charged) and install it as ``rank``'s ``slot``; 0 when a save
        made that slot meanwhile (this one is dropped)."""
        try:
            arena = Arena.create(naming.arena_path(self.cfg.job, self.node, rank, f"ahead{slot}", 0), nbytes)
        except BaseException:
            self.budget.release(nbytes)
            raise
        with self.lock:
            if (rank, slot) in self.arenas:  # a save made it meanwhile: keep that one
                self._discard(arena)
                return 0
            arena.rename(naming.arena_path(self.cfg.job, self.node, rank, slot, 0))
            self.arenas[(rank, slot)] = arena
        return 1

    def await_ahead(self, rank: int, timeout: float = 60.0) -> None:
        """Call before ``begin`` takes the lock: if an arena of ``rank`` is being made ahead
        right now, wait for it (at most one arena's making) rather than make a second one
        beside it, under the lock, on the way of the save."""
        with self.lock:
            done = self.making.get(rank)
        if done is not None:
            done.wait(timeout)

    def await_prepared(self, rank: int, timeout: float = 60.0) -> None:
        with self.lock:
            done = self.preparing.get(rank)
        if done is not None:
            done.wait(timeout)

    def install(self, rank: int, slot: int, arena: Arena) -> None:
        """Make ``arena`` (already charged) ``rank``'s arena of ``slot``, replacing the old one."""
        arena.rename(naming.arena_path(self.cfg.job, self.node, rank, slot, self.drop_arena(rank, slot)))
        self.arenas[(rank, slot)] = arena

    def drop_arena(self, rank: int, slot: int) -> int:
        """Unlink and uncharge ``rank``'s arena of ``slot`` if there is one; return the
        generation its replacement's file takes (the rank maps the new file)."""
        old = self.arenas.pop((rank, slot), None)
        if old is None:
            return 0
        self._discard(old)
        return naming.arena_gen(old.path)[1] + 1

    def forget_rank(self, rank: int) -> tuple[int, int]:
        """``rank`` left this node: drop its arenas (unlinked, uncharged), its restore arena
        made ahead, and its bytes in every version here. Returns (arenas, bytes) freed."""
        gone = [self.arenas.pop(key) for key in [key for key in self.arenas if key[0] == rank]]
        ready = self.prepared.pop(rank, None)
        if ready is not None:
            gone.append(ready)
        for arena in gone:
            self._discard(arena)
        self.versions.forget_rank(rank)
        return len(gone), sum(a.nbytes for a in gone)

    def _discard(self, arena: Arena) -> None:
        """Unlink ``arena`` and give its charge back to the memory budget."""
        arena.close(unlink=True)
        self.budget.release(arena.nbytes)

    def release(self, v: Version) -> None:
        """Lean mode: ``v``'s bytes are held by its peers (and spilled if that was due), so its
        arenas give their pages back until the next capture (RAM at rest: S(k+m)/k, not
        S(k+m)/k + S). Not when a newer version took the slot meanwhile."""
        if self.versions.shares_slot(v):
            return
        for (_rank, slot), arena in self.arenas.items():
            if slot == v.slot:
                arena.release()

    def close_all(self) -> None:
        for arena in [*self.arenas.values(), *self.prepared.values(), *self.standby]:
            arena.close(unlink=True)
        self.arenas.clear()
        self.prepared.clear()
        self.standby.clear()
