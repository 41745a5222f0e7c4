"""The device-buffer backend interface: memory the agent owns on a device, shared with a rank.

A backend gives three things, the same for the CPU stand-in (``memsnap.device.cpu``) and
CUDA (``memsnap.device.cuda``):

* ``DeviceBuffer``: one plain allocation (never a sub-allocation of a pool, so the handle
  that shares it names exactly it), seen in this process as a flat ``uint8`` torch tensor;
* ``BufferHandle``: what shares it with another process, a small frozen record that
  travels as JSON (no pickle);
* ``CopyStream``: where copies into or out of a buffer are enqueued (a CUDA side stream;
  on the CPU backend copies run at once) and how they are waited for.

Call protocol (one buffer per local rank per device; ``memsnap.device.tier`` drives it):

  1. (agent)  ``buf = backend.allocate(device, nbytes, name)``; ``buf.handle`` goes to the rank.
  2. (rank)   ``mine = backend.open(handle)`` once, cached: opening is slow (a CUDA IPC open
              maps the allocation into this process), never per snapshot.
  3. (rank)   capture: ``stream.copy(view_of(mine), src)`` for every tensor, ``stream.record()``,
              and ``stream.wait(event)`` before the optimizer changes the sources.
  4. (agent)  drain: ``stream.copy(host_tensor, buf.tensor[:n])``, then ``stream.synchronize()``,
              from the agent's own process (the rank may be gone by then).
  5. (rank)   restore after a crash: a new process opens the handle and copies back.
  6. (rank)   ``mine.close()`` unmaps; (agent) ``buf.close()`` frees. The agent must outlive
              every rank's mapping of its buffers (CUDA frees an IPC-shared allocation only
              after every importer closed it; a crashed importer's mapping dies with it).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch

from memsnap.errors import DeviceError


@dataclass(frozen=True)
class BufferHandle:
    """A shareable name of one device buffer. ``backend``: ``"cpu"`` or ``"cuda"``;
    ``device``: which device holds it (``"cpu"``, or a CUDA device's UUID, which does not
    depend on ``CUDA_VISIBLE_DEVICES``); ``token``: the backend's handle (an arena path, or
    the 64-byte ``cudaIpcMemHandle_t`` in hex); ``generation`` changes when the agent
    allocates the rank's buffer again (a rank drops its cached mapping then)."""

    backend: str
    device: str
    nbytes: int
    token: str
    generation: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> BufferHandle:
        try:
            doc = json.loads(raw)
            handle = cls(**doc)
        except (TypeError, ValueError) as exc:
            raise DeviceError(f"malformed device buffer handle {raw!r:.200}: {exc}") from None
        if not isinstance(handle.nbytes, int) or handle.nbytes < 0 or not isinstance(handle.token, str):
            raise DeviceError(
                f"malformed device buffer handle {raw!r:.200}: nbytes must be an int >= 0 and token a str"
            )
        return handle


class DeviceBuffer(ABC):
    """One allocation on a device, owned (``owner=True``, the agent) or opened from a handle."""

    handle: BufferHandle
    owner: bool

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes

    @property
    @abstractmethod
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a flat ``uint8`` tensor on its device (no copy)."""

    def host_view(self) -> memoryview | None:
        """The buffer's bytes as host memory, when the backend's device memory is host memory
        (the CPU backend); None otherwise."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Free (owner) or unmap (opener); idempotent."""


class CopyStream(ABC):
    """Copies enqueued in order; ``record`` marks a point, ``wait`` blocks the host until it."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` (same shape and dtype)."""

    @abstractmethod
    def record(self) -> Any:
        """A marker after every copy enqueued so far."""

    @abstractmethod
    def wait(self, event: Any) -> None:
        """Block until every copy before ``event`` is done."""

    def synchronize(self) -> None:
        self.wait(self.record())

    def __enter__(self) -> CopyStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class Backend(ABC):
    """Allocates, shares and opens device buffers of one kind."""

    name: str

    @abstractmethod
    def device_of(self, t: torch.Tensor) -> str:
        """The id (as in ``BufferHandle.device``) of the device tensor ``t`` lives on."""

    @abstractmethod
    def allocate(self, device: str, nbytes: int, name: str) -> DeviceBuffer:
        """(agent) A new buffer of ``nbytes`` on ``device``; ``name`` is unique per rank and
        generation (the CPU backend names its shared-memory file by it)."""

    @abstractmethod
    def open(self, handle: BufferHandle) -> DeviceBuffer:
        """(rank) Map the buffer ``handle`` names into this process; DeviceError if refused."""

    @abstractmethod
    def stream(self, device: str) -> CopyStream:
        """A copy stream on ``device`` that does not wait for the training loop's work."""

    def check(self, handle: BufferHandle) -> None:
        if handle.backend != self.name:
            raise DeviceError(
                f"a {handle.backend!r} device buffer handle was given to the {self.name!r} "
                "backend; the agent and its ranks must use the same device backend"
            )
