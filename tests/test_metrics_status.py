"""Metrics and the live-status commands on a running job: a simulated 3-node loopback cluster.

The metrics are read back the way Prometheus reads them, from each raylet's metrics endpoint
on 127.0.0.1 (Ray reports them every second here: ``metrics_report_interval_ms``; the
coordinator records its gauges every second: ``MEMSNAP_METRICS_INTERVAL_S``). The CLI runs in
a subprocess against the cluster's address. The tests run in file order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import ray
from support.runtime import JobSpec, restore_all, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = "rt-metrics"
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")
JOB_SPEC = JobSpec(
    JOB,
    3,
    dict(k=1, m=1, chunk=64 * 255, memory_budget=256 << 20, on_error="raise", preemption=False, spill_every=1),
    spill="spill/root",
    env={"MEMSNAP_METRICS_INTERVAL_S": "1"},
    system_config={"metrics_report_interval_ms": 1000},
)


def scrape() -> list[tuple[str, dict, float]]:
    """Every memsnap sample of every live node's metrics endpoint: (name, labels, value)."""
    out = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            m = SAMPLE.match(line)
            if m and m.group(1).startswith("ray_memsnap_"):
                out.append((m.group(1), dict(LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def values(samples, name: str, **labels) -> list[float]:
    return [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())]


def by_node(samples, name: str, **labels) -> dict[str, float]:
    """``{node: value}`` of a metric tagged by node (summed over the processes reporting it)."""
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name and lab.get("job") == JOB and all(lab.get(k) == w for k, w in labels.items()):
            out[lab["node"]] = out.get(lab["node"], 0.0) + v
    return out


def settle(what: str, checks: dict, timeout: float = 90) -> None:
    """Scrape until every check holds (Ray exports each process's metrics every second, each
    on its own clock); on timeout, fail naming the checks that did not."""
    failing: list[str] = []

    def holds():
        samples = scrape()
        failing[:] = [name for name, check in checks.items() if not check(samples)]
        return not failing

    try:
        wait_for(holds, timeout=timeout, what=what)
    except TimeoutError:
        pytest.fail(f"{what}: still wrong after {timeout:.0f} s: {failing}")


def status(job) -> dict:
    return ray.get(job["trainers"][0].status.remote(), timeout=60)


def cli(job, *argv: str, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "memsnap.cli", *argv, "--address", job["cluster"].address],
        env=env,
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_saves_restore_and_a_failure_show_in_the_metrics(job):
    trainers, nodes = job["trainers"], job["nodes"]
    for step in range(3):
        ray.get([t.step_and_save.remote(step) for t in trainers], timeout=120)
    assert ray.get(trainers[0].wait.remote(2, 120), timeout=150) == 2
    assert [r[0] for r in restore_all(trainers)] == [2, 2, 2]
    ray.get([t.step_and_save.remote(3) for t in trainers], timeout=120)
    assert ray.get(trainers[0].wait.remote(3, 120), timeout=150) == 3
    assert "MemoryBudgetError" in ray.get(trainers[0].save_too_big.remote(4), timeout=120)
    wait_for(lambda: status(job)["failed_snapshots"] >= 1, timeout=60, what="step 4's failure to reach the coordinator")
    wait_for(lambda: status(job)["durable_step"] == 3, timeout=60, what="step 3 to be spilled")

    settle(
        "the metrics of the saves, the restore and the failure",
        {
            "committed step": lambda s: values(s, "ray_memsnap_committed_step", job=JOB) == [3.0],
            "durable step": lambda s: values(s, "ray_memsnap_durable_step", job=JOB) == [3.0],
            "training step": lambda s: (
                by_node(s, "ray_memsnap_training_step") == {n: 4.0 if i == 0 else 3.0 for i, n in enumerate(nodes)}
            ),
            "captures": lambda s: by_node(s, "ray_memsnap_capture_seconds_count") == {n: 4.0 for n in nodes},
            "sends": lambda s: by_node(s, "ray_memsnap_send_seconds_count") == {n: 4.0 for n in nodes},
            "restores": lambda s: (
                by_node(s, "ray_memsnap_restore_seconds_count", tier="local") == {n: 1.0 for n in nodes}
            ),
            "failures": lambda s: by_node(s, "ray_memsnap_snapshots_failed_total") == {nodes[0]: 1.0},
            "spills": lambda s: len(by_node(s, "ray_memsnap_spill_seconds_count")) == 3,
        },
    )

    st = status(job)
    assert st["protection"] and all(p >= 1 for p in st["protection"].values())
    settle(
        "the coordinator's gauges",
        {
            "protection": lambda s: (
                {lab["group"]: v for n, lab, v in s if n == "ray_memsnap_protection_level"}
                == {g: float(p) for g, p in st["protection"].items()}
            ),
            "local bytes": lambda s: (
                by_node(s, "ray_memsnap_bytes", tier="local") == {n: float(a["local"]) for n, a in st["agents"].items()}
            ),
            "peer bytes": lambda s: (
                by_node(s, "ray_memsnap_bytes", tier="peer")
                == {n: float(a["held"] + a["parity"]) for n, a in st["agents"].items()}
            ),
            "durable bytes": lambda s: (
                by_node(s, "ray_memsnap_bytes", tier="durable")
                == {n: float(a["spill"]["bytes"]) for n, a in st["agents"].items()}
            ),
            "budget": lambda s: by_node(s, "ray_memsnap_memory_budget_bytes") == {n: float(256 << 20) for n in nodes},
            "re-protection idle": lambda s: values(s, "ray_memsnap_reprotect_running", job=JOB) == [0.0],
            "nothing dropped": lambda s: values(s, "ray_memsnap_reprotect_dropped", job=JOB) == [0.0],
        },
    )
    assert all(a["local"] > 0 and a["held"] > 0 and a["spill"]["bytes"] > 0 for a in st["agents"].values())


def test_commit_lag_counts_the_snapshots_begun_since_the_last_commit(job):
    nodes = job["nodes"]
    settle(
        "the commit lag and commit times",
        {
            # node 0 began step 4, which failed: step 3 is the newest committed
            "lag": lambda s: (
                by_node(s, "ray_memsnap_commit_lag_steps") == {nodes[0]: 1.0, nodes[1]: 0.0, nodes[2]: 0.0}
            ),
            "commit times": lambda s: by_node(s, "ray_memsnap_commit_seconds_count") == {n: 4.0 for n in nodes},
        },
    )


def test_status_json_and_table_from_the_running_job(job):
    st = status(job)
    out = cli(job, "status", JOB, "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert (s["job"], s["committed_step"], s["durable_step"], s["newest_begun"], s["lag_steps"]) == (JOB, 3, 3, 4, 1)
    assert s["protection"] == st["protection"] and sorted(s["agents"]) == sorted(job["nodes"])
    assert s["last_restore"]["tier"] == "local" and s["last_restore"]["step"] == 2

    out = cli(job, "status", JOB)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"job {JOB}: committed step 3 (") and "lag 1 step(s) behind snapshot 4" in lines[0]
    assert "last restore: step 2 from local" in out.stdout
    rows = {line.split()[0]: line for line in lines if line[:12] in {n[:12] for n in job["nodes"]}}
    assert sorted(rows) == sorted(n[:12] for n in job["nodes"])
    assert all("256.0 MiB" in row and "step 3" in row for row in rows.values())


def test_jobs_lists_the_job_and_an_unknown_job_is_one_line_exit_2(job):
    out = cli(job, "jobs", "--json")
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)[JOB]
    assert found["coordinator"] is True and sorted(found["agents"]) == sorted(job["nodes"])

    out = cli(job, "status", "no-such-job")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("memsnap status: no memsnap job 'no-such-job'")
    assert JOB in out.stderr


def test_shutdown_refuses_without_a_terminal_then_frees_the_job_with_yes(job):
    out = cli(job, "shutdown", JOB)
    assert out.returncode == 1 and "pass --yes" in out.stderr
    assert JOB in json.loads(cli(job, "jobs", "--json").stdout)

    out = cli(job, "shutdown", JOB, "--yes")
    assert out.returncode == 0, out.stderr
    assert JOB not in json.loads(cli(job, "jobs", "--json").stdout)
    from memsnap.memory import shmdir

    assert shmdir.arena_files(JOB) == []
