"""Each ``memsnap.chaos`` fault kind landing on a simulated 4-node loopback cluster running a
memsnap job (one rank per node, k=2, m=1; the head is never hit).

One cluster for the module; the tests run in file order: stall node 1's data plane -> fill
node 2's spill disk -> the CLI fills a disk -> kill node 2's training process (at a step) -> SIGTERM and a Ray drain
to a process watching for preemption on node 3 -> kill node 3 (a replacement joins) -> kill
node 2 the way a real cluster's nodes are killed (a task on it kills its raylet).
"""

from __future__ import annotations

import os

import pytest
import ray
from support.runtime import JobSpec, node_dead, wait_for

from memsnap import naming, testing
from memsnap.chaos import Fault, Injector, Schedule, read_log

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = "chaos-faults"
JOB_SPEC = JobSpec(
    JOB,
    4,
    dict(k=2, m=1, chunk=64 * 255, memory_budget=128 << 20, spill_every=1000, on_error="raise", preemption=False),
    spill="chaos-spill",
)


@ray.remote(num_cpus=0)
class Watched:
    """A process that watches for preemption notices the way ``Snapshotter`` does."""

    def __init__(self, signals: bool):
        import signal

        from memsnap.preempt import PreemptionWatcher

        self.watcher = PreemptionWatcher(
            lambda left: None, grace_seconds=30, poll_seconds=0.3, signals=(signal.SIGTERM,) if signals else ()
        ).start()

    def notice(self) -> dict:
        w = self.watcher
        return {"reason": w.reason, "left": w.seconds_left(), "signals": w.signals_installed, "pid": os.getpid()}


def save_all(job, step: int, ranks=(0, 1, 2, 3)) -> None:
    ray.get([job["trainers"][r].step_and_save.remote(step) for r in ranks], timeout=120)


def newest(job) -> int | None:
    coord = ray.get_actor(naming.coordinator(JOB), namespace=naming.NAMESPACE)
    return ray.get(coord.wait_committed.remote(-1, 0.0), timeout=60)


def inject(job, *faults: Fault, timeout: float = 180, **kw) -> Injector:
    kw.setdefault("cluster", job["cluster"])
    inj = Injector(Schedule.fixed(faults, seed=1), job=JOB, **kw).start()
    assert inj.wait(timeout, ended=False), f"faults landed: {inj.events}"
    return inj


def test_a_stall_holds_the_data_plane_until_it_ends(job):
    save_all(job, 1)
    assert ray.get(job["trainers"][0].wait.remote(1, 120), timeout=150) == 1
    agent = ray.get_actor(naming.agent(JOB, job["nodes"][1]), namespace=naming.NAMESPACE)
    inj = inject(job, Fault("stall", target=1, at_s=0, duration_s=600))  # ended by stop() below
    (ev,) = inj.events
    assert ev.ok and ev.target == job["nodes"][1] and 0 < ev.detail["remaining_s"] <= 600, ev
    save_all(job, 2)  # its chunks to and from node 1 wait for the stall to end
    wait_for(lambda: testing.data_plane_stall(agent)["held_calls"] > 0, timeout=120, what="a data-plane call held")
    assert newest(job) == 1, "nothing commits while a node's data plane is stalled"
    assert testing.data_plane_stall(agent)["remaining_s"] > 0, "(the check above ran during the stall)"
    end = inj.stop()[-1]
    assert end.phase == "end" and end.ok and end.detail["remaining_s"] == 0, end
    save_all(job, 3)
    assert ray.get(job["trainers"][0].wait.remote(3, 180), timeout=200) == 3


def test_fill_disk_fills_the_job_spill_directory_and_removes_the_filler(job, tmp_path):
    log = str(tmp_path / "fill.jsonl")
    inj = inject(job, Fault("fill_disk", target=2, at_s=0, limit_bytes=4 << 20), log=log)
    (ev,) = inj.events
    assert ev.ok and ev.target == job["nodes"][2], ev
    path = ev.detail["path"]
    assert os.path.dirname(path) == job["spill"] and os.path.getsize(path) == 4 << 20 and not ev.detail["full"]
    inj.stop()
    assert inj.events[1].phase == "end" and inj.events[1].detail == {"path": path, "removed": True}
    assert not os.path.exists(path)
    assert [e.phase for e in read_log(log).events] == ["fault", "end"]


def test_the_cli_lands_a_schedule_and_writes_its_timeline(job, tmp_path, capsys):
    from memsnap.cli import main

    log, disk = tmp_path / "cli.jsonl", tmp_path / "disk"
    disk.mkdir()
    argv = [
        "chaos",
        "--address",
        job["cluster"].address,
        "--job",
        JOB,
        "--log",
        str(log),
        "--timeout",
        "300",
        "--fault",
        f"fill_disk at_s=0 target=1 path={disk} limit_bytes=65536 duration_s=0.5",
    ]
    assert main(argv) == 1 and "--yes-kill-nodes" in capsys.readouterr().err
    assert main(argv + ["--yes-kill-nodes"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "fill_disk    fault" in out and "fill_disk    end" in out
    fault, end = read_log(str(log)).events
    assert fault.ok and fault.target == job["nodes"][1] and fault.detail["bytes"] == 65536
    assert end.ok and end.detail["removed"] and not os.listdir(disk)


def test_kill_process_at_a_step_kills_one_training_process_on_its_node(job):
    inj = inject(job, Fault("kill_process", target=2, at_step=3, process="Trainer"))
    (ev,) = inj.stop()
    assert ev.ok and ev.planned_step == 3 and ev.detail["class"] == "Trainer" and ev.detail["signal"] == "SIGKILL", ev

    def dead():
        try:
            ray.get(job["trainers"][2].node.remote(), timeout=30)
            return False
        except ray.exceptions.RayActorError:
            return True

    wait_for(dead, timeout=60, what="the killed rank's actor to be gone")
    assert ray.get(job["trainers"][1].node.remote(), timeout=30) == job["nodes"][1]  # the others live on


def notice(watched, what: str) -> dict:
    def seen():
        got = ray.get(watched.notice.remote(), timeout=30)
        return got if got["reason"] else None

    return wait_for(seen, timeout=90, what=what)


def test_preempt_sends_sigterm_that_memsnap_preempt_detects(job):
    watched = Watched.options(resources={"memsnap_node_3": 0.01}).remote(True)
    assert ray.get(watched.notice.remote(), timeout=120)["signals"], "the watcher runs in the actor's main thread"
    inj = inject(job, Fault("preempt", target=3, at_s=0, how="sigterm", process="Watched"))
    (ev,) = inj.stop()
    pid = ray.get(watched.notice.remote(), timeout=30)["pid"]
    assert ev.ok and ev.detail["sigterm"]["pids"] == [pid] and "drain" not in ev.detail, ev
    got = notice(watched, "the watcher to see the SIGTERM")
    assert got["reason"] == "signal SIGTERM"


def test_preempt_drains_the_node_the_way_memsnap_preempt_polls_for(job):
    watched = Watched.options(resources={"memsnap_node_3": 0.01}).remote(False)
    ray.get(watched.notice.remote(), timeout=120)
    inj = inject(job, Fault("preempt", target=job["nodes"][3][:10], at_s=0, how="drain", duration_s=45))
    (ev,) = inj.stop()
    assert ev.ok and ev.detail["drain"]["accepted"] and "sigterm" not in ev.detail, ev
    got = notice(watched, "the watcher to see the drain")
    assert got["reason"] == f"Ray is draining node {job['nodes'][3]}" and 0 < got["left"] <= 45


def test_kill_node_removes_a_simulated_node_and_a_replacement_joins(job):
    c = job["cluster"]
    inj = inject(job, Fault("kill_node", target=3, at_s=0), replace_killed=True)
    (ev,) = inj.stop()
    assert ev.ok and ev.target == job["nodes"][3], ev
    wait_for(lambda: node_dead(job["nodes"][3]), timeout=60, what="the killed node to be declared dead")
    job["replacement"] = ev.detail["replacement"]
    assert job["replacement"] in [n.node_id for n in c.nodes] and job["nodes"][3] not in [n.node_id for n in c.nodes]
    assert any(n["NodeID"] == job["replacement"] and n["Alive"] for n in ray.nodes())


def test_kill_node_on_a_real_cluster_kills_the_raylet_from_the_node_and_spares_the_head(job):
    target = job["nodes"][2]  # (its rank was killed above; a node up since the start)
    head = ray.get_runtime_context().get_node_id()  # the driver's node: the head of the loopback cluster
    inj = inject(
        job,
        Fault("kill_node", target=target, at_s=0),
        Fault("kill_node", target=head, at_s=0),
        cluster=None,
        address=job["cluster"].address,
        confirm=True,
    )
    events = inj.stop()
    by_target = {e.detail.get("how") and e.target or "refused": e for e in events}
    assert by_target[target].ok, events
    assert "raylet" in by_target[target].detail["how"]
    refused = by_target["refused"]
    assert not refused.ok and "spare the head" in refused.error
    wait_for(lambda: node_dead(target), timeout=90, what="the node whose raylet was killed to be declared dead")
    assert any(n["NodeID"] == head and n["Alive"] for n in ray.nodes())
