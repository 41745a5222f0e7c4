"""The Ray Train in-place backend's protocol, without a cluster: the generations it writes to
the rendezvous store and what each new worker is told, at the start and on a replacement."""

from __future__ import annotations

import types

import pytest

from memsnap.collective.assignment import Assignment

pytest.importorskip("ray.train.v2")


class FakeWorker:
    """A Ray Train worker as the backend sees it: its rank, its node, and the calls made on it."""

    def __init__(self, rank: int, world: int, node: str):
        self.distributed_context = types.SimpleNamespace(world_rank=rank, world_size=world)
        self.metadata = types.SimpleNamespace(node_id=node)
        self.calls: list[tuple] = []

    def execute_async(self, fn, *args, **kwargs):
        self.calls.append((fn.__name__, args))
        return None


@pytest.fixture
def backend(monkeypatch):
    import ray
    from ray.train._internal.utils import Singleton

    from memsnap.integrations.ray_train_inplace import InplaceTorchConfig

    monkeypatch.setattr(Singleton, "_instances", {})  # a backend is one per process: a fresh one per test

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: "head"))
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)

    def no_coordinator(name, namespace=None):
        raise ValueError(name)

    monkeypatch.setattr(ray, "get_actor", no_coordinator)
    config = InplaceTorchConfig(job="unit-rt")
    b = config.backend_cls()
    assert b.has_replica_groups
    return b, config


def _group(workers):
    from ray.train.v2._internal.execution.worker_group import ReplicaGroup

    return ReplicaGroup(workers, {"CPU": 1}, [])


def _gen(b, gen: int) -> Assignment:
    from memsnap.collective.assignment import gen_key

    return Assignment.from_json(b.store.get(gen_key(b.job, gen)))


def _env(worker) -> dict:
    ((name, (values,)),) = worker.calls
    assert name == "_set_env"
    return values


def test_the_backend_writes_generation_0_then_gives_a_replacement_the_lost_rank(backend):
    from memsnap.collective.group import failed_key
    from memsnap.integrations import ray_train_inplace as rti

    b, config = backend
    workers = [FakeWorker(r, 3, f"n{r}") for r in range(3)]
    whole = types.SimpleNamespace(
        get_workers=lambda: workers,  # the whole worker group (no ReplicaGroup)
        execute_single_async=lambda i, fn, *a: workers[i].execute_async(fn, *a),
    )
    b.on_start(whole, config)
    assert _gen(b, 0) == Assignment(3, {"w0g0": 0, "w1g0": 1, "w2g0": 2})
    envs = [_env(w) for w in workers]
    assert {e[rti.GEN_ENV] for e in envs} == {"0"} and [e[rti.MEMBER_ENV] for e in envs] == ["w0g0", "w1g0", "w2g0"]
    assert {e[rti.STORE_ENV] for e in envs} == {f"127.0.0.1:{b.store.port}"}
    assert {e[rti.JOB_ENV] for e in envs} == {"unit-rt"} and {e[rti.NODE_ENV] for e in envs} == {"head"}

    # Ray Train shuts the failed worker's replica group down: generation 0 is over for the survivors
    b.on_shutdown(_group([workers[1]]), config)
    assert b.store.get(failed_key("unit-rt", 0)).decode().startswith("Ray Train: a worker failed")
    # ... and starts a new worker in its place: generation 1, the same ranks, the new member
    new = FakeWorker(1, 3, "n3")
    b.on_start(_group([new]), config)
    one = _gen(b, 1)
    assert (one.world, dict(one.members), one.done) == (3, {"w0g0": 0, "w1g1": 1, "w2g0": 2}, False)
    assert (one.recoveries, one.rollbacks) == (0, 0) and one.age_s >= 0.0  # the ranks add this recovery
    assert _env(new)[rti.GEN_ENV] == "1" and _env(new)[rti.MEMBER_ENV] == "w1g1"
    assert all(len(w.calls) == 1 for w in workers)  # the survivors are told nothing but the store's keys
    assert b.nodes == {0: "n0", 1: "n3", 2: "n2"}


def test_without_a_job_name_the_run_gets_the_one_from_ray_train_would_give_it(backend):
    from memsnap.integrations.ray_train_inplace import InplaceTorchConfig

    b, _ = backend
    workers = [FakeWorker(0, 1, "n0")]
    run = types.SimpleNamespace(run_config=types.SimpleNamespace(name="sweep-2026"), run_id="0123456789abcdef")
    whole = types.SimpleNamespace(
        get_workers=lambda: workers,
        _train_run_context=run,
        execute_single_async=lambda i, fn, *a: workers[i].execute_async(fn, *a),
    )
    b.on_start(whole, InplaceTorchConfig())
    assert b.job == "sweep-2026-01234567"


def test_ray_train_v1_is_refused_with_the_fix(backend):
    b, config = backend
    v1_group = types.SimpleNamespace(workers=[], execute=lambda fn, *a: None)
    with pytest.raises(RuntimeError, match="RAY_TRAIN_V2_ENABLED=1"):
        b.on_start(v1_group, config)


def test_run_outside_an_inplace_trainer_says_what_is_missing(monkeypatch):
    from memsnap.integrations import ray_train_inplace as rti

    for key in (rti.STORE_ENV, rti.JOB_ENV, rti.GEN_ENV, rti.MEMBER_ENV):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torch_config=InplaceTorchConfig"):
        rti.run(lambda ctx: None, lambda ctx, state: None)


def test_each_generation_carries_the_recoveries_before_it_which_rolled_back_and_the_job_age(backend, monkeypatch):
    """What every rank's ``auto`` interval is set from: generation g follows g recoveries, g-1 of
    them before it; one rolled back unless every member reported a live takeover (``kept`` or
    ``live``); a recovery no member reported counts as a rollback (the safe side)."""
    from memsnap.collective.assignment import report_key
    from memsnap.collective.report import MemberReport
    from memsnap.integrations import ray_train_inplace as rti

    clock = [1000.0]
    monkeypatch.setattr(rti.time, "monotonic", lambda: clock[0])
    b, config = backend
    workers = [FakeWorker(r, 2, f"n{r}") for r in range(2)]
    whole = types.SimpleNamespace(
        get_workers=lambda: workers, execute_single_async=lambda i, fn, *a: workers[i].execute_async(fn, *a)
    )
    b.on_start(whole, config)
    assert (_gen(b, 0).recoveries, _gen(b, 0).rollbacks, _gen(b, 0).age_s) == (0, 0, 0.0)

    def report(gen: int, rank: int, tier: str) -> None:
        rep = MemberReport(member=f"m{rank}", pid=1, rank=rank, gen=gen, takeover=False, assigned=0.0, tier=tier)
        b.store.set(report_key("unit-rt", gen, rank), rep.to_json())

    tiers = {1: ("kept", "live"), 2: ("local", "peer"), 3: None}  # live takeover, rollback, no report
    for gen, clock[0] in ((1, 1030.0), (2, 1075.5), (3, 1100.0), (4, 1200.0)):
        b.on_start(_group([FakeWorker(1, 2, f"n{gen + 1}")]), config)
        for rank, tier in enumerate(tiers.get(gen) or ()):
            report(gen, rank, tier)
    got = [(_gen(b, g).recoveries, _gen(b, g).rollbacks, _gen(b, g).age_s) for g in range(1, 5)]
    assert got == [(0, 0, 30.0), (1, 0, 75.5), (2, 1, 100.0), (3, 2, 200.0)]
