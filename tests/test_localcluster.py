"""The loopback cluster's start: a node that fails to start is cleaned up and started again, and
closing the cluster leaves none of its processes behind, even after a failed start."""

from __future__ import annotations

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from memsnap.localcluster import LocalCluster, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def descendants() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    }


def live_resources() -> set[str]:
    return {r for n in ray.nodes() if n["Alive"] for r in n["Resources"] if r.startswith("memsnap_node_")}


def test_a_node_whose_start_fails_is_cleaned_up_and_started_again(monkeypatch):
    real_add = Cluster.add_node
    failed = []

    def add_node_that_fails_once_after_starting(self, **kwargs):
        node = real_add(self, **kwargs)
        if self.head_node is not node and not failed:
            failed.append(node)  # a raylet that started, then missed a deadline, as Ray's can
            raise RuntimeError("The current node timed out during startup (simulated)")
        return node

    monkeypatch.setattr(Cluster, "add_node", add_node_that_fails_once_after_starting)
    before = descendants()
    with LocalCluster(nodes=2, object_store_mb=96) as c:
        assert len(failed) == 1 and not failed[0].any_processes_alive(), "the failed node's processes were left running"
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 2 and len(c.nodes) == 2
        assert [c.index_of(n) for n in c.nodes] == [0, 1]  # the whole start was tried again, afresh
        failed.clear()  # a replacement node that fails once: tried again under a resource of its own
        added = c.add_node()
        assert len(failed) == 1 and not failed[0].any_processes_alive()
        assert c.index_of(added) == 3 and len(c.nodes) == 3
        want = {"memsnap_node_0", "memsnap_node_1", "memsnap_node_3"}
        wait_for(
            lambda: live_resources() == want,
            timeout=60,
            what=f"the live nodes' resources to be {sorted(want)} (the failed try's node declared dead)",
        )
        assert {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}
    ray.shutdown()
    left = {pid for pid in descendants() - before}
    assert not left, f"processes left after close: {[psutil.Process(p).cmdline()[:2] for p in left]}"


def test_a_start_that_fails_every_time_raises_and_leaves_nothing(monkeypatch):
    def never(self, **kwargs):
        raise RuntimeError("raylet exited (simulated)")

    monkeypatch.setattr(Cluster, "add_node", never)
    before = descendants()
    with pytest.raises(RuntimeError, match="simulated"):
        LocalCluster(nodes=2, tries=2)
    assert descendants() - before == set()
    with pytest.raises(ValueError, match="tries=0"):
        LocalCluster(nodes=2, tries=0)


def _raylet(node) -> psutil.Process:
    return psutil.Process(node.all_processes["raylet"][0].process.pid)


def test_a_node_added_from_a_thread_that_ends_keeps_running():
    """Ray starts a node's processes with PR_SET_PDEATHSIG(SIGKILL), which Linux sends when the
    thread that started them exits: a failure injector's replacement node must outlive it."""
    import os
    import threading

    @ray.remote(num_cpus=0)
    def where() -> str:
        return ray.get_runtime_context().get_node_id()

    with LocalCluster(nodes=1, object_store_mb=96) as c:
        added, tids = [], []

        def injector() -> None:
            tids.append(threading.get_native_id())
            added.append(c.add_node())

        t = threading.Thread(target=injector)
        t.start()
        t.join(timeout=120)
        assert added, "the node was not added within 120 s"
        node = added[0]
        # the thread is gone from the kernel's view too (join returns a moment before), so any
        # parent-death signal has been sent by now
        wait_for(
            lambda: not os.path.exists(f"/proc/self/task/{tids[0]}"), timeout=30, what="the injector thread to exit"
        )
        got = ray.get(where.options(resources={f"memsnap_node_{c.index_of(node)}": 0.01}).remote(), timeout=120)
        assert got == node.node_id
        raylet = _raylet(node)
        assert raylet.is_running() and raylet.status() != psutil.STATUS_ZOMBIE, (
            "the node's raylet died with the thread that added it"
        )
        assert all(n["Alive"] for n in ray.nodes()), "a node was declared dead"
