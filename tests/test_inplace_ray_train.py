"""In-place recovery under Ray Train: a ``TorchTrainer`` with ``InplaceTorchConfig`` loses one
worker's process; Ray Train replaces only that worker, the survivors keep their processes and
roll back from their own node's RAM, and training goes on bitwise as if nothing was lost."""
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
    with LocalCluster(nodes=4) as lc:  # the head (driver, Ray Train's controller) and three for workers
        yield lc


def _progress(store, rank: int) -> int:
    key = f"test/progress/{rank}"
    return int(store.get(key)) if store.check([key]) else -1


def test_a_killed_worker_is_replaced_alone_and_the_survivors_roll_back_in_place(cluster, tmp_path, monkeypatch):
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
        loop, train_loop_config={"store": ("127.0.0.1", store.port), "steps": STEPS, "options": OPTIONS},
        torch_config=InplaceTorchConfig(job=job),
        scaling_config=ScalingConfig(num_workers=3, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name=job, storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=2)))
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
        wait_for(lambda: _progress(store, 1) >= 10 or not runner.is_alive(), timeout=300,
                 what="rank 1 to train 10 steps")
        assert runner.is_alive(), out
        pids = {r: int(store.get(f"test/pid/{r}")) for r in range(3)}
        at_kill = _progress(store, 1)
        killed = time.time()
        psutil.Process(pids[1]).kill()
        runner.join(timeout=600)
        assert not runner.is_alive(), "the run did not finish"
        assert "error" not in out, out["error"]
        final = {r: json.loads(store.get(f"test/final/{r}")) for r in range(3)}
        # the survivors trained to the end in the processes they had; the replacement is new
        assert final[0]["pid"] == pids[0] and final[2]["pid"] == pids[2] and final[1]["pid"] != pids[1]
        assert final[0]["recoveries"] == 1 and final[2]["recoveries"] == 1 and final[1]["recoveries"] == 0
        restored = {r: json.loads(store.get(f"test/restored/1/{r}")) for r in range(3)}
        print("restored in generation 1:", restored, "rank 1 had trained", at_kill)
        # survivors from their own node's RAM; the replacement, on the lost worker's node (Ray
        # Train's placement group slot), from the RAM its node's agent still holds for it
        assert restored[0]["tier"] == "local" and restored[2]["tier"] == "local"
        assert restored[1]["tier"] in ("copy", "peer", "local"), restored
        assert len({r["start"] for r in restored.values()}) == 1
        assert restored[0]["start"] >= at_kill - 3  # a step or two in flight is trained again, never more
        # every step trained again after the rollback gave the digest it gave the first time
        mismatched = [(r, s) for r in range(3) for s in range(STEPS) if store.check([f"test/mismatch/{r}/{s}"])]
        assert mismatched == []
        print("steps trained again:", int(store.get("test/replayed")) if store.check(["test/replayed"]) else 0)
        assert len({f["digest"] for f in final.values()}) == 1
        first = max(float(store.get(f"test/first_step/1/{r}")) for r in range(3))
        print(f"kill -> first step of every rank: {first - killed:.2f} s; run: {time.time() - started:.1f} s")
    finally:
        runner.join(timeout=60)
        memsnap.shutdown(job, timeout=30)
