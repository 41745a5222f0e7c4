"""memsnap.goodput_model: the formulas on cases small enough to check by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest

from memsnap import goodput_model as gm
from memsnap.errors import ConfigError


def test_young_daly_and_periodic_goodput_by_hand():
    assert gm.young_daly(2.0, 100.0) == pytest.approx(20.0)
    # no stall: 1 - (recovery 50 + half a period 50) / MTBF 1000
    assert gm.periodic_goodput(100.0, 0.0, 1000.0, 50.0) == pytest.approx(0.9)
    # a 10 s stall every 90 s: 90/100 of the time trains, and a failure costs half of 100 s
    assert gm.periodic_goodput(90.0, 10.0, 1000.0, 0.0) == pytest.approx(0.9 * 0.95)
    assert gm.periodic_goodput(90.0, 10.0, 1000.0, 0.0, lag_s=50.0) == pytest.approx(0.9 * 0.9)
    # failures costing more than the MTBF leave nothing, never a negative goodput
    assert gm.periodic_goodput(100.0, 0.0, 10.0, 50.0) == 0.0


def test_lost_steps_and_a_finite_run():
    assert gm.lost_steps_per_failure(10, 0.0, 1.0) == pytest.approx(4.5)
    assert gm.lost_steps_per_failure(1, 0.5, 2.0) == pytest.approx(0.25)
    # 3 failures in 60 s, each 2 + 5 + 1 s of recovery and (0.5 lost + 0.5 in progress) x 1 s of work
    costs = dict(horizon_s=60.0, step_s=1.0, every_steps=1, lag_s=0.5, detect_s=2.0, restart_s=5.0, restore_s=1.0)
    assert gm.run_goodput(fault_times_s=[5.0, 20.0, 40.0], **costs) == pytest.approx(1 - 3 * 9 / 60)
    # a failure 4 s before the end can only cost those 4 s
    assert gm.run_goodput(fault_times_s=[5.0, 20.0, 56.0], **costs) == pytest.approx(1 - (9 + 9 + 4) / 60)
    assert gm.run_goodput(fault_times_s=[], **dict(costs, every_steps=10)) == 1.0
    # every 10 steps, synchronous: 4.5 steps lost on average + half a step in progress
    assert gm.run_goodput(fault_times_s=[10.0], **dict(costs, every_steps=10, lag_s=0.0)) == pytest.approx(
        1 - (8 + 5) / 60
    )


def test_a_replayed_failure_loses_what_it_loses_where_it_falls():
    # 1 s steps, a snapshot after every 10th counted 0.5 s later, 3 s to recover, 60 s in all
    costs = dict(horizon_s=60.0, step_s=1.0, every_steps=10, lag_s=0.5, detect_s=1.0, restart_s=1.5, restore_s=0.5)
    assert gm.replay_goodput(fault_times_s=[], **costs) == 1.0
    # at 10.6 s step 10's snapshot counts (10.5 s): back from step 10 at 13.6 s, 46 more steps
    assert gm.replay_goodput(fault_times_s=[10.6], **costs) * 60 == pytest.approx(10 + 46)
    # at 10.4 s it does not yet: back from step 0 at 13.4 s
    assert gm.replay_goodput(fault_times_s=[10.4], **costs) * 60 == pytest.approx(46)
    # replicas in place: back from the step the failure cut, whatever the snapshots
    assert gm.replay_goodput(fault_times_s=[10.4], **costs, live=True) * 60 == pytest.approx(10 + 46)
    # a failure during the recovery of the one before lands once the job trains again (13.4 s)
    assert gm.replay_goodput(fault_times_s=[10.4, 11.0], **costs) * 60 == pytest.approx(43)
    # a failure after the end costs nothing
    assert gm.replay_goodput(fault_times_s=[60.0], **costs) == 1.0
    # the 10th step stalls 2 s of its 10 s: the 9 before it take 0.8 s each, so a live
    # recovery at 8.5 s goes on from step 9, not 8 (back at 11.5 s: 48 steps more either way)
    assert gm.replay_goodput(fault_times_s=[8.5], **costs, live=True) * 60 == pytest.approx(8 + 48)
    assert gm.replay_goodput(fault_times_s=[8.5], **costs, live=True, stall_s=2.0) * 60 == pytest.approx(9 + 48)
    with pytest.raises(ConfigError, match=r"every_steps=0 is not a positive integer; give the steps between snapshots"):
        gm.replay_goodput(fault_times_s=[1.0], **dict(costs, every_steps=0))


def test_replayed_failures_spread_over_a_period_average_the_models_mean_loss():
    """``run_goodput`` charges the mean of what ``replay_goodput`` plays out: over kill times
    spread evenly across an interval, the replayed loss averages (N-1)/2 steps + lag/step +
    half a step in progress."""
    costs = dict(horizon_s=1000.0, step_s=1.0, lag_s=2.5, detect_s=4.0, restart_s=6.0, restore_s=1.0)
    for every in (1, 4, 16):
        kills = [200.0 + i * every / 400 for i in range(400)]  # one kill per run, across one interval
        replayed = sum(gm.replay_goodput(fault_times_s=[t], every_steps=every, **costs) for t in kills) / len(kills)
        mean = gm.run_goodput(fault_times_s=[200.0], every_steps=every, **costs)
        assert replayed == pytest.approx(mean, abs=0.6 / 1000)  # within 0.6 of a step in 1000


def small_cluster(**kw) -> gm.Cluster:
    """4 nodes of 8 GPUs, 1 GiB per GPU (8 GiB per node), job MTBF 400 s, 1 s steps."""
    base: dict[str, Any] = dict(
        gpus=32,
        gpus_per_node=8,
        state_gib_per_gpu=1.0,
        node_mtbf_h=400 * 4 / 3600,
        storage_gibps=4.0,
        node_storage_gibps=2.0,
        nic_gibps=10.0,
        agent_cores=4.0,
        host_ram_gib=100.0,
        step_s=1.0,
        spill_every_s=100.0,
    )
    base.update(kw)
    return gm.Cluster(**base)


MEASURED = gm.Measured(
    stall_s_per_gib=0.25,
    agent_cpu_s_per_gib=1.0,
    peer_restore_gibps=2.0,
    storage_restore_gibps=2.0,
    detect_s=1.0,
    restart_s=1.0,
)


def test_cluster_sizes_and_the_llama3_rate():
    c = small_cluster()
    assert (c.nodes, c.state_gib_per_node, c.mtbf_s) == (4, 8.0, pytest.approx(400.0))
    # 419 interruptions in 54 days on 2,048 nodes: the job MTBF at 16,384 GPUs is 54 d / 419
    big = gm.Cluster(gpus=16384)
    assert big.mtbf_s == pytest.approx(54 * 86400 / 419)


def test_disk_sync_by_hand():
    p = gm.disk(small_cluster(), MEASURED)
    # all 4 nodes write 8 GiB through 4 GiB/s of shared storage: 8 s (the 2 GiB/s links allow 4 s)
    assert p.stall_s == pytest.approx(8.0)
    assert p.period_s == pytest.approx(80.0)  # sqrt(2 * 8 * 400)
    assert p.recovery_s == pytest.approx(1 + 1 + 8)  # every node reads back through the same storage
    assert p.goodput == pytest.approx(80 / 88 * (1 - (10 + 44) / 400))
    assert p.use["storage bandwidth"] == pytest.approx(8 / 88)
    assert p.binding == ("storage bandwidth", pytest.approx(8 / 88))


def test_memsnap_by_hand():
    p = gm.memsnap(small_cluster(), MEASURED)
    assert p.stall_s == pytest.approx(0.25)  # 0.25 s/GiB x 1 GiB per GPU
    assert p.lag_s == pytest.approx(2.0)  # agent CPU 1 core-s/GiB x 8 GiB over 4 cores; NIC 8*1.5/10 = 1.2 s
    assert p.period_s == pytest.approx(15.0)  # sqrt(2 * 0.25 * 400) = 14.1 s, in whole 1 s steps
    assert p.recovery_s == pytest.approx(1 + 1 + 8 / 2)  # the lost node's 8 GiB from peers at 2 GiB/s
    assert p.goodput == pytest.approx(15 / 15.25 * (1 - (6 + 7.625 + 2) / 400))
    assert p.use["agent CPU"] == pytest.approx(2 / 15)
    assert p.use["NIC"] == pytest.approx(1.2 / 15)
    # keep+1 slots of 8 GiB, and the pieces held for peers (8 x 1.5) for 2 committed versions + 2 in flight
    assert p.use["host RAM"] == pytest.approx(8 * (3 + 4 * 1.5) / 100)
    assert p.use["storage (spill)"] == pytest.approx(32 / 100 / 4)
    assert p.binding[0] == "host RAM"


def test_memsnap_in_place_by_hand():
    x = gm.Measured(
        **{
            **vars(MEASURED),
            "inplace_detect_s": 0.5,
            "reform_s": 0.1,
            "local_restore_gibps": 4.0,
            "standby_warm_s": 40.0,
        }
    )
    c = small_cluster()
    recovery, fast, p = gm.inplace_recovery(c, x)
    # no restart: memsnap's own verdict, the new group, and the slower of the two restores (the
    # standby's 8 GiB from peers at 2 GiB/s; the survivors' from their own RAM at 4 GiB/s)
    assert fast == pytest.approx(0.5 + 0.1 + 4.0)
    # one spare: a second failure within the 40 s the next standby takes finds none (job MTBF 400 s)
    assert p == pytest.approx(1 - math.exp(-40 / 400))
    assert recovery == pytest.approx((1 - p) * fast + p * (1 + 1 + 4))
    inplace, restart = gm.memsnap_inplace(c, x), gm.memsnap(c, x)
    assert (inplace.period_s, inplace.stall_s, inplace.lag_s) == (restart.period_s, restart.stall_s, restart.lag_s)
    assert inplace.goodput == pytest.approx(15 / 15.25 * (1 - (recovery + 7.625 + 2) / 400))
    assert inplace.goodput > restart.goodput
    # two spares: both must be used up in a row; none: every failure restarts the job
    assert gm.inplace_recovery(small_cluster(spares=2), x)[2] == pytest.approx(p * p)
    assert gm.inplace_recovery(small_cluster(spares=0), x)[0] == pytest.approx(restart.recovery_s)


def test_replicas_in_place_lose_only_the_step_in_flight_by_hand():
    x = gm.Measured(
        **{**vars(MEASURED), "inplace_detect_s": 0.5, "reform_s": 0.1, "live_move_gibps": 2.0, "standby_warm_s": 40.0}
    )
    c = small_cluster()
    recovery, fast, p = gm.live_recovery(c, x)
    # memsnap's own verdict, the new group, and the lost node's 8 GiB sent by the survivors at 2 GiB/s
    assert fast == pytest.approx(0.5 + 0.1 + 4.0)
    assert p == pytest.approx(1 - math.exp(-40 / 400))
    assert recovery == pytest.approx((1 - p) * fast + p * (1 + 1 + 4))
    live, rollback = gm.memsnap_live(c, x), gm.memsnap_inplace(c, x)
    assert (live.period_s, live.stall_s) == (rollback.period_s, rollback.stall_s)
    # a failure loses half of a 1 s step, or (no standby left) half a period plus the lag
    lost = (1 - p) * 0.5 + p * (7.625 + 2)
    assert live.goodput == pytest.approx(15 / 15.25 * (1 - (recovery + lost) / 400))
    assert live.goodput > rollback.goodput
    # a finite run: no steps lost but the one in flight
    kw = dict(fault_times_s=[10.0], horizon_s=100.0, step_s=1.0, every_steps=4, lag_s=2.0)
    kw.update(detect_s=1.0, restart_s=0.0, restore_s=0.5)
    assert gm.run_goodput(**kw, live=True) == pytest.approx(1 - 2.0 / 100)
    assert gm.run_goodput(**kw) == pytest.approx(1 - (1.5 + (1.5 + 2.0 + 0.5)) / 100)


def test_a_pipeline_that_cannot_keep_up_sets_the_period():
    slow = gm.memsnap(small_cluster(agent_cores=0.1), MEASURED)  # 80 core-s per snapshot on 0.1 core
    assert slow.period_s == pytest.approx(80.0)
    assert slow.binding == ("agent CPU", pytest.approx(1.0))
    # async disk: the stall is the capture, but the next save waits for the 8 s write
    a = gm.disk(small_cluster(node_mtbf_h=1.0 * 4 / 3600), MEASURED, asynchronous=True)
    assert a.stall_s == pytest.approx(0.25)
    assert a.period_s == pytest.approx(8.0) and a.lag_s == pytest.approx(8.0)
    assert a.use["storage bandwidth"] == pytest.approx(8 / 8.25)


def test_more_gpus_shrink_the_mtbf_and_slow_shared_storage():
    m = gm.Measured()
    rows = [gm.project(gm.Cluster(gpus=g), m) for g in (1024, 4096, 16384)]
    disk = [r[3] for r in rows]
    assert disk[0].stall_s < disk[1].stall_s < disk[2].stall_s  # the same storage for more nodes
    assert disk[0].goodput > disk[1].goodput > disk[2].goodput
    mem = [r[2] for r in rows]
    assert mem[0].stall_s == mem[2].stall_s  # each node captures its own state
    assert all(r[2].goodput > r[3].goodput for r in rows)
    assert [p.system for p in rows[0]] == [
        "memsnap in place, replicas",
        "memsnap in place",
        "memsnap",
        "disk (sync)",
        "disk (async)",
    ]
    assert all(r[0].goodput >= r[1].goodput >= r[2].goodput for r in rows)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: gm.Cluster(gpus=12, gpus_per_node=8), "gpus=12 is not a multiple of gpus_per_node=8"),
        (lambda: gm.Cluster(gpus=16, gpus_per_node=8), "2 nodes, too few for k=2 m=1"),
        (lambda: gm.Cluster(gpus=1024, storage_gibps=0), "storage_gibps=0"),
        (lambda: gm.Cluster(gpus=1024, step_s=math.nan), "step_s=nan"),
        (lambda: gm.Measured(detect_s=-1), "detect_s=-1"),
        (lambda: gm.Measured(restart_s=True), "restart_s=True"),
    ],
)
def test_bad_inputs_name_the_field(make, needle):
    with pytest.raises(ConfigError, match=needle):
        make()
