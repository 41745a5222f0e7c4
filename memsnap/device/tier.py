"""The device tier's protocol: the agent's side (``AgentTier``) and a rank's side (``RankTier``).

One buffer per local rank per device, allocated by the agent and opened once by the rank.
The states of a rank's buffer, kept by the agent:

    empty --begin(step)--> writing --captured(step, manifest)--> held --drain(out)--> drained
      ^                                                                                 |
      +---------------------------- begin(next step) ----------------------------------+

* ``begin`` hands the rank the buffer's handle and marks it ``writing``: whatever it held is
  no longer a snapshot (a rank that dies mid-copy leaves a buffer nobody restores from). It
  refuses (returns None: skip this snapshot) while the previous capture is not drained yet.
* ``captured`` is called once the rank's copies are done (its side stream's event): from
  then on the bytes are the agent's; the rank may crash and nothing is lost.
* ``drain`` copies the buffer into the agent's host arena, from the agent's process; the
  existing encode/send/commit path continues from there.
* ``source(rank, step)`` serves a restore of a crashed rank from the buffer (tier
  ``device``, ahead of ``local``) while it still holds ``step``.

The rank's calls: ``RankTier.capture`` (enqueue the copies; False when the tier is refused
here, e.g. CUDA IPC is not allowed, and the caller takes the side-stream D2H path),
``RankTier.wait`` (before the optimizer step), ``RankTier.restore``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memsnap.device.backend import Backend, BufferHandle, DeviceBuffer
from memsnap.errors import DeviceError, MemoryBudgetError
from memsnap.state import apply as apply_mod
from memsnap.state.capture import tensor_view
from memsnap.state.dtypes import dtype_of
from memsnap.state.manifest import Manifest, align_up

log = logging.getLogger("memsnap")


@dataclass
class _Slot:
    buffer: DeviceBuffer
    state: str = "empty"  # empty | writing | held | drained
    step: int | None = None
    manifest: str | None = None  # JSON, as the rank sent it


class AgentTier:
    """(agent) The device buffers of this node's ranks, at most ``budget`` bytes in all."""

    def __init__(self, backend: Backend, budget: int, prefix: str = "memsnap-dev"):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise DeviceError(f"device buffer budget={budget!r}: must be a positive int of bytes")
        self.backend, self.budget, self.prefix = backend, budget, prefix
        self._slots: dict[tuple[int, str], _Slot] = {}
        self._gen = 0
        self._stream: dict[str, Any] = {}

    @property
    def used(self) -> int:
        return sum(s.buffer.nbytes for s in self._slots.values())

    def begin(self, rank: int, device: str, step: int, nbytes: int) -> BufferHandle | None:
        """The handle ``rank`` captures ``step`` into (a buffer of at least ``nbytes`` on
        ``device``, allocated now if it has none that large); None while its last capture
        is not drained. MemoryBudgetError when ``nbytes`` does not fit the budget."""
        key = (rank, device)
        slot = self._slots.get(key)
        if slot is not None and slot.state == "held":
            return None
        if slot is None or slot.buffer.nbytes < nbytes:
            slot = self._allocate(key, nbytes, slot)
        slot.state, slot.step, slot.manifest = "writing", step, None
        return slot.buffer.handle

    def _allocate(self, key: tuple[int, str], nbytes: int, old: _Slot | None) -> _Slot:
        freed = old.buffer.nbytes if old is not None else 0
        if self.used - freed + nbytes > self.budget:
            raise MemoryBudgetError(
                f"rank {key[0]}'s device buffer needs {nbytes} bytes on {key[1]}, but only "
                f"{self.budget - self.used + freed} of the device budget {self.budget} are free; raise "
                "device_buffer (bytes per node) or set device_buffer=False"
            )
        if old is not None:
            old.buffer.close()
            del self._slots[key]
        self._gen += 1
        buf = self.backend.allocate(key[1], nbytes, f"{self.prefix}-r{key[0]}-sdev-g{self._gen}")
        slot = _Slot(buf)
        self._slots[key] = slot
        return slot

    def captured(self, rank: int, device: str, step: int, manifest_json: str) -> None:
        """``rank``'s copies of ``step`` are done: the buffer holds it (and ``manifest_json``)."""
        slot = self._slot(rank, device)
        if slot.state != "writing" or slot.step != step:
            raise DeviceError(
                f"rank {rank} reported step {step} captured on {device}, but its device buffer "
                f"is {slot.state} for step {slot.step}; call begin first"
            )
        slot.state, slot.manifest = "held", manifest_json

    def drain(self, rank: int, device: str, out: memoryview | torch.Tensor) -> Manifest:
        """Copy the captured bytes into the host buffer ``out`` (from this process; pin it once
        with ``memsnap.memory.pinning`` for DMA speed) and return the manifest."""
        slot = self._slot(rank, device)
        if slot.state not in ("held", "drained"):
            raise DeviceError(f"rank {rank}'s device buffer on {device} is {slot.state}: nothing to drain")
        assert slot.manifest is not None  # held: the rank sent it
        manifest = Manifest.from_json(slot.manifest, f"rank {rank}'s device manifest")
        n = manifest.nbytes
        if n:
            dst = out if isinstance(out, torch.Tensor) else _host_tensor(out, n)
            stream = self._stream_for(device)
            stream.copy(dst[:n], slot.buffer.tensor[:n])
            stream.synchronize()
        slot.state = "drained"
        return manifest

    def _stream_for(self, device: str):
        if device not in self._stream:
            self._stream[device] = self.backend.stream(device)
        return self._stream[device]

    def holds(self, rank: int, device: str) -> int | None:
        """The step ``rank``'s buffer on ``device`` holds whole, or None."""
        slot = self._slots.get((rank, device))
        return slot.step if slot is not None and slot.state in ("held", "drained") else None

    def source(self, rank: int, device: str, step: int) -> tuple[str, BufferHandle] | None:
        """``(manifest JSON, handle)`` to restore ``rank``'s ``step`` from, or None (another
        step, or a capture was started since: tier ``local`` serves it then)."""
        if self.holds(rank, device) != step:
            return None
        slot = self._slots[(rank, device)]
        assert slot.manifest is not None  # held: the rank sent it
        return slot.manifest, slot.buffer.handle

    def release(self, rank: int) -> None:
        """Free every buffer of ``rank`` (it left the job)."""
        for key in [k for k in self._slots if k[0] == rank]:
            self._slots.pop(key).buffer.close()

    def close(self) -> None:
        for slot in self._slots.values():
            slot.buffer.close()
        self._slots.clear()

    def _slot(self, rank: int, device: str) -> _Slot:
        slot = self._slots.get((rank, device))
        if slot is None:
            raise DeviceError(f"rank {rank} has no device buffer on {device}")
        return slot


def _host_tensor(out: memoryview, n: int) -> torch.Tensor:
    mv = memoryview(out).cast("B")
    if mv.readonly or mv.nbytes < n:
        raise DeviceError(
            f"drain needs a writable host buffer of at least {n} bytes, got "
            f"{mv.nbytes}{' (read-only)' if mv.readonly else ''}"
        )
    import numpy as np

    return torch.from_numpy(np.frombuffer(mv, dtype=np.uint8, count=n))


class RankTier:
    """(rank) Opens the agent's buffers once, captures into them, restores from them."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._open: dict[str, DeviceBuffer] = {}  # token -> mapping, kept for the process's life
        self._streams: dict[str, Any] = {}
        self._event: tuple[Any, Any] | None = None
        self._on_done: Any = None
        self._hooks: list = []
        self.refused: str | None = None  # why the tier cannot run here (then: side-stream D2H)
        self.opens = 0  # handles opened (once per buffer, never per snapshot)

    def buffer(self, handle: BufferHandle) -> DeviceBuffer:
        """The mapping of ``handle``, opened on first use; a new generation replaces the old."""
        buf = self._open.get(handle.token)
        if buf is not None and buf.handle == handle:
            return buf
        if buf is not None:
            buf.close()
        buf = self.backend.open(handle)
        self.opens += 1
        self._open[handle.token] = buf
        return buf

    def attach(self, optimizers) -> None:
        """Make each optimizer's step wait for the copies in flight (a step pre-hook), so a
        snapshot holds exactly the state of the step it was taken at."""
        for opt in optimizers:
            self._hooks.append(opt.register_step_pre_hook(lambda *_: self.wait()))

    def capture(
        self, handle: BufferHandle, manifest: Manifest, sources: list[torch.Tensor], on_done: Any = None
    ) -> bool:
        """Enqueue the copies of ``sources`` (laid out by ``manifest``) into the buffer and
        return True; ``on_done()`` runs once they are done (in ``wait``: tell the agent
        ``captured`` there). False, with ``refused`` saying why, when this process cannot
        open the buffer: the caller takes the side-stream D2H path then."""
        self.wait()
        if manifest.nbytes > handle.nbytes:
            raise DeviceError(
                f"the snapshot needs {manifest.nbytes} bytes but the device buffer holds "
                f"{handle.nbytes}; ask the agent for a larger one (begin with nbytes)"
            )
        try:
            buf = self.buffer(handle)
        except DeviceError as exc:
            if self.refused is None:
                log.warning("memsnap: device tier refused here, using side-stream D2H instead: %s", exc)
            self.refused = str(exc)
            return False
        base = buf.tensor
        stream = self._stream_for(handle.device)
        with stream:
            for entry, src in zip(manifest.tensors, sources):
                if entry.alias_of is not None or not entry.nbytes:
                    continue
                stream.copy(tensor_view(base, entry, src.dtype), src.detach())
                end = entry.offset + entry.nbytes
                if align_up(end) > end:  # padding: zeros, never stale bytes
                    stream.copy(base[end : align_up(end)], _zeros(align_up(end) - end, base.device))
            self._event = (stream, stream.record())
        self._on_done = on_done
        return True

    def pending(self) -> bool:
        return self._event is not None

    def wait(self) -> None:
        """Block until the last capture's copies are done (the optimizer pre-hook calls it),
        then run its ``on_done`` once."""
        if self._event is not None:
            stream, event = self._event
            self._event = None
            stream.wait(event)
            done, self._on_done = self._on_done, None
            if done is not None:
                done()

    def restore(
        self,
        state: Mapping[str, Any],
        manifest_json: str,
        handle: BufferHandle,
        *,
        verify: bool = True,
        rng: bool = True,
    ) -> Manifest:
        """Copy the snapshot in the agent's buffer back into ``state`` (D2D for CUDA tensors),
        all or nothing: the manifest is matched against the live state before a byte moves;
        with ``verify`` the checksums are checked where the buffer is host memory."""
        manifest = Manifest.from_json(manifest_json, "device manifest")
        plan = apply_mod.plan(state, manifest, rng=rng)
        buf = self.buffer(handle)
        host = buf.host_view()
        if verify and host is not None:
            apply_mod.verify_checksums(manifest, host[: manifest.nbytes])
        received = {}
        for i, e in enumerate(manifest.tensors):
            if e.alias_of is None and e.nbytes:
                view = tensor_view(buf.tensor, e, dtype_of(e.dtype))
                # a tensor captured from host memory (RNG states, CPU extras) comes back on the host
                received[i] = view.cpu() if view.is_cuda and e.device == "cpu" else view
        apply_mod.apply_received(state, plan, received, set(received))
        return manifest

    def close(self) -> None:
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for buf in self._open.values():
            buf.close()
        self._open.clear()

    def _stream_for(self, device: str):
        if device not in self._streams:
            self._streams[device] = self.backend.stream(device)
        return self._streams[device]


_ZEROS: dict[tuple[str, int], torch.Tensor] = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    key = (str(device), n)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(n, dtype=torch.uint8, device=device)
    return _ZEROS[key]
