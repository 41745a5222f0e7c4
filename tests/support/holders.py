"""k+m chunk holders served over real loopback TCP, and a client to reach them."""

from __future__ import annotations

import contextlib

from memsnap.memory.arena import MemoryBudget
from memsnap.node.chunkstore import HeldChunks
from memsnap.transport import make_transport


@contextlib.contextmanager
def tcp_holders(n: int, secret: bytes):
    """``(stores, addresses, client)``: ``n`` holder servers, each with its own chunk store."""
    stores = [HeldChunks(MemoryBudget(1 << 30, f"h{j}")) for j in range(n)]
    servers = [make_transport("tcp", secret=secret, host="127.0.0.1") for _ in stores]
    client = make_transport("tcp", secret=secret, host="127.0.0.1")
    try:
        yield stores, [t.start(s) for t, s in zip(servers, stores)], client
    finally:
        client.close()
        for t in servers:
            t.close()
