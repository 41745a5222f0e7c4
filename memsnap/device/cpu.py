"""The CPU backend: shared memory stands in for device memory, so the device tier's protocol
(allocate, share, capture, drain, crash, restore) runs and is tested on any machine.

A buffer is an agent-owned ``memsnap.memory.arena.Arena`` (a private /dev/shm file under the
owner's ``flock``, swept if the agent dies); its handle's token is the file's path, and
``open`` attaches to it. Copies run at once (there is no device to overlap with).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from memsnap import naming
from memsnap.device.backend import Backend, BufferHandle, CopyStream, DeviceBuffer
from memsnap.errors import DeviceError
from memsnap.memory.arena import Arena


class CpuBuffer(DeviceBuffer):
    def __init__(self, handle: BufferHandle, arena: Arena, owner: bool):
        self.handle, self.owner, self._arena = handle, owner, arena
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            if self.nbytes == 0:
                self._tensor = torch.empty(0, dtype=torch.uint8)
            else:
                with warnings.catch_warnings():  # the arena is writable; torch warns for any buffer
                    warnings.simplefilter("ignore", UserWarning)
                    self._tensor = torch.frombuffer(self._arena.view(), dtype=torch.uint8)
        return self._tensor

    def host_view(self) -> memoryview:
        return self._arena.view()

    def close(self) -> None:
        self._tensor = None
        self._arena.close()


class CpuStream(CopyStream):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        return None


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, directory: str | None = None):
        self.directory = directory  # None: this user's private arena directory (naming.arena_dir)

    def device_of(self, t: torch.Tensor) -> str:
        return "cpu"

    def allocate(self, device: str, nbytes: int, name: str) -> CpuBuffer:
        if device != "cpu":
            raise DeviceError(f"the cpu device backend has only device 'cpu', not {device!r}")
        if os.sep in name or not name:
            raise DeviceError(f"device buffer name {name!r} must be a plain file name")
        path = os.path.join(self.directory or naming.arena_dir(), name)
        arena = Arena.create(path, nbytes)
        return CpuBuffer(BufferHandle("cpu", "cpu", nbytes, path), arena, owner=True)

    def open(self, handle: BufferHandle) -> CpuBuffer:
        self.check(handle)
        try:
            arena = Arena.attach(handle.token, handle.nbytes)
        except (OSError, ValueError) as exc:
            raise DeviceError(f"cannot open device buffer {handle.token}: {exc}") from None
        return CpuBuffer(handle, arena, owner=False)

    def stream(self, device: str) -> CpuStream:
        return CpuStream()
