"""The timeline of a run of ``bench/goodput.py``: its fault schedule, and what its events say
(progress, RPO and RTO per failure, stalls). No Ray, no cluster: tests/test_goodput_bench.py
checks it on made-up events."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

NODES = 4
# Ray's health checks: a node is declared dead after 5 missed pings 1 s apart (5-8 s), and a
# new node gets 5 s before its first; the localcluster default (0.5 s x 3) declares live and
# starting nodes dead on a machine as loaded as this one.
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 5000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 3000,
    "health_check_failure_threshold": 5,
}


def poisson_schedule(mtbf_s: float, horizon_s: float, seed: int) -> list[dict]:
    """Fault times (seconds from the first step) of a Poisson process with mean gap ``mtbf_s``,
    each with the position (0..NODES-2) of the non-head node it kills: the same for every system."""
    rng, t = random.Random(seed), 0.0
    out: list[dict] = []
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        out.append({"at_s": t, "victim": rng.randrange(NODES - 1)})


@dataclass
class RunResult:
    spec: dict
    t0: float
    horizon_s: float
    events: list[dict]
    faults: list[dict]
    storage_bytes: int
    state_bytes: int
    extra: dict = field(default_factory=dict)


def inplace_faults(faults: list[dict], recoveries: list[dict]) -> list[dict]:
    """The faults of an in-place run on memsnap's own timeline. Each kill is matched (in the
    order of the kills) to the first recovery decided after it that lost the killed rank
    (``rank``); its ``t_dead`` becomes that decision, Ray's verdict is kept as ``t_dead_ray``,
    and the recovery (``InplaceJob.collect()``'s record: noticed, decided, split, tiers, pids)
    comes along as ``recovery``. A recovery no kill explains (a member that missed its beats,
    a collective that failed with every member alive) cost the run like a fault: it is one,
    unscheduled, from the controller's first sign."""
    out, used = [], set()
    for f in sorted(faults, key=lambda f: f["t_kill"]):
        f = dict(f)
        for i, rec in enumerate(recoveries):
            if i in used or rec["decided"] < f["t_kill"]:
                continue
            if f.get("rank") is not None and f["rank"] not in {int(x) for x in rec["lost"]}:
                continue
            used.add(i)
            f.update(t_dead_ray=f["t_dead"], t_dead=rec["decided"], recovery=rec)
            break
        out.append(f)
    for i, rec in enumerate(recoveries):
        if i not in used:
            out.append(
                {
                    "t_kill": rec["noticed"],
                    "t_dead": rec["decided"],
                    "unscheduled": True,
                    "why": rec.get("why"),
                    "recovery": rec,
                }
            )
    return sorted(out, key=lambda f: f["t_kill"])


def _inplace_split(f: dict, events: list[dict]) -> dict:
    """Where the seconds of one in-place recovery went (from the kill, the controller's record
    and the members' reports), and whether the survivors kept their processes: each rank's pid
    in the ``built`` events of the generation before and of the one the recovery formed."""
    rec = f["recovery"]
    split = rec["split"]
    out = {
        "gen": rec["gen"],
        "lost": sorted(int(x) for x in rec["lost"]),
        "kill_to_sign": rec["noticed"] - f["t_kill"],
        "detect": split["detect"],
        "reform": split["reform"],
        "restore": split["restore"],
        "first_step": split["first_step"],
        "kill_to_all_stepped": None if split.get("total") is None else rec["noticed"] + split["total"] - f["t_kill"],
        "ray_verdict": f["t_dead_ray"] - f["t_kill"] if "t_dead_ray" in f else None,
        "tiers": {int(k): v for k, v in rec.get("tiers", {}).items()},
    }
    pid: dict[int, dict[int, int]] = {}
    for e in events:
        if e["ev"] == "built" and "gen" in e:
            pid.setdefault(e["gen"], {}).setdefault(e["rank"], e["pid"])
    before, after = pid.get(rec["gen"] - 1, {}), pid.get(rec["gen"], {})
    survivors = [r for r in sorted(after) if r not in out["lost"]]
    out["pids"] = {r: [before.get(r), after[r]] for r in survivors}
    out["survivors_kept"] = bool(survivors) and all(before.get(r) == after[r] for r in survivors)
    return out


def commit_lags(r: RunResult) -> list[float]:
    """memsnap: seconds from each snapshot's capture (rank 0's save returning) to the first
    reading of the coordinator at or past its step (``CommitWatch``, every 0.1 s), for each
    snapshot that committed before the next kill (a step replaced under load counts until the
    newer one committed). Empty for the other systems."""
    seen = r.extra.get("commits") or []
    if not seen:
        return []
    kills = sorted(f["t_kill"] for f in r.faults)
    out = []
    for e in r.events:
        if e["ev"] != "save" or e["rank"] != 0:
            continue
        until = next((k for k in kills if k > e["t"]), float("inf"))
        hit = next((t for t, step in seen if step >= e["step"] and e["t"] <= t < until), None)
        if hit is not None:
            out.append(hit - e["t"])
    return out


def analyse(r: RunResult) -> dict:
    """Progress, goodput inputs and per-failure RPO/RTO of one run (times from its ``t0``)."""
    steps = [e for e in r.events if e["ev"] == "step" and e["t"] <= r.t0 + r.horizon_s]
    timed = [e for e in steps if e["t"] >= r.t0]
    useful = timed[-1]["step"] + 1 if timed else 0
    first = min((e["step"] for e in timed), default=0)
    if any("participants" in e for e in timed):  # torchft: a step of fewer replica groups is part of one
        first, useful = 0, sum(e.get("participants", NODES) for e in timed) / NODES
    saves = [e for e in r.events if e["ev"] == "save"]
    rank_saves: dict[int, list[dict]] = {}
    for e in saves:
        rank_saves.setdefault(e["rank"], []).append(e)
    first_stall = [v[0]["stall"] for v in rank_saves.values() if v]
    later = [e["stall"] for v in rank_saves.values() for e in v[1:]]
    fails = []
    for i, f in enumerate(r.faults):
        nxt = r.faults[i + 1]["t_kill"] if i + 1 < len(r.faults) else r.t0 + r.horizon_s + 1e9
        built = [e["t"] for e in r.events if e["ev"] == "built" and f["t_kill"] < e["t"] < nxt]
        restored = [e for e in r.events if e["ev"] == "restored" and f["t_kill"] < e["t"] < nxt]
        # the old ranks' progress: a step whose all-reduce ended before the kill can be logged just after it
        before = [e for e in steps if e["t"] < (min(built) if built else f["t_kill"])]
        rec = {
            "at_s": f.get("at_s"),
            "unscheduled": f.get("unscheduled", False),
            "t_kill_s": f["t_kill"] - r.t0,
            "detect": f["t_dead"] - f["t_kill"],
        }
        if "committed_at_kill" in f:  # memsnap: its newest committed step as the kill landed
            rec["committed_at_kill"] = f["committed_at_kill"]
        if "recovery" in f:  # in place: memsnap's own decision ends detect (inplace_faults)
            rec["inplace"] = _inplace_split(f, r.events)
        progress = before[-1]["step"] + 1 if before else 0
        t_rest = max(e["t"] for e in restored[:NODES]) if len(restored) >= NODES else nxt
        after = [e for e in steps if t_rest < e["t"] < nxt]  # the new ranks' steps
        if r.spec.get("system") == "torchft":  # the others go on: the first step they commit after the kill
            at_kill = [e for e in steps if e["t"] < f["t_kill"]]
            done = at_kill[-1]["step"] + 1 if at_kill else 0
            went_on = [e for e in steps if f["t_kill"] < e["t"] < nxt and e["step"] >= done]
            if went_on:
                back = [e for e in restored if e["t"] > f["t_kill"]]  # the new worker joined the quorum
                rec.update(
                    rto=went_on[0]["t"] - f["t_kill"],
                    lost_steps=max(0, done - went_on[0]["step"]),
                    first_step=went_on[0]["t"] - f["t_kill"],
                    rejoin=(back[0]["t"] - f["t_kill"]) if back else None,
                )
        elif len(built) >= NODES and len(restored) >= NODES and after:
            t_built = max(built[:NODES])
            step = restored[0]["step"]
            resumed = 0 if step is None else step + 1
            rec.update(
                restart=t_built - f["t_dead"],
                restore=t_rest - t_built,
                restore_wall=max(e["wall"] for e in restored[:NODES]),
                restored_step=step,
                rto=after[0]["t"] - f["t_kill"],
                lost_steps=progress - resumed,
                first_step=after[0]["t"] - t_rest,
            )
        fails.append(rec)
    curve = [(e["t"] - r.t0, e["step"] + 1) for e in steps]
    return {
        "useful_steps": useful,
        "first_step": first,
        "executed": len(timed),
        "horizon_s": r.horizon_s,
        "rate": (useful - first) / r.horizon_s,
        "curve": curve,
        "failures": fails,
        "saves": len(saves) // NODES if saves else 0,
        "stall_first": statistics.median(first_stall) if first_stall else None,
        "stall_steady": statistics.median(later) if later else None,
        "storage_bytes": r.storage_bytes,
        "commit_lags": commit_lags(r),
        # DCP: seconds from async_save returning to its write being done, median over ranks and saves
        "write_lag": statistics.median(lags)
        if (lags := [e["lag"] for e in r.events if e["ev"] == "written"])
        else None,
    }
