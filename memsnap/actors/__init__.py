"""The Ray faces of memsnap's two actors: thin asyncio wrappers over plain objects.

``SnapshotAgent`` (one per node and job, detached, pinned to its node) wraps ``AgentCore``
(the RAM, the data plane) and ``NodeRelay`` (its ranks' calls toward the coordinator);
``Coordinator`` (one per job, detached) wraps ``CoordinatorCore``. Both are asyncio actors:
a barrier of N participants is N futures on one event loop, never a thread each, so no
concurrency setting limits the job's size. Blocking work (memory, sockets, Ray lookups)
runs in each actor's own thread pool. The call protocols are in ``memsnap.node.agent`` and
``memsnap.job.coordinator``; records cross this boundary as plain dicts (``records.py``).

    pool.py         the threads both faces run blocking work in
    coordinator.py  ``Coordinator``, ``coordinator_for``
    agent.py        ``SnapshotAgent``, ``agent_for``, ``find``

The faces stand above both ``node/`` and ``job/``: an agent that finds its coordinator gone
starts a new one.
"""

from memsnap.actors.agent import SnapshotAgent, agent_for, begin_waiting, find
from memsnap.actors.coordinator import Coordinator, coordinator_for

__all__ = ["Coordinator", "SnapshotAgent", "agent_for", "begin_waiting", "coordinator_for", "find"]
