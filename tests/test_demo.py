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

from memsnap import naming


def _demo(tmp_path, *args: str, timeout: float = 600) -> dict:
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "memsnap.cli", "demo", "--json", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.stdout.strip(), f"no report; stderr tail:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    report["_rc"] = proc.returncode
    report["_stderr"] = proc.stderr
    return report


def _check_report(r: dict, failures: int) -> None:
    assert r["_rc"] == 0, r["_stderr"][-4000:]
    assert len(r["failures"]) == failures
    for f in r["failures"]:
        assert f["tier"] == "peer", f  # the lost rank was rebuilt from its peers' RAM
        assert f["restored_step"] == f["failure_step"], f  # resumed from the last step
    assert r["restore_tier"] == "peer" and r["resumed_from_step"] == r["failure_step"]
    assert r["bitwise_identical"] is True
    assert r["final_params_identical"] is True
    assert set(r["recovery_seconds"]) == {"detect", "restart", "restore"}
    assert all(v is not None and v >= 0 for v in r["recovery_seconds"].values())
    assert r["disk_restore_seconds"] > 0 and r["disk_restore_step"] == r["steps"] - 1
    with open(r["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    left = os.listdir(naming.arena_dir()) if os.path.isdir(naming.arena_dir()) else []
    assert not [p for p in left if p.startswith("memsnap-demo-")]


@pytest.mark.ray
@pytest.mark.slow
def test_quick_demo_with_two_node_kills_resumes_from_peers_bitwise(tmp_path):
    """``memsnap demo --quick`` with two kills at different steps: Ray Train restarts the
    worker group twice (``max_failures``), each time the lost rank is rebuilt from its peers'
    RAM, and the loss curve and final parameters equal the run that never failed, bit for bit."""
    r = _demo(tmp_path, "--quick", "--failure-step", "4", "--failure-step", "10")
    _check_report(r, failures=2)
    first, second = (f["failure_step"] for f in r["failures"])
    assert 4 <= first < 10 <= second < r["steps"] - 1  # each kill lands after a committed step


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.demo
def test_default_demo(tmp_path):
    """The README's ``memsnap demo`` (4 nodes, RS(2,1), one kill): run with ``pytest -m demo``."""
    _check_report(_demo(tmp_path, timeout=900), failures=1)
