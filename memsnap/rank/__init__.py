"""The rank side of memsnap: one training process's snapshots.

``snapshotter.py`` is the public API (``Snapshotter``: save, restore, status, close) and the
restore loop; ``save.py`` captures a snapshot into the node's agent (host, CUDA side stream,
device tier); ``load.py`` reads a restore plan through its tier (local, copy, peer, elastic,
durable); ``client.py`` holds every call to the node's agent, with its deadline, returning
records; ``maps.py`` the mappings of the agent's arena files; ``job.py`` the job-wide calls
(its configuration, a spare agent, shutdown); ``member.py`` the recovery loop of a rank that
recovers in place (``memsnap.inplace``): a rank, or a standby waiting to become one, forming
the group again in the same process for each generation.
"""

from memsnap.rank.job import check_same_job, ensure_ray, job_config, shutdown, start_spare
from memsnap.rank.snapshotter import Snapshotter

__all__ = ["Snapshotter", "check_same_job", "ensure_ray", "job_config", "shutdown", "start_spare"]
