"""The CUDA backend: device buffers are plain ``cudaMalloc`` allocations shared by CUDA IPC.

NOT YET RUN ON A GPU: written against the CUDA runtime API and CuPy's bindings of it, and
never executed (the machines it was written on have no GPU). ``bench/gpu.py`` and the
``gpu``-marked tests exercise it on the first machine with one.

* ``allocate`` calls ``cudaMalloc`` through ``cupy.cuda.runtime.malloc`` (not CuPy's or
  torch's memory pool: a pool sub-allocation's IPC handle names the whole pool segment, and
  the pool may hand the rest of it to someone else), then ``cudaIpcGetMemHandle``.
* ``open`` calls ``cudaIpcOpenMemHandle`` (with ``cudaIpcMemLazyEnablePeerAccess``) on the
  device whose UUID the handle names, looked up among the devices this process sees (a Ray
  rank sees its GPU as ``cuda:0``; the agent sees all of them). A refusal (a sandboxed
  kernel, a container without ``--ipc=host``, MIG) raises ``DeviceError`` and the caller
  falls back to the side-stream D2H path (``memsnap.state.cuda_capture``).
* Buffers are seen by torch through ``__cuda_array_interface__`` (``torch.as_tensor``), so
  every copy is torch's ``copy_`` on a torch side stream.

CuPy is imported only when this backend is used (``pip install memsnap[gpu]``).
"""

from __future__ import annotations

from typing import Any

import torch

from memsnap.device.backend import Backend, BufferHandle, CopyStream, DeviceBuffer
from memsnap.errors import DeviceError

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def _runtime() -> Any:
    try:
        import cupy.cuda.runtime as rt  # noqa: PLC0415 (optional extra, imported on use)
    except ImportError:
        raise DeviceError(
            "the CUDA device tier needs CuPy: pip install 'memsnap[gpu]' (cupy-cuda12x); "
            "without it use the side-stream D2H capture (device_buffer=False)"
        ) from None
    return rt


def device_uuid(ordinal: int) -> str:
    """The UUID of the CUDA device this process calls ``cuda:ordinal``."""
    return str(torch.cuda.get_device_properties(ordinal).uuid)


def ordinal_of(uuid: str) -> int:
    """The index under which this process sees the device ``uuid``; DeviceError if it cannot
    see it (``CUDA_VISIBLE_DEVICES`` hides it: see ``memsnap.device.visibility``)."""
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in seen:
        raise DeviceError(
            f"CUDA device {uuid} is not visible to this process (it sees {seen}); "
            "the node's agent must see every GPU: see memsnap.device.visibility"
        )
    return seen.index(uuid)


class _Interface:
    """A raw device range as ``__cuda_array_interface__`` (v3), for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class CudaBuffer(DeviceBuffer):
    def __init__(self, handle: BufferHandle, ptr: int, ordinal: int, owner: bool):
        self.handle, self.owner, self.ordinal = handle, owner, ordinal
        self.ptr: int | None = ptr  # None once closed
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            if self.ptr is None:
                raise RuntimeError("this device buffer is closed")
            self._tensor = torch.as_tensor(_Interface(self.ptr, self.nbytes), device=f"cuda:{self.ordinal}")
        return self._tensor

    def close(self) -> None:
        if self.ptr is None:
            return
        self._tensor = None
        torch.cuda.synchronize(self.ordinal)  # no copy may still run on the range
        rt = _runtime()
        with _on(self.ordinal):
            if self.owner:
                rt.free(self.ptr)
            else:
                rt.ipcCloseMemHandle(self.ptr)
        self.ptr = None


class _on:
    """``cudaSetDevice`` for the block, for CuPy's runtime calls (torch keeps its own)."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal

    def __enter__(self) -> None:
        import cupy  # noqa: PLC0415

        self._ctx = cupy.cuda.Device(self.ordinal)
        self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


class CudaStream(CopyStream):
    """A torch side stream: copies on it overlap the training loop's kernels."""

    def __init__(self, ordinal: int):
        self.stream = torch.cuda.Stream(device=ordinal)

    def __enter__(self) -> CudaStream:
        # start after the work already queued on the caller's stream (the tensors' last writes)
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return self

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self.stream)  # the allocator must not reuse it mid-copy
            dst.copy_(src, non_blocking=True)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise DeviceError(
                "the cuda device backend needs a CUDA device; this process sees none "
                f"(CUDA_VISIBLE_DEVICES={_visible()!r})"
            )
        _runtime()

    def device_of(self, t: torch.Tensor) -> str:
        if not t.is_cuda:
            raise DeviceError(f"tensor on {t.device} is not on a CUDA device")
        return device_uuid(t.device.index if t.device.index is not None else torch.cuda.current_device())

    def allocate(self, device: str, nbytes: int, name: str) -> CudaBuffer:
        rt, ordinal = _runtime(), ordinal_of(device)
        with _on(ordinal):
            try:
                ptr = rt.malloc(max(nbytes, 1))
            except Exception as exc:  # cupy raises CUDARuntimeError
                raise DeviceError(
                    f"cudaMalloc of {nbytes} bytes on {device} for {name} failed: {exc}; lower the device buffer budget"
                ) from None
            try:
                raw = bytes(rt.ipcGetMemHandle(ptr))
            except Exception as exc:
                rt.free(ptr)
                raise DeviceError(
                    f"cudaIpcGetMemHandle refused ({exc}): CUDA IPC is not available here; "
                    "the side-stream D2H capture is used instead"
                ) from None
        if len(raw) != IPC_HANDLE_BYTES:
            raise DeviceError(f"cudaIpcGetMemHandle returned {len(raw)} bytes, expected {IPC_HANDLE_BYTES}")
        return CudaBuffer(BufferHandle("cuda", device, nbytes, raw.hex()), ptr, ordinal, owner=True)

    def open(self, handle: BufferHandle) -> CudaBuffer:
        self.check(handle)
        rt, ordinal = _runtime(), ordinal_of(handle.device)
        try:
            raw = bytes.fromhex(handle.token)
        except ValueError:
            raise DeviceError(f"device buffer handle token is not hex: {handle.token!r:.80}") from None
        if len(raw) != IPC_HANDLE_BYTES:
            raise DeviceError(f"device buffer handle holds {len(raw)} bytes, a CUDA IPC handle {IPC_HANDLE_BYTES}")
        with _on(ordinal):
            try:
                ptr = rt.ipcOpenMemHandle(raw, rt.cudaIpcMemLazyEnablePeerAccess)
            except Exception as exc:
                raise DeviceError(
                    f"cudaIpcOpenMemHandle refused ({exc}): CUDA IPC is not available "
                    "between these processes; the side-stream D2H capture is used instead"
                ) from None
        return CudaBuffer(handle, ptr, ordinal, owner=False)

    def stream(self, device: str) -> CudaStream:
        return CudaStream(ordinal_of(device))


def _visible() -> str | None:
    import os  # noqa: PLC0415

    return os.environ.get("CUDA_VISIBLE_DEVICES")
