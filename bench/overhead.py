"""Training throughput with and without snapshots, side by side in one run; the ``save()``
stall of the first snapshots against steady state; the agents' CPU per GiB snapshotted.

A 4-node job on a simulated local Ray cluster: one training actor per node trains the demo's
model (memsnap/demo/model.py), optionally with a frozen table beside it (``--frozen-mib``: the
demo's stand-in for a realistic state size; one table per size). Every configuration runs on
all four ranks at once, in interleaved rounds (the order rotates every round) so machine noise
hits them alike. The first round warms every configuration up (files created, DCP's process
group) and is not counted; each later round gives every configuration's steps/s relative to
``none`` in the same round, and the median of those ratios is reported:

    none              no checkpointing
    memsnap/1         memsnap.Snapshotter.save every step (RS(2,1), every_steps=1)
    memsnap/10        memsnap every 10 steps (every_steps=10; left out from 64 MiB of frozen
                      state on: a second job's arenas would double the RAM the bench holds)
    torch.save/10     torch.save + fsync every 10 steps
    dcp.async/10      torch.distributed.checkpoint.async_save every 10 steps

Before the rounds, the memsnap/1 job starts the way a training job does (``Snapshotter``,
then ``restore`` on every rank, which has the agents make the arena slots ahead) and takes
``--first-saves`` snapshots one at a time (save, then wait for the commit): the ``save()``
stall and the agents' CPU time (psutil, user + system, of this job's agent processes) of each
is recorded, so the first ``keep+1`` (fresh arena slots) can be set against later ones.

    python bench/overhead.py [--steps 100] [--rounds 5] [--models small] [--frozen-mib 0 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, cast

import psutil
import ray

if TYPE_CHECKING:
    from concurrent.futures import Future

    from memsnap.rank import Snapshotter

NODES = 4
CONFIGS = ["none", "memsnap/1", "memsnap/10", "torch.save/10", "dcp.async/10"]
LARGE_MIB = 64  # from this frozen size on, memsnap/10 is left out (RAM)
KEEP = 2  # the Snapshotter's default (--keep): keep+1 arena slots per rank
BUDGET = 4 << 30  # each agent's memory_budget, the Snapshotter's default (--memory-budget-gib)


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int, model: str, frozen_mib: float, work: str, keep: int = KEEP, budget: int = BUDGET):
        import torch

        from memsnap.demo.model import ModelConfig
        from memsnap.demo.train import TrainConfig

        torch.set_num_threads(1)
        self.rank, self.work, self.keep, self.budget = rank, work, keep, budget
        self.job = f"bench-overhead-{model}-{frozen_mib:g}"
        self.cfg = TrainConfig(model=ModelConfig.sized(model), batch=8, frozen_mib=frozen_mib)
        self.snaps: dict[int, Snapshotter] = {}
        self.next_step = 0  # step numbers keep rising across runs: a Snapshotter skips steps it has passed
        self.objs: dict[str, Any] | None = None

    def snapshotter(self, every: int):
        from memsnap.rank import Snapshotter

        if every not in self.snaps:
            self.snaps[every] = Snapshotter(
                job=f"{self.job}-{every}",
                rank=self.rank,
                world_size=NODES,
                k=2,
                m=1,
                keep=self.keep,
                memory_budget=self.budget,
                every_steps=every,
                preemption=False,
            )
        return self.snaps[every]

    def start(self, every: int) -> int:
        """(every rank at once) Join job ``every`` and restore (nothing yet): what a training
        job does first; the agents then make this rank's arena slots. Returns the state's bytes."""
        from memsnap.demo.train import build, snapshot_state
        from memsnap.state.capture import plan

        self.objs = build(self.cfg, self.rank, NODES, ddp=False)
        snap = self.snapshotter(every)
        snap.restore(snapshot_state(self.objs))
        return plan(snapshot_state(self.objs)).nbytes

    def one_save(self, every: int) -> dict:
        """One snapshot of the state ``start`` built, then wait for its commit."""
        from memsnap.demo.train import snapshot_state

        assert self.objs is not None, "start() builds the state"
        snap, step = self.snaps[every], self.next_step
        self.next_step += 1
        t = time.perf_counter()
        captured = snap.save(step, snapshot_state(self.objs))
        stall = time.perf_counter() - t
        committed = snap.wait(step, timeout=120)
        return {"step": step, "stall": stall, "captured": captured, "committed": committed == step}

    def drop_state(self) -> None:
        self.objs = None  # (the rounds build their own; this one would hold the RAM twice)

    def run(self, name: str, steps: int) -> dict:
        from memsnap.demo.train import TrainConfig, build, run, snapshot_state

        cfg = TrainConfig.from_json({**self.cfg.to_json(), "steps": steps + 3})
        objs = build(cfg, self.rank, NODES, ddp=False)
        run(TrainConfig.from_json({**cfg.to_json(), "steps": 3}), self.rank, 1, objs=objs)  # warm-up
        saver, stalls = self._saver(name), []
        base = self.next_step - 3  # the timed steps 3.. are saved as base+3.. (>= every step saved so far)
        self.next_step += steps + 10

        def after_step(s: int, o) -> None:
            t = time.perf_counter()
            if saver(base + s, snapshot_state(o)):
                stalls.append(time.perf_counter() - t)

        t = time.perf_counter()
        run(cfg, self.rank, 1, first_step=3, objs=objs, after_step=after_step)
        finish = getattr(saver, "finish", None)
        if finish:
            finish()
        return {"sps": steps / (time.perf_counter() - t), "stalls": stalls}

    def _saver(self, name: str):
        if name == "none":
            return lambda step, state: None
        if name.startswith("memsnap"):
            snap = self.snapshotter(int(name.split("/")[1]))
            return snap.save
        if name == "torch.save/10":

            def torch_save(step: int, state) -> bool:
                if step % 10 != 9:
                    return False
                self._torch_save(state)
                return True

            return torch_save
        return DcpAsync(os.path.join(self.work, f"dcp-{self.rank}-{time.monotonic_ns()}"))

    def _torch_save(self, state) -> None:
        import torch

        path = os.path.join(self.work, f"ckpt-{self.rank}.pt")
        with open(path, "wb") as f:
            torch.save({k: v.state_dict() for k, v in state.items()}, f)
            f.flush()
            os.fsync(f.fileno())

    def arena_bytes(self, every: int) -> int:
        """Bytes of arena the job's agents hold (the slots made so far, on every node)."""
        return self.snaps[every].status()["bytes"]["local"]

    def status(self) -> dict:
        return {
            str(e): {k: s.status().get(k) for k in ("committed_step", "failed_saves", "skipped_busy")}
            for e, s in self.snaps.items()
        }


class DcpAsync:
    """``dcp.async_save`` of model + optimizer (+ frozen table) every 10 steps (a world of one per rank)."""

    def __init__(self, root: str):
        import torch.distributed as dist

        if not dist.is_initialized():
            from memsnap.localcluster import free_port

            port = free_port()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        self.root = root
        self.future: Future | None = None

    def __call__(self, step: int, state) -> bool:
        import torch.distributed.checkpoint as dcp

        if step % 10 != 9:
            return False
        if self.future is not None:
            self.future.result()
        sd = {k: state[k].state_dict() for k in ("model", "optim", "frozen") if k in state}
        # with no async_stager, staging is synchronous and async_save returns the upload's Future
        self.future = cast("Future", dcp.async_save(sd, checkpoint_id=os.path.join(self.root, f"step{step}")))
        return True

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()


def main() -> None:
    global KEEP, BUDGET
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="counted rounds, after one warm-up round")
    ap.add_argument("--models", nargs="+", default=["small"], help="demo model sizes")
    ap.add_argument(
        "--frozen-mib",
        nargs="+",
        type=float,
        default=[0.0, 256.0],
        help="MiB of frozen state per rank beside the model; one table per model and size",
    )
    ap.add_argument("--first-saves", type=int, default=12, help="snapshots taken one at a time before the rounds")
    ap.add_argument(
        "--memory-budget-gib",
        type=float,
        default=BUDGET / (1 << 30),
        help="each agent's memory_budget; the agents' pools of held chunks grow up to it",
    )
    ap.add_argument(
        "--keep",
        type=int,
        default=KEEP,
        help="committed versions each agent keeps (keep+1 arena slots per rank; less RAM with 1)",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "overhead.md"))
    args = ap.parse_args()
    KEEP, BUDGET = args.keep, int(args.memory_budget_gib * (1 << 30))

    from memsnap.localcluster import LocalCluster

    # Ray's memory monitor counts the agents' shared-memory arenas in every process that maps
    # them and, on a machine shared with other work, killed agents at 256 MiB per rank
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    sections, load = [], [os.getloadavg()]
    with LocalCluster(NODES) as cluster:
        for model in args.models:
            for mib in args.frozen_mib:
                sections.append(measure(cluster, model, mib, args, load))
                write(sections, args, load)  # each table as soon as it is measured
    load.append(os.getloadavg())
    write(sections, args, load)


def agent_pids(cluster) -> set[int]:
    """The memsnap agents of ``cluster`` (children of its raylets whose title is
    ``ray::SnapshotAgent``), so other clusters on the machine are not counted."""
    pids = set()
    for node in cluster.nodes:
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        for p in raylet.children(recursive=True):
            try:
                if " ".join(p.cmdline()).startswith("ray::SnapshotAgent"):
                    pids.add(p.pid)
            except psutil.Error:
                pass
    return pids


def cpu_seconds(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            raise RuntimeError(f"memsnap agent process {pid} is gone (killed for memory?); see the Ray logs") from None
        total += t.user + t.system
    return total


def first_saves(cluster, ranks, n: int) -> dict:
    """Start the memsnap/1 job as training does (join, restore) and take ``n`` snapshots one
    at a time; per snapshot: the slowest rank's save() stall and the agents' CPU seconds."""
    before = agent_pids(cluster)
    t = time.perf_counter()
    nbytes = ray.get([a.start.remote(1) for a in ranks], timeout=600)[0]
    started = time.perf_counter() - t
    pids = agent_pids(cluster) - before
    rows = []
    for i in range(n):
        made = ray.get(ranks[0].arena_bytes.remote(1), timeout=120) if i < KEEP + 2 else None
        cpu = cpu_seconds(pids)
        got = ray.get([a.one_save.remote(1) for a in ranks], timeout=600)
        rows.append(
            {
                "i": i,
                "made": made,
                "stall_max": max(g["stall"] for g in got),
                "stall_min": min(g["stall"] for g in got),
                "captured": sum(g["captured"] for g in got),
                "committed": all(g["committed"] for g in got),
                "agent_cpu": cpu_seconds(pids) - cpu,
                "load": os.getloadavg()[0],
            }
        )
        print(
            f"snapshot {i}: save() stall {rows[-1]['stall_min']:.3f}-{rows[-1]['stall_max']:.3f} s, agents "
            f"{rows[-1]['agent_cpu']:.2f} core-s, captured by {rows[-1]['captured']} ranks",
            file=sys.stderr,
            flush=True,
        )
    return {"nbytes": nbytes, "start_s": started, "agents": len(pids), "rows": rows, "pids": pids}


def measure(cluster, model: str, mib: float, args, load: list) -> dict:
    from memsnap.rank import shutdown

    configs = [c for c in CONFIGS if not (c == "memsnap/10" and mib >= LARGE_MIB)]
    name = f"{model}+{mib:g} MiB"
    work = tempfile.mkdtemp(prefix="memsnap-overhead-")
    rounds: list[dict[str, dict]] = []
    ranks = [
        Rank.options(resources={f"memsnap_node_{i}": 0.01}).remote(i, model, mib, work, KEEP, BUDGET)  # type: ignore[attr-defined]  # @ray.remote makes an ActorClass; ray's annotation keeps the bare class
        for i in range(NODES)
    ]
    job = f"bench-overhead-{model}-{mib:g}"
    try:
        first = first_saves(cluster, ranks, args.first_saves)
        ray.get([a.drop_state.remote() for a in ranks], timeout=120)
        for r in range(args.rounds + 1):
            got = {}
            order = configs[r % len(configs) :] + configs[: r % len(configs)]  # no seat is always first
            for cfg in order:
                cpu = cpu_seconds(first["pids"]) if cfg == "memsnap/1" else 0.0
                runs = ray.get([a.run.remote(cfg, args.steps) for a in ranks], timeout=1800)
                got[cfg] = {
                    "sps": min(x["sps"] for x in runs),
                    "stalls": [t for x in runs for t in x["stalls"]],
                    "agent_cpu": cpu_seconds(first["pids"]) - cpu if cfg == "memsnap/1" else None,
                }
                print(
                    f"{name} round {r}{' (warm-up)' if r == 0 else ''} {cfg:14s} {got[cfg]['sps']:7.2f} steps/s "
                    f"(slowest rank), {len(got[cfg]['stalls'])} saves",
                    file=sys.stderr,
                    flush=True,
                )
            load.append(os.getloadavg())
            if r > 0:
                rounds.append(got)
        status = ray.get(ranks[0].status.remote(), timeout=120)
    finally:
        for every in (1, 10):
            shutdown(f"{job}-{every}")
        for a in ranks:
            ray.kill(a)
        shutil.rmtree(work, ignore_errors=True)
    first.pop("pids")
    return {
        "name": name,
        "model": model,
        "mib": mib,
        "configs": configs,
        "rounds": rounds,
        "status": status,
        "nbytes": first["nbytes"],
        "first": first,
    }


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    if not n:
        return float("nan")
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def write(sections: list[dict], args, load: list) -> None:
    import platform

    loads = [f"{a[0]:.1f}" for a in load]
    lines = [
        "# Training throughput with snapshots, first-snapshot and steady-state stall, agent CPU (`bench/overhead.py`)",
        "",
        f"`python bench/overhead.py --steps {args.steps} --rounds {args.rounds} --models {' '.join(args.models)} "
        f"--frozen-mib {' '.join(f'{m:g}' for m in args.frozen_mib)} --first-saves {args.first_saves} --keep {args.keep} "
        f"--memory-budget-gib {args.memory_budget_gib:g}`; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}. Machine load (1-min load average) at the start, after every round "
        f"and at the end: {', '.join(loads)}. Ray's memory monitor is off in this cluster "
        "(`RAY_memory_monitor_refresh_ms=0`): it counts the agents' shared-memory arenas in every process "
        "that maps them and killed agents at 256 MiB per rank on this machine, which other work shares.",
        "",
        f"One training actor on each of {NODES} simulated nodes of a local Ray cluster, all on this "
        f"machine's {os.cpu_count()} cores, trains a model of `memsnap demo` (batch 8), with a frozen "
        "table of random float32 beside it where a size is given (`memsnap.demo.model.FrozenTable`, part of "
        f"the snapshotted state like the weights). Each round runs {args.steps} "
        "timed steps of every configuration on every rank at once (the order rotates every round) and "
        f"takes the slowest rank's steps/s; one warm-up round is not counted; {args.rounds} counted "
        "rounds. The ratio is the median over rounds of (configuration / none) within a round, so slow "
        f"drifts of the machine cancel out. memsnap runs RS(2,1) with the local copy, keep={args.keep}: its agents' "
        "checksumming, encoding, sending and committing compete with training for the same cores, and "
        "when they are still busy with the previous snapshot a save is skipped (cheap), so `saves` "
        "counts the snapshots actually captured. A save's stall is the time `save()` (or `torch.save` + "
        "fsync, or `async_save`) held the training loop.",
    ]
    for sec in sections:
        rounds, mib = sec["rounds"], sec["nbytes"] / (1 << 20)
        what = f"model + {sec['mib']:g} MiB frozen" if sec["mib"] else "model, no frozen table"
        lines += [
            "",
            f"## `{sec['model']}` {what}: {mib:.1f} MiB of snapshot state per rank before the first "
            f"optimizer step (weights, scheduler, RNG, sampler{', frozen table' if sec['mib'] else ''}; the "
            "rounds add AdamW's two moments, 2x the weights)",
            "",
            "| configuration | steps/s (median) | range | vs. none (median ratio) | throughput cost | "
            "saves per rank and round (median) | stall per save: median | p90 | max |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name in sec["configs"]:
            sps = [r[name]["sps"] for r in rounds]
            ratio = _median([r[name]["sps"] / r["none"]["sps"] for r in rounds])
            stalls = [t for r in rounds for t in r[name]["stalls"]]
            nsaves = _median([len(r[name]["stalls"]) / NODES for r in rounds])
            st = (
                "- | - | -"
                if not stalls
                else f"{_median(stalls):.3f} s | {_pct(stalls, 0.9):.3f} s | {max(stalls):.3f} s"
            )
            lines.append(
                f"| {name} | {_median(sps):.2f} | {min(sps):.2f}-{max(sps):.2f} | {ratio:.3f} | "
                f"{100 * (1 - ratio):.1f}% | {nsaves:g} | {st} |"
            )
        first = sec["first"]
        gib = sec["nbytes"] * NODES / (1 << 30)
        lines += [
            "",
            f"### First snapshots against steady state ({mib:.1f} MiB per rank, {NODES} ranks)",
            "",
            f"The memsnap/1 job started as a training job does (every rank: `Snapshotter`, then `restore`, "
            f"which found nothing and had the agents make each rank's {KEEP + 1} arena slots; "
            f"{first['start_s']:.2f} s for all ranks together), then took {len(first['rows'])} snapshots one "
            "at a time, the first right after `restore` returned: every rank saves, then waits for the "
            "commit. Stall: the slowest and fastest rank's `save()`; agents: CPU seconds (user + system) of "
            f"the job's {first['agents']} agent processes from before the save to the commit, per GiB "
            "snapshotted (all ranks); slots made: the arena bytes the agents held just before the save "
            f"(all {KEEP + 1} slots of every rank: {(KEEP + 1) * NODES * mib:.0f} MiB).",
            "",
            "| snapshot | save() stall, slowest rank | fastest rank | agents' CPU | core-s per GiB | "
            "slots made before it | load |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in first["rows"]:
            made = "" if row["made"] is None else f"{row['made'] / (1 << 20):.0f} MiB"
            lines.append(
                f"| {row['i'] + 1}{'' if row['committed'] else ' (not committed)'} | {row['stall_max']:.3f} s | "
                f"{row['stall_min']:.3f} s | {row['agent_cpu']:.2f} s | {row['agent_cpu'] / gib:.2f} | "
                f"{made} | {row['load']:.1f} |"
            )
        head, tail = first["rows"][: KEEP + 1], first["rows"][KEEP + 1 :]
        if tail:
            lines += [
                "",
                f"First {KEEP + 1} (fresh slots): stall {_median([r['stall_max'] for r in head]):.3f} s "
                f"(median of the slowest rank), agents {_median([r['agent_cpu'] for r in head]) / gib:.2f} "
                f"core-s/GiB; later: stall {_median([r['stall_max'] for r in tail]):.3f} s, agents "
                f"{_median([r['agent_cpu'] for r in tail]) / gib:.2f} core-s/GiB.",
            ]
        cpu = [r["memsnap/1"]["agent_cpu"] for r in rounds]
        saved = [len(r["memsnap/1"]["stalls"]) * sec["nbytes"] / (1 << 30) for r in rounds]
        if sum(saved):
            lines += [
                "",
                f"During the memsnap/1 rounds (snapshots back to back while training): agents "
                f"{sum(cpu):.1f} core-s for {sum(saved):.2f} GiB captured = "
                f"{sum(cpu) / sum(saved):.2f} core-s per GiB snapshotted.",
            ]
        lines += ["", f"memsnap status at the end (per every_steps): {sec['status']}"]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
