"""Elastic restore on a loopback cluster: a job of FSDP-style ranks (DTensor ``Shard(0)``
parameters and AdamW moments, a replicated bias, gloo) comes back with another world size.

4 -> 3 ranks after a node is lost and not replaced, 3 -> 4 when a node returns: both from
peers' RAM, bitwise equal to loading the same step from the durable tier into the same
world size. Then 4 -> 1 after three nodes are lost: RAM cannot serve, every rank falls back
to the durable tier, resharded. One rank per process (gloo), one process per node.
Every wait has a deadline; none is a measure of speed.
"""

from __future__ import annotations

import pytest
import ray
from support import fsdp
from support.runtime import cluster, kill, lose_nodes, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]  # three restarts of a 4-node job

JOB = "elastic"


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    spill = tmp_path_factory.mktemp("elastic-spill")
    with cluster(JOB, 4) as lc:
        yield lc, dict(k=2, m=1, memory_budget=64 << 20, spill=f"file://{spill}", spill_every=1, on_error="raise")


def start(opts: dict, nodes: list[int]) -> list:
    return fsdp.start(JOB, opts, nodes)


def stop(ranks: list) -> None:
    """The worker group goes away (as Ray Train tears it down before restarting it)."""
    for r in ranks:
        kill(r)


def train(ranks: list, steps) -> None:
    for s in steps:
        assert all(ray.get([r.train_and_save.remote(s) for r in ranks], timeout=240))
    last = steps[-1]
    assert ray.get(ranks[0].wait.remote(last), timeout=240) == last
    assert ray.get(ranks[0].spill.remote(last), timeout=240) == last


def restored_equal_to_durable(ranks: list, step: int, tier: str) -> None:
    got = ray.get([r.restore.remote() for r in ranks], timeout=400)
    assert [(s, t) for s, t, *_ in got] == [(step, tier)] * len(ranks), got
    durable = ray.get([r.durable.remote(step) for r in ranks], timeout=240)
    assert [d for _, _, d, *_ in got] == [d for d, _ in durable]  # bitwise the shards memsnap.load gives


def test_4_to_3_after_a_node_loss_then_3_to_4_when_a_node_returns_restore_from_ram(c):
    lc, opts = c
    ranks = start(opts, [0, 1, 2, 3])
    assert ray.get([r.restore.remote() for r in ranks], timeout=300)[0][:2] == (None, "none")
    train(ranks, [1, 2])
    lost = ray.get(ranks[3].node.remote(), timeout=60)
    stop(ranks)
    lose_nodes(lc, [lost])  # no replacement: the job comes back on the three nodes left

    ranks = start(opts, [0, 1, 2])
    restored_equal_to_durable(ranks, 2, "elastic")
    train(ranks, [3])
    assert ray.get(ranks[0].status.remote(), timeout=120)["committed_steps"] == [3]  # step 2 let go
    wait_for(
        lambda: all(a["held"] == 0 for a in ray.get(ranks[0].status.remote(), timeout=120)["agents"].values()),
        timeout=120,
        what="every agent to free the chunks of the old world's step",
    )
    stop(ranks)

    lc.add_node()  # capacity returns: node index 4
    lc.cluster.wait_for_nodes()
    ranks = start(opts, [0, 1, 2, 4])
    restored_equal_to_durable(ranks, 3, "elastic")
    train(ranks, [4])
    st = ray.get(ranks[0].status.remote(), timeout=120)
    assert st["peers"] is True and st["protection"] and min(st["protection"].values()) >= 1  # re-placed, protected
    stop(ranks)


def test_when_ram_cannot_serve_every_rank_falls_back_to_the_durable_tier_resharded(c):
    lc, opts = c
    nodes = {r.node_id for r in lc.nodes[1:]}  # step 4 of 4 ranks is committed and spilled: lose 3 of its nodes
    lose_nodes(lc, sorted(nodes))
    ranks = start(opts, [0])
    restored_equal_to_durable(ranks, 4, "durable")
    stop(ranks)
