"""Who can load what: the coverage map of the live agents, the collective restore decision,
and how many more node losses each owner's bytes survive. Pure, no Ray.

``inventories`` maps a live node to what its agent reports (``records.Inventory``): its own
ranks' arenas by step and the chunks it holds for its peers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from memsnap.coding.stripes import stripes_of
from memsnap.job.placement import margin
from memsnap.records import CommitRecord, Inventory


@dataclass(frozen=True)
class JobPlan:
    """The collective restore decision, one for every rank: load ``step`` from ``plan`` (the
    job's tier: ``ram``, ``durable`` or ``none``), each rank through its own tier
    (``ranks``: ``local``, ``copy``, ``peer``, ``elastic``, ``durable`` or ``none``; the
    rank's ``records.RankPlan`` carries both under the same names). ``saved``: for a step
    taken by another world size, ``{saved rank: tier}`` for every saved rank, else None."""

    step: int | None
    plan: str
    ranks: Mapping[int, str] = field(default_factory=dict)
    saved: Mapping[int, str] | None = None


def holders_with(record: CommitRecord, owner: str, inventories: Mapping[str, Inventory]) -> list[int]:
    """The shard indices of ``owner`` whose holder is alive and holds every one of its stripes."""
    info = record.nodes[owner]
    need = stripes_of(info.regions, record.k, info.chunk)
    out = []
    for j, node in enumerate(record.holders(owner)):
        inv = inventories.get(node)
        if inv is not None and inv.held_shards(record.step, owner).get(j, 0) >= need:
            out.append(j)
    return out


def has_local(inv: Inventory | None, step: int, rank: int) -> bool:
    """Whether the agent that reported ``inv`` holds ``rank``'s committed bytes of ``step``."""
    return inv is not None and inv.has_local(step, rank)


def rank_tier(
    record: CommitRecord, rank: int, node: str, inventories: Mapping[str, Inventory], local_copy: bool = True
) -> str | None:
    """How ``rank`` (now on ``node``) can load ``record``: ``"local"`` (its node's arena),
    ``"copy"`` (it moved, and its old node still holds its whole copy: one read, no decode),
    ``"peer"`` (``k`` shards per stripe from the holders), or None."""
    owner = record.owner_of(rank)
    if owner is None:
        return None
    if local_copy and has_local(inventories.get(node), record.step, rank):
        return "local"
    if local_copy and node in inventories and owner != node and has_local(inventories.get(owner), record.step, rank):
        return "copy"
    if node in inventories and len(holders_with(record, owner, inventories)) >= record.k:
        return "peer"
    return None


def saved_rank_tier(
    record: CommitRecord, rank: int, inventories: Mapping[str, Inventory], local_copy: bool = True
) -> str | None:
    """How saved rank ``rank``'s bytes of ``record`` can be read by any live node (an elastic
    restore): ``"copy"`` (its owner node still holds them whole), ``"peer"`` (``k`` shards per
    stripe from the holders), or None."""
    owner = record.owner_of(rank)
    if owner is None:
        return None
    if local_copy and has_local(inventories.get(owner), record.step, rank):
        return "copy"
    return "peer" if len(holders_with(record, owner, inventories)) >= record.k else None


def elastic_tiers(
    record: CommitRecord, members: Mapping[int, str], inventories: Mapping[str, Inventory], local_copy: bool = True
) -> dict[int, str] | None:
    """For a step taken by another world size: ``{saved rank: tier}`` when every saved rank
    can be read (each new rank may need a part of any of them) and every new rank's node has
    a live agent, else None."""
    if not all(node in inventories for node in members.values()):
        return None
    tiers = {r: saved_rank_tier(record, r, inventories, local_copy) for r in range(record.world)}
    return {r: t for r, t in tiers.items() if t is not None} if all(tiers.values()) else None


def decide(
    records: Mapping[int, CommitRecord],
    members: Mapping[int, str],
    inventories: Mapping[str, Inventory],
    durable_step: int | None,
    bad=frozenset(),
    local_copy: bool = True,
) -> JobPlan:
    """The plan every rank follows: the newest committed step every rank can load from RAM
    (``local``, ``copy`` or ``peer``), else the newest spilled step for everyone
    (``durable``), else ``none``. ``local_copy=False`` (lean mode): no rank loads from its
    own node; every rank reads its peers.

    A step taken by another world size than ``members`` now has is loaded ``elastic`` by
    every rank (``saved``: ``{saved rank: tier}``), when every saved rank can be read."""
    for step in ram_candidates(records, durable_step, bad):
        if records[step].world != len(members):
            saved = elastic_tiers(records[step], members, inventories, local_copy)
            if saved is not None:
                return JobPlan(step, "ram", {r: "elastic" for r in members}, saved)
            continue
        tiers = {r: rank_tier(records[step], r, node, inventories, local_copy) for r, node in members.items()}
        if all(tiers.values()):
            return JobPlan(step, "ram", {r: t for r, t in tiers.items() if t})
    if durable_step is not None:
        return JobPlan(durable_step, "durable", {r: "durable" for r in members})
    return JobPlan(None, "none", {r: "none" for r in members})


def ram_candidates(records: Mapping[int, CommitRecord], durable_step: int | None, bad=frozenset()) -> list[int]:
    """The committed steps ``decide`` tries to load from RAM, newest first: none that a round
    found bad, none older than the spilled step."""
    return [s for s in sorted(records, reverse=True) if s not in bad and (durable_step is None or s >= durable_step)]


def best_step(records: Mapping[int, CommitRecord], durable_step: int | None, bad=frozenset()) -> int | None:
    """The step ``decide`` would plan from RAM if every node answered: the first committed
    step it tries (None: it tries none, and no node's RAM could change its plan)."""
    return next(iter(ram_candidates(records, durable_step, bad)), None)


def owner_margin(
    record: CommitRecord,
    owner: str,
    members: Mapping[int, str],
    inventories: Mapping[str, Inventory],
    local_copy: bool = True,
) -> int:
    """How many more node losses ``owner``'s bytes in ``record`` survive (-1: already lost).
    The owner's own copy adds one (it must die too), except in lean mode (``local_copy=False``)."""
    lost = record.k + record.m - len(holders_with(record, owner, inventories))
    local = local_copy and all(
        has_local(inventories.get(members.get(r, "")), record.step, r) for r in record.ranks_of(owner)
    )
    return margin(record.m, lost, local)
