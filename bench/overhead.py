"""Training throughput with and without snapshots, side by side in one run.

A 4-node job on a simulated local Ray cluster: one training actor per node trains the demo's
model (memsnap/demo/model.py). Every configuration runs on all four ranks at once, in
interleaved rounds (the order rotates every round) so machine noise hits them alike. The first round warms every
configuration up (agents started, first snapshots placed, files created) and is not counted;
each later round gives every configuration's steps/s relative to ``none`` in the same round,
and the median of those ratios is reported:

    none              no checkpointing
    memsnap/1         memsnap.Snapshotter.save every step (RS(2,1), every_steps=1)
    memsnap/10        memsnap every 10 steps (every_steps=10)
    torch.save/10     torch.save + fsync every 10 steps
    dcp.async/10      torch.distributed.checkpoint.async_save every 10 steps

    python bench/overhead.py [--steps 100] [--rounds 5] [--models small medium]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import ray

NODES = 4
CONFIGS = ["none", "memsnap/1", "memsnap/10", "torch.save/10", "dcp.async/10"]


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int, model: str, work: str):
        import torch

        from memsnap.demo.model import ModelConfig
        from memsnap.demo.train import TrainConfig

        torch.set_num_threads(1)
        self.rank, self.work, self.model = rank, work, model
        self.cfg = TrainConfig(model=ModelConfig.sized(model), batch=8)
        self.snaps = {}
        self.dcp_ready = False

    def snapshotter(self, every: int):
        from memsnap.snapshotter import Snapshotter

        if every not in self.snaps:
            self.snaps[every] = Snapshotter(job=f"bench-overhead-{self.model}-{every}", rank=self.rank, world_size=NODES,
                                            k=2, m=1, every_steps=every, preemption=False)
        return self.snaps[every]

    def run(self, name: str, steps: int) -> float:
        from memsnap.demo.train import TrainConfig, build, run, snapshot_state

        cfg = TrainConfig.from_json({**self.cfg.to_json(), "steps": steps + 3})
        objs = build(cfg, self.rank, NODES, ddp=False)
        run(TrainConfig.from_json({**cfg.to_json(), "steps": 3}), self.rank, 1, objs=objs)  # warm-up
        saver = self._saver(name)
        t = time.perf_counter()
        run(cfg, self.rank, 1, first_step=3, objs=objs, after_step=lambda s, o: saver(s, snapshot_state(o)))
        finish = getattr(saver, "finish", None)
        if finish:
            finish()
        return steps / (time.perf_counter() - t)

    def _saver(self, name: str):
        if name == "none":
            return lambda step, state: None
        if name.startswith("memsnap"):
            snap = self.snapshotter(int(name.split("/")[1]))
            return snap.save
        if name == "torch.save/10":
            return lambda step, state: step % 10 == 9 and self._torch_save(state)
        return DcpAsync(os.path.join(self.work, f"dcp-{self.rank}-{time.monotonic_ns()}"))

    def _torch_save(self, state) -> None:
        import torch

        path = os.path.join(self.work, f"ckpt-{self.rank}.pt")
        with open(path, "wb") as f:
            torch.save({k: v.state_dict() for k, v in state.items()}, f)
            f.flush()
            os.fsync(f.fileno())

    def state_bytes(self) -> int:
        from memsnap.capture import plan
        from memsnap.demo.train import build, snapshot_state

        return plan(snapshot_state(build(self.cfg, self.rank, NODES, ddp=False))).nbytes

    def status(self) -> dict:
        return {str(e): {k: s.status().get(k) for k in ("committed_step", "failed_saves")}
                for e, s in self.snaps.items()}


class DcpAsync:
    """``dcp.async_save`` of model + optimizer every 10 steps (a world of one per rank)."""

    def __init__(self, root: str):
        import torch.distributed as dist

        if not dist.is_initialized():
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        self.root, self.future = root, None

    def __call__(self, step: int, state) -> None:
        import torch.distributed.checkpoint as dcp

        if step % 10 != 9:
            return
        if self.future is not None:
            self.future.result()
        sd = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
        self.future = dcp.async_save(sd, checkpoint_id=os.path.join(self.root, f"step{step}"))

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="counted rounds, after one warm-up round")
    ap.add_argument("--models", nargs="+", default=["small"], help="demo model sizes, one table each")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "overhead.md"))
    args = ap.parse_args()

    from memsnap.localcluster import LocalCluster

    sections = []
    with LocalCluster(NODES) as _cluster:
        for model in args.models:
            sections.append(measure(model, args))
    write(sections, args)


def measure(model: str, args) -> dict:
    from memsnap.snapshotter import shutdown

    work = tempfile.mkdtemp(prefix="memsnap-overhead-")
    rounds: list[dict[str, float]] = []
    ranks = [Rank.options(resources={f"memsnap_node_{i}": 0.01}).remote(i, model, work) for i in range(NODES)]
    try:
        for r in range(args.rounds + 1):
            got = {}
            order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]  # no seat is always first
            for name in order:
                got[name] = min(ray.get([a.run.remote(name, args.steps) for a in ranks], timeout=1800))
                print(f"{model} round {r}{' (warm-up)' if r == 0 else ''} {name:14s} {got[name]:7.2f} steps/s "
                      "(slowest rank)", file=sys.stderr, flush=True)
            if r > 0:
                rounds.append(got)
        status = ray.get(ranks[0].status.remote(), timeout=120)
        nbytes = ray.get(ranks[0].state_bytes.remote(), timeout=120)
    finally:
        for every in (1, 10):
            shutdown(f"bench-overhead-{model}-{every}")
        for a in ranks:
            ray.kill(a)
        shutil.rmtree(work, ignore_errors=True)
    return {"model": model, "rounds": rounds, "status": status, "nbytes": nbytes}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def write(sections: list[dict], args) -> None:
    import platform

    lines = [
        "# Training throughput with snapshots (`bench/overhead.py`)",
        "",
        f"`python bench/overhead.py --steps {args.steps} --rounds {args.rounds} --models {' '.join(args.models)}`; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        f"One training actor on each of {NODES} simulated nodes of a local Ray cluster, all on this "
        f"machine's 2 cores, trains a model of `memsnap demo` (batch 8). Each round runs {args.steps} "
        "timed steps of every configuration on every rank at once (the order rotates every round) and "
        f"takes the slowest rank's steps/s; one warm-up round is not counted; {args.rounds} counted "
        "rounds. The ratio is the median over rounds of (configuration / none) within a round, so slow "
        "drifts of the machine cancel out. memsnap runs RS(2,1) with the local copy: its agents' "
        "checksumming, encoding, sending and committing compete with training for the same 2 cores.",
    ]
    for sec in sections:
        rounds = sec["rounds"]
        lines += ["", f"## `{sec['model']}` model ({sec['nbytes'] / (1 << 20):.1f} MiB of snapshot state per rank: "
                  "weights, AdamW moments, scheduler, RNG, sampler)", "",
                  "| configuration | steps/s (median) | range | vs. none (median ratio) | throughput cost |",
                  "| --- | --- | --- | --- | --- |"]
        for name in CONFIGS:
            sps = [r[name] for r in rounds]
            ratio = _median([r[name] / r["none"] for r in rounds])
            lines.append(f"| {name} | {_median(sps):.2f} | {min(sps):.2f}-{max(sps):.2f} | {ratio:.3f} | "
                         f"{100 * (1 - ratio):.1f}% |")
        lines += ["", f"memsnap status at the end (per every_steps): {sec['status']}"]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
