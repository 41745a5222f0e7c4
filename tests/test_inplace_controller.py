"""``InplaceJob``'s settings are checked when it is made (no Ray needed), and ``Recovery.split``
divides a recovery's seconds between its phases from the members' reports."""

from __future__ import annotations

import json

import pytest

from memsnap.collective.assignment import Assignment
from memsnap.collective.report import MemberReport
from memsnap.errors import ConfigError
from memsnap.inplace import InplaceJob, Recovery


def make(**kwargs) -> InplaceJob:
    return InplaceJob("ctl", lambda ctx: None, lambda ctx, state: None, **{"rank_nodes": ["n0", "n1"], **kwargs})


def test_the_defaults_make_a_job_of_one_rank_per_node():
    job = make(standby_nodes=["n2"])
    assert job.world == 2 and job.standby_nodes == ["n2"] and job.gen == 0
    assert job.options["run"] == job.run_id  # every rank's snapshotter names this run


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"rank_nodes": []}, r"rank_nodes=\[\]"),
        ({"on_no_standby": "retry"}, r"on_no_standby='retry': must be 'wait', 'shrink' or 'fail'"),
        ({"backend": "mpi"}, r"backend='mpi': must be 'gloo' \(CPU tensors\) or 'nccl'"),
        (
            {"beat_s": 0.5, "suspect_after_s": 0.3},
            r"beat_s=0.5, suspect_after_s=0.3, lost_after_s=1.0: need 0 < beat_s",
        ),
        ({"suspect_after_s": 2.0}, r"suspect_after_s=2.0, lost_after_s=1.0"),
        ({"beat_s": 0}, r"beat_s=0: must be a finite number of seconds > 0"),
        ({"beat_s": "0.1"}, r"beat_s='0.1': must be a finite number"),
        ({"lost_after_s": float("nan")}, r"lost_after_s=nan: must be a finite number"),
        ({"suspect_after_s": True}, r"suspect_after_s=True: must be a finite number"),
        ({"backend_timeout_s": 0}, r"backend_timeout_s=0: must be a finite number of seconds > 0"),
        ({"backend_timeout_s": float("inf")}, r"backend_timeout_s=inf"),
        ({"wait_for_node_s": -1}, r"wait_for_node_s=-1: must be a finite number of seconds >= 0"),
        ({"slow_limit_s": 0.5}, r"slow_limit_s=0.5: must be >= lost_after_s=1.0"),
        ({"slow_limit_s": float("inf")}, r"slow_limit_s=inf: must be a finite number"),
    ],
)
def test_a_bad_setting_is_refused_naming_the_value(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        make(**kwargs)


def test_waiting_no_time_for_a_node_is_allowed():
    assert make(wait_for_node_s=0).wait_for_node_s == 0.0


def report(rank: int, **times) -> MemberReport:
    base = {"member": f"r{rank}", "pid": 10 + rank, "rank": rank, "gen": 3, "takeover": False, "assigned": 100.25}
    return MemberReport.from_wire(base | times)


def recovery(reports: dict[int, dict]) -> Recovery:
    """A recovery of generation 3 decided at 100.25 s, with the members' reports."""
    return Recovery(
        gen=3,
        lost={1: "r1"},
        takeover={1: "s0"},
        fenced_nodes=["n1"],
        why="rank 1: its process ended",
        noticed=100.0,
        decided=100.25,
        reports={r: report(r, **rep) for r, rep in reports.items()},
    )


def test_split_measures_each_phase_up_to_the_last_member_to_finish_it():
    rec = recovery(
        {
            0: {"formed": 100.5, "restored": 101.0, "first_step": 101.5, "tier": "local", "step": 9, "pid": 11},
            1: {"formed": 101.0, "restored": 102.5, "first_step": 102.75, "tier": "peer", "step": 9, "pid": 22},
            2: {"formed": 100.75, "restored": 101.25, "first_step": 103.0, "tier": "local", "step": 9, "pid": 33},
        }
    )
    assert rec.split() == {"detect": 0.25, "reform": 0.75, "restore": 1.5, "first_step": 0.5, "total": 3.0}
    out = rec.to_dict()
    assert out["tiers"] == {0: "local", 1: "peer", 2: "local"} and out["pids"] == {0: 11, 1: 22, 2: 33}
    assert out["steps"] == {0: 9, 1: 9, 2: 9} and out["split"]["total"] == 3.0
    # each member's own timeline, to see whose wait made a phase long (here rank 1 formed last)
    assert out["members"][1]["formed"] == 101.0 and out["members"][1]["assigned"] == 100.25
    assert out["members"][2]["first_step"] == 103.0 and out["members"][0]["member"] == "r0"
    assert json.loads(json.dumps(out))["lost"] == {"1": "r1"}  # the events file is JSON
    assert out["left"] == {}  # (no report of the generation before read yet)
    rec.before = {0: report(0, gen=2, lost=100.125), 1: report(1, gen=2), 2: report(2, gen=2, lost=100.5)}
    assert rec.to_dict()["left"] == {0: 100.125, 2: 100.5}  # when each survivor left the failed one


def test_a_recovery_rolled_back_unless_every_rank_kept_or_took_live_state():
    live = {0: {"tier": "kept"}, 1: {"tier": "live"}, 2: {"tier": "kept"}}
    assert recovery(live).rolled_back() is False
    assert recovery({**live, 1: {"tier": "peer"}}).rolled_back() is True
    assert recovery({}).rolled_back() is True  # not known (no rank reported): taken as a rollback


def test_split_leaves_a_phase_unmeasured_until_every_member_reported_it():
    rec = recovery(
        {0: {"formed": 100.5, "restored": 101.0, "first_step": 101.5}, 1: {"formed": 101.0, "restored": 102.5}}
    )  # rank 1 has not stepped yet
    assert rec.split() == {"detect": 0.25, "reform": 0.75, "restore": 1.5, "first_step": None, "total": None}
    rec = recovery({0: {"formed": 100.5}, 1: {"restored": 102.5}})
    assert rec.split() == {"detect": 0.25, "reform": None, "restore": None, "first_step": None, "total": None}


def test_split_of_a_recovery_with_no_report_yet_has_only_the_detection():
    assert recovery({}).split() == {"detect": 0.25, "reform": None, "restore": None, "first_step": None, "total": None}


def test_a_sharded_member_refuses_to_shrink_naming_the_fix():
    """FSDP2 parameters live on a mesh of the world they were sharded on: a member holding a
    sharded model cannot become a rank of a smaller job in place."""
    import types

    from memsnap.rank.member import Member

    closed = []
    member = types.SimpleNamespace(
        name="r2", rank=2, world=3, sharded=[object()], snap=types.SimpleNamespace(close=lambda: closed.append(1))
    )
    with pytest.raises(RuntimeError, match=r"shrinks from 3 to 2 ranks.*sharded.*standby_nodes"):
        Member._resize(member, 1, 2)
    assert closed == [] and member.snap is not None
    member.sharded = []
    Member._resize(member, 1, 2)  # data parallel: a Snapshotter of the new shape comes next
    assert closed == [1] and member.snap is None


def test_a_member_report_travels_as_json_with_only_the_phases_it_reached():
    rep = report(2, formed=100.5, restored=101.0, tier="live", live_holders=[0, 1], live_phases={"move": 0.4})
    wire = json.loads(rep.to_json())
    assert "first_step" not in wire and wire["formed"] == 100.5 and wire["live_holders"] == [0, 1]
    back = MemberReport.from_json(rep.to_json())
    assert back == rep and back.first_step is None
    # a report from a newer member with a field this one does not know still reads
    assert MemberReport.from_wire(wire | {"newer": 1}) == rep


def test_a_generation_travels_as_json_with_the_recoveries_before_it():
    a = Assignment(4, {"r0": 0, "s1": 1, "r2": 2, "r3": 3}, False, 3, 1, 75.5)
    assert Assignment.from_json(a.to_json()) == a and a.rank_of("s1") == 1 and a.rank_of("s0") is None
    old = json.dumps({"world": 2, "members": {"r0": 0, "r1": 1}, "done": True})  # written before the counts
    assert Assignment.from_json(old) == Assignment(2, {"r0": 0, "r1": 1}, True, 0, 0, 0.0)


# --- asking a silent member's node (inplace/ending.py) ------------------------------------------
class FakeAgents:
    """Asks that answer when told to: ``running[node]`` lists the tokens that still run there."""

    def __init__(self, running: dict[str, list[str]]):
        self.running = running
        self.asked: list[tuple[str, list[str]]] = []
        self.ready: set[tuple[str, int]] = set()

    def ask(self, node, tokens):
        handle = (node, len(self.asked))
        self.asked.append((node, sorted(tokens)))
        return handle

    def poll(self, handles):
        return {h: self.running[h[0]] for h in handles if h in self.ready}


def test_a_silent_member_whose_node_says_its_process_ended_is_named_once_the_answer_comes():
    from memsnap.inplace.ending import EndedAsks

    agents = FakeAgents({"n1": ["t2"], "n2": RuntimeError("unreachable")})
    asks = EndedAsks(agents.ask, agents.poll)
    silent = {"r1": ("n1", "t1"), "r2": ("n1", "t2"), "r3": ("n2", "t3")}
    assert asks.ended(silent) == []  # asked (one ask per node), no answer yet
    assert agents.asked == [("n1", ["t1", "t2"]), ("n2", ["t3"])]
    assert asks.ended(silent) == [] and len(agents.asked) == 2  # not asked again while it waits
    agents.ready = {("n1", 0), ("n2", 1)}
    # r1's process no longer runs on n1; r2's does (slow, not lost); n2's ask failed: no verdict
    assert asks.ended(silent) == ["r1"]
    assert asks.ended(silent) == [] and len(agents.asked) == 2  # once per silence
    # r2 beat again; its next silence asks again (r3 and r1 stay silent: not asked again)
    assert asks.ended({"r1": ("n1", "t1"), "r3": ("n2", "t3")}) == []
    assert asks.ended(silent) == [] and agents.asked[-1] == ("n1", ["t2"])


def test_an_ask_still_out_is_counted_by_the_fencing_ping_until_its_node_answers_or_is_fenced():
    from memsnap.inplace.ending import EndedAsks

    now = [10.0]
    agents = FakeAgents({"n1": ["t2"], "n2": ["t3"]})
    asks = EndedAsks(agents.ask, agents.poll, clock=lambda: now[0])
    asks.ended({"r1": ("n1", "t1"), "r3": ("n2", "t3")})
    now[0] = 10.5
    asks.ended({"r1": ("n1", "t1"), "r3": ("n2", "t3"), "r2": ("n1", "t2")})  # n1 asked again, later
    # the oldest ask out to each node, with when it was sent (n1 has had since 10.0 to answer)
    assert asks.unanswered() == {"n1": (("n1", 0), 10.0), "n2": (("n2", 1), 10.0)}
    agents.ready = {("n2", 1)}
    now[0] = 10.7
    asks.ended({"r1": ("n1", "t1")})  # r3 beat again: its ask is still read, and n2 answered
    assert set(asks.unanswered()) == {"n1"}
    assert asks.answered == {"n2": 10.7}  # (its node is not doubted at a recovery: its agent is alive)
    asks.forget("n1")  # fenced: its asks never answer
    assert asks.unanswered() == {}


def test_a_member_with_no_agent_to_ask_is_left_to_its_lifeline_and_heartbeats():
    from memsnap.inplace.ending import EndedAsks

    asked = []
    asks = EndedAsks(lambda node, tokens: asked.append(node), lambda handles: pytest.fail("nothing to poll"))
    assert asks.ended({"r1": ("n1", "t1")}) == [] and asks.ended({"r1": ("n1", "t1")}) == []
    assert asked == ["n1"]


def test_a_new_ranks_snapshotter_registers_on_a_thread_of_its_own_and_its_error_is_raised(monkeypatch):
    """A standby's Snapshotter registers with its node's agent while its thread forms the group
    and runs ``on_rank``: ``result`` hands it over, or raises what the registration raised."""
    import threading
    import types

    import memsnap
    from memsnap.errors import ConfigError
    from memsnap.rank.member import _Registering

    made = []

    class Registered:
        def __init__(self, job, rank, world_size, **options):
            made.append((threading.current_thread().name, job, rank, world_size, options))

    monkeypatch.setattr(memsnap, "Snapshotter", Registered)
    member = types.SimpleNamespace(job="j", options={"k": 2, "preemption": False})
    snap = _Registering(member, 1, 4).result()
    assert isinstance(snap, Registered)
    assert made == [("memsnap-register", "j", 1, 4, {"k": 2, "preemption": False})]

    def refused(**_):
        raise ConfigError("job 'j' runs under another run id")

    monkeypatch.setattr(memsnap, "Snapshotter", refused)
    with pytest.raises(ConfigError, match="another run id"):
        _Registering(member, 1, 4).result()
