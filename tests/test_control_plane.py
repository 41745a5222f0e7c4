"""The control plane in the shapes real jobs run, on one loopback cluster of 5 nodes:
many ranks per node, uneven ranks, one multi-GPU node alone, a spare node, a burst of saves,
memsnap's own verdict on a frozen agent (fenced while Ray still sees its node) and on a slow one
(not fenced).

Ranks are threads of one process per node (``support.ranks.NodeRanks``). Every wait below
has a deadline; none is a measure of speed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest
import ray
from support.ranks import kill_node_ranks, merged, refused_node_ranks, start_node_ranks
from support.runtime import cluster, wait_for

from memsnap import naming, testing
from memsnap.rank import shutdown, start_spare

pytestmark = [pytest.mark.ray, pytest.mark.slow]

OPTS = dict(memory_budget=64 << 20, on_error="raise")


@pytest.fixture(scope="module")
def c():
    with cluster("control-plane", 5) as lc:
        yield lc


def run_job(job: str, layout: dict[int, list[int]], opts: dict = OPTS, steps=(0, 1)) -> tuple[list, dict]:
    """Start the ranks, save ``steps`` on every rank, wait for the last to commit."""
    actors = start_node_ranks(job, layout, opts)
    saved = {}
    for s in steps:
        saved = merged(ray.get([a.train_and_save.remote(s) for a in actors], timeout=240))
        assert all(ok for ok, _ in saved.values())
    assert ray.get(actors[0].wait.remote(steps[-1]), timeout=180) == steps[-1]
    return actors, {r: d for r, (_, d) in saved.items()}


def finish(job: str, actors: list) -> None:
    ray.get([a.close.remote() for a in actors], timeout=60)
    for a in actors:
        ray.kill(a, no_restart=True)
    shutdown(job, timeout=30)


def test_one_node_with_four_ranks_commits_at_once_on_local_ram(c):
    """The first thing a user with one 8-GPU box tries, with the defaults (k=2, m=1)."""
    actors, _ = run_job("cp-one-node", {1: [0, 1, 2, 3]})
    st = ray.get(actors[0].status.remote(), timeout=60)
    assert st["peers"] is False and st["committed_step"] == 1 and st["failed_snapshots"] == 0
    assert st["protection"] == {"0": 0} or all(v == 0 for v in st["protection"].values())
    finish("cp-one-node", actors)


def test_eighty_ranks_on_four_nodes_save_commit_and_restore_at_once(c):
    """More ranks than any actor's thread count: every barrier is futures, not threads."""
    layout = {i: list(range(20 * (i - 1), 20 * i)) for i in range(1, 5)}
    actors, saved = run_job("cp-eighty", layout, dict(OPTS, k=2, m=1))
    ray.get([a.train_and_save.remote(2) for a in actors], timeout=240)  # moved on, not committed-waited
    restored = merged(ray.get([a.restore.remote() for a in actors], timeout=300))
    assert sorted(restored) == list(range(80))
    assert {s for s, _, _ in restored.values()} == {2} or {s for s, _, _ in restored.values()} == {1}
    st = ray.get(actors[0].status.remote(), timeout=60)
    assert st["peers"] is True and st["failed_snapshots"] == 0
    finish("cp-eighty", actors)


def test_uneven_ranks_per_node_restore_bitwise_from_local_ram(c):
    layout = {1: [0, 1, 2], 2: [3, 4], 3: [5, 6], 4: [7]}
    actors, saved = run_job("cp-uneven", layout, dict(OPTS, k=2, m=1))
    ray.get([a.train_and_save.remote(5) for a in actors], timeout=240)  # step 5 moves the live state on
    ray.get(actors[0].wait.remote(5), timeout=180)
    restored = merged(ray.get([a.restore.remote() for a in actors], timeout=300))
    assert {r: (s, t) for r, (s, t, _) in restored.items()} == {r: (5, "local") for r in range(8)}
    finish("cp-uneven", actors)


def test_a_spare_node_lets_three_rank_nodes_run_with_peers_and_holds_chunks(c):
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and "memsnap_node_4" in n["Resources"])
    spare = start_spare("cp-spare", nodes[0], k=2, m=1, memory_budget=64 << 20)
    actors, _ = run_job("cp-spare", {1: [0], 2: [1], 3: [2]}, dict(OPTS, k=2, m=1))
    st = ray.get(actors[0].status.remote(), timeout=60)
    assert st["peers"] is True
    held = ray.get(spare.inventory.remote(), timeout=60)["held"]
    assert held.get(1), f"the spare holds no chunk of step 1: {held}"
    finish("cp-spare", actors)


def spare_nodes(*indexes: int) -> list[str]:
    return [
        next(n["NodeID"] for n in ray.nodes() if n["Alive"] and f"memsnap_node_{i}" in n["Resources"]) for i in indexes
    ]


def test_a_frozen_agent_is_declared_lost_and_fenced_while_ray_still_sees_its_node(c):
    """A host that stops without closing its sockets, as a frozen agent process: Ray's raylet
    there is healthy, so Ray never declares anything; memsnap's heartbeats do, and the job
    goes on committing with the placement formed again without it."""
    job = "cp-frozen"
    frozen, other = spare_nodes(4, 0)
    agents = [start_spare(job, n, k=2, m=1, memory_budget=64 << 20) for n in (frozen, other)]
    pid = ray.get(agents[0].pid.remote(), timeout=60)
    actors, _ = run_job(job, {1: [0], 2: [1], 3: [2]}, dict(OPTS, k=2, m=1))
    try:
        os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        st = wait_for(
            lambda: (lambda s: s if frozen in s["fenced"] else None)(ray.get(actors[0].status.remote(), timeout=60)),
            timeout=60,
            what="the frozen agent's node to be declared lost",
        )
        print(f"frozen agent declared lost {time.monotonic() - t:.2f} s after it stopped")
        assert any(n["NodeID"] == frozen and n["Alive"] for n in ray.nodes()), "Ray saw it first"
        assert "did not answer a ping" in st["liveness"]["lost"][frozen]
        ray.get([a.train_and_save.remote(2) for a in actors], timeout=240)
        assert ray.get(actors[0].wait.remote(2), timeout=180) == 2  # committed without the fenced node
        st = ray.get(actors[0].status.remote(), timeout=60)
        assert st["committed_step"] == 2 and frozen not in {h for hs in st["holders"].values() for h in hs}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        finish(job, actors)


def test_a_slow_agent_whose_heartbeats_stop_but_which_answers_is_not_fenced(c):
    job = "cp-slow"
    slow, other = spare_nodes(4, 0)
    agents = [start_spare(job, n, k=2, m=1, memory_budget=64 << 20) for n in (slow, other)]
    actors, _ = run_job(job, {1: [0], 2: [1], 3: [2]}, dict(OPTS, k=2, m=1))
    try:
        testing.hold_heartbeats(agents[0], 4.0)
        st = wait_for(
            lambda: (lambda s: s if s["liveness"]["slow"].get(slow) else None)(
                ray.get(actors[0].status.remote(), timeout=60)
            ),
            timeout=60,
            what="the coordinator to ping the silent agent and find it alive",
        )
        assert slow not in st["fenced"] and slow not in st["liveness"]["lost"]
        ray.get([a.train_and_save.remote(2) for a in actors], timeout=240)
        assert ray.get(actors[0].wait.remote(2), timeout=180) == 2
        assert slow not in ray.get(actors[0].status.remote(), timeout=60)["fenced"]
    finally:
        finish(job, actors)


def test_a_burst_of_back_to_back_saves_commits_its_last_step_with_nothing_failed(c):
    layout = {1: [0, 1], 2: [2, 3], 3: [4, 5], 4: [6, 7]}
    actors = start_node_ranks("cp-burst", layout, dict(OPTS, k=2, m=1))
    try:
        for s in range(30):  # no wait between saves: the pipeline coalesces, newest wins
            # the last step is forced, as a run's last save is: a burst's newest save may be
            # skipped where every arena slot of a node is busy (under CI's load it was once, and
            # wait(29) answered 27)
            ray.get([a.train_and_save.remote(s, force=s == 29) for a in actors], timeout=240)
        assert ray.get(actors[0].wait.remote(29), timeout=180) == 29
        st = ray.get(actors[0].status.remote(), timeout=60)
        counters = merged(ray.get([a.counters.remote() for a in actors], timeout=60))
        assert st["failed_snapshots"] == 0, st["failed_steps"]
        assert all(c["failed_saves"] == 0 for c in counters.values()), counters
        assert st["committed_step"] == 29
    finally:
        finish("cp-burst", actors)


def test_ranks_that_moved_between_live_nodes_read_their_old_nodes_copy(c):
    """Ray Train restarts a worker group with ranks on other nodes: a rank whose old node is
    alive reads its whole copy there (tier ``copy``), bitwise, with no decode."""
    opts = dict(OPTS, k=2, m=1)
    first, saved = run_job("cp-moved", {1: [0], 2: [1], 3: [2], 4: [3]}, opts)
    ray.get([a.close.remote() for a in first], timeout=60)
    kill_node_ranks(first)
    again = start_node_ranks("cp-moved", {1: [1], 2: [0], 3: [2], 4: [3]}, opts)  # 0 and 1 swapped
    restored = merged(ray.get([a.restore.remote() for a in again], timeout=300))
    assert {r: (s, t) for r, (s, t, _) in restored.items()} == {
        0: (1, "copy"),
        1: (1, "copy"),
        2: (1, "local"),
        3: (1, "local"),
    }
    assert {r: d for r, (_, _, d) in restored.items()} == saved
    finish("cp-moved", again)


def test_a_second_live_run_under_the_same_job_name_is_refused_and_the_first_runs_restart_is_not(c):
    """Two trials of a sweep with one hard-coded job name and the same options: the second's
    ranks are refused (naming both runs and the fix) instead of restoring the first's weights,
    while the first keeps committing; once the first's processes are gone, its restart (new
    processes, no run id given) takes the ranks back under the same run id and restores them."""
    job, layout = "cp-two-runs", {1: [0], 2: [1]}
    first, _ = run_job(job, layout)
    run = ray.get(first[0].status.remote(), timeout=60)["run"]
    refused = refused_node_ranks(job, layout, OPTS)
    assert len(refused) == 2 and all(
        re.search(
            rf"(?s)JobInUseError.*a process with no run id.*held by run '{run}', "
            r"still running.*its own job name",
            e,
        )
        for e in refused
    ), refused
    saved = merged(ray.get([a.train_and_save.remote(2) for a in first], timeout=240))
    assert ray.get(first[0].wait.remote(2), timeout=180) == 2
    st = ray.get(first[0].status.remote(), timeout=60)
    assert st["committed_step"] == 2 and st["failed_snapshots"] == 0 and st["run"] == run
    kill_node_ranks(first)
    again = start_node_ranks(job, layout, OPTS)
    restored = merged(ray.get([a.restore.remote() for a in again], timeout=300))
    assert {r: s for r, (s, _, _) in restored.items()} == {0: 2, 1: 2}
    assert {r: d for r, (_, _, d) in restored.items()} == {r: d for r, (_, d) in saved.items()}
    assert ray.get(again[0].status.remote(), timeout=60)["run"] == run
    finish(job, again)


def test_every_node_and_agent_address_is_loopback(c):
    actors, _ = run_job("cp-loopback", {1: [0], 2: [1]}, steps=(0,))
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    for node in {ray.get(a.node.remote(), timeout=60) for a in actors}:
        agent = ray.get_actor(naming.agent("cp-loopback", node), namespace=naming.NAMESPACE)
        assert ray.get(agent.address.remote(), timeout=60)["host"] == "127.0.0.1"
    finish("cp-loopback", actors)


@ray.remote(num_cpus=0)
def _niceness() -> int:
    import os

    return os.nice(0)


def test_every_worker_of_the_loopback_cluster_runs_at_the_drivers_niceness(c):
    # Ray's default (nice 15) starves niced workers on a machine whose cores other work shares.
    import os

    nodes = [f"memsnap_node_{c.index_of(n)}" for n in c.nodes]
    got = ray.get([_niceness.options(resources={r: 0.01}).remote() for r in nodes], timeout=120)
    assert got == [os.nice(0)] * len(nodes)
