"""Soak of in-place recovery: many recoveries in a row on one job, and what the survivor holds.

    python bench/soak_inplace.py [--recoveries 100] [--state-mb 8]
        -> bench/results/soak_inplace.md + bench/results/soak_inplace.png

A 3-rank data-parallel job (``memsnap.inplace.InplaceJob``, a snapshot every step) on a
5-node loopback cluster: ranks on nodes 1-3, a warm standby on node 4. Each round kills the
process of rank 1 or rank 2 (alternately; SIGKILL, its node and agent stay), the standby
takes the rank, and the controller warms a new standby on the node the lost process left.
Rank 0's process is never killed: it goes through every recovery in place, and its RSS,
threads and file descriptors, the job's shared-memory files and the rendezvous store's key
count are sampled after each one. Nothing may grow: a leak per recovery shows as a slope.
Every recovery's split (detect, re-form, restore, first step) is recorded too.

The state is small on purpose (a leak is per recovery, not per byte, and 100 recoveries must
fit in minutes on 2 cores; bench/inplace.py measures recovery at 256 MiB per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH")) if p)

import psutil  # noqa: E402

from memsnap.localcluster import LocalCluster, wait_for  # noqa: E402
from memsnap.memory import shmdir  # noqa: E402

WIDTH = 256


def setup(ctx):
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mb = int(os.environ.get("SOAK_STATE_MB", "8"))
    bulk = torch.zeros(max(1, (mb << 20) // 4 - 3 * sum(p.numel() for p in model.parameters())))
    return {"model": model, "optim": opt, "extra": {"bulk": bulk}}


def train(ctx, state):
    import torch
    import torch.distributed

    store = ctx.store
    model, opt = state["model"], state["optim"]
    step = ctx.restore(state)

    def go_on() -> bool:  # every rank stops at the same step (one that stopped alone would be a loss)
        flag = torch.tensor([0.0 if store.check(["soak/stop"]) else 1.0])
        ctx.all_reduce(flag, torch.distributed.ReduceOp.MIN)
        return flag.item() > 0

    while go_on():
        g = torch.Generator().manual_seed(7919 * (ctx.rank + 1) + step)
        loss = model(torch.randn(8, WIDTH, generator=g)).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        ctx.average_gradients(model.parameters())
        opt.step()
        ctx.save(step, state)
        store.set(f"soak/progress/{ctx.rank}", str(step))
        step += 1
        time.sleep(0.05)  # a stand-in for the step's compute
    return step


def shm_files(job: str) -> int:
    """The job's shared-memory files (every agent's arenas) on this machine."""
    return len(shmdir.arena_files(job))


def shm_layout(job: str) -> str:
    """Which node's agent holds arenas of which ranks (and how many files each)."""
    from collections import Counter

    from memsnap import naming

    held: Counter[tuple[str, int]] = Counter()
    for path in shmdir.arena_files(job):
        parts = naming.parse_arena(os.path.basename(path))
        if parts is not None:
            held[(parts["node"][:6], parts["rank"])] += 1
    return ", ".join(f"node {n} rank {r}: {c}" for (n, r), c in sorted(held.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recoveries", type=int, default=100)
    ap.add_argument("--state-mb", type=int, default=8)
    ap.add_argument("--out", default=str(HERE / "results" / "soak_inplace.md"))
    a = ap.parse_args()
    os.environ["SOAK_STATE_MB"] = str(a.state_mb)

    job = f"soak-inplace-{uuid.uuid4().hex[:6]}"
    samples: list[dict] = []
    splits: list[dict] = []
    t0 = time.time()
    try:
        soak(a, job, samples, splits)
        stopped = None
    except Exception as exc:  # the report still says what was measured, and why it stopped
        stopped = f"{type(exc).__name__}: {exc}"[:400]
        print("the soak stopped early:", stopped, flush=True)
    if samples:
        report(a, samples, splits, time.time() - t0, stopped)
    if stopped:
        sys.exit(1)


def soak(a, job: str, samples: list[dict], splits: list[dict]) -> None:
    import memsnap
    from memsnap.inplace import InplaceJob

    with LocalCluster(nodes=5) as lc:
        nodes = [n.node_id for n in lc.nodes]
        j = InplaceJob(
            job,
            setup,
            train,
            rank_nodes=nodes[1:4],
            standby_nodes=[nodes[4]],
            options=dict(k=1, m=1, keep=2, memory_budget=max(64, 12 * a.state_mb) << 20, every_steps=1),
        )
        import threading

        out: dict[str, dict] = {}
        runner = threading.Thread(target=lambda: out.update(r=j.run(timeout_s=24 * 3600)), daemon=True)
        runner.start()
        try:

            def stepped(rank, beyond):
                key = f"soak/progress/{rank}"
                return j.store is not None and j.store.check([key]) and int(j.store.get(key)) > beyond

            wait_for(lambda: stepped(0, 3), timeout=600, what="the job to start")
            assert j.store is not None  # run() made it: the job has started
            survivor = psutil.Process(j.members()[0]["pid"])
            for i in range(a.recoveries):
                wait_for(lambda: bool(j._standbys), timeout=600, what="a warm standby")
                victim = 1 + i % 2
                pid = j.members()[victim]["pid"]
                at = int(j.store.get("soak/progress/0"))
                psutil.Process(pid).kill()
                wait_for(lambda i=i: len(j.recoveries) > i, timeout=120, what=f"recovery {i + 1}")
                wait_for(
                    lambda at=at: all(stepped(r, at + 2) for r in range(3)),
                    timeout=300,
                    what=f"every rank to train on after recovery {i + 1}",
                )
                rec = j.collect()[i]
                splits.append(dict(rec["split"], tiers=rec["tiers"]))
                with survivor.oneshot():
                    samples.append(
                        {
                            "recovery": i + 1,
                            "rss_mb": survivor.memory_info().rss / 2**20,
                            "threads": survivor.num_threads(),
                            "fds": survivor.num_fds(),
                            "shm_files": shm_files(job),
                            "store_keys": j.store.num_keys(),
                            "pid": survivor.pid,
                            "shm_layout": shm_layout(job),
                        }
                    )
                s = samples[-1]
                print(
                    f"recovery {i + 1}: rank {victim} lost; split "
                    + ", ".join(f"{k} {v:.3f}" for k, v in rec["split"].items() if v is not None)
                    + f"; survivor rss {s['rss_mb']:.1f} MiB threads {s['threads']} fds {s['fds']} "
                    f"shm files {s['shm_files']}",
                    flush=True,
                )
            j.store.set("soak/stop", "1")
            runner.join(timeout=600)
        finally:
            if j.store is not None:
                j.store.set("soak/stop", "1")
            runner.join(timeout=120)
            memsnap.shutdown(job, timeout=30)


def tier_summary(splits: list[dict]) -> str:
    """How many recoveries took the live state (every rank ``kept`` or ``live``) and how many
    rolled back, from each recovery's tiers."""
    live = sum(1 for s in splits if set((s.get("tiers") or {}).values()) <= {"kept", "live"})
    return f"{live} of {len(splits)} recoveries took a survivor's live state (nothing rolled back)" + (
        f", {len(splits) - live} rolled back to a committed step" if live < len(splits) else ""
    )


def report(a, samples, splits, wall_s, stopped: str | None = None) -> None:
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    first, last = samples[min(1, len(samples) - 1)], samples[-1]

    def med(key):
        vals = [s[key] for s in splits if s.get(key) is not None]
        return (statistics.median(vals), min(vals), max(vals)) if vals else (float("nan"),) * 3

    lines = [
        "# In-place recovery soak",
        "",
        f"`python bench/soak_inplace.py --recoveries {a.recoveries} --state-mb {a.state_mb}` "
        f"on a 2-core machine, {wall_s / 60:.1f} min. Rank 0's process (pid {last['pid']}) went through every "
        f"recovery in place; a rank 1 or 2 process was SIGKILLed each round and a standby took its rank.",
        "",
        *(
            [f"**The soak stopped after {len(samples)} of {a.recoveries} recoveries**: {stopped}", ""]
            if stopped
            else []
        ),
        "| after recovery | survivor RSS (MiB) | threads | fds | /dev/shm files | store keys |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows = [samples[0], first, *samples[9::10], last]
    for s in [s for i, s in enumerate(rows) if s not in rows[:i]]:
        lines.append(
            f"| {s['recovery']} | {s['rss_mb']:.1f} | {s['threads']} | {s['fds']} | {s['shm_files']} "
            f"| {s['store_keys']} |"
        )
    lines += [
        "",
        f"Growth from recovery {first['recovery']} to {last['recovery']}: RSS "
        f"{last['rss_mb'] - first['rss_mb']:+.1f} MiB, threads {last['threads'] - first['threads']:+d}, "
        f"fds {last['fds'] - first['fds']:+d}, /dev/shm files {last['shm_files'] - first['shm_files']:+d}"
        + (
            f"; over the second half (recovery {half['recovery']} to {last['recovery']}): RSS "
            f"{last['rss_mb'] - half['rss_mb']:+.1f} MiB, /dev/shm files {last['shm_files'] - half['shm_files']:+d}."
            if (half := samples[len(samples) // 2]) is not last
            else "."
        ),
        "",
        f"How the ranks came back: {tier_summary(splits)}.",
        "",
        f"The /dev/shm files after recovery {first['recovery']}: {first['shm_layout']}; after the last: "
        f"{last['shm_layout']}.",
        "",
        "| phase | median (s) | min | max |",
        "| --- | --- | --- | --- |",
    ]
    for key in ("detect", "reform", "restore", "first_step", "total"):
        m, lo, hi = med(key)
        lines.append(f"| {key} | {m:.3f} | {lo:.3f} | {hi:.3f} |")
    lines += [
        "",
        "`detect` runs from the controller's first sign (a failed collective or a missed beat) to its "
        "decision; `total` from the first sign to every rank's first step of the new generation. The "
        "store's keys grow by a few per generation (its membership and reports), by design: they are "
        "small and the store lives as long as the job.",
    ]
    out.write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(12, 3.2))
        xs = [s["recovery"] for s in samples]
        for axis, key, label in zip(ax, ("rss_mb", "threads", "fds"), ("RSS (MiB)", "threads", "fds")):
            axis.plot(xs, [s[key] for s in samples])
            axis.set_xlabel("recoveries")
            axis.set_ylabel(label)
            axis.set_ylim(bottom=0)
        fig.suptitle("the surviving rank's process across in-place recoveries")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=90)
    except Exception as exc:
        print("no plot:", exc)
    print(out.read_text())
    print(json.dumps({"samples": len(samples)}))


if __name__ == "__main__":
    main()
