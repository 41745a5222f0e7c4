"""Arenas are page-locked for CUDA once, at creation, and never while their pages are given back.

Without a GPU the CUDA runtime is replaced by a recorder (``FakeCudart``), which checks the
calls memsnap makes: their order, addresses and sizes. The real ``cudaHostRegister`` runs only
in ``bench/gpu.py`` and the ``gpu``-marked test.
"""

from __future__ import annotations

import os

import pytest
import torch

from memsnap import naming
from memsnap.memory import pinning
from memsnap.memory.arena import Arena


class FakeCudart:
    def __init__(self, refuse: int = 0):
        self.calls: list[tuple] = []
        self.refuse = refuse

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return self.refuse

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def path():
    p = naming.arena_path(f"pintest{os.getpid()}", "n" * 12, 0, 0, 0)
    yield p
    assert not os.path.exists(p)


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_without_cuda_pinning_is_skipped_and_says_so(path):
    arena = Arena.create(path, 1 << 16, pin=True)
    try:
        assert arena.pinning.pinned is False and "no CUDA device" in arena.pinning.reason
        arena.view()[:4] = b"abcd"
        assert bytes(arena.view()[:4]) == b"abcd"
    finally:
        arena.close()


def test_an_arena_is_registered_once_at_creation_and_unregistered_at_close(path, cudart):
    arena = Arena.create(path, 1 << 16, pin=True)
    assert not pinning.register(bytearray()).pinned  # an empty buffer is never registered
    assert len(cudart.calls) == 1
    kind, address, nbytes, flags = cudart.calls[0]
    assert (kind, nbytes, flags) == ("register", 1 << 16, pinning.PORTABLE) and arena.pinning.pinned
    for _ in range(3):
        arena.pin()  # a snapshot asking again costs nothing
    assert len(cudart.calls) == 1
    arena.close()
    assert cudart.calls[1] == ("unregister", address)


def test_release_unpins_before_giving_pages_back_and_ensure_backed_pins_again(path, cudart):
    arena = Arena.create(path, 1 << 16, pin=True)
    try:
        arena.release()
        assert [c[0] for c in cudart.calls] == ["register", "unregister"] and not arena.pinning.pinned
        arena.release()  # twice: nothing more to drop
        arena.ensure_backed()
        assert [c[0] for c in cudart.calls] == ["register", "unregister", "register"] and arena.pinning.pinned
    finally:
        arena.close()
    assert cudart.calls[-1][0] == "unregister"


def test_a_refused_registration_is_reported_not_raised(path, monkeypatch, caplog):
    fake = FakeCudart(refuse=712)  # cudaErrorHostMemoryAlreadyRegistered, say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with caplog.at_level("WARNING", logger="memsnap"):
        arena = Arena.create(path, 1 << 12, pin=True)
    try:
        assert not arena.pinning.pinned and "refused (712)" in arena.pinning.reason
        assert "synchronous" in caplog.text
    finally:
        arena.close()
    assert [c[0] for c in fake.calls] == ["register"]  # nothing to undo


def test_side_stream_capture_registration_goes_through_pinning(cudart):
    from memsnap.state import cuda_capture

    buf = bytearray(4096)
    reg = cuda_capture.HostRegistration(memoryview(buf))
    assert reg.pinned and cudart.calls[0][2] == 4096
    reg.close()
    assert cudart.calls[1][0] == "unregister" and not reg.pinned


@pytest.mark.gpu
def test_real_registration_of_a_shared_memory_arena(path):
    arena = Arena.create(path, 1 << 20, pin=True)
    try:
        assert arena.pinning.pinned, arena.pinning.reason
        src = torch.arange(1 << 18, dtype=torch.int32, device="cuda")
        dst = torch.frombuffer(arena.view(), dtype=torch.int32)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dst, src.cpu())
        del dst
    finally:
        arena.close()
