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


def _ready(step: int, node: str, rank: int, gen: int):
    from memsnap.records import NodeReady, Region

    return NodeReady(step, node, gen, 4096, (Region(rank, 4096, 0),), ())


def test_a_restore_plan_drops_the_steps_above_it_and_none_commits_until_the_resume():
    """Between a restore plan of step 1 and the round's resume, step 2 (in flight) cannot be the
    one the job resumes from: a node already ready for it is forgotten and the last one's report
    commits nothing; after the resume, step 2 taken again commits."""
    log = CommitLog(SnapshotConfig("commit-unit", k=1, m=0))
    nodes = frozenset({"a", "b"})
    assert log.ready(_ready(1, "a", 0, 0), nodes, 2) is None
    assert log.ready(_ready(1, "b", 1, 0), nodes, 2) is not None
    assert log.ready(_ready(2, "a", 0, 0), nodes, 2) is None and 2 in log.pending
    assert log.roll_back(1) == [2]
    assert 2 not in log.pending and 2 in log.skipped and 2 not in log.failed  # not a failure
    assert log.ready(_ready(2, "b", 1, 0), nodes, 2) is None and log.newest() == 1
    assert log.ready(_ready(3, "a", 0, 0), nodes, 2) is None and 3 not in log.pending
    log.resume(1)
    for node, rank in (("a", 0), ("b", 1)):
        record = log.ready(_ready(2, node, rank, log.gen), nodes, 2)
    assert record is not None and log.newest() == 2


def test_a_cancelled_round_lifts_its_roll_back():
    log = CommitLog(SnapshotConfig("commit-unit", k=1, m=0))
    nodes = frozenset({"a"})
    log.roll_back(None)
    assert log.ready(_ready(0, "a", 0, 0), nodes, 1) is None and log.newest() is None
    log.cancel_roll_back()
    assert log.ready(_ready(1, "a", 0, 0), nodes, 1) is not None and log.newest() == 1
