"""Snapshot policy: every-N / every-T / both / auto (Young/Daly), validation, staleness."""

from __future__ import annotations

import math

import pytest

from memsnap.errors import ConfigError, StalenessError
from memsnap.policy import Policy, Scheduler, StalenessGuard, young_daly_interval


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def run_steps(sched: Scheduler, clock: FakeClock, steps: range, seconds_per_step: float) -> list[int]:
    """Drive the scheduler like a training loop; return the steps that were snapshotted."""
    taken = []
    for step in steps:
        if sched.due(step):
            sched.taken(step)
            taken.append(step)
        clock.t += seconds_per_step
    return taken


def test_every_steps_takes_the_multiples_of_n_after_the_start():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=3), clock)
    # after step 2 three steps are done, after step 5 six, ...
    assert run_steps(sched, clock, range(0, 10), 1000.0) == [2, 5, 8]
    assert sched.interval_seconds() is None and sched.grid_steps == 3


def test_every_steps_never_reads_the_clock_on_a_skipped_step():
    calls = []

    def clock():
        calls.append(1)
        return 0.0

    sched = Scheduler(Policy(every_steps=5), clock)
    calls.clear()
    assert [sched.due(s) for s in range(4)] == [False] * 4
    assert calls == []


def test_every_seconds_is_a_power_of_two_grid_of_steps_at_the_measured_step_time():
    clock = FakeClock()
    sched = Scheduler(Policy(every_seconds=10.0), clock)
    # 4 s per step: 2.5 steps fit in 10 s, so every 2nd step (8 s), once a step time is known
    assert run_steps(sched, clock, range(0, 10), 4.0) == [1, 3, 5, 7, 9]
    assert sched.interval_seconds() == 10.0 and sched.step_seconds == pytest.approx(4.0)
    # 0.7 s per step: 14.3 steps fit, so every 8th
    sched = Scheduler(Policy(every_seconds=10.0), clock)
    assert run_steps(sched, clock, range(0, 40), 0.7) == [7, 15, 23, 31, 39]


def test_both_whichever_comes_first():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=4, every_seconds=10.0), clock)
    # fast steps (1 s): 4 steps come before 10 s, so every_steps sets the grid
    assert run_steps(sched, clock, range(0, 9), 1.0) == [3, 7]
    # slow steps (12 s): less than one step fits in 10 s, so every step
    assert run_steps(sched, clock, range(9, 20), 12.0)[-4:] == [16, 17, 18, 19]
    assert sched.grid_steps == 1


def test_start_step_after_a_restore():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=10), clock, start_step=500)
    assert not sched.due(505)
    assert sched.due(509)  # 510 steps done


def test_a_failed_snapshot_waits_for_the_next_step_every_rank_takes():
    """A rank whose snapshot failed must not take the next step alone (the others would not,
    and a step commits only once every rank took it): it rejoins them at the next grid point."""
    clock = FakeClock()
    failed, ok = Scheduler(Policy(every_steps=2), clock), Scheduler(Policy(every_steps=2), clock)
    assert failed.due(1) and ok.due(1)
    ok.taken(1)  # the failed rank's snapshot of step 1 was never taken()
    assert (
        [s for s in range(2, 9) if failed.due(s) and (failed.taken(s) or True)]
        == [s for s in range(2, 9) if ok.due(s) and (ok.taken(s) or True)]
        == [3, 5, 7]
    )


def test_ranks_that_measure_different_step_times_and_costs_still_take_common_steps() -> None:
    """Two ranks of one job, 10% apart in step time and 30% in snapshot cost, straddling a power
    of two: the coarser grid is part of the finer one, so the job commits at least every 2G."""
    clocks = [FakeClock(), FakeClock()]
    ranks = [Scheduler(Policy(auto=True, mtbf_hours=1.0), c) for c in clocks]
    taken: list[set[int]] = [set(), set()]
    for step in range(0, 400):
        for i, (sched, clock) in enumerate(zip(ranks, clocks)):
            if sched.due(step):
                sched.taken(step, cost_seconds=(0.5, 0.65)[i])
                taken[i].add(step)
            clock.t += (1.0, 1.1)[i]
    grids = sorted(r.grid_steps or 0 for r in ranks)
    assert grids[0] != grids[1] and grids[1] == 2 * grids[0], grids  # they straddle a power of two
    common = sorted(taken[0] & taken[1])
    assert common[0] == 0  # the measuring snapshot: the first step is protected at once
    gaps = [b - a for a, b in zip(common[1:], common[2:])]
    assert len(common) > 5 and max(gaps) <= grids[1], (grids, common)  # never more than 2G apart


def test_auto_matches_young_daly_with_the_user_mtbf():
    clock = FakeClock()
    sched = Scheduler(Policy(auto=True, mtbf_hours=500.0, nodes=50), clock, start_step=-1)
    # the first step is snapshotted at once: it protects the start, and its stall is a first cost
    assert sched.due(0)
    sched.taken(0, cost_seconds=3.0)
    job_mtbf = 500.0 * 3600.0 / 50  # the prior (no time watched yet)
    assert sched.interval_seconds() == pytest.approx(math.sqrt(2 * 3.0 * job_mtbf), rel=1e-12)  # 465 s
    # 10 s steps: 46 fit in the interval, so every 32nd step (a quiet step is measured long before)
    clock.t += 10.0
    taken = run_steps(sched, clock, range(1, 200), 10.0)
    assert taken == [31, 63, 95, 127, 159, 191] and sched.grid_steps == 32
    assert sched.quiet_step_seconds == pytest.approx(10.0)
    expected = math.sqrt(2 * 3.0 * (job_mtbf + clock.t - 100.0))
    assert sched.interval_seconds() == pytest.approx(expected, rel=1e-12)


def test_after_its_first_snapshot_auto_waits_for_a_quiet_step_before_the_next():
    """With a short interval (a grid of one step), the second snapshot still waits until a step
    two after the first has been timed: otherwise no step would ever be quiet, and the cost
    would stay the stall alone."""
    clock = FakeClock()
    sched = Scheduler(Policy(auto=True, mtbf_hours=0.01, nodes=1), clock, start_step=-1)
    taken = []
    for step in range(8):
        if sched.due(step):
            sched.taken(step, cost_seconds=0.01)
            taken.append(step)
        clock.t += 1.0
    # step 2 -> 3 is the first quiet interval (0 -> 1 is a warm-up, 1 -> 2 follows the snapshot)
    assert taken[:2] == [0, 3] and sched.grid_steps == 1, (taken, sched.describe())
    assert taken == [0, *range(3, 8)] and sched.quiet_step_seconds == pytest.approx(1.0)


def test_auto_sets_its_interval_against_the_failures_that_roll_back():
    """Every recovery is a failure of the job (``n``), but one that went on from live state
    (replicas, in place) loses no work a snapshot saves: with p = (rolled back + 1) / (n + 1),
    the interval is Young/Daly of M / p = (M0 + T) / (rolled back + 1)."""
    clock = FakeClock()
    sched = Scheduler(Policy(auto=True, mtbf_hours=500.0, nodes=50, initial_cost_seconds=3.0), clock)

    def with_rollbacks(r: int) -> float:  # Young/Daly after r failures that rolled back
        return young_daly_interval(3.0, (500.0 * 3600.0 / 50 + watched()) / (r + 1))

    def watched() -> float:
        return clock.t - 100.0

    assert sched.rollback_share == 1.0  # before any recovery every failure is taken to roll back
    assert sched.interval_seconds() == pytest.approx(with_rollbacks(0), rel=1e-12)
    assert run_steps(sched, clock, range(1, 100), 10.0)[:2] == [31, 63] and sched.grid_steps == 32
    sched.set_recoveries(3, 0)  # three recoveries, each from live state: p = 1/4
    assert sched.rollback_share == 0.25 and sched.describe()["rollback_share"] == 0.25
    assert sched.failures == 3 and sched.mtbf_seconds() == pytest.approx((36000.0 + watched()) / 4)
    assert sched.interval_seconds() == pytest.approx(with_rollbacks(0), rel=1e-12)  # as if none failed
    assert sched.grid_steps == 32  # 47 steps of 10 s fit: every 32nd
    sched.set_recoveries(4, 4)  # then every one rolled back: p = 1
    assert sched.interval_seconds() == pytest.approx(with_rollbacks(4), rel=1e-12)
    assert sched.grid_steps == 16  # 21 steps fit
    with pytest.raises(ConfigError, match="rolled_back=5"):
        sched.set_recoveries(4, 5)


def test_auto_cost_counts_the_steps_a_snapshot_slows_not_only_its_stall():
    """A snapshot whose background work shares the rank's cores slows the steps after it: its
    cost is the period's wall time less as many quiet steps, so the interval grows with it."""
    clock = FakeClock()
    sched = Scheduler(Policy(auto=True, mtbf_hours=1.0, cost_smoothing=1.0), clock, start_step=-1)
    stall_only = Scheduler(Policy(auto=True, mtbf_hours=1.0, cost_smoothing=1.0), FakeClock(), start_step=-1)
    last = None
    for step in range(0, 200):
        if sched.due(step):
            clock.t += 0.1  # the stall
            sched.taken(step, cost_seconds=0.1)
            stall_only.taken(step, cost_seconds=0.1)
            last = step
        busy = last is not None and step - last < 2  # the two steps after a snapshot: 0.6 s slower
        clock.t += 1.0 + (0.6 if busy else 0.0)
    # each snapshot costs 0.1 + 2 * 0.6 = 1.3 s, whatever the grid
    assert sched.quiet_step_seconds == pytest.approx(1.0)
    assert sched.grid_steps >= 2 and sched.cost_seconds == pytest.approx(1.3), sched.describe()
    assert stall_only.cost_seconds == pytest.approx(0.1)
    assert sched.interval_seconds() > 3 * stall_only.interval_seconds()


def test_a_recovery_counts_as_a_failure_and_every_rank_agrees_on_the_job_age():
    """A standby that took over late, told the job's recoveries and age, estimates the same
    MTBF (and so the same interval) as a rank that ran from the start."""
    clock = FakeClock(t=0.0)
    survivor = Scheduler(Policy(auto=True, mtbf_hours=1.0, initial_cost_seconds=1.0), clock)
    clock.t = 900.0
    standby = Scheduler(Policy(auto=True, mtbf_hours=1.0, initial_cost_seconds=1.0), clock)
    clock.t = 1200.0
    for sched in (survivor, standby):
        sched.set_recoveries(2, 2, age_s=1200.0)
    assert survivor.failures == standby.failures == 2
    assert survivor.mtbf_seconds() == standby.mtbf_seconds() == pytest.approx((3600.0 + 1200.0) / 3)
    with pytest.raises(ConfigError, match="age_s=-1"):
        standby.set_recoveries(2, 2, age_s=-1.0)


def test_auto_cost_is_exponentially_weighted():
    clock = FakeClock()
    policy = Policy(auto=True, mtbf_hours=100.0, cost_smoothing=0.5, initial_cost_seconds=4.0)
    sched = Scheduler(policy, clock)
    assert not sched.due(0), "a known initial cost means no measuring snapshot is needed"
    for c in (2.0, 10.0):
        sched.record_cost(c)
    expected_cost = 0.5 * 10.0 + 0.5 * (0.5 * 2.0 + 0.5 * 4.0)
    assert sched.cost_seconds == pytest.approx(expected_cost)
    assert sched.interval_seconds() == pytest.approx(math.sqrt(2 * expected_cost * 100 * 3600))


def test_auto_mtbf_learns_from_observed_failures():
    clock = FakeClock(t=0.0)
    prior = 10.0 * 3600.0  # one node, 10 h
    sched = Scheduler(Policy(auto=True, mtbf_hours=10.0, initial_cost_seconds=1.0), clock)
    clock.t = 7200.0
    sched.record_failure()
    clock.t = 9000.0
    sched.record_failure(at=8000.0)
    watched = 9000.0
    mtbf = (prior + watched) / 3
    assert sched.mtbf_seconds() == pytest.approx(mtbf)
    assert sched.failures == 2
    assert sched.interval_seconds() == pytest.approx(math.sqrt(2 * 1.0 * mtbf))


def test_auto_without_prior_uses_observed_time():
    clock = FakeClock(t=0.0)
    sched = Scheduler(Policy(auto=True, initial_cost_seconds=2.0), clock)
    clock.t = 1800.0
    assert sched.mtbf_seconds() == pytest.approx(1800.0)
    for at in (600.0, 1200.0, 1800.0):
        sched.record_failure(at=at)
    assert sched.interval_seconds() == pytest.approx(math.sqrt(2 * 2.0 * 600.0))


def test_auto_interval_shrinks_when_a_failure_arrives_between_snapshots():
    clock = FakeClock(t=0.0)
    sched = Scheduler(Policy(auto=True, mtbf_hours=1.0, initial_cost_seconds=8.0), clock)
    before = young_daly_interval(8.0, 3600.0)  # 240 s
    assert run_steps(sched, clock, range(0, 20), 10.0) == [15]  # 24 steps fit: every 16th
    sched.record_failure()
    # M = (3600 + 200) / 2 = 1900 s, interval = sqrt(2 * 8 * 1900) = 174 s: 17 steps, still 16
    assert sched.interval_seconds() < before and sched.grid_steps == 16
    for _ in range(3):
        sched.record_failure()  # M = (3600 + 200) / 5 = 760 s: 110 s, 11 steps fit: every 8th
    assert run_steps(sched, clock, range(20, 40), 10.0) == [23, 31, 39]


def test_auto_with_every_steps_as_a_cap():
    clock = FakeClock()
    sched = Scheduler(Policy(auto=True, every_steps=3, mtbf_hours=1e6, initial_cost_seconds=1.0), clock)
    assert run_steps(sched, clock, range(0, 7), 0.001) == [2, 5]


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({}, "every_steps"),
        ({"every_steps": 0}, "every_steps=0"),
        ({"every_steps": 2.5}, "every_steps=2.5"),
        ({"every_steps": True}, "every_steps=True"),
        ({"every_seconds": -1.0}, "every_seconds=-1.0"),
        ({"every_seconds": float("nan")}, "every_seconds=nan"),
        ({"auto": True, "every_seconds": 5.0}, "every_seconds=5.0"),
        ({"auto": "yes"}, "auto='yes'"),
        ({"auto": True, "mtbf_hours": 0}, "mtbf_hours=0"),
        ({"auto": True, "nodes": 0}, "nodes=0"),
        ({"auto": True, "cost_smoothing": 0.0}, "cost_smoothing=0.0"),
        ({"auto": True, "initial_cost_seconds": -2}, "initial_cost_seconds=-2"),
        ({"every_steps": 1, "tier": "disk"}, "tier='disk'"),
    ],
)
def test_policy_validation_names_the_bad_value(kwargs, names):
    with pytest.raises(ConfigError, match=names.replace("(", r"\(").replace(".", r"\.")):
        Policy(**kwargs)


def test_policy_is_frozen():
    p = Policy(every_steps=1)
    with pytest.raises(AttributeError):
        p.every_steps = 2


def test_bad_cost_and_bad_policy_are_rejected():
    sched = Scheduler(Policy(auto=True), FakeClock())
    with pytest.raises(ConfigError, match="-1"):
        sched.record_cost(-1.0)
    with pytest.raises(ConfigError, match="policy="):
        Scheduler({"every_steps": 1})


def test_ram_and_spill_tiers_keep_separate_intervals():
    clock = FakeClock()
    ram = Scheduler(Policy(auto=True, mtbf_hours=1000, nodes=128, tier="ram"), clock)
    spill = Scheduler(Policy(auto=True, mtbf_hours=1e5, nodes=128, tier="spill"), clock)
    ram.taken(0, cost_seconds=0.5)
    spill.taken(0, cost_seconds=60.0)
    assert ram.interval_seconds() == pytest.approx(math.sqrt(2 * 0.5 * 1000 * 3600 / 128))
    assert spill.interval_seconds() == pytest.approx(math.sqrt(2 * 60.0 * 1e5 * 3600 / 128))


def test_staleness_guard_raises_when_snapshots_keep_failing():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=2), clock)
    guard = StalenessGuard(max_steps_behind=5)
    newest = None
    for step in range(0, 4):
        if sched.due(step):
            sched.taken(step)
            newest = step
        guard.check(step, newest)
    assert newest == 3
    # from here on every snapshot fails: nothing is taken, nothing committed
    for step in range(4, 9):
        assert sched.due(step) == (step % 2 == 1)
        guard.check(step, newest)
    with pytest.raises(StalenessError) as info:
        guard.check(9, newest)
    msg = str(info.value)
    assert "step 9" in msg and "step 3" in msg and "max_steps_behind=5" in msg


def test_staleness_guard_with_nothing_committed():
    guard = StalenessGuard(3, start_step=10)
    guard.check(13, None)
    with pytest.raises(StalenessError, match="since step 10"):
        guard.check(14, None)
    with pytest.raises(ConfigError, match="max_steps_behind=0"):
        StalenessGuard(0)


def test_the_same_failure_reported_twice_counts_once():
    clock = FakeClock(t=0.0)
    sched = Scheduler(Policy(auto=True, mtbf_hours=2.0, initial_cost_seconds=1.0), clock)
    clock.t = 600.0
    assert sched.record_failure(key="node-a") is True
    assert sched.record_failure(key="node-a") is False
    assert sched.record_failure(key="node-b") is True
    assert sched.failures == 2
    assert sched.mtbf_seconds() == pytest.approx((7200.0 + 600.0) / 3)


def test_describe_reports_the_numbers_in_use():
    clock = FakeClock(t=50.0)
    sched = Scheduler(Policy(auto=True, every_steps=100, mtbf_hours=1.0, tier="spill"), clock)
    sched.taken(7, cost_seconds=2.0)
    assert sched.describe()["grid_steps"] == 100 and sched.describe()["next_step"] == 99  # no step time yet
    sched.due(8)
    clock.t += 10.0
    sched.due(9)  # 10 s per step
    info = sched.describe()
    interval = math.sqrt(2 * 2.0 * (3600.0 + 10.0))  # 120 s: 12 steps fit, every 8th
    assert info["tier"] == "spill" and info["cost_s"] == 2.0 and info["failures"] == 0
    assert info["interval_s"] == pytest.approx(interval) and info["step_s"] == pytest.approx(10.0)
    assert info["grid_steps"] == 8 and info["next_step"] == 15


def test_a_bad_failure_time_is_rejected_and_not_counted():
    sched = Scheduler(Policy(auto=True, mtbf_hours=1.0), FakeClock())
    with pytest.raises(ConfigError, match="at=-3"):
        sched.record_failure(at=-3.0, key="node-a")
    assert sched.failures == 0
    assert sched.record_failure(key="node-a") is True
