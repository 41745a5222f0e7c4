"""The job's coordinator: membership, the two-phase commit, restore rounds, re-protection.

One detached asyncio actor per job (its Ray face is ``actors.Coordinator``). Ranks never
call it: each node's agent speaks for its ranks, so every call below arrives at most once
per node (a few per node at worst, when ranks arrive while a call is in flight) and its
size does not grow with the tensor count. Call protocol (who calls in brackets):

  1. [agent, for its ranks]  ``join(node, address, ranks, world, claims)``: once every rank of the job is
     known, the nodes (spares included) are placed; a node that comes back new takes a lost
     node's slot, which starts re-protection. Ranks that join with another world size start
     a new membership of that size (an elastic restart: the job came back with more or fewer
     ranks); the committed steps stay, and the restore reshards them (``elastic.py``). Each
     rank's claim names its run (``identity``): a rank held by a live rank of another run is
     refused (``membership.rivals``), and every accepted rank learns the job's run id.
  2. [agent]  ``answer(node)`` once placed (awaited): the node's ranks, whether pieces go to
     peers, its holders and their addresses (the agent caches them until the epoch changes).
  3. [agent]  ``node_ready(NodeReady)`` (phase one: every chunk acknowledged; a few hundred
     bytes), ``node_failed(t, node, why)`` or ``node_skipped(t, node, why)`` (busy: not a failure).
     A failure that finds a spare node dead places the live nodes anew without it (re-protection).
  4. [coordinator]  when every node running ranks is ready: keep a ``CommitRecord``, and
     ``commit(CommitNotice)`` on every agent (phase two), which frees what it no longer keeps.
  5. [agent, for its ranks]  restore: ``restore_arrive(node, attempt, ranks)``; awaited
     ``restore_plans(node, attempt)`` -> each of the node's ranks' ``RankPlan`` (one plan for
     all ranks: the decision is collective); ``restore_report(node, attempt, reports)``;
     awaited ``restore_result(node, attempt)``: if any rank failed, every rank tries the next plan.
  6. [agent]  ``spilled(t, ranks)``: the last one makes the durable step visible.

All state is rebuilt from the agents (ranks, addresses, committed NodeReady records) when
the actor is restarted (``rebuild_state``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from memsnap import metrics
from memsnap.config import SnapshotConfig, tunable
from memsnap.directory import Directory
from memsnap.errors import CommitError
from memsnap.identity import Claim, new_run_id
from memsnap.job import coverage
from memsnap.job.commit import CommitLog
from memsnap.job.liveness import Liveness, Verdict
from memsnap.job.membership import Holder, Membership, refusal, rivals
from memsnap.job.reprotect import Reprotector
from memsnap.job.rounds import RestoreRounds
from memsnap.records import (
    AgentState,
    CommitRecord,
    Inventory,
    LastRestore,
    NodeReady,
    Placed,
    RankPlan,
    RankRestore,
    Registered,
    RoundResult,
)

log = logging.getLogger("memsnap.coordinator")


class CoordinatorCore:
    """The coordinator's state and logic as a plain object; it never waits on a participant
    (the Ray face awaits ``changed`` notifications instead)."""

    def __init__(self, config: dict, world_size: int, directory: Directory | None = None):
        self.cfg = SnapshotConfig.from_dict(config)
        self.world = world_size
        self.lock = threading.RLock()
        self.restored = threading.Condition(self.lock)  # a restore round completed
        self.changed = lambda: None  # the Ray face wakes its waiters with this
        self.dir = directory or Directory(self.cfg.job)
        self.fenced: set[str] = set()  # nodes memsnap declared lost (``node_lost``); never un-fenced
        # nodes whose every rank was just lost, their agents' verdict pending (``doubt``): a
        # restore plan is made without them when they could not make it better
        self.doubted: dict[str, str] = {}
        self.liveness = Liveness(  # every agent's heartbeats (liveness.py)
            tunable("agent_lost_after_s"), tick_s=tunable("heartbeat_s") or 0.25
        )
        self.recoveries: list[dict] = []  # the newest in-place recoveries, as their controller reported them
        self.membership = Membership(self.cfg, world_size, self._alive, self.find_spares)
        self.log = CommitLog(self.cfg)
        self.rounds = RestoreRounds(world_size)
        self.reprotect = Reprotector(self)
        self.last_restore = LastRestore()
        self.run: str | None = None  # the run id of the ranks registered last (identity.py)
        self.step_runs: dict[int, str | None] = {}  # committed step -> the run that took it (the spill records it)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None

    def _alive(self) -> set[str]:
        """The nodes memsnap counts as alive: Ray's live nodes less the fenced ones (memsnap's
        own verdict comes first; Ray's health checks only confirm it, seconds later)."""
        return self.dir.alive() - self.fenced

    def recovered(self, record: dict) -> None:
        """An in-place recovery's record (who was lost, who took over, where the seconds went),
        kept for ``status()`` (the newest 20)."""
        with self.lock:
            self.recoveries = [*self.recoveries, dict(record)][-20:]
        metrics.recovered(self.cfg.job, dict(record.get("split") or {}))

    def doubt(self, nodes: list[str], why: str) -> list[str]:
        """Every rank of ``nodes`` was just lost, and whether their agents are lost too is not
        known yet (the in-place controller pings them, ``agent_ping_s``): until ``node_lost``
        or ``cleared`` says, a restore plan is made without asking them when the other nodes
        hold the newest committed step (no plan can be better), so that the ranks' restores
        need not wait for the verdict; else it waits for it. The nodes keep their place
        meanwhile (no placement changes on a doubt). The doubted nodes."""
        with self.lock:
            new = [n for n in nodes if n not in self.fenced and n not in self.doubted]
            for node in new:
                self.doubted[node] = why
            self.changed()
        if new:
            log.warning("job %r: node(s) %s doubted (%s)", self.cfg.job, [n[:12] for n in new], why)
        return new

    def cleared(self, node: str) -> bool:
        """A doubted ``node``'s agent answered: it is asked again, like any live node."""
        with self.lock:
            found = self.doubted.pop(node, None) is not None
            self.changed()
        return found

    def node_lost(self, node: str, why: str) -> bool:
        """memsnap's own verdict that ``node`` is lost (its ranks' process group saw it go, or
        its heartbeats stopped): it is fenced for good. Its agent is never asked again (the
        restore plan, placement and re-protection use the live nodes less the fenced ones),
        its phase-one reports are ignored, the steps in flight it has not reported fail (they
        can never commit), and a placement that holds it as a spare is redone without it. A node id is never un-fenced: a paused host that comes back has
        to join as a new node. False when ``node`` was fenced already (idempotent: Ray
        declaring the same node dead later changes nothing)."""
        with self.lock:
            self.doubted.pop(node, None)
            if node in self.fenced:
                return False
            self.fenced.add(node)
            self.liveness.fenced(node, why)
            self.dir.forget(node)
            # the steps in flight it never reported: nothing else would end them (their slots
            # on the other nodes stay held, and with every slot held no later step is taken)
            failed = self.log.lost(node, f"node {node[:12]} is lost: {why}") if node in self.membership.owners() else []
            replaced = self.membership.drop_lost_spares()
            self.changed()
        log.warning("job %r: node %s is lost (%s): fenced", self.cfg.job, node[:12], why)
        for step in failed:
            self.broadcast("abandon", step, f"node {node[:12]} is lost", True)
        if replaced:
            self.broadcast("layout_changed")
            if self.log.records:
                self.reprotect.kick()
        return True

    # --- memsnap's own verdict on a node: heartbeats (liveness.py) ------------------------------
    def beat(self, node: str) -> bool:
        """``node``'s agent is alive. False: the node was declared lost (fenced): its agent must
        stop (it is killed when it can be reached)."""
        with self.lock:  # (``node_lost`` marks every fenced node lost in ``liveness`` too)
            return self.liveness.beat(node)

    def suspect(self, node: str, why: str) -> bool:
        """A push to ``node`` was refused or reset: ask its agent now, not after its silence."""
        with self.lock:
            return self.liveness.suspect(node, why)

    def heartbeats_due(self) -> dict[str, str]:
        """``{node: why}`` of the job's nodes whose agent to ping now (``Liveness.due``)."""
        with self.lock:  # (``due`` leaves out the nodes it knows are lost: every fenced one)
            return self.liveness.due(sorted(self.membership.addrs))

    def ping_deadline(self, node: str, floor_s: float) -> float:
        """How long a ping of ``node`` waits (``Liveness.ping_deadline``)."""
        with self.lock:
            return self.liveness.ping_deadline(node, floor_s)

    def ping_control(self, node: str) -> str | None:
        """The beating node to ping beside a probe of ``node`` (``Liveness.control``)."""
        with self.lock:
            return self.liveness.control(node)

    def ping_answered(self, node: str, seconds: float) -> None:
        """A control ping of ``node`` was answered in ``seconds`` (``Liveness.answered``)."""
        with self.lock:
            self.liveness.answered(node, seconds)

    def heartbeat_verdict(
        self, node: str, outcome: str, why: str, ping_s: float, answered_s: float | None = None
    ) -> Verdict:
        """The ping of a silent or suspected ``node`` ended with ``outcome`` (answered in
        ``answered_s``); a ``silent`` one fences the node (``node_lost``), a ``died`` agent is
        forgotten (its host is up)."""
        with self.lock:
            if answered_s is not None:
                self.liveness.answered(node, answered_s)
            verdict = self.liveness.decide(node, outcome, why, ping_s)
        if verdict.outcome == "answered":
            log.info("job %r: node %s: %s", self.cfg.job, node[:12], verdict.why)
        elif verdict.outcome == "died":
            log.warning("job %r: node %s: %s", self.cfg.job, node[:12], verdict.why)
            self.dir.forget(node)
        else:
            self.node_lost(node, verdict.why)
        return verdict

    def spare_joined(self, node: str, address: dict) -> bool:
        """A spare agent started on ``node`` after the placement (``start_spare``): the job is
        placed anew with it (``Membership.add_spare``). True when the placement changed."""
        with self.lock:
            if node in self.fenced:
                return False
            changed = self.membership.add_spare(node, address)
            if changed:
                self.changed()
        if changed:
            log.info("job %r: spare node %s joins the placement", self.cfg.job, node[:12])
            self.broadcast("layout_changed")
            if self.log.records:
                self.reprotect.kick()
        return changed

    def find_spares(self, busy: set[str]) -> dict[str, dict]:
        """``{node: address}`` of the job's agents on live nodes that run no rank (spares)."""
        spare = sorted(self._alive() - busy)
        return self.dir.call_all(spare, "address", timeout=tunable("call_timeout_s"))

    # --- 1-2. membership ------------------------------------------------------------------------
    def join(
        self, node: str, address: dict, ranks: list[int], world: int | None = None, claims: dict | None = None
    ) -> Registered:
        """Ranks ``ranks`` (of ``world``) run on ``node``; ``claims``: each rank's
        ``identity.Claim`` on the wire (none: a claim that never conflicts). The answer's hints
        name those ranks whose newest committed bytes this node has no copy of (it is new to
        them: its agent can back the memory a restore will fill before the restore starts); its
        refused, the ranks a live rank of another run holds (they are not registered); its gen,
        the job's restore generation, which a node new to the job takes (its snapshots are of the
        job as it runs now: a rank that joined without a restore round, such as a standby that
        took a survivor's live state, would otherwise send steps the commit ignores)."""
        claims = {rank: Claim.from_wire((claims or {}).get(rank)) for rank in ranks}
        refused = self.refusals(claims, world)
        if refused:
            log.warning("job %r: refused ranks %s: %s", self.cfg.job, sorted(refused), next(iter(refused.values())))
        ranks = [rank for rank in ranks if rank not in refused]
        if not ranks:
            return Registered({}, refused, self.run, self.log.gen)
        with self.lock:
            if node in self.fenced:  # refused before it holds a rank or resizes the job
                raise CommitError(
                    f"node {node[:12]} was declared lost and is fenced: its processes must not "
                    "rejoin the job (a host that comes back joins as a new node)"
                )
            resized = False
            if world is not None and world != self.world:
                resized = True
                self.resize(world)
            self._hold(node, {rank: claims[rank] for rank in ranks})
            replaced = self.membership.join(node, address, ranks)
            # a rank moved onto a placed node (a standby taking over): a lost node it left behind
            # holds no rank now, and leaves the placement like a lost spare
            replaced = self.membership.drop_lost_spares() or replaced
            self.changed()
            newest = self.log.newest()
            record = self.log.records.get(newest) if newest is not None else None
            if record is not None and record.world != self.world:
                record = None  # taken by another world size: its rank r is not this rank r
            hints = {}
            for rank in ranks:
                owner = None if record is None else record.owner_of(rank)
                if record is not None and owner is not None and (owner != node or not self.cfg.local_copy):
                    region = record.nodes[owner].region(rank)
                    assert region is not None  # owner_of found the rank among its regions
                    hints[rank] = region.nbytes
            placed = self.membership.placement is not None
            run, gen = self.run, self.log.gen
        if replaced or resized:
            self.broadcast("layout_changed")
        if placed and self.log.records:
            self.reprotect.kick()
        return Registered(hints, refused, run, gen)

    def refusals(self, claims: dict[int, Claim], world: int | None = None) -> dict[int, str]:
        """``{rank: why}`` for the newcomers ``claims`` whose rank (any rank, for another world
        size) a rank of another run holds whose process still runs."""
        with self.lock:
            every = world is not None and world != self.world
            found = rivals(self.membership.holders, claims, every)
        if not found:
            return {}
        live = self.running_holders({r: h for theirs in found.values() for r, h in theirs.items()})
        out = {}
        for rank, theirs in sorted(found.items()):
            held = next((r for r in sorted(theirs) if r in live), None)
            if held is not None:
                out[rank] = refusal(self.cfg.job, rank, claims[rank], held, theirs[held])
        if every and out:  # one membership: an elastic restart takes every rank or none
            why = next(iter(out.values()))
            out = {rank: out.get(rank, why) for rank in claims}
        return out

    def running_holders(self, holders: dict[int, Holder]) -> set[int]:
        """The ranks in ``holders`` whose process still runs: on a live node whose agent sees it
        (an agent that does not answer in time counts its ranks as gone)."""
        nodes = sorted({h.node for h in holders.values()} & self._alive())
        tokens = sorted({h.process for h in holders.values()})
        answers = self.dir.call_all(nodes, "running", tokens, timeout=tunable("call_timeout_s"))
        return {r for r, h in holders.items() if h.process in answers.get(h.node, ())}

    def _hold(self, node: str, claims: dict[int, Claim]) -> None:
        """The accepted ``claims`` hold their ranks; a newcomer's run id becomes the job's (a new
        run taking over one whose ranks are gone), and one with none takes the job's (made now
        at the first registration). Call under the lock."""
        for rank, claim in sorted(claims.items()):
            if claim.run is not None and claim.run != self.run:
                if self.run is not None:
                    log.warning(
                        "job %r: run %r takes over from run %r, whose ranks are gone; it resumes from "
                        "that run's snapshots",
                        self.cfg.job,
                        claim.run,
                        self.run,
                    )
                self.run = claim.run
            elif self.run is None:
                self.run = new_run_id()
                log.info("job %r: run id %s", self.cfg.job, self.run)
            self.membership.holders[rank] = Holder(self.run, claim.process, node)

    def resize(self, world: int) -> None:
        """The job came back with ``world`` ranks: a new membership of that size (its ranks
        register again and are placed anew); the restore rounds count the new ranks. The
        committed steps stay: an elastic restore reads them, and the first step the new
        layout commits frees them (``CommitLog.ready``). Call under the lock."""
        if not isinstance(world, int) or world < 1:
            raise CommitError(f"world_size={world!r}: must be an int >= 1")
        log.warning(
            "job %r: ranks join with world size %d (was %d): a new membership; the newest "
            "committed step is resharded on restore",
            self.cfg.job,
            world,
            self.world,
        )
        old = self.membership
        self.world = world
        self.membership = Membership(self.cfg, world, self._alive, self.find_spares)
        self.membership.addrs = dict(old.addrs)
        self.membership.epoch = old.epoch
        self.rounds = RestoreRounds(world)

    def answer(self, node: str) -> Placed:
        with self.lock:
            return self.membership.answer(node)

    # --- 3-4. the two-phase commit ----------------------------------------------------------------
    def node_ready(self, wire: dict) -> None:
        info = NodeReady.from_wire(wire)
        with self.lock:
            if info.node in self.fenced:  # a fenced node's snapshot never commits
                return
            record = self.log.ready(info, self.membership.owners(), self.world)
            if record is None:
                return
            notice = self.log.notice(record)
            self.step_runs[record.step] = self.run
            for old in sorted(self.step_runs)[:-64]:
                del self.step_runs[old]
            self.changed()
        metrics.committed(self.cfg.job, record.step)
        self.broadcast("commit", notice.to_wire())

    def node_failed(self, step: int, node: str, why: str) -> None:
        """``step`` cannot commit. If a spare node is gone (a push to it failed), the live nodes
        are placed anew without it and re-protection rebuilds the shards it held."""
        with self.lock:
            news = self.log.fail(step, f"node {node[:12]}: {why}")
            replaced = self.membership.drop_lost_spares()
            self.changed()
        if news:
            metrics.failed(self.cfg.job, node)
            log.warning("step %d failed on node %s: %s", step, node[:12], why)
            self.broadcast("abandon", step, why, True)
        if replaced:
            self.broadcast("layout_changed")
            if self.log.records:
                self.reprotect.kick()

    def node_skipped(self, step: int, node: str, why: str) -> None:
        """A node's pipeline was busy: it skipped ``step`` or replaced it with a newer capture
        (newest wins). Not a failure: every agent drops the step and ``wait(step)`` returns."""
        with self.lock:
            news = self.log.skip(step, f"node {node[:12]}: {why}")
            self.changed()
        if news:
            metrics.skipped(self.cfg.job, node)
            log.info("step %d skipped: node %s: %s", step, node[:12], why)
            self.broadcast("abandon", step, why, False)

    def resolved(self, step: int) -> bool:
        with self.lock:
            return self.log.resolved(step)

    def newest(self) -> int | None:
        with self.lock:
            return self.log.newest()

    def rank_bytes(self) -> int | None:
        """The largest snapshot of one rank in the newest committed step (None: none committed):
        what a warm standby's arenas are made for (``Slots.ready_standby``)."""
        with self.lock:
            step = self.log.newest()
            if step is None:
                return None
            return max(r.nbytes for info in self.log.records[step].nodes.values() for r in info.regions)

    def broadcast(self, method: str, *args) -> None:
        """``method(*args)`` on every live agent, in order, from one sender thread (every
        agent of one broadcast at once, one deadline for all)."""
        self._outbox.put((method, args))
        with self.lock:
            if self._sender is None or not self._sender.is_alive():
                self._sender = threading.Thread(target=self._send_loop, name="memsnap-broadcast", daemon=True)
                self._sender.start()

    def _send_loop(self) -> None:
        while True:
            try:
                method, args = self._outbox.get(timeout=60.0)
            except queue.Empty:
                with self.lock:
                    if self._outbox.empty():
                        self._sender = None
                        return
                continue
            with self.lock:
                nodes = self.membership.live_nodes()
            self.dir.call_all(nodes, method, *args, timeout=tunable("commit_notify_timeout_s"))

    # --- 5. restore rounds ----------------------------------------------------------------------
    def cancel_restore(self, why: str) -> list[int]:
        """A member was lost while a restore round was open: every rank waiting in it fails
        (``CommitError``) instead of waiting out ``restore_timeout_s``; the next generation's
        restore starts a new round."""
        with self.lock:
            cancelled = self.rounds.cancel(why)
            if cancelled:
                self.log.cancel_roll_back()
            self.changed()
        if cancelled:
            log.warning("job %r: restore round(s) %s cancelled: %s", self.cfg.job, cancelled, why)
        return cancelled

    def restore_arrive(self, attempt: int, ranks: list[int]) -> None:
        with self.lock:
            self.rounds.arrive(attempt, ranks)
            self.changed()

    def plan(self, attempt: int) -> coverage.JobPlan:
        """The round's one plan for every rank (made once, by the first node to ask); a doubted
        node's agent is asked too (its verdict was waited for)."""
        plan = self._plan(attempt, early=False)
        assert plan is not None  # (only an early plan is refused)
        return plan

    def plan_early(self, attempt: int) -> coverage.JobPlan | None:
        """As ``plan``, but while nodes are doubted (``doubt``) made without them, and only if it
        loads the newest committed step from RAM; else None (wait for their verdict, then
        ``plan``)."""
        return self._plan(attempt, early=True)

    def _plan(self, attempt: int, early: bool) -> coverage.JobPlan | None:
        with self.lock:
            rnd = self.rounds.rounds[attempt]
            if rnd.plan is not None:
                return rnd.plan
            records, members, bad = dict(self.log.records), dict(self.membership.members), set(self.rounds.bad)
            doubted = bool(self.doubted)
        durable = self._durable_step()
        inventories = self.inventories(ask_doubted=not early)  # (a late plan: the verdict's wait is over)
        plan = coverage.decide(records, members, inventories, durable, bad, self.cfg.local_copy)
        best = coverage.best_step(records, durable, bad)
        if early and doubted and best is not None and (plan.plan, plan.step) != ("ram", best):
            return None  # the doubted nodes might hold what makes it better
        with self.lock:
            if rnd.plan is None:
                rnd.plan = plan
                log.info("restore plan (attempt %d): step %s, %s", attempt, plan.step, plan.plan)
                # the steps above it can no longer be the one the job resumes from: none
                # commits now (each node gives up its own as its ranks hear the plan)
                dropped = self.log.roll_back(plan.step)
                if dropped:
                    log.info("steps %s dropped: the job rolls back to step %s", dropped, plan.step)
                self.changed()
            return rnd.plan

    def plans_for(self, node: str, attempt: int) -> dict[int, dict]:
        """Each of ``node``'s ranks' part of the round's plan: only what that rank needs."""
        plan = self.plan(attempt)
        with self.lock:
            ranks, addrs = list(self.membership.by_node().get(node, [])), self.membership.addrs
            record = self.log.records.get(plan.step) if plan.plan == "ram" and plan.step is not None else None
            if plan.saved is not None:  # elastic: every rank reads the parts it needs of every saved rank
                sources = tuple(self._saved_source(record, r, tier, addrs) for r, tier in sorted(plan.saved.items()))
                return {
                    rank: RankPlan(plan.step, "elastic", "ram", self.cfg.spill, None, sources).to_wire()
                    for rank in ranks
                }
            out = {}
            for rank in ranks:
                out[rank] = self._plan_of(plan, rank, record, addrs)
        return out

    @staticmethod
    def _saved_source(record, rank: int, tier: str, addrs: dict):
        source = record.source(rank, addrs)
        return dataclasses.replace(source, copy=addrs.get(source.owner)) if tier == "copy" else source

    def _plan_of(self, plan: coverage.JobPlan, rank: int, record, addrs: dict) -> dict:
        source = None if record is None else record.source(rank, addrs)
        if plan.ranks[rank] == "copy":
            assert source is not None  # a copy tier comes from a committed record
            source = dataclasses.replace(source, copy=addrs.get(source.owner))
        return RankPlan(plan.step, plan.ranks[rank], plan.plan, self.cfg.spill, source).to_wire()

    def restore_report(self, attempt: int, reports: dict[int, RankRestore]) -> None:
        with self.lock:
            self.rounds.report(attempt, reports)
            self.changed()

    def restore_result(self, attempt: int) -> RoundResult:
        """Every rank reported: the round's outcome, the same for every rank."""
        with self.lock:
            rnd = self.rounds.rounds[attempt]
            first = not rnd.closed
            rnd, failed = self.rounds.close(attempt)
            if not failed and first:
                self._note_restore(rnd)
                assert rnd.plan is not None  # a closed round was planned
                self.log.resume(rnd.plan.step)
                rnd.gen = self.log.gen
                self.rounds.completed += 1
                log.info("restore generation %d: the job resumes from step %s", rnd.gen, rnd.plan.step)
                self.changed()
                self.restored.notify_all()
            return RoundResult(not failed, failed, rnd.gen if rnd.gen is not None else self.log.gen)

    def wait_for_a_restore(self, timeout: float) -> None:
        """Block (a background thread) until a restore round completes, at most ``timeout``."""
        with self.restored:
            seen = self.rounds.completed
            self.restored.wait_for(lambda: self.rounds.completed > seen, timeout)

    def _note_restore(self, rnd) -> None:
        self.last_restore = LastRestore.of_round(rnd.plan.step, list(rnd.done.values()))

    def inventories(self, ask_doubted: bool = False) -> dict[str, Inventory]:
        """What every live agent holds; a doubted node's only with ``ask_doubted`` (its agent
        may be gone: a call to it waits for Ray's verdict)."""
        with self.lock:
            nodes = [n for n in self.membership.live_nodes() if ask_doubted or n not in self.doubted]
        answers = self.dir.call_all(nodes, "inventory", timeout=tunable("call_timeout_s"))
        return {node: Inventory.from_wire(wire) for node, wire in answers.items()}

    def _durable_step(self) -> int | None:
        if self.cfg.spill is None:
            return None
        from memsnap.durable.storage import Store

        try:
            return Store.open(self.cfg.spill).latest()
        except Exception as exc:  # nothing spilled yet, or storage unreachable
            log.info("no durable step at %s: %s", self.cfg.spill, exc)
            return None

    # --- 6. spill (phase two of the durable write) ------------------------------------------------
    def spilled(self, step: int, ranks: list[int]) -> bool:
        """Agents report ranks written to durable storage; the last one makes the step visible."""
        with self.lock:
            if not self.log.spilled(step, ranks, self.world):
                return False
        from memsnap.durable.storage import Store

        run = self.step_runs.get(step, self.run)
        assert self.cfg.spill is not None, "agents spill only with spill= set"
        Store.open(self.cfg.spill).commit(step, self.world, spill_metadata(self.cfg, step, run))
        with self.lock:
            self.log.durable(step)
            self.changed()
        return True

    def durable_step(self) -> int | None:
        with self.lock:
            return self.log.durable_step

    # --- status ----------------------------------------------------------------------------------
    def status(self) -> dict:
        inventories = self.inventories()
        with self.lock:
            log_, mem = self.log, self.membership
            newest = log_.newest()
            return {
                "committed_step": newest,
                "last_commit_time": None if newest is None else log_.records[newest].time,
                "committed_steps": sorted(log_.records),
                "failed_snapshots": len(log_.failed),
                "skipped_snapshots": len(log_.skipped),
                "failed_steps": {str(s): why for s, why in sorted(log_.failed.items())[-10:]},
                "protection": self._protection(newest, inventories),
                # who holds each owner node's pieces of the newest committed step
                "holders": {}
                if newest is None
                else {o: list(log_.records[newest].holders(o)) for o in log_.records[newest].nodes},
                "peers": mem.peered,
                "members": {str(r): n for r, n in mem.members.items()},
                "epoch": mem.epoch,
                "generation": log_.gen,
                "run": self.run,
                "durable_step": log_.durable_step,
                "last_restore": self.last_restore.to_wire(),
                "recoveries": list(self.recoveries),
                "fenced": sorted(self.fenced),
                "doubted": sorted(self.doubted),
                "liveness": self.liveness.status(),
                "reprotect": self.reprotect.status(),
                "agents": {
                    n: dict(inv.bytes) | {"counters": dict(inv.counters), "spill": inv.spill}
                    for n, inv in inventories.items()
                },
            }

    def _protection(self, step: int | None, inventories: dict) -> dict:
        """Per group: how many more node losses every owner's newest committed bytes survive."""
        placement = self.membership.placement
        if step is None or placement is None:
            return {}
        record = self.log.records[step]
        out: dict[str, int] = {}
        for owner in record.nodes:
            margin = coverage.owner_margin(record, owner, self.membership.members, inventories, self.cfg.local_copy)
            node = (
                owner if owner in placement.holders else self.membership.members.get(record.ranks_of(owner)[0], owner)
            )
            group = str(placement.group_of(node)) if node in placement.holders else "?"
            out[group] = min(out.get(group, margin), margin)
        return out


def spill_metadata(cfg: SnapshotConfig, step: int, run: str | None = None) -> dict:
    """What a spilled step records about how it was made: job, the run that took it (its
    ``identity`` run id), config, package versions."""
    from memsnap.durable import meta

    return {
        "job": cfg.job,
        "run": run,
        "step": step,
        "source": "memsnap spill",
        "config": cfg.to_dict(),
        "versions": meta.versions(),
        "time": time.time(),
    }


def rebuild_state(core: CoordinatorCore) -> list[str]:
    """Fill a fresh coordinator from the live agents: ranks and who holds them (the job's run
    id is the one most agents served), addresses, committed records (each committed step's
    NodeReady from its owner, or from a holder when the owner is gone). Returns the nodes
    whose agent did not answer in time (busy: its threads may all be waiting on the
    coordinator that is being rebuilt): ``adopt_late`` asks them again."""
    nodes = sorted(core._alive())
    answers = _agent_states(core, nodes)
    infos: dict[int, dict[str, NodeReady]] = {}
    committed: set[int] = set()
    runs: list[str | None] = []
    for node, ans in answers.items():
        _adopt(core, node, ans)
        runs.append(ans.run)
        committed.update(ans.committed)
        for info in ans.infos:
            infos.setdefault(info.step, {})[info.node] = info
    for step in sorted(committed)[-core.cfg.keep :]:
        record = CommitRecord(step, core.cfg.k, core.cfg.m, infos.get(step, {}))
        if record.complete():
            core.log.records[step] = record
    known = [r for r in runs if r is not None]
    core.run = max(set(known), key=known.count) if known else core.run  # the run most agents served
    _finish_phase_two(core, answers)
    if answers:
        core.membership.maybe_place()
        log.warning(
            "coordinator rebuilt from %d agents: ranks %s, committed steps %s, restore generation %d",
            len(answers),
            sorted(core.membership.members),
            sorted(core.log.records),
            core.log.gen,
        )
    return [n for n in nodes if n not in answers and core.dir.agent(n) is not None]


def _agent_states(core: CoordinatorCore, nodes: list[str]) -> dict[str, AgentState]:
    """Every answer of ``nodes``' agents to ``committed_infos`` within a call timeout."""
    answers = core.dir.call_all(nodes, "committed_infos", timeout=tunable("call_timeout_s"))
    return {node: AgentState.from_wire(wire) for node, wire in answers.items()}


def _finish_phase_two(core: CoordinatorCore, answers: dict[str, AgentState]) -> None:
    """The old coordinator may have died during phase two of its newest commit: the agents
    that did not hear it are told now. Otherwise their version of that step stays ready, not
    committed, and a restore of it (no newer step commits after a node loss) reads their
    ranks from peers instead of their own RAM."""
    newest = max(core.log.records, default=None)
    if newest is None:
        return
    behind = sorted(node for node, ans in answers.items() if newest not in ans.committed)
    if behind:
        notice = core.log.notice(core.log.records[newest])
        log.warning("coordinator rebuilt: the commit of step %d reaches %d more agents", newest, len(behind))
        core.dir.call_all(behind, "commit", notice.to_wire(), timeout=tunable("commit_notify_timeout_s"))


def _adopt(core: CoordinatorCore, node: str, ans: AgentState) -> None:
    """One agent's answer to ``committed_infos``: its address, ranks, holders, generation."""
    core.membership.addrs[node] = ans.address
    # the restore generation goes on from the agents': restarting it at 0 would let the next
    # restore hand a new node's agent a generation below the survivors', and every step
    # that node sends afterwards would be ignored as taken before the restore
    core.log.gen = max(core.log.gen, ans.gen)
    for rank in ans.ranks:
        core.membership.members.setdefault(rank, node)
    for rank, (run, process) in ans.holders.items():
        core.membership.holders.setdefault(rank, Holder(run, process, node))


def adopt_late(core: CoordinatorCore, nodes: list[str], within_s: float | None = None) -> list[str]:
    """Ask the agents the rebuild missed again until they answer (or ``within_s``, default
    four call timeouts, runs out). Left out, such a node would get no commit notice and no
    restore plan: its ranks would never commit a step locally again. Their ranks, address and
    generation join the rebuilt state (the records stand: newer commits follow at once).
    Returns the nodes still missing."""
    deadline = time.monotonic() + (4 * tunable("call_timeout_s") if within_s is None else within_s)
    missing = list(nodes)
    while missing and time.monotonic() < deadline:
        answers = _agent_states(core, missing)
        alive = core._alive()  # (Ray's node table: read once a round)
        with core.lock:
            for node, ans in answers.items():
                if node in alive:
                    _adopt(core, node, ans)
            if answers:
                core.membership.maybe_place()
                core.changed()
        _finish_phase_two(core, answers)
        for node in answers:
            log.warning("coordinator rebuilt: the agent of %s answered late and joins", node[:12])
        missing = [n for n in missing if n not in answers and n in alive and core.dir.agent(n) is not None]
        if missing:
            time.sleep(0.2)  # (a busy agent: ask again shortly)
    return missing
