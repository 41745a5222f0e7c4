"""The runtime end to end on a simulated 4-node loopback cluster, one failure after another.

One cluster for the whole module (starting one costs about a minute on 2 cores); the tests
run in file order and each leaves the job in a state the next one builds on:
save/commit -> process crash -> rank dies mid-capture -> coordinator lost -> corrupted chunk
+ node loss (that node, a holder, dies in the middle of a transfer) -> re-protection -> more losses than the code
tolerates (durable fallback).
"""

from __future__ import annotations

import os
import socket

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

from memsnap import naming, testing
from memsnap.errors import TransportError
from memsnap.memory import shmdir
from memsnap.transport import ChunkKey, make_transport

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = "rt-failures"
K, M = 2, 1
JOB_SPEC = JobSpec(
    JOB,
    4,
    dict(k=K, m=M, chunk=64 * 255, memory_budget=256 << 20, spill_every=2, on_error="raise", preemption=False),
    spill="spill",
)


def save_all(job, step: int, commit: bool = True) -> list[str]:
    digests = ray.get([t.step_and_save.remote(step) for t in job["trainers"]], timeout=120)
    job["digests"][step] = digests
    if commit:
        assert ray.get(job["trainers"][0].wait.remote(step, 120), timeout=150) == step
    return digests


def status(job) -> dict:
    return ray.get(job["trainers"][0].status.remote(), timeout=60)


def agent(node_id: str):
    return ray.get_actor(naming.agent(JOB, node_id), namespace=naming.NAMESPACE)


def full_protection(job) -> dict:
    return wait_for(
        lambda: (lambda p: p if p and all(v == M + 1 for v in p.values()) else None)(status(job)["protection"]),
        timeout=180,
        what="full protection (m+1 with the local copy)",
    )


def test_save_commits_and_reports_status(job):
    save_all(job, 1)
    save_all(job, 2)
    st = full_protection(job)
    st = status(job)
    assert st["committed_step"] == 2 and st["committed_steps"] == [1, 2]
    assert st["failed_snapshots"] == 0 and st["last_restore"]["tier"] == "none"
    assert st["bytes"]["local"] > 4 * 6_000_000 and st["bytes"]["peer"] > 0
    import json

    json.dumps(st)  # JSON-serialisable
    wait_for(lambda: status(job)["durable_step"] == 2, timeout=90, what="step 2 spilled")


def test_a_snapshot_over_the_memory_budget_is_refused_with_a_typed_error(job):
    msg = ray.get(job["trainers"][0].save_too_big.remote(3), timeout=120)
    assert msg.startswith("MemoryBudgetError:") and "memory_budget" in msg and "needs" in msg


def test_every_address_is_loopback(job):
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert job["cluster"].address.startswith("127.0.0.1:")
    for node in job["nodes"]:
        addr = ray.get(agent(node).inventory.remote(), timeout=30)["address"]
        assert addr["host"] == "127.0.0.1"


def test_unauthenticated_connection_to_a_live_agent_is_refused(job):
    addr = ray.get(agent(job["nodes"][0]).inventory.remote(), timeout=30)["address"]
    intruder = make_transport("tcp", secret=b"not-the-job-secret-0123456789abc", host="127.0.0.1")
    key = ChunkKey(2, job["nodes"][1], 0, 0)
    with pytest.raises(TransportError):
        intruder.fetch(addr, [(key, memoryview(bytearray(64 * 255)))], timeout=10)
    with socket.create_connection((addr["host"], addr["port"]), timeout=10) as s:  # no handshake at all
        s.sendall(b"\0" * 256)
        s.settimeout(10)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert b"\0" * 64 not in got  # nothing served; the connection was closed
    intruder.close()


def test_process_crash_restores_from_local_ram(job):
    trainers = job["trainers"]
    kill(trainers[1])
    trainers[1] = start_trainer(JOB, 1, 4, job["node_index"][1], job["opts"], seed=99)
    results = restore_all(trainers)
    assert [r[0] for r in results] == [2] * 4
    assert [r[1] for r in results] == job["digests"][2]  # bitwise equal to what was saved
    assert {r[2]["tier"] for r in results} == {"local"}
    assert set(results[1][2]["seconds"]) >= {"plan", "apply", "total"}


def test_rank_dying_mid_capture_leaves_the_previous_step(job):
    trainers = job["trainers"]
    ray.get([t.step_and_save.remote(3) for t in trainers[:3]], timeout=120)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(trainers[3].save_and_die.remote(3), timeout=120)
    trainers[3] = start_trainer(JOB, 3, 4, job["node_index"][3], job["opts"], seed=98)
    results = restore_all(trainers)
    assert [r[0] for r in results] == [2] * 4
    assert [r[1] for r in results] == job["digests"][2]


def test_coordinator_loss_the_job_continues_and_restores(job):
    generation = status(job)["generation"]
    assert generation >= 1  # the restores so far
    ray.kill(ray.get_actor(naming.coordinator(JOB), namespace=naming.NAMESPACE), no_restart=True)
    # rebuilt from the agents, restore generation included (a new node's agent joining after
    # the next restore must not be handed a generation below the survivors')
    assert status(job)["generation"] == generation
    save_all(job, 4)
    results = restore_all(job["trainers"])
    assert [r[0] for r in results] == [4] * 4 and [r[1] for r in results] == job["digests"][4]
    job["spilled"] = wait_for(
        lambda: (lambda d: d if d == 4 else None)(status(job)["durable_step"]), timeout=90, what="step 4 spilled"
    )


def test_corrupt_chunk_and_node_loss_restore_from_peers(job):
    c, trainers, nodes = job["cluster"], job["trainers"], job["nodes"]
    lost = nodes[2]
    # flip a byte of a data chunk of the soon-lost node, on its holder
    for node in nodes:
        held = ray.get(agent(node).inventory.remote(), timeout=30)["held"].get(4, {}).get(lost, {})
        if 0 in held:
            testing.flip_chunk(agent(node), 4, lost, 5, 0, 17)
            break
    else:
        pytest.fail("no holder of shard 0 of the lost node's step 4")
    # every rank saves step 5; the soon-lost node, a holder of the others, stops acknowledging
    # chunks of step 5 after the first one it receives, and dies while the senders are mid-transfer
    testing.stall_receiving(agent(lost), 5, 1)
    for r in (0, 1, 2, 3):
        ray.get(trainers[r].step_and_save.remote(5), timeout=120)
    wait_for(
        lambda: testing.stalled(agent(lost)),
        timeout=60,
        what="a transfer of step 5 to the soon-lost holder to be under way",
    )
    assert status(job)["committed_step"] == 4
    lose_nodes(c, [lost])
    assert ray.get(trainers[0].wait.remote(5, 120), timeout=150) == 4  # step 5 fails, never commits
    c.add_node()  # resource memsnap_node_4
    trainers[2] = start_trainer(JOB, 2, 4, 4, job["opts"], seed=97)
    nodes[2] = ray.get(trainers[2].node.remote())
    results = restore_all(trainers)
    assert [r[0] for r in results] == [4] * 4
    assert [r[1] for r in results] == job["digests"][4]  # bitwise, through the corrupted chunk
    assert results[2][2]["tier"] == "peer" and {results[i][2]["tier"] for i in (0, 1, 3)} == {"local"}
    st = status(job)
    assert st["failed_snapshots"] >= 1
    assert sum(a["counters"]["repaired_chunks"] for a in st["agents"].values()) >= 1


def test_reprotection_brings_the_protection_level_back(job):
    st = full_protection(job)
    assert st  # every group survives m more losses again, before any new snapshot
    assert status(job)["committed_step"] == 4
    assert status(job)["reprotect"]["rebuilt_chunks"] > 0


def test_more_losses_than_tolerated_fall_back_to_durable(job):
    c, trainers, nodes = job["cluster"], job["trainers"], job["nodes"]
    doomed = [nodes[1], nodes[2], nodes[3]]  # node 0 is the head: the driver needs it
    lose_nodes(c, doomed)
    for i, r in enumerate((1, 2, 3)):
        c.add_node()
        trainers[r] = start_trainer(JOB, r, 4, 5 + i, job["opts"], seed=90 + r)
    results = restore_all(trainers)
    spilled = job["spilled"]
    assert [r[0] for r in results] == [spilled] * 4  # the newest spilled step
    assert [r[1] for r in results] == job["digests"][spilled]
    assert {r[2]["tier"] for r in results} == {"durable"}
    assert all("durable storage" in r[2]["warning"] for r in results)


def _flip(path: str, offset: int) -> bytes:
    """Flip one byte of a file; return the byte it held."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return byte


def _byte(path: str, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(1)


def test_objstore_transport_and_a_corrupt_local_copy_rebuilt_from_peers(job):
    """A second job on the surviving nodes, chunks through Ray's object store; rank 1's arena
    gets a flipped byte, so its restore detects it by checksum and reads its peers instead."""
    alive = [i for i in (0, 5, 6, 7)]
    opts = dict(k=K, m=M, chunk=64 * 255, memory_budget=256 << 20, transport="objstore")
    other = "rt-objstore"
    trainers = start_all(other, alive, opts)
    try:
        digests = ray.get([t.step_and_save.remote(1) for t in trainers], timeout=120)
        assert ray.get(trainers[0].wait.remote(1, 120), timeout=150) == 1
        st = ray.get(trainers[0].status.remote(), timeout=60)
        assert st["bytes"]["peer"] > 0 and st["failed_snapshots"] == 0
        node1 = ray.get(trainers[1].node.remote())
        _flip(next(p for p in shmdir.arena_files(other, node1) if "-r1-s0-" in p), 4096)
        results = restore_all(trainers)
        assert [r[0] for r in results] == [1] * 4 and [r[1] for r in results] == digests
        assert results[1][2]["tier"] == "peer" and results[0][2]["tier"] == "local"
    finally:
        from memsnap.rank import shutdown

        for t in trainers:
            kill(t)
        shutdown(other, timeout=10)
        remove_arenas(other)


def test_m_node_losses_at_once_are_restored_from_ram(job):
    """k=1, m=2 (replication to two more holders): two nodes of the group die together, and
    both lost ranks come back from their peers' RAM on replacement nodes, bitwise. Rank 3's
    local copy has a flipped byte: it reads its holders straight into its tensors, and its
    agent then rebuilds the local copy from them."""
    c = job["cluster"]
    other = "rt-m2"
    opts = dict(k=1, m=2, chunk=64 * 255, memory_budget=256 << 20)
    trainers = start_all(other, [0, 5, 6, 7], opts)
    try:
        digests = ray.get([t.step_and_save.remote(1) for t in trainers], timeout=120)
        assert ray.get(trainers[0].wait.remote(1, 120), timeout=150) == 1
        doomed = ray.get([trainers[1].node.remote(), trainers[2].node.remote()])
        lose_nodes(c, doomed)
        for i, r in enumerate((1, 2)):
            c.add_node()  # resources memsnap_node_8, memsnap_node_9
            trainers[r] = start_trainer(other, r, 4, 8 + i, opts, seed=80 + r)
        node3 = ray.get(trainers[3].node.remote())
        path = next(p for p in shmdir.arena_files(other, node3) if "-r3-s0-" in p)
        good = _flip(path, 4096)
        results = restore_all(trainers)
        assert [r[0] for r in results] == [1] * 4 and [r[1] for r in results] == digests
        assert [r[2]["tier"] for r in results] == ["local", "peer", "peer", "peer"]
        # the agent installs the rebuilt copy as a new file of that slot
        wait_for(
            lambda: any(_byte(p, 4096) == good for p in shmdir.arena_files(other, node3) if "-r3-s0-g1" in p),
            timeout=60,
            what="rank 3's local copy rebuilt",
        )
        assert not os.path.exists(path)
    finally:
        from memsnap.rank import shutdown

        for t in trainers:
            kill(t)
        shutdown(other, timeout=10)
        remove_arenas(other)
