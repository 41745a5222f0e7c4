"""One snapshot of a rank's state into its node's agent: the only part training waits for.

``Capture.take(step, state)`` lays out the state (``capture.PlanCache``: once, until its
tensors change), asks the agent for a slot (``begin``), and copies the bytes in by one of
three paths:

- **host** (CPU tensors): a plain copy into the agent's arena file, then ``captured``;
- **CUDA side stream** (``cuda_capture``): device-to-host on a stream of its own into the
  arena (registered as pinned memory once per file); the agent hears ``captured`` when the
  copy is done, and the optimizers' next step waits for it;
- **the device tier** (``device_buffer=True``; ``device.runtime``): device-to-device into the
  agent's buffer, which the agent drains; a step it cannot take goes the host way.

Encoding, sending and the commit happen in the agent, in the background.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from memsnap.errors import ConfigError
from memsnap.rank.client import AgentClient, get
from memsnap.rank.maps import ArenaMaps

if TYPE_CHECKING:
    from memsnap.device.runtime import RankDevice
    from memsnap.state.cuda_capture import SideStreamCapture

log = logging.getLogger("memsnap")


class Capture:
    """The save paths of rank ``rank`` (of ``world``) of ``job``."""

    def __init__(
        self, client: AgentClient, maps: ArenaMaps, job: str, world: int, device: Any, optimizers=(), plan=None
    ):
        from memsnap.state.capture import PlanCache

        self.client, self.maps, self.job, self.world = client, maps, job, world
        self.rank = client.rank
        self.device_options = device  # the resolved ``options.Device`` group
        self.optimizers = list(optimizers)
        self.plan = plan if plan is not None else PlanCache()  # the layout, again only when the tensors change
        self._cuda: SideStreamCapture | None = None
        self._pins: dict[str, Any] = {}
        self._device: RankDevice | None = None  # the device tier's rank side, when device_buffer is on

    def take(self, step: int, state: Mapping[str, Any], local: list[int], wait_s: float = 0.0) -> bool:
        """Capture ``step`` into this node's agent; False when the agent skipped it (busy, and
        no slot freed within ``wait_s``). ``local``: the node's ranks (the agent sends the
        node's snapshot once every one of them captured)."""
        from memsnap.state import cuda_capture
        from memsnap.state.capture import copy_into, snapshot_view

        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r}: must be an int >= 0")
        layout, sources = self.plan.plan(state)
        begun = self.client.begin(step, layout.nbytes, wait_s)
        if begun.path is None:
            log.debug("rank %d: step %d skipped: %s", self.rank, step, begun.skipped)
            return False
        out = self.maps.view(begun.path, layout.nbytes)
        layout.meta.update(step=step, rank=self.rank, world_size=self.world, job=self.job)
        if self.device_options.on and self.device().save(step, layout, sources, local):
            return True  # device tier: D2D into the agent's buffer, which the agent drains
        if cuda_capture.needs_async(sources):
            self._take_cuda(step, layout, sources, out, begun.path, local)
            return True
        copy_into(layout, sources, snapshot_view(out, layout.nbytes, writable=True))
        self.client.captured(step, layout.to_json().decode(), local)
        return True

    def _take_cuda(self, step, layout, sources, out, path, local) -> None:
        """D2H on a side stream; the agent hears of the step once the copy is done."""
        from memsnap.state import cuda_capture

        if self._cuda is None:
            self._cuda = cuda_capture.SideStreamCapture()
            self._cuda.attach(self.optimizers)
        if path not in self._pins:
            self._pins[path] = cuda_capture.HostRegistration(out)
        manifest_json = layout.to_json().decode()
        self._cuda.start(layout, sources, out, on_done=lambda: self.client.captured_later(step, manifest_json, local))

    def device(self):
        """The device tier's rank side (``device.runtime.RankDevice``), made on first use."""
        if self._device is None:
            from memsnap.device.runtime import RankDevice

            self._device = RankDevice(self.client.handle, self.rank, self.device_options.backend, self.optimizers, get)
        return self._device

    def nbytes(self, state: Mapping[str, Any]) -> int:
        """How many bytes a snapshot of ``state`` takes (its layout, planned once)."""
        return self.plan.plan(state)[0].nbytes

    def drain(self) -> None:
        """Wait for a GPU copy in flight (the last snapshot before a preemption exit)."""
        if self._cuda is not None:
            self._cuda.wait()
        if self._device is not None:
            self._device.wait()

    def close(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
        if self._device is not None:
            self._device.close()
            self._device = None
        for pin in self._pins.values():
            pin.close()
        self._pins.clear()
