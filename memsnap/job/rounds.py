"""The collective restore at the coordinator, one round per attempt: every rank arrives, one
plan for all, every rank reports, and if any failed every rank takes the next plan.

Arrivals and reports come a node at a time (each node's agent gathers its ranks). Pure
state; the coordinator's Ray face waits on it with ``waiting.Signal`` (no thread per waiter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memsnap.job.coverage import JobPlan
from memsnap.records import RankRestore


@dataclass
class Round:
    arrived: set[int] = field(default_factory=set)
    plan: JobPlan | None = None
    done: dict[int, RankRestore] = field(default_factory=dict)
    closed: bool = False
    gen: int | None = None  # the restore generation this round's success started
    cancelled: str | None = None  # why the round was given up (a member was lost during it)


class RestoreRounds:
    def __init__(self, world: int):
        self.world = world
        self.rounds: dict[int, Round] = {}
        self.bad: set[int] = set()  # steps some rank failed to load: the next plan avoids them
        self.completed = 0  # rounds that ended with every rank loaded

    def get(self, attempt: int) -> Round:
        """The round of ``attempt``; attempt 0 after a finished restore starts a new one."""
        rnd = self.rounds.get(attempt)
        if rnd is None or (attempt == 0 and rnd.closed):
            if attempt == 0:
                self.rounds, self.bad = {}, set()
            rnd = self.rounds[attempt] = Round()
        return rnd

    def cancel(self, why: str) -> list[int]:
        """Give up every open round (a member was lost while the others waited in it): its
        waiters fail with ``why``, and the next attempt 0 starts afresh. The attempts cancelled."""
        out = []
        for attempt, rnd in sorted(self.rounds.items()):
            if not rnd.closed:
                rnd.cancelled, rnd.closed = why, True
                out.append(attempt)
        return out

    def cancelled(self, attempt: int) -> str | None:
        rnd = self.rounds.get(attempt)
        return None if rnd is None else rnd.cancelled

    def arrive(self, attempt: int, ranks: list[int]) -> Round:
        rnd = self.get(attempt)
        rnd.arrived.update(ranks)
        return rnd

    def all_arrived(self, attempt: int) -> bool:
        rnd = self.rounds.get(attempt)
        return rnd is not None and len(rnd.arrived) >= self.world

    def missing(self, attempt: int, table: str = "arrived") -> list[int]:
        rnd = self.rounds.get(attempt) or Round()
        seen = rnd.arrived if table == "arrived" else set(rnd.done)
        return sorted(set(range(self.world)) - set(seen))

    def report(self, attempt: int, reports: dict[int, RankRestore]) -> None:
        self.rounds[attempt].done.update(reports)

    def all_done(self, attempt: int) -> bool:
        rnd = self.rounds.get(attempt)
        return rnd is not None and len(rnd.done) >= self.world

    def close(self, attempt: int) -> tuple[Round, dict[int, RankRestore]]:
        """Every rank reported: the round and its failures (``{rank: report}``); a step some
        rank could not load is not planned again."""
        rnd = self.rounds[attempt]
        failed = {r: rep for r, rep in rnd.done.items() if not rep.ok}
        if failed and rnd.plan is not None and rnd.plan.step is not None:
            self.bad.add(rnd.plan.step)
        rnd.closed = True
        return rnd, failed
