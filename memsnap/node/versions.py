"""A node's snapshot versions: the one owner of its version table.

A version is one step's bytes on this node: which arena slot, which ranks, how far it got.
Its life (``State``, ``ALLOWED``)::

    capturing -> queued -> sending -> ready -> committed     (a snapshot taken here)
    restoring -> committed                                   (a rank's bytes gathered back)
    (new) -> committed                                       (re-protection rebuilt a local copy)
    capturing | queued | sending -> committed                (its commit, or a restore, came first)
    capturing | queued -> superseded                         (a newer capture took the slot)
    capturing | queued | sending | ready | restoring -> failed

``Versions`` is the only code that adds a version to the table, moves one to another state
or takes one out; every change is an event method (``begin``, ``captured``, ``sending``,
``sent``, ``committed``, ``abandoned``, ``resumed``, ``spilled``, ``restoring``, ``restored``,
``rebuilt``...), and a move ``ALLOWED`` does not list raises ``VersionStateError``. The
other parts of the agent ask it questions (``free_slot``, ``busy``, ``holds``,
``in_flight_before``...). A version taken out of the table is freed: its slot may take the
next capture (its arenas stay; ``slots.Slots`` gives their pages back when the policy says so).

``SlotPolicy`` answers what lean mode (``local_copy=False``) changes, in one place: which
states keep a slot, whether a committed version stays as the node's local copy, when the
arenas give their pages back.

Every method is called under the agent's lock, but ``checksummed``: the sender fills the
manifests of the version it is sending while it encodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum

from memsnap.errors import VersionStateError


class State(str, Enum):
    """How far a version got. A ``str``: ``v.state == "committed"`` holds, and formats as its value."""

    CAPTURING = "capturing"  # begun: the node's ranks write their arenas
    QUEUED = "queued"  # every local rank captured, waiting for the sender
    SENDING = "sending"  # checksums, stripes, parity and pushes to the holders
    READY = "ready"  # every chunk acknowledged; its commit is on the way
    COMMITTED = "committed"  # every node is ready: the node's local copy of the step
    RESTORING = "restoring"  # a rank's bytes being gathered from its peers into the slot
    FAILED = "failed"  # given up (its error says why); freed by the next ``free_slot``
    SUPERSEDED = "superseded"  # a newer capture took its slot (not a failure)

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]  # (Enum's is typed narrower than str's)
    __hash__ = str.__hash__  # (a state and its value are the same key)


CAPTURING, QUEUED, SENDING, READY, COMMITTED, RESTORING, FAILED, SUPERSEDED = State

# What each state may become. ``None``: a version new to the table.
ALLOWED: dict[State | None, frozenset[State]] = {
    None: frozenset({CAPTURING, RESTORING, COMMITTED}),
    CAPTURING: frozenset({QUEUED, SUPERSEDED, FAILED, COMMITTED}),
    QUEUED: frozenset({SENDING, SUPERSEDED, FAILED, COMMITTED}),
    SENDING: frozenset({READY, FAILED, COMMITTED}),
    READY: frozenset({COMMITTED, FAILED}),
    RESTORING: frozenset({COMMITTED, FAILED}),
    COMMITTED: frozenset({COMMITTED}),  # (a second rank of the node restored into it)
    FAILED: frozenset(),
    SUPERSEDED: frozenset(),
}
# (capturing/queued/sending -> committed: the commit notice, or a restore, of a step this
# node had not finished sending; ready -> committed is the usual way)

IN_FLIGHT = (CAPTURING, QUEUED, SENDING, READY)  # taken here, its commit not yet heard
LIVE = IN_FLIGHT + (COMMITTED, RESTORING)


@dataclass
class Version:
    """One step's bytes on this node: which slot, which ranks, how far it got."""

    step: int
    slot: int
    state: State = CAPTURING
    sizes: dict[int, int] = field(default_factory=dict)  # rank -> nbytes
    manifests: dict[int, str] = field(default_factory=dict)  # rank -> manifest JSON
    error: str | None = None
    gen: int = 0  # the restore generation it was taken in (see ``AgentCore.resume``)

    def __setattr__(self, name, value):
        if name == "state":
            value = State(value)  # a value given as its string is the state
        object.__setattr__(self, name, value)


@dataclass(frozen=True)
class SlotPolicy:
    """The lean-mode questions: ``local_copy`` (a committed version stays as this node's
    copy) and ``spill`` (a durable tier is configured). ``SnapshotConfig.slots`` sizes the
    slots to match: ``keep+1`` with the local copy, else 1, plus 1 with a spill."""

    local_copy: bool = True
    spill: bool = False

    @classmethod
    def of(cls, cfg) -> SlotPolicy:
        return cls(bool(cfg.local_copy), cfg.spill is not None)

    def holds_slot(self, state: State) -> bool:
        """Whether a version in ``state`` keeps its slot from a new capture. Lean mode: a
        sent ("ready") version gives it up, since its bytes are at its holders; with a spill
        it keeps it until its commit says whether the spill is due."""
        if state is READY:
            return self.local_copy or self.spill
        return state in LIVE

    def keeps_committed(self, spill_due: bool) -> bool:
        """Whether a version stays in its slot once committed: the local copy; lean mode: only
        while a spill that is due writes it."""
        return self.local_copy or spill_due

    def holds_for_spill(self, spill_due: bool) -> bool:
        """Lean mode with a due spill: the committed version is held for it, and an older one
        held for its own spill gives way (unless it is being written)."""
        return not self.local_copy and spill_due

    @property
    def releases_when_sent(self) -> bool:
        """Lean mode without a spill: the arenas give their pages back once every chunk is
        acknowledged (RAM at rest: S(k+m)/k, not S(k+m)/k + S)."""
        return not self.local_copy and not self.spill

    @property
    def frees_when_spilled(self) -> bool:
        """Lean mode: a committed version held for its spill is freed once written."""
        return not self.local_copy

    @property
    def keeps_restored(self) -> bool:
        """Whether a rank's bytes restored into a slot stay as the node's local copy (lean
        mode: the slot is free at once, its pages kept for the rank reading them)."""
        return self.local_copy

    @property
    def clears_for_restore(self) -> bool:
        """Lean mode: a restore takes the one slot back from any version not committed here."""
        return not self.local_copy


class Versions(Mapping):
    """The node's version table (read it as a ``{step: Version}`` mapping), and every change
    to it. ``slots``: arena slots per rank; ``keep``: committed versions kept; ``counters``:
    the agent's (``failed_snapshots``); ``replaced(v, was, step)``: ``v`` gave its slot to
    ``step`` (``was``: how far it had got)."""

    def __init__(
        self,
        policy: SlotPolicy,
        slots: int,
        keep: int,
        counters: dict | None = None,
        replaced: Callable[[Version, str, int], None] | None = None,
    ):
        self.policy, self.slots, self.keep = policy, slots, keep
        self.counters = counters if counters is not None else {}
        self.counters.setdefault("failed_snapshots", 0)
        self.replaced = replaced or (lambda v, was, step: None)
        self._table: dict[int, Version] = {}

    # --- the mapping (read only) -----------------------------------------------------------------
    def __getitem__(self, step: int) -> Version:
        return self._table[step]

    def __iter__(self) -> Iterator[int]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"Versions({ {s: v.state.value for s, v in self._table.items()} })"

    # --- the one place a state changes, a version comes or goes ------------------------------------
    def _move(self, v: Version, to: State) -> None:
        was = None if v.state is None else State(v.state)
        if to not in ALLOWED[was]:
            name = "new" if was is None else was.value
            raise VersionStateError(
                f"step {v.step}: a {name} version cannot become {to.value} "
                f"(it may become {sorted(s.value for s in ALLOWED[was]) or 'nothing'})"
            )
        v.state = to

    def _add(self, v: Version, to: State) -> Version:
        old = self._table.get(v.step)
        if old is not None and old.state is not FAILED:
            raise VersionStateError(
                f"step {v.step} is already {old.state} here: a new version of it may only replace a failed one"
            )
        object.__setattr__(v, "state", None)
        self._move(v, to)
        self._table[v.step] = v
        return v

    def _free(self, v: Version) -> None:
        if self._table.get(v.step) is v:
            del self._table[v.step]

    def held(self, v: Version) -> bool:
        """Whether ``v`` is still in the table (a freed version's owner may still hold it)."""
        return self._table.get(v.step) is v

    # --- a snapshot taken here ------------------------------------------------------------------
    def begin(self, step: int, slot: int, gen: int = 0) -> Version:
        """A new capture of ``step`` in ``slot`` (over a failed version of it, if any)."""
        return self._add(Version(step, slot, gen=gen), CAPTURING)

    def add_rank(self, v: Version, rank: int, nbytes: int) -> None:
        """``rank`` captures ``nbytes`` into ``v`` (again: its earlier manifest is void)."""
        v.sizes[rank] = nbytes
        v.manifests.pop(rank, None)

    def withdraw(self, v: Version) -> None:
        """A ``begin`` that could not give ``v`` its first rank (the arena did not fit): gone."""
        if not v.sizes:
            self._free(v)

    def captured(self, v: Version, rank: int, manifest_json: str, local_ranks) -> bool:
        """``rank`` captured into ``v``; True when that was the node's last one (now queued)."""
        v.manifests[rank] = manifest_json
        if not set(local_ranks) <= set(v.manifests):
            return False
        self._move(v, QUEUED)
        return True

    def capture_dropped(self, step: int) -> None:
        """A capture of an abandoned step came in: a version still capturing frees its slot
        (each rank writes only its own arena)."""
        v = self._table.get(step)
        if v is not None and v.state is CAPTURING:
            self._free(v)

    def sending(self, v: Version) -> bool:
        """The sender takes ``v``; False when a newer capture replaced it while it waited."""
        if v.state is not QUEUED:
            return False
        self._move(v, SENDING)
        return True

    def checksummed(self, v: Version, rank: int, manifest_json: str) -> None:
        """The sender filled the checksums of ``rank``'s manifest (its own ``SENDING`` version)."""
        v.manifests[rank] = manifest_json

    def sent(self, v: Version) -> bool:
        """Every chunk of ``v`` was acknowledged; False when it was given up meanwhile."""
        if v.state is not SENDING:
            return False
        self._move(v, READY)
        return True

    def failed(self, v: Version, why: str, counted: bool = True) -> None:
        """``v`` is given up and counted (``counted=False``: given up, but nothing failed).
        A version no longer in the table is left alone: the job's decision that freed it
        (a commit, an abandon, a resume) counted it, or chose not to."""
        if v.state in (FAILED, COMMITTED, SUPERSEDED) or not self.held(v):
            return
        self._move(v, FAILED)
        v.error = why
        if counted:
            self.counters["failed_snapshots"] += 1

    def given_up(self, v: Version, why: str) -> None:
        """A holder refused ``v``'s chunks: the job gave its step up (a node skipped or replaced
        it) before this node heard so. Freed, not counted: nothing failed."""
        self.failed(v, why, counted=False)
        self._free(v)

    # --- which slot -------------------------------------------------------------------------------
    def free_slot(self, step: int, pinned: Callable[[int], bool]) -> int | None:
        """A slot for ``step``, or None when the pipeline is busy (the save is skipped, not
        failed). Under pressure the newest capture wins: it takes the slot of an older one
        that has not started sending (never of one already sent: see below). ``pinned(s)``:
        the spill is writing ``s`` (it may not be freed)."""
        self._supersede(pinned)
        free = self.free_slots()
        committed = self._steps(COMMITTED)
        if not free and len(committed) >= 2 and not pinned(committed[0]):
            self._free(self._table[committed[0]])  # a newer committed version stays whole
            free = self.free_slots()
        # A sent version ("ready": every chunk acknowledged, its commit on the way) never gives
        # way: it is one notice from committing on every node, and a node that replaced it
        # alone would make it fail everywhere; under steady pressure every node doing so in
        # turn would let no step commit at all. The newer capture is skipped instead.
        for state in (QUEUED, CAPTURING):
            if free:
                break
            older = [s for s in self._steps(state) if s < step]
            if older:
                self._replace(self._table[older[0]], step)
                free = self.free_slots()
        return free[0] if free else None

    def _replace(self, v: Version, step: int) -> None:
        was = "not yet sent" if v.state is QUEUED else "still capturing"
        self._move(v, SUPERSEDED)
        v.error = f"replaced by step {step}"
        self._free(v)
        self.replaced(v, was, step)

    def _supersede(self, pinned: Callable[[int], bool]) -> None:
        """Free committed versions beyond ``keep`` and forget failed ones."""
        committed = self._steps(COMMITTED)
        for s in committed[: -self.keep] if len(committed) > self.keep else []:
            if not pinned(s):
                self._free(self._table[s])
        for s in self._steps(FAILED):
            self._free(self._table[s])

    def _steps(self, state: State) -> list[int]:
        return sorted(s for s, v in self._table.items() if v.state is state)

    def free_slots(self) -> list[int]:
        """The slots no version holds (``SlotPolicy.holds_slot``)."""
        used = {v.slot for v in self._table.values() if self.policy.holds_slot(v.state)}
        return [s for s in range(self.slots) if s not in used]

    def shares_slot(self, v: Version) -> bool:
        """Whether another live version uses ``v``'s slot (a newer capture took it meanwhile)."""
        return any(o is not v and o.slot == v.slot and o.state in LIVE for o in self._table.values())

    # --- what the coordinator decides ---------------------------------------------------------------
    def committed(
        self, step: int, keep, spill_due: bool, pinned: Callable[[int], bool], release: Callable[[Version], None]
    ) -> None:
        """Every node is ready with ``step``: it is committed here; the steps older than it
        and not in ``keep`` are freed (given up, not counted failed, if they had not committed:
        a newer step overtook them, as the coordinator's log records it). ``release(v)``: the
        arenas of a freed version give their pages back (the policy decides when)."""
        v = self._table.get(step)
        if self.policy.holds_for_spill(spill_due):  # an older step held for a spill gives way,
            for s in [s for s in self._steps(COMMITTED) if s < step and not pinned(s)]:  # unless written
                self._free(self._table[s])
        if v is not None and v.state in (READY, QUEUED, SENDING):
            self._move(v, COMMITTED)
            if not self.policy.keeps_committed(spill_due):
                self._free(v)
                release(v)
        for old in [o for s, o in self._table.items() if s < step and s not in keep and not pinned(s)]:
            self.failed(old, f"step {step} committed first", counted=False)  # overtaken: newest wins
            self._free(old)

    def abandoned(self, step: int, why: str, failed: bool = True) -> None:
        """The job gave up ``step`` (``failed=False``: a node skipped or replaced it, which is
        not a failure, nor is a roll back below it): an uncommitted version of it is freed (a
        sender still sending it stops at its next chunk: ``held`` says it is gone)."""
        v = self._table.get(step)
        if v is not None and v.state is not COMMITTED:
            if failed:
                self.failed(v, f"abandoned: {why}")
            self._free(v)

    def resumed(self, last: int, why: str) -> None:
        """The job resumed from step ``last``: every uncommitted version after it fails."""
        for v in [v for v in self._table.values() if v.step > last and v.state is not COMMITTED]:
            self.failed(v, why)
            self._free(v)

    def spilled(self, step: int) -> Version | None:
        """The spill wrote ``step``: lean mode held it only for that, so it is freed; the
        version whose pages go back, or None."""
        v = self._table.get(step)
        if not self.policy.frees_when_spilled or v is None or v.state is not COMMITTED:
            return None
        self._free(v)
        return v

    # --- a restore into this node ---------------------------------------------------------------------
    def clear_for_restore(self, step: int) -> None:
        """Lean mode: the one slot may hold a step that was never committed here (the job
        resumes from ``step``, so it is dropped anyway); give it up so ``step`` can use it."""
        if not self.policy.clears_for_restore:
            return
        for v in [v for v in self._table.values() if (v.step, v.state) != (step, RESTORING)]:
            self.failed(v, f"the job restores step {step}")
            self._free(v)

    def restoring(self, step: int, slot: int) -> Version:
        """A rank's bytes of ``step`` are gathered into ``slot`` (over a failed version of it)."""
        return self._add(Version(step, slot), RESTORING)

    def restore_rank(self, v: Version, rank: int, nbytes: int) -> None:
        """``rank``'s ``nbytes`` are being gathered into ``v``'s slot."""
        v.sizes[rank] = nbytes

    def restored(self, v: Version, rank: int, manifest_json: str) -> None:
        """``rank``'s bytes are in ``v``'s arena: ``v`` is committed, a local copy (lean mode:
        the slot is free again; the rank reads the arena now, the next save reuses it). A
        version freed, or given up, while the bytes came in stays so."""
        v.manifests[rank] = manifest_json
        if not self.held(v) or v.state is FAILED:
            return
        self._move(v, COMMITTED)
        if not self.policy.keeps_restored:
            self._free(v)

    def rebuilt(self, step: int, slot: int, gen: int) -> Version:
        """Re-protection rebuilt a local copy of committed ``step`` into ``slot``."""
        return self._add(Version(step, slot, gen=gen), COMMITTED)

    def add_copy(self, v: Version, rank: int, nbytes: int, manifest_json: str) -> None:
        """``rank``'s committed bytes of ``v`` are installed in its slot (a rebuilt copy)."""
        v.sizes[rank], v.manifests[rank] = nbytes, manifest_json

    # --- a rank that left -------------------------------------------------------------------------
    def forget_rank(self, rank: int) -> None:
        """``rank`` runs on another node: its bytes in every version here are gone."""
        for v in self._table.values():
            v.sizes.pop(rank, None)
            v.manifests.pop(rank, None)

    # --- questions ------------------------------------------------------------------------------
    def busy(self) -> list[tuple[int, str]]:
        """(step, state) of every live version, oldest first."""
        return sorted((v.step, v.state.value) for v in self._table.values() if v.state in LIVE)

    def holds(self, step: int, rank: int) -> bool:
        """Whether ``rank``'s committed bytes of ``step`` are here."""
        v = self._table.get(step)
        return v is not None and v.state is COMMITTED and rank in v.manifests

    def committed_version(self, step: int) -> Version | None:
        """``step``'s version if it is committed here (the node's local copy), else None."""
        v = self._table.get(step)
        return v if v is not None and v.state is COMMITTED else None

    def newer_than(self, step: int) -> bool:
        return any(s > step for s in self._table)

    def uncommitted_after(self, last: int) -> list[int]:
        """The steps above ``last`` whose version here is not committed, oldest first."""
        return sorted(s for s, v in self._table.items() if s > last and v.state is not COMMITTED)

    def in_flight_before(self, step: int) -> bool:
        """Whether an older step than ``step`` is on its way to a commit here."""
        return any(s < step and v.state in IN_FLIGHT for s, v in self._table.items())

    def summary(self) -> dict[int, tuple[str, tuple[int, ...]]]:
        """{step: (state, ranks with a manifest)}: the coordinator's view (``Inventory``)."""
        return {s: (v.state.value, tuple(sorted(v.manifests))) for s, v in self._table.items()}

    def local_bytes(self) -> int:
        """The bytes of the committed versions' ranks: this node's local copies."""
        return sum(v.sizes.get(r, 0) for v in self._table.values() if v.state is COMMITTED for r in v.manifests)
