"""The history of a storage root's committed steps: lineages (which run each commit belongs
to, and where a rollback started a new one) and retention (which steps to keep).

Pure: the ``Commit`` records come from the markers ``storage.Store`` reads; nothing here
touches a file.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

_LINEAGE_RE = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class Retention:
    """Which committed steps to keep: the newest ``keep_last`` of the current lineage, the
    step that lineage resumed from, and milestones.

    The current lineage is the run of the newest commit (see ``Lineage``); steps of other
    lineages (a run abandoned by a rollback) are kept until the current one holds
    ``keep_last`` steps of its own. A milestone is every step divisible by
    ``milestone_every`` (0: none) or a step saved with ``milestone=True`` in its metadata.
    The newest committed step is never deleted.
    """

    keep_last: int = 3
    milestone_every: int = 0

    def __post_init__(self):
        if self.keep_last < 1:
            raise ValueError(f"keep_last={self.keep_last} must be >= 1 (the newest step is always kept)")
        if self.milestone_every < 0:
            raise ValueError(f"milestone_every={self.milestone_every} must be >= 0 (0 turns it off)")


@dataclass(frozen=True)
class Lineage:
    """Where a commit sits in its root's history, recorded in its marker as ``lineage``.

    ``id``: the run (lineage) the step belongs to; a run that resumes from a step other than
    the newest of that step's lineage (a rollback) starts a new one. ``seq``: the commit's
    place in the root's commit order (1 + the highest recorded). ``parent``: the step the
    save continued from (the lineage's previous commit, or for its first commit the step it
    resumed from). ``base``: the step the lineage resumed from (None: it started from
    nothing or continues a run saved without lineage). A marker without the field is of the
    one legacy lineage (``id == ""``, ``seq == 0``), ordered by step.
    """

    id: str
    seq: int
    parent: int | None
    base: int | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def parse(cls, doc: object) -> Lineage | None:
        """The lineage recorded in a marker, or None if it has none (or a malformed one)."""
        if not isinstance(doc, dict):
            return None
        lid, seq, parent, base = (doc.get(k) for k in ("id", "seq", "parent", "base"))
        steps_ok = all(v is None or (type(v) is int and v >= 0) for v in (parent, base))
        if isinstance(lid, str) and _LINEAGE_RE.fullmatch(lid) and type(seq) is int and seq >= 1 and steps_ok:
            return cls(lid, seq, parent, base)
        return None


LEGACY = Lineage("", 0, None, None)


@dataclass(frozen=True)
class Commit:
    """One committed step as the history sees it: its lineage and whether its marker is
    intact (a malformed or unreadable one counts as legacy and may be saved over)."""

    step: int
    lineage: Lineage
    intact: bool
    milestone: bool = False

    @property
    def order(self) -> tuple[int, int]:
        return self.lineage.seq, self.step


def kept_steps(history: list[Commit], policy: Retention) -> set[int]:
    """The steps ``policy`` keeps of ``history`` (commit order): the newest ``keep_last`` of
    the newest commit's lineage, the step that lineage resumed from, milestones, and every
    other lineage's steps while the newest holds fewer than ``keep_last`` of its own (and a
    damaged marker numbered beyond the newest commit: its lineage is unknown)."""
    head = head_of(history)
    own = descent(parent_map(history), head.step, stop=head.lineage.base)
    keep = set(own[: policy.keep_last])
    if head.lineage.base is not None:
        keep.add(head.lineage.base)
    if len(own) < policy.keep_last:
        keep |= {c.step for c in history}
    keep |= {c.step for c in history if not c.intact and c.step > head.step}  # may be the newest
    every = policy.milestone_every
    keep |= {c.step for c in history if c.milestone or (every and c.step % every == 0)}
    return keep


def parent_map(history: list[Commit]) -> dict[int, int | None]:
    """Each committed step's parent: the recorded one, or for a legacy marker the legacy step
    before it."""
    out: dict[int, int | None] = {}
    previous = None
    for c in history:
        if c.lineage.id:
            out[c.step] = c.lineage.parent
        else:
            out[c.step], previous = previous, c.step
    return out


def descent(parents: dict[int, int | None], start: int | None, stop: int | None = None) -> list[int]:
    """``start`` and the committed steps it descends from, newest first, up to (without)
    ``stop`` or the first that is not committed."""
    out: list[int] = []
    step = start
    while step is not None and step in parents and step != stop and step not in out:
        out.append(step)
        step = parents[step]
    return out


def next_lineage(step: int, history: list[Commit], resumed: int | None) -> Lineage:
    """The lineage of a new commit of ``step``: it continues the lineage of the step the run
    resumed from (``resumed``; None: the newest commit) when that step is the newest commit
    and ``step`` lies beyond it (a run going on, or restarted from where it stopped); else
    it starts a new lineage, resumed from that step (a rollback)."""
    seq = max((c.lineage.seq for c in history), default=0) + 1
    others = [c for c in history if c.step != step]  # a step of this number is being replaced
    head = newest_head(others)
    start = resumed if resumed is not None else head_of(history).step if history else None
    if start == step:
        start = parent_map(history).get(step)
    if start is None:
        return Lineage(secrets.token_hex(8), seq, None, None)
    if head is not None and head.step == start and step > start:
        return Lineage(head.lineage.id or secrets.token_hex(8), seq, start, head.lineage.base)
    return Lineage(secrets.token_hex(8), seq, start, start)


def newest_head(history: list[Commit]) -> Commit | None:
    """The newest commit with an intact marker (else the newest): where a run goes on from."""
    intact = [c for c in history if c.intact]
    return intact[-1] if intact else history[-1] if history else None


def head_of(history: list[Commit]) -> Commit:
    """``newest_head`` of a history that holds at least one commit."""
    head = newest_head(history)
    if head is None:
        raise ValueError("an empty commit history has no head")
    return head
