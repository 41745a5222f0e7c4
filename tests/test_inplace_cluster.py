"""In-place recovery on a loopback cluster: a node is killed mid-training; the survivors keep
their processes, the standby takes the lost rank, and training goes on bitwise as if the
node had never been lost."""
from __future__ import annotations

import os
import signal
import threading
import uuid

import psutil
import pytest

from memsnap.localcluster import LocalCluster, wait_for
from support import inplace_job

pytestmark = [pytest.mark.slow, pytest.mark.ray]

OPTIONS = dict(k=1, m=1, keep=2, memory_budget=64 << 20, every_steps=1, preemption=False)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(nodes=5) as lc:
        yield lc


def kill_hard(lc: LocalCluster, node) -> None:
    """The node's raylet and every process under it, as a lost host would go."""
    raylet = node.all_processes["raylet"][0].process.pid
    tree = psutil.Process(raylet).children(recursive=True)
    lc.kill_node(node)
    for proc in tree:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_node_is_replaced_by_the_standby_and_the_survivors_keep_their_processes(cluster):
    from memsnap.inplace import InplaceJob

    import memsnap

    lc = cluster
    ranks = [lc.nodes[1], lc.nodes[2], lc.nodes[3]]
    spare = lc.nodes[4]
    job = f"inplace-{uuid.uuid4().hex[:6]}"
    steps = 60
    j = InplaceJob(job, inplace_job.setup, inplace_job.make_train(steps, step_s=0.05),
                   rank_nodes=[n.node_id for n in ranks], standby_nodes=[spare.node_id], options=OPTIONS)
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(results=j.run(timeout_s=600)), daemon=True)
    try:
        runner.start()
        wait_for(lambda: j.store is not None and j.store.check(["test/progress/1"])
                 and int(j.store.get("test/progress/1")) >= 10, timeout=300, what="rank 1 to train 10 steps")
        pids_before = {r: s for r, s in j.members().items()}
        kill_hard(lc, ranks[1])
        runner.join(timeout=600)
        assert not runner.is_alive(), "the job did not finish"
        assert sorted(out["results"]) == [0, 1, 2]
        recs = j.collect()
        assert len(recs) == 1, recs
        rec = recs[0]
        assert rec["lost"] == {1: "r1"} and rec["takeover"] == {1: "s0"}
        assert rec["fenced_nodes"] == [ranks[1].node_id]
        # survivors restored from their own node's RAM, in the processes they had
        assert rec["tiers"][0] == "local" and rec["tiers"][2] == "local"
        assert rec["tiers"][1] == "peer"
        assert rec["pids"][0] == pids_before[0]["pid"] and rec["pids"][2] == pids_before[2]["pid"]
        assert len(set(rec["steps"].values())) == 1
        # every step trained again after the rollback gave the digest it gave the first time
        assert int(j.store.get("test/replayed")) > 0 if j.store.check(["test/replayed"]) else True
        assert not any(j.store.check([f"test/mismatch/{r}/{s}"]) for r in range(3) for s in range(steps))
        # and the three ranks end identical (data parallel), each having trained every step
        assert len({v["digest"] for v in out["results"].values()}) == 1
        split = rec["split"]
        print("recovery split:", {k: None if v is None else round(v, 3) for k, v in split.items()})
        assert None not in split.values()
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)
