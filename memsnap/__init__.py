"""memsnap: erasure-coded in-memory snapshots of a training job's whole state.

The data path, one module per stage:

    capture.py / rng.py / sampler.py    state -> manifest.py + flat bytes (the state layer)
    validate.py                         every manifest, skeleton, marker and frame header checked
    arena.py / shmdir.py                the agent's shared memory the ranks capture into
    codec.py (+ native/) / encode.py    bytes -> stripes -> Reed-Solomon chunks
    stripes.py / placement.py           which bytes form which chunk (ChunkKey), which node holds it
    buffers.py                          flat byte views, a destination in pieces (Scatter)
    transport/                          chunks between agents (authenticated TCP, Ray object store)
    chunkstore.py                       the chunks an agent holds for its peers
    versions.py / slots.py              an agent's version table (states, lean-mode policy), its arena slots
    sender.py / repair.py               an agent's sends, its repairs (agent.py composes them all)
    durable.py / storage.py / spill.py  memsnap's on-disk / object-store format, and the spill
    lineage.py / localfs.py             a root's commit history and retention; safe local file I/O
    restore.py / receive.py             bytes back from the peers, straight into the live tensors
    elastic.py / reshard.py             a step taken by another world size, resharded (RAM / disk)

The control plane (ranks -> their node's agent -> the coordinator, once per node):

    rank/ / options.py                  the user-facing save / restore / status (rank/snapshotter.py:
                                        the API; save.py, load.py: the capture and the load tiers;
                                        client.py: every call to the node's agent), and its options
    relay.py                            a node's ranks' calls toward the coordinator
    coordinator.py                      membership.py, commit.py, rounds.py, reprotect.py, coverage.py
    liveness.py                         memsnap's own verdict on a node (the agents' heartbeats)
    records.py                          the typed records they exchange
    actors.py                           both Ray faces (asyncio actors)
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
