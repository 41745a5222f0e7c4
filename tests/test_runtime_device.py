"""The device tier wired into the runtime (``device_buffer=True``), on the CPU backend.

One node, one rank: every snapshot goes through the agent's device buffer (shared memory
standing in for GPU memory), the agent drains it into the step's host arena and commits it;
the rank's process is killed, and its replacement restores from the agent's buffer (tier
``device``), bitwise. On a GPU the same path runs with the CUDA backend (not yet run).
"""

from __future__ import annotations

import pytest
import ray
from support.runtime import JobSpec, kill, start_trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = "rt-device"
OPTS = dict(
    k=2, m=1, memory_budget=128 << 20, on_error="raise", preemption=False, device_buffer=True, device_backend="cpu"
)

JOB_SPEC = JobSpec(JOB, 1, ranks=())  # the cluster only: each test starts its trainers


def test_a_crashed_rank_restores_from_the_agents_device_buffer(job):
    trainer = start_trainer(JOB, 0, 1, 0, OPTS, seed=5)
    digests = {}
    for step in range(3):
        digests[step] = ray.get(trainer.step_and_save.remote(step), timeout=120)
        assert ray.get(trainer.wait.remote(step, 120), timeout=150) == step  # drained, then committed
    kill(trainer)
    again = start_trainer(JOB, 0, 1, 0, OPTS, seed=99)
    step, digest, report = ray.get(again.restore.remote(), timeout=240)
    assert (step, report["tier"]) == (2, "device")
    assert digest == digests[2]
    # the next snapshot goes through the device tier again and commits
    ray.get(again.step_and_save.remote(3), timeout=120)
    assert ray.get(again.wait.remote(3, 120), timeout=150) == 3
    kill(again)
