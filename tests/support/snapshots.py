"""Small durable snapshots for the storage tests: a manifest and its buffer, and a committed
step of them. (No tests here.)"""

from __future__ import annotations

import numpy as np

from memsnap.durable.storage import Store
from memsnap.state.checksum import checksum
from memsnap.state.manifest import Manifest, TensorEntry, align_up


def make_snapshot(seed: int, n: int = 1000) -> tuple[Manifest, bytearray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.integers(0, 1 << 30, size=7, dtype=np.int64)
    off_b = align_up(a.nbytes)
    buf = bytearray(align_up(off_b + b.nbytes))
    buf[: a.nbytes] = a.tobytes()
    buf[off_b : off_b + b.nbytes] = b.tobytes()
    tensors = [
        TensorEntry("w", "float32", (n,), 0, a.nbytes, checksum(a)),
        TensorEntry("b", "int64", (7,), off_b, b.nbytes, checksum(b)),
    ]
    return Manifest(tensors, {"w": {"__tensor__": 0}, "b": {"__tensor__": 1}}, len(buf)), buf


def save_step(store: Store, step: int, world: int = 1, meta: dict | None = None) -> list[bytearray]:
    bufs = []
    for rank in range(world):
        m, buf = make_snapshot(step * 10 + rank)
        store.write_rank(step, rank, m, buf)
        bufs.append(buf)
    store.commit(step, world, meta or {"step": step})
    return bufs
