"""In-place recovery against the whole-job restart, one data-parallel job, side by side in one run.

    python bench/inplace.py [--state-mb 256] [--step-s 0.3] [--kills 3] [--k 1] [--m 1]
        [--restart-gap-s 30] [--out bench/results/inplace.md]

The job: 3 ranks on a 5-node loopback Ray cluster (head + 3 rank nodes + 1 spare, every
address 127.0.0.1), the workload of bench/goodput_job.py (a small MLP + AdamW beside a bulk
buffer, ``--state-mb`` per rank; a step is its forward/backward, a sleep of ``--step-s``
standing in for GPU time, the gradient average and the optimizer step), a memsnap snapshot
every step. The same cluster runs, one after the other (in place first):

* **whole-job restart** (what memsnap does without ``memsnap.inplace``): bench/goodput.py's
   ``run_own`` with its fault injector: a rank's node is killed, a replacement node added,
   and once Ray declares the node dead every rank is killed, 3 ranks start again (one on the
   replacement), build their state, create their ``Snapshotter`` and ``restore()``.
* **in place** (``memsnap.inplace.InplaceJob``, one warm standby on the spare node): the
   node of a rank is killed hard (its raylet and every process under it), ``--kills`` times
   in a row; before each kill the bench adds a fresh node, which the controller warms the
   next standby on. The ranks are replicas, so the survivors keep their live state and the
   standby takes theirs (``live_takeover``); nothing is rolled back. Per recovery: kill ->
   the controller's first sign, detect, re-form, restore (each rank's tier), first step,
   kill -> every rank's first step, the survivors' pids before and after, the steps trained
   twice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH")) if p)

import goodput  # noqa: E402
import goodput_timeline  # noqa: E402
import psutil  # noqa: E402

from memsnap.localcluster import LocalCluster, wait_for  # noqa: E402
from memsnap.policy import agent_ram  # noqa: E402

RESULTS = HERE / "results"
MIB = 1 << 20
RANKS = 3
NODES = RANKS + 2  # head + a node per rank + a spare


def _say(msg: str) -> None:
    print(f"[inplace {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kill_hard(lc: LocalCluster, node) -> float:
    """Kill ``node`` as a lost host goes; the wall time of the kill."""
    return lc.kill_node_hard(node)


# --- the in-place job's member functions (run in the members' processes) -------------------------
def make_setup(cfg: dict):
    def setup(ctx):
        from goodput_job import Job

        # a standby has no rank yet: every member builds rank 0's state, and restore overwrites it
        return Job(0, RANKS, cfg)

    return setup


def make_train(cfg: dict):
    """bench/goodput_job.py's step (``compute="sleep"``) with ``ctx.average_gradients`` for the
    per-parameter all-reduce; ends when the driver sets ``bench/stop`` (all ranks at one step)."""

    def train(ctx, job):
        import torch

        store, rank, gen = ctx.store, ctx.rank, ctx.generation
        step = ctx.restore(job.state())
        while True:
            x = torch.randn(64, job.width, generator=job.gen)
            loss = job.model(x).square().mean()
            job.optim.zero_grad(set_to_none=False)
            loss.backward()
            time.sleep(cfg["step_s"])
            ctx.average_gradients(job.model.parameters())
            job.optim.step()
            job.bulk[step % job.bulk.numel()] += 1.0
            c = ctx.snapshotter.counters
            store.set(f"bench/last/{gen}/{rank}", json.dumps([step, time.time(), c["saves"], c["skipped_busy"]]))
            ctx.save(step, job.state())
            stop = torch.tensor([1.0 if store.check(["bench/stop"]) else 0.0])
            ctx.all_reduce(stop)
            step += 1
            if stop.item() > 0:
                return {"rank": rank, "next_step": step, "recoveries": ctx.recoveries}

    return train


def _last(store, gen: int, rank: int):
    key = f"bench/last/{gen}/{rank}"
    return json.loads(store.get(key)) if store.check([key]) else None


def run_inplace(lc: LocalCluster, cfg: dict, opts: dict, kills: int, settle_steps: int) -> dict:
    """The in-place job on the cluster's live non-head nodes, ``kills`` hard kills in a row."""
    import ray

    import memsnap
    from memsnap.inplace import InplaceJob

    head = lc.nodes[0]
    live = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    workers = [n for n in lc.nodes[1:] if n.node_id in live]
    assert len(workers) >= RANKS + 1, f"need {RANKS + 1} live worker nodes, have {len(workers)}"
    by_id = {n.node_id: n for n in lc.nodes}
    job_name = f"inplace-bench-{uuid.uuid4().hex[:6]}"
    events = os.path.join(cfg["scratch"], f"{job_name}.jsonl")
    j = InplaceJob(
        job_name,
        make_setup(cfg),
        make_train(cfg),
        rank_nodes=[n.node_id for n in workers[:RANKS]],
        standby_nodes=[workers[RANKS].node_id],
        options=opts,
        events=events,
    )
    # the head runs the driver, the controller and its rendezvous store: no standby there, so
    # each recovery's new standby goes to the fresh node the bench adds
    j._used_nodes.add(head.node_id)
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(results=j.run(timeout_s=1800)), daemon=True)
    t_start = time.time()
    runner.start()
    records = []
    try:
        wait_for(
            lambda: (
                j.store is not None
                and all(
                    _last(j.store, 0, r) is not None and _last(j.store, 0, r)[0] >= settle_steps for r in range(RANKS)
                )
            ),
            timeout=600,
            what=f"every rank to train {settle_steps} steps",
            interval=0.2,
        )
        _say(f"in place: {RANKS} ranks training ({time.time() - t_start:.0f} s after the start)")
        a, ta = _last(j.store, 0, 0)[:2]
        wait_for(lambda: _last(j.store, 0, 0)[0] >= a + settle_steps, timeout=300, what="steady steps", interval=0.1)
        b, tb = _last(j.store, 0, 0)[:2]
        step_s = (tb - ta) / (b - a)
        _say(f"in place: failure-free step {step_s:.3f} s (rank 0, steps {a}-{b})")
        for i in range(kills):
            fresh = lc.add_node()  # the free node the controller warms the next standby on
            by_id[fresh.node_id] = fresh
            wait_for(lambda: len(j._standbys) >= 1, timeout=600, what="a warm standby", interval=0.2)
            gen = j.gen
            victim = 1 + i % (RANKS - 1)
            before = j.members()
            node = by_id[j._ranks[victim].node]
            progress_before = max(_last(j.store, gen, r)[0] for r in range(RANKS))
            coord_node = coordinator_node(job_name)
            _say(f"in place: the coordinator runs on {str(coord_node)[:8]} (head {head.node_id[:8]})")
            t_kill = kill_hard(lc, node)
            _say(f"in place: killed rank {victim}'s node {node.node_id[:8]} (kill {i + 1} of {kills})")

            def reported(i=i):
                if len(j.collect()) <= i:
                    return False
                rec = j.recoveries[i]
                return len(rec.reports) == RANKS and all(r.first_step is not None for r in rec.reports.values())

            wait_for(reported, timeout=600, what=f"recovery {i + 1}: every rank's first step", interval=0.05)
            rec = j.recoveries[i]
            last_old = max(v[0] for r in range(RANKS) if (v := _last(j.store, gen, r)) is not None)
            record = {
                "kill": i + 1,
                "victim": victim,
                "t_kill": t_kill,
                **rec.to_dict(),
                "reports": {r: rec.reports[r].to_wire() for r in sorted(rec.reports)},
                "pids_before": {r: before[r]["pid"] for r in before},
                "last_step_before": last_old,
                "progress_at_kill": progress_before,
                "coordinator_on_killed_node": coord_node == node.node_id,
                "coordinator_node": coord_node,
                "snapshots_before": {r: _last(j.store, gen, r)[2:] for r in range(RANKS)},
            }
            records.append(record)
            _say(f"in place: recovery {i + 1}: {summarise_inplace(record)}")
            # a few steps in the new generation (its snapshots committed) before the next kill
            wait_for(
                lambda g=j.gen, rec=rec: all(
                    (v := _last(j.store, g, r)) is not None
                    and v[0] >= (rec.reports[r].first_step_no or 0) + settle_steps
                    for r in range(RANKS)
                ),
                timeout=600,
                what="steps after the recovery",
                interval=0.2,
            )
        assert j.store is not None  # run() made it before the ranks stepped
        j.store.set("bench/stop", "1")
        runner.join(timeout=600)
        if runner.is_alive():
            raise TimeoutError("the in-place job did not end within 600 s of the stop")
    finally:
        if j.store is not None and runner.is_alive():
            j.store.set("bench/stop", "1")
            runner.join(timeout=120)
        try:
            memsnap.shutdown(job_name, timeout=30)
        except Exception as exc:
            _say(f"shutdown {job_name}: {exc}")
    standbys = []
    if os.path.exists(events):
        with open(events) as f:
            standbys = [json.loads(line) for line in f if '"standby"' in line]
    return {"recoveries": records, "step_s": step_s, "results": out.get("results"), "standby_events": standbys}


def coordinator_node(job: str) -> str | None:
    """The node the job's coordinator actor runs on (None where Ray does not say)."""
    import ray

    from memsnap import naming

    try:
        actor_id = ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)._actor_id.hex()
        info = ray._private.state.actors(actor_id)
        return info.get("Address", {}).get("NodeID")
    except Exception:  # a private API: the record just lacks it
        return None


def summarise_inplace(rec: dict) -> dict:
    """Where the seconds of one in-place recovery went (wall clock, seconds)."""
    reps = rec["reports"]
    stepped = max(r["first_step"] for r in reps.values())
    split = rec["split"]
    taken = [r for r in reps.values() if r.get("takeover") and "registered" in r]
    return {
        "kill_to_sign": rec["noticed"] - rec["t_kill"],
        "detect": split["detect"],
        "reform": split["reform"],
        "restore": split["restore"],
        "register": max(max(0.0, r["registered"] - r["formed"]) for r in taken) if taken else None,
        "first_step": split["first_step"],
        "kill_to_all_stepped": stepped - rec["t_kill"],
        "tiers": {int(r): reps[r].get("tier") for r in reps},
        "restore_s": {int(r): reps[r].get("restore_s") for r in reps},
        "live_phases": {int(r): reps[r].get("live_phases") for r in reps if reps[r].get("live_phases")},
        "steps_lost": rec["last_step_before"] - next(iter(reps.values()))["step"],
        "restored_step": {int(r): reps[r]["step"] for r in reps},
        "coordinator_lost": rec.get("coordinator_on_killed_node"),
        "pids_same": all(
            rec["pids"][r] == rec["pids_before"][r] for r in rec["pids_before"] if int(r) != rec["victim"]
        ),
    }


# --- the whole-job restart ----------------------------------------------------------------------------
def run_restart(lc: LocalCluster, cfg: dict, kills: int, gap_s: float) -> dict:
    """bench/goodput.py's ``run_own`` (the driver restarts every rank after a kill) for this
    job: 3 ranks on nodes 1-3, ``kills`` kills ``gap_s`` apart (each lands once the job
    trains again after the one before)."""
    import ray
    from goodput import Nodes, RunSpec, run_own
    from goodput_timeline import analyse

    import memsnap
    from memsnap.memory import shmdir

    goodput.NODES = goodput_timeline.NODES = RANKS  # run_own and analyse: one rank per slot
    nodes = Nodes(lc)
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    nodes.live = {lc.index_of(n): n for n in lc.nodes if n.node_id in alive}  # by memsnap_node_<i>
    nodes.slots = sorted(nodes.live)[1 : 1 + RANKS]  # one rank per worker node, none on the head
    job_name = f"inplace-bench-restart-{uuid.uuid4().hex[:6]}"
    storage = os.path.join(cfg["storage_root"], job_name)
    os.makedirs(storage)
    run_cfg = dict(
        cfg,
        system="memsnap",
        interval="1",
        job=job_name,
        storage=storage,
        events=os.path.join(cfg["scratch"], f"{job_name}.jsonl"),
    )
    schedule = [{"at_s": 8.0 + gap_s * i, "victim": i % (RANKS - 1)} for i in range(kills)]
    horizon = 8.0 + gap_s * kills + 10.0
    try:
        res = run_own(RunSpec("memsnap", "1", True), run_cfg, nodes, schedule, horizon)
    finally:
        try:
            memsnap.shutdown(job_name, timeout=30)
        except Exception as exc:
            _say(f"shutdown {job_name}: {exc}")
        shmdir.remove_job(job_name)
    a = analyse(res)
    return {"failures": a["failures"], "rate": a["rate"], "faults": res.faults}


# --- the report --------------------------------------------------------------------------------------
def _stat(values: list) -> tuple[str, str]:
    v = [x for x in values if x is not None]
    if not v:
        return "not measured", ""
    return f"{statistics.median(v):.2f}", f"{min(v):.2f}-{max(v):.2f}"


def render(data: dict, out: Path) -> None:
    inp = [summarise_inplace(r) for r in data["inplace"]["recoveries"]]
    rst = [f for f in data["restart"]["failures"] if "rto" in f]
    a = data["args"]
    lines = [
        "# In-place recovery vs the whole-job restart (`python bench/inplace.py`)",
        "",
        f"`{data['command']}`; {data['date']}; {os.cpu_count()} CPUs (shared with other work), "
        f"{data['mem_gib']:.0f} GiB RAM; the whole run took {data['seconds'] / 60:.1f} min; "
        f"1-min load average {data['load_start'][0]:.1f} at the start, {data['load_mid'][0]:.1f} between the "
        f"two parts, {data['load_end'][0]:.1f} at the end.",
        "",
        "## How it was measured",
        "",
        f"One data-parallel job of {RANKS} ranks on a {NODES}-node loopback Ray cluster (head + {RANKS} rank "
        f"nodes + 1 spare, every address 127.0.0.1; Ray's health checks as in bench/goodput.py: a ping every 1 s, "
        f"dead after 5 missed). Each rank holds {data['state_mib']:.0f} MiB of state (bench/goodput_job.py's "
        f"workload: a 4-layer MLP with AdamW beside a bulk buffer). A step: forward/backward, a sleep of "
        f"{a['step_s']} s standing in for GPU time, the gradient average (gloo), the optimizer step, then "
        f"`save` every step (the pipeline skips or replaces a step while the previous snapshot is still in "
        "flight: here the commits lag several steps behind the training, which a rollback would train again). "
        f"Snapshot options, the same for both: RS(k={a['k']}, m={a['m']}), keep=2, a spill to local disk every "
        f"{a['spill_every']} steps. RS({a['k']},{a['m']}) because the whole-job restart has only its "
        f"{RANKS} rank nodes' agents to place each rank's pieces on (the other {RANKS - 1} nodes: k+m <= "
        f"{RANKS - 1}), and the in-place run must use the same code to compare like with like; replication "
        "also has no parity to encode, which matters when 3 ranks snapshot 256 MiB every step on 2 cores.",
        "",
        f"* **whole-job restart**: bench/goodput.py's `run_own` (what memsnap does without `memsnap.inplace`, "
        f"as Ray Train restarts its worker group): a rank's node is killed (`kill_node` + its `ray::` "
        f"workers), a replacement node is added, and once Ray declares the node dead every rank is killed; "
        f"{RANKS} ranks start again (one on the replacement), build their state, create their `Snapshotter` and "
        f"`restore()`. Kills {a['restart_gap_s']:.0f} s apart, each once the job trains again. *detect* is kill -> "
        "Ray declares the node dead (the replacement node starts meanwhile), *restart* -> every new rank built "
        "and registered, *restore* -> every rank restored, *first step* -> rank 0's first completed step "
        "(an all-reduce: every rank has done it).",
        f"* **in place**: `memsnap.inplace.InplaceJob`, one warm standby on the spare node. The node of rank 1, "
        f"then 2, then 1... is killed hard (its raylet and every process under it, as "
        f"tests/test_inplace_cluster.py does), {len(inp)} times in a row. Before each kill the bench adds a "
        "fresh node (the controller looks for a free node once, when it decides a recovery, and warms the next "
        "standby there in the background) and waits for a warm standby and "
        f"{a['settle_steps']} steps of the new generation. *kill -> first sign*: the controller's `noticed` "
        "(a member's lifeline closed as its process died, a survivor's failed all-reduce published, or a dead actor/heartbeat); *detect*: -> the next "
        "generation written (survivors kept, the standby named); *re-form*: -> every member formed the new "
        "gloo group; *restore*: -> every rank restored. The ranks are replicas (data parallel, the same buffer on "
        "every rank), so the default `live_takeover='verified'` applies: the survivors show with one all-reduce "
        "that they hold the same state at their last step boundary and keep it (tier `kept`), and the standby "
        "receives it from them over the re-formed group, a slice from each (tier `live`); nothing is rolled "
        "back. Where they could not show it, every rank would roll back to the newest committed step instead, "
        "survivors from their own node's RAM (`local`), the standby from its peers (`peer`), after the lost "
        "node is doubted at the coordinator (its restore plan made without asking that node's agent). The standby's "
        "`Snapshotter` registers while it forms the group (and runs `on_rank`), and its *restore* waits for it. "
        "*first step*: -> every rank completed a step; the last row is kill -> every rank's first completed step.",
        "* **steps lost**: steps trained twice (the newest step completed before the kill minus the step restored).",
        "",
        "## Results",
        "",
        f"Median and range over the kills ({len(inp)} in place, {len(rst)} whole-job restarts).",
        "",
        "| in place | median s | range s | per kill |",
        "| --- | ---: | ---: | --- |",
    ]
    for key, name in [
        ("kill_to_sign", "kill -> first sign (`noticed`)"),
        ("detect", "detect (noticed -> decided)"),
        ("reform", "re-form (every member formed the group)"),
        ("restore", "restore (every rank)"),
        ("register", "  of which: the standby's `Snapshotter` still registering once the group formed"),
        ("first_step", "first step (every rank)"),
        ("kill_to_all_stepped", "**kill -> every rank's first completed step**"),
    ]:
        med, rng = _stat([r[key] for r in inp])
        lines.append(
            f"| {name} | {med} | {rng} | {', '.join('-' if r[key] is None else f'{r[key]:.2f}' for r in inp)} |"
        )
    med, rng = _stat([r["steps_lost"] for r in inp])
    lines.append(f"| steps lost (trained twice) | {med} | {rng} | {', '.join(str(r['steps_lost']) for r in inp)} |")
    lines += ["", "| whole-job restart | median s | range s | per kill |", "| --- | ---: | ---: | --- |"]
    for key, name in [
        ("detect", "detect (kill -> Ray declares the node dead)"),
        ("restart", "restart (every rank built)"),
        ("restore", "restore (every rank)"),
        ("first_step", "first step"),
        ("rto", "**kill -> first completed step**"),
    ]:
        med, rng = _stat([f.get(key) for f in rst])
        lines.append(f"| {name} | {med} | {rng} | {', '.join(f'{f[key]:.2f}' for f in rst)} |")
    med, rng = _stat([f.get("lost_steps") for f in rst])
    lines.append(f"| steps lost | {med} | {rng} | {', '.join(str(f['lost_steps']) for f in rst)} |")
    r = data["ratios"]
    if "error" in data["restart"]:
        lines += ["", f"The whole-job restart could not be measured in this run: {data['restart']['error']}"]
    if r:
        lines += [
            "",
            f"**Ratio, kill -> every rank trains again: whole-job restart / in place = "
            f"{r['total']:.1f}x** (medians: {r['restart_total']:.2f} s / {r['inplace_total']:.2f} s). "
            f"Leaving detection out of both (the whole-job restart's waits on Ray's health checks; the in-place "
            f"one on its own heartbeats and failed collectives): {r['after_detect']:.1f}x "
            f"({r['restart_after_detect']:.2f} s / {r['inplace_after_detect']:.2f} s).",
        ]
    lines += [
        "",
        f"Failure-free step: {data['inplace']['step_s']:.3f} s in place (rank 0, the mean of "
        f"{a['settle_steps']} steps before the first kill).",
        "",
        "### Per recovery, in place",
        "",
        "| kill | rank lost | restored step | tiers (rank: tier) | restore s per rank | survivors' pids before -> after |",
        "| ---: | ---: | ---: | --- | --- | --- |",
    ]
    for rec, s in zip(data["inplace"]["recoveries"], inp):
        tiers = ", ".join(f"{k}: {v}" for k, v in sorted(s["tiers"].items()))
        rs = ", ".join(f"{k}: {v:.2f}" if v is not None else f"{k}: -" for k, v in sorted(s["restore_s"].items()))
        pids = ", ".join(
            f"r{k} {rec['pids_before'][k]} -> {rec['pids'][k]}"
            for k in sorted(rec["pids_before"])
            if int(k) != rec["victim"]
        )
        lines.append(
            f"| {rec['kill']} | {rec['victim']} | {min(s['restored_step'].values())} | {tiers} | {rs} | "
            f"{pids} ({'unchanged' if s['pids_same'] else 'CHANGED'}) |"
        )
    phased = [(rec, s) for rec, s in zip(data["inplace"]["recoveries"], inp) if s.get("live_phases")]
    if phased:
        lines += [
            "",
            "Where each live takeover's *restore* went, per rank (s): *digest* (a holder's digest of its state at "
            "the step boundary, read in place), *agree* (the all-reduce of every rank's boundary and digests: it "
            "waits for the slowest member, the standby's `Snapshotter` registration included), *move* (each holder "
            "lays its slice out from its live tensors and sends it; the standby receives each large tensor's "
            "bytes straight into its own tensor and checks them), *apply* (a holder: its small state and RNGs put "
            "back to the boundary; the standby: the received state handed to its objects, the small tensors "
            "copied in, the RNGs set).",
            "",
            "| kill | " + " | ".join(f"rank {r}" for r in range(RANKS)) + " |",
            "| ---: |" + " --- |" * RANKS,
        ]
        for rec, s in phased:
            cells = []
            for r in range(RANKS):
                ph = s["live_phases"].get(r) or s["live_phases"].get(str(r)) or {}
                cells.append(" / ".join(f"{k} {ph[k]:.2f}" for k in ("digest", "agree", "move", "apply") if k in ph))
            lines.append(f"| {rec['kill']} | " + " | ".join(cells) + " |")
    warm = [e for e in data["inplace"]["standby_events"]]
    if warm:
        gaps = [e["t"] - rec["decided"] for e, rec in zip(warm, data["inplace"]["recoveries"])]
        lines += [
            "",
            "New standby warm (decided -> the controller's `standby` event): "
            + ", ".join(f"{g:.1f} s" for g in gaps)
            + " (in the background, on the fresh node).",
        ]
    cl = [i + 1 for i, s in enumerate(inp) if s["coordinator_lost"]]
    lines += [
        "",
        f"The memsnap coordinator actor ran on the killed node in kill(s) {', '.join(map(str, cl))}." if cl else "",
        "",
        "Snapshots before each kill (rank: captured, skipped as the pipeline was busy, since the "
        "generation began): "
        + "; ".join(
            f"kill {rec['kill']}: " + ", ".join(f"{k}: {v[0]}/{v[1]}" for k, v in rec["snapshots_before"].items())
            for rec in data["inplace"]["recoveries"]
        ),
    ]
    lines += ["", "Raw records: `" + out.with_suffix(".json").name + "` beside this file.", ""]
    out.write_text("\n".join(lines) + "\n" + data.get("notes", ""))


def ratios(inplace: dict, restart: dict) -> dict:
    inp = [summarise_inplace(r) for r in inplace["recoveries"]]
    rst = [f for f in restart["failures"] if "rto" in f]
    if not rst:
        return {}
    it = statistics.median(r["kill_to_all_stepped"] for r in inp)
    rt = statistics.median(f["rto"] for f in rst)
    ia = statistics.median(r["kill_to_all_stepped"] - r["kill_to_sign"] - r["detect"] for r in inp)
    ra = statistics.median(f["rto"] - f["detect"] for f in rst)
    return {
        "inplace_total": it,
        "restart_total": rt,
        "total": rt / it,
        "inplace_after_detect": ia,
        "restart_after_detect": ra,
        "after_detect": ra / ia,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-mb", type=int, default=256, help="state per rank, MiB")
    ap.add_argument("--step-s", type=float, default=0.3, help="simulated compute per step, seconds")
    ap.add_argument("--kills", type=int, default=3, help="nodes killed in a row, in each part")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--spill-every", type=int, default=10, help="memsnap's durable spill, steps")
    ap.add_argument("--settle-steps", type=int, default=5, help="steps trained before each in-place kill")
    ap.add_argument("--restart-gap-s", type=float, default=30.0, help="seconds between whole-job-restart kills")
    ap.add_argument("--out", default=str(RESULTS / "inplace.md"))
    ap.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.render:
        render(json.loads(out.with_suffix(".json").read_text()), out)
        return
    t0 = time.time()
    load_start = os.getloadavg()
    scratch = tempfile.mkdtemp(prefix="memsnap-inplace-scratch-")
    storage_root = tempfile.mkdtemp(prefix="memsnap-inplace-nfs-")
    state = args.state_mb * MIB
    cfg = {
        "state_mb": args.state_mb,
        "compute": "sleep",
        "step_s": args.step_s,
        "model_passes": 0,
        "seed": 21,
        "spill_every": args.spill_every,
        "spill_bytes_per_s": 256 << 20,
        "k": args.k,
        "m": args.m,
        "memory_budget": int(agent_ram(state, k=args.k, m=args.m, keep=2)) + (256 << 20),
        "node_mtbf_s": 3600.0,
        "scratch": scratch,
        "storage_root": storage_root,
    }
    from goodput_job import memsnap_options

    opts = memsnap_options(dict(cfg, interval="1", storage=os.path.join(storage_root, "inplace")))
    os.makedirs(opts["spill"])
    try:
        with LocalCluster(
            NODES, cpus_per_node=1, object_store_mb=96, system_config=goodput_timeline.HEALTH_CHECKS
        ) as lc:
            _say(f"in place: {args.kills} kills")
            inplace = run_inplace(lc, cfg, opts, args.kills, args.settle_steps)
            load_mid = os.getloadavg()
            _say(f"whole-job restart: {args.kills} kills")
            try:
                restart = run_restart(lc, cfg, args.kills, args.restart_gap_s)
            except Exception as exc:  # the in-place numbers still go to the file, with the reason
                restart = {"failures": [], "rate": None, "error": f"{type(exc).__name__}: {exc}"}
            for f in restart["failures"]:
                _say(f"  restart: { ({k: round(v, 2) if isinstance(v, float) else v for k, v in f.items()}) }")
        goodput.reap_children()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(storage_root, ignore_errors=True)
    cmd = "python bench/inplace.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "render")
    )
    data = {
        "args": vars(args),
        "command": cmd,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": time.time() - t0,
        "mem_gib": psutil.virtual_memory().total / (1 << 30),
        "state_mib": state / MIB,
        "load_start": load_start,
        "load_mid": load_mid,
        "load_end": os.getloadavg(),
        "options": {k: v for k, v in opts.items() if k != "spill"},
        "inplace": inplace,
        "restart": restart,
        "ratios": ratios(inplace, restart),
    }
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    render(data, out)
    _say(f"ratios: {data['ratios']}; written {out}")


if __name__ == "__main__":
    main()
