"""Placement: which nodes hold the Reed-Solomon shards of which node's bytes. Pure, no Ray.

Nodes are split into groups of at least ``k+m+1`` that protect each other. Inside a group the
members sit on a ring and each owner's ``k+m`` shards go to the next ``k+m`` members, so no
node holds its own shards and every node is protected, whatever the group's size. Nodes are
dealt to groups in the order of their failure domain (region, zone, rack labels), which puts
the nodes of one domain into different groups whenever the domain is no larger than the
number of groups — the best any split can do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DOMAIN_LABELS = ("region", "zone", "rack")  # failure domains, outermost first


@dataclass(frozen=True)
class NodeInfo:
    """One node of the job: its Ray node id (hex) and its labels, e.g. ``{"rack": "r1"}``."""

    node_id: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError(f"NodeInfo node_id={self.node_id!r}: pass the Ray node id as a non-empty str")
        object.__setattr__(self, "labels", {str(k): str(v) for k, v in dict(self.labels).items()})

    def __hash__(self) -> int:
        return hash((self.node_id, tuple(sorted(self.labels.items()))))

    @property
    def domain(self) -> tuple[str, ...]:
        """The node's failure domain, outermost label first ("" where a label is absent)."""
        return tuple(str(self.labels.get(name, "")) for name in DOMAIN_LABELS)


@dataclass(frozen=True)
class Placement:
    """Groups of nodes and, for every owner, the ``k+m`` nodes holding its shards.

    ``holders[o][j]`` holds shard ``j`` (``j < k`` data, ``j >= k`` parity) of every stripe
    of owner ``o``; all of them are in ``o``'s group and none is ``o``.
    """

    k: int
    m: int
    groups: tuple[tuple[str, ...], ...]
    holders: Mapping[str, tuple[str, ...]]

    def __hash__(self) -> int:
        return hash((self.k, self.m, self.groups))

    def group_of(self, node_id: str) -> int:
        """The index of the group ``node_id`` belongs to; KeyError if it is not placed."""
        for i, group in enumerate(self.groups):
            if node_id in group:
                return i
        raise KeyError(f"node {node_id!r} is not in this placement")

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every placed node id, group by group."""
        return tuple(n for group in self.groups for n in group)

    def to_dict(self) -> dict:
        """A JSON-able form (for status reports and for sending between actors)."""
        return {
            "k": self.k,
            "m": self.m,
            "groups": [list(g) for g in self.groups],
            "holders": {o: list(hs) for o, hs in self.holders.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Placement:
        """The placement ``to_dict`` wrote."""
        return cls(
            int(d["k"]),
            int(d["m"]),
            tuple(tuple(g) for g in d["groups"]),
            {o: tuple(hs) for o, hs in d["holders"].items()},
        )


def _check_code(k: int, m: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: must be an int >= 1 (k=1 is replication)")
    if not isinstance(m, int) or m < 0:
        raise ValueError(f"m={m!r}: must be an int >= 0")


def _group_count(n: int, k: int, m: int, group_size: int | None) -> int:
    need = k + m + 1
    size = need if group_size is None else group_size
    if not isinstance(size, int) or size < need:
        raise ValueError(f"group_size={group_size!r}: a group needs at least k+m+1={need} nodes")
    if n < need:
        raise ValueError(
            f"{n} nodes cannot hold k={k} data + m={m} parity shards on other nodes: "
            f"that needs at least k+m+1={need} nodes; add nodes or lower k or m"
        )
    return n // size


def _interleave(nodes: list[NodeInfo]) -> list[NodeInfo]:
    """``nodes`` reordered so that consecutive ones come from different domains where possible."""
    by_domain: dict[tuple[str, ...], list[NodeInfo]] = {}
    for node in nodes:
        by_domain.setdefault(node.domain, []).append(node)
    queues = [by_domain[d] for d in sorted(by_domain)]
    out: list[NodeInfo] = []
    for i in range(max(len(q) for q in queues)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def _ring_holders(members: Sequence[str], width: int) -> dict[str, tuple[str, ...]]:
    s = len(members)
    return {o: tuple(members[(i + 1 + j) % s] for j in range(width)) for i, o in enumerate(members)}


def place(nodes: Sequence[NodeInfo], k: int, m: int, group_size: int | None = None) -> Placement:
    """Split ``nodes`` into groups of at least ``k+m+1`` (or ``group_size``) and assign holders.

    Deterministic: the result depends only on the set of nodes and their labels, not on
    their order. Raises ValueError when there are fewer than ``k+m+1`` nodes.
    """
    _check_code(k, m)
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError(f"node ids must be unique; duplicates: {sorted({i for i in ids if ids.count(i) > 1})}")
    count = _group_count(len(nodes), k, m, group_size)
    ordered = sorted(nodes, key=lambda n: (n.domain, n.node_id))
    dealt: list[list[NodeInfo]] = [[] for _ in range(count)]
    for i, node in enumerate(ordered):
        dealt[i % count].append(node)
    groups = tuple(tuple(n.node_id for n in _interleave(g)) for g in dealt)
    holders: dict[str, tuple[str, ...]] = {}
    for group in groups:
        holders.update(_ring_holders(group, k + m))
    return Placement(k, m, groups, holders)


def place_local(nodes: Sequence[NodeInfo], k: int, m: int) -> Placement:
    """The placement of a job without peers (``peers=False``): one group, nobody holds shards."""
    _check_code(k, m)
    ids = sorted({n.node_id for n in nodes})
    return Placement(k, m, (tuple(ids),), {n: () for n in ids})


def replace_node(p: Placement, lost: str, new: NodeInfo) -> Placement:
    """``p`` with node ``new`` in every slot ``lost`` had (its group, its shards, its holders)."""
    if lost not in p.holders:
        raise ValueError(f"node {lost!r} is not in this placement; nothing to replace")
    if new.node_id in p.holders:
        raise ValueError(f"node {new.node_id!r} is already placed; pass a node that is not")

    def sub(n: str) -> str:
        return new.node_id if n == lost else n

    groups = tuple(tuple(sub(n) for n in g) for g in p.groups)
    holders = {sub(o): tuple(sub(h) for h in hs) for o, hs in p.holders.items()}
    return Placement(p.k, p.m, groups, holders)


def recoverable(p: Placement, owner: str, alive: set[str], local_copy: bool = True) -> bool:
    """Whether ``owner``'s bytes can still be read from RAM when only ``alive`` nodes live."""
    if local_copy and owner in alive:
        return True
    lost = sum(1 for h in p.holders[owner] if h not in alive)
    return lost <= p.m


def margin(m: int, lost: int, local: bool) -> int:
    """How many more node losses an owner's bytes survive, with ``lost`` of its k + m pieces
    gone and (``local``) or without its own whole copy: -1, already unreadable from RAM. The
    own copy counts as one more (the owner must die too). The one rule for the placement's
    plan and the coordinator's view of what the agents hold."""
    if local:
        return max(0, m - lost + 1)
    return m - lost if lost <= m else -1


def _owner_margin(p: Placement, owner: str, alive: set[str], local_copy: bool) -> int:
    lost = sum(1 for h in p.holders[owner] if h not in alive)
    return margin(p.m, lost, local_copy and owner in alive)


def protection_level(p: Placement, alive: set[str], local_copy: bool = True) -> dict[int, int]:
    """Per group: how many more arbitrary node losses every owner's data in it survives now.

    -1 means some owner's data in that group is already unrecoverable from RAM.
    """
    return {i: min(_owner_margin(p, o, alive, local_copy) for o in group) for i, group in enumerate(p.groups)}
