"""The data plane: chunks between agents over direct TCP or Ray's object store."""

from __future__ import annotations

from memsnap.transport.base import ChunkKey, ChunkStore, Transport

__all__ = ["ChunkKey", "ChunkStore", "Transport", "make_transport"]


def make_transport(name: str, *, secret: bytes, host: str, **opts) -> Transport:
    """The transport called ``name`` ("tcp" or "objstore") for an agent on ``host``.

    ``secret`` is the per-job key from which every TCP connection's handshake and frame keys
    derive; ``host`` is the address to bind (the runtime passes Ray's node IP). TCP options:
    ``wire`` ("mac": every frame authenticated; "encrypt": also encrypted; default from the
    ``tcp_encrypt`` tunable), ``max_chunk`` (the largest chunk a peer may send), ``port``,
    ``window``.
    """
    if name == "tcp":
        from memsnap.transport.tcp import TcpTransport

        return TcpTransport(secret=secret, host=host, **opts)
    if name == "objstore":
        from memsnap.transport.objstore import ObjStoreTransport

        return ObjStoreTransport(**opts)
    raise ValueError(f"transport {name!r} is unknown: use 'tcp' or 'objstore'")
