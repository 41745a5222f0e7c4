"""The control plane's records cross every boundary as plain JSON-able dicts: each comes back
equal from its wire form, after a trip through JSON (integer keys included)."""

from __future__ import annotations

import json

import pytest

from memsnap.records import (
    AgentState,
    CommitNotice,
    Holders,
    Inventory,
    LastRestore,
    NodeReady,
    Placed,
    RankPlan,
    RankRestore,
    RankSource,
    Region,
    Registered,
    RoundResult,
)

READY = NodeReady(7, "node-a", 2, 1 << 20, (Region(0, 3000, 0), Region(1, 5000, 3)), ("node-b", "node-c"), "ab" * 8, 4)
SOURCE = RankSource(7, 2, 1, "node-a", 1 << 20, Region(1, 5000, 3), ("node-b", "node-c"), ({"port": 1}, None))


def through_json(record):
    return type(record).from_wire(json.loads(json.dumps(record.to_wire())))


@pytest.mark.parametrize(
    "record",
    [
        READY,
        CommitNotice(7, (6, 7), True, {"node-a": ("node-d",)}),
        Placed((0, 1), True, None, 3, 8, Holders(("node-b", "node-c"), ({"port": 1}, None), 3)),
        Placed((), False, "1 node(s) < k+m+1=4", 1, 8, None),
        Registered({1: 4096}, {0: "rank 0 is held by run 'r'"}, "run-1", 2),
        SOURCE,
        RankPlan(7, "peer", "ram", "/nfs/ck", SOURCE, (SOURCE,)),
        RankRestore.loaded("local", {"plan": 0.01, "fetch": 0.2, "total": 0.3}),
        RankRestore.failed(OSError("no such chunk")),
        RoundResult(False, {3: RankRestore.failed(ValueError("bad")), 1: RankRestore.loaded("peer", {})}, 5),
        AgentState({"port": 9}, 3, (0, 1), (6, 7), (READY,), "run-1", {0: ("run-1", "p0"), 1: (None, "p1")}),
        Inventory("node-a", {"port": 9}, {7: ("committed", (0, 1))}, {}, (6, 7), {"arena": 8}, {"sent": 2}, None),
    ],
    ids=lambda r: type(r).__name__,
)
def test_a_record_comes_back_equal_from_its_wire_form_through_json(record):
    assert through_json(record) == record


def test_a_failed_rank_report_names_the_error_and_no_tier():
    rep = RankRestore.failed(OSError("holder gone"))
    assert not rep.ok and rep.tier is None and rep.error == "OSError: holder gone"


def test_the_jobs_last_restore_names_every_tier_and_the_slowest_ranks_seconds():
    reports = [
        RankRestore.loaded("local", {"fetch": 0.1, "total": 0.2}),
        RankRestore.loaded("peer", {"fetch": 1.0, "total": 1.5}),
        RankRestore.loaded("local", {"fetch": 0.3, "total": 0.4}),
    ]
    last = LastRestore.of_round(9, reports)
    assert last.tier == "local,peer" and last.step == 9 and last.total_s == 1.5
    assert LastRestore.of_round(9, reports[:1]).tier == "local"


def test_last_restore_leaves_out_what_it_does_not_know():
    assert LastRestore().to_wire() == {"tier": "none", "step": None, "seconds": {}}
    wire = LastRestore("durable", 4, {"total": 2.0}, "run-1", "from durable storage").to_wire()
    assert wire["run"] == "run-1" and wire["warning"] == "from durable storage"
