"""The in-place controller: it keeps the surviving ranks' processes when a peer is lost.

``InplaceJob`` runs a data-parallel job on plain Ray actors (``member.Member``), one per rank,
plus warm standbys on spare nodes. It hosts the rendezvous store (never a rank: the job must
survive any rank's loss), watches every member's heartbeat and the Ray tasks of the members,
and on a loss:

  1. decides who is lost: a member whose process ended (its lifeline, a TCP connection to
     the controller, closed without a goodbye and its beats stopped for two beat periods:
     ``collective/lifeline.py``; milliseconds after a kill or crash, once the process's memory
     is freed; or, sooner where that takes long, its node's agent answered that the process
     is exiting or gone, asked once its beats stopped for ``suspect_after_s``:
     ``ending.py``), whose task ended with an
     error (its actor died), or whose beats stopped (``lost_after_s``; ``suspect_after_s``
     once a collective failure was published: a host that vanished without closing anything). A member silent with
     no failed collective is first asked after on its node: a process that runs there and is
     not stopped (holding the GIL, in a swap storm) is waited for up to ``slow_limit_s``; a
     stopped or gone process, or a node whose agent does not answer, is lost at once;
  2. kills its actor, and writes the next generation: the survivors keep their ranks, a
     standby takes each lost rank. Every member forms the group again in the same process and
     rolls back (survivors from their own node's RAM, the standby from its peers);
  3. meanwhile fences the lost nodes: a node all of whose ranks were lost is first doubted at
     the memsnap coordinator (``Coordinator.doubt``: a restore plan leaves it out when the
     other nodes hold the newest committed step, else waits for the verdict), and then, if its
     agent is silent, declared lost (``Coordinator.node_lost``), else cleared; so the restore
     plan and the placement never wait on its agent or on Ray's verdict about it. The
     members' restores wait only for the doubt (``gen/<g>/fenced``), not for the verdict;
  4. starts a new standby on a free node in the background, if there is one.

Without a standby, ``on_no_standby="wait"`` waits (bounded) for Ray to offer a free node and
warms a standby there; ``"shrink"`` goes on at once with fewer ranks (the survivors numbered
0..W'-1 in their old order, the newest committed step loaded into the smaller world: data
parallel jobs only); ``"fail"`` ends the job with an error naming the fix.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from memsnap.collective.assignment import Assignment, fenced_key, gen_key
from memsnap.collective.group import failed_key, publish_failure
from memsnap.collective.heartbeat import Monitor
from memsnap.collective.lifeline import Lifelines
from memsnap.collective.report import MemberReport, read_reports, rolled_back
from memsnap.errors import ConfigError, MemsnapError
from memsnap.inplace.ending import EndedAsks
from memsnap.rank.member import Member

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger("memsnap.inplace")

_POLL_S = 0.05


class RecoveryError(MemsnapError):
    """The job cannot go on in place (no standby and no free node, or too many losses)."""


@dataclasses.dataclass
class Recovery:
    """One recovery: who was lost, and where the seconds went (wall-clock times)."""

    gen: int  # the generation formed by this recovery
    lost: dict[int, str]  # rank -> the member lost
    takeover: dict[int, str]  # rank -> the standby that took it
    fenced_nodes: list[str]
    why: str
    noticed: float  # the controller saw the first sign
    decided: float  # the next generation was written
    doubted: float | None = None  # the lost nodes were doubted at the coordinator: the restores could start
    fenced: float | None = None  # the coordinator had its verdict on them (fenced or cleared)
    shrunk: tuple[int, int] | None = None  # (world before, world after) when no standby was left
    reports: dict[int, MemberReport] = dataclasses.field(default_factory=dict)
    before: dict[int, MemberReport] = dataclasses.field(default_factory=dict)  # of the failed generation
    sent: bool = False  # reported to the coordinator and the event log

    def rolled_back(self) -> bool:
        """Whether the ranks rolled back to a snapshot in this recovery (or it is not known: a
        recovery that failed before every rank reported), rather than went on from live state."""
        return rolled_back(self.reports.values())

    def split(self) -> dict[str, float | None]:
        """``detect`` (first sign -> decision), ``reform`` (decision -> every member formed the
        group), ``restore`` (-> every rank restored), ``first_step`` (-> every rank took a step)."""

        def last(key):
            values = [getattr(r, key) for r in self.reports.values()]
            return max(values) if values and None not in values else None

        formed, restored, stepped = last("formed"), last("restored"), last("first_step")
        return {
            "detect": self.decided - self.noticed,
            "reform": None if formed is None else formed - self.decided,
            "restore": None if restored is None or formed is None else restored - formed,
            "first_step": None if stepped is None or restored is None else stepped - restored,
            "total": None if stepped is None else stepped - self.noticed,
        }

    def to_dict(self) -> dict:
        return {
            "gen": self.gen,
            "lost": self.lost,
            "takeover": self.takeover,
            "fenced_nodes": self.fenced_nodes,
            "why": self.why,
            "noticed": self.noticed,
            "decided": self.decided,
            "doubted": self.doubted,
            "fenced": self.fenced,
            "shrunk": self.shrunk,
            "split": self.split(),
            "tiers": {r: rep.tier for r, rep in sorted(self.reports.items())},
            "steps": {r: rep.step for r, rep in sorted(self.reports.items())},
            "pids": {r: rep.pid for r, rep in sorted(self.reports.items())},
            # why the ranks rolled back instead of going on from their live state (None: they did not)
            "live_refused": next((r.live_refused for r in self.reports.values() if r.live_refused is not None), None),
            # each member's own timeline of the generation (assigned, formed, restored, first step...)
            "members": {r: rep.to_wire() for r, rep in sorted(self.reports.items())},
            # when each survivor left the failed generation (its step cut, or run out to a collective)
            "left": {r: rep.lost for r, rep in sorted(self.before.items()) if rep.lost is not None},
        }


def pin_coordinator(job: str, options: dict, world: int, node: str) -> None:
    """Start the job's coordinator on ``node`` (hard affinity), or find the one running:
    ``options`` are the ranks' Snapshotter options."""
    import ray

    from memsnap import actors
    from memsnap.options import resolve_options
    from memsnap.rank.job import job_config

    cfg = job_config(job, resolve_options({k: v for k, v in options.items() if k != "run"}))
    ray.get(actors.coordinator_for(cfg, world, node=node).config.remote(), timeout=120)


def _answers(refs: list) -> dict:
    """``{ref: its value, or the exception it raised}`` of those of ``refs`` done now."""
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    out: dict = {}
    for ref in ready:
        try:
            out[ref] = ray.get(ref)
        except Exception as exc:
            out[ref] = exc
    return out


def silent_nodes(job: str, nodes: Sequence[str], ping_s: float, asked: dict | None = None) -> list[str]:
    """Those of ``nodes`` whose memsnap agent does not answer within ``ping_s`` (a rank's
    process can die on a healthy node: a node whose agent answers keeps its place, and the
    RAM it holds for its peers). ``asked``: ``node -> (ref, time.monotonic() sent)`` of a
    question already out to a node's agent (``EndedAsks``, sent when its member fell silent):
    an answer to either counts, and such a node is waited for only until ``ping_s`` after
    that question was sent, not after this ping."""
    import ray

    from memsnap.directory import find_agent

    now = time.monotonic()
    pings, deadline = {}, {}
    for node in nodes:
        deadline[node] = now + ping_s
        agent = find_agent(job, node)
        if agent is not None:
            pings[agent.address.remote()] = node
        if asked and node in asked:
            ref, sent = asked[node]
            pings[ref] = node
            deadline[node] = min(deadline[node], sent + ping_s)
    answered: set[str] = set()
    while True:
        now = time.monotonic()
        waiting = {ref: n for ref, n in pings.items() if n not in answered and now < deadline[n]}
        if not waiting:
            break
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=min(deadline[n] for n in waiting.values()) - now)
        for ref in ready:
            node = pings.pop(ref)
            try:
                ray.get(ref)
                answered.add(node)
            except Exception:
                pass
    return [n for n in nodes if n not in answered]


def _seconds(name: str, value, zero_ok: bool = False) -> float:
    """``value`` as a finite number of seconds (> 0, or >= 0 with ``zero_ok``), else ConfigError."""
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if zero_ok else value > 0)
    )
    if not ok:
        raise ConfigError(f"{name}={value!r}: must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}")
    return float(value)


@dataclasses.dataclass
class _Slot:
    name: str
    node: str
    actor: Any
    ref: Any = None  # its run() task
    token: str | None = None  # its process, as its node's agent knows it (from prepare)
    arenas_asked: bool = False  # a standby: its node's agent was asked to back its arena slots ahead


class InplaceJob:
    """A data-parallel job on Ray actors that recovers from a lost rank in place.

    ``setup(ctx) -> state`` runs once per process (ranks and standbys alike, before any
    failure; ``ctx.rank`` is None in a standby, so it must not depend on the rank);
    ``train(ctx, state)`` runs once per generation: ``step = ctx.restore(state)``, then
    ``ctx.average_gradients(params)`` and ``ctx.save(step, state)`` in each step. A lost peer
    ends the generation; ``train`` is called again in the same process after the group is
    formed again, and its ``ctx.restore`` rolls back in place.

    ``rank_nodes``: the Ray node id of each rank (several ranks may share a node);
    ``standby_nodes``: the node of each warm standby (each also runs a memsnap spare agent).
    ``options``: the ``memsnap.Snapshotter`` options of every rank.

    ``live_takeover``: where the ranks hold replicas of one state (data parallel), a recovery
    rolls nobody back: the survivors keep their live state and the standby takes it from them
    (``memsnap.collective.live``). ``"verified"`` (default) does so when two survivors show the
    same state; ``"trusted"`` when one does; ``"off"`` always rolls back to the newest
    committed step. Sharded state (``ctx.fully_shard``) always rolls back."""

    def __init__(
        self,
        job: str,
        setup: Callable,
        train: Callable,
        *,
        rank_nodes: list[str],
        standby_nodes: Sequence[str] = (),
        options: dict | None = None,
        beat_s: float = 0.1,
        lost_after_s: float = 1.0,
        suspect_after_s: float = 0.3,
        slow_limit_s: float = 30.0,
        backend: str = "gloo",
        backend_timeout_s: float = 60.0,
        on_no_standby: str = "wait",
        wait_for_node_s: float = 120.0,
        agent_ping_s: float = 0.5,
        events: str | None = None,
        live_takeover: str = "verified",
    ):
        if not rank_nodes:
            raise ConfigError("rank_nodes=[]: give the Ray node id of every rank")
        from memsnap.collective.live import MODES

        if live_takeover not in MODES:
            raise ConfigError(
                f"live_takeover={live_takeover!r}: must be 'verified' (the default: go on from the survivors' "
                "live state where two of them show they are replicas), 'trusted' (one is enough) or 'off' "
                "(always roll back to the newest committed step)"
            )
        if on_no_standby not in ("wait", "shrink", "fail"):
            raise ConfigError(f"on_no_standby={on_no_standby!r}: must be 'wait', 'shrink' or 'fail'")
        if backend not in ("gloo", "nccl"):
            raise ConfigError(
                f"backend={backend!r}: must be 'gloo' (CPU tensors) or 'nccl' (CUDA tensors; "
                "its groups are aborted, never destroyed, when a peer is lost)"
            )
        beat_s, suspect_after_s, lost_after_s, slow_limit_s = (
            _seconds("beat_s", beat_s),
            _seconds("suspect_after_s", suspect_after_s),
            _seconds("lost_after_s", lost_after_s),
            _seconds("slow_limit_s", slow_limit_s),
        )
        backend_timeout_s, wait_for_node_s = (
            _seconds("backend_timeout_s", backend_timeout_s),
            _seconds("wait_for_node_s", wait_for_node_s, zero_ok=True),
        )
        if not 0 < beat_s < suspect_after_s <= lost_after_s:
            raise ConfigError(
                f"beat_s={beat_s}, suspect_after_s={suspect_after_s}, lost_after_s={lost_after_s}: "
                "need 0 < beat_s < suspect_after_s <= lost_after_s (a few beats each)"
            )
        if slow_limit_s < lost_after_s:
            raise ConfigError(
                f"slow_limit_s={slow_limit_s}: must be >= lost_after_s={lost_after_s} (how long a silent "
                "member whose process still runs is waited for; equal to lost_after_s: never waited for)"
            )
        self.job, self.setup, self.train = job, setup, train
        self.rank_nodes, self.standby_nodes = list(rank_nodes), list(standby_nodes)
        self.world = len(self.rank_nodes)
        self.run_id = uuid.uuid4().hex[:16]
        self.options = {**(options or {}), "run": self.run_id}
        self.beat_s, self.lost_after_s, self.suspect_after_s = beat_s, lost_after_s, suspect_after_s
        self.slow_limit_s = slow_limit_s
        self._working: dict[str, float] = {}  # member -> when its node last said its process works
        self._agent_answers: dict[str, float] = {}  # node -> when its agent last answered about a member
        self._rank_bytes: Any = None  # the coordinator's answer pending: a rank's snapshot size
        self.backend, self.backend_timeout_s = backend, backend_timeout_s
        self.on_no_standby, self.wait_for_node_s = on_no_standby, wait_for_node_s
        self.events = events
        self.live_takeover = live_takeover
        self.agent_ping_s = float(agent_ping_s)
        self.recoveries: list[Recovery] = []
        self.gen = 0
        self._started = time.monotonic()  # the job's age in each generation counts from here (run)
        self._ranks: dict[int, _Slot] = {}
        self._standbys: list[_Slot] = []
        self._lock = threading.Lock()
        self._used_nodes: set[str] = set()
        self._fenced: set[str] = set()
        self._ended = EndedAsks(self._ask_running, _answers)  # a silent member's node, asked early
        self._warming: list[threading.Thread] = []
        self.store: TCPStore | None = None  # the job's store, from run() on

    # --- running --------------------------------------------------------------------------------
    def run(self, timeout_s: float = 3600.0) -> dict[int, Any]:
        """Run the job to its end: ``{rank: what train returned}``."""
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self._started = time.monotonic()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        self.monitor = Monitor(self.store, self.job)
        self.lifelines = Lifelines(host)
        try:
            import memsnap

            self._pin_coordinator()
            for node in self.standby_nodes:
                memsnap.start_spare(self.job, node, **{k: v for k, v in self.options.items() if k != "run"})
            for rank, node in enumerate(self.rank_nodes):
                self._ranks[rank] = self._start(f"r{rank}", node)
            self._standbys = [self._start(f"s{i}", node) for i, node in enumerate(self.standby_nodes)]
            slots = [*self._ranks.values(), *self._standbys]
            for slot, info in zip(slots, ray.get([s.actor.prepare.remote() for s in slots], timeout=600)):
                slot.token = info.get("token")
            self._assign(0, {s.name: rank for rank, s in self._ranks.items()})
            for slot in [*self._ranks.values(), *self._standbys]:
                slot.ref = slot.actor.run.remote()
            return self._watch(time.monotonic() + timeout_s)
        finally:
            self._close()

    def _pin_coordinator(self) -> None:
        """The job's coordinator runs beside this controller, on a node no rank runs on (a
        rank node's loss must not take the coordinator with it)."""
        import ray

        pin_coordinator(self.job, self.options, self.world, ray.get_runtime_context().get_node_id())

    def _coordinator_call(self, method: str, *args, timeout_s: float = 60.0):
        """``method(*args)`` on the job's coordinator, through its restart if it was lost
        (it is rebuilt from the agents; the calls made here are idempotent)."""
        import ray

        from memsnap import naming

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                coord = ray.get_actor(naming.coordinator(self.job), namespace=naming.NAMESPACE)
                return ray.get(getattr(coord, method).remote(*args), timeout=max(1.0, deadline - time.monotonic()))
            except ValueError:
                return None  # no coordinator (no rank registered yet)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError) as exc:
                if time.monotonic() >= deadline:
                    raise RecoveryError(
                        f"job {self.job!r}: the coordinator did not come back within {timeout_s:.0f} s ({exc})"
                    ) from None
                time.sleep(0.1)  # it is restarting; Ray has no event to wait on for that

    def _start(self, name: str, node: str) -> _Slot:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        assert self.store is not None, "ranks start from run()"
        host, port = self.store.host, self.store.port
        self.monitor.watch(name)
        ticket = self.lifelines.expect(name)
        actor = (
            ray.remote(Member)
            .options(
                num_cpus=0,
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote(
                self.job,
                name,
                (host, port),
                self.setup,
                self.train,
                self.options,
                beat_s=self.beat_s,
                backend=self.backend,
                backend_timeout_s=self.backend_timeout_s,
                live_takeover=self.live_takeover,
                lifeline=ticket,
            )
        )
        self._used_nodes.add(node)
        return _Slot(name, node, actor)

    def _assign(self, gen: int, members: dict[str, int], done: bool = False, fenced: bool = True) -> None:
        """Write generation ``gen``, with how the recoveries so far went (every member's
        snapshot interval reads it); ``fenced``: its restore may start at once (else once
        ``_fenced_for(gen)`` is written)."""
        self.gen = gen
        assert self.store is not None
        recs = self.recoveries
        rollbacks = sum(rec.rolled_back() for rec in recs)
        age = time.monotonic() - self._started
        self.store.set(
            gen_key(self.job, gen), Assignment(self.world, members, done, len(recs), rollbacks, age).to_json()
        )
        if fenced:
            self.store.set(fenced_key(self.job, gen), "1")

    def _watch(self, deadline: float) -> dict[int, Any]:
        import ray

        results: dict[int, Any] = {}
        reported_at: float | None = None
        next_report = 0.0
        while True:
            if time.monotonic() >= next_report:
                self._report_finished()
                self._ready_standby_arenas()
                next_report = time.monotonic() + 0.5
            if time.monotonic() > deadline:
                raise RecoveryError(f"job {self.job!r} did not finish within its timeout")
            by_ref = {s.ref: (rank, s) for rank, s in self._ranks.items() if rank not in results}
            if not by_ref:
                return results
            ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=_POLL_S)
            lost: dict[int, str] = {}
            for ref in ready:
                rank, slot = by_ref[ref]
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    # the member raised: its training function (or what it called) failed. Every
                    # process would fail the same way again: that ends the job, it is no loss
                    raise RecoveryError(
                        f"job {self.job!r}: rank {rank} ({slot.name}) failed: {_why(exc)}. A training "
                        "function that raises ends the job (it is not a lost node): fix it and start again"
                    ) from exc
                except Exception as exc:
                    lost[rank] = f"its process ended ({_why(exc)})"
                    continue
                if out.get("outcome") == "finished":
                    results[rank] = out.get("result")
                elif out.get("outcome") == "handed_over":
                    lost[rank] = "handed over (a preemption notice)"
            if self.store is not None and self.store.check([failed_key(self.job, self.gen)]) and reported_at is None:
                reported_at = time.time()
            ages, gone = self.monitor.poll(), self.lifelines.gone()
            dead = {
                rank: slot
                for rank, slot in self._ranks.items()
                if rank not in results and rank not in lost and self._dead(slot.name, ages, gone)
            }
            limit = self.suspect_after_s if reported_at is not None else self.lost_after_s
            silent = {
                rank: slot
                for rank, slot in self._ranks.items()
                if rank not in results and rank not in lost and rank not in dead and ages.get(slot.name, 0.0) > limit
            }
            slow = self._still_working(silent, ages) if silent and reported_at is None else set()
            for rank, slot in dead.items():
                lost[rank] = f"its process ended: its lifeline closed, no heartbeat for {ages[slot.name]:.2f} s"
            for rank, slot in silent.items():
                if slot.name not in slow:
                    lost[rank] = f"no heartbeat for {ages[slot.name]:.1f} s"
            quiet = {
                slot.name: (rank, slot)
                for rank, slot in self._ranks.items()
                if rank not in results and rank not in lost and slot.token is not None
                if ages.get(slot.name, 0.0) > self.suspect_after_s
            }
            ended = self._ended.ended({name: (slot.node, str(slot.token)) for name, (_, slot) in quiet.items()})
            for name in ended:
                lost[quiet[name][0]] = (
                    f"its process ended: its node says so, no heartbeat for {ages[name]:.2f} s (its lifeline "
                    "not closed yet: a killed process closes its sockets last)"
                )
            if lost:
                signs = [t for t in (reported_at, *(gone[s.name] for s in dead.values())) if t is not None]
                signs += [time.time()] if ended else []
                noticed = min(signs) if signs else time.time()
                self._recover(lost, noticed)
                reported_at = None
                results = {r: v for r, v in results.items() if r not in lost}
                if self.recoveries[-1].shrunk:  # the ranks were numbered again
                    results = {}
            elif reported_at is not None and time.time() - reported_at > 2 * self.lost_after_s:
                # a collective failed but every member still beats: re-form with the same members
                self._recover({}, reported_at)
                reported_at = None
                results = {}

    def _dead(self, member: str, ages: dict[str, float], gone: dict[str, float]) -> bool:
        """``member``'s process ended: its lifeline closed without a goodbye, and it has not
        beaten for two beat periods since (a live process whose connection broke goes on beating)."""
        return member in gone and ages.get(member, 0.0) > 2 * self.beat_s

    def _still_working(self, silent: dict[int, _Slot], ages: dict[str, float]) -> set[str]:
        """Those of the ``silent`` members (beats stopped, no collective failed) to wait for:
        their node's agent says their process runs and is not stopped, and they have been
        silent for less than ``slow_limit_s``. Asked again once per ``lost_after_s``."""
        import ray

        from memsnap.directory import find_agent

        now = time.monotonic()
        wait = {s.name for s in silent.values() if ages[s.name] <= self.slow_limit_s and s.token is not None}
        ask = [
            s for s in silent.values() if s.name in wait and now - self._working.get(s.name, -1e9) > self.lost_after_s
        ]
        by_node: dict[str, list[_Slot]] = {}
        for slot in ask:
            by_node.setdefault(slot.node, []).append(slot)
        refs = {}
        for node, slots in by_node.items():
            agent = find_agent(self.job, node)
            if agent is not None:
                refs[agent.working.remote([s.token for s in slots])] = slots
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.agent_ping_s) if refs else ([], [])
        confirmed = set()
        for ref in ready:
            try:
                tokens = set(ray.get(ref))
            except Exception:
                continue
            for slot in refs[ref]:
                self._agent_answers[slot.node] = time.monotonic()
            confirmed |= {s.name for s in refs[ref] if s.token in tokens}
        for slot in ask:
            if slot.name in confirmed:
                if slot.name not in self._working:
                    log.warning(
                        "job %r: %s (rank %s) has not beaten for %.1f s but its process runs: waiting up to "
                        "slow_limit_s=%.0f s",
                        self.job,
                        slot.name,
                        next(r for r, s in silent.items() if s is slot),
                        ages[slot.name],
                        self.slow_limit_s,
                    )
                self._working[slot.name] = now
            else:
                self._working.pop(slot.name, None)
                wait.discard(slot.name)
        for name in list(self._working):  # a member that beats again starts afresh
            if name not in {s.name for s in silent.values()}:
                del self._working[name]
        return wait

    def _ask_running(self, node: str, tokens: list[str]):
        """Ask ``node``'s agent which of these member processes still run (``EndedAsks``)."""
        from memsnap.directory import find_agent

        agent = find_agent(self.job, node)
        return None if agent is None else agent.running.remote(tokens)

    def hand_over(self, rank: int) -> None:
        """Move ``rank`` to a standby at its next step boundary, with nothing rolled back (what
        a preemption notice on its node does by itself)."""
        from memsnap.collective.assignment import leave_key

        assert self.store is not None, "a rank leaves a running job"
        self.store.set(leave_key(self.job, self._ranks[rank].name), "1")

    # --- recovering -------------------------------------------------------------------------------
    def _recover(self, lost: dict[int, str], noticed: float) -> None:
        import ray

        why = "; ".join(f"rank {r}: {w}" for r, w in sorted(lost.items())) or "a collective failed"
        log.warning("job %r generation %d: %s", self.job, self.gen, why)
        publish_failure(self.store, self.job, self.gen, f"controller: {why}")
        lost_slots = {rank: self._ranks[rank] for rank in lost}
        for slot in lost_slots.values():
            self._forget(slot.name)
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
        self._cancel_restore(why)
        survivors = {r: s for r, s in self._ranks.items() if r not in lost}
        takeover = {}
        dropped = []
        for rank in sorted(lost_slots):
            standby = self._next_standby(may_shrink=len(survivors) > 0)
            if standby is None:
                dropped.append(rank)
                del self._ranks[rank]
                continue
            takeover[rank] = standby.name
            self._ranks[rank] = standby
        shrunk = None
        if dropped:  # fewer ranks: the rest keep their order, numbered from 0
            shrunk = (self.world, len(self._ranks))
            self._ranks = dict(enumerate(slot for _, slot in sorted(self._ranks.items())))
            self.world = len(self._ranks)
            log.warning(
                "job %r: no standby for rank(s) %s: the job goes on with %d ranks (was %d)",
                self.job,
                dropped,
                self.world,
                shrunk[0],
            )
        members = {s.name: rank for rank, s in self._ranks.items()}
        gen = self.gen + 1
        # the generation first: the members re-form and a standby registers while the lost
        # nodes are doubted at the coordinator (restores may start: their plans leave those
        # nodes out, or wait for the verdict where they might matter) and then fenced or
        # cleared (a silent agent takes agent_ping_s to tell)
        self.collect()  # the earlier recoveries' reports: which rolled back (the members' interval)
        self._assign(gen, members, fenced=False)
        decided = time.time()
        candidates = self._lost_nodes(lost_slots, survivors)
        # a node whose agent answered lately (a rank's process lost on a healthy node) is not
        # doubted: its agent is asked as before, once the verdict has it alive
        quiet = [n for n in candidates if not self._answered_lately(n)]
        doubted = None
        assert self.store is not None  # (run() made it)
        try:
            if quiet:
                self._coordinator_call("doubt", quiet, why)
            if len(quiet) == len(candidates):
                doubted = time.time()
                self.store.set(fenced_key(self.job, gen), "1")
            fenced = self._fence_nodes(candidates, why)
        finally:
            self.store.set(fenced_key(self.job, gen), "1")
        busy = {s.node for s in self._ranks.values()} | {s.node for s in self._standbys}
        for slot in lost_slots.values():  # a healthy node a lost process leaves free can warm a standby
            if slot.node not in fenced and slot.node not in busy:
                self._used_nodes.discard(slot.node)
        rec = Recovery(
            gen=gen,
            lost={r: s.name for r, s in lost_slots.items()},
            takeover=takeover,
            fenced_nodes=fenced,
            why=why,
            noticed=noticed,
            decided=decided,
            doubted=doubted,
            fenced=time.time(),
            shrunk=shrunk,
        )
        self.recoveries.append(rec)
        self._event({"event": "recovery", **rec.to_dict()})
        for _ in lost_slots:
            self._warm_a_standby()

    def _answered_lately(self, node: str) -> bool:
        """``node``'s agent answered one of this controller's questions within the last
        ``lost_after_s + agent_ping_s`` (it was asked about a silent member)."""
        at = max(self._ended.answered.get(node, -1e9), self._agent_answers.get(node, -1e9))
        return time.monotonic() - at <= self.lost_after_s + self.agent_ping_s

    @staticmethod
    def _lost_nodes(lost: dict[int, _Slot], survivors: dict[int, _Slot]) -> list[str]:
        """The nodes all of whose ranks were lost (their agents may be lost too)."""
        return sorted({s.node for s in lost.values()} - {s.node for s in survivors.values()})

    def _fence_nodes(self, candidates: list[str], why: str) -> list[str]:
        """Those of ``candidates`` whose agent is silent: memsnap's coordinator fences them;
        the others (a process lost on a healthy node) are cleared of the doubt."""
        if not candidates:
            return []
        nodes = silent_nodes(self.job, candidates, self.agent_ping_s, self._ended.unanswered())
        for node in candidates:
            if node not in nodes:
                self._coordinator_call("cleared", node)
        for node in nodes:
            self._coordinator_call("node_lost", node, why)
            self._ended.forget(node)
        self._fenced.update(nodes)
        return nodes

    def _cancel_restore(self, why: str) -> None:
        """Ranks waiting in a restore round for a member that is gone leave it now (before the
        next generation, whose restore starts a new round)."""
        self._coordinator_call("cancel_restore", why)

    def _next_standby(self, may_shrink: bool = False) -> _Slot | None:
        """A warm standby to take a lost rank; None to go on without the rank (``"shrink"``,
        with ``may_shrink``: some rank survives to go on)."""
        self._drop_dead_standbys()
        with self._lock:
            if self._standbys:
                return self._standbys.pop(0)
        if self.on_no_standby == "shrink" and may_shrink:
            return None
        if self.on_no_standby in ("fail", "shrink"):
            raise RecoveryError(
                f"job {self.job!r}: a rank was lost and no standby is left"
                + (" (and no rank survived to go on with)" if self.on_no_standby == "shrink" else "")
                + ": give more standby_nodes, or on_no_standby='wait' to wait for a free node"
            )
        log.warning(
            "job %r: a rank was lost and no standby is warm: waiting up to %.0f s for the one warming or "
            "a free node (add a node to the cluster, or give more standby_nodes)",
            self.job,
            self.wait_for_node_s,
        )
        for t in list(self._warming):
            t.join(timeout=max(0.0, self.wait_for_node_s))
        deadline = time.monotonic() + self.wait_for_node_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._standbys:
                    return self._standbys.pop(0)
            if self._free_node() is not None:
                self._warm_a_standby(wait=True)
                continue
            time.sleep(0.5)  # Ray has no event for a node joining to wait on
        raise RecoveryError(
            f"job {self.job!r}: no standby and no free node within {self.wait_for_node_s:.0f} s: "
            "add a node to the cluster or give standby_nodes"
        )

    def _drop_dead_standbys(self) -> None:
        """Leave out the standbys that are gone (their task ended, or their beats stopped for
        ``suspect_after_s``: a standby on a node lost with the ranks' must not take a rank, or
        the generation it joins waits for it until its heartbeat times out)."""
        import ray

        ages, gone = self.monitor.poll(), self.lifelines.gone()
        with self._lock:
            slots = list(self._standbys)
        ended = set()
        refs = [s.ref for s in slots if s.ref is not None]
        if refs:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            ended = set(ready)
        dead = [
            s
            for s in slots
            if s.ref in ended or ages.get(s.name, 0.0) > self.suspect_after_s or self._dead(s.name, ages, gone)
        ]
        if not dead:
            return
        with self._lock:
            self._standbys = [s for s in self._standbys if s not in dead]
        for slot in dead:
            log.warning("job %r: standby %s is gone: it takes no rank", self.job, slot.name)
            self._forget(slot.name)
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass

    def _forget(self, member: str) -> None:
        self.monitor.forget(member)
        self.lifelines.forget(member)

    def _free_node(self) -> str | None:
        import ray

        alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        free = [n for n in alive if n not in self._used_nodes and n not in self._fenced]
        return free[0] if free else None

    def _warm_a_standby(self, wait: bool = False) -> None:
        """A new standby on a free node (its memsnap spare agent too), off the recovery's path."""
        node = self._free_node()
        if node is None:
            return
        self._used_nodes.add(node)

        def warm():
            import ray

            import memsnap

            slot = None
            try:
                # the member's process starts and runs the user's setup while the node's
                # spare agent starts (each takes seconds on a busy host: side by side, not in turn)
                t = time.time()
                slot = self._start(f"s{uuid.uuid4().hex[:6]}", node)
                prepared = slot.actor.prepare.remote()
                memsnap.start_spare(self.job, node, **{k: v for k, v in self.options.items() if k != "run"})
                spare_s = time.time() - t
                ready = ray.get(prepared, timeout=600)
                slot.token = ready.get("token")
                slot.ref = slot.actor.run.remote()
                with self._lock:
                    self._standbys.append(slot)
                # where its warm-up went: its process start (until its setup began), the user's
                # setup, FSDP2's warm-up (in the setup's time), the spare agent (side by side)
                phases = {
                    "process_s": ready["began"] - t,
                    "setup_s": ready["setup_s"],
                    "fsdp_warm_s": ready["fsdp_warm_s"],
                    "spare_s": spare_s,
                }
                self._event({"event": "standby", "member": slot.name, "node": node, **phases})
            except Exception as exc:
                log.warning("job %r: no new standby on node %s: %s", self.job, node[:12], exc)
                if slot is not None:
                    self._forget(slot.name)
                    try:
                        ray.kill(slot.actor, no_restart=True)
                    except Exception:
                        pass

        t = threading.Thread(target=warm, name="memsnap-warm-standby", daemon=True)
        self._warming.append(t)
        t.start()
        if wait:
            t.join(timeout=self.wait_for_node_s)

    def _ready_standby_arenas(self) -> None:
        """Once the job has committed a step (its ranks' snapshot size known), ask each warm
        standby's node agent to back the arena slots of whichever rank it will take
        (``Slots.ready_standby``): its first saves after a takeover then touch no fresh pages.
        Never waits: the size is asked for once and read on a later call."""
        import ray

        from memsnap import naming
        from memsnap.directory import find_agent

        with self._lock:
            pending = [s for s in self._standbys if not s.arenas_asked]
        if not pending:
            return
        if self._rank_bytes is None:
            try:
                coord = ray.get_actor(naming.coordinator(self.job), namespace=naming.NAMESPACE)
                self._rank_bytes = coord.rank_bytes.remote()
            except ValueError:  # no coordinator yet
                return
        ready, _ = ray.wait([self._rank_bytes], timeout=0)
        if not ready:
            return
        try:
            nbytes = ray.get(self._rank_bytes)
        except Exception:
            nbytes = None
        self._rank_bytes = None  # (asked again next time if no step was committed yet)
        if not nbytes:
            return
        for slot in pending:
            agent = find_agent(self.job, slot.node)
            if agent is not None:
                agent.ready_standby.remote(int(nbytes))  # (in the background, on the standby's node)
                slot.arenas_asked = True

    # --- reporting -------------------------------------------------------------------------------
    def collect(self) -> list[dict]:
        """Every recovery so far, with the members' reports of the generation it formed."""
        if self.store is not None:
            for rec in self.recoveries:
                read_reports(self.store, self.job, rec.gen, self.world, rec.reports)
                if not rec.sent:  # the survivors' reports of the generation they left, once final
                    for rank in [r for r, rep in rec.before.items() if rep.lost is None and r not in rec.lost]:
                        del rec.before[rank]  # written at its first step: read again once it left
                    world = self.world if rec.shrunk is None else rec.shrunk[0]
                    read_reports(self.store, self.job, rec.gen - 1, world, rec.before)
        return [rec.to_dict() for rec in self.recoveries]

    def _report_finished(self) -> None:
        """Recoveries whose every rank has taken its first step go to the coordinator
        (``status()``, ``memsnap status``, the metrics) and the event log, once each."""
        import ray

        from memsnap import naming

        self.collect()
        for rec in self.recoveries:
            if rec.sent or len(rec.reports) < self.world or rec.split()["total"] is None:
                continue
            rec.sent = True
            self._event({"event": "recovered", **rec.to_dict()})
            try:
                coord = ray.get_actor(naming.coordinator(self.job), namespace=naming.NAMESPACE)
                coord.recovered.remote(rec.to_dict())
            except Exception as exc:  # the record is for the record: never stop the job for it
                log.warning("job %r: recovery not reported to the coordinator: %s", self.job, exc)

    def members(self) -> dict[int, dict]:
        """``{rank: member info}`` (pid, threads, fds, RSS) of the current generation."""
        import ray

        return dict(zip(self._ranks, ray.get([s.actor.info.remote() for s in self._ranks.values()], timeout=60)))

    def _event(self, record: dict) -> None:
        if self.events:
            with open(self.events, "a") as f:
                f.write(json.dumps({"t": time.time(), "job": self.job, **record}, default=str) + "\n")

    def _close(self) -> None:
        import ray

        if self.store is None:
            return
        try:
            self._report_finished()
        except Exception:
            pass
        for t in self._warming:
            t.join(timeout=60)
        try:
            self._assign(self.gen + 1, {}, done=True)  # standbys waiting for a generation return
        except Exception:
            pass
        try:
            self._drop_dead_standbys()  # (one lost with a node: nothing to close there)
        except Exception:
            pass
        slots = [*self._ranks.values(), *self._standbys]
        refs = [s.actor.close.remote() for s in slots]
        try:
            ray.get(refs, timeout=60)
        except Exception as exc:
            log.warning("job %r: closing members: %s", self.job, exc)
        for s in slots:
            try:
                ray.kill(s.actor, no_restart=True)
            except Exception:
                pass
        self.lifelines.close()


def _why(exc: BaseException) -> str:
    """A member's end in one line: the error's type and its last line (a task error's cause)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1][:300]}" if lines else type(exc).__name__
