"""``memsnap demo`` end to end: Ray Train on a simulated cluster, node kills, resume from RAM.

Each test runs the real command in a subprocess (its own Ray cluster on 127.0.0.1) and reads
its ``--json`` report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.demo]


def _demo(tmp_path, *args: str, timeout: float = 600) -> dict:
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "memsnap.cli", "demo", "--json", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.stdout.strip(), f"no report; stderr tail:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    report["_rc"] = proc.returncode
    report["_stderr"] = proc.stderr
    return report


def test_quick_demo_resumes_from_peers_bitwise(tmp_path):
    r = _demo(tmp_path, "--quick")
    assert r["_rc"] == 0, r["_stderr"][-4000:]
    assert r["restore_tier"] == "peer"
    assert r["bitwise_identical"] is True
    assert r["final_params_identical"] is True
    assert 0 <= r["resumed_from_step"] <= r["failure_step"]
    assert set(r["recovery_seconds"]) == {"detect", "restart", "restore"}
    assert all(v is not None and v >= 0 for v in r["recovery_seconds"].values())
    assert r["disk_restore_seconds"] > 0
    with open(r["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("memsnap-demo-")]


def test_two_node_kills_final_weights_match_uninterrupted_run(tmp_path):
    """Ray Train with max_failures covering two kills at different steps."""
    r = _demo(tmp_path, "--quick", "--failure-step", "4", "--failure-step", "10")
    assert r["_rc"] == 0, r["_stderr"][-4000:]
    assert [f["failure_step"] for f in r["failures"]] == [4, 10]
    assert all(f["tier"] == "peer" for f in r["failures"])
    assert r["final_params_identical"] is True
    assert r["bitwise_identical"] is True
