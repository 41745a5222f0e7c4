"""``memsnap plan``: the table, the JSON and input validation."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from memsnap.commands import plan as plan_cmd
from memsnap.errors import ConfigError

BASE = ["--state-gb", "90", "--nodes", "128", "--mtbf-hours", "1000"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="memsnap")
    sub = ap.add_subparsers(dest="command", required=True)
    plan_cmd.register(sub)
    return ap


def invoke(capsys, *argv: str) -> tuple[int, str, str]:
    args = parser().parse_args(["plan", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def expected(state, nodes, mtbf_h, bc=6.0, bn=2.0, bd=1.0, k=2, m=1):
    """The formulas of the issue, written out independently: {tier: (cost, interval, restore, lost)}."""
    mtbf = mtbf_h * 3600 / nodes
    costs = {
        "ram": (state / bc, state / bc),
        "peer": (state / bc + state * (k + m) / k / bn, state / bn),
        "disk": (state / bc + state / bd, state / bd),
    }
    out = {}
    for tier, (c, r) in costs.items():
        tau = (2 * c * mtbf) ** 0.5
        out[tier] = (c, tau, r, tau / 2 + r)
    return out


def test_json_matches_the_formulas(capsys):
    rc, out, err = invoke(capsys, *BASE, "--json", "--step-seconds", "2")
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert data["job_mtbf_s"] == pytest.approx(1000 * 3600 / 128)
    want = expected(90, 128, 1000)
    assert [t["tier"] for t in data["tiers"]] == ["ram", "peer", "disk"]
    for t in data["tiers"]:
        c, tau, r, lost = want[t["tier"]]
        assert t["snapshot_cost_s"] == pytest.approx(c)
        assert t["interval_s"] == pytest.approx(tau)
        assert t["restore_s"] == pytest.approx(r)
        assert t["lost_work_per_failure_s"] == pytest.approx(lost)
        assert t["interval_steps"] == round(tau / 2)
        assert t["formula_valid"] is True
    assert data["inputs"]["k"] == 2 and data["inputs"]["memcpy_gbps"] == 6.0


def test_bandwidths_and_code_change_the_costs(capsys):
    rc, out, _ = invoke(
        capsys,
        "--state-gb",
        "10",
        "--nodes",
        "16",
        "--mtbf-hours",
        "200",
        "--memcpy-gbps",
        "8",
        "--network-gbps",
        "1.5",
        "--streams",
        "2",
        "--disk-gbps",
        "0.5",
        "--k",
        "4",
        "--m",
        "2",
        "--json",
    )
    assert rc == 0
    tiers = {t["tier"]: t for t in json.loads(out)["tiers"]}
    want = expected(10, 16, 200, bc=8, bn=3.0, bd=0.5, k=4, m=2)
    for name, (c, _tau, _r, lost) in want.items():
        assert tiers[name]["snapshot_cost_s"] == pytest.approx(c)
        assert tiers[name]["lost_work_per_failure_s"] == pytest.approx(lost)
        assert tiers[name]["interval_steps"] is None


def test_table_lists_every_tier_with_its_numbers(capsys):
    rc, out, _ = invoke(capsys, *BASE)
    assert rc == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("tier"))
    for col in ("snapshot cost", "interval", "lost work/failure", "restore"):
        assert col in header
    rows = {line.split()[0]: line for line in lines if line.split()[:1] in (["ram"], ["peer"], ["disk"])}
    assert set(rows) == {"ram", "peer", "disk"}
    want = expected(90, 128, 1000)
    for tier, (c, tau, _r, lost) in want.items():
        row = rows[tier]
        assert plan_cmd.format_duration(c) in row
        assert plan_cmd.format_duration(tau) in row
        assert plan_cmd.format_duration(lost) in row
    assert "job MTBF 7.8 h" in out
    assert "warning" not in out


def test_table_warns_when_snapshots_cost_more_than_half_the_mtbf(capsys):
    # 1000 GB at 1 GB/s to disk = 1000+ s; job MTBF = 1 h / 4 = 900 s
    rc, out, _ = invoke(capsys, "--state-gb", "1000", "--nodes", "4", "--mtbf-hours", "1")
    assert rc == 0
    assert "warning: disk snapshots cost" in out
    assert "warning: ram" not in out


@pytest.mark.parametrize(
    "flag, value, needle",
    [
        ("--state-gb", "0", "--state-gb=0.0"),
        ("--state-gb", "nan", "--state-gb=nan"),
        ("--mtbf-hours", "-5", "--mtbf-hours=-5.0"),
        ("--memcpy-gbps", "inf", "--memcpy-gbps=inf"),
        ("--streams", "0", "--streams=0"),
        ("--m", "0", "--m=0"),
        ("--step-seconds", "0", "--step-seconds=0.0"),
        ("--nodes", "3", "--nodes 3 is too few for --k 2 --m 1"),
    ],
)
def test_bad_inputs_exit_2_naming_the_flag(capsys, flag, value, needle):
    argv = dict(zip(BASE[::2], BASE[1::2]))
    argv[flag] = value
    rc, out, err = invoke(capsys, *[x for kv in argv.items() for x in kv])
    assert rc == 2 and out == ""
    assert needle in err and err.startswith("memsnap plan: error:")


def test_non_numbers_are_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["plan", "--state-gb", "lots", "--nodes", "4", "--mtbf-hours", "1"])
    assert info.value.code == 2
    assert "--state-gb" in capsys.readouterr().err


def test_plan_inputs_validate_directly():
    with pytest.raises(ConfigError, match="--nodes=0"):
        plan_cmd.PlanInputs(state_gb=1.0, nodes=0, mtbf_hours=1.0)
    p = plan_cmd.PlanInputs(state_gb=2.0, nodes=8, mtbf_hours=100.0)
    ram = plan_cmd.plan(p)[0]
    mtbf = 100 * 3600 / 8
    assert ram.overhead_fraction == pytest.approx(
        ram.snapshot_cost_s / ram.interval_s + (ram.interval_s / 2 + ram.restore_s) / mtbf
    )
    assert math.isclose(ram.interval_s, math.sqrt(2 * (2 / 6) * mtbf))


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.0004, "0.4 ms"),
        (15.0, "15.0 s"),
        (918.0, "15.3 min"),
        (28125.0, "7.8 h"),
        (3e5, "3.5 d"),
    ],
)
def test_format_duration(seconds, text):
    assert plan_cmd.format_duration(seconds) == text


def test_measure_uses_this_machines_memcpy(capsys):
    rc, out, _ = invoke(capsys, *BASE, "--measure", "--json")
    assert rc == 0
    data = json.loads(out)
    bc = data["inputs"]["memcpy_gbps"]
    assert data["inputs"]["memcpy_measured"] is True
    assert math.isfinite(bc) and bc > 0
    ram = data["tiers"][0]
    assert ram["snapshot_cost_s"] == pytest.approx(90 / bc)
    rc, out, _ = invoke(capsys, *BASE, "--measure")
    assert rc == 0 and "GB/s (measured)" in out.splitlines()[0]


def test_through_the_memsnap_dispatcher(capsys):
    from memsnap import cli

    assert cli.main(["plan", *BASE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t["tier"] for t in data["tiers"]] == ["ram", "peer", "disk"]
    assert cli.main(["plan", "--state-gb", "-1", "--nodes", "8", "--mtbf-hours", "10"]) == 2
    assert "--state-gb=-1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert "sqrt(2 * cost * M)" in capsys.readouterr().out


# --- --goodput: the projection of memsnap/goodput_model.py --------------------------------------
def test_goodput_json_is_the_model(capsys):
    from memsnap import goodput_model as gm

    rc, out, err = invoke(
        capsys,
        "--goodput",
        "--json",
        "--gpus",
        "1024",
        "16384",
        "--detect-s",
        "5",
        "--state-gib-per-gpu",
        "20",
        "--step-seconds",
        "4",
    )
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert [r["cluster"]["gpus"] for r in data["rows"]] == [1024, 16384]
    m = gm.Measured(detect_s=5.0)
    for row in data["rows"]:
        c = gm.Cluster(gpus=row["cluster"]["gpus"], state_gib_per_gpu=20.0, step_s=4.0)
        want = gm.project(c, m)
        assert row["nodes"] == c.nodes and row["job_mtbf_s"] == pytest.approx(c.mtbf_s)
        for got, p in zip(row["systems"], want):
            assert got["system"] == p.system
            assert got["goodput"] == pytest.approx(p.goodput)
            assert got["period_s"] == pytest.approx(p.period_s)
            assert got["binding"] == p.binding[0]


def test_goodput_table_has_every_size_and_system(capsys):
    rc, out, _ = invoke(capsys, "--goodput")
    assert rc == 0
    lines = out.splitlines()
    assert "node MTBF 6335 h" in lines[0]  # the Llama 3 report's rate
    for gpus in ("1024", "2048", "4096", "8192", "16384"):
        assert any(line.startswith(gpus + " ") for line in lines)
    assert sum("memsnap in place, replicas" in line for line in lines) == 5
    assert sum("memsnap in place" in line for line in lines) == 10
    assert sum(line.split()[-6:-5] == ["memsnap"] or " memsnap   " in line for line in lines) == 5
    assert sum("disk (sync)" in line for line in lines) == 5
    assert "closest to running out" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--nic-gibps", "0"], "--nic-gibps=0.0"),
        (["--detect-s", "nan"], "--detect-s=nan"),
        (["--gpus", "1000", "--gpus-per-node", "16"], "--gpus=1000 is not a multiple of gpus_per_node=16"),
        (["--gpus", "16"], "--gpus=16 make 2 nodes, too few"),
    ],
)
def test_goodput_bad_inputs_exit_2_naming_the_flag(capsys, argv, needle):
    rc, out, err = invoke(capsys, "--goodput", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("memsnap plan: error:") and needle in err


def test_without_goodput_the_sizes_are_required(capsys):
    rc, out, err = invoke(capsys, "--nodes", "8")
    assert rc == 2 and out == ""
    assert "--state-gb, --mtbf-hours required" in err


def test_the_plan_names_the_memory_budget_a_node_needs(capsys):
    """keep+1 slots of the node's state, and its peers' pieces, S(k+m)/k per version, for the
    keep committed versions and two in flight; the same figure in the table and the JSON."""
    rc, out, _ = invoke(capsys, "--state-gb", "0.25", "--nodes", "4", "--mtbf-hours", "1", "--k", "2", "--m", "1")
    assert rc == 0
    want = 0.25 * (3 + 4 * 1.5)  # 2.25 GB: what a 2 GB budget refused under load at 256 MiB per rank
    assert f"memory_budget per node: at least {want:.3g} GB (keep=2" in out
    rc, out, _ = invoke(
        capsys,
        "--state-gb",
        "10",
        "--nodes",
        "16",
        "--mtbf-hours",
        "1",
        "--k",
        "4",
        "--m",
        "2",
        "--keep",
        "1",
        "--json",
    )
    assert rc == 0 and json.loads(out)["memory_budget_gb"] == pytest.approx(10 * (2 + 3 * 6 / 4))
    rc, _, err = invoke(capsys, *BASE, "--keep", "0")
    assert rc == 2 and "--keep=0" in err
