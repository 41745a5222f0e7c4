"""The device tier inside the Ray runtime: the agent's half (``AgentDevice``, held by
``AgentCore``) and the rank's half (``RankDevice``, held by a ``Snapshotter``).

Call sequence of one snapshot with ``device_buffer`` on (the host path's ``begin`` and
``captured`` are unchanged; the device tier sits between them):

  1. (rank)  ``agent.begin(step, rank, nbytes)`` as always: the host arena slot of the step.
  2. (rank)  ``agent.device_begin(step, rank, device, nbytes)`` -> a buffer handle, or None
             while the agent still drains the last capture: then this step goes the host way.
  3. (rank)  ``RankTier.capture``: D2D on a side stream; the optimizer pre-hook waits for it.
  4. (rank)  ``agent.device_captured(step, rank, device, manifest, local_ranks)`` once the
             copies are done, and waits for the answer (the buffer is marked held: one actor
             round trip, not the drain). From here the rank may die and nothing is lost.
  5. (agent) in its thread pool: drains the buffer into the step's (pinned) host arena, then
             ``captured`` as if the rank had written the arena itself: encode, send, commit.
  6. (rank)  restore after a crash, when the plan says ``local``: ``agent.device_source(rank,
             step)`` -> the buffer still holds ``step``: copy back D2D (tier ``device``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from memsnap.device import backend as make_backend
from memsnap.device import visibility
from memsnap.device.backend import BufferHandle
from memsnap.device.tier import AgentTier, RankTier
from memsnap.errors import DeviceError, MemoryBudgetError

log = logging.getLogger("memsnap")
UNBOUNDED = 1 << 62  # device_buffer=True: bounded by the device's memory, not by a budget


def resolve_kind(kind: str) -> str:
    """``auto``: ``cuda`` when this process sees a CUDA device, else ``none`` (no device, so
    nothing for the tier to do); ``cuda`` and ``cpu`` as asked."""
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "none"
    return kind


class AgentDevice:
    """(agent) The node's device buffers, and the drain into the host arenas.

    What it needs of its agent, passed in: ``submit(fn, *args)`` runs a drain in the agent's
    thread pool; ``arena(step, rank)`` is the host arena of ``rank``'s slot of ``step`` and its
    byte count (None: the step was dropped meanwhile); ``captured(step, rank, manifest,
    local_ranks)`` hands the drained step on (encode, send, commit); ``failed(step, why)``
    tells the coordinator that the step cannot commit."""

    def __init__(
        self,
        node: str,
        job: str,
        kind: str,
        buffer: bool | int,
        *,
        submit: Callable[..., Any],
        arena: Callable[[int, int], tuple[Any, int] | None],
        captured: Callable[[int, int, str, list[int]], None],
        failed: Callable[[int, str], None],
    ):
        if kind != "cpu":  # before CUDA starts in this process: see every GPU of the node
            log.info("memsnap: device tier: %s", visibility.see_node_gpus())
        kind = resolve_kind(kind)
        if kind == "none":
            raise DeviceError(
                f"node {node[:12]}: the agent sees no CUDA device (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get(visibility.VISIBLE)!r}); the device tier is off here"
            )
        budget = UNBOUNDED if buffer is True else int(buffer)
        self.submit, self.arena, self.handed_on, self.failed = submit, arena, captured, failed
        self.tier = AgentTier(make_backend(kind), budget, prefix=f"memsnap-{job}-{node[:12]}")
        self.lock = threading.Lock()

    def begin(self, step: int, rank: int, device: str, nbytes: int) -> str | None:
        with self.lock:
            handle = self.tier.begin(rank, device, step, nbytes)
        return None if handle is None else handle.to_json()

    def captured(self, step: int, rank: int, device: str, manifest_json: str, local_ranks: list[int]) -> None:
        """Mark ``rank``'s buffer as holding ``step`` now; drain it and hand the step on in
        the agent's thread pool."""
        with self.lock:
            self.tier.captured(rank, device, step, manifest_json)
        self.submit(self._drain, step, rank, device, manifest_json, local_ranks)

    def _drain(self, step: int, rank: int, device: str, manifest_json: str, local_ranks: list[int]) -> None:
        try:
            self._drain_into_arena(step, rank, device, manifest_json, local_ranks)
        except Exception as exc:  # the step cannot commit: say so, as a failed capture would
            why = f"rank {rank}: device buffer drain failed: {type(exc).__name__}: {exc}"
            log.warning("step %d: %s", step, why)
            self.failed(step, why)  # every node drops the step

    def _drain_into_arena(self, step, rank, device, manifest_json, local_ranks) -> None:
        found = self.arena(step, rank)
        if found is not None:  # (None: the step was abandoned meanwhile: the host path drops it the same way)
            arena, nbytes = found
            arena.pin()  # once per arena (a no-op after the first time, or without CUDA)
            self.tier.drain(rank, device, arena.view(0, nbytes))
        self.handed_on(step, rank, manifest_json, local_ranks)

    def source(self, rank: int, step: int) -> list | None:
        """``[manifest JSON, handle JSON]`` of ``rank``'s ``step`` in a device buffer, or None."""
        with self.lock:
            for r, device in list(self.tier._slots):
                if r == rank:
                    found = self.tier.source(rank, device, step)
                    if found is not None:
                        return [found[0], found[1].to_json()]
        return None

    def close(self) -> None:
        with self.lock:
            self.tier.close()


class RankDevice:
    """(rank) Capture into and restore from this node's agent's device buffers."""

    def __init__(self, agent: Any, rank: int, kind: str, optimizers, get: Callable):
        self.agent, self.rank, self._get = agent, rank, get
        self.tier: RankTier | None = None
        self.refused: str | None = None
        self.kind = resolve_kind(kind)
        if self.kind == "none":
            self.refused = "this process sees no CUDA device: nothing to put in a device buffer"
            return
        try:
            self.tier = RankTier(make_backend(self.kind))
        except DeviceError as exc:  # e.g. CuPy missing
            self._refuse(str(exc))
            return
        self.tier.attach(optimizers)

    def _refuse(self, why: str) -> None:
        if self.refused is None:
            log.warning("rank %d: device tier off, side-stream D2H capture instead: %s", self.rank, why)
        self.refused = why

    def device_of(self, sources: list[torch.Tensor]) -> str | None:
        """The device the capture goes to, or None when this state does not take the device
        tier (no CUDA tensor for the CUDA backend; the CPU backend takes any state)."""
        if self.kind == "cpu":
            return "cpu"
        if self.tier is None:  # refused when it was made
            return None
        cuda = [t for t in sources if t.is_cuda]
        if not cuda or len({t.device for t in cuda}) > 1:
            return None  # one buffer per rank and device: a rank's state on one GPU
        return self.tier.backend.device_of(cuda[0])

    def save(self, step: int, layout, sources: list[torch.Tensor], local: list[int]) -> bool:
        """Capture ``step`` through the device tier; False when it cannot take it (the agent is
        still draining, CUDA IPC refused here, state on several devices): the caller captures
        into the host arena instead."""
        tier = self.tier
        if self.refused is not None or tier is None or tier.refused is not None:
            return False
        device = self.device_of(sources)
        if device is None:
            return False
        try:
            got = self._get(self.agent.device_begin.remote(step, self.rank, device, layout.nbytes))
        except DeviceError as exc:  # the agent sees no GPU, or cannot share memory: off for good
            self._refuse(f"the agent refused: {exc}")
            return False
        except MemoryBudgetError as exc:  # does not fit the device budget: this step goes the host way
            log.warning("rank %d: step %d not captured on the device: %s", self.rank, step, exc)
            return False
        if got is None:
            return False
        manifest_json = layout.to_json().decode()
        ok = tier.capture(
            BufferHandle.from_json(got),
            layout,
            sources,
            on_done=lambda: self._get(self.agent.device_captured.remote(step, self.rank, device, manifest_json, local)),
        )  # a round trip
        if ok and self.kind == "cpu":
            tier.wait()  # nothing to overlap with on the CPU
        return ok

    def restore(self, step: int, state) -> bool:
        """Load ``step`` from the agent's device buffer; False when it does not hold it."""
        if self.tier is None:
            return False
        got = self._get(self.agent.device_source.remote(self.rank, step))
        if got is None:
            return False
        try:
            self.tier.restore(state, got[0], BufferHandle.from_json(got[1]))
        except DeviceError as exc:
            log.warning(
                "rank %d: device tier restore of step %d refused (%s); restoring from the host copy",
                self.rank,
                step,
                exc,
            )
            return False
        return True

    def wait(self) -> None:
        if self.tier is not None:
            self.tier.wait()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
