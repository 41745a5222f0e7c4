"""What one member tells of one generation: written to the job's store as JSON when the
generation ends or its first step after a recovery completes; the controller reads every
member's to divide a recovery's seconds between its phases (``controller.Recovery.split``).

Times are wall clock (``time.time()``): members run in different processes and hosts. A
field the member has not reached is None and is left out of the JSON.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from memsnap.collective.assignment import report_key


@dataclass
class MemberReport:
    member: str
    pid: int
    rank: int
    gen: int
    takeover: bool  # a standby that took a lost rank in this generation
    assigned: float  # the generation's assignment read
    formed: float | None = None  # the process group formed
    on_rank: float | None = None  # a standby's on_rank setup finished
    registered: float | None = None  # its Snapshotter created
    restored: float | None = None  # its state is the generation's step (rolled back or live)
    step: int | None = None  # the step restored (None: a fresh start)
    tier: str | None = None  # the restore tier, or ``kept`` / ``live`` for a live takeover
    restore_s: float | None = None
    restore_phases: dict[str, float] | None = None  # its restore's seconds: plan, fetch, apply, total
    live_holders: list[int] | None = None  # the ranks a live takeover's state came from
    live_phases: dict[str, float] | None = None  # a live takeover's seconds: digest, agree, move, apply
    live_refused: str | None = None  # why the ranks rolled back instead of going on live
    first_step: float | None = None  # the first step after the restore completed
    first_step_no: int | None = None
    handover_step: int | None = None  # the step a preempted member handed over at
    handed_over: float | None = None
    lost: float | None = None  # the generation failed under it
    finished: float | None = None  # the training function returned
    fenced: float | None = None  # the lost nodes were fenced: the restore could start

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def to_json(self) -> str:
        return json.dumps(self.to_wire())

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> MemberReport:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, text: str | bytes) -> MemberReport:
        return cls.from_wire(json.loads(text))


def rolled_back(reports: Collection[MemberReport]) -> bool:
    """Whether a recovery rolled its ranks back to a snapshot, from the members' reports of the
    generation it formed: yes when any rank restored from a tier (not ``kept`` / ``live``), and
    when no rank reported (not known: counted as a rollback, the safe side for the interval)."""
    return len(reports) == 0 or any(r.tier not in ("kept", "live") for r in reports)


def read_reports(store, job: str, gen: int, world: int, into: dict[int, MemberReport]) -> dict[int, MemberReport]:
    """Add to ``into`` (rank -> report) the reports of generation ``gen`` that the ranks not in
    it have written to the job's ``store`` since; return ``into``."""
    for rank in range(world):
        key = report_key(job, gen, rank)
        if rank not in into and store.check([key]):
            into[rank] = MemberReport.from_json(store.get(key))
    return into
