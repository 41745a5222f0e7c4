"""The two-phase commit's state at the coordinator: nodes ready per step, the committed
records (newest ``keep``), steps failed or skipped, the restore generation, and which
committed step is due for a spill. Pure, no Ray; the coordinator calls it under its lock.

Phase one: each node's agent reports ``NodeReady`` (every chunk of its stream acknowledged).
Phase two: when every node of the job is ready, the step is committed and every agent gets
a ``CommitNotice``. A step a node skipped or replaced under load is *skipped*, not failed.
"""

from __future__ import annotations

import logging
import time

from memsnap.config import SnapshotConfig
from memsnap.records import CommitNotice, CommitRecord, NodeReady

log = logging.getLogger("memsnap.coordinator")

REMEMBERED = 256  # failed / skipped steps remembered (for wait() and status)


class CommitLog:
    def __init__(self, cfg: SnapshotConfig):
        self.cfg = cfg
        self.pending: dict[int, dict[str, NodeReady]] = {}
        self.records: dict[int, CommitRecord] = {}
        self.failed: dict[int, str] = {}
        self.skipped: dict[int, str] = {}
        self.gen = 0  # bumped by every completed restore; steps taken before it are ignored
        self.spill_asked: tuple[int, float] | None = None  # (step, monotonic time) of the last spill asked
        self.spill_ranks: dict[int, set[int]] = {}
        self.durable_step: int | None = None
        self.rolling_back: int | None = None  # a restore plan's step: nothing above it commits until the resume

    def newest(self) -> int | None:
        return max(self.records, default=None)

    def resolved(self, step: int) -> bool:
        """``wait(step)`` may return: it (or a newer step) committed, or it failed or was skipped."""
        newest = self.newest()
        return (newest if newest is not None else -1) >= step or step in self.failed or step in self.skipped

    def ready(self, info: NodeReady, nodes: frozenset[str], world: int) -> CommitRecord | None:
        """Phase one from one node; the record when this completes ``info.step`` (every node of
        ``nodes`` ready and every one of ``world`` ranks captured)."""
        step = info.step
        if info.gen < self.gen:
            log.info(
                "ignoring step %d from node %s: taken before the last restore (generation %d < %d)",
                step,
                info.node[:12],
                info.gen,
                self.gen,
            )
            return None
        self.gen = info.gen  # a rebuilt coordinator learns the generation from the agents
        if step in self.failed or step in self.skipped or step in self.records or self._stale(step):
            return None
        if self.rolling_back is not None and step > self.rolling_back:
            self._remember(self.skipped, step, f"the job rolls back to step {self.rolling_back}")
            return None
        ready = self.pending.setdefault(step, {})
        ready[info.node] = info
        if len(ready) < len(nodes) or not nodes <= ready.keys():  # O(1) until the last node reports
            return None
        del self.pending[step]
        captured = {r.rank for i in ready.values() for r in i.regions}
        missing = sorted(set(range(world)) - captured)
        if missing:
            self._remember(self.failed, step, f"ranks {missing} were not captured")
            return None
        record = CommitRecord(step, self.cfg.k, self.cfg.m, dict(ready), time.time(), self._spill_due(step))
        self.records[step] = record
        for s in [s for s in self.pending if s < step]:
            self._remember(self.skipped, s, f"step {step} committed first")  # replaced under load
            del self.pending[s]
        for s in sorted(self.records)[: -self.cfg.keep]:
            del self.records[s]
        for s in [s for s, r in self.records.items() if r.world != record.world]:
            del self.records[s]  # taken by the job's former world size: the new layout replaces it
        return record

    def notice(self, record: CommitRecord, spill: bool | None = None, moved=None) -> CommitNotice:
        return CommitNotice(
            record.step, tuple(sorted(self.records)), record.spill if spill is None else spill, moved or {}
        )

    def _stale(self, step: int) -> bool:
        return bool(self.records) and step < max(self.records)

    def fail(self, step: int, why: str) -> bool:
        """``step`` cannot commit; True if this is news (the agents must drop it)."""
        if step in self.records or step in self.failed or step in self.skipped:
            return False  # (a push for a skipped step refused later is no news)
        self._remember(self.failed, step, why)
        self.pending.pop(step, None)
        return True

    def lost(self, node: str, why: str) -> list[int]:
        """``node``, which runs ranks, is lost: every step in flight it has not reported can never
        commit (its ranks' bytes are gone with it). Those steps fail; the news, oldest first."""
        steps = sorted(s for s, ready in self.pending.items() if node not in ready)
        return [s for s in steps if self.fail(s, why)]

    def skip(self, step: int, why: str) -> bool:
        """A node skipped ``step`` or replaced it with a newer capture; True if this is news."""
        if step in self.records or step in self.skipped or step in self.failed:
            return False
        self._remember(self.skipped, step, why)
        self.pending.pop(step, None)
        return True

    @staticmethod
    def _remember(table: dict[int, str], step: int, why: str) -> None:
        table[step] = why
        for s in sorted(table)[:-REMEMBERED]:
            del table[s]

    def roll_back(self, step: int | None) -> list[int]:
        """A restore plan loads ``step`` (None: a fresh start): the steps in flight above it can
        no longer be the one the job resumes from, and none commits until the round's
        ``resume`` (or ``cancel_roll_back``). Not a failure; the steps dropped."""
        last = -1 if step is None else step
        self.rolling_back = last
        dropped = sorted(s for s in self.pending if s > last)
        for s in dropped:
            self._remember(self.skipped, s, f"the job rolls back to step {step}")
            del self.pending[s]
        return dropped

    def cancel_roll_back(self) -> None:
        """The restore round was cancelled: the next round's plan rolls back again, if any."""
        self.rolling_back = None

    def resume(self, step: int | None) -> None:
        """The job resumed from ``step``: every step after it may be taken again."""
        self.gen += 1
        self.rolling_back = None
        last = -1 if step is None else step
        for table in (self.pending, self.failed, self.skipped, self.records):
            for s in [s for s in table if s > last]:
                del table[s]

    def _spill_due(self, step: int) -> bool:
        """Whether the agents spill the step committed now: the first commit in each new block
        of ``spill_every`` steps (so a failed step ``10`` moves the spill to ``11``, not ``20``),
        or ``spill_every_seconds`` after the last one asked. Decided here, once, so that every
        agent writes the same step."""
        every, secs = self.cfg.spill_every, self.cfg.spill_every_seconds
        if self.cfg.spill is None or not (every or secs):
            return False
        last = self.spill_asked
        due = bool(
            last is None
            or last[0] > step
            or (every and step // every > last[0] // every)
            or (secs and time.monotonic() - last[1] >= secs)
        )
        if due:
            self.spill_asked = (step, time.monotonic())
        return due

    def spilled(self, step: int, ranks: list[int], world: int) -> bool:
        """Agents wrote ``ranks`` of ``step``; True when every rank is written (the caller
        then writes the commit marker and calls ``durable``)."""
        done = self.spill_ranks.setdefault(step, set())
        done.update(ranks)
        return len(done) >= world and step != self.durable_step

    def durable(self, step: int) -> None:
        self.durable_step = max(step, self.durable_step or -1)
        for s in [s for s in self.spill_ranks if s <= step]:
            del self.spill_ranks[s]
