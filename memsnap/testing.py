"""Fault injection into a live agent, for tests and failure drills only.

A production agent refuses every call here: the hooks work only in an agent whose process
was started with ``MEMSNAP_TESTING_HOOKS=1`` in its environment (the test suite sets it
before it starts its loopback cluster). From a driver::

    from memsnap import testing
    testing.flip_chunk(agent_handle, step, owner, stripe, shard)   # corrupt one held byte
    testing.stall_receiving(agent_handle, step, after_chunks=3)    # stop acknowledging
"""
from __future__ import annotations

import os

import ray

from memsnap.errors import ConfigError
from memsnap.transport.base import ChunkKey

ENV = "MEMSNAP_TESTING_HOOKS"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def inject(core, what: str, *args):
    """Run fault ``what`` in the agent ``core`` (called inside the agent's process)."""
    if not enabled():
        raise ConfigError(f"fault injection ({what}) is off in this agent: it is for tests, and only an agent "
                          f"started with {ENV}=1 in its environment accepts it")
    if what == "flip_chunk":
        step, owner, stripe, shard, offset = args
        core.store.flip_byte(ChunkKey(step, owner, stripe, shard), offset)
    elif what == "stall_receiving":
        step, after = args
        core.store.stall(step, after)
    elif what == "stalled":
        return core.store.stalled.is_set()
    else:
        raise ConfigError(f"unknown fault {what!r}: use flip_chunk, stall_receiving or stalled")
    return None


def flip_chunk(agent, step: int, owner: str, stripe: int, shard: int, offset: int = 0, timeout: float = 60):
    """Corrupt one byte of a chunk ``agent`` holds."""
    return ray.get(agent.fault.remote("flip_chunk", step, owner, stripe, shard, offset), timeout=timeout)


def stall_receiving(agent, step: int, after_chunks: int, timeout: float = 60):
    """Make ``agent`` stop acknowledging chunks of ``step`` after ``after_chunks`` of them."""
    return ray.get(agent.fault.remote("stall_receiving", step, after_chunks), timeout=timeout)


def stalled(agent, timeout: float = 60) -> bool:
    return ray.get(agent.fault.remote("stalled"), timeout=timeout)
