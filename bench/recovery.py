"""Recovery benchmark, side by side in one run on a simulated loopback Ray cluster.

    python bench/recovery.py [--mib 256] [--ram-mib 256] [--elastic-mib 16] [--no-s3] [--elastic-only]
                             [--out bench/results/recovery.md]

1. Restore time of one lost node's state (``--mib`` per node, 4 nodes, k=2, m=1): from the
   peers' RAM (node killed, replacement node, ``Snapshotter.restore``) vs memsnap's durable
   format on local disk (warm and cold page cache) and on a moto S3 server on loopback vs
   ``torch.load(weights_only=True)`` + ``load_state_dict`` from local disk (warm and cold).
   Cold = the file's pages dropped with ``posix_fadvise(DONTNEED)`` first.
2. The raw loopback socket ceiling (one stream, sendall / recv_into MSG_WAITALL, 1 GiB),
   measured in the same run.
3. Per-node RAM held by the agents vs the snapshot size S for (k, m) in
   {(1,1), (2,1), (3,1), (2,2)} on 5 nodes (``--ram-mib`` per node): measured with the local
   copy (arena + parity + held chunks) against S*(1+(k+m)/k), and from a second job in lean
   mode (``local_copy=False``: no committed local copy; held chunks against S*(k+m)/k, plus
   the reused staging arena).
4. Resharding restore, 4 -> 3 ranks after a node loss with no replacement (FSDP-style state:
   a ``Shard(0)`` weight of ``4 * --elastic-mib`` MiB with its AdamW moments, a replicated
   bias; gloo): from peers' RAM (``Snapshotter.restore``, tier ``elastic``) vs ``memsnap.load``
   of the same spilled step into the same 3 ranks (warm, then cold page cache), in the same
   run and the same processes. ``--elastic-only`` runs this part alone and rewrites only its
   section of ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests"), os.environ.get("PYTHONPATH")) if p
)

import ray  # noqa: E402
import torch  # noqa: E402

from memsnap import naming  # noqa: E402
from memsnap.localcluster import LocalCluster, wait_for  # noqa: E402
from memsnap.memory import shmdir  # noqa: E402

MIB = 1 << 20
JOB = "bench-recovery"


class Blob(torch.nn.Module):
    """``mib`` MiB of float32 parameters in 16 MiB tensors."""

    def __init__(self, mib: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        n = max(1, mib // 16)
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.rand(mib * MIB // 4 // n, generator=g)) for _ in range(n)
        )


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int, world: int, mib: int, seed: int, opts: dict, job: str):
        from memsnap.rank import Snapshotter

        self.state = {"model": Blob(mib, seed)}
        self.snap = Snapshotter(job=job, rank=rank, world_size=world, **opts)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def save(self, step: int) -> None:
        self.snap.save(step, self.state)

    def wait(self, step: int) -> int | None:
        return self.snap.wait(step, 600)

    def restore(self) -> dict:
        t = time.perf_counter()
        step = self.snap.restore(self.state)
        return dict(self.snap.last_restore.to_wire(), wall=time.perf_counter() - t, restored=step)

    def status(self) -> dict:
        return self.snap.status()

    def source(self) -> dict:
        """Where this rank's bytes of its last restored step live (its part of the plan)."""
        plan = self.snap.last_plan
        assert plan is not None and plan.source is not None, "a RAM restore ran first"
        return plan.source.to_wire()

    def receive_again(self, source: dict) -> float:
        """This rank's bytes ``source`` names read from its holders straight into its live
        tensors again (the direct restore's data path, without the collective plan)."""
        from memsnap.records import RankSource

        src = RankSource.from_wire(source)
        t = time.perf_counter()
        self.snap.loader.receive(src, self.snap.client.manifest(src.step, src.rank, src), self.state)
        return time.perf_counter() - t

    def apply_local(self, step: int) -> float:
        """Load this rank's committed ``step`` from its node's agent again: the apply phase alone."""
        held = self.snap.client.local(step)
        assert held is not None, f"the agent holds no copy of step {step}"
        seconds: dict = {}
        self.snap.loader.apply(held, self.state, seconds)
        return seconds["apply"]


def free_job(job: str) -> None:
    """Shut the job's agents down and remove any arena they left, whatever state the run ended in."""
    from memsnap.rank import shutdown

    with contextlib.suppress(Exception):
        shutdown(job, timeout=30)
    for p in shmdir.arena_files(job):
        with contextlib.suppress(OSError):
            os.unlink(p)


def _start(job, nodes, mib, opts, seed0=0):
    ranks = [
        Rank.options(resources={f"memsnap_node_{n}": 0.01}).remote(r, len(nodes), mib, seed0 + r, opts, job)
        for r, n in enumerate(nodes)
    ]
    ray.get([r.node.remote() for r in ranks], timeout=600)
    return ranks


def _drop_cache(path: str) -> None:
    for root, _, files in (
        os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]
    ):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --- 1. restore of a lost node -------------------------------------------------------------------
def peer_vs_durable(mib: int, spill: str) -> dict:
    opts = dict(
        k=2, m=1, keep=1, memory_budget=(mib * 6 + 256) * MIB, spill=spill, spill_every=1, spill_bytes_per_s=4 << 30
    )
    out = {}
    with LocalCluster(nodes=4, cpus_per_node=1, object_store_mb=96) as c:
        try:
            ranks = _start(JOB, [0, 1, 2, 3], mib, opts)
            ray.get([r.save.remote(1) for r in ranks], timeout=600)
            assert ray.get(ranks[0].wait.remote(1), timeout=900) == 1
            wait_for(lambda: ray.get(ranks[0].status.remote())["durable_step"] == 1, timeout=900, what="step 1 spilled")
            lost = ray.get(ranks[1].node.remote())
            c.kill_node(next(n for n in c.nodes if n.node_id == lost))
            wait_for(
                lambda: any(n["NodeID"] == lost and not n["Alive"] for n in ray.nodes()),
                timeout=120,
                what="the node declared dead",
            )
            c.add_node()
            ranks[1] = Rank.options(resources={"memsnap_node_4": 0.01}).remote(1, 4, mib, 50, opts, JOB)  # type: ignore[attr-defined]  # @ray.remote makes an ActorClass; ray's annotation keeps the bare class
            ray.get(ranks[1].node.remote(), timeout=600)
            res = ray.get([r.restore.remote() for r in ranks], timeout=900)
            out["peer"] = res[1]
            out["alone"] = data_path_alone(ranks, lost)
        finally:
            free_job(JOB)
    return out


def data_path_alone(ranks, lost: str, rounds: int = 7) -> dict:
    """The lost node's bytes read again from the same holders with every other rank idle and
    re-protection done (on separate machines, the other ranks' own loads would not share these
    2 cores), ``rounds`` times, the ways side by side in each round: straight into rank 1's
    live tensors (what ``restore`` does); into the replacement node's arena, whose pages are
    backed already (the objstore transport's way), then rank 1's apply from that arena.
    Returns the median and best of each."""
    wait_for(
        lambda: (
            lambda st: st["reprotect"]["running"] == 0 and st["protection"] and min(st["protection"].values()) == 2
        )(ray.get(ranks[0].status.remote(), timeout=60)),
        timeout=600,
        what="re-protection to finish (it would share the cores)",
    )
    new = ray.get(ranks[1].node.remote())
    a_new = ray.get_actor(naming.agent(JOB, new), namespace=naming.NAMESPACE)
    source = ray.get(ranks[1].source.remote(), timeout=60)  # rank 1's part of the restore plan
    assert source["owner"] == lost
    runs: dict[str, list[float]] = {"direct": [], "touched": [], "apply": []}
    for _ in range(rounds):
        runs["direct"].append(ray.get(ranks[1].receive_again.remote(source), timeout=600))
        t = time.perf_counter()
        ray.get(a_new.recover.remote(1, 1, source), timeout=600)
        runs["touched"].append(time.perf_counter() - t)
        runs["apply"].append(ray.get(ranks[1].apply_local.remote(1), timeout=600))
    for name, v in runs.items():
        print(f"  data path alone, {name}: {[round(r, 3) for r in v]}", flush=True)
    return {name: {"median": statistics.median(v), "best": min(v)} for name, v in runs.items()}


def durable_restore(uri: str, mib: int, cold_path: str | None) -> float:
    from memsnap.durable.storage import Store
    from memsnap.state.apply import apply

    if cold_path:
        _drop_cache(cold_path)
    state = {"model": Blob(mib, 123)}
    t = time.perf_counter()
    store = Store.open(uri)
    step = store.latest()
    man = store.manifest(step, 1)
    buf = bytearray(man.nbytes)
    store.read_rank_into(step, 1, buf)
    apply(state, man, buf, verify=True)
    return time.perf_counter() - t


def torch_load(path: str, mib: int, cold: bool) -> float:
    model = Blob(mib, 7)
    if cold:
        _drop_cache(path)
    t = time.perf_counter()
    model.load_state_dict(torch.load(path, weights_only=True))
    return time.perf_counter() - t


def _load_one(path: str, mib: int, barrier, q) -> None:
    model = Blob(mib, 7)
    _drop_cache(path)
    barrier.wait()
    t = time.perf_counter()
    model.load_state_dict(torch.load(path, weights_only=True))
    q.put(time.perf_counter() - t)


def torch_load_together(paths: list[str], mib: int) -> float:
    """Every rank's ``torch.load`` + ``load_state_dict`` at once, each from its own file with a
    cold cache, on the same cores (the conditions of the collective restore): the slowest."""
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(len(paths)), ctx.Queue()
    procs = [ctx.Process(target=_load_one, args=(p, mib, barrier, q)) for p in paths]
    for p in procs:
        p.start()
    times = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return max(times)


def s3_copy(spill: str, mib: int) -> float | None:
    """Write rank 1's step to a moto S3 server on loopback and time restoring it from there."""
    from support.s3server import moto_s3

    from memsnap.durable.storage import Store

    with moto_s3("bench") as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        try:
            src, dst = Store.open(spill), Store.open("s3://bench/ckpt")
            step = src.latest()
            for rank in range(4):
                man = src.manifest(step, rank)
                buf = bytearray(man.nbytes)
                src.read_rank_into(step, rank, buf)
                dst.write_rank(step, rank, man, buf)
            dst.commit(step, 4)
            return min(durable_restore("s3://bench/ckpt", mib, None) for _ in range(2))
        finally:
            os.environ.pop("AWS_ENDPOINT_URL", None)


# --- 4. resharding restore ------------------------------------------------------------------------
ELASTIC_BEGIN, ELASTIC_END = "<!-- elastic: begin -->", "<!-- elastic: end -->"


def elastic_ram_vs_durable(mib: int, work: str, rounds: int = 3) -> dict:
    """4 ranks save step 1 (spilled), one node is lost, 3 ranks restore it from RAM (elastic),
    ``rounds`` times, then the same 3 ranks load it with ``memsnap.load`` from the spill,
    ``rounds`` times with a warm page cache and once after dropping it. Each time is the
    slowest rank's (every rank loads at once, as a restarted job does). The first RAM restore
    also opens the rank's connections to the agents; the later ones reuse them."""
    from support.fsdp import start

    job = "bench-elastic"
    spill = os.path.join(work, "elastic-spill")
    rows = 4 * mib * MIB // (1024 * 4)  # (rows, 1024) float32 = 4 * mib MiB, over 4 then 3 ranks
    layout = {"l1.weight": ((rows, 1024), "shard"), "l1.bias": ((1024,), "replicate")}
    opts = dict(
        k=2,
        m=1,
        keep=1,
        memory_budget=(mib * 24 + 256) * MIB,
        spill=f"file://{spill}",
        spill_every=1,
        spill_bytes_per_s=4 << 30,
    )
    with LocalCluster(nodes=4, cpus_per_node=1, object_store_mb=96) as c:
        try:
            ranks = start(job, opts, [0, 1, 2, 3], layout, timeout=600)
            ray.get([r.restore.remote() for r in ranks], timeout=600)
            assert all(ray.get([r.train_and_save.remote(1) for r in ranks], timeout=600))
            assert ray.get(ranks[0].wait.remote(1), timeout=600) == 1
            assert ray.get(ranks[0].spill.remote(1), timeout=900) == 1
            lost = ray.get(ranks[3].node.remote())
            for r in ranks:
                ray.kill(r, no_restart=True)
            c.kill_node(next(n for n in c.nodes if n.node_id == lost))
            wait_for(
                lambda: any(n["NodeID"] == lost and not n["Alive"] for n in ray.nodes()),
                timeout=120,
                what="the node declared dead",
            )
            ranks = start(job, opts, [0, 1, 2], layout, timeout=600)
            ram = [ray.get([r.restore.remote() for r in ranks], timeout=900) for _ in range(rounds)]
            assert {t for got in ram for _, t, *_ in got} == {"elastic"}, ram
            warm = [ray.get([r.durable.remote(1) for r in ranks], timeout=900) for _ in range(rounds)]
            _drop_cache(spill)
            cold = ray.get([r.durable.remote(1) for r in ranks], timeout=900)
            digests = {tuple(d for _, _, d, *_ in got) for got in ram} | {tuple(d for d, _ in got) for got in warm}
            assert digests == {tuple(d for d, _ in cold)}  # every way, every round: the same bytes on every rank
            slowest = [max(got, key=lambda x: x[3]) for got in ram]
            print(
                f"  RAM rounds (slowest rank): {[round(x[3], 3) for x in slowest]}; durable warm: "
                f"{[round(max(w for _, w in got), 3) for got in warm]}; cold {max(w for _, w in cold):.3f}",
                flush=True,
            )
            return {
                "mib": mib,
                "nbytes": 3 * rows * 1024 * 4,
                "rounds": rounds,
                "ram_first": slowest[0][3],
                "ram_first_phases": slowest[0][4],
                "ram": statistics.median(x[3] for x in slowest[1:]) if rounds > 1 else slowest[0][3],
                "ram_phases": slowest[-1][4],
                "warm": statistics.median(max(w for _, w in got) for got in warm),
                "cold": max(w for _, w in cold),
            }
        finally:
            free_job(job)


def elastic_section(res: dict) -> list[str]:
    gib, per_rank, n = 1 << 30, res["nbytes"] / 3, res["rounds"]

    def phases(sec: dict) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in sec.items())

    lines = [
        ELASTIC_BEGIN,
        f"## Resharding restore, 4 -> 3 ranks (`--elastic-mib {res['mib']}`)",
        "",
        f"FSDP-style state: a `Shard(0)` weight of {4 * res['mib']} MiB (float32, 1024 columns) and its two "
        f"AdamW moments, {res['nbytes'] / MIB:.0f} MiB in all (plus a replicated bias), on 4 ranks (one per "
        "simulated node, gloo, k=2, m=1). Step 1 is committed and spilled; one node is killed and not "
        "replaced; 3 ranks restart (a new gloo group, world size 3) and every rank calls `restore` at once, "
        f"{n} times (each a full collective restore: plan, manifests, partial fetch, reshard, load). Then, in "
        f"the same processes, every rank loads the same step with `memsnap.load(..., world_size=3)` from the "
        f"spill (local disk), {n} times with a warm page cache, then once after dropping it with "
        "`posix_fadvise(DONTNEED)`. Each time is the slowest rank's; every way and every round gave every "
        "rank the same bytes (checked).",
        "",
        "| resharding restore, 4 -> 3 ranks | seconds (slowest rank) | GiB/s per rank |",
        "| --- | ---: | ---: |",
    ]
    for name, key in [
        ("memsnap RAM (tier `elastic`), first restore (opens its connections to the agents)", "ram_first"),
        (f"memsnap RAM (tier `elastic`), later restores (median of {n - 1})", "ram"),
        (f"memsnap.load from the durable tier, resharded, warm cache (median of {n})", "warm"),
        ("memsnap.load from the durable tier, resharded, cold cache", "cold"),
    ]:
        lines.append(f"| {name} | {res[key]:.3f} | {per_rank / res[key] / gib:.2f} |")
    lines += [
        "",
        f"Phases of the slowest rank's RAM restore (s): first {phases(res['ram_first_phases'])}; "
        f"last {phases(res['ram_phases'])}.",
        ELASTIC_END,
    ]
    return lines


def _replace_section(path: str, section: list[str]) -> None:
    text = open(path).read() if os.path.exists(path) else ""
    if ELASTIC_BEGIN in text:
        head, rest = text.split(ELASTIC_BEGIN, 1)
        text = head + "\n".join(section) + rest.split(ELASTIC_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(section) + "\n"
    with open(path, "w") as f:
        f.write(text)


# --- 2. raw socket ceiling ----------------------------------------------------------------------
def _sink(port_q, nbytes: int) -> None:
    import numpy as np

    buf = np.ones(nbytes, np.uint8)  # touched before the clock starts (page allocation is slow here)
    mv = memoryview(buf)  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    got = 0
    while got < nbytes:
        got += conn.recv_into(mv[got:], min(nbytes - got, 4 * MIB), socket.MSG_WAITALL)
    conn.sendall(b"k")
    conn.close()


def raw_socket(nbytes: int = 1 << 30) -> float:
    import numpy as np

    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_sink, args=(q, nbytes))
    p.start()
    port = q.get(timeout=60)
    data = memoryview(np.ones(nbytes, np.uint8))  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    s = socket.create_connection(("127.0.0.1", port))
    t = time.perf_counter()
    for off in range(0, nbytes, 4 * MIB):
        s.sendall(data[off : off + 4 * MIB])
    s.recv(1)
    dt = time.perf_counter() - t
    s.close()
    p.join(30)
    return nbytes / dt


# --- 3. RAM per node ------------------------------------------------------------------------------
def ram_table(mib: int) -> list[dict]:
    rows = []
    with LocalCluster(nodes=5, cpus_per_node=1, object_store_mb=96):
        for k, m in [(1, 1), (2, 1), (3, 1), (2, 2)]:
            full = _ram_of(f"bench-ram-{k}{m}", k, m, mib, local_copy=True)
            lean = _ram_of(f"bench-ram-{k}{m}-lean", k, m, mib, local_copy=False)
            rows.append(dict(full, **{"lean_" + key: v for key, v in lean.items()}))
    return rows


def _ram_of(job: str, k: int, m: int, mib: int, local_copy: bool) -> dict:
    """The largest agent's RAM after one committed snapshot of a fresh 5-node job, and its
    arena bytes after a second one (``arena2``: lean mode reuses its one staging arena)."""
    opts = dict(k=k, m=m, keep=1, memory_budget=(mib * 8 + 64) * MIB, group_size=5, local_copy=local_copy)
    ranks = _start(job, [0, 1, 2, 3, 4], mib, opts)
    try:
        nodes = ray.get([r.node.remote() for r in ranks], timeout=60)
        for step in (1, 2):
            ray.get([r.save.remote(step) for r in ranks], timeout=600)
            ray.get(ranks[0].wait.remote(step), timeout=600)
            wait_for(
                lambda step=step: _committed_on_agents(job, nodes, step),
                timeout=120,
                what="the commit reaching every agent",
            )
            agents = ray.get(ranks[0].status.remote())["agents"].values()
            if step == 1:  # one version saved: each agent has exactly one arena slot and parity buffer
                out = dict(
                    k=k,
                    m=m,
                    S=max(a["arena"] for a in agents),
                    local=max(a["local"] for a in agents),
                    parity=max(a["parity"] for a in agents),
                    held=max(a["held"] for a in agents),
                    total=max(a["arena"] + a["parity"] + a["held"] for a in agents),
                )
        return dict(out, arena2=max(a["arena"] for a in agents))
    finally:
        for r in ranks:
            ray.kill(r)
        free_job(job)


def _committed_on_agents(job: str, nodes: list[str], step: int) -> bool:
    """Whether every agent has heard of ``step``'s commit (sent to them in the background)."""
    agents = [ray.get_actor(naming.agent(job, n), namespace=naming.NAMESPACE) for n in nodes]
    return all(step in inv["records"] for inv in ray.get([a.inventory.remote() for a in agents], timeout=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--ram-mib", type=int, default=256)
    ap.add_argument("--elastic-mib", type=int, default=16)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--elastic-only", action="store_true", help="run part 4 alone; rewrite only its section")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "recovery.md"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="memsnap-bench-", dir="/var/tmp")
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: str) -> None:
    print("resharding restore 4 -> 3, RAM vs durable ...", flush=True)
    elastic = elastic_ram_vs_durable(args.elastic_mib, work)
    print(f"  {elastic}", flush=True)
    if args.elastic_only:
        _replace_section(args.out, elastic_section(elastic))
        print(open(args.out).read())
        return
    spill = os.path.join(work, "spill")
    print("raw socket ceiling (best of 3) ...", flush=True)
    tries = [raw_socket() for _ in range(3)]
    ceiling = max(tries)  # the highest ceiling: the ratios against it are the least flattering
    print(f"  {[round(c / (1 << 30), 2) for c in tries]} GiB/s", flush=True)
    print("peer restore on a 4-node cluster ...", flush=True)
    got = peer_vs_durable(args.mib, spill)
    peer = dict(got["peer"], alone=got["alone"])
    print(f"  {peer}", flush=True)
    nbytes = args.mib * MIB
    alone = peer["alone"]
    rows = [
        ("memsnap peer RAM (k=2, m=1), collective restore, lost rank end to end", peer["wall"]),
        ("  of which: fetch + decode straight into the live tensors", peer["seconds"].get("fetch", float("nan"))),
        (
            "memsnap peer data path alone, straight into the live tensors, end to end (median of 7)",
            alone["direct"]["median"],
        ),
        ("  best of 7", alone["direct"]["best"]),
        (
            "memsnap peer data path alone, through the agent's arena: fetch + decode (median of 7)",
            alone["touched"]["median"],
        ),
        (
            "memsnap peer data path alone, through the agent's arena: apply, verify + copy (median of 7)",
            alone["apply"]["median"],
        ),
        (
            "memsnap peer data path alone, through the agent's arena, end to end (sum of the medians)",
            alone["touched"]["median"] + alone["apply"]["median"],
        ),
    ]
    rows.append(
        ("memsnap durable, local disk, warm cache", min(durable_restore(spill, args.mib, None) for _ in range(2)))
    )
    rows.append(("memsnap durable, local disk, cold cache", durable_restore(spill, args.mib, spill)))
    if not args.no_s3:
        rows.append(("memsnap durable, moto S3 on loopback", s3_copy(spill, args.mib)))
    tpath = os.path.join(work, "state.pt")
    torch.save(Blob(args.mib, 3).state_dict(), tpath)
    rows.append(
        (
            "torch.load + load_state_dict, local disk, warm cache",
            min(torch_load(tpath, args.mib, False) for _ in range(2)),
        )
    )
    rows.append(("torch.load + load_state_dict, local disk, cold cache", torch_load(tpath, args.mib, True)))
    paths = [os.path.join(work, f"state{r}.pt") for r in range(4)]
    for r, path in enumerate(paths):
        torch.save(Blob(args.mib, 10 + r).state_dict(), path)
    rows.append(
        (
            "torch.load + load_state_dict, 4 ranks at once (as the collective restore), cold cache, slowest",
            torch_load_together(paths, args.mib),
        )
    )
    print("RAM per node ...", flush=True)
    ram = ram_table(args.ram_mib)
    write(args.out, args, ceiling, nbytes, rows, peer, ram)
    _replace_section(args.out, elastic_section(elastic))
    print(open(args.out).read())


def write(path, args, ceiling, nbytes, rows, peer, ram) -> None:
    gib = 1 << 30
    lines = [
        "# Recovery benchmark (`python bench/recovery.py`)",
        "",
        f"One run on this machine ({os.cpu_count()} cores, shared with other work), a simulated Ray cluster on "
        f"127.0.0.1. State per node: {args.mib} MiB of float32 parameters. Peer restore = node killed "
        "(`LocalCluster.kill_node`), replacement node added, every rank calls `restore`; the lost rank's "
        "time is shown.",
        "",
        f"Raw loopback socket ceiling (one stream, 1 GiB, best of 3): **{ceiling / gib:.2f} GiB/s**",
        "",
        "| restore of one node's state | seconds | GiB/s |",
        "| --- | ---: | ---: |",
    ]
    for name, sec in rows:
        lines.append(f"| {name} | {sec:.3f} | {nbytes / sec / gib:.2f} |" if sec else f"| {name} | n/a | |")
    fetch, alone = peer["seconds"].get("fetch"), peer["alone"]
    if fetch:

        def x(sec: float) -> str:
            return f"{nbytes / sec / ceiling:.2f}x"

        lines += [
            "",
            "Against the socket ceiling (target >= 0.5x end to end):",
            "",
            f"- collective restore (all 4 ranks load at once, on the same 2 cores): fetch+decode "
            f"{x(fetch)}, lost rank end to end {x(peer['wall'])};",
            f"- data path alone (other ranks idle, re-protection done), straight into the live tensors: "
            f"end to end {x(alone['direct']['median'])} (median), {x(alone['direct']['best'])} (best);",
            f"- data path alone through the agent's arena (`MEMSNAP_DIRECT_RESTORE=0`, and the objstore "
            f"transport): fetch {x(alone['touched']['median'])}, end to end "
            f"{x(alone['touched']['median'] + alone['apply']['median'])} (medians).",
        ]
    lines += [
        "",
        f"## RAM per node ({args.ram_mib} MiB of state per node, 5 nodes, one version)",
        "",
        "Measured from the agents' own accounting after one committed snapshot (largest node). "
        "S = the node's arena (its local copy), parity = the owner's parity scratch (two batches of "
        "`parity_window` stripes, reused by every snapshot), "
        "held = its peers' chunks. The lean columns come from a second job with `local_copy=False`: "
        "its committed local copy (0 when lean mode keeps none), its held chunks against S(k+m)/k, "
        "and its total, with its target S(k+m)/k: once its chunks are held, the staging arena gives "
        "its pages back until the next capture. "
        "Arenas after a 2nd save: with the local copy (keep=1) the committed step 1 stays whole while "
        "step 2 is captured into a second slot; lean mode reuses its one arena (resident bytes: 0 once "
        "step 2's chunks are held).",
        "",
        "| k | m | S (MiB) | parity | held | total | target S(1+(k+m)/k) | total / target | "
        "arena + held / target | lean: local copy | lean: held / S(k+m)/k | lean: total | lean: total / S(k+m)/k | "
        "arenas after a 2nd save: local copy / lean |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in ram:
        k, m, s = r["k"], r["m"], r["S"]
        t1, t2 = s * (1 + (k + m) / k), s * (k + m) / k
        lines.append(
            f"| {k} | {m} | {s / MIB:.1f} | {r['parity'] / MIB:.1f} | {r['held'] / MIB:.1f} | "
            f"{r['total'] / MIB:.1f} | {t1 / MIB:.1f} | {r['total'] / t1:.3f} | "
            f"{(s + r['held']) / t1:.3f} | {r['lean_local'] / MIB:.1f} | {r['lean_held'] / t2:.3f} | "
            f"{r['lean_total'] / MIB:.1f} | {r['lean_total'] / t2:.3f} | "
            f"{r['arena2'] / MIB:.1f} / {r['lean_arena2'] / MIB:.1f} |"
        )
    lines += [
        "",
        "Parity is encoded a batch of stripes at a time into the scratch while data shards stream "
        "from the arena, so the scratch is a fixed few MiB, not S*m/k.",
    ]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
