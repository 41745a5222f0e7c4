"""``memsnap demo``: its parts (the frozen table, the cold read from the spill directory, the
comparison and its summary, the options), and end to end: Ray Train on a simulated cluster,
node kills, resume from RAM.

Each end-to-end test runs the real command in a subprocess (its own Ray cluster on
127.0.0.1) and reads its ``--json`` report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memsnap import naming
from memsnap.commands import demo as demo_cmd
from memsnap.demo import disk
from memsnap.demo.driver import DemoOptions, compare
from memsnap.demo.model import FrozenTable, ModelConfig
from memsnap.demo.train import TrainConfig, build, snapshot_state, state_digest

TINY = TrainConfig(model=ModelConfig.sized("tiny"), batch=4, frozen_mib=0.25)


# --- the frozen table and the final-state digest -----------------------------------------------
def test_frozen_table_is_its_size_reproducible_and_differs_by_rank():
    a, b, other = (
        FrozenTable(1 << 16, seed=3, rank=1),
        FrozenTable(1 << 16, seed=3, rank=1),
        FrozenTable(1 << 16, seed=3, rank=2),
    )
    assert a.table.nbytes == 1 << 16 and a.table.dtype.is_floating_point
    assert a.table.equal(b.table) and not a.table.equal(other.table)
    assert "table" in a.state_dict()  # persistent: snapshotted and restored with the model


def test_frozen_table_refuses_a_size_without_a_float():
    with pytest.raises(ValueError, match="at least 4 bytes"):
        FrozenTable(3)


def test_state_digest_covers_the_weights_and_the_frozen_table():
    objs = build(TINY, 1, 4, ddp=False)
    assert "frozen" in snapshot_state(objs) and objs["frozen"].table.nbytes == 1 << 18
    before = state_digest(objs)
    assert state_digest(build(TINY, 1, 4, ddp=False)) == before
    objs["frozen"].table[-1] += 1
    assert state_digest(objs) != before
    assert state_digest(build(TINY, 2, 4, ddp=False)) != before  # another rank, another table
    assert "frozen" not in build(TrainConfig(model=ModelConfig.sized("tiny")), 0, 1, ddp=False)


# --- the cold read from the spill directory ------------------------------------------------------
def test_cold_restore_reads_a_rank_back_bitwise_from_an_emptied_page_cache(tmp_path):
    import memsnap

    saved = build(TINY, 0, 1, ddp=False)
    memsnap.save(str(tmp_path), snapshot_state(saved), step=7, rank=0, world_size=1)
    [data] = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".bin")]
    fresh = build(TINY, 2, 4, ddp=False)  # another rank's table: the read must replace it
    assert state_digest(fresh) != state_digest(saved)
    got = disk.cold_restore(str(tmp_path), 7, 0, snapshot_state(fresh))
    assert state_digest(fresh) == state_digest(saved)
    assert got["bytes"] == os.path.getsize(data) and got["path"] == data and (got["step"], got["rank"]) == (7, 0)
    assert got["pages"] == -(-got["bytes"] // os.sysconf("SC_PAGE_SIZE"))
    assert got["seconds"] >= got["read_s"] > 0 and got["gib_per_s"] > 0
    if _drops_cache(str(tmp_path)):
        assert got["cached_pages_before"] == 0


def _drops_cache(directory: str) -> bool:
    """Whether the filesystem under ``directory`` drops clean pages on request (tmpfs does not)."""
    probe = os.path.join(directory, "probe")
    with open(probe, "wb") as f:
        f.write(os.urandom(1 << 16))
    disk.evict(probe)
    cached = disk.resident(probe)[0]
    os.remove(probe)
    return cached == 0


def test_resident_counts_cached_pages_and_evict_drops_them(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    pages = (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert disk.resident(str(path)) == (pages, pages)  # just written: every page cached
    if not _drops_cache(str(tmp_path)):
        pytest.skip("this filesystem keeps its pages (tmpfs)")
    disk.evict(str(path))
    assert disk.resident(str(path))[0] == 0
    path.read_bytes()
    assert disk.resident(str(path))[0] == pages


# --- the comparison and the summary ----------------------------------------------------------------
def _lost(fetch: float) -> dict:
    return {
        "tier": "peer",
        "restored_step": 15,
        "restore_bytes": 128 << 20,
        "restoring_ranks": 4,
        "restore_phases": {"plan": 5.0, "fetch": fetch, "total": 5.0 + fetch},
    }


def _disk(seconds: float) -> dict:
    return {
        "step": 39,
        "rank": 3,
        "bytes": 128 << 20,
        "path": "x",
        "seconds": seconds,
        "read_s": seconds / 2,
        "apply_s": seconds / 2,
        "gib_per_s": (128 / 1024) / seconds,
        "cached_pages_before": 0,
        "pages": 32768,
        "cache_drop": "fsync + posix_fadvise(POSIX_FADV_DONTNEED)",
    }


def test_compare_sets_bytes_into_the_tensors_against_the_disk_leaving_out_the_plan():
    got = compare(DemoOptions(), _lost(0.25), _disk(1.0))
    assert got["peer"]["seconds"] == 0.25  # the plan (waiting for every rank) is not the data path
    assert got["peer"]["gib_per_s"] == pytest.approx(0.5)
    assert got["why_disk_wins"] == []


def test_when_disk_is_ahead_the_comparison_says_why():
    got = compare(DemoOptions(), _lost(2.0), _disk(0.5))
    why = " ".join(got["why_disk_wins"])
    assert "4 ranks restored at once" in why and "RS(2,1)" in why and "shared storage" in why
    assert "fixed costs" not in why  # 128 MiB is not a small state
    small = dict(_lost(0.2), restore_bytes=1 << 20)
    assert "fixed costs" in " ".join(compare(DemoOptions(), small, dict(_disk(0.01), bytes=1 << 20))["why_disk_wins"])


def _report(lost: dict, disk_: dict) -> dict:
    return {
        "nodes": 4,
        "k": 2,
        "m": 1,
        "steps": 40,
        "frozen_mib": 128.0,
        "failure_step": 15,
        "resumed_from_step": 15,
        "restore_tier": "peer",
        "recovery_seconds": {"detect": 3.0, "restart": 10.0, "restore": 6.0},
        "restore_compare": compare(DemoOptions(), lost, disk_),
        "bitwise_identical": True,
        "final_params_identical": True,
        "plot": "loss.png",
        "total_seconds": 120.0,
    }


def test_summary_shows_both_restores_with_bytes_and_rates_and_explains_a_disk_win():
    text = demo_cmd.summary(_report(_lost(2.0), _disk(0.5)))
    assert "128.0 MiB in 2.00 s = 64.0 MiB/s" in text and "128.0 MiB in 0.50 s = 0.25 GiB/s" in text
    assert "page cache dropped" in text and "0 of 32768 pages cached" in text
    assert "why disk is ahead here" in text
    assert "why disk is ahead" not in demo_cmd.summary(_report(_lost(0.25), _disk(1.0)))
    tie = demo_cmd.summary(_report(_lost(0.25), _disk(0.2495)))  # disk a hair ahead: a tie, said so
    assert "why disk keeps up here" in tie and "why disk is ahead" not in tie
    small = dict(_lost(0.5), restore_bytes=1 << 20)
    assert "1.0 MiB in 0.50 s = 2.0 MiB/s" in demo_cmd.summary(_report(small, _disk(1.0)))


def test_summary_says_when_the_disk_holds_an_older_step_than_the_final_one():
    assert "NOTE" not in demo_cmd.summary(_report(_lost(0.25), _disk(1.0)))  # step 39 of 40: the final one
    older = dict(_report(_lost(0.25), dict(_disk(1.0), step=30)), final_spill={"committed": 39, "durable": None})
    text = demo_cmd.summary(older)
    assert "the disk holds step 30, not the final step 39" in text and "its spill returned None" in text


def test_options_size_the_frozen_table():
    ap = __import__("argparse").ArgumentParser()
    demo_cmd.register(ap.add_subparsers())
    parse = lambda *a: demo_cmd.options(ap.parse_args(["demo", *a]))  # noqa: E731
    assert parse().frozen_mib == demo_cmd.DEFAULT_FROZEN_MIB
    assert parse("--quick").frozen_mib == demo_cmd.QUICK_FROZEN_MIB
    assert parse("--frozen-mib", "16").frozen_mib == 16 and parse("--quick", "--frozen-mib", "0").frozen_mib == 0
    with pytest.raises(ValueError, match="--frozen-mib -1"):
        parse("--frozen-mib", "-1")


# --- end to end ----------------------------------------------------------------------------------


def _demo(tmp_path, *args: str, timeout: float = 600) -> dict:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "memsnap.cli", "demo", "--json", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.stdout.strip(), f"no report; stderr tail:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    report["_rc"] = proc.returncode
    report["_stderr"] = proc.stderr
    return report


def _check_report(r: dict, failures: int, mode: str = "inplace") -> None:
    assert r["_rc"] == 0, r["_stderr"][-4000:]
    assert r["mode"] == mode
    assert len(r["failures"]) == failures
    for f in r["failures"]:
        assert f["tier"] == "peer", f  # the lost rank was rebuilt from its peers' RAM
        assert f["restored_step"] == f["failure_step"], f  # resumed from the last step
        if mode == "inplace":  # the survivors kept their processes and rolled back from their own RAM
            assert f["survivors_kept_their_processes"] is True, f
            assert all(before == after for before, after in f["survivor_pids"].values()), f
            assert set(f["survivor_tiers"].values()) == {"local"}, f
            assert len(f["survivor_pids"]) == r["nodes"] - 1
    assert r["restore_tier"] == "peer" and r["resumed_from_step"] == r["failure_step"]
    assert r["bitwise_identical"] is True
    assert r["final_params_identical"] is True
    keys = {
        "inplace": {"first_sign", "detect", "reform", "restore", "first_step", "total"},
        "restart": {"detect", "restart", "restore"},
    }[mode]
    assert set(r["recovery_seconds"]) == keys
    assert all(v is not None and v >= 0 for v in r["recovery_seconds"].values())
    assert r["disk_restore_seconds"] > 0 and r["disk_restore_step"] == r["steps"] - 1, r["final_spill"]
    peer, disk_ = r["restore_compare"]["peer"], r["restore_compare"]["disk"]
    assert peer["bytes"] == disk_["bytes"] > r["frozen_mib"] * (1 << 20)  # the same rank's bytes, table included
    assert peer["gib_per_s"] > 0 and disk_["gib_per_s"] > 0 and disk_["rank"] == r["failures"][0]["rank"]
    assert bool(r["restore_compare"]["why_disk_wins"]) == (disk_["gib_per_s"] > peer["gib_per_s"])
    with open(r["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    left = os.listdir(naming.arena_dir()) if os.path.isdir(naming.arena_dir()) else []
    assert not [p for p in left if p.startswith("memsnap-demo-")]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(660)  # the command's own limit (600 s) first, on a loaded machine
def test_quick_demo_with_two_node_kills_recovers_in_place_bitwise(tmp_path):
    """``memsnap demo --quick`` with two kills at different steps: each time the survivors keep
    their processes and roll back from their own node's RAM, a warm standby takes the lost rank
    from its peers' RAM, and the loss curve and final parameters equal the run that never
    failed, bit for bit."""
    r = _demo(tmp_path, "--quick", "--failure-step", "4", "--failure-step", "10")
    _check_report(r, failures=2)
    first, second = (f["failure_step"] for f in r["failures"])
    assert 4 <= first < 10 <= second < r["steps"] - 1  # each kill lands after a committed step
    assert r["failures"][0]["takeover"] != r["failures"][1]["takeover"]  # a standby each


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.demo
@pytest.mark.timeout(660)
def test_quick_demo_with_restart_resumes_from_peers_bitwise(tmp_path):
    """``--restart``: Ray Train restarts the whole worker group (the fallback path); the lost
    rank is rebuilt from its peers' RAM, bitwise. With the demos (``pytest -m demo``): CI's
    time goes to the in-place path; the restart path's restore is covered by the runtime
    suites (test_runtime_failures.py, test_control_plane.py)."""
    _check_report(_demo(tmp_path, "--quick", "--restart"), failures=1, mode="restart")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.demo
@pytest.mark.timeout(960)
def test_default_demo(tmp_path):
    """The README's ``memsnap demo`` (4 nodes, RS(2,1), one kill): run with ``pytest -m demo``."""
    _check_report(_demo(tmp_path, timeout=900), failures=1)


def test_summary_in_place_shows_the_split_and_the_survivors_pids():
    failure = {"survivor_pids": {"0": [101, 101], "1": [102, 102]}, "survivor_tiers": {"0": "local", "1": "local"}}
    r = dict(
        _report(_lost(0.25), _disk(1.0)),
        mode="inplace",
        failures=[failure],
        survivors_kept_their_processes=True,
        recovery_seconds={
            "first_sign": 0.1,
            "detect": 0.5,
            "reform": 0.02,
            "restore": 0.7,
            "first_step": 0.2,
            "total": 1.42,
        },
    )
    text = demo_cmd.summary(r)
    assert "1.42 s in place" in text and "re-form 0.02 s" in text and "first step 0.20 s" in text
    assert "kept (rank 0 101 -> 101, rank 1 102 -> 102); rolled back from: local" in text
    r["survivors_kept_their_processes"] = False
    assert "NOT kept" in demo_cmd.summary(r)


def test_the_demo_recovers_in_place_unless_told_to_restart():
    ap = __import__("argparse").ArgumentParser()
    demo_cmd.register(ap.add_subparsers())
    parse = lambda *a: demo_cmd.options(ap.parse_args(["demo", *a]))  # noqa: E731
    assert parse().mode == "inplace" and parse("--restart").mode == "restart"
    # in place: a head for the controller, a node per rank and a spare per failure
    assert parse("--quick", "--failure-step", "4", "--failure-step", "10").cluster_nodes == 1 + 3 + 2
    assert parse("--restart").cluster_nodes == 4
    with pytest.raises(ValueError, match="mode='sideways'"):
        DemoOptions(mode="sideways")
