"""memsnap.chaos without a cluster: schedules (fixed, Poisson: seeded and at the right rate),
argument checks, target resolution, the injector's timeline and log against a recording
backend, the filler file, the refusal to touch a real cluster without confirmation, the CLI."""

from __future__ import annotations

import errno
import json
import os
import random
import statistics

import pytest

from memsnap import chaos
from memsnap.chaos import Fault, Injector, Schedule, hand, read_log
from memsnap.chaos.nodes import Node, resolve
from memsnap.cli import main
from memsnap.errors import ConfigError

HEAD, A, B, C = "0" * 56, "a1" * 28, "b2" * 28, "b2b2b2b3" + "c" * 48
NODES = [
    Node(HEAD, True, True, {}, 0),
    Node(A, True, False, {"pool": "spot"}, 1),
    Node(B, True, False, {"pool": "spot"}, 2),
    Node(C, False, False, {"pool": "ondemand"}, 3),
]


# --- schedules -------------------------------------------------------------------------------------
def test_fixed_schedule_orders_timed_faults_by_time_then_stepped_ones_by_step():
    s = Schedule.fixed(
        [
            Fault("stall", at_s=9, duration_s=1),
            Fault("kill_node", at_step=20),
            {"kind": "kill_process", "at_s": 2},
            Fault("preempt", at_step=5),
        ],
        seed=3,
    )
    assert [(f.kind, f.at_s, f.at_step) for f in s.faults] == [
        ("kill_process", 2.0, None),
        ("stall", 9.0, None),
        ("preempt", None, 5),
        ("kill_node", None, 20),
    ]
    assert s.seed == 3 and len(s) == 4


def test_poisson_schedule_is_deterministic_for_a_seed_and_differs_across_seeds():
    kw = dict(mtbf_s=50, kinds=["kill_node", "stall", "preempt"], nodes=[A, B], horizon_s=1000, duration_s=4)
    one, two = Schedule.poisson(seed=11, **kw), Schedule.poisson(seed=11, **kw)
    assert one.to_list() == two.to_list() and len(one) > 10
    assert Schedule.poisson(seed=12, **kw).to_list() != one.to_list()
    assert {f.target for f in one.faults} == {A, B}
    assert all(0 < f.at_s < 1000 for f in one.faults)
    assert all(f.duration_s == 4 for f in one.faults if f.kind != "kill_node")
    assert all(f.duration_s is None for f in one.faults if f.kind == "kill_node")


def test_poisson_schedule_has_the_rate_of_its_mtbf_per_node():
    nodes, mtbf, horizon = 8, 100.0, 100_000.0
    s = Schedule.poisson(mtbf_s=mtbf, nodes=nodes, seed=5, horizon_s=horizon)
    expected = nodes * horizon / mtbf  # 8,000 faults; a Poisson count's sd is sqrt(8000) ~ 89
    assert abs(len(s) - expected) < 5 * expected**0.5
    # each node's own process: inter-arrival times exponential with mean mtbf (sd of the mean ~1.1 s)
    per_node = Schedule.poisson(mtbf_s=mtbf, nodes=[A], seed=5, horizon_s=horizon)
    times = [f.at_s for f in per_node.faults]
    gaps = [b - a for a, b in zip([0.0] + times[:-1], times, strict=True)]
    assert abs(statistics.mean(gaps) - mtbf) < 5 * mtbf / len(gaps) ** 0.5
    assert abs(statistics.stdev(gaps) - mtbf) < 0.1 * mtbf  # exponential: sd == mean
    kinds = Schedule.poisson(mtbf_s=10, kinds=["kill_node", "kill_process"], nodes=2, seed=1, horizon_s=20_000)
    share = sum(f.kind == "kill_node" for f in kinds.faults) / len(kinds)
    assert abs(share - 0.5) < 0.05


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(mtbf_s=0), "mtbf_s=0"),
        (dict(mtbf_s=-5), "mtbf_s=-5"),
        (dict(mtbf_s=float("nan")), "mtbf_s=nan"),
        (dict(mtbf_s="60"), "mtbf_s='60'"),
        (dict(horizon_s=0), "horizon_s=0"),
        (dict(kinds=[]), "kinds is empty"),
        (dict(kinds=["explode"]), "unknown fault kind"),
        (dict(nodes=0), "nodes=0"),
        (dict(nodes=[]), "nodes=[]"),
        (dict(nodes=[A, A]), "names a node twice"),
        (dict(kinds=["stall"]), "give duration_s"),
        (dict(colour="red"), "unknown option"),
        (dict(seed=-1), "seed=-1"),
    ],
)
def test_poisson_schedule_rejects_bad_arguments_naming_them(kw, says):
    args = dict(mtbf_s=60, nodes=2, seed=0, horizon_s=600) | kw
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        Schedule.poisson(**args)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(kind="meteor", at_s=1), "unknown"),
        (dict(kind="kill_node"), "exactly one of at_s"),
        (dict(kind="kill_node", at_s=1, at_step=2), "exactly one of at_s"),
        (dict(kind="kill_node", at_s=-1), "at_s=-1"),
        (dict(kind="kill_node", at_step=1.5), "at_step=1.5"),
        (dict(kind="stall", at_s=1), "give duration_s"),
        (dict(kind="stall", at_s=1, duration_s=0), "duration_s=0"),
        (dict(kind="kill_node", at_s=1, duration_s=3), "means nothing for a kill"),
        (dict(kind="stall", at_s=1, duration_s=1, process=5), "process= applies"),
        (dict(kind="kill_process", at_s=1, process=True), "process=True"),
        (dict(kind="kill_node", at_s=1, path="/tmp"), "path= applies"),
        (dict(kind="fill_disk", at_s=1, limit_bytes=0), "limit_bytes=0"),
        (dict(kind="preempt", at_s=1, how="politely"), "how='politely'"),
        (dict(kind="kill_node", at_s=1, target=[A]), "target="),
    ],
)
def test_fault_rejects_bad_arguments_naming_them(kw, says):
    with pytest.raises(ConfigError, match=says):
        Fault(**kw)


def test_fault_dicts_round_trip_and_unknown_fields_are_named():
    f = Fault("fill_disk", target="pool=spot", at_step=7, duration_s=3, path="/data", limit_bytes=1 << 20)
    assert Fault.from_dict(json.loads(json.dumps(f.to_dict()))) == f
    assert Fault("kill_node", at_s=0).to_dict() == {"kind": "kill_node", "at_s": 0.0}
    with pytest.raises(ConfigError, match="unknown field"):
        Fault.from_dict({"kind": "kill_node", "at_s": 1, "when": 3})


# --- which node ----------------------------------------------------------------------------------
def test_targets_resolve_by_id_prefix_label_and_index_and_spare_the_head():
    rng = random.Random(0)
    assert resolve(A, NODES, rng).id == A
    assert resolve(B[:8], NODES, rng).id == B
    assert resolve(2, NODES, rng).id == B and resolve("1", NODES, rng).id == A
    assert resolve("pool=spot", NODES, rng).id in (A, B)
    assert {resolve(None, NODES, random.Random(s)).id for s in range(20)} == {A, B}  # never the head, nor dead C
    assert resolve(0, NODES, rng, allow_head=True).id == HEAD
    with pytest.raises(ConfigError, match="spare the head unless"):
        resolve(HEAD, NODES, rng)
    with pytest.raises(ConfigError, match="already dead"):
        resolve("pool=ondemand", NODES, rng)
    with pytest.raises(ConfigError, match="no node matches node id 'abcdef99'.*a1a1a1a1a1a1"):
        resolve("abcdef99", NODES, rng)
    with pytest.raises(ConfigError, match="matches 2 nodes"):
        resolve("b2b2b2", NODES, rng)


def test_a_short_or_non_hex_target_is_refused_with_the_forms_to_use():
    with pytest.raises(ConfigError, match="prefix of at least 6 hex digits"):
        resolve("node-7", NODES, random.Random(0))
    with pytest.raises(ConfigError, match="no node matches node index 9"):
        resolve(9, NODES, random.Random(0))


# --- the injector against a recording backend -------------------------------------------------------
class Recorder:
    """A backend that records each call and fails where told."""

    local = True

    def __init__(self, fail: dict | None = None):
        self.calls: list[tuple] = []
        self.fail, self.nodes_ = fail or {}, list(NODES)

    def nodes(self):
        return self.nodes_

    def _do(self, what, node, *args):
        self.calls.append((what, node.id) + args)
        if what in self.fail:
            raise RuntimeError(self.fail[what])
        return {"did": what}

    def kill_node(self, node):
        self.nodes_ = [n if n.id != node.id else Node(n.id, False, n.head, n.labels, n.index) for n in self.nodes_]
        return self._do("kill_node", node)

    def kill_process(self, node, process, rng):
        return self._do("kill_process", node, process)

    def stall(self, node, seconds):
        return self._do("stall", node, seconds)

    def end_stall(self, node, early):
        return self._do("end_stall", node, early)

    def fill_disk(self, node, path, limit):
        return dict(self._do("fill_disk", node, path, limit), path=f"{path}/filler")

    def unfill(self, node, path):
        return self._do("unfill", node, path)

    def preempt(self, node, how, deadline, process):
        return self._do("preempt", node, how, deadline, process)

    def step(self):
        raise ConfigError("no job")


def test_the_injector_lands_each_fault_records_it_and_writes_a_timeline_log(tmp_path):
    log = tmp_path / "chaos" / "run.jsonl"
    sched = Schedule.fixed(
        [
            Fault("kill_node", target=A, at_s=0),
            Fault("stall", target=1, at_s=0, duration_s=2),
            Fault("fill_disk", target=B, at_step=3, path="/spill", limit_bytes=10),
            Fault("preempt", target="pool=spot", at_step=4, how="drain", duration_s=30),
        ],
        seed=9,
    )
    rec = Recorder()
    inj = Injector(sched, backend=rec, log=str(log)).start()
    inj.observe_step(3)
    inj.observe_step(4)
    assert inj.wait(30), "every fault landed"
    events = inj.stop()
    assert [(e.kind, e.phase) for e in events] == [
        ("kill_node", "fault"),
        ("stall", "fault"),
        ("fill_disk", "fault"),
        ("preempt", "fault"),
        ("fill_disk", "end"),
    ]
    kill, stall, fill, preempt, unfill = events
    assert kill.ok and kill.target == A and kill.planned_s == 0 and kill.detail == {"did": "kill_node"}
    assert not stall.ok and stall.target is None and "already dead" in stall.error  # index 1 is A, killed first
    assert fill.planned_step == 3 and fill.target == B and rec.calls[1] == ("fill_disk", B, "/spill", 10)
    assert preempt.target == B and rec.calls[2] == ("preempt", B, "drain", 30.0, None)
    assert unfill.ok and rec.calls[3] == ("unfill", B, "/spill/filler")  # removed at stop()
    assert [e.seq for e in events] == list(range(5))
    assert all(abs(e.landed - events[0].landed) < 60 for e in events)
    tl = read_log(str(log))
    assert tl.events == events and tl.header["seed"] == 9 and tl.header["schedule"] == sched.to_list()
    assert tl.stopped["landed"] == 4 and tl.stopped["not_landed"] == []
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["type"] for x in lines] == ["start"] + ["event"] * 5 + ["stop"]


def test_a_fault_that_fails_is_recorded_with_its_error_and_the_run_goes_on(tmp_path):
    sched = Schedule.fixed(
        [Fault("kill_process", target=A, at_s=0, process="Trainer"), Fault("kill_node", target=B, at_s=0)]
    )
    with Injector(sched, backend=Recorder(fail={"kill_process": "no such process"})) as inj:
        assert inj.wait(30)
    bad, good = inj.events
    assert not bad.ok and bad.error == "RuntimeError: no such process" and bad.target == A
    assert good.ok and good.target == B


def test_a_fill_with_a_duration_is_removed_when_it_ends_and_stop_drops_faults_not_yet_due():
    sched = Schedule.fixed(
        [Fault("fill_disk", target=A, at_s=0, duration_s=0.2, path="/d"), Fault("kill_node", at_s=3600)]
    )
    rec = Recorder()
    inj = Injector(sched, backend=rec).start()
    from memsnap.localcluster import wait_for

    wait_for(lambda: len(inj.events) == 2, timeout=30, what="the fill to land and end")
    assert [(e.kind, e.phase) for e in inj.events] == [("fill_disk", "fault"), ("fill_disk", "end")]
    inj.stop()
    assert len(inj.events) == 2 and [c[0] for c in rec.calls] == ["fill_disk", "unfill"]


def test_the_same_seed_picks_the_same_targets():
    def run(seed):
        sched = Schedule.fixed([Fault("kill_process", at_s=0) for _ in range(6)], seed=seed)
        with Injector(sched, backend=Recorder()) as inj:
            assert inj.wait(30)
        return [e.target for e in inj.events]

    assert run(4) == run(4)
    assert {t for s in range(8) for t in run(s)} == {A, B}


def test_a_real_cluster_is_refused_without_confirmation_naming_the_flag():
    with pytest.raises(ConfigError, match="without confirmation.*--yes-kill-nodes.*confirm=True"):
        Injector(Schedule.fixed([Fault("kill_node", at_s=1)]), address="127.0.0.1:1")
    with pytest.raises(ConfigError, match="exactly one of cluster= .* and address="):
        Injector(Schedule.fixed([]))
    with pytest.raises(ConfigError, match="LocalCluster only"):
        Injector(Schedule.fixed([]), address="127.0.0.1:1", confirm=True, replace_killed=True)
    with pytest.raises(ConfigError, match="give a memsnap.chaos.Schedule"):
        Injector([Fault("kill_node", at_s=1)], backend=Recorder())


def test_read_log_refuses_a_file_that_is_not_a_chaos_log(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"type": "event", "kind": "kill_node"}) + "\n")
    with pytest.raises(ConfigError, match="x.jsonl:1: not a memsnap.chaos log record"):
        read_log(str(p))
    p.write_text("{not json\n")
    with pytest.raises(ConfigError, match="x.jsonl:1"):
        read_log(str(p))
    p.write_text("")
    with pytest.raises(ConfigError, match="no start record"):
        read_log(str(p))


# --- the filler file ---------------------------------------------------------------------------------
def test_fill_writes_up_to_its_limit_and_unfill_removes_only_filler_files(tmp_path):
    got = hand.fill(str(tmp_path / "not" / "yet"), limit_bytes=3 * 1024 * 1024 + 5, block=1 << 20)
    assert os.path.dirname(got["path"]) == str(tmp_path)  # the nearest existing directory
    assert got["bytes"] == os.path.getsize(got["path"]) == 3 * 1024 * 1024 + 5 and not got["full"]
    with pytest.raises(ValueError, match="not a filler file"):
        hand.unfill(str(tmp_path / "important.bin"))
    assert hand.unfill(got["path"]) == {"path": got["path"], "removed": True}
    assert not os.path.exists(got["path"])


def test_fill_stops_at_a_full_disk_and_keeps_what_it_wrote(tmp_path):
    class Disk:
        """A file on a disk with room for 2.5 blocks."""

        def __init__(self, path, mode, buffering):
            self.f, self.room = open(path, mode, buffering=buffering), 5 * 1024

        def write(self, data):
            if self.room <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = min(len(data), self.room)
            self.room -= n
            return self.f.write(data[:n])

        def fileno(self):
            return self.f.fileno()

        def close(self):
            self.f.close()

    got = hand.fill(str(tmp_path), block=2048, opener=Disk)
    assert got["full"] and got["bytes"] == 5 * 1024 == os.path.getsize(got["path"])


def test_signal_pids_refuses_the_raylet_and_itself():
    with pytest.raises(ValueError, match="refusing to signal"):
        hand.signal_pids([os.getpid()], 15)
    with pytest.raises(ValueError, match="refusing to signal"):
        hand.signal_pids([os.getppid()], 15)


# --- the CLI -------------------------------------------------------------------------------------------
def test_cli_refuses_a_cluster_without_yes_kill_nodes(capsys):
    assert main(["chaos", "--address", "127.0.0.1:1", "--fault", "kill_node at_s=5"]) == 1
    assert "--yes-kill-nodes" in capsys.readouterr().err


def test_cli_dry_run_prints_the_seeded_schedule(capsys):
    argv = [
        "chaos",
        "--dry-run",
        "--mtbf",
        "100",
        "--kinds",
        "kill_node,stall",
        "--nodes",
        "3",
        "--horizon",
        "1000",
        "--duration",
        "5",
        "--seed",
        "4",
    ]
    assert main(argv) == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    want = Schedule.poisson(mtbf_s=100, kinds=["kill_node", "stall"], nodes=3, horizon_s=1000, duration_s=5, seed=4)
    assert printed == want.to_list() and printed
    assert (
        main(
            [
                "chaos",
                "--dry-run",
                "--fault",
                "stall at_s=3 target=2 duration_s=1.5",
                "--fault",
                "kill_process at_step=9 process=4242",
            ]
        )
        == 0
    )
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == [
        {"kind": "stall", "at_s": 3.0, "target": "2", "duration_s": 1.5},
        {"kind": "kill_process", "at_step": 9, "process": 4242},
    ]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--fault", "kill_node at=3"], "unknown field"),
        (["--fault", "kill_node at_s=soon"], "is not a number"),
        (["--fault", "kill_node at_s"], "is not key=value"),
        (["--mtbf", "0", "--horizon", "9"], "mtbf_s=0"),
        (["--mtbf", "10"], "needs --horizon"),
        ([], "no faults to inject"),
        (["--mtbf", "10", "--horizon", "9", "--fault", "kill_node at_s=1"], "not both"),
    ],
)
def test_cli_names_what_is_wrong_with_a_schedule(capsys, argv, says):
    assert main(["chaos", "--dry-run"] + argv) == 1
    assert says in capsys.readouterr().err


def test_cli_prints_a_timeline_from_a_log(tmp_path, capsys):
    log = tmp_path / "t.jsonl"
    with Injector(
        Schedule.fixed([Fault("kill_node", target=A, at_s=0)], seed=2), backend=Recorder(), log=str(log)
    ) as inj:
        assert inj.wait(30)
    assert main(["chaos", "--timeline", str(log)]) == 0
    out = capsys.readouterr().out
    assert "seed 2, 1 fault(s) planned" in out and "kill_node" in out and A[:12] in out and " ok " in out


@pytest.mark.parametrize("fail, code", [({}, 0), ({"kill_node": "refused\x1b[2J"}, 1)])
def test_cli_exits_1_when_a_fault_failed_to_land(monkeypatch, tmp_path, capsys, fail, code):
    def injector(schedule, **kw):  # the CLI's own arguments, on a recording backend
        assert kw["confirm"] is True
        return Injector(schedule, log=kw["log"], job=kw["job"], allow_head=kw["allow_head"], backend=Recorder(fail))

    monkeypatch.setattr(chaos, "Injector", injector)
    argv = ["chaos", "--yes-kill-nodes", "--log", str(tmp_path / "t.jsonl"), "--fault", f"kill_node at_s=0 target={A}"]
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert f"{code} failed" in err
    if fail:  # the failure's text is shown escaped
        assert "FAILED" in out and "refused\\x1b[2J" in out and "\x1b" not in out


def test_the_package_exports_the_names_the_benchmarks_use():
    assert {"Fault", "Schedule", "Injector", "read_log", "KINDS"} <= set(chaos.__all__)


def test_a_stall_ends_on_its_own_or_is_ended_at_stop():
    rec = Recorder()
    with Injector(Schedule.fixed([Fault("stall", target=A, at_s=0, duration_s=0.1)]), backend=rec) as inj:
        assert inj.wait(30)
    assert [(e.phase, e.ok) for e in inj.events] == [("fault", True), ("end", True)]
    assert rec.calls == [("stall", A, 0.1), ("end_stall", A, False)]  # ended by the agent: only read
    rec = Recorder()
    inj = Injector(Schedule.fixed([Fault("stall", target=B, at_s=0, duration_s=3600)]), backend=rec).start()
    assert inj.wait(30, ended=False) and not inj.wait(0.1)
    inj.stop()
    assert rec.calls == [("stall", B, 3600.0), ("end_stall", B, True)] and inj.events[-1].phase == "end"
