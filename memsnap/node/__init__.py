"""The node's agent: one per node, holding its ranks' snapshots and its peers' pieces in RAM.

``agent`` (``AgentCore``, which composes the rest), ``versions`` (the one owner of the node's
version table), ``slots`` (the arena slots ranks capture into, ``memsnap.memory.arena``),
``sender`` (checksums, stripes, parity and the pushes to holders), ``chunkstore`` (the pieces
held for peers), ``repair`` (bytes back into this node), ``relay`` (the node's ranks toward the
coordinator), ``spill`` (the background copy to durable storage).
"""
