"""The demo recovering in place (the default): ``memsnap.inplace.InplaceJob`` on plain Ray actors.

Layout: the head node hosts the controller (the rendezvous store) and the memsnap coordinator
and runs no rank; ``nodes`` nodes run one rank each; one warm standby per planned failure waits
on a spare node, its model already built. At each failure step every rank holds once the step
has committed; the driver kills one rank's node hard (its raylet and every process under it).
The survivors' next all-reduce fails, the controller fences the node, the survivors roll back
in their own processes from their node's RAM and a standby takes the lost rank from its
peers' RAM. The recovery's split (detect, re-form, restore, first step) is the controller's.
"""

from __future__ import annotations

import functools
import os
import threading
import time

from memsnap.demo.inplace_worker import setup, train
from memsnap.demo.run import Failure, Run, held_at, pick_victim, say
from memsnap.demo.train import read_log
from memsnap.demo.worker import gate_path, read_events


def run_job(opts, run: Run, cluster, train_config: dict, spill_uri: str, bar) -> dict:
    """Train to the end with in-place recoveries; returns ``{"failures": [...], "digests": ...}``."""
    from memsnap.inplace import InplaceJob

    head, rank_nodes = cluster.nodes[0], cluster.nodes[1 : 1 + opts.nodes]
    spares = cluster.nodes[1 + opts.nodes :]
    config = {
        "train": train_config,
        "events": run.events_path,
        "out": os.path.abspath(opts.out),
        "failure_steps": list(opts.failure_steps),
        "steps": opts.steps,
        "world": opts.nodes,
    }
    options = {"k": opts.k, "m": opts.m, "spill": spill_uri, "spill_every": opts.spill_every, "preemption": False}
    job = InplaceJob(
        opts.job,
        functools.partial(setup, config),
        functools.partial(train, config),
        rank_nodes=[n.node_id for n in rank_nodes],
        standby_nodes=[n.node_id for n in spares],
        options=options,
        on_no_standby="fail",
        events=os.path.join(os.path.abspath(opts.out), "recoveries.jsonl"),
    )
    out: dict = {}

    def fit() -> None:
        try:
            out["results"] = job.run(timeout_s=opts.timeout_s)
        except BaseException as exc:  # reported by the driver's thread
            run.error = exc

    thread = threading.Thread(target=fit, daemon=True, name="memsnap-demo-job")
    thread.start()
    pids: list[dict[int, int]] = []
    pending = list(opts.failure_steps)
    deadline = time.monotonic() + opts.timeout_s
    while thread.is_alive():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the demo's training did not finish within {opts.timeout_s:.0f} s")
        done = max(read_log(run.log_path), default=-1) + 1
        if bar.n != done:
            bar.n = done
            bar.refresh()
        held = held_at(run, pending[0]) if pending else None
        if held is not None:
            victim = pick_victim(cluster, read_events(run.events_path), head.node_id)
            if victim is not None:
                rank, node_id, node = victim
                pending.pop(0)
                pids.append({r: info["pid"] for r, info in job.members().items()})
                say(f"step {held} committed: killing node {node_id[:8]} (rank {rank}) hard")
                run.failures.append(Failure(held, rank, node_id, time.time()))
                cluster.kill_node_hard(node)
                with open(gate_path(os.path.abspath(opts.out), held), "w"):
                    pass  # the surviving ranks go on and fail in their next all-reduce
        thread.join(timeout=0.1)
    if run.error is not None:
        raise run.error
    return {"recoveries": job.collect(), "pids_before": pids, "digests": out.get("results", {})}


def recoveries(run: Run, job_out: dict) -> list[dict]:
    """One record per failure: the controller's split, the lost rank's restore, and whether
    every survivor kept its process."""
    events = read_events(run.events_path)
    recs = []
    for f, rec, before in zip(run.failures, job_out["recoveries"], job_out["pids_before"]):
        rank = f.rank
        lost = [e for e in events if e["ev"] == "restored" and e["rank"] == rank and e["t"] > f.t_kill]
        restores = [e for e in events if e["ev"] == "restored" and e["t"] > f.t_kill and e.get("gen") == rec["gen"]]
        split = rec["split"]
        survivors = {int(r): p for r, p in before.items() if int(r) != rank}
        after = {int(r): p for r, p in rec["pids"].items()}
        recs.append(
            {
                "failure_step": f.step,
                "rank": rank,
                "detect": split["detect"] + (rec["noticed"] - f.t_kill),  # kill -> decided
                "first_sign": rec["noticed"] - f.t_kill,
                "reform": split["reform"],
                "restore": split["restore"],
                "first_step": split["first_step"],
                "total": None if split["total"] is None else split["total"] + rec["noticed"] - f.t_kill,
                "tier": lost[0]["tier"] if lost else None,
                "restored_step": lost[0]["step"] if lost else None,
                "restore_phases": lost[0]["seconds"] if lost else {},
                "restore_bytes": lost[0].get("nbytes") if lost else None,
                "restoring_ranks": len(restores),
                "survivor_tiers": {r: t for r, t in rec["tiers"].items() if int(r) != rank},
                "survivor_pids": {r: [p, after.get(r)] for r, p in survivors.items()},
                "survivors_kept_their_processes": all(after.get(r) == p for r, p in survivors.items()),
                "takeover": rec["takeover"],
            }
        )
    return recs
