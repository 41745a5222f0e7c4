"""``memsnap plan``: recommended snapshot intervals and expected lost work, per tier.

Inputs: ``S`` the state per node (GB), ``N`` nodes, the MTBF of one node, the bandwidths
(``Bc`` memcpy, assumed or measured with ``--measure``; ``Bn`` one TCP stream times
``streams``; ``Bd`` durable storage per node; all GB/s), the code ``k+m`` and optionally the
step time. Formulas, all in seconds:

* job MTBF: ``M = mtbf_hours * 3600 / N`` (any node's failure interrupts the job).
* snapshot cost ``C``, the time from ``save`` until the snapshot is safe in that tier, counted
  in full as if training waited for all of it (conservative: memsnap overlaps everything but
  the capture, which makes the real optimum somewhat shorter):

  - ram (local agent RAM): ``C = S / Bc`` (the capture copy);
  - peer (erasure-coded in the group's RAM): ``C = S / Bc + S * (k + m) / k / Bn``: the
    capture plus sending ``k+m`` chunks of ``S/k`` bytes to other nodes (encoding is fused
    with the copy and counted as free);
  - disk (durable storage): ``C = S / Bc + S / Bd`` (the capture plus the spill write).

* restore time ``R``: ram ``S / Bc`` (a copy back); peer ``S / Bn`` (``k`` chunks of ``S/k``
  from the survivors, decoded on the fly); disk ``S / Bd``.
* recommended interval, Young/Daly: ``tau = sqrt(2 * C * M)``; in steps
  ``max(1, round(tau / step_seconds))`` when the step time is given. The formula holds for
  ``C`` well below ``M``; at ``C >= M / 2`` the plan says so.
* expected lost work per failure: ``L = tau / 2 + R`` (half an interval of recomputation on
  average, plus the restore).
* expected overhead (fraction of wall time not training):
  ``C / tau + (tau / 2 + R) / M``.
* the agent's RAM, what ``memory_budget`` must cover (``memsnap.policy.agent_ram``):
  ``S * ((keep + 1) + (keep + 2) * (k + m) / k)``: ``keep + 1`` arena slots of the node's
  own state, and the pieces held for peers for ``keep`` committed versions and two in flight.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

from memsnap.commands import plan_goodput
from memsnap.commands._common import format_duration
from memsnap.errors import ConfigError
from memsnap.policy import agent_ram, require_positive_float, require_positive_int, young_daly_interval

TIERS = ("ram", "peer", "disk")
EPILOG = """formulas (seconds; S state GB per node, B* bandwidths GB/s, N nodes):
  job MTBF  M = mtbf_hours * 3600 / N
  cost      ram S/Bc;  peer S/Bc + S*(k+m)/k/(Bn*streams);  disk S/Bc + S/Bd
  restore   ram S/Bc;  peer S/(Bn*streams);  disk S/Bd
  interval  sqrt(2 * cost * M)            lost work per failure  interval/2 + restore
  overhead  cost/interval + lost/M
  agent RAM (memory_budget)  S * ((keep+1) + (keep+2)*(k+m)/k)"""


@dataclass(frozen=True)
class PlanInputs:
    """What ``memsnap plan`` is given; every field validated, messages name the flag."""

    state_gb: float
    nodes: int
    mtbf_hours: float
    memcpy_gbps: float = 6.0
    network_gbps: float = 2.0
    streams: int = 1
    disk_gbps: float = 1.0
    k: int = 2
    m: int = 1
    keep: int = 2
    step_seconds: float | None = None
    memcpy_measured: bool = False  # memcpy_gbps was measured on this machine (--measure)

    def __post_init__(self) -> None:
        for name in ("state_gb", "mtbf_hours", "memcpy_gbps", "network_gbps", "disk_gbps"):
            require_positive_float("--" + name.replace("_", "-"), getattr(self, name), "pass a positive number")
        if self.step_seconds is not None:
            require_positive_float("--step-seconds", self.step_seconds, "pass the seconds one training step takes")
        for name in ("nodes", "streams", "k", "m", "keep"):
            require_positive_int("--" + name, getattr(self, name), "pass an integer >= 1")
        if self.nodes < self.k + self.m + 1:
            raise ConfigError(
                f"--nodes {self.nodes} is too few for --k {self.k} --m {self.m}: each node's "
                f"k+m={self.k + self.m} chunks go to other nodes, so the job needs at least "
                f"{self.k + self.m + 1} nodes; lower k/m or raise --nodes"
            )


@dataclass(frozen=True)
class TierPlan:
    """The plan for one tier, every duration in seconds."""

    tier: str
    snapshot_cost_s: float
    interval_s: float
    interval_steps: int | None
    restore_s: float
    lost_work_per_failure_s: float
    overhead_fraction: float
    formula_valid: bool


def tier_costs(p: PlanInputs) -> dict[str, tuple[float, float]]:
    """``{tier: (snapshot cost, restore time)}`` in seconds (formulas in the docstring)."""
    s, capture = p.state_gb, p.state_gb / p.memcpy_gbps
    net = p.network_gbps * p.streams
    return {
        "ram": (capture, capture),
        "peer": (capture + s * (p.k + p.m) / p.k / net, s / net),
        "disk": (capture + s / p.disk_gbps, s / p.disk_gbps),
    }


def measure_memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """This machine's copy bandwidth in GB/s: best of ``repeats`` copies between touched buffers."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)  # zeros, then a first copy, touches every page
    best = math.inf
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def job_mtbf_seconds(p: PlanInputs) -> float:
    return p.mtbf_hours * 3600.0 / p.nodes


def plan(p: PlanInputs) -> list[TierPlan]:
    """One ``TierPlan`` per tier, ram, peer, disk."""
    mtbf = job_mtbf_seconds(p)
    return [_tier_plan(tier, cost, restore, mtbf, p.step_seconds) for tier, (cost, restore) in tier_costs(p).items()]


def _tier_plan(tier: str, cost: float, restore: float, mtbf: float, step_seconds: float | None) -> TierPlan:
    tau = young_daly_interval(cost, mtbf)
    steps = None if step_seconds is None else max(1, round(tau / step_seconds))
    lost = tau / 2 + restore
    return TierPlan(tier, cost, tau, steps, restore, lost, cost / tau + lost / mtbf, cost < mtbf / 2)


def format_table(p: PlanInputs, plans: list[TierPlan]) -> str:
    """The plain-text report: inputs, one row per tier, and warnings."""
    mtbf = job_mtbf_seconds(p)
    head = ("tier", "snapshot cost", "interval", "steps", "lost work/failure", "restore", "overhead")
    rows = [head] + [
        (
            t.tier,
            format_duration(t.snapshot_cost_s),
            format_duration(t.interval_s),
            "-" if t.interval_steps is None else str(t.interval_steps),
            format_duration(t.lost_work_per_failure_s),
            format_duration(t.restore_s),
            f"{100 * t.overhead_fraction:.2f}%",
        )
        for t in plans
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        f"{p.state_gb:g} GB/node x {p.nodes} nodes, node MTBF {p.mtbf_hours:g} h -> "
        f"job MTBF {format_duration(mtbf)}; k={p.k} m={p.m}; memcpy {p.memcpy_gbps:.3g} GB/s"
        f"{' (measured)' if p.memcpy_measured else ''}, "
        f"network {p.network_gbps:g} GB/s x {p.streams} stream(s), disk {p.disk_gbps:g} GB/s",
        "",
    ]
    for i, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        f"warning: {t.tier} snapshots cost {format_duration(t.snapshot_cost_s)}, at least "
        "half the job MTBF; Young/Daly does not hold there: snapshot as often as you can "
        "and reduce the cost"
        for t in plans
        if not t.formula_valid
    ]
    lines.append("interval = sqrt(2 x cost x job MTBF); lost work = interval/2 + restore")
    lines.append(
        f"memory_budget per node: at least {agent_ram(p.state_gb, p.k, p.m, p.keep):.3g} GB "
        f"(keep={p.keep}: {p.keep + 1} slots of the node's state, and its peers' pieces for "
        f"{p.keep} committed versions and 2 in flight)"
    )
    return "\n".join(lines)


def to_json(p: PlanInputs, plans: list[TierPlan]) -> str:
    return json.dumps(
        {
            "inputs": asdict(p),
            "job_mtbf_s": job_mtbf_seconds(p),
            "memory_budget_gb": agent_ram(p.state_gb, p.k, p.m, p.keep),
            "tiers": [asdict(t) for t in plans],
        },
        indent=2,
    )


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``memsnap`` command's subparsers."""
    d = PlanInputs.__dataclass_fields__
    ap = subparsers.add_parser(
        "plan",
        help="recommend snapshot intervals per tier",
        description="Recommend snapshot intervals for the ram, peer and disk tiers (Young/Daly) "
        "and show the expected lost work per failure; with --goodput, project the goodput "
        "of memsnap and of disk checkpointing at 1k-16k GPUs from measured figures.",
        epilog=EPILOG + "\n\n" + plan_goodput.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--state-gb", type=float, help="training state per node, GB (required without --goodput)")
    ap.add_argument("--nodes", type=int, help="nodes in the job (required without --goodput)")
    ap.add_argument("--mtbf-hours", type=float, help="MTBF of one node, hours (required without --goodput)")
    for name, text in (
        ("memcpy_gbps", "memory copy, GB/s"),
        ("network_gbps", "one TCP stream, GB/s"),
        ("disk_gbps", "durable storage per node, GB/s"),
    ):
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=float,
            default=d[name].default,
            help=f"{text} (default {d[name].default})",
        )
    for name, text in (
        ("streams", "parallel TCP streams per node"),
        ("k", "data chunks per stripe"),
        ("m", "parity chunks per stripe"),
    ):
        ap.add_argument("--" + name, type=int, default=d[name].default, help=f"{text} (default {d[name].default})")
    ap.add_argument("--step-seconds", type=float, default=None, help="one training step, seconds")
    ap.add_argument(
        "--measure", action="store_true", help="measure this machine's memcpy bandwidth and use it for --memcpy-gbps"
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan_goodput.add_arguments(ap)
    ap.set_defaults(func=run)
    return ap


def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 on success, 2 with a message on stderr for bad inputs."""
    if args.goodput:
        return _run_goodput(args)
    missing = [f"--{n.replace('_', '-')}" for n in ("state_gb", "nodes", "mtbf_hours") if getattr(args, n) is None]
    if missing:
        print(
            f"memsnap plan: error: {', '.join(missing)} required (or --goodput for the goodput projection)",
            file=sys.stderr,
        )
        return 2
    names = [f for f in PlanInputs.__dataclass_fields__ if f != "memcpy_measured"]
    values = {n: getattr(args, n) for n in names}
    if args.measure:
        values.update(memcpy_gbps=measure_memcpy_gbps(), memcpy_measured=True)
    try:
        p = PlanInputs(**values)
    except ConfigError as exc:
        print(f"memsnap plan: error: {exc}", file=sys.stderr)
        return 2
    plans = plan(p)
    print(to_json(p, plans) if args.json else format_table(p, plans))
    return 0


def _run_goodput(args: argparse.Namespace) -> int:
    try:
        measured, clusters = plan_goodput.inputs(args)
    except ConfigError as exc:
        print(f"memsnap plan: error: {exc}", file=sys.stderr)
        return 2
    print(plan_goodput.report(measured, clusters, args.json))
    return 0
