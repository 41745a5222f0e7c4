"""Fault injection into a live agent, for tests and failure drills only.

A production agent refuses every call here: the hooks work only in an agent whose process
was started with ``MEMSNAP_TESTING_HOOKS=1`` in its environment (the test suite sets it
before it starts its loopback cluster). From a driver::

    from memsnap import testing
    testing.flip_chunk(agent_handle, step, owner, stripe, shard)   # corrupt one held byte
    testing.stall_receiving(agent_handle, step, after_chunks=3)    # stop acknowledging
    testing.stall_data_plane(agent_handle, seconds=5)              # hold chunks in and out
    testing.hold_heartbeats(agent_handle, seconds=3)               # a slow agent: beats late

``memsnap.chaos`` uses ``stall_data_plane`` for its ``stall`` fault.
"""

from __future__ import annotations

import functools
import os
import threading
import time

import ray

from memsnap.coding.stripes import ChunkKey
from memsnap.errors import ConfigError

ENV = "MEMSNAP_TESTING_HOOKS"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def inject(core, what: str, *args):
    """Run fault ``what`` in the agent ``core`` (called inside the agent's process)."""
    if not enabled():
        raise ConfigError(
            f"fault injection ({what}) is off in this agent: it is for tests, and only an agent "
            f"started with {ENV}=1 in its environment accepts it"
        )
    if what == "flip_chunk":
        step, owner, stripe, shard, offset = args
        core.store.flip_byte(ChunkKey(step, owner, stripe, shard), offset)
    elif what == "stall_receiving":
        step, after = args
        core.store.stall(step, after)
    elif what == "stalled":
        return core.store.stalled.is_set()
    elif what == "stall_data_plane":
        (seconds,) = args
        return DataPlaneStall.on(core).hold(seconds)
    elif what == "data_plane_stall":
        return DataPlaneStall.on(core).status()
    elif what == "end_data_plane_stall":
        return DataPlaneStall.on(core).end()
    elif what == "hold_heartbeats":
        (seconds,) = args
        core.heartbeats_held_until = time.monotonic() + float(seconds)
    else:
        raise ConfigError(
            f"unknown fault {what!r}: use flip_chunk, stall_receiving, stalled, "
            "stall_data_plane, data_plane_stall, end_data_plane_stall or hold_heartbeats"
        )
    return None


class DataPlaneStall:
    """Holds an agent's data plane still until a deadline: every chunk reserved or looked up
    by its transport server (pushes and fetches from peers and ranks) and every push or fetch
    it makes waits until the deadline passes, then goes on as if the network had paused."""

    GATED = (("store", "reserve"), ("store", "lookup"), ("transport", "push"), ("transport", "fetch"))

    def __init__(self):
        self.until = 0.0  # time.monotonic() of the end of the stall
        self.held = 0  # calls held so far
        self.lock = threading.Lock()

    @classmethod
    def on(cls, core) -> DataPlaneStall:
        """The stall gate of agent ``core``, put in front of its data plane the first time."""
        with core.lock:
            gate = getattr(core, "_data_plane_stall", None)
            if gate is None:
                gate = core._data_plane_stall = cls()
                for owner, name in cls.GATED:
                    obj = getattr(core, owner)
                    setattr(obj, name, functools.partial(gate.gated, getattr(obj, name)))
            return gate

    def hold(self, seconds: float) -> dict:
        """Stall for ``seconds`` from now (a stall already running is extended, never shortened)."""
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < 86400:
            raise ConfigError(f"stall_data_plane: seconds={seconds!r} is not a number of seconds in (0, 86400)")
        with self.lock:
            self.until = max(self.until, time.monotonic() + seconds)
        return self.status()

    def end(self) -> dict:
        """End the stall now (held calls go on within a quarter of a second)."""
        with self.lock:
            self.until = 0.0
        return self.status()

    def status(self) -> dict:
        with self.lock:
            return {"remaining_s": max(self.until - time.monotonic(), 0.0), "held_calls": self.held}

    def gated(self, fn, *args, **kwargs):
        counted = False
        while (left := self.until - time.monotonic()) > 0:
            if not counted:
                with self.lock:
                    self.held += 1
                counted = True
            time.sleep(min(left, 0.25))  # the fault itself: this thread is meant to wait
        return fn(*args, **kwargs)


def flip_chunk(agent, step: int, owner: str, stripe: int, shard: int, offset: int = 0, timeout: float = 60):
    """Corrupt one byte of a chunk ``agent`` holds."""
    return ray.get(agent.fault.remote("flip_chunk", step, owner, stripe, shard, offset), timeout=timeout)


def stall_receiving(agent, step: int, after_chunks: int, timeout: float = 60):
    """Make ``agent`` stop acknowledging chunks of ``step`` after ``after_chunks`` of them."""
    return ray.get(agent.fault.remote("stall_receiving", step, after_chunks), timeout=timeout)


def stalled(agent, timeout: float = 60) -> bool:
    return ray.get(agent.fault.remote("stalled"), timeout=timeout)


def stall_data_plane(agent, seconds: float, timeout: float = 60) -> dict:
    """Hold ``agent``'s data plane (chunks in and out) still for ``seconds``; returns
    ``{"remaining_s", "held_calls"}``."""
    return ray.get(agent.fault.remote("stall_data_plane", seconds), timeout=timeout)


def hold_heartbeats(agent, seconds: float, timeout: float = 60) -> None:
    """Stop ``agent``'s heartbeats for ``seconds`` while it goes on answering (a slow agent:
    the coordinator must ping it and find it alive, not fence it)."""
    ray.get(agent.fault.remote("hold_heartbeats", seconds), timeout=timeout)


def data_plane_stall(agent, timeout: float = 60) -> dict:
    """``{"remaining_s": seconds left of the stall, "held_calls": calls it held so far}``."""
    return ray.get(agent.fault.remote("data_plane_stall"), timeout=timeout)


def end_data_plane_stall(agent, timeout: float = 60) -> dict:
    """End a stall of ``agent``'s data plane now."""
    return ray.get(agent.fault.remote("end_data_plane_stall"), timeout=timeout)
