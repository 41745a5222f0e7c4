"""Lean mode (``local_copy=False``) end to end on a simulated 4-node loopback cluster.

The agents keep no committed copy of their own node's bytes (only the chunks they hold for
peers and one reused staging arena per rank), so a crashed process restores from its peers,
and a group is protected against ``m`` node losses, not ``m+1``: the last test loses ``m+1``
nodes of a second, spilling lean job and falls back to the durable tier. The tests run in file
order.
"""

from __future__ import annotations

import pytest
import ray
from support.runtime import (
    JobSpec,
    kill,
    lose_nodes,
    remove_arenas,
    restore_all,
    start_all,
    start_trainer,
    wait_for,
)

from memsnap import naming
from memsnap.rank import shutdown

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = "rt-lean"
K, M = 2, 1
JOB_SPEC = JobSpec(
    JOB,
    4,
    dict(k=K, m=M, chunk=64 * 255, memory_budget=256 << 20, local_copy=False, on_error="raise", preemption=False),
)


def save_all(job, step: int) -> None:
    """Save ``step`` on every rank and wait for its commit (lean mode has one slot per rank)."""
    job["digests"][step] = ray.get([t.step_and_save.remote(step) for t in job["trainers"]], timeout=120)
    assert ray.get(job["trainers"][0].wait.remote(step, 120), timeout=150) == step


def inventories(job) -> list[dict]:
    agents = [ray.get_actor(naming.agent(JOB, n), namespace=naming.NAMESPACE) for n in job["nodes"]]
    return ray.get([a.inventory.remote() for a in agents], timeout=60)


def status(job) -> dict:
    return ray.get(job["trainers"][0].status.remote(), timeout=60)


def assert_no_local_copy(job, steps: list[int]) -> None:
    wait_for(
        lambda: all(inv["records"] == steps for inv in inventories(job)),
        timeout=60,
        what=f"every agent told of the commits of steps {steps}",
    )
    for inv in inventories(job):
        assert not any(v["state"] == "committed" for v in inv["versions"].values()), inv["versions"]
        assert inv["records"] == steps
        assert inv["bytes"]["local"] == 0 and inv["bytes"]["held"] > 0
        assert inv["bytes"]["arena"] == 0  # the staging arena gave its pages back once its chunks were held


def test_lean_saves_commit_and_keep_no_local_copy(job):
    save_all(job, 1)
    save_all(job, 2)
    assert_no_local_copy(job, [1, 2])
    protection = wait_for(
        lambda: (lambda p: p if p and all(v == M for v in p.values()) else None)(status(job)["protection"]),
        timeout=120,
        what="protection m (no local copy to add one)",
    )
    assert protection == {"0": M}
    st = status(job)
    assert st["committed_steps"] == [1, 2] and st["failed_snapshots"] == 0
    assert all(a["local"] == 0 for a in st["agents"].values())


def test_lean_process_crash_restores_from_peers_bitwise(job):
    trainers = job["trainers"]
    kill(trainers[1])  # the process dies, its node and agent live on
    trainers[1] = start_trainer(JOB, 1, 4, 1, job["opts"], seed=99)
    results = restore_all(trainers)
    assert [r[0] for r in results] == [2] * 4
    assert [r[1] for r in results] == job["digests"][2]  # bitwise equal to what was saved
    assert [r[2]["tier"] for r in results] == ["peer"] * 4
    assert_no_local_copy(job, [1, 2])  # the restored bytes were not kept as a local copy


def test_lean_job_goes_on_saving_after_the_restore(job):
    save_all(job, 3)
    assert_no_local_copy(job, [2, 3])
    assert status(job)["committed_step"] == 3


def test_lean_with_spill_m_plus_1_node_losses_fall_back_to_durable(job, tmp_path):
    """A second, spilling lean job: a step the coordinator asks to spill is held until it is
    written, then dropped. Losing m+1 = 2 nodes leaves node 0's bytes with one holder (k=2 are
    needed) and no local copy, so every rank loads the newest spilled step, with a warning."""
    c, name = job["cluster"], "rt-lean-spill"
    opts = dict(job["opts"], spill=str(tmp_path / "spill"), spill_every=2)
    try:
        trainers = start_all(name, [0, 1, 2, 3], opts)
        nodes = ray.get([t.node.remote() for t in trainers], timeout=60)
        digests = {}
        for step in (1, 2, 3):  # spilled: 1 (the first commit) and 2 (first of the block 2-3)
            digests[step] = ray.get([t.step_and_save.remote(step) for t in trainers], timeout=120)
            assert ray.get(trainers[0].wait.remote(step, 120), timeout=150) == step
        wait_for(
            lambda: ray.get(trainers[0].status.remote(), timeout=60)["durable_step"] == 2,
            timeout=120,
            what="step 2 spilled",
        )
        agents = [ray.get_actor(naming.agent(name, n), namespace=naming.NAMESPACE) for n in nodes]
        wait_for(
            lambda: (
                not any(
                    v["state"] == "committed"
                    for inv in ray.get([a.inventory.remote() for a in agents], timeout=60)
                    for v in inv["versions"].values()
                )
            ),
            timeout=60,
            what="the lean agents to drop the spilled step's local copy",
        )
        doomed = nodes[2:]
        lose_nodes(c, doomed)
        for r in (2, 3):
            c.add_node()
            trainers[r] = start_trainer(name, r, 4, r + 2, opts, seed=70 + r)  # memsnap_node_4, _5
        results = restore_all(trainers)
        assert [r[0] for r in results] == [2] * 4  # the newest spilled step, not 3 (RAM)
        assert [r[1] for r in results] == digests[2]
        assert {r[2]["tier"] for r in results} == {"durable"}
        assert all("durable storage" in r[2]["warning"] for r in results)
    finally:
        shutdown(name, timeout=30)
        remove_arenas(name)
