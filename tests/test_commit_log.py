"""CommitLog's resolution of a step: committed, failed or skipped, each news once."""

from __future__ import annotations

from memsnap.config import SnapshotConfig
from memsnap.job.commit import CommitLog


def test_a_skipped_step_is_news_once_and_a_failure_reported_after_it_is_not():
    """A node skipped step 5 (its pipeline was busy); a peer still sending 5 is refused by its
    holders and reports a failure of 5 later: the step stays skipped, not counted as failed."""
    log = CommitLog(SnapshotConfig("commit-unit"))
    assert log.skip(5, "node a: busy") is True
    assert log.skip(5, "node b: busy") is False
    assert log.fail(5, "node c: the peer refused chunk ... which the job gave up") is False
    assert 5 in log.skipped and 5 not in log.failed
    assert log.fail(6, "node c: a holder died") is True
    assert log.skip(6, "node a: busy") is False and 6 in log.failed
