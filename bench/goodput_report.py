"""Writes bench/results/goodput.md and the timeline plot from goodput.json (bench/goodput.py)."""

from __future__ import annotations

import statistics
from pathlib import Path

from goodput_timeline import HEALTH_CHECKS

from memsnap import goodput_model as gm

GIB = 1 << 30


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x, fmt=".2f", none="-"):
    return none if x is None else format(x, fmt)


def _name(run: dict) -> str:
    s = run["spec"]
    return s["label"] or f"{s['system']}/{s['interval']}"


def pairs(data: dict) -> list[tuple[dict, dict]]:
    """(faulted run, failure-free run of the same system and interval) for every faulted run."""
    free = {(r["spec"]["system"], r["spec"]["interval"]): r for r in data["runs"] if not r["spec"]["faults"]}
    return [
        (r, free[(r["spec"]["system"], r["spec"]["interval"])])
        for r in data["runs"]
        if r["spec"]["faults"] and (r["spec"]["system"], r["spec"]["interval"]) in free
    ]


def _faults(run: dict) -> str:
    extra = sum(1 for f in run["failures"] if f.get("unscheduled"))
    return f"{len(run['failures'])}" + (f" ({extra} not scheduled)" if extra else "")


def goodput(run: dict, base: dict) -> float:
    return run["rate"] / base["rate"] if base["rate"] else 0.0


def lag_s(run: dict, data: dict) -> float:
    """How long after its stall a snapshot completes: memsnap's commit (the mean over the run's
    own snapshots, as the coordinator's commits were read during it; else the calibration's
    steady lag), DCP's background write (its ``written`` events); 0 for the synchronous savers.
    The mean, since the work a failure loses grows with the lag of the snapshot it lands after,
    and the first snapshots after a restart commit later than the steady ones."""
    system = run["spec"]["system"]
    if system in ("memsnap", "memsnap-inplace"):
        if run.get("commit_lags"):
            return statistics.fmean(run["commit_lags"])
        c = _calibration(data)
        if c:
            return c["steady"]["commit"]
    return run.get("write_lag") or 0.0


def _went_live(fails: list[dict]) -> bool:
    """Whether every in-place recovery of a run rolled nothing back (the standby took the
    survivors' live state: replicas)."""
    tiers = [(f.get("inplace") or {}).get("tiers") or {} for f in fails]
    return bool(tiers) and all("live" in t.values() for t in tiers)


def model_check(data: dict) -> list[dict]:
    """The model's goodput for every faulted run against the measured one. Inputs: the run's
    fault count, its system's failure-free step time, its interval, the snapshot lag, and the
    median detect / restart / restore seconds measured over the run's failures; the model
    supplies the expected work lost (half an interval plus the lag) instead of what the run lost."""
    out = []
    for run, base in pairs(data):
        fails = [f for f in run["failures"] if "restart" in f]
        if not fails:
            continue
        step_s = 1.0 / base["rate"]
        interval = run["spec"]["interval"]
        # auto: the steps run per snapshot taken in this run
        every = int(interval) if interval.isdigit() else max(1, round(run["executed"] / max(run["saves"], 1)))
        warm = max(0.0, _med([f["first_step"] for f in fails]) - step_s)  # the first step back is slower
        inputs = {
            "fault_times_s": [f["t_kill_s"] for f in run["failures"]],
            "horizon_s": run["horizon_s"],
            "step_s": step_s,
            "every_steps": every,
            "lag_s": lag_s(run, data),
            "detect_s": _med([f["detect"] for f in fails]),
            "restart_s": _med([f["restart"] for f in fails]) + warm,
            "restore_s": _med([f["restore"] for f in fails]),
            "live": _went_live(fails),
        }
        pred = gm.run_goodput(**inputs)
        # the same inputs, each kill's loss played out where it fell (the snapshot step stalls)
        replayed = gm.replay_goodput(**inputs, stall_s=run.get("stall_steady") or 0.0)
        meas = goodput(run, base)
        out.append(
            {
                "run": _name(run),
                "every": every,
                "faults": len(run["failures"]),
                "measured": meas,
                "predicted": pred,
                "error": (pred - meas) / meas if meas else None,
                "replayed": replayed,
                "replay_error": (replayed - meas) / meas if meas else None,
            }
        )
    return out


FRESH = 3  # keep + 1 arena slots per rank: the first snapshots each back a fresh one


def _calibration(data: dict) -> dict | None:
    """memsnap's costs from the calibration snapshots: the first ``FRESH`` and the rest."""
    cal = next((r for r in data["runs"] if r["extra"].get("calibration")), None)
    if cal is None:
        return None
    c = cal["extra"]["calibration"]
    gib = cal["state_bytes"] / GIB
    ranks, cpu, saves = len(c["saves"][0]), c["agent_cpu_s"], c["saves"]
    out = {"gib": gib, "ranks": ranks, "n": len(saves)}
    for part, lo, hi in (("fresh", 0, FRESH), ("steady", FRESH, len(saves))):
        out[part] = {
            "stall": _med([s["stall"] for step in saves[lo:hi] for s in step]),
            "stall_max": max(s["stall"] for step in saves[lo:hi] for s in step),
            "commit": _med([s["commit_wait"] for step in saves[lo:hi] for s in step]),
            "cpu_per_gib": (cpu[hi] - cpu[lo]) / ((hi - lo) * ranks * gib),
        }
    out["first"] = {"stall": _med([s["stall"] for s in saves[0]]), "cpu_per_gib": (cpu[1] - cpu[0]) / (ranks * gib)}
    return out


def _stall_rows(data: dict) -> list[str]:
    c = _calibration(data)
    if c is None:
        return []
    f, st, one = c["fresh"], c["steady"], c["first"]
    return [
        "## memsnap's own costs per GiB (the figures to carry to a real node)",
        "",
        f"Measured in the failure-free memsnap run before its timed part: every rank snapshots {c['n']} steps in a "
        f"row, each time waiting for the commit (RS(2,1), keep=2, {c['gib'] * 1024:.0f} MiB per rank, {c['ranks']} "
        "ranks, right after `restore()`). The agents' CPU is the sum of user + system seconds of the 4 "
        "`SnapshotAgent` processes (psutil, children of this cluster's raylets) over those snapshots: "
        "checksum, encode, send, receive and commit, divided by the GiB snapshotted (all ranks). The first "
        f"{FRESH} snapshots each use an arena slot for the first time (keep + 1 slots per rank); the rest "
        "reuse them.",
        "",
        f"| | first snapshot | first {FRESH} snapshots (median) | steady state, snapshots {FRESH + 1}-{c['n']} (median) |",
        "| --- | --- | --- | --- |",
        f"| `save()` stall per rank | {one['stall']:.3f} s | {f['stall']:.3f} s (max {f['stall_max']:.2f}) | "
        f"{st['stall']:.3f} s (max {st['stall_max']:.2f}) |",
        f"| stall per GiB | {one['stall'] / c['gib']:.3f} s/GiB | {f['stall'] / c['gib']:.3f} s/GiB | "
        f"{st['stall'] / c['gib']:.3f} s/GiB |",
        f"| agent CPU per GiB snapshotted | {one['cpu_per_gib']:.2f} core-s/GiB | {f['cpu_per_gib']:.2f} core-s/GiB | "
        f"{st['cpu_per_gib']:.2f} core-s/GiB |",
        f"| from `save()` returning to the commit | - | {f['commit']:.2f} s | {st['commit']:.2f} s |",
        "",
    ]


def measured_figures(data: dict) -> gm.Measured | None:
    """The figures the plan model takes, from this run (None without a memsnap calibration)."""
    c = _calibration(data)
    if c is None:
        return None
    ms = [r for r in data["runs"] if r["spec"]["system"] == "memsnap" and r["spec"]["faults"]]
    disk = [r for r in data["runs"] if r["spec"]["system"] == "torch.save" and r["spec"]["faults"]]
    # the projection's detect and restart are a whole-job restart's: the in-place runs stay out
    fails = [
        f
        for r in data["runs"]
        if r["spec"]["faults"] and r["spec"]["system"] != "memsnap-inplace"
        for f in r["failures"]
        if "restart" in f
    ]
    peer = _med([f["restore_wall"] for r in ms for f in r["failures"] if "restore_wall" in f])
    store = _med([f["restore_wall"] for r in disk for f in r["failures"] if "restore_wall" in f])
    if not (peer and fails):
        return None
    if not store or store < peer:  # none recovered here, or read back from the page cache (faster
        # than from peers' RAM): the model's illustrative default, said in the text
        store = c["gib"] / gm.Measured().storage_restore_gibps
    live = [
        x["restore"]
        for r in data["runs"]
        if r["spec"]["system"] == "memsnap-inplace" and r["spec"]["faults"]
        for f in r["failures"]
        if (x := f.get("inplace")) and "live" in (x.get("tiers") or {}).values() and x.get("restore")
    ]
    extra = {"live_move_gibps": c["gib"] / _med(live)} if live else {}
    return gm.Measured(
        stall_s_per_gib=c["steady"]["stall"] / c["gib"],
        agent_cpu_s_per_gib=c["steady"]["cpu_per_gib"],
        peer_restore_gibps=c["gib"] / peer,
        storage_restore_gibps=c["gib"] / store,
        detect_s=_med([f["detect"] for f in fails]),
        restart_s=_med([f["restart"] for f in fails]),
        **extra,
    )


def _health(data: dict) -> str:
    h = data.get("health_checks")
    if not h:  # results written before the settings were recorded: the bench's constant
        h = HEALTH_CHECKS
    return (
        f"a ping every {h['health_check_period_ms'] / 1000:g} s, dead after "
        f"{h['health_check_failure_threshold']} missed, the first {h['health_check_initial_delay_ms'] / 1000:g} s "
        "after a node starts"
    )


def _passes(data: dict) -> str:
    """A file measured in several passes (``--append``) says which systems each pass ran."""
    passes = data.get("passes") or []
    if len(passes) < 2:
        return ""
    return (
        f" Measured in {len(passes)} passes (`--append` reruns some systems and keeps the others' runs; the "
        "figures above are the last pass's): "
        + "; ".join(
            f"{p['date']}, {', '.join(p['systems'])}, {p['seconds'] / 60:.1f} min, load "
            f"{min(la[0] for la in p['loadavg_after_each_run']):.1f}-{max(la[0] for la in p['loadavg_after_each_run']):.1f}"
            for p in passes
        )
        + ". Each system's runs are from the last pass that ran it."
    )


def ranking(data: dict) -> str:
    """The faulted runs by goodput, best first."""
    ranked = sorted(pairs(data), key=lambda p: -goodput(*p))
    if not ranked:
        return ""
    return "Goodput, best first: " + ", ".join(f"{_name(r)} {goodput(r, b):.2f}" for r, b in ranked) + "."


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def inplace_rows(data: dict) -> list[str]:
    """Where each in-place recovery's time went, per fault (the memsnap-inplace runs)."""
    runs = [r for r in data["runs"] if r["spec"]["faults"] and any("inplace" in f for f in r["failures"])]
    if not runs:
        return []
    lines = [
        "## Where the in-place recoveries' time went (memsnap-inplace)",
        "",
        "Per fault, from the kill: *first sign* (the controller's `noticed`: a member's lifeline closed, a "
        "survivor's failed all-reduce published, or a member's beats or actor gone), *detect* (-> the next generation written: the lost "
        "rank named, its node fenced, the standby given the rank; the table above's *detect* is kill -> "
        "this decision), *re-form* (-> every member formed the new gloo group), *restore* (-> every rank "
        + (
            "restored: the ranks hold shards, as here, so the survivors roll back from their own node's RAM "
            "(`local`) and the standby from its peers (`peer`); where they are replicas, the survivors keep "
            "their live state (`kept`) and the standby receives it from them (`live`); the standby's "
            if data.get("args", {}).get("workload") == "fsdp"
            else "restored: where the ranks are replicas, as here, the survivors keep their live state (`kept`) "
            "and the standby receives it from them (`live`), nothing rolled back; otherwise the survivors roll "
            "back from their own node's RAM (`local`), the standby from its peers (`peer`); the standby's "
        )
        + "`Snapshotter` registers beside its `on_rank`), *first step* (-> every rank completed a step), and the whole: kill -> every "
        "rank's first completed step. *Ray's verdict*: kill -> Ray's GCS declares the node dead (the other "
        "systems' detect; the in-place job does not wait for it). *Survivors' pids*: the pid each surviving "
        "rank reported at the start of the generation before and of the one the recovery formed.",
        "",
        "| run | kill at s | rank lost | first sign | detect | re-form | restore | first step | "
        "**kill -> every rank stepped** | Ray's verdict | restore tiers | survivors' pids |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for run in runs:
        for f in run["failures"]:
            x = f.get("inplace")
            if x is None:
                lines.append(f"| {_name(run)} | {f['t_kill_s']:.1f} | - | not recovered in place | | | | | | | | |")
                continue
            tiers = ", ".join(f"{k}: {v}" for k, v in sorted(x["tiers"].items(), key=lambda kv: int(kv[0])))
            pids = (
                "unchanged"
                if x["survivors_kept"]
                else "CHANGED: " + ", ".join(f"r{k} {a} -> {b}" for k, (a, b) in x["pids"].items())
            )
            lost = ", ".join(map(str, x["lost"])) or "none (a collective failed)"
            lines.append(
                f"| {_name(run)} | {f['t_kill_s']:.1f}{' (not scheduled)' if f.get('unscheduled') else ''} | {lost} | "
                f"{_s(x['kill_to_sign'])} | {_s(x['detect'])} | {_s(x['reform'])} | {_s(x['restore'])} | "
                f"{_s(x['first_step'])} | **{_s(x['kill_to_all_stepped'])}** | {_s(x['ray_verdict'])} | {tiers} | "
                f"{pids} |"
            )
    for run in runs:
        warm = run.get("extra", {}).get("standby_events") or []
        recs = run.get("extra", {}).get("recoveries") or []
        if warm and recs:
            gaps = [f"{e['t'] - r['decided']:.1f} s{_warm_phases(e)}" for e, r in zip(warm, recs)]
            lines += [
                "",
                f"{_name(run)}: each new standby warm (decided -> the controller's `standby` event, in the "
                "background on the replacement node): " + ", ".join(gaps) + ". A loss that "
                "finds no standby warm yet waits for the one warming (its *detect* includes that wait).",
            ]
    return lines + _rollback_rows(runs) + [""]


def _warm_phases(event: dict) -> str:
    """`` (process 6.1 + setup 9.0, of which FSDP2 warm-up 2.0; spare agent 8.0 beside them)``
    from a ``standby`` event that says where its warm-up went (empty for one that does not)."""
    if "process_s" not in event:
        return ""
    return (
        f" (process start {event['process_s']:.1f} + setup {event['setup_s']:.1f}, of which FSDP2 warm-up "
        f"{event['fsdp_warm_s']:.1f}; spare agent {event['spare_s']:.1f} beside them)"
    )


def _rollback_rows(runs: list[dict]) -> list[str]:
    """Where a rollback's *restore* went, per recovery that rolled back: the standby's path
    (its group formed, its ``on_rank`` and its ``Snapshotter``'s registration done side by
    side, the restore plan, the fetch from its peers) and the survivors' (their local read,
    then the wait for the round's last rank), seconds from the generation's assignment."""
    rows = []
    for run in runs:
        for rec in run.get("extra", {}).get("recoveries") or []:
            members = rec.get("members") or {}
            standby = [m for m in members.values() if m.get("takeover") and m.get("tier") == "peer"]
            survivors = [m for m in members.values() if not m.get("takeover") and m.get("tier") == "local"]
            if len(standby) != 1 or not survivors or "restore_phases" not in standby[0]:
                continue
            sb, t0 = standby[0], standby[0]["assigned"]

            def at(m, key, t0=t0):
                return _s(m[key] - t0) if m.get(key) is not None else "-"

            ph = sb["restore_phases"]
            applies = [m.get("restore_phases", {}).get("apply") for m in survivors]
            waits = [m.get("restore_phases", {}).get("done") for m in survivors]
            rows.append(
                f"| {_name(run)} | {rec['gen']} | {at(sb, 'formed')} | {at(sb, 'on_rank')} | {at(sb, 'registered')} | "
                f"{_s(ph.get('plan'))} | {_s(ph.get('fetch'))} | {at(sb, 'restored')} | "
                f"{_s(max((a for a in applies if a is not None), default=None))} | "
                f"{_s(max((w for w in waits if w is not None), default=None))} |"
            )
    if not rows:
        return []
    return [
        "",
        "Where a rollback's *restore* went (seconds; the standby's columns from the generation's assignment): "
        "the standby forms the group, runs `on_rank` (FSDP2's `fully_shard`, the optimizer) while its "
        "`Snapshotter` registers with its node's agent, then asks for the restore plan (made at once: the lost "
        "node is doubted, not waited for) and fetches its shards from its peers; the survivors read their own "
        "node's copy (*local read*) and wait for the round's last rank.",
        "",
        "| run | generation | standby: formed | on_rank done | registered | plan | fetch from peers | restored "
        "| survivors: local read (slowest) | waiting for the round (longest) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]


def write_report(data: dict, out: Path) -> None:
    a, mach = data["args"], data["machine"]
    loads = mach["loadavg_after_each_run"]
    runs = data["runs"]
    state_mib = runs[0]["state_bytes"] / (1 << 20)
    lines = [
        "# Goodput under node failures (`bench/goodput.py`)",
        "",
        f"`python bench/goodput.py{' --workload fsdp' if a.get('workload') == 'fsdp' else ''} "
        f"--state-mb {a['state_mb']} --compute {a['compute']} --step-s {a['step_s']} "
        f"--horizon-s {a['horizon_s']:g} --baseline-s {a['baseline_s']:g} --mtbf-s {a['mtbf_s']:g} --seed {a['seed']} "
        f"--common-n {a['common_n']}`; {mach['date']}; {mach['cpus']} CPUs, {mach['mem_total_gib']:.0f} GiB RAM; "
        f"the whole run took {mach['seconds'] / 60:.1f} min. Machine load (1-min load average after each run): "
        f"{min(la[0] for la in loads):.1f}-{max(la[0] for la in loads):.1f}, CPU busy "
        f"{min(mach['cpu_busy_percent']):.0f}-{max(mach['cpu_busy_percent']):.0f}% over a run (psutil)."
        + _passes(data),
        "",
        "## How it was measured",
        "",
        f"One data-parallel job, one rank on each of 4 simulated Ray nodes on this machine (loopback; every address "
        f"127.0.0.1), each rank with {state_mib:.0f} MiB of state: "
        + (
            "an MLP of 4 layers of 1024 x 1024 sharded with FSDP2 (`fully_shard` per layer, on gloo: each "
            "rank holds a quarter of the parameters and of the AdamW moments, and no rank a replica of "
            "another's), beside a frozen buffer (bench/goodput_job.py; in place, through "
            "`ctx.fully_shard`). "
            if a.get("workload") == "fsdp"
            else "a small MLP with AdamW whose gradients are averaged by a gloo all-reduce, beside a frozen "
            "buffer (bench/goodput_job.py). "
        )
        + (
            "Each step's compute is a sleep of "
            f"{a['step_s']} s standing in for GPU time (the CPU is left to the agents, as on a GPU node), plus the "
            "model's forward, backward, all-reduce and optimizer step."
            if a["compute"] == "sleep"
            else "Each step's compute is "
            f"{a['step_s']} s of sleep standing in for GPU time (the CPU is left to the agents, as on a GPU node), "
            "slept in equal parts in each layer's forward and backward, between the collectives FSDP2 runs per "
            "layer, plus the model's own forward, backward and optimizer step."
            if a["compute"] == "layers"
            else f"Each step runs the model {a['model_passes']} times on the CPU."
        )
        + f" Each system runs {a['horizon_s']:g} wall seconds from its first step with the faults and "
        f"{a['baseline_s']:g} s without, for its failure-free rate.",
        "",
        f"Faults: one Poisson schedule, job MTBF {a['mtbf_s']:g} s, seed {a['seed']}: "
        f"{', '.join(format(f['at_s'], '.1f') + ' s' for f in data['schedule'])} after the first step. At each, a node "
        "that runs a rank (never the head) is killed abruptly (its raylet and every worker under it, ranks "
        "and memsnap agent, SIGKILLed at once, then `ray.cluster_utils.Cluster.remove_node` with no grace; "
        "until 2026-12-06 07:30 UTC the workers were killed after `remove_node`, which let them live a "
        "few tenths of a second past the kill time) and a replacement node is added. A fault that "
        "falls while the job is still recovering from the previous one lands when it trains again, so the "
        "kill times (in the table's runs) differ a little between systems. After a kill the whole job "
        "restarts, as Ray Train restarts its worker group: the surviving ranks are killed, 4 ranks start "
        "on the live nodes, restore, and train on. Ray Train runs the same loop in a `TorchTrainer` "
        "(`FailureConfig(max_failures=-1)`), which restarts the group itself. **memsnap-inplace** runs the "
        "same job, schedule and events under `memsnap.inplace.InplaceJob` (a snapshot every step, as "
        "memsnap/1) with one warm standby on a spare node: after a kill nothing restarts: the controller "
        "notices the loss from the survivors' failed all-reduce or the lost member's missing heartbeats, the "
        "survivors keep their processes, the standby takes the lost rank, and the next standby warms on the "
        "replacement node; "
        + (
            "the ranks hold shards, not replicas, so every rank rolls back to the newest committed step: the "
            "survivors from their own node's RAM, the standby from its peers' erasure-coded pieces"
            if a.get("workload") == "fsdp"
            else "the ranks are replicas (data parallel), so nothing is rolled back: the survivors "
            "keep their live state and the standby receives it from them (`live_takeover`; a sharded job rolls "
            "back from RAM instead)"
        )
        + (
            f" (a member is lost after {a.get('lost_after_s') or 1.0:g} s without heartbeats, "
            f"{a.get('suspect_after_s') or 0.3:g} s once a collective failed)"
            if a.get("lost_after_s") or a.get("suspect_after_s")
            else ""
        )
        + "."
        + (
            " **torchft** runs the job under Ray Train v2's `TorchftConfig` as Ray's `torchft_linear_example` "
            "does: every worker its own replica group, torchft's DDP averaging across the groups, its "
            "PGTransport sending a live peer's state to a new worker; nothing is saved. After a kill the "
            "other groups go on (the lighthouse binds to loopback, forms a quorum as soon as it can and drops "
            "a silent manager after 1 s: `join_timeout_ms` and `heartbeat_timeout_ms` 1000) and Ray Train "
            "starts one new worker, which joins at a later step. A step of fewer groups averages fewer "
            "samples: torchft's useful steps count each step as the share of the 4 groups that took it."
            if any(r["spec"]["system"] == "torchft" for r in runs)
            else ""
        )
        + (
            " **torchft** does not run on this workload: it shards only inside a replica group (HSDP; here "
            "two groups of 2 ranks at the same rank count), and Ray Train 2.60's `TorchftConfig` makes every "
            "worker a replica group of its own (replica groups of more than one worker are a TODO in "
            "`ray.train.v2`'s worker group), so a sharded job cannot be laid out under it."
            if a.get("workload") == "fsdp"
            else ""
        ),
        "",
        "* **useful steps**: the job's progress when the horizon ends (steps redone after a rollback count once).",
        "* **goodput**: useful steps per wall second over the same system's failure-free rate (same interval).",
        "* **lost steps (RPO)**: steps completed when the node died minus the step the job resumed from.",
        "* **RTO**: seconds from the kill to the next completed step, split into *detect* (kill until Ray's GCS "
        f"declares the node dead; its health checks here: {_health(data)}), *restart* (until every new rank has built its "
        "state and joined the process group), *restore* (until every rank has loaded the checkpoint) and the first step. "
        "For memsnap-inplace, *detect* ends at memsnap's own decision (the next generation written), not at Ray's "
        "verdict, and *restart* is until every rank has begun the new generation (the group re-formed, the standby's "
        "`Snapshotter` created); its own split is in the section on the in-place recoveries.",
        "* **stall**: wall seconds `save` blocks training, per rank: the first save of a run and the median of the others.",
        "* **to storage**: bytes written under the directory that stands in for NFS (the largest size seen of every "
        "file, polled every 0.2 s). memsnap writes there only when it spills.",
        "* **not scheduled**: a node Ray declared dead on its own (e.g. missed health checks); the job lost it like "
        "any other, so it counts as a fault of that run.",
        "",
        "## Results",
        "",
        "| system | N | faults | useful steps | failure-free steps/s | steps/s with faults | goodput | vs. unprotected | "
        "lost steps per failure | RTO s (detect + restart + restore + step) | stall first / steady s | to storage |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    none = next((r for r in runs if r["spec"]["system"] == "none"), None)
    for run, base in pairs(data):
        f = [x for x in run["failures"] if "rto" in x]
        rejoin = [x["rejoin"] for x in f if x.get("rejoin") is not None]
        if f and all("restart" in x for x in f):
            rto = (
                f"{_mean([x['rto'] for x in f]):.1f} ({_mean([x['detect'] for x in f]):.1f} + "
                f"{_mean([x['restart'] for x in f]):.1f} + {_mean([x['restore'] for x in f]):.1f} + "
                f"{_mean([x['first_step'] for x in f]):.1f})"
            )
        elif f:  # torchft: the others go on; the new worker joins later
            rto = f"{_mean([x['rto'] for x in f]):.1f} (the others go on; the new worker in at {_f(_mean(rejoin), '.1f')})"
        else:
            rto = "-"
        lost = [x["lost_steps"] for x in f]
        lines.append(
            f"| {_name(run)} | {run['spec']['interval']} | {_faults(run)} | {run['useful_steps']} | "
            f"{base['rate']:.3f} | {run['rate']:.3f} | **{goodput(run, base):.2f}** | "
            f"{run['rate'] / none['rate'] if none else float('nan'):.2f} | "
            f"{_f(_mean(lost), '.1f')} ({', '.join(map(str, lost))}) | {rto} | "
            f"{_f(run['stall_first'])} / {_f(run['stall_steady'])} | {run['storage_bytes'] / GIB:.2f} GiB |"
        )
    if ranking(data):
        lines += ["", ranking(data)]
    if none:
        lines += [
            "",
            f"*vs. unprotected*: steps/s with faults over the rate of the same job without any protection "
            f"and without faults ({none['rate']:.3f} steps/s), which also charges each system its failure-free "
            "overhead (on this box the agents' work shares 2 cores with the ranks).",
        ]
    yd = data.get("young_daly", {})
    if yd:
        lines += [
            "",
            "Young/Daly intervals for the disk systems (N = sqrt(2 x stall x MTBF) / step time, from the "
            "median stall of their failure-free run at the common N and the schedule's MTBF): "
            + ", ".join(f"{k} N = {v}" for k, v in yd.items())
            + ".",
        ]
    present = {r["spec"]["system"] for r in runs if r["spec"]["faults"]}
    missing = [x for x in a.get("systems", []) if x not in present and x not in data.get("errors", {})]
    if missing:
        lines += [
            "",
            f"**Not measured in this run**: {', '.join(missing)} (the run ended before them; see the end "
            "of this file).",
        ]
    for system, err in data.get("errors", {}).items():
        lines += ["", f"**{system} did not complete**: `{err[:400]}`"]
    lines += [""] + inplace_rows(data) + _stall_rows(data)
    check = model_check(data)
    if check:
        worst = max(abs(c["error"]) for c in check if c["error"] is not None)
        own_lags = (
            "the mean capture -> commit over the run's own snapshots, the coordinator read every 0.1 s"
            if any(r.get("commit_lags") for r in data["runs"])
            else "the calibration's steady capture -> commit (this file's runs predate the per-run commit lags)"
        )
        lines += [
            "## The goodput model against the measurement",
            "",
            "`memsnap.goodput_model.run_goodput` (what `memsnap plan --goodput` projects with) given each run's "
            "kill times, its system's failure-free step time, its interval, the lag until a snapshot completes "
            f"(memsnap: {own_lags}; DCP: the median background write), "
            "and the median detect / restart (plus how much slower the first step back was) / restore seconds "
            "measured in the run; the model supplies the work lost per failure ((N-1)/2 steps + lag/step + half "
            "a step in progress, never more than the time the run had left; an in-place run whose recoveries "
            "rolled nothing back, only the half step in progress) instead of what the run lost. "
            "*Replayed*: `memsnap.goodput_model.replay_goodput`, the same inputs with each kill's loss "
            "played out where it fell (steps at the failure-free pace, the snapshot step stalled by the "
            "run's median stall, a snapshot counted lag seconds after its step, training back from it "
            "detect + restart + restore after the kill) instead of the mean: with a few kills and an "
            "interval of many steps, where each kill falls in its interval moves the goodput by more than "
            "the model's costs do.",
            "",
            "| run | N | faults | measured goodput | model | error | replayed | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in check:
            lines.append(
                f"| {c['run']} | {c['every']} | {c['faults']} | {c['measured']:.3f} | {c['predicted']:.3f} | "
                f"{100 * c['error']:+.1f}% | {c['replayed']:.3f} | {100 * c['replay_error']:+.1f}% |"
            )
        replay_worst = max(abs(c["replay_error"]) for c in check if c["replay_error"] is not None)
        lines += [
            "",
            f"Largest error: {100 * worst:.1f}% for the model, {100 * replay_worst:.1f}% replayed (the target is 15%).",
            "",
        ]
    x = measured_figures(data)
    if x is not None:
        lines += [
            "## Carried to 1k-16k GPUs",
            "",
            f"`memsnap plan --goodput` with the figures measured here (stall {x.stall_s_per_gib:.3f} s/GiB, agent CPU "
            f"{x.agent_cpu_s_per_gib:.2f} core-s/GiB, restore {x.peer_restore_gibps:.2f} GiB/s from peers and "
            f"{x.storage_restore_gibps:.2f} GiB/s from storage"
            f"{' (the model default: no torch.save run recovered here, or it read from the page cache)' if x.storage_restore_gibps == gm.Measured().storage_restore_gibps else ''}"
            f", detect {x.detect_s:.1f} s, restart "
            f"{x.restart_s:.1f} s) and the model's default cluster (8 GPUs and 10 GiB of state per GPU, "
            "per-node MTBF from the Llama 3 report's 419 unexpected interruptions in 54 days on 16,384 GPUs, "
            "100 GiB/s of shared storage, 2 GiB/s per node to it, 10 GiB/s NIC, 4 agent cores, 10 s steps):",
            "",
            "| GPUs | job MTBF | memsnap in place, replicas goodput (period) | memsnap in place goodput (period) "
            "| memsnap restarting goodput (period) | sync disk goodput (period) | async disk goodput (period) "
            "| closest to running out |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for gpus in (1024, 2048, 4096, 8192, 16384):
            cluster = gm.Cluster(gpus=gpus)
            ps = gm.project(cluster, x)
            tight = "; ".join(f"{p.system}: {p.binding[0]} {100 * p.binding[1]:.0f}%" for p in ps)
            lines.append(
                f"| {gpus} | {cluster.mtbf_s / 3600:.2f} h | "
                + " | ".join(f"{p.goodput:.3f} ({p.period_s:.0f} s)" for p in ps)
                + f" | {tight} |"
            )
        lines.append("")
    if data.get("notes"):
        lines += ["## Notes on this run", ""] + [f"* {n}" for n in data["notes"]] + [""]
    lines += [
        "## Timeline",
        "",
        f"![progress against time, faults marked]({out.with_suffix('.png').name})",
        "",
        "## Limits",
        "",
        "* 4 simulated nodes share 2 cores: the agents' background work competes with the ranks and with other "
        "jobs on the machine; the per-GiB figures above are the ones to carry to a real node.",
        "* The directory standing in for NFS is this machine's local disk (page cache included); on shared "
        "storage the disk systems' saves and restores slow down as nodes are added (see the projection).",
        "* Faults are injected by the bench's own seeded schedule (`Nodes.inject`: the kill, a replacement node, "
        "a wait until Ray declares the node dead, and the next fault only once the job trains again), node kills "
        "only. `memsnap.chaos` lands the same kill on the loopback cluster, but not that wait for training.",
        "* After a kill the lost rank starts on the replacement node and the other ranks on their own nodes: "
        "in memsnap's restore the lost rank reads from its peers and the others from their node's RAM. In "
        "memsnap-inplace the lost rank moves to the standby's node instead (the replacement warms the next "
        "standby), and the cluster has one node more than the job's ranks while it runs.",
        "",
    ]
    out.write_text("\n".join(lines))
    plot(data, out.with_suffix(".png"))
    print("\n".join(lines))


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faulted = [r for r in data["runs"] if r["spec"]["faults"]]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for r in faulted:
        (line,) = ax.step([p[0] for p in r["curve"]], [p[1] for p in r["curve"]], where="post", label=_name(r))
        kills = [f["t_kill_s"] for f in r["failures"]]
        ax.plot(
            kills,
            [([0] + [p[1] for p in r["curve"] if p[0] <= t])[-1] for t in kills],
            "x",
            color=line.get_color(),
            markersize=9,
            markeredgewidth=2,
        )
    for f in data["schedule"]:
        ax.axvline(f["at_s"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlim(0, data["args"]["horizon_s"])
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("training progress (steps)")
    ax.set_title("Progress under node kills (dotted: scheduled faults; x: where each run's kill landed)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
