"""memsnap: erasure-coded in-memory snapshots of a training job's whole state.

The data path, one module per stage:

    capture.py / rng.py / sampler.py    state -> manifest.py + flat bytes (the state layer)
    codec.py (+ native/)                bytes -> Reed-Solomon chunks
    stripes.py / placement.py           which bytes go to which node
    transport/                          chunks between agents (TCP, Ray object store)
    agent.py / coordinator.py           RAM holding and the two-phase commit
    durable.py                          memsnap's on-disk / object-store format (spill)
    restore.py / snapshotter.py         the user-facing save/restore
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public names, imported on first use so that importing memsnap stays cheap and a module
# that is broken or absent does not take the others down.
_LAZY = {
    "ReedSolomon": "memsnap.codec",
    "save": "memsnap.durable",
    "load": "memsnap.durable",
    "Snapshotter": "memsnap.snapshotter",
    "start_spare": "memsnap.snapshotter",
    "shutdown": "memsnap.snapshotter",
    "ResumableSampler": "memsnap.sampler",
    "ResumableLoader": "memsnap.sampler",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'memsnap' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
