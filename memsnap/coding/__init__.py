"""How a node's bytes survive the loss of nodes: Reed-Solomon stripes, and reading them back.

``stripes`` (which bytes form shard j of stripe s), ``codec`` (the RS(k, m) kernels),
``encode`` (parity of a node's stream, rebuilt shards), ``restore`` (gathering a rank's bytes
from its holders, decoding what is missing), ``receive`` (the same inside the restoring rank,
straight into its live tensors), ``elastic`` (a step of another world size, from RAM),
``landing`` and ``buffers`` (where fetched bytes land).
"""
