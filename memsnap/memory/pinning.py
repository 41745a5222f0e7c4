"""Page-locking (pinning) host memory for CUDA once per arena, never per snapshot.

``register(buf)`` calls ``cudaHostRegister`` (through ``torch.cuda.cudart()``; flag
``cudaHostRegisterPortable``, so every CUDA context of the process sees it) on the whole
buffer and returns a ``Registration`` that says whether it worked and, if not, why:

* no CUDA device (a CPU-only install, an agent that sees no GPU): nothing is called;
  ``pinned`` is False and ``reason`` says so. Copies stay correct, only synchronous.
* CUDA refuses (a sandboxed kernel, a locked-memory limit, a filesystem it cannot pin):
  logged once with the error; D2H copies into the buffer then run synchronously, staging
  through the driver's own pinned buffers.

Registration pins the pages the buffer has now. Whoever punches holes in the buffer
(``Arena.release``) must ``close`` the registration first and register again once the pages
are back, or DMA would keep writing the old, orphaned pages (``memsnap.memory.arena`` does this).
NOT YET RUN ON A GPU: the CUDA calls are the ones ``memsnap.state.cuda_capture`` made before; the
no-CUDA path is what the tests run.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("memsnap")

PORTABLE = 1  # cudaHostRegisterPortable


def cuda_ready() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover (torch is a dependency)
        return False
    return torch.cuda.is_available()


class Registration:
    """One ``cudaHostRegister`` of a host buffer, undone by ``close``."""

    def __init__(self, address: int, nbytes: int, pinned: bool, reason: str):
        self.address, self.nbytes, self.pinned, self.reason = address, nbytes, pinned, reason

    def close(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
            self.reason = "unregistered"

    def __repr__(self) -> str:
        return f"Registration({self.nbytes} bytes at {self.address:#x}, pinned={self.pinned}, {self.reason!r})"


def register(buf) -> Registration:
    """Pin the whole of ``buf`` (anything with a writable buffer) for CUDA, or say why not."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    address, nbytes = (arr.ctypes.data, arr.nbytes) if arr.nbytes else (0, 0)
    if not nbytes:
        return Registration(0, 0, False, "empty buffer: nothing to pin")
    if not cuda_ready():
        return Registration(address, nbytes, False, "no CUDA device: not pinned (copies stay synchronous)")
    import torch

    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, PORTABLE)
    if int(err) != 0:
        reason = f"cudaHostRegister refused ({err}): D2H copies into this buffer will be synchronous"
        log.warning("memsnap: %s", reason)
        return Registration(address, nbytes, False, reason)
    return Registration(address, nbytes, True, "pinned")
