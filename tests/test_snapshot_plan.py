"""Rank 0 names an in-place generation's snapshot steps and every rank follows
(``memsnap.collective.plan``): the ranks agree even where their own schedulers would not."""

from __future__ import annotations

import json
import random

import pytest

from memsnap.collective.plan import SharedPlan, figures_key, plan_key
from memsnap.policy import Policy, Scheduler


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class DictStore:
    """The three calls of a torch ``Store`` the plan makes, over a dict."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.gets = 0

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        self.gets += 1
        return self.keys[key]


def schedulers(clock: FakeClock) -> list[Scheduler]:
    """Three survivors that know the job's figures, and a standby that took rank 3 over: it
    measures its cost on cold memory (its first snapshots stall 6x the others')."""
    ranks = []
    for _ in range(3):
        s = Scheduler(Policy(auto=True, mtbf_hours=0.05, nodes=1), clock, start_step=-1)
        s.adopt(0.1, 1.0)
        ranks.append(s)
    ranks.append(Scheduler(Policy(auto=True, mtbf_hours=0.05, nodes=1), clock, start_step=-1))
    for s in ranks:
        s.resume(99)  # the generation restored step 99
    return ranks


def run(ranks: list[Scheduler], clock: FakeClock, plans: list[SharedPlan] | None, seed: int) -> list[set[int]]:
    """Drive the ranks in lockstep from step 100: each step's saves in a random order (rank 0
    first, last or between), every save of a step before any of the next (the next step's
    collective waits for every rank). Returns the steps each rank snapshotted."""
    rng = random.Random(seed)
    taken: list[set[int]] = [set() for _ in ranks]
    if plans is not None:
        for plan, sched in zip(plans, ranks):
            plan.start(sched, 99)
    for step in range(100, 400):
        clock.t += 1.0
        order = list(range(len(ranks)))
        rng.shuffle(order)
        for r in order:
            sched = ranks[r]
            due = sched.due(step) if plans is None else plans[r].due(step, sched)
            if due:
                stall = 0.6 if r == 3 and len(taken[r]) < 3 else 0.1
                sched.taken(step, cost_seconds=stall)
                taken[r].add(step)
            if plans is not None:
                plans[r].passed(step, sched)
    return taken


def test_own_schedulers_disagree_where_a_standby_measured_cold_memory():
    """The case the plan is for: left to themselves, the standby and the survivors pick steps
    that are not all the same, and a step commits only when every rank took it."""
    clock = FakeClock()
    taken = run(schedulers(clock), clock, None, seed=0)
    assert any(t != taken[0] for t in taken[1:]), taken


@pytest.mark.parametrize("seed", range(5))
def test_every_rank_snapshots_the_steps_rank_0_names(seed):
    clock = FakeClock()
    ranks = schedulers(clock)
    store = DictStore()
    plans = [SharedPlan(store, "j", 1, lead=r == 0) for r in range(4)]
    taken = run(ranks, clock, plans, seed)
    assert len(taken[0]) >= 5
    assert all(t == taken[0] for t in taken[1:]), taken
    # rank 0's scheduler decided: its grid, from its figures
    g = ranks[0].grid_steps
    assert g is not None and all((s + 1) % g == 0 for s in sorted(taken[0])[-3:])
    # followers read the plan about once or twice per point, not on every step
    assert store.gets <= 3 * 2 * len(taken[0]) + 3 * 2


def test_a_standby_that_becomes_rank_0_goes_on_from_the_published_figures():
    clock = FakeClock()
    store = DictStore()
    lead = Scheduler(Policy(auto=True, mtbf_hours=0.05, nodes=1), clock, start_step=-1)
    lead.adopt(0.1, 1.0)
    lead.resume(9)
    plan = SharedPlan(store, "j", 1, lead=True)
    plan.start(lead, 9)
    assert json.loads(store.keys[figures_key("j")]) == {"cost_s": 0.1, "quiet_step_s": 1.0}
    # generation 2: rank 0 is a fresh standby; without the figures it would snapshot its first
    # step to measure its cost, and then wait for a quiet step
    fresh = Scheduler(Policy(auto=True, mtbf_hours=0.05, nodes=1), clock, start_step=-1)
    assert fresh.next_due(10) == 10
    fresh.resume(9)
    SharedPlan(store, "j", 2, lead=True).start(fresh, 9)
    assert fresh.cost_seconds == 0.1 and fresh.quiet_step_seconds == 1.0
    point = json.loads(store.keys[plan_key("j", 2)])
    assert point["next"] == lead.next_due(10) and point["prev"] is None


def test_a_follower_before_rank_0_has_named_a_point_takes_no_snapshot():
    clock = FakeClock()
    store = DictStore()
    sched = Scheduler(Policy(every_steps=1), clock)
    follower = SharedPlan(store, "j", 3, lead=False)
    follower.start(sched, 4)  # a follower names nothing
    assert plan_key("j", 3) not in store.keys
    assert not follower.due(5, sched)
    store.set(plan_key("j", 3), json.dumps({"prev": None, "next": 6}))
    assert not follower.due(5, sched) and follower.due(6, sched)


class FailingStore(DictStore):
    def set(self, key: str, value: str) -> None:
        raise ConnectionError("store gone")

    def check(self, keys: list[str]) -> bool:
        raise ConnectionError("store gone")


def test_a_store_that_fails_names_no_point_and_never_stops_training():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=1), clock)
    store = FailingStore()
    lead, follower = SharedPlan(store, "j", 1, lead=True), SharedPlan(store, "j", 1, lead=False)
    lead.start(sched, 4)  # its write fails: logged
    assert lead.due(5, sched)  # rank 0 takes the point it named (the others missed it: no commit)
    lead.passed(5, sched)
    assert not follower.due(5, sched)
