"""Capture of CUDA tensors without stalling the training loop.

``save`` starts the device-to-host copies on a side stream into pinned host memory and
returns; the copies overlap the next forward/backward. Before the optimizer changes any
parameter, a step pre-hook (``Optimizer.register_step_pre_hook``) waits for them, so the
snapshot holds exactly the state of the step it was taken at. Then ``on_done`` runs (the
Snapshotter hands the captured bytes to its agent there).

The shared-memory arena the bytes land in is page-locked once with ``cudaHostRegister``, so
the copies are truly asynchronous DMA. Without CUDA this module imports cleanly and
``available()`` is False; the CPU capture path in ``capture.py`` is used instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from memsnap.state.capture import tensor_view
from memsnap.state.manifest import Manifest

log = logging.getLogger("memsnap")


def available() -> bool:
    return torch.cuda.is_available()


def needs_async(sources: Iterable[torch.Tensor]) -> bool:
    """True when any tensor to capture lives on a CUDA device."""
    return available() and any(t.is_cuda for t in sources)


class HostRegistration:
    """Page-locks (pins) a host buffer for the lifetime of this object (once per mapping,
    never per snapshot); ``pinned`` False and ``reason`` say when CUDA refused it."""

    def __init__(self, buf: memoryview):
        from memsnap.memory import pinning

        self._reg = pinning.register(buf)
        self.pinned, self.reason = self._reg.pinned, self._reg.reason

    def close(self) -> None:
        self._reg.close()
        self.pinned = False


class SideStreamCapture:
    """At most one snapshot's D2H copies in flight, finished before the next optimizer step.

    Protocol (training thread only):
      1. ``attach(optimizers)`` once: installs the step pre-hooks.
      2. ``start(manifest, sources, out, on_done)`` in ``save``: enqueues the copies, returns.
      3. ``wait()`` — called by the pre-hook, by the next ``start`` and by ``close`` — blocks
         until the copies are done, then calls ``on_done()`` exactly once.
    """

    def __init__(self, device: torch.device | None = None):
        self.stream = torch.cuda.Stream(device=device)
        self._event: torch.cuda.Event | None = None
        self._on_done: Callable[[], None] | None = None
        self._hooks: list = []

    def attach(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            self._hooks.append(opt.register_step_pre_hook(lambda *_: self.wait()))

    def start(
        self, manifest: Manifest, sources: list[torch.Tensor], out: memoryview, on_done: Callable[[], None]
    ) -> None:
        self.wait()
        base = torch.frombuffer(out, dtype=torch.uint8, count=manifest.nbytes) if manifest.nbytes else None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for entry, src in zip(manifest.tensors, sources):
                if entry.alias_of is not None or not entry.nbytes:
                    continue
                assert base is not None  # a tensor with bytes: the manifest has some
                if src.is_cuda:
                    src.record_stream(self.stream)  # the allocator must not reuse it mid-copy
                tensor_view(base, entry, src.dtype).copy_(src, non_blocking=src.is_cuda)
            self._event = torch.cuda.Event()
            self._event.record(self.stream)
        self._on_done = on_done

    def pending(self) -> bool:
        return self._event is not None

    def wait(self) -> None:
        if self._event is None:
            return
        self._event.synchronize()
        self._event, done, self._on_done = None, self._on_done, None
        if done is not None:
            done()

    def close(self) -> None:
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
