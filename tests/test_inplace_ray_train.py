"""In-place recovery under Ray Train: a ``TorchTrainer`` with ``InplaceTorchConfig`` loses one
worker (its process, or its whole node); Ray Train replaces only that worker, the survivors
keep their processes and roll back from their own node's RAM, and training goes on bitwise as
if nothing was lost."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import timedelta

import psutil
import pytest

from memsnap.localcluster import LocalCluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]

OPTIONS = dict(k=1, m=1, keep=2, memory_budget=64 << 20, every_steps=1)
STEPS = 40


@pytest.fixture(scope="module")
def cluster():
    # the head (the driver, Ray Train's controller, memsnap's coordinator) and three more: the
    # three workers spread over four nodes leave one free for a lost node's placement-group slot
    with LocalCluster(nodes=4) as lc:
        yield lc


def _progress(store, rank: int) -> int:
    key = f"test/progress/{rank}"
    return int(store.get(key)) if store.check([key]) else -1


def _run_losing_a_worker(tmp_path, monkeypatch, lose) -> dict:
    """Train ``STEPS`` steps on three workers; once they are 10 steps in, ``lose(store)`` loses
    one (returns its rank and the time of the loss). Checks what every in-place recovery must
    give, and returns what the caller checks further."""
    import torch.distributed as dist
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from support.ray_train_inplace import loop

    import memsnap
    from memsnap.integrations.ray_train_inplace import InplaceTorchConfig

    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")  # the controller polls its workers
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    job = f"rt-inplace-{uuid.uuid4().hex[:6]}"
    trainer = TorchTrainer(
        loop,
        train_loop_config={"store": ("127.0.0.1", store.port), "steps": STEPS, "options": OPTIONS},
        torch_config=InplaceTorchConfig(job=job),
        scaling_config=ScalingConfig(num_workers=3, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name=job, storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=2)),
    )
    out: dict = {}

    def fit():
        try:
            out["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            out["error"] = exc

    runner = threading.Thread(target=fit, daemon=True)
    started = time.time()
    try:
        runner.start()
        wait_for(
            lambda: min(_progress(store, r) for r in range(3)) >= 10 or not runner.is_alive(),
            timeout=300,
            what="every rank to train 10 steps",
        )
        assert runner.is_alive(), out
        pids = {r: int(store.get(f"test/pid/{r}")) for r in range(3)}
        lost, killed, at_kill = lose(store)
        runner.join(timeout=600)
        assert not runner.is_alive(), "the run did not finish"
        assert "error" not in out, out["error"]
        survivors = [r for r in range(3) if r != lost]
        final = {r: json.loads(store.get(f"test/final/{r}")) for r in range(3)}
        # the survivors trained to the end in the processes they had; the replacement is new
        assert all(final[r]["pid"] == pids[r] for r in survivors) and final[lost]["pid"] != pids[lost]
        assert [final[r]["recoveries"] for r in range(3)] == [0 if r == lost else 1 for r in range(3)]
        restored = {r: json.loads(store.get(f"test/restored/1/{r}")) for r in range(3)}
        print(
            "lost rank", lost, "restored in generation 1:", restored, "at the loss rank", lost, "had trained", at_kill
        )
        # replicas (data parallel): the survivors kept their live state, nothing was rolled back
        assert all(restored[r]["tier"] == "kept" for r in survivors), restored
        assert len({r["start"] for r in restored.values()}) == 1
        assert restored[lost]["start"] >= at_kill  # only the step in flight is trained again
        # every step trained again after the rollback gave the digest it gave the first time
        mismatched = [(r, s) for r in range(3) for s in range(STEPS) if store.check([f"test/mismatch/{r}/{s}"])]
        assert mismatched == []
        assert len({f["digest"] for f in final.values()}) == 1
        first = max(float(store.get(f"test/first_step/1/{r}")) for r in range(3))
        print("steps trained again:", int(store.get("test/replayed")) if store.check(["test/replayed"]) else 0)
        print(f"loss -> first step of every rank: {first - killed:.2f} s; run: {time.time() - started:.1f} s")
        split = {k: round(v - killed, 2) for k, v in restored[lost]["times"].items()}
        print("the replacement, seconds after the loss:", split)
        return {"restored": restored, "lost": lost}
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)


@pytest.mark.extended  # beside the node kill below, beyond CI's time: run with `pytest -m extended`
def test_a_killed_worker_process_is_replaced_alone_and_the_survivors_go_on_in_place(cluster, tmp_path, monkeypatch):
    def lose(store):
        pid, at = int(store.get("test/pid/1")), _progress(store, 1)
        t = time.time()
        psutil.Process(pid).kill()
        return 1, t, at

    out = _run_losing_a_worker(tmp_path, monkeypatch, lose)
    # the replacement took a survivor's live state (nothing rolled back)
    assert out["restored"][1]["tier"] == "live", out


def test_a_lost_node_is_replaced_by_a_worker_on_the_free_node_and_the_survivors_go_on_in_place(
    cluster, tmp_path, monkeypatch
):
    lc = cluster
    head = lc.nodes[0].node_id

    def lose(store):
        nodes = {r: store.get(f"test/node/{r}").decode() for r in range(3)}
        rank = next(r for r in (1, 2, 0) if nodes[r] != head)  # the head hosts the driver and the controller
        node = next(n for n in lc.nodes if n.node_id == nodes[rank])
        at = _progress(store, rank)
        return rank, lc.kill_node_hard(node), at

    out = _run_losing_a_worker(tmp_path, monkeypatch, lose)
    assert out["restored"][out["lost"]]["tier"] == "live", out  # the survivors' live state, sent to it
