"""The live-cluster commands' formatting and parsing, and the metrics module's fallback, without Ray."""

from __future__ import annotations

import io
import json

import pytest

from memsnap import metrics
from memsnap.cli import build_parser, main
from memsnap.commands import _cluster, jobs, shutdown, status
from memsnap.errors import ConfigError
from memsnap.localcluster import free_port

NODE_A, NODE_B, NODE_C = "a" * 56, "b" * 56, "c" * 56


def agent(local: int, held: int, parity: int, used: int, begun: int, spill: dict | None = None) -> dict:
    return {
        "arena": local,
        "local": local,
        "held": held,
        "parity": parity,
        "budget_used": used,
        "budget": 1 << 30,
        "counters": {"failed_snapshots": 0, "newest_begun": begun},
        "spill": spill,
    }


def coordinator_status() -> dict:
    return {
        "committed_step": 7,
        "last_commit_time": 1000.0,
        "committed_steps": [6, 7],
        "failed_snapshots": 1,
        "skipped_snapshots": 2,
        "protection": {"0": 1, "1": 0},
        "peers": True,
        "members": {"0": NODE_A, "1": NODE_B},
        "generation": 1,
        "durable_step": 6,
        "last_restore": {"tier": "peer", "step": 5, "seconds": {"plan": 0.25, "fetch": 1.0, "total": 1.5}},
        "reprotect": {"running": 1, "rebuilt_chunks": 12, "local_copies": 1, "errors": []},
        "agents": {
            NODE_A: agent(
                4 << 20,
                8 << 20,
                1 << 20,
                16 << 20,
                9,
                {"spilled_step": 6, "writing": 7, "failures": 0, "bytes": 3 << 20},
            ),
            NODE_B: agent(4 << 20, 8 << 20, 0, 12 << 20, 8),
            NODE_C: agent(0, 8 << 20, 0, 8 << 20, -1),
        },
    }


def test_summary_lag_is_the_newest_begun_snapshot_minus_the_committed_step():
    s = status.summary("job-x", coordinator_status())
    assert (s["job"], s["newest_begun"], s["lag_steps"]) == ("job-x", 9, 2)
    st = coordinator_status() | {"committed_step": None}
    assert status.summary("j", st)["lag_steps"] == 10  # nothing committed: every begun step is behind
    st["agents"] = {}
    assert status.summary("j", st)["lag_steps"] is None  # nothing begun either


def test_render_names_the_committed_step_lag_protection_restore_and_every_node():
    text = status.render(status.summary("job-x", coordinator_status()), now=1012.0)
    lines = text.splitlines()
    assert lines[0] == "job job-x: committed step 7 (12 s ago), lag 2 step(s) behind snapshot 9, durable step 6"
    assert lines[1] == "protection (further node losses survived): group 0: 1, group 1: 0 (UNPROTECTED)"
    assert "1 failed, 2 skipped busy" in lines[2] and "restore generation 1" in lines[2]
    assert lines[3] == "last restore: step 5 from peer in 1.50 s"
    assert lines[4] == "re-protection: running, 12 chunk(s) rebuilt, 1 local copy given back"
    st = coordinator_status()
    st["reprotect"]["dropped"] = 2
    again = status.render(status.summary("job-x", st), now=1012.0).splitlines()[4]
    assert again == lines[4] + ", 2 step(s) dropped as newer commits pruned them"
    header, _, row_a, row_b, row_c = lines[6:]
    assert header.split() == ["NODE", "RANKS", "RAM", "USED", "BUDGET", "USE", "LOCAL", "PEER", "SPILLED", "SPILL"]
    assert row_a.split()[:2] == [NODE_A[:12], "0"] and "16.0 MiB" in row_a and "2%" in row_a
    assert "9.0 MiB" in row_a and "3.0 MiB" in row_a and row_a.endswith("step 6, writing 7")
    assert row_b.split()[:2] == [NODE_B[:12], "1"] and row_b.endswith("off")
    assert row_c.split()[:2] == [NODE_C[:12], "spare"]


def test_render_names_the_fenced_nodes_with_why_and_the_slow_agents():
    st = coordinator_status() | {
        "fenced": [NODE_C],
        "liveness": {"lost": {NODE_C: "no heartbeat for 1.2 s, and its agent did not answer"}, "slow": {NODE_B: 2}},
    }
    lines = status.render(status.summary("job-x", st), now=1012.0).splitlines()
    line = next(line for line in lines if line.startswith("nodes declared lost"))
    assert (
        f"{NODE_C[:12]} (no heartbeat for 1.2 s" in line
        and f"slow agents (answered when silent): {NODE_B[:12]} x2" in line
    )
    assert not any(
        line.startswith("nodes declared lost")
        for line in status.render(status.summary("j", coordinator_status()), now=1012.0).splitlines()
    )


def test_render_before_anything_committed():
    st = {"committed_step": None, "protection": {}, "agents": {}, "members": {}, "last_restore": {"tier": "none"}}
    text = status.render(status.summary("fresh", st), now=0.0)
    assert text.splitlines()[0] == "job fresh: committed step -, lag - step(s) behind snapshot -, durable step -"
    assert "nothing committed or not placed yet" in text and "last restore: none" in text


def test_tier_bytes_match_the_documented_tiers():
    a = agent(5, 7, 2, 0, 0, {"bytes": 11})
    assert metrics.tier_bytes(a) == {"local": 5, "peer": 9, "durable": 11}
    assert metrics.tier_bytes(agent(5, 7, 2, 0, 0))["durable"] == 0


@pytest.mark.parametrize(
    "name, parsed",
    [
        ("memsnap-coordinator:gpt", ("gpt", None)),
        ("memsnap-agent:gpt:" + NODE_A, ("gpt", NODE_A)),
        ("memsnap-agent:a:b:" + NODE_A, ("a:b", NODE_A)),  # a job name may hold ':'
        ("memsnap-agent:gpt", None),
        ("something-else:gpt", None),
        ("memsnap-coordinator:", None),
    ],
)
def test_parse_actor(name, parsed):
    assert _cluster.parse_actor(name) == parsed


def test_jobs_rows():
    found = {"b": {"coordinator": False, "agents": [NODE_A]}, "a": {"coordinator": True, "agents": [NODE_A, NODE_B]}}
    assert jobs.rows(found) == [["a", "yes", 2], ["b", "no", 1]]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_shutdown_asks_on_a_terminal_and_refuses_without_one():
    entry = {"coordinator": True, "agents": [NODE_A, NODE_B]}
    out = io.StringIO()
    assert shutdown.confirm("gpt", entry, _Tty("y\n"), out) is True
    assert "'gpt'" in out.getvalue() and "2 agent(s)" in out.getvalue()
    assert shutdown.confirm("gpt", entry, _Tty("\n"), io.StringIO()) is False
    with pytest.raises(ConfigError, match="pass --yes"):
        shutdown.confirm("gpt", entry, io.StringIO("y\n"), io.StringIO())


def test_address_defaults_to_ray_address_then_auto(monkeypatch):
    args = build_parser().parse_args(["status", "j"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _cluster.address(args) == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert _cluster.address(args) == "127.0.0.1:6379"
    assert _cluster.address(build_parser().parse_args(["jobs", "--address", "127.0.0.1:1"])) == "127.0.0.1:1"


def test_an_address_nobody_listens_on_is_refused_at_once():
    port = free_port()  # a port that was free a moment ago: nothing listens there
    with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
        _cluster._reachable(f"127.0.0.1:{port}", timeout=2)


def test_every_metric_records_without_a_ray_cluster():
    for name, (kind, tags, _) in metrics.DEFINITIONS.items():
        assert kind in ("gauge", "counter", "histogram") and "job" in tags
        metrics.record(name, 1.0, **{t: "x" for t in tags})  # never raises


def test_metrics_fall_back_to_no_ops_when_ray_metrics_are_unavailable(monkeypatch):
    def broken(name):
        raise ImportError("no ray.util.metrics")

    monkeypatch.setattr(metrics, "_made", {})
    monkeypatch.setattr(metrics, "_off", False)
    monkeypatch.setattr(metrics, "_make", broken)
    metrics.training_step("j", "n", 3)
    assert metrics._off is True
    metrics.job_status("j", coordinator_status())  # every helper is now a no-op
    assert metrics._made == {}


def test_a_step_the_policy_skips_records_the_training_step_at_most_once_a_second(monkeypatch):
    seen = []
    monkeypatch.setattr(metrics, "record", lambda name, value, **tags: seen.append((name, value)))
    monkeypatch.setattr(metrics, "_step_recorded", {})
    clock = iter([100.0, 100.5, 101.2, 101.3])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    for step in (1, 2, 3):
        metrics.training_step("j", "n", step, every_s=1.0)
    metrics.training_step("j", "n", 4)  # a snapshotted step is always recorded
    assert seen == [("memsnap_training_step", 1), ("memsnap_training_step", 3), ("memsnap_training_step", 4)]


def test_watch_prints_one_json_object_per_refresh_until_interrupted(monkeypatch, capsys):
    answers = iter([coordinator_status() | {"committed_step": 7}, coordinator_status() | {"committed_step": 8}])
    monkeypatch.setattr(status, "fetch", lambda handle, job, timeout: status.summary(job, next(answers)))
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status.time, "sleep", sleep)
    monkeypatch.setattr(status, "connect", lambda args: None)
    args = build_parser().parse_args(["status", "job-x", "--watch", "--json", "--interval", "0.5"])
    import ray

    monkeypatch.setattr(ray, "get_actor", lambda name, namespace: object())
    assert args.func(args) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(o["job"], o["committed_step"]) for o in out] == [("job-x", 7), ("job-x", 8)]
    assert sleeps == [0.5, 0.5]


def test_a_coordinator_that_does_not_answer_is_one_error_naming_the_job(monkeypatch):
    import ray

    class Handle:
        class status:  # (an actor method's shape)
            @staticmethod
            def remote():
                return "ref"

    def get(ref, timeout):
        raise ray.exceptions.GetTimeoutError("no answer")

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(Exception, match="coordinator of job 'job-x' did not answer within 5 s"):
        status.fetch(Handle, "job-x", 5.0)


HOSTILE_JOB = "evil\x1b]52;c;SGk=\x07\u202e"


def test_strings_from_the_cluster_are_printed_escaped():
    st = coordinator_status()
    st["reprotect"]["errors"] = ["disk \x1b[2J gone"]
    text = status.render(status.summary(HOSTILE_JOB, st), now=1012.0)
    assert text.startswith("job evil\\x1b]52;c;SGk=\\x07\\u202e: committed step 7")
    assert "last error: disk \\x1b[2J gone" in text
    from memsnap.commands._common import table

    found = {HOSTILE_JOB: {"coordinator": True, "agents": [NODE_A]}}
    assert table(["JOB", "COORDINATOR", "AGENTS"], jobs.rows(found)).splitlines()[-1].split() == [
        "evil\\x1b]52;c;SGk=\\x07\\u202e",
        "yes",
        "1",
    ]
    for shown in (text, table(["JOB"], [[HOSTILE_JOB]])):
        assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown


@pytest.mark.parametrize("command", ["status", "shutdown"])
def test_a_job_the_cluster_does_not_run_exits_2(monkeypatch, capsys, command):
    import ray

    def no_actor(name, namespace):
        raise ValueError(f"no actor {name}")

    monkeypatch.setattr(ray, "get_actor", no_actor)
    for mod in (status, shutdown):
        monkeypatch.setattr(mod, "connect", lambda args: None)
        monkeypatch.setattr(mod, "jobs", lambda: {HOSTILE_JOB: {"coordinator": True, "agents": [NODE_A]}})
    assert main([command, "gpt", "--yes"] if command == "shutdown" else [command, "gpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"memsnap {command}: no memsnap job 'gpt' on the Ray cluster") and len(err.splitlines()) == 1
    assert "jobs there: evil\\x1b]52;c;SGk=\\x07\\u202e" in err and "\x1b" not in err
