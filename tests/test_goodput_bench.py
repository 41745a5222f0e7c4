"""bench/goodput_timeline.py: the fault schedule and the timeline analysis of the goodput
benchmark, on made-up events (no Ray)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from goodput_timeline import NODES, RunResult, analyse, poisson_schedule  # noqa: E402


def test_the_schedule_is_seeded_and_inside_the_horizon():
    a = poisson_schedule(50.0, 120.0, 21)
    assert a == poisson_schedule(50.0, 120.0, 21)
    assert a != poisson_schedule(50.0, 120.0, 22)
    times = [f["at_s"] for f in a]
    assert times == sorted(times) and all(0 < t < 120 for t in times)
    assert all(0 <= f["victim"] < NODES - 1 for f in a)  # never the head node
    # the bench's default seed: 3 faults at least 25 s apart, the last before the final 30 s
    assert len(times) == 3 and min(b - a for a, b in zip(times, times[1:])) > 25 and times[-1] < 90
    long = poisson_schedule(10.0, 100_000.0, 1)
    assert len(long) == pytest.approx(10_000, rel=0.05)  # a Poisson process of rate 1/MTBF


def _events(t0: float) -> tuple[list[dict], list[dict]]:
    """Steps 0-9 at t0+1..t0+10, a checkpoint after step 4; the node dies at t0+10.5, Ray notices
    3 s later; the ranks are up again at t0+20.5, restored step 4 at t0+22.5, step 5 ends at t0+23.5."""
    ev = [{"ev": "built", "rank": r, "t": t0 - 2} for r in range(NODES)]
    ev += [{"ev": "restored", "rank": r, "step": None, "wall": 0.1, "t": t0 - 1} for r in range(NODES)]
    for s in range(10):
        ev.append({"ev": "step", "step": s, "attempt": 0, "t": t0 + 1 + s})
        if s == 4:
            ev += [
                {"ev": "save", "rank": r, "step": s, "stall": 0.5 + r, "bytes": 0, "t": t0 + 5.1} for r in range(NODES)
            ]
    ev += [{"ev": "built", "rank": r, "t": t0 + 20.0 + r / 6} for r in range(NODES)]
    ev += [{"ev": "restored", "rank": r, "step": 4, "wall": 1.5 + r / 10, "t": t0 + 22.0 + r / 6} for r in range(NODES)]
    for i, s in enumerate(range(5, 20)):
        ev.append({"ev": "step", "step": s, "attempt": 1, "t": t0 + 23.5 + i})
        if s == 9:
            ev += [
                {"ev": "save", "rank": r, "step": s, "stall": 0.25, "bytes": 0, "t": t0 + 28.1} for r in range(NODES)
            ]
    faults = [{"at_s": 10.0, "t_kill": t0 + 10.5, "t_dead": t0 + 13.5, "killed": 2, "replacement": 4}]
    return ev, faults


def test_one_failure_is_split_into_detect_restart_restore():
    t0 = 1000.0
    ev, faults = _events(t0)
    a = analyse(
        RunResult(
            {"system": "torch.save", "interval": "5", "faults": True, "label": ""},
            t0,
            35.0,
            ev,
            faults,
            7 << 20,
            256 << 20,
        )
    )
    (f,) = a["failures"]
    assert f["lost_steps"] == 5  # 10 steps done when the node died, resumed at step 5
    assert f["detect"] == pytest.approx(3.0)
    assert f["restart"] == pytest.approx(20.5 - 13.5)  # until the last rank is up
    assert f["restore"] == pytest.approx(22.5 - 20.5)  # until the last rank restored
    assert f["rto"] == pytest.approx(23.5 - 10.5)
    assert f["first_step"] == pytest.approx(1.0)
    assert f["restore_wall"] == pytest.approx(1.8)
    assert f["restored_step"] == 4 and "committed_at_kill" not in f  # (asked of memsnap only)
    # progress at the horizon (t0+35): step 16 ended at t0+34.5, so 17 useful steps
    assert a["useful_steps"] == 17 and a["rate"] == pytest.approx(17 / 35.0)
    assert a["stall_first"] == pytest.approx(2.0) and a["stall_steady"] == pytest.approx(0.25)
    assert a["saves"] == 2 and a["storage_bytes"] == 7 << 20
    assert a["curve"][9] == (10.0, 10) and a["curve"][10] == (23.5, 6)  # the rollback shows


def test_memsnaps_newest_committed_step_at_the_kill_is_kept_beside_the_step_restored():
    t0 = 1000.0
    ev, faults = _events(t0)
    faults[0]["committed_at_kill"] = 4
    spec = {"system": "memsnap", "interval": "5", "faults": True, "label": ""}
    (f,) = analyse(RunResult(spec, t0, 35.0, ev, faults, 0, 256 << 20))["failures"]
    assert (f["committed_at_kill"], f["restored_step"]) == (4, 4)


def test_a_failure_the_job_never_recovered_from_has_no_rto():
    t0 = 0.5
    ev, faults = _events(t0)
    cut = [e for e in ev if e["t"] < t0 + 15]  # the horizon ended during the restart
    a = analyse(RunResult({"system": "dcp", "interval": "5", "faults": True, "label": ""}, t0, 15.0, cut, faults, 0, 1))
    (f,) = a["failures"]
    assert "rto" not in f and f["detect"] == pytest.approx(3.0)
    assert a["useful_steps"] == 10


def test_torchft_goes_on_after_a_kill_its_rto_is_the_first_step_the_others_commit():
    """torchft's surviving replica groups go on (no rollback, no restart): the failure's RTO is
    the first step committed after the kill, and the new worker's rejoin is its first step."""
    t0 = 100.0
    ev = [{"ev": "built", "rank": r, "t": t0 - 2} for r in range(NODES)]
    ev += [{"ev": "restored", "rank": r, "step": -1, "wall": 0.0, "t": t0 - 1} for r in range(NODES)]
    ev += [{"ev": "step", "step": s, "attempt": 0, "participants": NODES, "t": t0 + 1 + s} for s in range(10)]
    # killed at t0+10.2; the quorum drops the lost group, step 10 commits at t0+13.0 with the
    # others, and the new worker is in from step 18 on
    ev += [
        {"ev": "step", "step": s, "attempt": 0, "participants": NODES - (s < 18), "t": t0 + 13.0 + (s - 10)}
        for s in range(10, 30)
    ]
    ev += [
        {"ev": "built", "rank": 2, "t": t0 + 18.0},
        {"ev": "restored", "rank": 2, "step": 14, "wall": 0.3, "t": t0 + 21.0},
    ]
    faults = [{"at_s": 10.0, "t_kill": t0 + 10.2, "t_dead": t0 + 14.0, "killed": 2, "replacement": 4}]
    a = analyse(
        RunResult({"system": "torchft", "interval": "0", "faults": True, "label": ""}, t0, 35.0, ev, faults, 0, 1)
    )
    (f,) = a["failures"]
    assert f["rto"] == pytest.approx(13.0 - 10.2) and f["lost_steps"] == 0
    assert f["rejoin"] == pytest.approx(21.0 - 10.2)
    assert "restart" not in f
    # the work done by the horizon (t0+35): steps 0-9 whole, 10-17 by three of four groups, 18-31 whole
    in_horizon = [s for s in range(10, 30) if t0 + 13.0 + (s - 10) <= t0 + 35.0]
    whole = 10 + sum(1 if s >= 18 else (NODES - 1) / NODES for s in in_horizon)
    assert a["useful_steps"] == pytest.approx(whole) and a["rate"] == pytest.approx(whole / 35.0)


def test_a_step_the_old_ranks_log_just_after_the_kill_is_progress_not_recovery():
    """Rank 0 may log a step whose all-reduce ended before the kill a moment after it: that step
    was done before the node died (it counts in the lost steps), and the RTO runs to the first
    step of the restarted ranks, not to it."""
    t0 = 1000.0
    ev, faults = _events(t0)
    ev.append({"ev": "step", "step": 10, "attempt": 0, "t": t0 + 10.7})  # logged 0.2 s after the kill
    ev.sort(key=lambda e: e["t"])
    (f,) = analyse(
        RunResult({"system": "memsnap", "interval": "1", "faults": True, "label": ""}, t0, 35.0, ev, faults, 0, 1)
    )["failures"]
    assert f["lost_steps"] == 6  # 11 steps done, resumed at step 5
    assert f["rto"] == pytest.approx(23.5 - 10.5) and f["first_step"] == pytest.approx(1.0)


def _inplace(t0: float) -> tuple[list[dict], list[dict], list[dict]]:
    """An in-place run: steps 0-9 at t0+1..t0+10, a snapshot every step; rank 2's node is killed
    at t0+10.5, the controller notices at t0+10.8 and decides at t0+11.0 (Ray's verdict comes at
    t0+16); every rank begins generation 1 by t0+11.3 (rank 2: the standby, a new pid), restores
    step 9 by t0+12.0 and steps 10.. end from t0+13.0. A second recovery at t0+25 no kill explains."""
    ev: list[dict[str, Any]] = []
    for gen, t, pids in (
        (0, t0 - 2, {r: 100 + r for r in range(NODES)}),
        (1, t0 + 11.0, {0: 100, 1: 101, 2: 200, 3: 103}),
    ):
        ev += [{"ev": "built", "rank": r, "gen": gen, "pid": pids[r], "t": t + 0.1 * (r + 1)} for r in range(NODES)]
        ev += [
            {"ev": "restored", "rank": r, "gen": gen, "step": None if gen == 0 else 9, "wall": 0.5, "t": t + 1.0}
            for r in range(NODES)
        ]
    for s in range(10):
        ev.append({"ev": "step", "step": s, "attempt": 0, "t": t0 + 1 + s})
    for i, s in enumerate(range(10, 30)):
        ev.append({"ev": "step", "step": s, "attempt": 1, "t": t0 + 13.0 + i})
    ev.sort(key=lambda e: e["t"])
    faults = [{"at_s": 10.0, "t_kill": t0 + 10.5, "t_dead": t0 + 16.0, "killed": 3, "replacement": 5, "rank": 2}]
    split = {"detect": 0.2, "reform": 0.3, "restore": 0.7, "first_step": 1.0, "total": 2.2}
    recoveries = [
        {
            "gen": 1,
            "lost": {"2": "r2"},
            "takeover": {"2": "s0"},
            "why": "rank 2: its process ended",
            "noticed": t0 + 10.8,
            "decided": t0 + 11.0,
            "split": split,
            "tiers": {"0": "local", "1": "local", "2": "peers", "3": "local"},
            "pids": {},
        },
        {
            "gen": 2,
            "lost": {"1": "r1"},
            "takeover": {"1": "s1"},
            "why": "rank 1: no heartbeat for 1.2 s",
            "noticed": t0 + 25.0,
            "decided": t0 + 25.1,
            "split": dict(split, reform=None, total=None),
            "tiers": {},
            "pids": {},
        },
    ]
    return ev, faults, recoveries


def test_in_place_faults_end_detect_at_memsnaps_decision():
    from goodput_timeline import inplace_faults

    t0 = 1000.0
    ev, faults, recoveries = _inplace(t0)
    fs = inplace_faults(faults, recoveries)
    assert [f.get("unscheduled", False) for f in fs] == [False, True]
    kill, extra = fs
    assert kill["t_dead"] == t0 + 11.0 and kill["t_dead_ray"] == t0 + 16.0  # Ray's verdict is kept
    assert kill["recovery"]["gen"] == 1 and faults[0]["t_dead"] == t0 + 16.0  # the input is not changed
    assert extra["t_kill"] == t0 + 25.0 and extra["t_dead"] == t0 + 25.1 and "rank 1" in extra["why"]
    a = analyse(
        RunResult(
            {"system": "memsnap-inplace", "interval": "1", "faults": True, "label": ""}, t0, 35.0, ev, fs, 0, 64 << 20
        )
    )
    f, g = a["failures"]
    assert f["detect"] == pytest.approx(0.5)  # kill -> decided, not kill -> Ray's verdict (5.5 s)
    assert f["restart"] == pytest.approx(0.4)  # decided -> every rank began generation 1
    assert f["restore"] == pytest.approx(0.6) and f["first_step"] == pytest.approx(1.0)
    assert f["rto"] == pytest.approx(2.5) and f["lost_steps"] == 0  # a snapshot every step: nothing lost
    x = f["inplace"]
    assert x["kill_to_sign"] == pytest.approx(0.3) and x["detect"] == pytest.approx(0.2)
    assert x["kill_to_all_stepped"] == pytest.approx(2.5) and x["ray_verdict"] == pytest.approx(5.5)
    assert x["lost"] == [2] and x["tiers"][2] == "peers"
    assert x["survivors_kept"] and x["pids"] == {0: [100, 100], 1: [101, 101], 3: [103, 103]}
    # the unscheduled one never formed its generation here: no split to the end, no survivors seen
    assert g["unscheduled"] and g["inplace"]["kill_to_all_stepped"] is None and not g["inplace"]["survivors_kept"]
    assert "rto" not in g


def test_a_kill_no_recovery_lost_keeps_rays_verdict():
    from goodput_timeline import inplace_faults

    t0 = 0.0
    _, faults, recoveries = _inplace(t0)
    (f, g, h) = inplace_faults([dict(faults[0], rank=3)], recoveries)  # rank 3 was never lost
    assert "recovery" not in f and f["t_dead"] == t0 + 16.0
    assert g["unscheduled"] and h["unscheduled"]


def test_the_report_shows_the_in_place_split_and_ranks_goodput():
    from goodput_report import inplace_rows, ranking
    from goodput_timeline import inplace_faults

    t0 = 1000.0
    ev, faults, recoveries = _inplace(t0)
    spec = {"system": "memsnap-inplace", "interval": "1", "faults": True, "label": ""}
    run = {
        "spec": spec,
        **analyse(RunResult(spec, t0, 35.0, ev, inplace_faults(faults, recoveries), 0, 1)),
        "extra": {
            "recoveries": recoveries,
            "standby_events": [
                {"t": t0 + 14.0, "event": "standby", "process_s": 1.2, "setup_s": 1.5, "fsdp_warm_s": 0.4, "spare_s": 2}
            ],
        },
    }
    base = {"spec": dict(spec, faults=False), "rate": 1.0}
    other = {"spec": {"system": "dcp", "interval": "5", "faults": True, "label": ""}, "rate": 0.3, "failures": []}
    data = {"runs": [run, base, other, {"spec": dict(other["spec"], faults=False), "rate": 0.6}]}
    rows = inplace_rows(data)
    row = next(r for r in rows if r.startswith("| memsnap-inplace/1 | 10.5 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:10] == ["2", "0.30", "0.20", "0.30", "0.70", "1.00", "**2.50**", "5.50"]
    assert "2: peers" in cells[10] and cells[11] == "unchanged"
    # the new standby warm 3 s after the decision, and where those seconds went
    warm = "3.0 s (process start 1.2 + setup 1.5, of which FSDP2 warm-up 0.4; spare agent 2.0 beside them)"
    assert any(warm in r for r in rows)
    assert ranking(data) == f"Goodput, best first: memsnap-inplace/1 {run['rate']:.2f}, dcp/5 0.50."
    assert "the ranks are replicas, as here" in rows[2]  # ddp, the default workload
    sharded = inplace_rows({**data, "args": {"workload": "fsdp"}})
    assert "the ranks hold shards, as here" in sharded[2] and "replicas, as here" not in sharded[2]


def test_the_model_charges_an_in_place_run_that_went_live_only_the_step_in_flight():
    from goodput_report import model_check

    from memsnap import goodput_model as gm

    t0 = 1000.0
    ev, faults, recoveries = _inplace(t0)
    spec = {"system": "memsnap-inplace", "interval": "1", "faults": True, "label": ""}

    def check(tiers: dict) -> tuple[dict, dict]:
        recs = [dict(recoveries[0], tiers=tiers)]
        run = {"spec": spec, **analyse(RunResult(spec, t0, 35.0, ev, inplace_faults(faults, recs), 0, 1)), "extra": {}}
        run["failures"][0]["first_step"] = 1.0  # (no slower first step: the figures below are by hand)
        run["write_lag"] = 2.0  # a snapshot completes 2 s after its stall (no calibration run here)
        base = {"spec": dict(spec, faults=False), "rate": 1.0, "extra": {}}
        (c,) = model_check({"runs": [run, base], "young_daly": {}})
        return c, run

    from goodput_timeline import inplace_faults

    live, run = check({"0": "kept", "1": "kept", "2": "live", "3": "kept"})
    f = run["failures"][0]
    kw = dict(fault_times_s=[f["t_kill_s"]], horizon_s=run["horizon_s"], step_s=1.0, every_steps=1, lag_s=2.0)
    kw.update(detect_s=f["detect"], restart_s=f["restart"], restore_s=f["restore"])
    assert live["predicted"] == pytest.approx(gm.run_goodput(**kw, live=True))
    stall = run.get("stall_steady") or 0.0
    assert live["replayed"] == pytest.approx(gm.replay_goodput(**kw, live=True, stall_s=stall))
    rolled, _ = check({"0": "local", "1": "local", "2": "peer", "3": "local"})
    assert rolled["predicted"] < live["predicted"]  # a rollback is charged the snapshot's lag as well
    assert rolled["replayed"] < live["replayed"]


def test_commit_lags_run_from_each_capture_to_the_first_commit_reading_at_or_past_its_step():
    """The coordinator's commits as the bench read them: step 4 committed 1.5 s after its capture,
    and step 3 before it, replaced under load, counts until step 4 committed; a commit read after
    the kill is no capture's before it (the job rolled back); after the restore, step 9 counts
    until step 10 committed."""
    t0 = 1000.0
    ev, faults = _events(t0)
    ev += [{"ev": "save", "rank": 0, "step": 3, "stall": 0.2, "bytes": 0, "t": t0 + 4.0}]  # replaced by step 4
    ev += [{"ev": "save", "rank": 0, "step": 10, "stall": 0.2, "bytes": 0, "t": t0 + 29.5}]
    commits = [(t0 + 6.6, 4), (t0 + 22.0, 4), (t0 + 31.0, 10)]
    spec = {"system": "memsnap", "interval": "5", "faults": True, "label": ""}
    a = analyse(RunResult(spec, t0, 35.0, ev, faults, 0, 256 << 20, {"commits": commits}))
    assert a["commit_lags"] == pytest.approx([1.5, 31.0 - 28.1, 6.6 - 4.0, 1.5])
    late = [(t0 + 11.0, 4)]  # step 4 read committed only after the kill
    assert analyse(RunResult(spec, t0, 35.0, ev, faults, 0, 256 << 20, {"commits": late}))["commit_lags"] == []
    assert analyse(RunResult(spec, t0, 35.0, ev, faults, 0, 256 << 20))["commit_lags"] == []


def test_the_model_check_takes_memsnaps_lag_from_the_runs_own_commits():
    from goodput_report import lag_s

    data: dict[str, Any] = {"runs": []}  # no calibration run
    run = {"spec": {"system": "memsnap", "interval": "1"}, "commit_lags": [1.0, 1.0, 7.0], "write_lag": None}
    assert lag_s(run, data) == pytest.approx(3.0)  # the mean: the slow commits after a restart count
    assert lag_s(dict(run, commit_lags=[]), data) == 0.0
    assert lag_s({"spec": {"system": "dcp", "interval": "4"}, "write_lag": 0.75}, data) == 0.75
