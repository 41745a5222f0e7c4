"""The training-loop contract of ``Snapshotter``: policy, failed snapshots, staleness, SIGTERM.

One 3-node loopback cluster for the module (k=1, m=1 needs k+m+1 = 3 nodes); each test runs
its own job (3 ranks, one pinned to each node) and shuts it down afterwards. The SIGTERM test
runs rank 0 as a separate, torchrun-style Python process (``Snapshotter.from_env``: RANK,
WORLD_SIZE and RAY_ADDRESS from the environment), the other two ranks as actors that mirror
its steps.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator, Mapping
from functools import partial

import pytest
import ray
import torch
from support import states
from support.runtime import cluster, kill, remove_arenas
from support.runtime import digest as helpers_digest

import memsnap
from memsnap.durable.storage import Store
from memsnap.rank import Snapshotter, shutdown

pytestmark = [pytest.mark.ray, pytest.mark.slow]

K, M, WORLD = 1, 1, 3
BUDGET = 32 << 20  # per agent; an "over budget" state carries a 40 MiB tensor
BASE = dict(k=K, m=M, memory_budget=BUDGET, preemption=False)


STATE: states.Shape = dict(widths=(16, 32, 16), lr=1e-2)
BATCH = 8
make_state = partial(states.make_state, **STATE)
train_step = partial(states.train_step, batch=BATCH)


def digest(state: dict) -> str:
    """A hash over the parameters and the optimizer's tensors: equal iff bitwise equal."""
    return helpers_digest(state, rng=False)


class Counted(Mapping):
    """A read-only view of a state that counts how often it is read."""

    def __init__(self, state: dict):
        self._state, self.reads = state, 0

    def __getitem__(self, key):
        self.reads += 1
        return self._state[key]

    def __iter__(self):
        self.reads += 1
        return iter(self._state)

    def __len__(self):
        self.reads += 1
        return len(self._state)


class Blob(torch.nn.Module):
    """A tensor larger than ``BUDGET``: a snapshot holding it cannot get an arena."""

    def __init__(self):
        super().__init__()
        self.register_buffer("blob", torch.zeros((BUDGET + (8 << 20)) // 4))


@ray.remote(num_cpus=0)
class Rank:
    """One rank of a test job: its own small state and Snapshotter."""

    def __init__(self, job: str, rank: int, opts: dict, world: int = WORLD):
        self.state = make_state(rank)
        self.snap = Snapshotter(job=job, rank=rank, world_size=world, **opts)

    def restore(self) -> int | None:
        return self.snap.restore(self.state)

    def digest(self) -> str:
        return digest(self.state)

    def ready(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def step(self, step: int, too_big: bool = False) -> dict:
        """Train one step and ``save`` it (with an over-budget tensor if ``too_big``)."""
        train_step(self.state)
        view = Counted(dict(self.state, blob=Blob()) if too_big else self.state)
        try:
            saved, error = self.snap.save(step, view), None
        except Exception as exc:
            saved, error = None, f"{type(exc).__name__}: {exc}"
        return {
            "saved": saved,
            "error": error,
            "reads": view.reads,
            "counters": dict(self.snap.counters),
            "last_error": self.snap.last_error,
        }

    def wait(self, step: int, timeout: float) -> int | None:
        return self.snap.wait(step, timeout)

    def status(self) -> dict:
        return self.snap.status()


@pytest.fixture(scope="module")
def local_cluster():
    with cluster("tc-none", WORLD) as c:  # each test shuts its own job down
        yield c


@pytest.fixture
def own_job(local_cluster, request) -> Iterator[tuple[str, list]]:
    """A unique job name; its actors, agents, coordinator and arenas are removed afterwards."""
    name = f"tc-{request.node.name[5:20].replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    actors: list = []
    yield name, actors
    for actor in actors:
        kill(actor)
    with contextlib.suppress(Exception):
        shutdown(name, timeout=10)
    remove_arenas(name)


def start_ranks(job, opts: dict, ranks=range(WORLD)) -> list:
    name, actors = job
    started = [Rank.options(resources={f"memsnap_node_{r}": 0.01}).remote(name, r, dict(BASE, **opts)) for r in ranks]  # type: ignore[attr-defined]  # @ray.remote makes an ActorClass; ray's annotation keeps the bare class
    actors.extend(started)
    ray.get([a.ready.remote() for a in started], timeout=180)
    return started


def step_all(ranks: list, step: int, too_big: bool = False) -> list[dict]:
    return ray.get([r.step.remote(step, too_big) for r in ranks], timeout=240)


def wait(rank, step: int) -> int | None:
    return ray.get(rank.wait.remote(step, 60), timeout=90)


def test_every_steps_snapshots_steps_n_minus_1_2n_minus_1_and_skips_the_rest_untouched(own_job):
    ranks = start_ranks(own_job, dict(every_steps=3, keep=3))
    taken = []
    for step in range(9):
        results = step_all(ranks, step)
        assert len({r["saved"] for r in results}) == 1 and results[0]["error"] is None
        if results[0]["saved"]:
            taken.append(step)
            assert all(r["reads"] > 0 for r in results)
            assert wait(ranks[0], step) == step
        else:  # a skipped step does not even look at the state
            assert all(r["reads"] == 0 for r in results)
    assert taken == [2, 5, 8]
    for r in results:
        assert r["counters"] == {"saves": 3, "failed_saves": 0, "skipped_saves": 6, "skipped_busy": 0}
    st = ray.get(ranks[0].status.remote(), timeout=60)
    assert st["committed_steps"] == [2, 5, 8] and st["failed_snapshots"] == 0


def test_a_failed_snapshot_is_counted_and_training_goes_on(own_job):
    ranks = start_ranks(own_job, dict(on_error="warn"))
    assert all(r["saved"] for r in step_all(ranks, 0)) and wait(ranks[0], 0) == 0
    failed = step_all(ranks, 1, too_big=True)
    for r in failed:
        assert r["saved"] is False and r["error"] is None
        assert r["counters"]["failed_saves"] == 1 and r["counters"]["saves"] == 1
        assert r["last_error"].startswith("step 1: MemoryBudgetError:") and "memory_budget" in r["last_error"]
    st = ray.get(ranks[0].status.remote(), timeout=60)
    assert st["failed_saves"] == 1 and st["committed_step"] == 0
    assert all(r["saved"] for r in step_all(ranks, 2))
    assert wait(ranks[0], 2) == 2
    assert ray.get(ranks[0].status.remote(), timeout=60)["committed_steps"] == [0, 2]


def test_on_error_raise_makes_a_failed_snapshot_a_hard_error(own_job):
    ranks = start_ranks(own_job, dict(on_error="raise"))
    got = ray.get(ranks[0].step.remote(0, True), timeout=240)
    assert got["saved"] is None and got["error"].startswith("MemoryBudgetError:")
    assert got["counters"]["failed_saves"] == 1 and got["last_error"].startswith("step 0: MemoryBudgetError:")


def test_snapshots_failing_for_longer_than_max_staleness_steps_stop_training(own_job):
    ranks = start_ranks(own_job, dict(on_error="warn", max_staleness_steps=2))
    for step in (0, 1):
        assert all(r["saved"] is False and r["error"] is None for r in step_all(ranks, step, too_big=True))
    third = step_all(ranks, 2, too_big=True)
    for r in third:
        assert r["error"].startswith("StalenessError: step 2:") and "max_staleness_steps=2" in r["error"]
        assert r["counters"]["failed_saves"] == 3


def test_a_single_process_snapshots_into_local_ram_and_the_spill(own_job, tmp_path):
    """world_size=1 has no peers: a crashed process restores from its node's agent, the
    spill holds the rest, and status() says no node loss is survivable from RAM."""
    from memsnap.localcluster import wait_for

    name, actors = own_job
    spill = str(tmp_path / "spill")

    def solo():
        actor = Rank.options(resources={"memsnap_node_0": 0.01}).remote(
            name, 0, dict(BASE, spill=spill, spill_every=2), world=1
        )
        actors.append(actor)
        ray.get(actor.ready.remote(), timeout=180)
        return actor

    first = solo()
    for step in range(3):
        got = ray.get(first.step.remote(step), timeout=240)
        assert got["saved"] and got["error"] is None
    assert wait(first, 2) == 2
    wait_for(
        lambda: ray.get(first.status.remote(), timeout=60)["durable_step"] == 2,
        timeout=120,
        what="step 2 spilled (the first commit of the second block of 2 steps)",
    )
    st = ray.get(first.status.remote(), timeout=60)
    assert st["committed_steps"] == [1, 2] and st["protection"] == {"0": 0}
    saved = ray.get(first.digest.remote(), timeout=60)
    kill(first)  # the process dies; the node and its agent stay
    second = solo()
    assert ray.get(second.digest.remote(), timeout=60) != saved
    assert ray.get(second.restore.remote(), timeout=240) == 2
    assert ray.get(second.digest.remote(), timeout=60) == saved
    assert ray.get(second.status.remote(), timeout=60)["last_restore"]["tier"] == "local"
    fresh = make_state(7)
    assert memsnap.load(spill, fresh, 2, rank=0, world_size=1) == 2 and digest(fresh) == saved


SCRIPT = """
import json, sys, time
import memsnap.localcluster  # binds Ray to loopback before it is imported
import ray, torch
from memsnap.rank import Snapshotter
from support.runtime import digest
from support.states import make_state, train_step

job, spill, out = sys.argv[1:4]
# a torchrun-style process: RANK, WORLD_SIZE and RAY_ADDRESS come from the environment
snap = Snapshotter.from_env(job=job, k={k}, m={m}, memory_budget={budget}, spill=spill, spill_every=1000)
assert (snap.rank, snap.world) == (0, {world})
state, step = make_state(0, **{state!r}), -1
try:
    for step in range(1000):
        train_step(state, batch={batch})
        print("STEP", step, flush=True)
        snap.save(step, state)
        snap.wait(step, timeout=120)  # one step in flight at a time, however loaded the machine
finally:
    with open(out, "w") as f:
        json.dump({{"step": step, "digest": digest(state, rng=False)}}, f)
    print("EXIT", step, flush=True)
"""


def _lines(proc) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            q.put(line.split())
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def test_sigterm_takes_a_last_snapshot_spills_it_and_exits_cleanly(own_job, local_cluster, tmp_path):
    name, actors = own_job
    spill, out = str(tmp_path / "spill"), str(tmp_path / "rank0.json")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(world=WORLD, k=K, m=M, budget=BUDGET, state=STATE, batch=BATCH)))
    env = dict(os.environ, RANK="0", WORLD_SIZE=str(WORLD), RAY_ADDRESS=local_cluster.address)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), name, spill, out], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    try:
        others = start_ranks(own_job, dict(spill=spill, spill_every=1000, preemption=False), ranks=(1, 2))
        lines, exit_line = _lines(proc), None
        while (words := lines.get(timeout=180)) is not None:
            if words[:1] == ["STEP"]:  # the other ranks take the same step
                step = int(words[1])
                assert all(r["error"] is None for r in step_all(others, step))
                if step == 5:
                    proc.send_signal(signal.SIGTERM)
            elif words[:1] == ["EXIT"]:
                exit_line = int(words[1])
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert code == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    import json

    last = json.loads(open(out).read())
    assert exit_line == last["step"] and last["step"] >= 5
    assert Store.open(spill).latest() == last["step"]
    fresh = make_state(123)
    assert digest(fresh) != last["digest"]
    assert memsnap.load(spill, fresh, last["step"], rank=0, world_size=WORLD) == last["step"]
    assert digest(fresh) == last["digest"]
