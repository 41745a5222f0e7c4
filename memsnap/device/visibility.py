"""How a node's agent sees every GPU of its node without reserving any (Ray).

Ray sets ``CUDA_VISIBLE_DEVICES`` in every worker to the GPUs it reserved for it; an actor
with ``num_gpus=0`` (the agent: it must not take a GPU from training) gets an empty string and
sees no device. Two ways around it, both without reserving a GPU:

1. Start the agent with ``runtime_env={"env_vars": {NOSET: "1"}}`` (``agent_runtime_env``):
   Ray then leaves ``CUDA_VISIBLE_DEVICES`` as the raylet had it, i.e. the node's GPUs.
2. In a process that has not initialised CUDA yet, ``see_node_gpus()`` removes an empty
   ``CUDA_VISIBLE_DEVICES`` that Ray set (or restores the node's list when given it).

Either way the agent names devices by UUID (``memsnap.device.cuda.device_uuid``), never by
index: a rank's ``cuda:0`` is the node's GPU 3 when Ray gave it GPU 3.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
VISIBLE = "CUDA_VISIBLE_DEVICES"


def agent_runtime_env() -> dict:
    """The ``runtime_env`` that makes Ray leave the agent's ``CUDA_VISIBLE_DEVICES`` alone."""
    return {"env_vars": {NOSET: "1"}}


def see_node_gpus(environ: MutableMapping[str, str] | None = None, node_devices: str | None = None) -> str:
    """Undo Ray's empty ``CUDA_VISIBLE_DEVICES`` in ``environ`` (default ``os.environ``) before
    CUDA is initialised in this process; returns what was done, for the log. ``node_devices``
    (e.g. ``"0,1,2,3"``) sets the list outright. A non-empty list is left alone: someone chose
    it on purpose."""
    env = os.environ if environ is None else environ
    if node_devices is not None:
        env[VISIBLE] = node_devices
        return f"{VISIBLE}={node_devices!r} set for the agent"
    current = env.get(VISIBLE)
    if current is None:
        return f"{VISIBLE} unset: every GPU of the node is visible"
    if current.strip() == "":
        del env[VISIBLE]
        return f"removed the empty {VISIBLE} Ray sets for num_gpus=0: every GPU of the node is visible"
    return f"{VISIBLE}={current!r} kept"
