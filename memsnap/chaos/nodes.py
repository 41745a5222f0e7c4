"""Which node a fault's target names: by id (or a unique prefix), label, or index; never the head unless asked."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from memsnap.errors import ConfigError

HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node only
_INDEX = re.compile(r"^memsnap_node_(\d+)$")  # memsnap.localcluster's per-node resource
MIN_PREFIX = 6


@dataclass(frozen=True)
class Node:
    id: str
    alive: bool
    head: bool
    labels: dict = field(default_factory=dict)
    index: int | None = None  # i of a ``memsnap_node_<i>`` resource (the loopback cluster's nodes)


def from_ray(entry: dict) -> Node:
    """A ``Node`` from one entry of ``ray.nodes()``."""
    resources = entry.get("Resources") or {}
    index = next((int(m.group(1)) for r in resources if (m := _INDEX.match(r))), None)
    return Node(
        entry["NodeID"], bool(entry.get("Alive")), HEAD_RESOURCE in resources, dict(entry.get("Labels") or {}), index
    )


def ray_nodes() -> list[Node]:
    import ray

    return [from_ray(e) for e in ray.nodes()]


def resolve(target, nodes: list[Node], rng: random.Random, *, allow_head: bool = False) -> Node:
    """The live node ``target`` names; ``None`` (or a label several nodes carry): one of the
    candidates, drawn with ``rng``. Raises ``ConfigError`` naming the known nodes."""
    live = [n for n in nodes if n.alive]
    if target is None:
        pool = [n for n in live if allow_head or not n.head]
        if not pool:
            raise ConfigError("no live worker node to inject into (the head is spared unless allow_head=True)")
        return rng.choice(sorted(pool, key=lambda n: n.id))
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit() and len(target) < MIN_PREFIX):
        found = [n for n in nodes if n.index == int(target)]
        what = f"node index {target} (resource memsnap_node_{target})"
    elif isinstance(target, str) and "=" in target:
        key, _, value = target.partition("=")
        found = [n for n in nodes if n.labels.get(key) == value]
        what = f"label {target!r}"
    else:
        found = _by_id(str(target), nodes)
        what = f"node id {target!r}"
    if not found:
        raise ConfigError(f"no node matches {what}; the cluster's nodes are {_known(nodes)}")
    alive = [n for n in found if n.alive]
    if not alive:
        raise ConfigError(f"{what} names node(s) {[n.id[:12] for n in found]} that are already dead")
    spared = [n for n in alive if allow_head or not n.head]
    if not spared:
        raise ConfigError(
            f"{what} names the head node {alive[0].id[:12]}; faults spare the head unless "
            "asked explicitly (allow_head=True, --allow-head)"
        )
    return rng.choice(sorted(spared, key=lambda n: n.id))


def _by_id(target: str, nodes: list[Node]) -> list[Node]:
    exact = [n for n in nodes if n.id == target]
    if exact:
        return exact
    if len(target) < MIN_PREFIX or not re.fullmatch(r"[0-9a-fA-F]+", target):
        raise ConfigError(
            f"target {target!r} is not a node id: give a node id or a prefix of at least {MIN_PREFIX} "
            f"hex digits, 'key=value' for a label, or a node index; nodes: {_known(nodes)}"
        )
    found = [n for n in nodes if n.id.startswith(target.lower())]
    if len(found) > 1:
        raise ConfigError(
            f"node id prefix {target!r} matches {len(found)} nodes ({[n.id[:12] for n in found]}); give more digits"
        )
    return found


def _known(nodes: list[Node]) -> str:
    parts = [
        f"{n.id[:12]}{' (head)' if n.head else ''}{'' if n.alive else ' (dead)'}"
        + ("" if n.index is None else f" index {n.index}")
        for n in nodes
    ]
    return ", ".join(parts) or "none"
