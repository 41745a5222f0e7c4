"""The data plane: chunks between agents over direct TCP or Ray's object store."""
from __future__ import annotations

from memsnap.transport.base import ChunkKey, ChunkStore, Transport, make_transport

__all__ = ["ChunkKey", "ChunkStore", "Transport", "make_transport"]
