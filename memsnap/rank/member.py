"""One process of an in-place job: a rank, or a standby waiting to become one.

A member runs the user's ``setup(ctx)`` once, when it starts (a standby does it ahead of any
failure: imports, model, optimizer, data loader), and then, for each generation it is a
member of, forms the process group and calls ``train(ctx, state)``. When a peer is lost the
collective in flight ends in ``PeerLost``, which this loop catches: the member waits for the
controller's next generation, forms the group again in the same process and calls ``train``
again, whose ``ctx.restore(state)`` rolls the live objects back to the newest committed step
(a survivor from its own node's RAM, a standby that takes a lost rank from its peers).

Store keys (the controller writes the first, members the rest):

  ``memsnap/<job>/gen/<g>``            JSON of an ``assignment.Assignment``: world, member -> rank, done
  ``memsnap/<job>/gen/<g>/fenced``     the nodes lost before generation g are doubted (or
                                       fenced) at the coordinator: its restore may start (the
                                       controller writes the generation first, so a standby
                                       registers meanwhile; the fencing verdict comes later)
  ``memsnap/<job>/gen/<g>/report/<r>`` JSON: what rank r's member did in generation g
  ``memsnap/<job>/done/<r>``           JSON: rank r finished training (the result's summary)
  ``memsnap/<job>/leave/<member>``     set by ``InplaceJob.hand_over``: that member is to leave
  ``memsnap/<job>/gen/<g>/handover``   the step after which generation g ends for a handover
  ``memsnap/<job>/gen/<g>/plan``       rank 0's next snapshot step, which every rank follows
                                       (``collective/plan.py``), and ``memsnap/<job>/plan/figures``

**Handover** (a preemption notice: SIGTERM, a Ray drain of the node, or ``hand_over(rank)``):
the leaving member, at its next ``save(S)``, names ``S+1`` as the generation's last step. Every
rank sees it at its own ``save(S+1)`` (none can be past it: step ``S+1``'s collective needs
the leaving rank, which named it first) and takes a forced snapshot of ``S+1``, waits for its
commit, and ends the generation; the leaving member returns, a standby takes its rank, and
everyone restores ``S+1``: nothing is rolled back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from memsnap.collective.assignment import (
    Assignment,
    done_key,
    fenced_key,
    gen_key,
    handover_key,
    leave_key,
    report_key,
)
from memsnap.collective.group import PeerLost, RecoverableGroup, connect, os_threads
from memsnap.collective.heartbeat import Beater
from memsnap.collective.lifeline import Lifeline
from memsnap.collective.plan import SharedPlan
from memsnap.collective.report import MemberReport
from memsnap.identity import process_token

if TYPE_CHECKING:
    from memsnap.collective.live import Takeover
    from memsnap.rank import Snapshotter

log = logging.getLogger("memsnap.inplace")


class HandedOver(Exception):
    """This member handed its rank over at a step boundary (it leaves the job cleanly)."""


class Context:
    """What ``setup`` and ``train`` see of the job: this member's rank (None for a standby
    in ``setup``), the world size, the generation, the process group and the snapshotter."""

    def __init__(self, member: Member):
        self._m = member

    @property
    def rank(self) -> int | None:
        return self._m.rank

    @property
    def world_size(self) -> int | None:
        return self._m.world

    @property
    def generation(self) -> int | None:
        return self._m.gen

    @property
    def group(self) -> RecoverableGroup:
        return self._m.group

    @property
    def snapshotter(self):
        self._m._registered()  # (a new rank's, once it has registered)
        return self._m.snap

    @property
    def store(self):
        """A client of the job's rendezvous store, for small keys of the user's own."""
        return self._m.store

    @property
    def recoveries(self) -> int:
        """How many times this process re-formed the group after a loss."""
        return self._m.recoveries

    def restore(self, state) -> int:
        """(collective) The step to train next, with ``state`` at the step before it. In a
        recovery, where the ranks are replicas (``memsnap.collective.live``), the survivors keep
        their live state and the others take it from them: nothing is rolled back; otherwise
        every rank rolls ``state`` back to the newest committed step (a survivor from its own
        node's RAM, a standby from its peers)."""
        m = self._m
        # a new rank's Snapshotter registered first: a live takeover's receive would share
        # the CPU with it (on a busy host that cost the move more than the registration took)
        m._registered()
        if m.recoveries:  # a step cut short by the loss: DDP and FSDP2 back to a step boundary
            from memsnap.collective import ddp, fsdp

            for model in m.replicated:
                ddp.reset(model)
            for model in m.sharded:
                fsdp.reshard(model)
        if m.current_gen > 0 and m.live.mode != "off" and not m.sharded:
            from memsnap.collective.live import take_over

            done, refused = take_over(m.live, state, m.current_rank, m.world or 0, resized=m.resized)
            if done is not None:
                m.took_over(done)
                m.recovered(live=True)
                m.plan_snapshots(done.step)
                return done.step + 1
            m.live_refused(refused)
        m.await_fenced()
        if m.live.dirty:  # a refused takeover wrote into the live tensors: no fresh start on them
            m.snapshotter.state_written()
        try:
            step = m.snapshotter.restore(state)
        except Exception as exc:
            why = m.group.wait_failure(5.0)
            if why is None:
                raise
            # a member was lost while the others restored: the round was cancelled
            raise PeerLost(f"generation {m.gen} is over during the restore: {why} ({exc})", m.current_gen) from None
        m.live.dirty = False
        m.restored(step)
        if m.current_gen > 0:
            m.recovered(live=False)
        if step is not None:
            m.live.mark(step, state)
        m.plan_snapshots(step)
        return 0 if step is None else step + 1

    def save(self, step: int, state, **kwargs: Any):
        """Snapshot ``state`` after ``step`` (the Snapshotter's ``save``). A step whose
        gradients were not averaged because a peer was lost (``ddp``) is not saved: it ends
        in ``PeerLost`` here, and the rollback undoes it."""
        self._m.live.mark(step, state)  # the end of ``step``, whatever becomes of its snapshot
        why = self._m.group.failure()
        if why is not None:
            raise PeerLost(f"generation {self._m.gen} is over: {why}", self._m.current_gen)
        self._m.stepped(step)
        at = self._m.handover_step(step)
        if at != step:
            return self._m.snapshotter.save(step, state, **kwargs)
        self._m.hand_over(step, state)  # every rank: this step is the last of the generation
        return None

    def average_gradients(self, params) -> None:
        """Average the gradients across the ranks (a lost peer ends it in ``PeerLost``, which the
        runner handles: the training function never sees it)."""
        self._m.group.average_gradients(params)

    def all_reduce(self, tensor, op=None):
        return self._m.group.all_reduce(tensor, op)

    def ddp(self, model, **ddp_options):
        """``model`` in DistributedDataParallel whose gradients go through the re-formable
        group (``memsnap.collective.ddp``): build it once, in ``setup``; it is never rebuilt."""
        from memsnap.collective.ddp import replicate

        replicated = replicate(model, self._m.group, **ddp_options)
        self._m.replicated.append(replicated)
        return replicated

    def on_rank(self, fn: Callable) -> None:
        """Run ``fn(ctx, state)`` once in this process, when it first becomes a rank: after its
        group is formed, before ``train``. Call it in ``setup`` for work that needs the rank or
        the group, which a standby does not have in ``setup``: ``ctx.fully_shard`` and the
        optimizer over the sharded parameters."""
        self._m.on_rank_fns.append(fn)

    def fully_shard(self, model, *, modules=(), **options):
        """FSDP2's ``fully_shard`` of each of ``modules`` and then ``model``, its all-gathers
        and reduce-scatters through the re-formable group (``memsnap.collective.fsdp``): call it
        once, in a function given to ``on_rank``; it is never redone."""
        from memsnap.collective.fsdp import shard

        sharded = shard(model, self._m.group, modules=modules, **options)
        self._m.sharded.append(sharded)
        return sharded


class Member:
    """The plain object behind a member's Ray actor (``controller`` wraps it)."""

    def __init__(
        self,
        job: str,
        name: str,
        store_addr: tuple[str, int],
        setup: Callable,
        train: Callable,
        snapshot_options: dict,
        *,
        beat_s: float = 0.1,
        backend: str = "gloo",
        backend_timeout_s: float = 60.0,
        assign_timeout_s: float = 3600.0,
        preemption_poll_s: float | None = 1.0,
        handover_commit_s: float = 120.0,
        watch_preemption: bool = True,
        live_takeover: str = "verified",
        lifeline: tuple[str, int, str] | None = None,
    ):
        import torch.distributed as dist

        from memsnap.collective.live import Live

        self.job, self.name = job, name
        self.setup_fn, self.train_fn = setup, train
        # the member, not the Snapshotter, acts on a preemption notice (a handover, not an exit)
        self.options = {**snapshot_options, "preemption": False}
        self.handover_commit_s = float(handover_commit_s)
        self.assign_timeout_s = float(assign_timeout_s)
        host, port = store_addr
        self.group = RecoverableGroup(job, store_addr, backend=backend, timeout_s=backend_timeout_s)
        self.live = Live(self.group, live_takeover)  # step boundaries, for a takeover with no rollback
        self.resized = False  # the current generation has another world size than the last
        self.store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=self.assign_timeout_s)
        )
        # a client of its own: one client serves one call at a time, and the group's waits
        # on it (a rendezvous waiting for a slow peer) would stop the beats behind them
        self._beater = Beater(connect(host, port, 30.0), job, name, beat_s)
        self._lifeline = self._hold_lifeline(lifeline)  # its close tells the controller this process ended
        self.rank: int | None = None
        self.world: int | None = None
        self.gen: int | None = None
        self.snap: Snapshotter | None = None
        self.state = None
        self.recoveries = 0
        self.history = (0, 0, 0.0)  # the job's recoveries before this generation, how many rolled back, its age
        self._registering: _Registering | None = None  # a new rank's Snapshotter, being made
        self.on_rank_fns: list[Callable] = []  # ctx.on_rank: run once, when this process first has a rank
        self.sharded: list = []  # the models ctx.fully_shard sharded
        self.replicated: list = []  # the DDP modules ctx.ddp built
        self._report = MemberReport("", os.getpid(), -1, -1, False, time.time())
        self._lock = threading.Lock()
        self._leaving = threading.Event()  # a preemption notice: hand over at the next step boundary
        # off where another runner owns the preemption notice (Ray Train's own watcher)
        self._watcher = self._watch_preemption(preemption_poll_s) if watch_preemption else None

    def _hold_lifeline(self, ticket: tuple[str, int, str] | None) -> Lifeline | None:
        if ticket is None:
            return None
        try:
            return Lifeline(self.name, ticket)
        except OSError as exc:  # the heartbeats still tell the controller; only slower
            log.warning(
                "member %s: no lifeline to the controller (%s): its loss is noticed by heartbeats", self.name, exc
            )
            return None

    def _watch_preemption(self, poll_s: float | None):
        from memsnap.preempt import PreemptionWatcher

        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
            return PreemptionWatcher(lambda deadline: self._leaving.set(), poll_seconds=poll_s, node_id=node).start()
        except Exception as exc:  # never let the watcher stop the member from starting
            log.warning("member %s: preemption watcher not started: %s", self.name, exc)
            return None

    # --- the generation this process is a rank of (set by _generation) ---------------------------
    @property
    def current_gen(self) -> int:
        if self.gen is None:
            raise RuntimeError(f"member {self.name} is not a rank of a generation yet")
        return self.gen

    @property
    def current_rank(self) -> int:
        if self.rank is None:
            raise RuntimeError(f"member {self.name} is not a rank of a generation yet")
        return self.rank

    @property
    def snapshotter(self) -> Snapshotter:
        self._registered()
        if self.snap is None:
            raise RuntimeError(f"member {self.name} is not a rank of a generation yet")
        return self.snap

    # --- handover ---------------------------------------------------------------------------------
    def handover_step(self, step: int) -> int | None:
        """The step at which this generation ends for a handover, if one is named; a leaving
        member names ``step + 1`` (the next boundary every rank reaches after it)."""
        key = handover_key(self.job, self.current_gen)
        if self.store.check([key]):
            return int(self.store.get(key))
        if self._leaving.is_set() or self.store.check([leave_key(self.job, self.name)]):
            self._leaving.set()
            self.store.compare_set(key, "", str(step + 1))
            log.warning(
                "member %s (rank %d): leaving: the job hands rank %d over after step %d",
                self.name,
                self.rank,
                self.rank,
                step + 1,
            )
        return None

    def hand_over(self, step: int, state) -> None:
        """Take the generation's last snapshot (forced, every rank) and end the generation:
        ``HandedOver`` for the leaving member, ``PeerLost`` for the others."""
        self.snapshotter.save(step, state, force=True)
        committed = self.snapshotter.wait(step, timeout=self.handover_commit_s)
        self._report.handover_step = step
        if committed is None or committed < step:
            log.warning(
                "member %s: the handover snapshot of step %d did not commit (newest %s): the "
                "job rolls back to the newest committed step",
                self.name,
                step,
                committed,
            )
        if self._leaving.is_set():
            raise HandedOver(f"member {self.name} handed rank {self.rank} over after step {step}")
        raise PeerLost(f"generation {self.gen} ends after step {step}: a rank is handed over", self.current_gen)

    # --- called by the controller --------------------------------------------------------------
    def info(self) -> dict:
        return {
            "member": self.name,
            "pid": os.getpid(),
            "token": process_token(),  # what its node's agent knows the process by
            "rank": self.rank,
            "gen": self.gen,
            "threads": os_threads(),
            "fds": len(os.listdir("/proc/self/fd")),
            "rss": _rss(),
        }

    def prepare(self) -> dict:
        """Run the user's setup (before any generation: a standby is warm before it is needed)."""
        t = time.time()
        self.state = self.setup_fn(Context(self))
        # the modules a takeover's Snapshotter needs, loaded now: on a busy host importing
        # them took most of the 0.7-1.0 s a standby spent registering, on every rank's way
        # (the survivors' restore waits for it at the restore barrier)
        import memsnap.coding.receive  # noqa: F401
        import memsnap.coding.restore  # noqa: F401
        import memsnap.rank  # noqa: F401
        import memsnap.state.apply  # noqa: F401
        import memsnap.state.capture  # noqa: F401
        import memsnap.transport  # noqa: F401

        warm_s = 0.0
        if self.on_rank_fns:  # it shards when it has a rank: FSDP2's first-call costs, paid now
            from memsnap.collective.fsdp import warm_up

            try:
                warm_s = warm_up()
            except Exception as exc:  # a warm-up is an optimisation: never stop a member for it
                log.warning("member %s: FSDP2 warm-up skipped: %s", self.name, exc)
        return {**self.info(), "began": t, "setup_s": time.time() - t, "fsdp_warm_s": warm_s}

    def run(self, first_gen: int = 0) -> dict:
        """Be a member until the job is done or this member is fenced (left out of a generation
        it was a rank of). Returns what happened. ``first_gen``: the first generation this
        process can be a member of (a process started to replace a lost one joins the job's
        current generation, not the first)."""
        gen = first_gen
        while True:
            assignment = self._await(gen)
            self.history = (assignment.recoveries, assignment.rollbacks, assignment.age_s)
            if assignment.done:
                return {**self.info(), "outcome": "done", "result": None}
            rank = assignment.rank_of(self.name)
            if rank is None:
                if self.rank is not None:  # fenced: the job goes on without this process
                    return {**self.info(), "outcome": "fenced", "result": None}
                gen += 1  # still a standby
                continue
            world = assignment.world
            if self.rank is not None and rank != self.rank and world == self.world:
                raise RuntimeError(f"member {self.name}: rank {self.rank} cannot become rank {rank} in place")
            outcome = self._generation(gen, rank, world)
            if outcome is HandedOver:
                return {**self.info(), "outcome": "handed_over", "result": None}
            if outcome is not PeerLost:
                return {**self.info(), "outcome": "finished", "result": outcome}
            self.recoveries += 1
            gen += 1

    def _generation(self, gen: int, rank: int, world: int):
        t_assigned = time.time()
        takeover = self.rank is None and gen > 0
        self.resized = self.world is not None and world != self.world
        if self.snap is not None and world != self.world:
            self._resize(rank, world)
        self.rank, self.world, self.gen = rank, world, gen
        self._report = MemberReport(self.name, os.getpid(), rank, gen, takeover, t_assigned)
        if self.snap is not None:
            self.snap.steer(None)  # the last generation's plan; ctx.restore names this one's
        # a new rank's Snapshotter registers with its node's agent (calls to Ray actors) while
        # this thread forms the group and runs on_rank (CPU): side by side, not in turn
        self._registering = _Registering(self, rank, world) if self.snap is None else None
        try:
            self.group.configure(gen, rank, world)
            self._report.formed = time.time()
            while self.on_rank_fns:  # once per process (a standby's at its takeover)
                self.on_rank_fns.pop(0)(Context(self), self.state)
                self._report.on_rank = time.time()
            self._registered()
            result = self.train_fn(Context(self), self.state)
        except HandedOver as exc:
            log.warning("%s", exc)
            self._report.handed_over = time.time()
            self._publish()
            return HandedOver
        except Exception as exc:
            try:
                self._registered()  # (a rank keeps its Snapshotter across generations)
            except Exception as reg:
                log.warning("member %s: its Snapshotter did not register: %s", self.name, reg)
            # a lost peer ends a generation in PeerLost; anything else raised while the
            # generation was failing (a collective inside a library, a cancelled restore) too
            # (a failure named by the controller after a silent peer's heartbeat stops: within
            # lost_after_s and an agent ping, well inside the wait below)
            if not isinstance(exc, PeerLost) and self.group.wait_failure(5.0) is None:
                raise
            log.warning(
                "member %s (rank %d): generation %d is over (%s): waiting for the next", self.name, rank, gen, exc
            )
            if self._report.lost is None:
                self._report.lost = time.time()
            self._publish()
            return PeerLost
        self._report.finished = time.time()
        self._publish()
        self.store.set(done_key(self.job, rank), json.dumps({"member": self.name, "gen": gen}))
        return result

    def _registered(self) -> None:
        """Wait for the Snapshotter being registered for this generation, if one is; its
        error, if it failed."""
        registering, self._registering = self._registering, None
        if registering is not None:
            self.snap = registering.result()
            self._report.registered = registering.done_at

    def await_fenced(self) -> None:
        """Wait until the nodes lost before this generation are doubted (or fenced) at the
        coordinator (its restore plan must not wait on their agents), or the generation fails
        meanwhile."""
        key = fenced_key(self.job, self.current_gen)
        deadline = time.monotonic() + self.assign_timeout_s
        while not self.store.check([key]):
            why = self.group.wait_failure(0.05)
            if why is not None:
                raise PeerLost(f"generation {self.gen} is over before its restore: {why}", self.current_gen)
            if time.monotonic() > deadline:
                raise RuntimeError(f"member {self.name}: generation {self.gen} was never fenced")
        self._report.fenced = time.time()

    def _resize(self, rank: int, world: int) -> None:
        """The job goes on with ``world`` ranks, this one as ``rank``: a Snapshotter of the new
        shape (its first restore loads the newest step into the smaller world). A sharded
        model cannot follow: its parameters are laid out on a mesh of the old world."""
        if self.sharded:
            raise RuntimeError(
                f"member {self.name}: the job shrinks from {self.world} to {world} ranks, but this rank's "
                "model is sharded (ctx.fully_shard) on a mesh of the old world: a sharded job cannot go on "
                "with fewer ranks in place; give standby_nodes, or on_no_standby='wait'"
            )
        log.warning("member %s: rank %s of %s becomes rank %d of %d", self.name, self.rank, self.world, rank, world)
        assert self.snap is not None
        self.snap.close()
        self.snap = None

    def _await(self, gen: int) -> Assignment:
        key = gen_key(self.job, gen)
        self.store.wait([key], timedelta(seconds=self.assign_timeout_s))
        return Assignment.from_json(self.store.get(key))

    # --- what ``Context`` tells ------------------------------------------------------------------
    def recovered(self, live: bool) -> None:
        """This generation's recovery went on from live state (``live``) or rolled back: with
        the job's earlier recoveries (its assignment), every rank's snapshot interval is set
        against the failures that roll back (``Snapshotter.recovered``)."""
        total, rollbacks, age_s = self.history
        self.snapshotter.recovered(total + 1, rollbacks + (0 if live else 1), age_s)

    def plan_snapshots(self, after: int | None) -> None:
        """The generation trains from the step after ``after``: its snapshot steps are named by
        rank 0's scheduler for every rank (``collective.plan``), so that they commit."""
        plan = SharedPlan(self.store, self.job, self.current_gen, lead=self.current_rank == 0)
        self.snapshotter.steer(plan, after)

    def restored(self, step: int | None) -> None:
        rep = self._report
        last = self.snapshotter.last_restore
        rep.restored, rep.step, rep.tier, rep.restore_s = time.time(), step, last.tier, last.total_s
        rep.restore_phases = {k: round(v, 4) for k, v in last.seconds.items()}

    def took_over(self, done: Takeover) -> None:
        """A recovery with nothing rolled back: this rank kept its live state ("kept") or
        took a replica's ("live")."""
        rep = self._report
        rep.restored, rep.step, rep.tier, rep.restore_s = time.time(), done.step, done.role, done.seconds
        rep.live_holders, rep.live_phases = list(done.holders), dict(done.phases)
        log.info(
            "member %s (rank %s): %s step %d (%.3f s)",
            self.name,
            self.rank,
            "kept its live state at" if done.role == "kept" else "took a replica's live state of",
            done.step,
            done.seconds,
        )

    def live_refused(self, why: str) -> None:
        self._report.live_refused = why
        if self.rank == 0:
            log.warning("no live takeover in generation %s (%s): every rank rolls back", self.gen, why)

    def stepped(self, step: int) -> None:
        if self._report.first_step is None and self._report.restored is not None:
            self._report.first_step, self._report.first_step_no = time.time(), step
            self._publish()

    def _publish(self) -> None:
        try:
            self.store.set(report_key(self.job, self.current_gen, self.current_rank), self._report.to_json())
        except Exception as exc:  # a report is for the record; never stop training for it
            log.warning("member %s: report not written: %s", self.name, exc)

    def close(self) -> None:
        if self._watcher is not None:
            try:
                self._watcher.stop()
            except ValueError:  # its signals were installed by another thread: Ray's worker keeps them
                pass
        if self._lifeline is not None:
            self._lifeline.close()  # a goodbye: this process leaves, it is not lost
            self._lifeline = None
        self._beater.close()
        try:
            self._registered()
        except Exception:  # (it closes with nothing to close)
            pass
        if self.snap is not None:
            self.snap.close()
        self.group.close()


class _Registering:
    """A Snapshotter for ``rank`` of ``world`` made on a thread of its own (``result`` waits)."""

    def __init__(self, member: Member, rank: int, world: int):
        self._member, self._rank, self._world = member, rank, world
        self._snap: Snapshotter | None = None
        self._error: BaseException | None = None
        self.done_at: float | None = None
        self._thread = threading.Thread(target=self._make, name="memsnap-register", daemon=True)
        self._thread.start()

    def _make(self) -> None:
        import memsnap

        m = self._member
        try:
            self._snap = memsnap.Snapshotter(job=m.job, rank=self._rank, world_size=self._world, **m.options)
        except BaseException as exc:
            self._error = exc
        self.done_at = time.time()  # (its report's ``registered``)

    def result(self) -> Snapshotter:
        self._thread.join()  # (the Snapshotter's own calls have deadlines)
        if self._error is not None:
            raise self._error
        assert self._snap is not None
        return self._snap


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
