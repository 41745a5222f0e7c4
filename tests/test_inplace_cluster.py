"""In-place recovery on a loopback cluster: a node is killed mid-training; the survivors keep
their processes, the standby takes the lost rank, and training goes on bitwise as if the
node had never been lost."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psutil
import pytest
import ray
from support import inplace_job
from torch.distributed import TCPStore

from memsnap import naming
from memsnap.inplace import InplaceJob
from memsnap.localcluster import LocalCluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]

OPTIONS = dict(k=1, m=1, keep=2, memory_budget=64 << 20, every_steps=1, preemption=False)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(nodes=5) as lc:
        yield lc


def kill_hard(lc: LocalCluster, node) -> None:
    """The node's raylet and every process under it, as a lost host would go."""
    lc.kill_node_hard(node)


def test_a_killed_node_is_replaced_by_the_standby_and_the_survivors_keep_their_processes_under_ddp(cluster) -> None:
    import memsnap

    lc = cluster
    ranks = lc.nodes[-4:-1]
    spare = lc.nodes[-1]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    steps = 60
    # DDP, built once per process in setup, its gradients through the re-formable group
    j = InplaceJob(
        job,
        inplace_job.setup_ddp,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[spare.node_id],
        options=OPTIONS,
    )
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(results=j.run(timeout_s=600)), daemon=True)
    try:
        runner.start()
        wait_for(
            lambda: (
                j.store is not None
                and store_of(j).check(["test/progress/1"])
                and int(store_of(j).get("test/progress/1")) >= 10
            ),
            timeout=300,
            what="rank 1 to train 10 steps",
        )
        pids_before = {r: s for r, s in j.members().items()}
        # the coordinator runs beside the controller, on no rank's node (so no rank node's loss takes it)
        coord = ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)
        assert ray.get(coord.status.remote(), timeout=60)["coordinator_node"] == ray.get_runtime_context().get_node_id()
        at_kill = int(store_of(j).get("test/progress/1"))
        kill_hard(lc, ranks[1])
        runner.join(timeout=600)
        assert not runner.is_alive(), "the job did not finish"
        assert sorted(out["results"]) == [0, 1, 2]
        recs = j.collect()
        assert len(recs) == 1, recs
        rec = recs[0]
        assert rec["lost"] == {1: "r1"} and rec["takeover"] == {1: "s0"}
        assert rec["fenced_nodes"] == [ranks[1].node_id]
        # its process's lifeline closed with it: named lost without waiting out its heartbeats
        assert "lifeline closed" in rec["why"], rec["why"]
        # replicas: the survivors kept their live state, in the processes they had, and the
        # standby took theirs; nothing rolled back but the step in flight
        assert rec["tiers"] == {0: "kept", 1: "live", 2: "kept"} and rec["live_refused"] is None
        assert rec["pids"][0] == pids_before[0]["pid"] and rec["pids"][2] == pids_before[2]["pid"]
        assert len(set(rec["steps"].values())) == 1
        print("went on from step", rec["steps"], "rank 1 had trained", at_kill)
        assert rec["steps"][0] >= at_kill
        # every step trained again after the rollback gave the digest it gave the first time
        assert int(store_of(j).get("test/replayed")) > 0 if store_of(j).check(["test/replayed"]) else True
        mismatched = [(r, s) for r in range(3) for s in range(steps) if store_of(j).check([f"test/mismatch/{r}/{s}"])]
        assert mismatched == [], (mismatched, rec)
        # and the three ranks end identical (data parallel), each having trained every step
        assert len({v["digest"] for v in out["results"].values()}) == 1
        coord = ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)
        status = ray.get(coord.status.remote(), timeout=60)
        assert status["fenced"] == [ranks[1].node_id]
        assert [r["gen"] for r in status["recoveries"]] == [1]
        # the snapshots go on after the live takeover: the standby's node, which joined with no
        # restore round of its own, takes the job's restore generation, so its steps commit
        assert status["committed_step"] > rec["steps"][0], (status["committed_step"], status["failed_steps"])
        split = rec["split"]
        print("recovery split:", {k: None if v is None else round(v, 3) for k, v in split.items()})
        assert None not in split.values()
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def three_ranks_and_a_spare(lc: LocalCluster) -> tuple[list, Any, str]:
    """The nodes of three ranks and of a standby (the cluster's last four, nodes added where a
    test before took some away), and a new job name."""
    while len(lc.nodes) < 5:
        lc.add_node()
    return lc.nodes[-4:-1], lc.nodes[-1], f"inplace-{uuid.uuid4().hex[:6]}"


def store_of(j: InplaceJob) -> TCPStore:
    """The running job's store (the test's keys are written there by its ranks)."""
    assert j.store is not None, "the job is not running"
    return j.store


def run_in_thread(j, out):
    t = threading.Thread(target=lambda: out.update(results=j.run(timeout_s=600)), daemon=True)
    t.start()
    return t


def assert_replayed_bitwise(j, out: dict, steps: int, replicas: bool = True) -> None:
    """Every step trained again after a rollback gave the digest it gave the first time, and
    the three ranks end identical (``replicas``: data parallel) or each with its own shards."""
    assert not any(store_of(j).check([f"test/mismatch/{r}/{s}"]) for r in range(3) for s in range(steps))
    assert len({v["digest"] for v in out["results"].values()}) == (1 if replicas else 3)


def progress(j, rank: int, at_least: int) -> bool:
    key = f"test/progress/{rank}"
    return j.store is not None and store_of(j).check([key]) and int(store_of(j).get(key)) >= at_least


def test_a_killed_node_under_fsdp2_is_restored_from_its_peers_and_the_survivors_from_their_ram(cluster) -> None:
    """FSDP2: no rank holds a replica of another's shards, so the lost rank's parameters and
    optimizer moments exist only in memsnap's erasure-coded snapshot."""
    import memsnap

    lc = cluster
    ranks, spare, job = three_ranks_and_a_spare(lc)
    steps = 40
    j = InplaceJob(
        job,
        inplace_job.setup_fsdp,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[spare.node_id],
        options=OPTIONS,
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 0, 10), timeout=300, what="rank 0 to train 10 steps")
        pids_before = j.members()
        kill_hard(lc, ranks[2])
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        (rec,) = j.collect()
        assert rec["lost"] == {2: "r2"} and rec["takeover"] == {2: "s0"}
        assert rec["tiers"] == {0: "local", 1: "local", 2: "peer"}
        assert rec["pids"][0] == pids_before[0]["pid"] and rec["pids"][1] == pids_before[1]["pid"]
        # every rank's rolled-back state, the standby's decoded from its peers included, was
        # checked against the digest the first run recorded after that step
        assert all(int(store_of(j).get(f"test/restore_checked/{r}")) >= 1 for r in range(3))
        assert_replayed_bitwise(j, out, steps, replicas=False)
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def test_a_hung_rank_is_noticed_by_its_heartbeat_fenced_and_replaced(cluster) -> None:
    """SIGSTOP: no socket closes, no collective error; only the beats stop."""
    import memsnap

    ranks, spare, job = three_ranks_and_a_spare(cluster)
    steps = 40
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[spare.node_id],
        options=OPTIONS,
        backend_timeout_s=300,
        live_takeover="off",  # the rollback's whole-copy read from the hung rank's own node
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    stopped = None
    try:
        wait_for(lambda: progress(j, 2, 8), timeout=300, what="rank 2 to train 8 steps")
        stopped = psutil.Process(j.members()[2]["pid"])
        stopped.suspend()
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        (rec,) = j.collect()
        assert rec["lost"] == {2: "r2"} and rec["why"].startswith("rank 2: no heartbeat")
        # only the process hung: its node's agent still answers, so the node is not fenced and
        # the standby reads the rank's whole copy from it (one read, no decode)
        assert rec["fenced_nodes"] == []
        assert rec["tiers"] == {0: "local", 1: "local", 2: "copy"}
        assert_replayed_bitwise(j, out, steps)
        # fenced: the frozen process was killed, so it cannot wake up into the job
        wait_for(
            lambda: not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE,
            timeout=60,
            what="the hung rank's process to be killed",
        )
    finally:
        if stopped is not None:
            try:
                stopped.resume()
            except psutil.Error:
                pass
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def test_a_killed_rank_whose_sockets_stay_open_is_named_lost_by_its_node(cluster, tmp_path) -> None:
    """A rank is killed alone, and its sockets stay open (a child holds them, as a teardown that
    frees many GiB does for a second or more): its lifeline does not close and no collective
    fails; only its beats stop. Its node's agent, asked once it has been silent for
    ``suspect_after_s``, says that its process has ended, and it is named lost on that word,
    long before its silence (``lost_after_s``, set far off here) would name it."""
    import memsnap

    ranks, spare, job = three_ranks_and_a_spare(cluster)
    steps = 40
    release = str(tmp_path / "release")
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(steps, step_s=0.05, hold=(2, release)),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[spare.node_id],
        options=OPTIONS,
        lost_after_s=60.0,
        slow_limit_s=60.0,
        live_takeover="off",
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 2, 8), timeout=300, what="rank 2 to train 8 steps")
        killed = psutil.Process(j.members()[2]["pid"])
        held = killed.children()
        assert held, "rank 2 forked no child"
        alive = watch_alive(held[0])
        killed.kill()
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        (rec,) = j.collect()
        assert rec["lost"] == {2: "r2"}, rec
        assert "its node says so" in rec["why"], rec["why"]
        # the child still held the killed rank's sockets when the loss was decided: no socket
        # could have told (it is killed as the job ends)
        assert alive["last"] > rec["decided"], (alive, rec["decided"])
        # the node lives: not fenced, and the standby reads the rank's whole copy from it
        assert rec["fenced_nodes"] == []
        assert rec["tiers"] == {0: "local", 1: "local", 2: "copy"}
        assert_replayed_bitwise(j, out, steps)
    finally:
        with open(release, "w"):
            pass
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def watch_alive(proc: psutil.Process) -> dict:
    """``{"last": the last time.time() at which ``proc`` was seen running}``, kept up to date
    by a thread (every 20 ms) until it is seen gone."""
    seen = {"last": 0.0}

    def watch() -> None:
        try:
            while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                seen["last"] = time.time()
                time.sleep(0.02)
        except psutil.Error:
            pass

    threading.Thread(target=watch, daemon=True).start()
    return seen


@pytest.mark.parametrize("how", ["sleeps", "holds_the_gil"])
def test_a_slow_rank_is_not_taken_for_a_lost_one(cluster, caplog, how) -> None:
    """One step of one rank takes 3x the time after which silent beats mean a loss, with no
    standby (a false verdict would end the job). Sleeping, its beats go on from their own
    thread; holding the GIL, they stop, and its node's agent says the process runs (not
    stopped): it is waited for up to ``slow_limit_s``. Nothing is recovered."""
    import memsnap

    lc = cluster
    ranks = lc.nodes[-3:]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    once = (1, 5, 3.0)  # rank 1, step 5, 3 s
    train = inplace_job.make_train(20, slow=once) if how == "sleeps" else inplace_job.make_train(20, gil=once)
    j = InplaceJob(
        job,
        inplace_job.setup,
        train,
        rank_nodes=[n.node_id for n in ranks],
        options=OPTIONS,
        lost_after_s=1.0,
        slow_limit_s=20.0,
        on_no_standby="fail",
    )
    out: dict = {}
    try:
        with caplog.at_level("WARNING", logger="memsnap.inplace"):
            runner = run_in_thread(j, out)
            runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        assert store_of(j).check(["test/slow" if how == "sleeps" else "test/gil"])  # the slow step happened
        assert j.collect() == []
        waited = [r.getMessage() for r in caplog.records if "its process runs" in r.getMessage()]
        if how == "holds_the_gil":
            assert waited and "r1 (rank 1)" in waited[0], waited
        else:
            assert waited == []
    finally:
        memsnap.shutdown(job, timeout=30)


def test_a_training_function_that_raises_ends_the_job_naming_the_rank_and_the_error(cluster):
    """A bug is not a lost node: every process would raise again, so no standby is spent on
    it and no generation is formed again; run() ends with the rank's error."""
    import memsnap
    from memsnap.inplace.controller import RecoveryError

    lc = cluster
    ranks, spare = lc.nodes[-3:-1], lc.nodes[-1]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(20, bug=(1, 3)),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[spare.node_id],
        options=OPTIONS,
    )
    try:
        with pytest.raises(
            RecoveryError, match=r"rank 1 \(r1\) failed: .*ValueError: a bug in the training function at step 3"
        ):
            j.run(timeout_s=600)
        assert j.recoveries == []
    finally:
        memsnap.shutdown(job, timeout=30)


def test_a_standby_that_dies_as_it_takes_over_is_replaced_by_the_next(cluster) -> None:
    """The survivors wait in the restore round for the first standby, which dies: the round
    is cancelled (no 300 s wait), and the second standby takes the rank."""
    import memsnap

    lc = cluster
    while len(lc.nodes) < 6:
        lc.add_node()
    ranks, spares = lc.nodes[-5:-2], lc.nodes[-2:]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    steps = 40
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[s.node_id for s in spares],
        options=OPTIONS,
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 1, 8), timeout=300, what="rank 1 to train 8 steps")
        store_of(j).set("test/die_on_takeover", "1")
        kill_hard(lc, ranks[1])
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        first, second = j.collect()
        assert first["lost"] == {1: "r1"} and first["takeover"] == {1: "s0"}
        assert second["lost"] == {1: "s0"} and second["takeover"] == {1: "s1"}
        assert second["fenced_nodes"] == []  # the standby's node and agent were fine
        # the survivors kept their live state through both attempts; the second standby took it
        assert second["tiers"] == {0: "kept", 1: "live", 2: "kept"}
        assert_replayed_bitwise(j, out, steps)
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def test_a_handover_moves_a_rank_to_the_standby_with_nothing_rolled_back(cluster) -> None:
    """A preemption notice (here asked of the controller, as a drain of the node would): the
    rank hands over at the next step boundary; every rank restores the step it just took."""
    import memsnap

    ranks, spare, job = three_ranks_and_a_spare(cluster)
    steps = 30
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[spare.node_id],
        options=OPTIONS,
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 0, 6), timeout=300, what="rank 0 to train 6 steps")
        pids = j.members()
        j.hand_over(2)
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        (rec,) = j.collect()
        assert rec["lost"] == {2: "r2"} and "handed over" in rec["why"]
        assert rec["takeover"] == {2: "s0"}
        assert rec["fenced_nodes"] == []  # the node was still there: it left cleanly
        assert rec["pids"][0] == pids[0]["pid"] and rec["pids"][1] == pids[1]["pid"]
        # nothing rolled back: no step was trained twice
        assert not store_of(j).check(["test/replayed"])
        assert len({v["digest"] for v in out["results"].values()}) == 1
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def test_a_node_lost_after_the_coordinator_was_lost_recovers_through_its_rebuild(cluster) -> None:
    """The coordinator's process dies (Ray restarts it beside the controller; it rebuilds its
    state from the agents), then a rank's node is killed: the recovery goes through the rebuilt
    coordinator, the survivors roll back in place, and the replayed steps are bitwise equal."""
    import memsnap

    lc = cluster
    ranks, spare, job = three_ranks_and_a_spare(lc)
    steps = 40
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[spare.node_id],
        options=OPTIONS,
        live_takeover="off",  # the rollback: its restore plan is the rebuilt coordinator's
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 1, 6), timeout=300, what="rank 1 to train 6 steps")
        pids = j.members()
        coord = ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)
        ray.kill(coord, no_restart=False)  # its process dies; Ray starts it again
        at = int(store_of(j).get("test/progress/1"))
        wait_for(lambda: progress(j, 1, at + 3), timeout=300, what="training to go on past the coordinator's loss")
        kill_hard(lc, ranks[1])
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        (rec,) = j.collect()
        assert rec["lost"] == {1: "r1"} and rec["takeover"] == {1: "s0"}
        assert rec["tiers"][0] == "local" and rec["tiers"][2] == "local" and rec["tiers"][1] == "peer"
        assert rec["pids"][0] == pids[0]["pid"] and rec["pids"][2] == pids[2]["pid"]
        assert_replayed_bitwise(j, out, steps)
        status = ray.get(coord.status.remote(), timeout=60)  # the rebuilt coordinator knows the loss
        assert ranks[1].node_id in status["fenced"]
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def test_with_no_standby_and_no_free_node_the_job_waits_for_a_node_and_recovers_on_it(cluster, caplog) -> None:
    """``on_no_standby="wait"`` with no standby at all and every node in use: a rank's node is
    lost, the controller says it waits for a node, and once one joins the cluster a standby is
    warmed there and takes the rank; the survivors stay in place."""
    import logging

    import memsnap

    lc = cluster
    while len(lc.nodes) < 4:
        lc.add_node()
    ranks = lc.nodes[-3:]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    steps = 40
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        options=OPTIONS,
        on_no_standby="wait",
        wait_for_node_s=300,
    )
    j._used_nodes.update(n["NodeID"] for n in ray.nodes() if n.get("Alive"))  # no free node anywhere
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 1, 6), timeout=300, what="rank 1 to train 6 steps")
        pids = j.members()
        with caplog.at_level(logging.WARNING, logger="memsnap.inplace"):
            kill_hard(lc, ranks[1])
            wait_for(
                lambda: "no standby is warm: waiting" in caplog.text, timeout=120, what="the controller to say it waits"
            )
            lc.add_node()
            runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        (rec,) = j.collect()
        assert rec["lost"] == {1: "r1"} and rec["tiers"][1] == "live"
        assert rec["pids"][0] == pids[0]["pid"] and rec["pids"][2] == pids[2]["pid"]
        assert_replayed_bitwise(j, out, steps)
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def test_with_no_standby_and_shrink_allowed_the_survivors_go_on_as_a_smaller_job_in_place(cluster) -> None:
    """``on_no_standby="shrink"``: a rank's node is killed and no standby is left; the two
    survivors go on at once as ranks 0 and 1 of 2 in the processes they had, and load the
    newest committed step of the 3-rank job (rank 1 the lost rank's state, from its peers)."""
    import memsnap

    lc = cluster
    ranks = lc.nodes[-3:]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    steps = 40
    j = InplaceJob(
        job,
        inplace_job.setup_ddp,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        options=OPTIONS,
        on_no_standby="shrink",
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 2, 10), timeout=300, what="rank 2 to train 10 steps")
        pids = j.members()
        kill_hard(lc, ranks[1])
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1]
        recs = j.collect()
        assert len(recs) == 1, recs
        rec = recs[0]
        assert rec["lost"] == {1: "r1"} and rec["takeover"] == {} and rec["shrunk"] == (3, 2), rec
        assert rec["pids"] == {0: pids[0]["pid"], 1: pids[2]["pid"]}  # old rank 2 is rank 1 now
        assert len(set(rec["steps"].values())) == 1 and rec["steps"][0] >= 5, rec
        assert set(rec["tiers"].values()) == {"elastic"}, rec  # the 3-rank step into 2 ranks
        # each rank's state right after the restore is the committed state of the rank it now is
        assert (
            int(store_of(j).get("test/restore_checked/0")) >= 1 and int(store_of(j).get("test/restore_checked/1")) >= 1
        )
        restored_wrong = [
            (r, st)
            for r in range(3)
            for st in range(steps)
            if store_of(j).check([f"test/mismatch/{r}/{st}"])
            and store_of(j).get(f"test/mismatch/{r}/{st}") == b"restored"
        ]
        assert restored_wrong == []
        assert len({v["digest"] for v in out["results"].values()}) == 1  # two replicas again
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def six_nodes(lc: LocalCluster) -> list:
    """The head, three rank nodes and two standby nodes."""
    while len(lc.nodes) < 6:
        lc.add_node()
    return lc.nodes[-5:]


def test_a_second_node_lost_while_the_job_re_forms_is_recovered_too(cluster) -> None:
    """A second rank's node is killed the moment the controller has decided the first loss,
    while the survivors re-form and restore. With two replicas of each rank (m=2) both lost
    ranks come back from the one node left; that node's rank keeps its process throughout."""
    import memsnap

    lc = cluster
    nodes = six_nodes(lc)
    ranks, spares = nodes[:3], nodes[3:]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    steps = 40
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[n.node_id for n in spares],
        options={**OPTIONS, "m": 2},
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 2, 8), timeout=300, what="rank 2 to train 8 steps")
        pids = j.members()
        kill_hard(lc, ranks[0])
        wait_for(lambda: len(j.recoveries) >= 1, timeout=120, what="the controller to decide the first loss")
        kill_hard(lc, ranks[1])  # the job is re-forming: nobody has stepped in the new generation
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1, 2]
        recs = j.collect()
        lost = {rank: member for rec in recs for rank, member in rec["lost"].items()}
        assert lost == {0: "r0", 1: "r1"}, recs
        last = recs[-1]
        # rank 2 went on from its own state: live where the first standby had taken it over
        # before the second loss (two replicas agreed), else rolled back from its own RAM
        if last["tiers"][2] == "kept":
            assert last["tiers"][0] in ("kept", "live") and last["tiers"][1] == "live", last
        else:
            assert last["tiers"][2] == "local" and "fresh" not in (last["tiers"][0], last["tiers"][1]), last
        assert all(rec["pids"][2] == pids[2]["pid"] for rec in recs if 2 in rec["pids"])
        assert_replayed_bitwise(j, out, steps)
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


def test_more_losses_than_the_code_survives_roll_everyone_back_to_the_durable_step(cluster, tmp_path) -> None:
    """A rank's node and both nodes holding its pieces (k=1, m=1: two replicas) are killed at
    once: its steps in RAM are on no live node. The job rolls every rank back together to the
    newest spilled step, the other rank in the process it had, and trains on bitwise."""
    import memsnap

    lc = cluster
    nodes = six_nodes(lc)
    ranks, spares = nodes[:2], nodes[2:]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    steps = 40
    j = InplaceJob(
        job,
        inplace_job.setup,
        inplace_job.make_train(steps, step_s=0.05),
        rank_nodes=[n.node_id for n in ranks],
        standby_nodes=[n.node_id for n in spares],
        options={**OPTIONS, "spill": str(tmp_path / "durable"), "spill_every": 4},
    )
    out: dict = {}
    runner = run_in_thread(j, out)
    try:
        wait_for(lambda: progress(j, 1, 14), timeout=300, what="rank 1 to train 14 steps")
        coord = ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)
        status = ray.get(coord.status.remote(), timeout=60)
        assert status["durable_step"] is not None, status
        holders = status["holders"]
        # the victim: a rank the other does not hold pieces of (on a ring of five nodes with
        # two holders each, two nodes never both hold each other's), so one rank survives
        victim = next(r for r in (0, 1) if ranks[1 - r].node_id not in holders[ranks[r].node_id])
        doomed = {ranks[victim].node_id, *holders[ranks[victim].node_id]}
        assert len(doomed) == 3, holders
        # the holders' nodes first: a standby there is gone before the rank's loss is decided
        killed = sorted((n for n in nodes if n.node_id in doomed), key=lambda n: n.node_id == ranks[victim].node_id)
        lost_ranks, survivors = [victim], [1 - victim]
        pids = j.members()
        for node in killed:
            kill_hard(lc, node)
        runner.join(timeout=600)
        assert not runner.is_alive() and sorted(out["results"]) == [0, 1]
        recs = j.collect()
        # the nodes die one after another: a standby on a holder's node may take the rank over
        # before its own node is killed, and the rank is lost once more; no one else is
        assert {rank for rec in recs for rank in rec["lost"]} == set(lost_ranks), recs
        assert {n for rec in recs for n in rec["fenced_nodes"]} <= doomed, (recs, doomed)
        last = recs[-1]
        assert set(last["tiers"].values()) == {"durable"}, last
        assert len(set(last["steps"].values())) == 1, last
        assert all(last["pids"][r] == pids[r]["pid"] for r in survivors), (last, pids)
        assert_replayed_bitwise(j, out, steps)
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)
