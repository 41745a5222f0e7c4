"""The control plane's records: small, frozen, typed; plain dicts only at the Ray boundary.

Sizes are independent of the tensor count: manifests stay with the agents that hold the
bytes (the owner, and its holders), so the coordinator sees per node per step one
``NodeReady`` of a few hundred bytes and answers each node with a ``CommitNotice``.

    Registered    coordinator -> agent   a node's ranks registered (or refused), the run, the generation
    Placed        coordinator -> agent   a node's placement: its ranks, peers or not, its holders
    Holders       coordinator -> agent   the k+m holders a node sends its stream to (and their addresses)
    NodeReady     agent -> coordinator   phase one: a node's stream is acknowledged by its holders
    CommitNotice  coordinator -> agents  phase two: step t is committed (keep these, spill or not)
    CommitRecord  coordinator, inside    every node's NodeReady of one committed step
    RankSource    coordinator -> a rank  where one rank's bytes of one step live (its restore plan)
    RankPlan      coordinator -> a rank  the collective restore decision, this rank's part
    Inventory     agent -> coordinator   what an agent holds (the coverage map's input) and its RAM
    AgentState    agent -> coordinator   what a rebuilt coordinator learns from one agent
    RankRestore   a rank -> coordinator  how one rank's load of one restore round went
    RoundResult   coordinator -> ranks   a restore round's outcome, the same for every rank
    LastRestore   rank, coordinator      the newest restore that succeeded (``status()["last_restore"]``)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Region:
    """One rank's bytes in its node's stream: ``nbytes`` bytes from stripe ``stripe_base`` on."""

    rank: int
    nbytes: int
    stripe_base: int


@dataclass(frozen=True)
class Registered:
    """The coordinator's answer to a node's ranks registering: ``hints`` (rank -> the bytes a
    restore of it will fill on this node, which holds no copy of its newest committed step),
    ``refused`` (rank -> why: a live rank of another run holds it), the job's ``run`` id and its
    restore ``gen``eration, which a node new to the job takes."""

    hints: Mapping[int, int] = field(default_factory=dict)
    refused: Mapping[int, str] = field(default_factory=dict)
    run: str | None = None
    gen: int = 0

    def merged(self, other: Registered) -> Registered:
        """Two answers to one node (one call per world size) as one."""
        return Registered(
            {**self.hints, **other.hints}, {**self.refused, **other.refused}, other.run, max(self.gen, other.gen)
        )

    def to_wire(self) -> dict:
        return {"hints": dict(self.hints), "refused": dict(self.refused), "run": self.run, "gen": self.gen}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Registered:
        return cls(
            {int(r): int(n) for r, n in d["hints"].items()},
            {int(r): str(w) for r, w in d["refused"].items()},
            d.get("run"),
            int(d.get("gen", 0)),
        )


@dataclass(frozen=True)
class Holders:
    """The ``k+m`` holders of a node's stream, shard ``j`` to ``holders[j]`` at ``addrs[j]``
    (none without peers), as placed in placement ``epoch``."""

    holders: tuple[str, ...]
    addrs: tuple[Any, ...]
    epoch: int

    def to_wire(self) -> dict:
        return {"holders": list(self.holders), "addrs": list(self.addrs), "epoch": self.epoch}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Holders:
        return cls(tuple(d["holders"]), tuple(d["addrs"]), int(d["epoch"]))


@dataclass(frozen=True)
class Placed:
    """What a node's agent learns once the job is placed: the ``ranks`` on it, whether their
    pieces go to ``peers`` (and ``why`` not), the job's ``world`` size, and its ``holders``
    (None for a node that is not placed: a spare). ``epoch`` changes with every placement."""

    ranks: tuple[int, ...]
    peers: bool
    why: str | None
    epoch: int
    world: int
    holders: Holders | None

    def to_wire(self) -> dict:
        return {
            "ranks": list(self.ranks),
            "peers": self.peers,
            "why": self.why,
            "epoch": self.epoch,
            "world": self.world,
            "holders": None if self.holders is None else self.holders.to_wire(),
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Placed:
        h = d.get("holders")
        return cls(
            tuple(int(r) for r in d["ranks"]),
            bool(d["peers"]),
            d.get("why"),
            int(d["epoch"]),
            int(d["world"]),
            None if h is None else Holders.from_wire(h),
        )


@dataclass(frozen=True)
class NodeReady:
    """Phase one of a commit for one node: every chunk of its stream is acknowledged by
    ``holders`` (shard ``j`` of every stripe on ``holders[j]``). ``digest``: xxh3 of the
    manifests the owner sent its holders with the chunks. ``world``: the job's world size
    when the step was taken (0: not known)."""

    step: int
    node: str
    gen: int
    chunk: int
    regions: tuple[Region, ...]
    holders: tuple[str, ...]
    digest: str = ""
    world: int = 0

    def region(self, rank: int) -> Region | None:
        return next((r for r in self.regions if r.rank == rank), None)

    def to_wire(self) -> dict:
        return {
            "step": self.step,
            "node": self.node,
            "gen": self.gen,
            "chunk": self.chunk,
            "regions": [[r.rank, r.nbytes, r.stripe_base] for r in self.regions],
            "holders": list(self.holders),
            "digest": self.digest,
            "world": self.world,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> NodeReady:
        return cls(
            int(d["step"]),
            str(d["node"]),
            int(d["gen"]),
            int(d["chunk"]),
            tuple(Region(int(a), int(b), int(c)) for a, b, c in d["regions"]),
            tuple(d["holders"]),
            str(d.get("digest", "")),
            int(d.get("world", 0)),
        )


@dataclass(frozen=True)
class CommitNotice:
    """Phase two, to every agent: ``step`` is committed; agents keep ``keep`` and free the rest.
    ``spill``: the coordinator asks for this step to be written to durable storage.
    ``moved``: re-protection rebuilt shards of these owners on new holders."""

    step: int
    keep: tuple[int, ...]
    spill: bool = False
    moved: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def to_wire(self) -> dict:
        return {
            "step": self.step,
            "keep": list(self.keep),
            "spill": self.spill,
            "moved": {o: list(h) for o, h in self.moved.items()},
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> CommitNotice:
        return cls(
            int(d["step"]),
            tuple(int(s) for s in d["keep"]),
            bool(d["spill"]),
            {o: tuple(h) for o, h in d.get("moved", {}).items()},
        )


@dataclass(frozen=True)
class RankSource:
    """Where ``region`` (one rank's bytes of ``step``) lives: shard ``j`` of each of its
    stripes on ``holders[j]`` at ``addrs[j]`` (None: address unknown), the owner ``owner``.
    ``copy``: the owner's address when its node still holds the whole committed copy and
    the rank runs elsewhere now: every data shard is read there first (no decode)."""

    step: int
    k: int
    m: int
    owner: str
    chunk: int
    region: Region
    holders: tuple[str, ...]
    addrs: tuple[Any, ...]
    copy: Any = None

    @property
    def rank(self) -> int:
        return self.region.rank

    @property
    def nbytes(self) -> int:
        return self.region.nbytes

    def to_wire(self) -> dict:
        return {
            "step": self.step,
            "k": self.k,
            "m": self.m,
            "owner": self.owner,
            "chunk": self.chunk,
            "region": [self.region.rank, self.region.nbytes, self.region.stripe_base],
            "holders": list(self.holders),
            "addrs": list(self.addrs),
            "copy": self.copy,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> RankSource:
        rank, nbytes, base = d["region"]
        return cls(
            int(d["step"]),
            int(d["k"]),
            int(d["m"]),
            str(d["owner"]),
            int(d["chunk"]),
            Region(int(rank), int(nbytes), int(base)),
            tuple(d["holders"]),
            tuple(d["addrs"]),
            d.get("copy"),
        )


@dataclass(frozen=True)
class CommitRecord:
    """One committed step as the coordinator keeps it: every owner node's ``NodeReady``."""

    step: int
    k: int
    m: int
    nodes: Mapping[str, NodeReady]
    time: float = 0.0
    spill: bool = False

    def owner_of(self, rank: int) -> str | None:
        return self._owners().get(rank)

    def _owners(self) -> dict[int, str]:
        cached = self.__dict__.get("_owner_index")
        if cached is None:
            cached = {r.rank: n for n, info in self.nodes.items() for r in info.regions}
            object.__setattr__(self, "_owner_index", cached)
        return cached

    @property
    def ranks(self) -> list[int]:
        return sorted(self._owners())

    @property
    def world(self) -> int:
        """The world size that took this step (its nodes' word, else how many ranks it has)."""
        return max((i.world for i in self.nodes.values()), default=0) or len(self._owners())

    def complete(self) -> bool:
        """Whether every rank of the world that took the step is in the record."""
        return set(self._owners()) == set(range(self.world))

    def holders(self, owner: str) -> tuple[str, ...]:
        return self.nodes[owner].holders

    def ranks_of(self, owner: str) -> list[int]:
        return [r.rank for r in self.nodes[owner].regions]

    def source(self, rank: int, addrs: Mapping[str, Any]) -> RankSource:
        owner = self._owners()[rank]
        info = self.nodes[owner]
        region = info.region(rank)
        if region is None:
            raise KeyError(f"node {owner} reported no region for rank {rank}")
        return RankSource(
            self.step,
            self.k,
            self.m,
            owner,
            info.chunk,
            region,
            info.holders,
            tuple(addrs.get(h) for h in info.holders),
        )

    def with_holder(self, owner: str, j: int, node: str) -> CommitRecord:
        """This record after shard ``j`` of ``owner`` was rebuilt on ``node`` (re-protection)."""
        info = self.nodes[owner]
        holders = info.holders[:j] + (node,) + info.holders[j + 1 :]
        return replace(self, nodes={**self.nodes, owner: replace(info, holders=holders)})


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of the collective restore decision: load ``step`` through ``tier``
    (``local``, ``copy``, ``peer``, ``elastic``, ``durable`` or ``none``); ``plan``: the job's
    tier (``ram``, ``durable``, ``none``). ``source``: where its bytes live, for a RAM tier.
    ``sources``: for ``elastic`` (the step was taken by another world size), where every
    saved rank's bytes live, in saved rank order; the rank reads the parts it needs."""

    step: int | None
    tier: str
    plan: str
    spill: str | None = None
    source: RankSource | None = None
    sources: tuple[RankSource, ...] = ()

    def to_wire(self) -> dict:
        return {
            "step": self.step,
            "tier": self.tier,
            "plan": self.plan,
            "spill": self.spill,
            "source": None if self.source is None else self.source.to_wire(),
            "sources": [s.to_wire() for s in self.sources],
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> RankPlan:
        src = d.get("source")
        return cls(
            d["step"],
            d["tier"],
            d["plan"],
            d.get("spill"),
            None if src is None else RankSource.from_wire(src),
            tuple(RankSource.from_wire(s) for s in d.get("sources", ())),
        )


@dataclass(frozen=True)
class Inventory:
    """What one agent holds: ``versions`` ``{step: (state, ranks)}`` of its own ranks' arenas,
    ``held`` ``{step: {owner: {shard: chunks}}}`` for its peers, ``committed`` the steps it
    heard committed; ``bytes``, ``counters`` and ``spill`` for status reports."""

    node: str
    address: Any = None
    versions: Mapping[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    held: Mapping[int, Mapping[str, Mapping[int, int]]] = field(default_factory=dict)
    committed: tuple[int, ...] = ()
    bytes: Mapping[str, int] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)
    spill: Mapping[str, Any] | None = None

    def has_local(self, step: int, rank: int) -> bool:
        """Whether this agent holds ``rank``'s committed bytes of ``step``."""
        v = self.versions.get(step)
        return v is not None and v[0] == "committed" and rank in v[1]

    def held_shards(self, step: int, owner: str) -> Mapping[int, int]:
        return self.held.get(step, {}).get(owner, {})

    def to_wire(self) -> dict:
        return {
            "node": self.node,
            "address": self.address,
            "versions": {s: {"state": st, "ranks": list(r)} for s, (st, r) in self.versions.items()},
            "held": self.held,
            "records": list(self.committed),
            "bytes": dict(self.bytes),
            "counters": dict(self.counters),
            "spill": self.spill,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Inventory:
        return cls(
            str(d["node"]),
            d.get("address"),
            {int(s): (v["state"], tuple(v["ranks"])) for s, v in d.get("versions", {}).items()},
            {int(s): dict(h) for s, h in d.get("held", {}).items()},
            tuple(d.get("records", ())),
            dict(d.get("bytes", {})),
            dict(d.get("counters", {})),
            d.get("spill"),
        )


@dataclass(frozen=True)
class RankRestore:
    """One rank's report of one restore round: ``ok`` with the ``tier`` that served it and
    where its ``seconds`` went (phase -> s), or not ``ok`` with the ``error``. What its node's
    agent acts on: ``repaired``, chunks the read found bad at a holder and pushed back
    (counted there); ``rebuild``, the node's own copy was corrupt and the rank read its
    peers instead (the agent reads the copy back from the holders once the round succeeds)."""

    ok: bool
    tier: str | None = None
    seconds: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None
    repaired: int = 0
    rebuild: bool = False

    @classmethod
    def loaded(cls, tier: str, seconds: Mapping[str, float], repaired: int = 0, rebuild: bool = False) -> RankRestore:
        return cls(True, tier, dict(seconds), None, repaired, rebuild)

    @classmethod
    def failed(cls, exc: BaseException, repaired: int = 0) -> RankRestore:
        return cls(False, error=f"{type(exc).__name__}: {exc}", repaired=repaired)

    def to_wire(self) -> dict:
        return {
            "ok": self.ok,
            "tier": self.tier,
            "seconds": dict(self.seconds),
            "error": self.error,
            "repaired": self.repaired,
            "rebuild": self.rebuild,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> RankRestore:
        return cls(
            bool(d["ok"]),
            d.get("tier"),
            {str(k): float(v) for k, v in (d.get("seconds") or {}).items()},
            d.get("error"),
            int(d.get("repaired") or 0),
            bool(d.get("rebuild")),
        )


@dataclass(frozen=True)
class RoundResult:
    """A restore round's outcome, the same for every rank: ``ok``, the ranks that failed (with
    their reports) and the restore generation the job resumed in."""

    ok: bool
    failed: Mapping[int, RankRestore] = field(default_factory=dict)
    gen: int = 0

    def to_wire(self) -> dict:
        return {"ok": self.ok, "failed": {str(r): rep.to_wire() for r, rep in self.failed.items()}, "gen": self.gen}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> RoundResult:
        failed = {int(r): RankRestore.from_wire(rep) for r, rep in (d.get("failed") or {}).items()}
        return cls(bool(d["ok"]), failed, int(d.get("gen") or 0))


@dataclass(frozen=True)
class LastRestore:
    """The newest restore that succeeded: the ``tier`` that served (a rank's; at the
    coordinator, every tier the ranks used, comma-joined), the ``step`` (None: a fresh start)
    and the phases' ``seconds`` (the slowest rank's at the coordinator). ``run``: the run that
    spilled a durable step; ``warning``: why the RAM tiers could not serve."""

    tier: str = "none"
    step: int | None = None
    seconds: Mapping[str, float] = field(default_factory=dict)
    run: str | None = None
    warning: str | None = None

    @property
    def total_s(self) -> float | None:
        return self.seconds.get("total")

    def to_wire(self) -> dict:
        d: dict[str, Any] = {"tier": self.tier, "step": self.step, "seconds": dict(self.seconds)}
        if self.run is not None:
            d["run"] = self.run
        if self.warning is not None:
            d["warning"] = self.warning
        return d

    @classmethod
    def of_round(cls, step: int | None, reports: list[RankRestore]) -> LastRestore:
        """The job's view of a round every rank loaded."""
        tiers = sorted({rep.tier or "none" for rep in reports})
        slowest = max(reports, key=lambda rep: sum(rep.seconds.values()), default=RankRestore(True))
        return cls(",".join(tiers) if tiers else "none", step, dict(slowest.seconds))


@dataclass(frozen=True)
class AgentState:
    """What a rebuilt coordinator learns from one agent: its data-plane ``address``, restore
    generation ``gen``, the ``ranks`` registered on it and who holds each (``holders``: rank
    -> (run id, process token)), the run it served, the steps it heard ``committed`` and every
    ``NodeReady`` it keeps (its own and those of the owners it holds pieces for)."""

    address: Any
    gen: int
    ranks: tuple[int, ...] = ()
    committed: tuple[int, ...] = ()
    infos: tuple[NodeReady, ...] = ()
    run: str | None = None
    holders: Mapping[int, tuple[str | None, str]] = field(default_factory=dict)

    def to_wire(self) -> dict:
        return {
            "address": self.address,
            "gen": self.gen,
            "ranks": list(self.ranks),
            "committed": list(self.committed),
            "infos": [i.to_wire() for i in self.infos],
            "run": self.run,
            "holders": {str(r): {"run": run, "process": proc} for r, (run, proc) in self.holders.items()},
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> AgentState:
        return cls(
            d.get("address"),
            int(d["gen"]),
            tuple(int(r) for r in d.get("ranks", ())),
            tuple(int(s) for s in d.get("committed", ())),
            tuple(NodeReady.from_wire(i) for i in d.get("infos", ())),
            d.get("run"),
            {int(r): (h.get("run"), str(h.get("process", ""))) for r, h in (d.get("holders") or {}).items()},
        )
