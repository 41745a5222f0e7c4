"""``memsnap.Snapshotter`` and the job-wide calls, where they were imported from before the
rank side became the ``memsnap.rank`` package (this module only re-exports it)."""

from memsnap.rank.job import check_same_job, ensure_ray, job_config, shutdown, start_spare
from memsnap.rank.snapshotter import Snapshotter

__all__ = ["Snapshotter", "check_same_job", "ensure_ray", "job_config", "shutdown", "start_spare"]
