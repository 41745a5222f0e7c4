"""The NCCL side of ``RecoverableGroup``, as far as it runs without a GPU: the environment a
member runs with, a generation left by abort (never by destroy), and the timer that abandons
a collective nobody reported. The NCCL group itself forms only on a GPU (skipped here)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from memsnap.collective import group as pg
from memsnap.collective.group import PeerLost, RecoverableGroup, failed_key


def test_a_member_runs_nccl_with_memsnap_not_the_watchdog_handling_failures():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    pg.nccl_environment(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # the watchdog would kill the survivors
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # the user's own choice stays


@pytest.mark.parametrize("backend, called", [("nccl", "abort"), ("gloo", "destroy")])
def test_a_generation_is_left_by_abort_under_nccl_and_never_destroyed(monkeypatch, backend, called):
    calls = []
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append("destroy"))
    pg.leave(backend)
    assert calls == [called]


def test_nccl_communicators_are_non_blocking_where_nccl_is_built():
    if not dist.is_nccl_available():
        assert pg.nccl_options() is None
        pytest.skip("this torch has no NCCL")
    assert pg.nccl_options().config.blocking is False


class _Hung:
    """A collective whose peer is gone and whose failure nobody reported."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def is_completed(self):
        return False


def test_a_collective_nobody_reports_is_abandoned_once_it_outlives_the_backends_timeout():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = RecoverableGroup("nccl-timer", ("127.0.0.1", store.port), timeout_s=0.5)
    try:
        with group._wake:  # a formed generation (the group itself is not under test)
            group.gen, group.rank, group.world = 0, 0, 2
            group._wake.notify_all()
        with pytest.raises(PeerLost, match="outlived the backend's timeout"):
            group._wait(_Hung(), 0)
        # the generation is over for every member, not only here
        assert "outlived the backend's timeout" in store.get(failed_key("nccl-timer", 0)).decode()
        assert group.failure() is not None
    finally:
        group.close()
