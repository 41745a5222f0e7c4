"""What a node's agent does for its ranks toward the coordinator: registration, the
placement answer, waits for a commit, and the restore barriers, once per node.

Every rank of a node calls its agent; the agent's event loop holds each call as a future
(never a parked thread) and speaks to the coordinator for all of them at once
(``waiting.Batch``: one call in flight, carrying every rank that arrived meanwhile), so the
coordinator hears each barrier at most a few times per node, never once per rank. Commit
waits are answered from the commit notices the agent receives; only one that outlives its
deadline asks the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from memsnap.config import tunable
from memsnap.errors import CommitError, JobInUseError
from memsnap.records import Placed, RankPlan, RankRestore, RankSource, Registered, RoundResult
from memsnap.waiting import Batch, Signal

log = logging.getLogger("memsnap.agent")


@dataclass
class _NodeRound:
    """One restore attempt as this node sees it."""

    arrivals: Batch
    reports: Batch
    plans: asyncio.Future | None = None
    result: asyncio.Future | None = None
    closed: bool = False
    ranks: set[int] = field(default_factory=set)
    loads: dict[int, RankRestore] = field(default_factory=dict)  # the node's ranks' reports


class RelayedNode(Protocol):
    """What the relay reads of its node's agent and tells it (``agent.AgentCore`` is one)."""

    node: str
    world: int | None  # the job's world size (None: not known yet)
    address: Any  # the agent's data-plane address
    ranks: set[int]  # the ranks registered on this node
    holders: dict[int, dict]  # rank -> the claim ({"run", "process"}) it registered with
    newest: int | None  # the newest committed step this node heard of

    def joined(self, rank: int, world: int, claim: dict | None = None, gen: int = 0) -> None: ...

    def placed(self, answer: Placed) -> None: ...

    def resolved(self, step: int) -> bool: ...

    def resume(self, step: int | None, gen: int) -> None: ...

    def roll_back(self, step: int | None) -> list[int]: ...

    def count(self, counter: str, n: int) -> None: ...

    def rebuild_local(self, step: int, rank: int, src: RankSource, replace: bool = False) -> bool: ...


class NodeRelay:
    """``core``: the node's agent, as the relay uses it; ``call(method, *args, timeout)``: an
    awaitable call on the coordinator (found again, and the node re-joined, if it was lost)."""

    def __init__(self, core: RelayedNode, call: Callable[..., Awaitable[Any]], signal: Signal):
        self.core, self.call, self.signal = core, call, signal
        self.node = core.node
        self._joins = Batch(self._send_joins)
        self._answer: asyncio.Future | None = None
        self.rounds: dict[int, _NodeRound] = {}

    # --- registration and placement -------------------------------------------------------------
    async def join(self, rank: int, world: int, claim: dict | None = None) -> tuple[int | None, str | None]:
        """Register ``rank`` (of ``world``; ``claim``: its ``identity.Claim`` on the wire) through
        this node: the bytes a restore of it will fill here if this node is new to it (None
        otherwise), and the job's run id. A rank that a live rank of another run holds is
        refused (``JobInUseError``), and nothing here changes."""
        claim = dict(claim or {"run": None, "process": ""})
        self._answer = None
        if self.core.world is None:  # a new agent: the coordinator it may have to start needs the size
            self.core.world = world
        got = await self._joins.add((rank, world, claim))
        if rank in got.refused:
            raise JobInUseError(got.refused[rank])
        self.core.joined(rank, world, dict(claim, run=got.run), got.gen)
        self._answer = None  # the node's ranks changed: ask for the placement again
        return got.hints.get(rank), got.run

    async def _send_joins(self, items: list[tuple[int, int, dict]]) -> Registered:
        """One join call per world size among ``items`` (``(rank, world, claim)``); the answers merged."""
        out = Registered()
        by_world: dict[int, dict[int, dict]] = {}
        for rank, world, claim in items:
            by_world.setdefault(world, {})[rank] = claim
        for world, claims in by_world.items():
            got = await self.call(
                "join",
                self.node,
                self.core.address,
                sorted(claims),
                world,
                claims,
                timeout=tunable("membership_timeout_s") + tunable("claim_wait_s") + 30,
            )
            out = out.merged(Registered.from_wire(got))
        return out

    async def rejoin(self) -> None:
        """A new coordinator: tell it every rank of this node again, with its claim."""
        ranks, world = sorted(self.core.ranks), self.core.world
        if ranks and world is not None:  # (a rank joined: the world size is known)
            unclaimed = {"run": None, "process": ""}
            await self._send_joins([(r, world, self.core.holders.get(r) or unclaimed) for r in ranks])

    async def answer(self, timeout: float) -> Placed:
        """The node's placement answer (its ranks, peers or not, its holders), asked once for
        every rank of the node and kept until the node's ranks or the placement change."""
        if self._answer is None or (self._answer.done() and self._answer.exception() is not None):
            self._answer = asyncio.ensure_future(self.call("answer", self.node, timeout, timeout=timeout + 30))
        answer = Placed.from_wire(await asyncio.shield(self._answer))
        self.core.placed(answer)
        return answer

    def forget_answer(self) -> None:
        self._answer = None

    # --- commit waits -------------------------------------------------------------------------------
    async def wait(self, step: int, timeout: float) -> int | None:
        """Until ``step`` (or a newer one) is committed, failed or skipped; the newest committed
        step. ``timeout=0``: what this node knows now, without asking anyone."""
        if await self.signal.wait_for(lambda: self.core.resolved(step), timeout) or timeout <= 0:
            return self.core.newest
        # a commit notice may have been lost on the way: the coordinator knows
        return await self.call("wait_committed", step, 0.0, timeout=tunable("call_timeout_s"))

    # --- restore barriers ---------------------------------------------------------------------------
    def _round(self, attempt: int) -> _NodeRound:
        rnd = self.rounds.get(attempt)
        if rnd is None or (attempt == 0 and rnd.closed):
            if attempt == 0:
                self.rounds = {}
            rnd = self.rounds[attempt] = _NodeRound(
                Batch(
                    lambda ranks: self.call(
                        "restore_arrive", self.node, attempt, sorted(set(ranks)), timeout=tunable("call_timeout_s")
                    )
                ),
                Batch(
                    lambda reports: self.call(
                        "restore_report", self.node, attempt, dict(reports), timeout=tunable("call_timeout_s")
                    )
                ),
            )
        return rnd

    async def restore_plan(self, rank: int, attempt: int) -> dict:
        """``rank``'s part of the collective plan of ``attempt`` (a barrier over every rank)."""
        rnd = self._round(attempt)
        rnd.ranks.add(rank)
        await rnd.arrivals.add(rank)
        if rnd.plans is None:
            rnd.plans = asyncio.ensure_future(self._plans(attempt))
        try:
            plans = await asyncio.shield(rnd.plans)
        except Exception:
            rnd.closed = True  # a failed or cancelled round: the next attempt 0 starts afresh
            raise
        if rank not in plans:
            raise CommitError(
                f"restore: the plan names no part for rank {rank} on node {self.node[:12]}; "
                "it registered on another node"
            )
        return plans[rank]

    async def _plans(self, attempt: int) -> dict:
        """The node's ranks' plans of ``attempt``; before its ranks hear them, the node gives up
        its steps above the plan's (milliseconds: its sender stops at the next chunk, so the
        ranks' restores do not share the data plane with a step that can no longer commit)."""
        plans = await self.call("restore_plans", self.node, attempt, timeout=tunable("restore_timeout_s") + 30)
        if plans:
            step = RankPlan.from_wire(next(iter(plans.values()))).step  # (one step for every rank)
            await asyncio.get_running_loop().run_in_executor(None, self._roll_back, step)
        return plans

    def _roll_back(self, step: int | None) -> None:
        try:
            self.core.roll_back(step)
        except Exception as exc:  # an optimisation: the round's resume drops the same steps
            log.warning("node %s: its steps above %s not given up at the plan: %s", self.node[:12], step, exc)

    async def _result(self, rnd: _NodeRound, attempt: int) -> dict:
        """The round's outcome; when it is ok, this node resumes from the round's step (its
        uncommitted newer versions forgotten) before any of its ranks hears the outcome, so
        none of them can save into the old generation."""
        result = await self.call("restore_result", self.node, attempt, timeout=tunable("restore_timeout_s") + 30)
        outcome = RoundResult.from_wire(result)
        if outcome.ok:
            assert rnd.plans is not None  # a rank reports only after its plan
            plans = {r: RankPlan.from_wire(p) for r, p in (await rnd.plans).items()}
            step = next(iter(plans.values())).step  # (one step for every rank)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.core.resume, step, outcome.gen)
            for rank, load in sorted(rnd.loads.items()):
                source = plans[rank].source
                if load.rebuild and step is not None and source is not None:
                    loop.run_in_executor(None, self._rebuild, step, rank, source)
        return result

    def _rebuild(self, step: int, rank: int, source: RankSource) -> None:
        """(a thread) Read the node's corrupt copy of ``rank``'s ``step`` back from the holders."""
        try:
            done = self.core.rebuild_local(step, rank, source, True)
            log.info(
                "rank %d: the node's corrupt copy of step %d %s",
                rank,
                step,
                "rebuilt" if done else "not rebuilt (moved on)",
            )
        except Exception as exc:  # the next commit leaves a whole local copy anyway
            log.warning("rank %d: the node's corrupt copy of step %d not rebuilt: %s", rank, step, exc)

    async def restore_done(self, rank: int, attempt: int, report: dict) -> dict:
        """Report ``rank``'s load (a ``RankRestore`` on the wire); the round's outcome, the
        same for every rank (a barrier)."""
        rnd = self.rounds.get(attempt)
        if rnd is None:
            raise CommitError(f"restore_done(rank={rank}, attempt={attempt}) before its restore_plan")
        load = RankRestore.from_wire(report)
        rnd.loads[rank] = load
        if load.repaired:
            self.core.count("repaired_chunks", load.repaired)
        await rnd.reports.add((rank, report))
        if rnd.result is None:
            rnd.result = asyncio.ensure_future(self._result(rnd, attempt))
        try:
            result = await asyncio.shield(rnd.result)
        finally:
            rnd.closed = True
        return result
