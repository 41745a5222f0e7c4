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


def test_every_steps_counts_from_the_last_snapshot():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=3), clock)
    assert run_steps(sched, clock, range(0, 10), 1000.0) == [3, 6, 9]
    assert sched.interval_seconds() is None


def test_every_steps_never_reads_the_clock_on_a_skipped_step():
    calls = []

    def clock():
        calls.append(1)
        return 0.0

    sched = Scheduler(Policy(every_steps=5), clock)
    calls.clear()
    assert [sched.due(s) for s in range(5)] == [False] * 5
    assert calls == []


def test_every_seconds_with_fake_clock():
    clock = FakeClock()
    sched = Scheduler(Policy(every_seconds=10.0), clock)
    # 4 s per step: 10 s have passed at step 3 (t=12), then at step 6 (t=24 since 12)...
    assert run_steps(sched, clock, range(0, 10), 4.0) == [3, 6, 9]
    assert sched.interval_seconds() == 10.0


def test_both_whichever_comes_first():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=4, every_seconds=10.0), clock)
    # fast steps: the step count triggers first
    assert run_steps(sched, clock, range(0, 9), 1.0) == [4, 8]
    # slow steps (6 s; the last snapshot was step 8 at t=108): the clock triggers every 2 steps
    assert run_steps(sched, clock, range(9, 15), 6.0) == [11, 13]


def test_start_step_after_a_restore():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=10), clock, start_step=500)
    assert not sched.due(505)
    assert sched.due(510)


def test_a_failed_snapshot_stays_due():
    clock = FakeClock()
    sched = Scheduler(Policy(every_steps=2), clock)
    assert sched.due(2)
    assert sched.due(3)  # step 2's snapshot was never taken()
    sched.taken(3)
    assert not sched.due(4)


def test_auto_matches_young_daly_with_the_user_mtbf():
    clock = FakeClock()
    sched = Scheduler(Policy(auto=True, mtbf_hours=500.0, nodes=50), clock)
    assert sched.due(0), "the first step is due so its snapshot measures the cost"
    sched.taken(0, cost_seconds=3.0)
    job_mtbf = 500.0 * 3600.0 / 50
    expected = math.sqrt(2 * 3.0 * job_mtbf)
    assert sched.interval_seconds() == pytest.approx(expected, rel=1e-12)
    clock.t += expected - 1.0
    assert not sched.due(1)
    clock.t += 1.0
    assert sched.due(2)


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
    before = young_daly_interval(8.0, 3600.0)
    clock.t = 0.8 * before  # 192 s
    assert not sched.due(1)
    sched.record_failure()
    # M = (3600 + 192) / 2 = 1896 s, interval = sqrt(2 * 8 * 1896) = 174 s: already past
    assert sched.interval_seconds() < before
    assert sched.due(2)


def test_auto_with_every_steps_as_a_cap():
    clock = FakeClock()
    sched = Scheduler(Policy(auto=True, every_steps=3, mtbf_hours=1e6, initial_cost_seconds=1.0), clock)
    assert run_steps(sched, clock, range(0, 7), 0.001) == [3, 6]


@pytest.mark.parametrize("kwargs, names", [
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
])
def test_policy_validation_names_the_bad_value(kwargs, names):
    with pytest.raises(ConfigError, match=names.replace("(", r"\(").replace(".", r"\.")):
        Policy(**kwargs)


def test_policy_is_frozen():
    p = Policy(every_steps=1)
    with pytest.raises(AttributeError):
        p.every_steps = 2  # type: ignore[misc]


def test_bad_cost_and_bad_policy_are_rejected():
    sched = Scheduler(Policy(auto=True), FakeClock())
    with pytest.raises(ConfigError, match="-1"):
        sched.record_cost(-1.0)
    with pytest.raises(ConfigError, match="policy="):
        Scheduler({"every_steps": 1})  # type: ignore[arg-type]


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
    assert newest == 2
    # from here on every snapshot fails: nothing is taken, nothing committed
    for step in range(4, 8):
        assert sched.due(step)
        guard.check(step, newest)
    with pytest.raises(StalenessError) as info:
        guard.check(8, newest)
    msg = str(info.value)
    assert "step 8" in msg and "step 2" in msg and "max_steps_behind=5" in msg


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
    clock.t += 10.0
    info = sched.describe()
    interval = math.sqrt(2 * 2.0 * (3600.0 + 10.0))
    assert info["tier"] == "spill" and info["cost_s"] == 2.0 and info["failures"] == 0
    assert info["next_step"] == 107
    assert info["interval_s"] == pytest.approx(interval)
    # the next time was set at the snapshot, from the MTBF estimate of that moment
    assert info["next_in_s"] == pytest.approx(math.sqrt(2 * 2.0 * 3600.0) - 10.0)


def test_a_bad_failure_time_is_rejected_and_not_counted():
    sched = Scheduler(Policy(auto=True, mtbf_hours=1.0), FakeClock())
    with pytest.raises(ConfigError, match="at=-3"):
        sched.record_failure(at=-3.0, key="node-a")
    assert sched.failures == 0
    assert sched.record_failure(key="node-a") is True
