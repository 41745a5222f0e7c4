"""memsnap: erasure-coded in-memory snapshots of a training job's whole state.

The packages follow a snapshot's path (each package's docstring names its modules):

    rank/        the user's side: Snapshotter (save, restore, status), its save path, its load
                 tiers (rank/load.py), every call it makes to its node's agent (client.py) and
                 the recovery loop of a rank that recovers in place (member.py)
    state/       what a snapshot is: the state captured into flat bytes and a manifest
                 (capture.py), read back into the live objects (apply.py), RNGs, checks
    coding/      how the bytes survive lost nodes: stripes, Reed-Solomon parity (codec.py with
                 native/, encode.py), and reading them back from peers (restore.py, receive.py)
    transport/   chunks between nodes: authenticated TCP, or Ray's object store
    node/        the agent, one per node: its version table, arena slots, sends to holders,
                 the pieces it holds for peers, repairs, the relay to the coordinator, the spill
    job/         the coordinator: membership and placement, the two-phase commit, the restore
                 decision (coverage.py), liveness and re-protection
    durable/     the disk format (save, load) and the storage it spills to (pyarrow.fs)
    collective/  the process group that outlives a lost peer: re-formed per generation,
                 heartbeats, DDP and FSDP2 on it, the live takeover
    inplace/     recovery in place, the job's side: InplaceJob decides, fences, re-forms
    device/      the device tier (CUDA IPC buffers) and Reed-Solomon on the GPU
    memory/      host memory the agent owns: shared-memory arenas, their directory, pinning

Beside them: records.py (the typed records the rank, agents and coordinator exchange),
actors/ (the agent's and the coordinator's Ray faces),
options.py and config.py (options and tunables), commands/ (the CLI), chaos/, demo/.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public names, imported on first use so that importing memsnap stays cheap and a module
# that is broken or absent does not take the others down.
_LAZY = {
    "ReedSolomon": "memsnap.coding.codec",
    "save": "memsnap.durable.checkpoint",
    "load": "memsnap.durable.checkpoint",
    "Snapshotter": "memsnap.rank.snapshotter",
    "start_spare": "memsnap.rank.job",
    "shutdown": "memsnap.rank.job",
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
