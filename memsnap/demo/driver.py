"""The demo's driver: cluster, job, failure injection, measurements and report.

By default the job recovers in place (``inplace_driver``: the survivors keep their processes,
a warm standby takes the lost rank). With ``mode="restart"`` it runs under Ray Train, which
restarts the whole worker group after a loss; timeline of one such failure (all times on the
driver's clock):

    kill      the victim node's raylet, workers and agent are SIGKILLed
    detect    Ray's GCS marks the node dead (health checks; see localcluster.py)
    restart   every rank of the new worker group is running ``train_loop_per_worker`` again
    restore   every rank has loaded the restored step (the lost rank from peers' RAM)
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

from memsnap.demo.model import ModelConfig
from memsnap.demo.run import DemoOptions, Failure, Run, held_at, pick_victim, say
from memsnap.demo.train import TrainConfig, read_final, read_log
from memsnap.demo.worker import gate_path, read_events, train_loop_per_worker


def _train_config(opts: DemoOptions, log_path: str) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig.sized(opts.model),
        steps=opts.steps,
        seed=opts.seed,
        log_path=log_path,
        batch=8,
        frozen_mib=opts.frozen_mib,
    )


def _trainer(opts: DemoOptions, run: Run, spill_uri: str):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {
        "train": _train_config(opts, run.log_path).to_json(),
        "events": run.events_path,
        "job": opts.job,
        "out": os.path.abspath(opts.out),
        "failure_steps": list(opts.failure_steps),
        "steps": opts.steps,
        "snapshotter": {"k": opts.k, "m": opts.m, "spill": spill_uri, "spill_every": opts.spill_every},
    }
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=opts.nodes, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(
            storage_path=os.path.join(os.path.abspath(opts.out), "ray-train"),
            name=opts.job,
            failure_config=FailureConfig(max_failures=len(opts.failure_steps) + 1),
        ),
    )


def _fit(trainer, run: Run) -> None:
    try:
        run.result = trainer.fit()
    except BaseException as exc:  # reported by the main thread
        run.error = exc


def _node_dead(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and not n["Alive"] for n in ray.nodes())


def _drive(cluster, run: Run, thread: threading.Thread, bar) -> None:
    """Watch training; kill a node at each failure step; return when the job ends."""
    opts = run.opts
    head = cluster.nodes[0].node_id
    pending = list(opts.failure_steps)
    deadline = time.monotonic() + opts.timeout_s
    while thread.is_alive():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the demo's training did not finish within {opts.timeout_s:.0f} s")
        losses = read_log(run.log_path)
        done = max(losses, default=-1) + 1
        if bar.n != done:
            bar.n = done
            bar.refresh()
        for f in run.failures:
            if f.t_dead is None and _node_dead(f.node):
                f.t_dead = time.time()
                say(f"Ray marked node {f.node[:8]} dead after {f.t_dead - f.t_kill:.1f} s")
        held = held_at(run, pending[0]) if pending else None
        if held is not None:
            victim = pick_victim(cluster, read_events(run.events_path), head)
            if victim is not None:
                rank, node_id, node = victim
                pending.pop(0)
                say(f"step {held} committed: killing node {node_id[:8]} (rank {rank}) abruptly")
                run.failures.append(Failure(held, rank, node_id, time.time()))
                cluster.kill_node(node)
                cluster.add_node()
                say("added a replacement node")
                with open(gate_path(os.path.abspath(opts.out), held), "w"):
                    pass  # the surviving ranks go on and fail in their next collective
        time.sleep(0.1)


def _after(events: list[dict], kind: str, t: float) -> list[dict]:
    return [e for e in events if e["ev"] == kind and e["t"] > t]


def recovery(run: Run, f: Failure, until: float) -> dict:
    """Detection / restart / restore seconds of failure ``f`` (events before ``until``)."""
    events = [e for e in read_events(run.events_path) if e["t"] < until]
    starts = _after(events, "start", f.t_kill)
    restores = _after(events, "restored", f.t_kill)
    t_dead = f.t_dead or (min(e["t"] for e in starts) if starts else f.t_kill)
    lost = [e for e in restores if e["rank"] == f.rank]
    out = {
        "detect": t_dead - f.t_kill,
        "restart": (max(e["t"] for e in starts) - t_dead) if starts else None,
        "restore": max(e["wall"] for e in restores) if restores else None,
        "tier": lost[0]["tier"] if lost else None,
        "restored_step": lost[0]["step"] if lost else None,
        "restore_phases": lost[0]["seconds"] if lost else {},
        "restore_bytes": lost[0].get("nbytes") if lost else None,
        "restoring_ranks": len(restores),
    }
    return out


def disk_restore(opts: DemoOptions, spill_uri: str, rank: int) -> dict:
    """``rank``'s bytes of the newest spilled step, read as a replacement node reads them:
    from the spill directory, page cache dropped (``disk.cold_restore``)."""
    from memsnap.demo.disk import cold_restore
    from memsnap.demo.train import build, snapshot_state
    from memsnap.durable.storage import Store

    step = Store.open(spill_uri).latest()
    objs = build(_train_config(opts, ""), rank, opts.nodes, ddp=False)
    return cold_restore(spill_uri, step, rank, snapshot_state(objs))


def run_demo(opts: DemoOptions, *, progress: bool = True) -> dict:
    """Run the whole demo; return the report (see ``memsnap demo --json``)."""
    from tqdm import tqdm

    from memsnap.demo.reference import reference_losses
    from memsnap.localcluster import LocalCluster

    t_start = time.time()
    out = os.path.abspath(opts.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run = Run(opts, os.path.join(out, "losses.jsonl"), os.path.join(out, "events.jsonl"))
    spill_uri = os.path.join(out, "spill")
    ref: dict = {}
    ref_thread = threading.Thread(
        target=lambda: ref.update(
            reference_losses(_train_config(opts, ""), opts.nodes, os.path.join(out, "reference.jsonl"))
        ),
        daemon=True,
    )
    say(f"starting a {opts.cluster_nodes}-node Ray cluster on 127.0.0.1")
    job_out = None
    with LocalCluster(opts.cluster_nodes) as cluster:
        try:
            say("starting the reference run that never fails (plain gloo processes, no Ray)")
            ref_thread.start()
            with tqdm(total=opts.steps, desc="training", unit="step", disable=not progress, file=sys.stderr) as bar:
                if opts.mode == "inplace":
                    from memsnap.demo import inplace_driver

                    say(
                        f"training {opts.steps} steps on {opts.nodes} Ray actors that recover in place, "
                        f"{len(opts.failure_steps)} warm standby(s); snapshot every step into peers' RAM with "
                        f"RS({opts.k},{opts.m}); node kills after steps {list(opts.failure_steps)}"
                    )
                    job_out = inplace_driver.run_job(
                        opts, run, cluster, _train_config(opts, run.log_path).to_json(), spill_uri, bar
                    )
                else:
                    say(
                        f"training {opts.steps} steps with Ray Train on {opts.nodes} workers, snapshot every "
                        f"step into peers' RAM with RS({opts.k},{opts.m}); node kills after steps "
                        f"{list(opts.failure_steps)}; Ray Train restarts the worker group"
                    )
                    thread = threading.Thread(target=_fit, args=(_trainer(opts, run, spill_uri), run), daemon=True)
                    thread.start()
                    _drive(cluster, run, thread, bar)
                    thread.join()
            if run.error is not None:
                raise run.error
            t_end = time.time()
            victim = run.failures[0].rank if run.failures else 1
            say(f"reading rank {victim}'s bytes back from the spill directory, page cache dropped")
            disk = disk_restore(opts, spill_uri, victim)
        finally:
            _cleanup(opts.job)
    ref_thread.join(timeout=opts.timeout_s)
    return _report(opts, run, ref, t_end, disk, out, time.time() - t_start, job_out)


def _cleanup(job: str) -> None:
    from memsnap import snapshotter
    from memsnap.memory import shmdir

    try:
        snapshotter.shutdown(job, timeout=10)
    except Exception as exc:
        say(f"agent shutdown: {exc}")
    try:
        shmdir.remove_job(job)
    except OSError as exc:
        say(f"removing arenas: {exc}")


RECOVERY_KEYS = {
    "inplace": ("first_sign", "detect", "reform", "restore", "first_step", "total"),
    "restart": ("detect", "restart", "restore"),
}


def _report(opts, run, ref, t_end, disk, out, total, job_out=None) -> dict:
    from memsnap.demo.plot import plot_losses

    losses = read_log(run.log_path)
    identical = bool(ref) and sorted(losses) == sorted(ref) and all(losses[s].hex() == ref[s].hex() for s in ref)
    final, ref_final = read_final(run.log_path), read_final(os.path.join(out, "reference.jsonl"))
    if job_out is not None:
        from memsnap.demo.inplace_driver import recoveries

        recs = recoveries(run, job_out)
    else:
        recs = []
        for i, f in enumerate(run.failures):
            until = run.failures[i + 1].t_kill if i + 1 < len(run.failures) else t_end
            recs.append({"failure_step": f.step, "rank": f.rank, **recovery(run, f, until)})
    first = recs[0] if recs else {}
    plot = plot_losses(
        ref,
        losses,
        [f.step for f in run.failures],
        os.path.join(out, "loss.png"),
        [r.get("restored_step") for r in recs],
    )
    return {
        "failure_step": first.get("failure_step"),
        "resumed_from_step": first.get("restored_step"),
        "restore_tier": first.get("tier"),
        "bitwise_identical": identical,
        "final_params_identical": len(final) == opts.nodes and final == ref_final,
        "mode": opts.mode,
        "recovery_seconds": {k: first.get(k) for k in RECOVERY_KEYS[opts.mode]},
        "survivors_kept_their_processes": all(r.get("survivors_kept_their_processes", False) for r in recs)
        if opts.mode == "inplace" and recs
        else None,
        "restore_phases": first.get("restore_phases", {}),
        "disk_restore_seconds": disk["seconds"],
        "disk_restore_step": disk["step"],
        "final_spill": next((e for e in read_events(run.events_path) if e["ev"] == "final"), None),
        "restore_compare": compare(opts, first, disk),
        "failures": recs,
        "steps": opts.steps,
        "frozen_mib": opts.frozen_mib,
        "nodes": opts.nodes,
        "k": opts.k,
        "m": opts.m,
        "plot": plot,
        "total_seconds": total,
    }


def _gib_s(nbytes: int | None, seconds: float | None) -> float | None:
    return nbytes / seconds / (1 << 30) if nbytes and seconds else None


def compare(opts: DemoOptions, lost: dict, disk: dict) -> dict:
    """The lost rank's restore from peers against the same rank's bytes from the durable
    tier, like with like: bytes into the live tensors, verified, from the moment the rank
    knows what to load (the peer side leaves out the plan, the wait for every rank to ask)."""
    phases = lost.get("restore_phases") or {}
    peer_s = sum(phases.get(k, 0.0) for k in ("fetch", "apply")) or None
    peer = {
        "tier": lost.get("tier"),
        "step": lost.get("restored_step"),
        "bytes": lost.get("restore_bytes"),
        "seconds": peer_s,
        "gib_per_s": _gib_s(lost.get("restore_bytes"), peer_s),
        "restoring_ranks": lost.get("restoring_ranks"),
    }
    out = {"peer": peer, "disk": disk, "why_disk_wins": []}
    if peer["gib_per_s"] is not None and disk["gib_per_s"] > peer["gib_per_s"]:
        out["why_disk_wins"] = why_disk_wins(opts, peer, disk)
    return out


SMALL_STATE = 16 << 20  # below this a restore's time is mostly fixed costs


def why_disk_wins(opts: DemoOptions, peer: dict, disk: dict) -> list[str]:
    """What made this machine's disk look faster than its peers' RAM, from what was measured."""
    cpus = os.cpu_count() or 1
    around = "the survivors rolled back beside it" if opts.mode == "inplace" else "Ray restarted the worker group"
    why = [
        f"the peer restore ran while {peer['restoring_ranks']} ranks restored at once and "
        f"{around}, all on this machine's {cpus} cores: the holders' sends, TCP on "
        f"loopback, frame authentication and the RS({opts.k},{opts.m}) decode took turns with them; "
        "the disk read ran alone, after training"
    ]
    if (peer["bytes"] or 0) < SMALL_STATE:
        why.append(
            f"at {peer['bytes'] / (1 << 20):.1f} MiB a restore is mostly fixed costs (connecting to "
            "the holders, the manifest, waiting for each round trip), not bytes; a realistic state "
            "(--frozen-mib 128 or more) shows the rates"
        )
    if disk["cached_pages_before"]:
        why.append(
            f"{disk['cached_pages_before']} of {disk['pages']} pages of the file were still cached "
            "when the read began (the kernel kept them despite the drop request)"
        )
    why.append(
        "the durable tier here is a local disk read by one process; in a job every replacement "
        "node (after a wider failure, every rank) reads the shared storage at once and divides "
        "its bandwidth, while peers' RAM grows with the job: each node serves its own chunks"
    )
    return why
