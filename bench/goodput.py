"""Goodput under node failures: memsnap (restarting the job, or recovering in place) against
torch.save, DCP async_save and Ray Train checkpoints, one data-parallel job, one seeded fault
schedule, each system in turn.

    python bench/goodput.py [--workload ddp|fsdp] [--state-mb 256] [--compute sleep|layers|model] [--step-s 1.0]
        [--horizon-s 120] [--baseline-s 15] [--mtbf-s 50] [--seed 21] [--common-n 10]
        [--systems memsnap memsnap-inplace torch.save dcp ray.train torchft] [--append]
        -> bench/results/goodput.md, goodput.png and goodput.json (goodput_fsdp.* for fsdp)
    python bench/goodput.py --render   # rewrite the .md and .png from goodput.json

The job: one rank per simulated node of a 4-node loopback Ray cluster (every address
127.0.0.1), each with ``--state-mb`` of state (a small MLP + AdamW beside a frozen buffer;
bench/goodput_job.py); ``--workload fsdp`` shards the MLP with FSDP2 (no rank holds a replica
of another's parameters or moments). Every run trains for ``--horizon-s`` wall seconds from its first
step. Faults come from one seeded Poisson schedule (job MTBF ``--mtbf-s``): at each time a
node that runs a rank (never the head) is killed abruptly and a replacement node is added;
a fault that falls while the job is still recovering lands once it trains again. After a
kill the whole job restarts (as Ray Train restarts its worker group): the ranks are killed,
started again on the live nodes, restore and go on. ``memsnap-inplace`` runs the same job,
schedule and events under ``memsnap.inplace.InplaceJob`` with one warm standby on a spare
node instead: the surviving ranks keep their processes, the standby takes the lost rank, and
the next standby warms on the replacement node; with the ddp workload (replicas) nothing is
rolled back (the standby takes the survivors' live state), with fsdp every rank rolls back
in place (survivors from their own node's RAM, the standby from its peers); its *detect*
ends at memsnap's own decision, not Ray's verdict.
``torchft`` (``--systems ... torchft``; ddp only) runs the job under Ray Train v2's
``TorchftConfig``, each worker its own replica group: after a kill the other workers go on,
and Ray Train starts one new worker, which torchft sends a live peer's state. Each system also runs ``--baseline-s`` without faults, for its failure-free rate. See the
results file for what is measured.
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH")) if p)

import psutil  # noqa: E402
from goodput_timeline import HEALTH_CHECKS, NODES, RunResult, analyse, poisson_schedule  # noqa: E402

from memsnap import goodput_model as gm  # noqa: E402
from memsnap.localcluster import LocalCluster, free_port, wait_for  # noqa: E402
from memsnap.policy import agent_ram  # noqa: E402

if TYPE_CHECKING:
    from goodput_job import MemsnapProtection

RESULTS = HERE / "results"
GIB = 1 << 30


# --- the fault schedule and the one place a fault is injected ------------------------------------
def _node_processes(node) -> list[psutil.Process]:
    """One simulated node's raylet and its worker processes (``ray::...``: ranks, agents)."""
    out = []
    for info in node.all_processes.get("raylet", []):
        try:
            out += [psutil.Process(info.process.pid)]
            out += [
                c
                for c in psutil.Process(info.process.pid).children(recursive=True)
                if " ".join(c.cmdline()).startswith("ray::")
            ]
        except psutil.Error:
            pass
    return out


class Nodes:
    """The cluster's live nodes by the index of their ``memsnap_node_<i>`` resource, and the
    node each rank runs on (``slots[rank]``): a lost node's rank moves to its replacement, the
    other ranks stay where they are."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.live = {i: n for i, n in enumerate(cluster.nodes)}  # index -> ray node
        self.slots = list(range(len(cluster.nodes)))

    def _replace(self, index: int):
        node = self.live.pop(index)
        added = self.cluster.add_node()  # a start that misses Ray's deadline is tried again there
        new = self.cluster.index_of(added)
        self.live[new] = added
        self.slots[self.slots.index(index)] = new
        return node, new

    def inject(self, victim: int) -> dict:
        """Kill the node of rank ``victim + 1`` (never the head's rank 0) abruptly, add a
        replacement, wait until Ray declares the killed node dead. The bench's one fault kind;
        swap for memsnap.chaos here."""
        import ray

        index = self.slots[1 + victim]
        on_node = _node_processes(self.live[index])
        t_kill = time.time()
        # the raylet and its workers at once, as a host goes; Ray's teardown of the node after
        # (a worker whose raylet died would linger, holding its memory: a lost node keeps nothing)
        for p in on_node:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.cluster.kill_node(self.live[index])
        node, new = self._replace(index)
        wait_for(
            lambda: any(n["NodeID"] == node.node_id and not n["Alive"] for n in ray.nodes()),
            timeout=120,
            what="Ray to declare the killed node dead",
            interval=0.05,
        )
        return {"t_kill": t_kill, "t_dead": time.time(), "killed": index, "replacement": new}

    def heal(self) -> list[dict]:
        """Replace live nodes Ray has declared dead on its own (a node of a machine this loaded
        can miss its health checks): each is recorded as an unscheduled fault."""
        import ray

        dead = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
        out = []
        for index in [i for i, n in self.live.items() if n.node_id in dead]:
            _, new = self._replace(index)
            now = time.time()
            out.append({"t_kill": now, "t_dead": now, "killed": index, "replacement": new, "unscheduled": True})
        return out


class InplaceNodes(Nodes):
    """``Nodes`` of an in-place run (the same ``live`` and ``slots``, shared): a lost rank moves
    to the standby's node, not to the replacement, so before each fault the rank -> node map is
    read from the job. The replacement ``inject`` adds is the free node the next standby warms
    on: the controller looks for a free node once, when it decides the recovery, which is
    often before the replacement has started, so once both have happened (the node added, the
    recovery decided) the node is handed to it here, without waiting for Ray's verdict."""

    def __init__(self, base: Nodes, job):
        self.cluster, self.live, self.slots, self.job = base.cluster, base.live, base.slots, job
        self._decided = 0
        self.handoffs: list[threading.Thread] = []
        self.stop = threading.Event()  # the run is over: no more standbys

    def sync(self) -> None:
        self.slots[:] = [self.live_index(self.job._ranks[r].node) for r in range(NODES)]

    def settle(self, head: int) -> None:
        """After the run: the head first (rank 0's node in every other system: never killed),
        then the other nodes the job's ranks ended on, then other live nodes as needed; the
        live nodes past those are removed (the last standby's, a node a lost rank left)."""
        try:
            ranks = [self.live_index(self.job._ranks[r].node) for r in range(NODES)]
        except (KeyError, AttributeError) as exc:  # the job never placed every rank
            _say(f"  the ranks' nodes unknown ({type(exc).__name__}: {exc})")
            ranks = list(self.slots)
        keep = [head] + [i for i in dict.fromkeys(ranks) if i != head]
        keep += [i for i in self.live if i not in keep][: max(0, NODES - len(keep))]
        self.slots[:] = keep[:NODES]
        for index in [i for i in self.live if i not in self.slots]:
            try:
                self.cluster.kill_node(self.live.pop(index))
            except Exception as exc:  # a node Ray declared dead on its own may be gone already
                _say(f"  removing node {index}: {type(exc).__name__}: {exc}")

    def live_index(self, node_id: str) -> int:
        for i, n in self.live.items():
            if n.node_id == node_id:
                return i
        raise KeyError(f"node {node_id[:12]} is not live")

    def inject(self, victim: int) -> dict:
        self.sync()
        self._decided = len(self.job.recoveries)
        return {**super().inject(victim), "rank": 1 + victim}

    def _replace(self, index: int):
        out = super()._replace(index)
        t = threading.Thread(target=self._hand_off, args=(self._decided,), daemon=True)
        self.handoffs.append(t)
        t.start()
        return out

    def _hand_off(self, decided: int) -> None:
        j = self.job
        try:
            wait_for(
                lambda: len(j.recoveries) > decided or self.stop.is_set(),
                timeout=120,
                what="the in-place recovery's decision",
            )
        except TimeoutError as exc:
            _say(f"  {exc}")
            return
        if not self.stop.is_set() and not j._standbys and not any(t.is_alive() for t in j._warming):
            j._warm_a_standby()


def coordinator(job: str):
    """The handle of memsnap's coordinator of ``job``."""
    import ray

    from memsnap import naming

    return ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)


def newest_committed(coord, timeout: float) -> int | None:
    """The coordinator's newest committed step, now (it does not wait for a newer one)."""
    import ray

    return ray.get(coord.wait_committed.remote(1 << 62, 0.0), timeout=timeout)


class Injector(threading.Thread):
    """Applies the schedule from ``t0``; a fault waits until training resumed after the last one."""

    def __init__(
        self,
        nodes: Nodes,
        schedule: list[dict],
        t0: float,
        deadline: float,
        events: str,
        job: str | None = None,
    ):
        super().__init__(daemon=True)
        self.nodes, self.schedule, self.t0, self.deadline, self.events = nodes, schedule, t0, deadline, events
        self.job = job  # memsnap's: its newest committed step is read just before each kill
        self.faults: list[dict] = []
        self.stop = threading.Event()

    def _training(self) -> bool:
        from goodput_job import read_events

        last = self.faults[-1]["t_dead"] if self.faults else 0.0
        return any(e["ev"] == "step" and e["t"] > last for e in read_events(self.events))

    def run(self) -> None:
        for f in self.schedule:
            while not self.stop.is_set() and (time.time() < self.t0 + f["at_s"] or not self._training()):
                if time.time() > self.deadline:
                    return
                time.sleep(0.05)
            if self.stop.is_set() or time.time() > self.deadline:
                return
            seen = self._committed()
            self.faults.append({"at_s": f["at_s"], **seen, **self.nodes.inject(f["victim"])})

    def _committed(self) -> dict:
        """memsnap's newest committed step as the kill lands (the coordinator's answer, asked
        just before it): a restore must load it, or a newer one committed from pieces already
        sent. ``{}`` for the other systems, or where the coordinator did not answer."""
        if self.job is None:
            return {}
        try:
            return {"committed_at_kill": newest_committed(coordinator(self.job), timeout=10)}
        except Exception as exc:  # noqa: BLE001 (a diagnostic: the kill goes ahead)
            _say(f"  the newest committed step was not read before the kill: {type(exc).__name__}: {exc}")
            return {}


class CommitWatch(threading.Thread):
    """memsnap's committed steps as they commit: the coordinator's newest, asked every 0.1 s,
    kept as ``(wall time, step)`` at each change. A save's commit lag is the time from its
    capture to the first reading at or past its step (0.1 s resolution)."""

    def __init__(self, job: str):
        super().__init__(daemon=True)
        self.job, self.stop = job, threading.Event()
        self.seen: list[tuple[float, int]] = []

    def run(self) -> None:
        coord = None
        while not self.stop.wait(0.1):
            try:
                coord = coord or coordinator(self.job)
                step = newest_committed(coord, timeout=5)
            except Exception:  # noqa: BLE001 (a diagnostic: a coordinator being rebuilt is asked again)
                coord = None
                continue
            if step is not None and (not self.seen or self.seen[-1][1] != step):
                self.seen.append((time.time(), step))


class StorageMeter(threading.Thread):
    """Bytes written under a directory: the largest size seen of every file (temporaries
    ``*.tmp`` left out, as they become the named file), polled every 0.2 s."""

    def __init__(self, root: str):
        super().__init__(daemon=True)
        self.root, self.stop = root, threading.Event()
        self.sizes: dict[str, int] = {}

    def poll(self) -> None:
        for d, _, files in os.walk(self.root):
            for name in files:
                if name.endswith(".tmp"):
                    continue
                p = os.path.join(d, name)
                try:
                    self.sizes[p] = max(self.sizes.get(p, 0), os.path.getsize(p))
                except OSError:
                    pass

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.poll()

    def total(self) -> int:
        self.poll()
        return sum(self.sizes.values())


# --- agents' CPU ----------------------------------------------------------------------------------
def agent_cpu_seconds(cluster: LocalCluster) -> float:
    """User + system CPU seconds of this cluster's memsnap agents (children of its raylets)."""
    raylets: set[int] = set()
    for node in cluster.nodes:
        for name, procs in node.all_processes.items():
            if name == "raylet":
                raylets.update(p.process.pid for p in procs)
    total = 0.0
    for p in psutil.process_iter(["cmdline", "ppid"]):
        if p.info["ppid"] in raylets and " ".join(p.info["cmdline"] or []).startswith("ray::SnapshotAgent"):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


# --- one run ----------------------------------------------------------------------------------------
@dataclass
class RunSpec:
    system: str  # none | memsnap | memsnap-inplace | torch.save | dcp | ray.train | torchft
    interval: str  # steps between saves, or "auto"
    faults: bool
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or f"{self.system}/{self.interval}"


def _rank_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, rank: int, world: int, cfg: dict, port: int):
            from datetime import timedelta

            import torch.distributed as dist
            from goodput_job import PROTECTIONS, Job, event

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=120),
            )
            self.cfg = cfg
            self.job = Job(rank, world, cfg)
            self.prot = PROTECTIONS[cfg["system"]](self.job, cfg)
            event(cfg["events"], ev="built", rank=rank, node=ray.get_runtime_context().get_node_id())

        def nbytes(self) -> int:
            return self.job.nbytes

        def restore(self) -> int | None:
            from goodput_job import event

            t = time.perf_counter()
            step = self.prot.restore(self.job)
            event(self.cfg["events"], ev="restored", rank=self.job.rank, step=step, wall=time.perf_counter() - t)
            return step

        def calibrate(self, step: int) -> dict:
            """memsnap only: one snapshot, then wait for its commit."""
            from goodput_job import event

            self.job.step(step)
            prot = cast("MemsnapProtection", self.prot)  # the memsnap system is the one calibrated
            saved = prot.save(self.job, step)
            assert saved is not None, f"calibration step {step} was not snapshotted"
            t = time.perf_counter()
            committed = prot.wait(step)
            saved.update(commit_wait=time.perf_counter() - t, committed=committed)
            event(self.cfg["events"], ev="calibrate", rank=self.job.rank, step=step, **saved)
            return saved

        def train(self, first: int, attempt: int, deadline: float) -> int:
            from goodput_job import train

            return train(self.job, self.prot, self.cfg, first, attempt, deadline)

        def close(self) -> None:
            self.prot.close()

    return Rank


def run_own(
    spec: RunSpec, cfg: dict, nodes: Nodes, schedule: list[dict], horizon: float, calibrate: int = 0
) -> RunResult:
    """A run of none / memsnap / torch.save / dcp with this driver restarting the job."""
    import ray

    Rank = _rank_actor()
    meter = StorageMeter(cfg["storage"])
    meter.start()
    extra: dict = {}

    def start(attempt: int):
        for tries in range(4):
            port = free_port()
            ranks = [
                Rank.options(resources={f"memsnap_node_{nodes.slots[r]}": 0.01}, max_restarts=0).remote(
                    r, NODES, cfg, port
                )
                for r in range(NODES)
            ]
            try:
                ray.get([r.nbytes.remote() for r in ranks], timeout=300)
                got = ray.get([r.restore.remote() for r in ranks], timeout=600)
                return ranks, 0 if got[0] is None else got[0] + 1
            except ray.exceptions.RayActorError:
                for r in ranks:
                    ray.kill(r, no_restart=True)
                healed = nodes.heal()
                inj.faults.extend(healed)
                _say(f"  restart {attempt} failed (try {tries}); replaced nodes Ray declared dead: {healed}")
        raise RuntimeError(f"{spec.name}: the job could not restart")

    job = cfg["job"] if spec.system == "memsnap" else None
    inj = Injector(nodes, schedule if spec.faults else [], 0.0, 0.0, cfg["events"], job)
    watch = CommitWatch(job) if job else None
    ranks, first = start(0)
    inj.faults.clear()  # a node lost before the run began is not the run's fault
    nbytes = ray.get(ranks[0].nbytes.remote())
    if calibrate:
        cpu = [agent_cpu_seconds(nodes.cluster)]
        cal = []
        for s in range(calibrate):
            cal.append(ray.get([r.calibrate.remote(s) for r in ranks], timeout=600))
            cpu.append(agent_cpu_seconds(nodes.cluster))
        extra["calibration"] = {"saves": cal, "agent_cpu_s": cpu}
        first = calibrate
    t0 = time.time()
    deadline = t0 + horizon
    inj.t0, inj.deadline = t0, deadline
    inj.start()
    if watch:
        watch.start()
    attempt = handled = 0
    try:
        while time.time() < deadline:
            refs = [r.train.remote(first, attempt, deadline) for r in ranks]
            failed = False
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=600)
                if not done:
                    raise TimeoutError(f"{spec.name}: a rank did not return within 600 s")
                try:
                    ray.get(done[0])
                except Exception:
                    failed = True
                    break
            if not failed:
                break
            # a rank died: wait for the injector's record (Ray has declared the node dead), or
            # find the node Ray declared dead on its own
            try:
                wait_for(lambda handled=handled: len(inj.faults) > handled, timeout=30, what="the fault's record")
            except TimeoutError:
                inj.faults.extend(nodes.heal())
            handled = len(inj.faults)
            for r in ranks:
                ray.kill(r, no_restart=True)
            attempt += 1
            if time.time() >= deadline:
                break
            ranks, first = start(attempt)
    finally:
        inj.stop.set()
        inj.join(timeout=150)
        if watch:
            watch.stop.set()
            watch.join(timeout=10)
            extra["commits"] = watch.seen
        try:  # DCP's last write finishes; memsnap's ranks drop their mappings
            ray.get([r.close.remote() for r in ranks], timeout=120)
        except Exception as exc:
            _say(f"  closing the ranks: {type(exc).__name__}")
        for r in ranks:
            ray.kill(r, no_restart=True)
        meter.stop.set()
        meter.join(timeout=10)
    from goodput_job import read_events

    return RunResult(vars(spec), t0, horizon, read_events(cfg["events"]), inj.faults, meter.total(), nbytes, extra)


def run_ray_train(spec: RunSpec, cfg: dict, nodes: Nodes, schedule: list[dict], horizon: float) -> RunResult:
    """A Ray Train ``TorchTrainer`` run: Ray Train restarts the worker group after a failure
    and hands it the newest reported checkpoint."""
    from goodput_job import ray_train_loop
    from ray.train.torch import TorchTrainer

    return _run_trainer(spec, cfg, nodes, schedule, horizon, TorchTrainer, ray_train_loop, {})


def run_torchft(spec: RunSpec, cfg: dict, nodes: Nodes, schedule: list[dict], horizon: float) -> RunResult:
    """torchft under Ray Train v2 (``TorchftConfig``, every worker its own replica group, as
    Ray's ``torchft_linear_example`` runs it): a lost worker's group leaves the quorum, the
    others go on, and Ray Train starts a new worker alone, which torchft sends a live peer's
    state. Its lighthouse and managers bind to loopback; the lighthouse forms a quorum as soon
    as it can (``join_timeout_ms``) and drops a silent manager after ``heartbeat_timeout_ms``
    (1 s each: the best setting here, as fast as memsnap's own detection)."""
    try:
        import torchft  # noqa: F401  (its workers import it: without it they fail at once, again and again)
    except ImportError as exc:
        raise RuntimeError(f"torchft is not installed ({exc}): pip install -e '.[bench]'") from exc
    from goodput_job import torchft_loop
    from ray.train.v2.torch.torch_trainer import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    lighthouse = {"bind": "127.0.0.1:0", "min_replicas": 1, "join_timeout_ms": 1000, "heartbeat_timeout_ms": 1000}
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    try:
        config = {"torch_config": TorchftConfig(lighthouse_kwargs=lighthouse, backend="gloo")}
        return _run_trainer(spec, cfg, nodes, schedule, horizon, TorchTrainer, torchft_loop, config)
    finally:
        os.environ.pop("RAY_TRAIN_V2_ENABLED", None)


def _run_trainer(
    spec: RunSpec, cfg: dict, nodes: Nodes, schedule: list[dict], horizon: float, trainer_cls, loop, extra: dict
) -> RunResult:
    """``trainer_cls(loop, **extra)`` over the 4 nodes, its workers told the run's deadline once
    every one of them has restored (the timed part starts then), the faults injected until it."""
    from goodput_job import read_events
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    meter = StorageMeter(cfg["storage"])
    meter.start()
    box: dict = {}

    def fit() -> None:
        try:
            trainer = trainer_cls(
                loop,
                train_loop_config={**cfg, "deadline_file": cfg["events"] + ".deadline"},
                scaling_config=ScalingConfig(num_workers=NODES, placement_strategy="STRICT_SPREAD"),
                run_config=RunConfig(
                    storage_path=cfg["storage"], name="goodput", failure_config=FailureConfig(max_failures=-1)
                ),
                **extra,
            )
            box["result"] = trainer.fit()
        except BaseException as exc:
            box["error"] = exc

    th = threading.Thread(target=fit, daemon=True)
    th.start()
    inj = None
    try:
        wait_for(
            lambda: sum(e["ev"] == "restored" for e in read_events(cfg["events"])) >= NODES or not th.is_alive(),
            timeout=600,
            what=f"the {spec.system} workers to start",
        )
        if "error" in box:
            raise box["error"]
        t0 = time.time()
        deadline = t0 + horizon
        Path(cfg["events"] + ".deadline.tmp").write_text(repr(deadline))
        os.replace(cfg["events"] + ".deadline.tmp", cfg["events"] + ".deadline")
        inj = Injector(nodes, schedule if spec.faults else [], t0, deadline, cfg["events"])
        inj.start()
        th.join(timeout=horizon + 240)
    finally:
        if inj is not None:
            inj.stop.set()
            inj.join(timeout=150)
        meter.stop.set()
        meter.join(timeout=10)
    if th.is_alive():
        ev = read_events(cfg["events"])
        last = max((e["t"] for e in ev), default=t0)
        raise TimeoutError(
            f"{spec.name}: TorchTrainer.fit did not return within {horizon + 240:.0f} s of the first step; "
            f"{len(inj.faults)} node(s) killed, the last event from a worker {last - t0:.0f} s after the first step "
            f"({sum(e['ev'] == 'built' for e in ev)} worker starts, {sum(e['ev'] == 'step' for e in ev)} steps)"
        )
    if "error" in box:
        raise box["error"]
    events = read_events(cfg["events"])
    return RunResult(vars(spec), t0, horizon, events, inj.faults, meter.total(), cfg["state_mb"] << 20)


class _Pinned(set):
    """A set whose ``pinned`` members stay in it (``discard`` leaves them)."""

    def __init__(self, items=(), *, pinned: set):
        super().__init__(items)
        self.pinned = set(pinned)
        self.update(self.pinned)

    def discard(self, item) -> None:
        if item not in self.pinned:
            super().discard(item)


def run_inplace(spec: RunSpec, cfg: dict, nodes: Nodes, schedule: list[dict], horizon: float) -> RunResult:
    """memsnap recovering in place: ``InplaceJob`` with rank r on ``nodes.slots[r]``'s node and
    one warm standby on a spare node added for it; the timed part starts once every rank has
    restored (the driver writes the deadline to the job's store). Each fault's ``t_dead`` is the
    recovery's decision (``inplace_faults``). Afterwards ``nodes`` holds the ranks' last nodes
    only: the node left without a rank (the last standby's) is removed, so the next system
    runs on as many nodes as this one began with."""
    from functools import partial

    import ray
    from goodput_job import DEADLINE_KEY, memsnap_options, read_events, setup_inplace, train_inplace
    from goodput_timeline import inplace_faults

    from memsnap.inplace import InplaceJob
    from memsnap.rank import shutdown

    healed = nodes.heal()  # a node Ray declared dead during an earlier run: not this run's fault
    if healed:
        _say(f"  replaced nodes Ray declared dead before the run: {healed}")
    meter = StorageMeter(cfg["storage"])
    meter.start()
    spare = nodes.cluster.add_node()
    nodes.live[nodes.cluster.index_of(spare)] = spare
    control = cfg["events"] + ".controller"  # the controller's own records (recovery, standby, recovered)
    liveness = {k: cfg[k] for k in ("lost_after_s", "suspect_after_s") if cfg.get(k) is not None}
    j = InplaceJob(
        cfg["job"],
        partial(setup_inplace, cfg=cfg, world=NODES),
        partial(train_inplace, cfg=cfg),
        rank_nodes=[nodes.live[nodes.slots[r]].node_id for r in range(NODES)],
        standby_nodes=[spare.node_id],
        options=memsnap_options(cfg),
        events=control,
        **liveness,
    )
    # the head runs this driver, the controller, its store and the coordinator, and the bench
    # never kills it: no standby there, even once a lost rank 0 has left it free
    head = next(i for i, n in nodes.live.items() if n.node_id == ray.get_runtime_context().get_node_id())
    j._used_nodes = _Pinned(j._used_nodes, pinned={nodes.live[head].node_id})
    box: dict = {}

    def go() -> None:
        try:
            box["results"] = j.run(timeout_s=horizon + 1800)
        except BaseException as exc:
            box["error"] = exc

    th = threading.Thread(target=go, daemon=True)
    th.start()
    inp = InplaceNodes(nodes, j)
    inj = Injector(inp, schedule if spec.faults else [], 0.0, 0.0, cfg["events"], cfg["job"])
    watch = CommitWatch(cfg["job"])
    t0 = 0.0
    try:
        wait_for(
            lambda: sum(e["ev"] == "restored" for e in read_events(cfg["events"])) >= NODES or not th.is_alive(),
            timeout=900,
            what="the in-place ranks to restore",
        )
        if not th.is_alive():
            raise box.get("error") or RuntimeError(f"{spec.name}: the in-place job ended before training")
        t0 = time.time()
        inj.t0, inj.deadline = t0, t0 + horizon
        assert j.store is not None  # run() made it before any rank restored
        j.store.set(DEADLINE_KEY, repr(t0 + horizon))
        inj.start()
        watch.start()
        th.join(timeout=horizon + 900)
        if th.is_alive():
            ev = read_events(cfg["events"])
            raise TimeoutError(
                f"{spec.name}: the in-place job did not end within {horizon + 900:.0f} s of its "
                f"first step ({len(inj.faults)} node(s) killed, {len(j.recoveries)} recoveries, "
                f"{sum(e['ev'] == 'step' for e in ev)} steps)"
            )
        if "error" in box:
            raise box["error"]
    finally:
        inj.stop.set()
        if inj.is_alive():
            inj.join(timeout=150)
        watch.stop.set()
        if watch.is_alive():
            watch.join(timeout=10)
        inp.stop.set()
        for t in inp.handoffs:
            t.join(timeout=60)
        if th.is_alive() and j.store is not None:
            j.store.set(DEADLINE_KEY, "0")  # rank 0 reads it every step: the ranks stop together
            th.join(timeout=180)
        meter.stop.set()
        meter.join(timeout=10)
        recoveries = j.collect() if j.store is not None else [r.to_dict() for r in j.recoveries]
        try:
            shutdown(cfg["job"], timeout=30)
        except Exception as exc:
            _say(f"shutdown {cfg['job']}: {exc}")
        inp.settle(head)
    standby = [e for e in read_events(control) if e.get("event") == "standby"]
    # a recovery before the timed part is not the run's fault (as run_own drops a node lost then)
    faults = inplace_faults(inj.faults, [r for r in recoveries if r["noticed"] >= t0])
    return RunResult(
        vars(spec),
        t0,
        horizon,
        read_events(cfg["events"]),
        faults,
        meter.total(),
        cfg["state_mb"] << 20,
        {"recoveries": recoveries, "standby_events": standby, "commits": watch.seen},
    )


# --- the whole benchmark -------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-mb", type=int, default=256, help="state per rank, MiB")
    ap.add_argument(
        "--workload",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="ddp: the model replicated, gradients all-reduced; fsdp: FSDP2 fully_shard, no replica "
        "(results in goodput_fsdp.md unless --out)",
    )
    ap.add_argument(
        "--compute",
        choices=("sleep", "layers", "model"),
        default="sleep",
        help="sleep: step-s slept after the backward; layers: step-s slept in equal parts in each layer's "
        "forward and backward (between FSDP2's per-layer collectives); model: model-passes passes on the CPU",
    )
    ap.add_argument("--step-s", type=float, default=1.0, help="simulated compute per step (sleep, layers)")
    ap.add_argument("--model-passes", type=int, default=40, help="forward/backward passes per step (--compute model)")
    ap.add_argument("--horizon-s", type=float, default=120.0, help="wall seconds of each run with faults")
    ap.add_argument("--baseline-s", type=float, default=15.0, help="wall seconds of each failure-free run")
    ap.add_argument("--mtbf-s", type=float, default=50.0, help="the schedule's job MTBF, seconds")
    ap.add_argument(
        "--seed",
        type=int,
        default=21,
        help="the schedule's seed (21: the first seed whose draw at the defaults has 3 faults "
        "at least 25 s apart, the last before the final 30 s)",
    )
    ap.add_argument("--common-n", type=int, default=10, help="the interval every disk system also runs at")
    ap.add_argument("--spill-every", type=int, default=10, help="memsnap's durable spill, steps")
    ap.add_argument("--systems", nargs="+", default=["memsnap", "memsnap-inplace", "torch.save", "dcp", "ray.train"])
    ap.add_argument(
        "--lost-after-s",
        type=float,
        default=None,
        help="memsnap-inplace: seconds without beats before a member is lost (InplaceJob's default)",
    )
    ap.add_argument(
        "--suspect-after-s",
        type=float,
        default=None,
        help="memsnap-inplace: the same once a collective failed (InplaceJob's default)",
    )
    ap.add_argument("--storage", default=None, help="the directory standing in for NFS (default: a temp dir)")
    ap.add_argument("--out", default=None, help="the results file (default bench/results/goodput[_fsdp].md)")
    ap.add_argument("--render", action="store_true", help="only rewrite the .md/.png from the .json")
    ap.add_argument(
        "--note",
        action="append",
        default=[],
        help="with --render: a note on this run for the results file (repeatable)",
    )
    ap.add_argument(
        "--append", action="store_true", help="run only --systems again and keep the other systems' runs from the .json"
    )
    args = ap.parse_args()
    out = Path(args.out or RESULTS / ("goodput.md" if args.workload == "ddp" else f"goodput_{args.workload}.md"))
    if args.render:
        data = json.loads(out.with_suffix(".json").read_text())
        if args.note:  # what the person who ran it has to say about this run, kept with the data
            data["notes"] = args.note
            out.with_suffix(".json").write_text(json.dumps(data, indent=1))
        render(data, out)
        return
    keep, keep_yd, passes = [], {}, []
    if args.append:  # rerun some systems, keep the other systems' runs (and intervals) of the earlier file
        old = json.loads(out.with_suffix(".json").read_text())
        keep = [r for r in old["runs"] if r["spec"]["system"] not in (*args.systems, "none")]  # none: run again
        keep_yd = {k: v for k, v in old.get("young_daly", {}).items() if k not in args.systems}
        passes = earlier_passes(old)
    data = measure(args, out.with_suffix(".json"), keep, keep_yd, passes)
    render(data, out)


def reap_children() -> None:
    """Kill what is left of this process's own children: Ray gives a starting node 30 s to
    register and, past that, raises without stopping the processes it started."""
    for p in psutil.Process().children(recursive=True):
        try:
            p.kill()
        except psutil.Error:
            pass


def start_cluster() -> LocalCluster:
    """The 4-node cluster (LocalCluster cleans up and tries again a start that misses Ray's
    startup deadline on a machine this loaded)."""
    return LocalCluster(NODES, cpus_per_node=1, object_store_mb=96, system_config=HEALTH_CHECKS)


def _say(msg: str) -> None:
    print(f"[goodput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def earlier_passes(old: dict) -> list[dict]:
    """The passes an appended file was measured in (a file written by one pass: that one)."""
    if old.get("passes"):
        return old["passes"]
    m = old["machine"]
    return [
        {
            "date": m["date"],
            "seconds": m["seconds"],
            "loadavg_after_each_run": m["loadavg_after_each_run"],
            "systems": sorted({r["spec"]["system"] for r in old["runs"]} - {"none"}),
        }
    ]


def measure(
    args, json_path: Path, keep: list[dict], keep_yd: dict[str, int] | None = None, passes: list[dict] | None = None
) -> dict:
    from memsnap.memory import shmdir
    from memsnap.rank import shutdown

    t_begin = time.time()
    schedule = poisson_schedule(args.mtbf_s, args.horizon_s, args.seed)
    storage_root = args.storage or tempfile.mkdtemp(prefix="memsnap-goodput-nfs-")
    scratch = tempfile.mkdtemp(prefix="memsnap-goodput-scratch-")
    base_cfg = {
        "state_mb": args.state_mb,
        "workload": args.workload,
        "compute": args.compute,
        "step_s": args.step_s,
        "model_passes": args.model_passes,
        "seed": args.seed,
        "spill_every": args.spill_every,
        "spill_bytes_per_s": 256 << 20,
        # what `memsnap plan` says a node needs (RS(2,1), keep=2: 9x the state), and 256 MiB to spare
        "memory_budget": int(agent_ram(args.state_mb << 20, k=2, m=1, keep=2)) + (256 << 20),
        "node_mtbf_s": args.mtbf_s * NODES,
        "scratch": scratch,
        "lost_after_s": args.lost_after_s,
        "suspect_after_s": args.suspect_after_s,
    }
    runs: list[dict] = list(keep)
    chosen: dict[str, int] = dict(keep_yd or {})  # Young/Daly N per disk system
    errors: dict[str, str] = {}
    step_s: float | None = None
    loads: list[tuple[float, float, float]] = []
    cpu_busy: list[float] = []
    psutil.cpu_percent(None)
    _say(f"schedule (seed {args.seed}, job MTBF {args.mtbf_s} s): {[round(f['at_s'], 1) for f in schedule]}")
    counter = [0]

    def one(cluster_nodes: Nodes, spec: RunSpec, horizon: float, **kw) -> dict:
        counter[0] += 1
        job = f"goodput-{os.getpid()}-{counter[0]}"  # unique: another bench may run beside this one
        storage = os.path.join(storage_root, job)
        os.makedirs(storage)
        events = os.path.join(scratch, f"{job}.jsonl")
        cfg = dict(base_cfg, system=spec.system, interval=spec.interval, job=job, storage=storage, events=events)
        _say(f"{spec.name} {'with faults' if spec.faults else 'failure-free'} for {horizon:.0f} s")
        try:
            if spec.system == "ray.train":
                res = run_ray_train(spec, cfg, cluster_nodes, schedule, horizon)
            elif spec.system == "torchft":
                res = run_torchft(spec, cfg, cluster_nodes, schedule, horizon)
            elif spec.system == "memsnap-inplace":
                res = run_inplace(spec, cfg, cluster_nodes, schedule, horizon)
            else:
                res = run_own(spec, cfg, cluster_nodes, schedule, horizon, **kw)
        finally:
            if spec.system in ("memsnap", "memsnap-inplace"):
                try:
                    shutdown(job, timeout=30)
                except Exception as exc:
                    _say(f"shutdown {job}: {exc}")
                shmdir.remove_job(job)
            shutil.rmtree(storage, ignore_errors=True)
        loads.append(os.getloadavg())
        cpu_busy.append(psutil.cpu_percent(None))
        a = analyse(res)
        summary = {
            "spec": res.spec,
            "state_bytes": res.state_bytes,
            "faults": res.faults,
            "extra": res.extra,
            "t0": res.t0,
            "events": res.events,
            **a,
        }  # the raw events, to analyse again
        _say(
            f"  {spec.name}: {a['useful_steps']} useful steps, {len(res.faults)} faults, "
            f"lost {[f.get('lost_steps') for f in a['failures']]}, rto "
            f"{[round(f.get('rto', -1), 1) for f in a['failures']]}, stall {a['stall_steady']}, "
            f"storage {a['storage_bytes'] / GIB:.2f} GiB"
            + (
                f", committed at each kill {[f.get('committed_at_kill') for f in a['failures']]}, "
                f"restored {[f.get('restored_step') for f in a['failures']]}"
                if any("committed_at_kill" in f for f in a["failures"])
                else ""
            )
            + (
                f", commit lag median {statistics.median(lags):.2f} s, mean {statistics.fmean(lags):.2f} s, "
                f"max {max(lags):.2f} s over {len(lags)} snapshots"
                if (lags := a["commit_lags"])
                else ""
            )
        )
        runs.append(summary)
        json_path.write_text(json.dumps(result(), indent=1))  # every run is kept as soon as it ends
        return summary

    def result() -> dict:
        return {
            "args": vars(args),
            "schedule": schedule,
            "runs": runs,
            "young_daly": chosen,
            "none_step_s": step_s,
            "errors": errors,
            "health_checks": HEALTH_CHECKS,
            "machine": {
                "cpus": os.cpu_count(),
                "loadavg_after_each_run": loads,
                "cpu_busy_percent": cpu_busy,
                "mem_total_gib": psutil.virtual_memory().total / GIB,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "seconds": time.time() - t_begin,
            },
            "passes": [
                *(passes or []),
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "seconds": time.time() - t_begin,
                    "loadavg_after_each_run": loads,
                    "systems": list(args.systems),
                },
            ],
        }

    def one_system(system: str) -> None:
        if system == "memsnap":
            one(nodes, RunSpec("memsnap", "1", False), args.baseline_s, calibrate=6)
            one(nodes, RunSpec("memsnap", "1", True), args.horizon_s)
            one(nodes, RunSpec("memsnap", "auto", False), args.baseline_s)
            one(nodes, RunSpec("memsnap", "auto", True), args.horizon_s)
            return
        if system == "memsnap-inplace":  # a snapshot every step, as memsnap/1, and at auto: with
            # replicas a recovery takes the live state, so the snapshots are only the fallback
            one(nodes, RunSpec("memsnap-inplace", "1", False), args.baseline_s)
            one(nodes, RunSpec("memsnap-inplace", "1", True), args.horizon_s)
            one(nodes, RunSpec("memsnap-inplace", "auto", False), args.baseline_s)
            one(nodes, RunSpec("memsnap-inplace", "auto", True), args.horizon_s)
            return
        if system == "torchft":  # no saves: a new worker is sent a live replica's state
            if args.workload != "ddp":
                raise ValueError(
                    f"--workload {args.workload}: torchft shards only inside a replica group (HSDP: here two "
                    f"groups of {NODES // 2}), and Ray Train's TorchftConfig makes every worker a replica group "
                    "of its own (replica groups of one: ray.train.v2's worker_group.py, 'support replica groups "
                    "of size > 1' is a TODO in Ray 2.60)"
                )
            one(nodes, RunSpec("torchft", "0", False), args.baseline_s)
            one(nodes, RunSpec("torchft", "0", True), args.horizon_s)
            return
        assert step_s is not None  # the "none" baseline runs first
        base = one(nodes, RunSpec(system, str(args.common_n), False), args.baseline_s)
        cost = base["stall_steady"] or base["stall_first"] or 0.0
        n = max(1, round(gm.young_daly(cost, args.mtbf_s) / step_s))
        chosen[system] = n
        _say(f"  {system}: save stall {cost:.2f} s -> Young/Daly N = {n} steps")
        if n != args.common_n:
            one(nodes, RunSpec(system, str(n), False, f"{system}/{n} (Young/Daly)"), args.baseline_s)
            one(nodes, RunSpec(system, str(n), True, f"{system}/{n} (Young/Daly)"), args.horizon_s)
        one(nodes, RunSpec(system, str(args.common_n), True), args.horizon_s)

    with start_cluster() as cluster:
        nodes = Nodes(cluster)
        try:
            none = one(nodes, RunSpec("none", "0", False), args.baseline_s)
            step_s = 1.0 / none["rate"]
            for system in args.systems:
                try:
                    one_system(system)
                except Exception as exc:  # the other systems still run; the report names the failure
                    errors[system] = f"{type(exc).__name__}: {exc}"[:2000]
                    _say(f"{system} failed: {errors[system]}")
        finally:
            for i in range(counter[0] + 1):
                shmdir.remove_job(f"goodput-{os.getpid()}-{i}")
    reap_children()
    shutil.rmtree(scratch, ignore_errors=True)
    if not args.storage:
        shutil.rmtree(storage_root, ignore_errors=True)
    data = result()
    json_path.write_text(json.dumps(data, indent=1))
    return data


# --- the report -------------------------------------------------------------------------------------
def render(data: dict, out: Path) -> None:
    """Analyse every run again from its raw events (the analysis may have been fixed since it
    ran), then write the report."""
    from goodput_report import write_report

    for run in data["runs"]:
        if "events" in run:
            run.update(
                analyse(
                    RunResult(
                        run["spec"],
                        run["t0"],
                        run["horizon_s"],
                        run["events"],
                        run["faults"],
                        run["storage_bytes"],
                        run["state_bytes"],
                        run.get("extra", {}),
                    )
                )
            )
    write_report(data, out)


if __name__ == "__main__":
    main()
