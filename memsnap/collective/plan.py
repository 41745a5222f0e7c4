"""Which steps an in-place job snapshots: rank 0 names them, every rank follows.

A step commits only once every rank has snapshotted it. Each rank's own ``Scheduler`` picks
the same steps while the ranks' figures agree, but they need not: a standby that took a rank
over measures its snapshot cost on cold memory and its step time from its first steps, and one
rank with a grid of ``4G`` beside the others' ``G`` makes the job commit only every ``4G``
steps. So in a generation of an in-place job, rank 0's scheduler alone decides, and writes its
decision to the job's store (``memsnap/<job>/gen/<g>/plan``, JSON)::

    {"prev": 11, "next": 15, "cost_s": 0.42, "quiet_step_s": 1.3}

``next`` is the next step every rank snapshots (None while rank 0's scheduler cannot name one
yet: ``auto`` waiting for a quiet step to be timed), ``prev`` the one before it.

Why every rank sees a point in time, with no extra round trip on the way: rank 0 names a step
``n`` while it is in ``save(s)`` (or before its first step), and always ``n > s``. Every
collective of step ``s + 1`` needs rank 0, which starts that step only after ``save(s)``
returned; so any rank in ``save(s + 1)`` or later reads the point. And rank 0 is never more
than one step ahead of another rank: by the time a rank reads in ``save(n)``, rank 0 may have
passed ``n`` and named the next point, but not the one after, so ``prev`` still holds ``n``.
This takes one collective per step across every rank, as data-parallel and sharded training
have. A follower reads the key only when its last point is behind it: once or twice per
snapshot, not per step.

The scheduler's figures (``cost_s``, ``quiet_step_s``) ride along, so that a process that
becomes rank 0 later (a standby that took rank 0's place) goes on from them instead of
measuring afresh.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from memsnap.policy import Scheduler

log = logging.getLogger("memsnap.inplace")


def plan_key(job: str, gen: int) -> str:
    return f"memsnap/{job}/gen/{gen}/plan"


def figures_key(job: str) -> str:
    """The newest figures rank 0's scheduler published, across generations."""
    return f"memsnap/{job}/plan/figures"


class SharedPlan:
    """One generation's snapshot steps for one rank: rank 0 (``lead``) names them from its
    scheduler and publishes them; the other ranks read them (see the module docstring).

    ``Snapshotter.save`` asks ``due(step, scheduler)`` instead of its scheduler's ``due`` and
    calls ``passed(step, scheduler)`` when it returns, whether it snapshotted or not."""

    def __init__(self, store: Any, job: str, gen: int, *, lead: bool):
        self.store, self.job, self.lead = store, job, lead
        self.key = plan_key(job, gen)
        self.prev: int | None = None
        self.next: int | None = None
        self._named = False  # rank 0 has published a point of this generation

    # --- rank 0 ---------------------------------------------------------------------------------
    def start(self, scheduler: Scheduler, after: int | None) -> None:
        """The generation's ranks train from the step after ``after`` (None: a fresh start):
        rank 0 names the first point, before its first step. It takes over the published
        figures where its scheduler has none of its own yet (a standby that became rank 0)."""
        if not self.lead:
            return
        figures = self._read(figures_key(self.job))
        if figures is not None:
            scheduler.adopt(figures.get("cost_s"), figures.get("quiet_step_s"))
        self._name(scheduler.next_due(-1 if after is None else after + 1), scheduler)

    def passed(self, step: int, scheduler: Scheduler) -> None:
        """``save(step)`` is done: rank 0 names the next point once this one is behind it."""
        if self.lead and (self.next is None or step >= self.next):
            self._name(scheduler.next_due(step + 1), scheduler)

    def _name(self, point: int | None, scheduler: Scheduler) -> None:
        if point == self.next and self._named:
            return
        self._named = True
        if self.next is not None:
            self.prev = self.next
        self.next = point
        figures = {"cost_s": scheduler.cost_seconds, "quiet_step_s": scheduler.quiet_step_seconds}
        try:
            self.store.set(self.key, json.dumps({"prev": self.prev, "next": self.next, **figures}))
            if figures["cost_s"] is not None:
                self.store.set(figures_key(self.job), json.dumps(figures))
        except Exception as exc:  # the others miss this point (it does not commit); never stop training
            log.warning("snapshot plan %s not written: %s", self.key, exc)

    # --- every rank -----------------------------------------------------------------------------
    def due(self, step: int, scheduler: Scheduler) -> bool:
        """Whether ``step`` is to be snapshotted: the same answer on every rank of the generation."""
        scheduler.observe(step)  # this rank's step time, for its status
        if not self.lead and (self.next is None or step > self.next):
            point = self._read(self.key)
            if point is not None:
                self.prev, self.next = point.get("prev"), point.get("next")
        return step == self.next or step == self.prev

    def _read(self, key: str) -> dict | None:
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception as exc:  # a store that fails now: no point named; never stop training for it
            log.warning("snapshot plan %s not read: %s", key, exc)
            return None
