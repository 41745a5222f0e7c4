"""The device tier: agent-owned device buffers that ranks capture into (opt-in).

``backend.py`` is the interface, ``cpu.py`` the shared-memory stand-in that runs everywhere,
``cuda.py`` the CUDA IPC implementation (needs CuPy: ``memsnap[gpu]``), ``tier.py`` the
protocol both sides of it follow, ``gf_ref.py`` and ``cupy_rs.py`` the Reed-Solomon code on the
device. Nothing here imports CuPy until a CUDA buffer or kernel is asked for. (Page-locking host
arenas for CUDA copies is ``memsnap.memory.pinning``.)
"""

from __future__ import annotations

from memsnap.device.backend import Backend, BufferHandle, CopyStream, DeviceBuffer
from memsnap.errors import DeviceError

__all__ = ["Backend", "BufferHandle", "CopyStream", "DeviceBuffer", "DeviceError", "backend"]


def backend(kind: str = "auto", **kwargs) -> Backend:
    """A backend by name: ``"cpu"``, ``"cuda"`` (needs CuPy: DeviceError naming the fix
    without it), or ``"auto"`` (cuda when torch sees a device, else cpu)."""
    if kind == "auto":
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        from memsnap.device.cpu import CpuBackend

        return CpuBackend(**kwargs)
    if kind == "cuda":
        from memsnap.device.cuda import CudaBackend

        return CudaBackend(**kwargs)
    raise DeviceError(f"device backend {kind!r}: use 'cpu', 'cuda' or 'auto'")
