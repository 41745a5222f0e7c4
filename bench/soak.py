"""Soak: many snapshot cycles with periodic restores on a 4-node loopback cluster, and what
every process of the job holds throughout: RSS, open file descriptors and threads of each
agent, rank and the coordinator, and the job's shared-memory files. Nothing may grow once
warm: a leak per save shows here as a slope.

    python bench/soak.py [--cycles 1000] [--restore-every 100] [--state-mb 8] [--sample-every 20]
        -> bench/results/soak.md + bench/results/soak.png

Beside it, in the same run, the peer a team would use instead: one process saving the same
state with PyTorch DCP's ``async_save`` (gloo, world size 1, waiting for each save, to one
directory overwritten each cycle) the same number of times, sampled the same way, so the
training process's growth per save reads side by side with memsnap's ranks.

Each cycle every rank changes its state, saves it and waits for the commit; every
``--restore-every`` cycles every rank restores (from its node's RAM). The state is small
on purpose (a leak is per save or per restore, not per byte, and 1,000 cycles must fit in
minutes on 2 cores); the processes are found by their Ray process titles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)

import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from memsnap.localcluster import LocalCluster  # noqa: E402
from memsnap.memory import shmdir  # noqa: E402

JOB = "bench-soak"
RESULTS = HERE / "results"
KINDS = {"agent": "SnapshotAgent", "rank": "SoakRank", "coordinator": "Coordinator"}


@ray.remote(num_cpus=0)
class SoakRank:
    def __init__(self, rank: int, world: int, mib: int):
        from memsnap.rank import Snapshotter

        torch.manual_seed(rank)
        self.model = torch.nn.Linear(1024, mib * 256)  # mib MiB of float32 weights
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.state = {"model": self.model, "optim": self.optim}
        self.snap = Snapshotter(
            job=JOB, rank=rank, world_size=world, k=2, m=1, memory_budget=256 << 20, on_error="raise", preemption=False
        )

    def cycle(self, step: int) -> int | None:
        with torch.no_grad():
            self.model.weight.add_(1.0)
        self.snap.save(step, self.state)
        return self.snap.wait(step, timeout=120)

    def restore(self) -> tuple:
        got = self.snap.restore(self.state)
        return got, self.snap.last_restore.tier


def processes() -> dict[str, list[psutil.Process]]:
    """The job's processes by kind, found by their Ray process titles (``ray::<Class>...``)."""
    out: dict[str, list[psutil.Process]] = {k: [] for k in KINDS}
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        for kind, cls in KINDS.items():
            if line.startswith(f"ray::{cls}"):
                out[kind].append(p)
    return out


def sample(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """Totals per kind: RSS (MiB), open fds, threads; and the job's shared-memory files."""
    row: dict[str, float] = {}
    for kind, ps in procs.items():
        rss = fds = threads = 0
        for p in ps:
            with p.oneshot():
                rss += p.memory_info().rss
                fds += p.num_fds()
                threads += p.num_threads()
        row[f"{kind}_rss_mib"] = rss / 2**20
        row[f"{kind}_fds"] = fds
        row[f"{kind}_threads"] = threads
    files = shmdir.arena_files(JOB)
    row["shm_files"] = len(files)
    row["shm_mib"] = sum(os.path.getsize(f) for f in files) / 2**20
    return row


DCP_CHILD = """
import json, os, sys, psutil, torch, warnings
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
cycles, mib, every, tmp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(1024, mib * 256)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
me = psutil.Process()
for step in range(1, cycles + 1):
    with torch.no_grad():
        model.weight.add_(1.0)
    dcp.async_save({"model": model.state_dict(), "optim": optim.state_dict()},
                   checkpoint_id=os.path.join(tmp, "ckpt")).result()
    if step % every == 0:
        with me.oneshot():
            print(json.dumps({"cycle": step, "dcp_rss_mib": me.memory_info().rss / 2**20,
                              "dcp_fds": me.num_fds(), "dcp_threads": me.num_threads()}), flush=True)
dist.destroy_process_group()
"""


def dcp_rows(cycles: int, mib: int, every: int) -> list[dict]:
    """The DCP ``async_save`` process's samples (its RSS, fds and threads every ``every`` saves)."""
    with tempfile.TemporaryDirectory(prefix="soak-dcp-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", DCP_CHILD, str(cycles), str(mib), str(every), tmp],
            capture_output=True,
            text=True,
            timeout=3600,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"the DCP soak process failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--restore-every", type=int, default=100)
    ap.add_argument("--state-mb", type=int, default=8)
    ap.add_argument("--sample-every", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "soak.md"))
    args = ap.parse_args()
    t0 = time.time()
    peer = dcp_rows(args.cycles, args.state_mb, args.sample_every)
    print(f"DCP async_save: {len(peer)} samples in {time.time() - t0:.0f} s; last {peer[-1]}", flush=True)
    rows, restores, t0 = [], [], time.time()
    with LocalCluster(nodes=4, cpus_per_node=1, object_store_mb=96):
        try:
            ranks = [
                SoakRank.options(resources={f"memsnap_node_{i}": 0.01}).remote(i, 4, args.state_mb)  # type: ignore[attr-defined]  # @ray.remote makes an ActorClass; ray's annotation keeps the bare class
                for i in range(4)
            ]
            ray.get([r.cycle.remote(0) for r in ranks], timeout=300)
            procs = processes()
            print("processes:", {k: len(v) for k, v in procs.items()}, flush=True)
            for step in range(1, args.cycles + 1):
                got = ray.get([r.cycle.remote(step) for r in ranks], timeout=300)
                assert all(g == step for g in got), f"cycle {step}: committed {got}"
                if step % args.restore_every == 0:
                    restores.append((step, ray.get([r.restore.remote() for r in ranks], timeout=300)))
                if step % args.sample_every == 0:
                    rows.append({"cycle": step, "seconds": time.time() - t0, **sample(procs)})
                    if step % (args.sample_every * 10) == 0:
                        print(f"cycle {step}: {rows[-1]}", flush=True)
        finally:
            from memsnap.rank import shutdown

            shutdown(JOB, timeout=30)
    write(rows, restores, peer, args, time.time() - t0)


def drift(rows: list[dict], key: str) -> tuple[float, float, float]:
    """(value after warm-up, value at the end, change in %): medians of the samples of the
    second tenth of the run and of its last tenth."""
    n = max(1, len(rows) // 10)
    warm = statistics.median(r[key] for r in rows[n : 2 * n] or rows[:1])
    end = statistics.median(r[key] for r in rows[-n:])
    return warm, end, 0.0 if warm == 0 else 100.0 * (end - warm) / warm


def write(rows: list[dict], restores: list, peer: list[dict], args, seconds: float) -> None:
    keys = [k for k in rows[0] if k not in ("cycle", "seconds")]
    load = os.getloadavg()
    lines = [
        "# Soak: many snapshot cycles, nothing grows",
        "",
        f"`python bench/soak.py --cycles {args.cycles} --restore-every {args.restore_every} --state-mb "
        f"{args.state_mb}`, {time.strftime('%Y-%m-%d')}, 4 loopback nodes on 2 cores, {seconds / 60:.1f} min, "
        f"load average at the end {load[0]:.1f}. Each cycle: every rank changes its state "
        f"({args.state_mb} MiB), saves it (k=2, m=1) and waits for the commit; every {args.restore_every} "
        f"cycles every rank restores ({len(restores)} collective restores, tiers "
        f"{sorted({t for _, rs in restores for _, t in rs})}). Totals over the job's 4 agents, 4 ranks and "
        "its coordinator, sampled every "
        f"{args.sample_every} cycles.",
        "",
        "| what | after warm-up (2nd tenth) | at the end (last tenth) | change |",
        "| --- | --- | --- | --- |",
    ]
    worst = 0.0
    for key in keys:
        warm, end, pct = drift(rows, key)
        worst = max(worst, abs(pct)) if warm >= 1 else worst
        lines.append(f"| {key} | {warm:.1f} | {end:.1f} | {pct:+.1f}% |")
    lines += [
        "",
        f"Largest change after warm-up: {worst:.1f}% (the target is within 5%).",
        "",
        f"The process that saves, side by side ({args.cycles} saves of the same {args.state_mb} MiB "
        "state each): one memsnap rank (the ranks' totals / 4) against one process saving with DCP "
        "`async_save` and waiting for each save.",
        "",
        "| what | memsnap rank: warm | end | change | DCP async_save: warm | end | change |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for what in ("rss_mib", "fds", "threads"):
        m_warm, m_end, m_pct = (x / 4 if i < 2 else x for i, x in enumerate(drift(rows, f"rank_{what}")))
        d_warm, d_end, d_pct = drift(peer, f"dcp_{what}")
        lines.append(
            f"| {what} | {m_warm:.1f} | {m_end:.1f} | {m_pct:+.1f}% | {d_warm:.1f} | {d_end:.1f} | {d_pct:+.1f}% |"
        )
    lines += ["", "![soak](soak.png)", ""]
    Path(args.out).write_text("\n".join(lines))
    plot(rows, keys, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}; largest change after warm-up {worst:.1f}%")


def plot(rows: list[dict], keys: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [("RSS (MiB)", "_rss_mib"), ("open fds", "_fds"), ("threads", "_threads")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    x = [r["cycle"] for r in rows]
    for ax, (title, suffix) in zip(axes, groups):
        for key in [k for k in keys if k.endswith(suffix)]:
            ax.plot(x, [r[key] for r in rows], label=key.removesuffix(suffix))
        ax.set_title(title)
        ax.set_xlabel("cycle")
        ax.legend(fontsize=7)
    axes[3].plot(x, [r["shm_files"] for r in rows], label="files")
    axes[3].plot(x, [r["shm_mib"] for r in rows], label="MiB")
    axes[3].set_title("/dev/shm (the job's arenas)")
    axes[3].set_xlabel("cycle")
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
