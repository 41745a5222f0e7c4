"""Membership by node: which ranks run where, the nodes' data-plane addresses, the placement.

The job's *nodes* are those running ranks plus spares (an agent of the job, no rank).
Protection needs ``k+m+1`` of them; with fewer, ``peers=None`` (the default) runs on local
RAM + spill and says so once, and ``peers=True`` is refused with the reason at once.
Placement waits until every rank registered: until a restarted worker group has all
re-registered, ranks can still name nodes of the old group (Ray Train moves ranks).
A rank that comes back on a new node takes a lost node's slot (``placement.replace_node``);
a lost spare, whose slot nobody comes back to, leaves the placement (``drop_lost_spares``).

Every rank is *held* by a run (``identity``): a newcomer of the same run takes its rank back
(a restart, on any node), and so does any newcomer once the holder's process is gone; a
holder of another run that still runs is a *rival*, and the newcomer is refused
(``rivals``, ``refusal``). A newcomer with another world size (an elastic restart) must find
every holder gone or of its own run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from memsnap.config import SnapshotConfig
from memsnap.errors import CommitError
from memsnap.identity import Claim
from memsnap.job.placement import NodeInfo, Placement, place, place_local, replace_node
from memsnap.records import Holders, Placed

log = logging.getLogger("memsnap.coordinator")


@dataclass(frozen=True)
class Holder:
    """Who holds a rank: its run id, its process (``identity.process_token``) and its node."""

    run: str | None  # (None: a rank started with no run id)
    process: str
    node: str

    def to_wire(self) -> dict:
        return {"run": self.run, "process": self.process, "node": self.node}


def rivals(holders: dict[int, Holder], claims: dict[int, Claim], every: bool = False) -> dict[int, dict[int, Holder]]:
    """``{newcomer rank: {rank: holder}}``: the holders each newcomer may only replace once
    their process is gone. Its own rank's holder (with ``every``, an elastic restart: every
    holder) unless that holder is of the newcomer's run or, for a newcomer that came with no
    run id, its very process (a rank registering again)."""
    out: dict[int, dict[int, Holder]] = {}
    for rank, claim in claims.items():
        held = holders.items() if every else [(rank, holders[rank])] if rank in holders else []
        theirs = {
            r: h for r, h in held if not (h.run == claim.run if claim.run is not None else h.process == claim.process)
        }
        if theirs:
            out[rank] = theirs
    return out


def refusal(job: str, rank: int, claim: Claim, holder_rank: int, holder: Holder) -> str:
    """The one-line reason a newcomer is refused: both runs, and the fixes."""
    mine = f"run {claim.run!r}" if claim.run is not None else "a process with no run id"
    return (
        f"job {job!r}: rank {rank} of {mine} cannot register: rank {holder_rank} is held by run "
        f"{holder.run!r}, still running (process {holder.process} on node {holder.node[:12]}), and two runs "
        f"with one job name would share their snapshots. Give this run its own job name, or pass the "
        f"same run id (run={holder.run!r} or MEMSNAP_RUN_ID) if it is a restart of that run, "
        f"or stop the old run first (memsnap.shutdown({job!r}))"
    )


class Membership:
    """``alive()``: the live Ray node ids; ``find_spares(busy)``: ``{node: address}`` of the
    job's agents on live nodes outside ``busy``."""

    def __init__(
        self, cfg: SnapshotConfig, world: int, alive: Callable[[], set[str]], find_spares: Callable[[set[str]], dict]
    ):
        self.cfg, self.world = cfg, world
        self.alive, self.find_spares = alive, find_spares
        self.members: dict[int, str] = {}
        self.holders: dict[int, Holder] = {}  # rank -> the run and process that registered it last
        self.addrs: dict[str, dict] = {}
        self.placement: Placement | None = None
        self.epoch = 0
        self.place_error: str | None = None
        self.peered = False  # pieces go to other nodes (else local RAM + spill)
        self.no_peers_why: str | None = None
        self._by_node: dict[str, list[int]] | None = None

    def by_node(self) -> dict[str, list[int]]:
        """``{node: its ranks}`` for the nodes running ranks; cached until a rank joins."""
        if self._by_node is None:
            self._by_node = {}
            for rank, node in sorted(self.members.items()):
                self._by_node.setdefault(node, []).append(rank)
        return self._by_node

    def owners(self) -> frozenset[str]:
        """The nodes running ranks (each must report before a step commits)."""
        return frozenset(self.by_node())

    def needs_a_dead_node(self, node: str) -> bool:
        """``node`` is new to a placement with peers: it can only join in a lost node's slot."""
        return self.peered and self.placement is not None and node not in self.placement.holders

    def join(self, node: str, address: dict, ranks: list[int]) -> bool:
        """Ranks ``ranks`` run on ``node`` (its agent at ``address``). True when the node took
        a lost node's slot (re-protection is due)."""
        for rank in ranks:
            if not isinstance(rank, int) or not 0 <= rank < self.world:
                raise CommitError(f"rank={rank!r}: must be an int in [0, world_size={self.world})")
        olds = [self.members.get(r) for r in ranks]
        for rank in ranks:
            self.members[rank] = node
        self._by_node = None
        self.addrs[node] = address
        if self.placement is None or not self.peered:
            self.maybe_place()
            return False
        if node not in self.placement.holders:
            self._replace(next((o for o in olds if o is not None), None), node)
            return True
        return False

    def add_spare(self, node: str, address: dict) -> bool:
        """A spare agent started on ``node`` after the job was placed (a warm standby's node, a
        node added to the cluster): the job is placed anew with it, so that a rank it takes over
        later joins a placed node (not only in a dead node's slot) and pieces can go to it now.
        True when the placement changed."""
        if (
            not self.peered
            or self.placement is None
            or node in self.placement.holders
            or node in self.by_node()
            or node not in self.alive()
        ):
            return False
        self.addrs[node] = address
        epoch = self.epoch
        self.maybe_place()
        return self.epoch != epoch

    def maybe_place(self) -> None:
        if len(self.members) < self.world:
            return
        busy = set(self.members.values())
        self.addrs.update(self.find_spares(busy))
        nodes = [NodeInfo(n) for n in sorted(busy | (set(self.addrs) & self.alive()))]
        need = self.cfg.k + self.cfg.m + 1
        if self.cfg.peers is False or (self.cfg.peers is None and len(nodes) < need):
            self._place_locally(
                nodes,
                "peers=False"
                if self.cfg.peers is False
                else f"the job runs on {len(nodes)} node(s) and erasure-coded protection needs "
                f"k+m+1={need} (k={self.cfg.k}, m={self.cfg.m})",
            )
            return
        try:
            self.placement = place(nodes, self.cfg.k, self.cfg.m, self.cfg.group_size)
        except ValueError as exc:
            self.place_error = (
                f"{exc} (peers=True; ranks run on {len(busy)} node(s), spares "
                f"{len(nodes) - len(busy)}): add nodes or spare agents (memsnap.start_spare), "
                "lower k/m, or leave peers unset to run on local RAM + spill"
            )
            log.warning("not placing: %s", self.place_error)
            return
        self.place_error, self.peered, self.no_peers_why = None, True, None
        self.epoch += 1

    def drop_lost_spares(self) -> bool:
        """Placed nodes that run no rank and are dead (lost spares) leave the placement: the
        nodes running ranks and the live spares (one started since included) are placed anew,
        so the next step's pieces go to live holders. A lost node that ran ranks stays: its
        ranks come back on a new node, which takes its slot. True when the placement changed."""
        if self.placement is None or not self.peered:
            return False
        lost = set(self.placement.holders) - self.alive() - set(self.by_node())
        if not lost:
            return False
        epoch = self.epoch
        self.maybe_place()
        if self.epoch != epoch:
            log.warning(
                "spare node(s) %s lost: the job's nodes are placed anew without them", [n[:12] for n in sorted(lost)]
            )
        return self.epoch != epoch

    def _place_locally(self, nodes: list[NodeInfo], why: str) -> None:
        if why != self.no_peers_why:
            log.warning(
                "memsnap job %r: no peer protection (%s): snapshots live in each node's RAM (a crashed "
                "process restores from there) and in the spill (a lost node)%s",
                self.cfg.job,
                why,
                "" if self.cfg.spill else "; set spill= to survive a node loss",
            )
        self.no_peers_why, self.peered = why, False
        self.placement = place_local(nodes, self.cfg.k, self.cfg.m)
        self.epoch += 1

    def _replace(self, old: str | None, node: str) -> None:
        """``node`` is new: it takes the slot of a placed node that is dead (``old``, the node
        its ranks ran on before, when that one is dead)."""
        assert self.placement is not None, "a node replaces one of a placement"
        dead = sorted(set(self.placement.holders) - self.alive())
        lost = old if old in dead else (dead[0] if dead else None)
        if lost is None:
            raise CommitError(
                f"node {node[:12]} joined but no placed node was lost; "
                "start the job with every node, or restart it to re-place"
            )
        self.placement = replace_node(self.placement, lost, NodeInfo(node))
        self.epoch += 1
        log.warning("node %s replaces lost node %s", node[:12], lost[:12])

    def decided(self) -> bool:
        return self.placement is not None or self.place_error is not None

    def answer(self, node: str) -> Placed:
        """What a node's agent learns once placed: its ranks, whether pieces go to peers, and
        its holders (the layout it sends by, cached until ``epoch`` changes)."""
        if self.placement is None:
            raise CommitError(self.place_error or "not placed yet")
        return Placed(
            tuple(self.by_node().get(node, [])),
            self.peered,
            self.no_peers_why,
            self.epoch,
            self.world,
            self.holders_of(node) if node in self.placement.holders else None,
        )

    def holders_of(self, node: str) -> Holders:
        """``node``'s ``k+m`` holders and their addresses (none without peers)."""
        if self.placement is None or node not in self.placement.holders:
            raise CommitError(f"node {node[:12]} is not placed yet; every rank must register first")
        holders = tuple(self.placement.holders[node])
        return Holders(holders, tuple(self.addrs.get(h) for h in holders), self.epoch)

    def live_nodes(self) -> list[str]:
        """Every node with an agent of the job (ranks or spare) that Ray still sees alive."""
        return sorted(set(self.addrs) & self.alive())
