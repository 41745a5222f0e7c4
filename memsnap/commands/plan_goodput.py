"""``memsnap plan --goodput``: projected goodput of memsnap (recovering in place, and restarting
the job) and of disk checkpointing at 1k-16k GPUs, from measured figures (memsnap/goodput_model.py holds the model and its formulas)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields

from memsnap import goodput_model as gm
from memsnap.commands._common import format_duration
from memsnap.errors import ConfigError

DEFAULT_GPUS = (1024, 2048, 4096, 8192, 16384)
MEASURED_HELP = {
    "stall_s_per_gib": "memsnap's capture stall per GiB of one GPU's state, s",
    "agent_cpu_s_per_gib": "agent core-seconds per GiB snapshotted",
    "peer_restore_gibps": "restore of a lost node's state from peers, GiB/s",
    "storage_restore_gibps": "one node's restore from storage, GiB/s",
    "detect_s": "seconds until a dead node is noticed",
    "restart_s": "seconds from noticing to every rank running again",
    "inplace_detect_s": "in place: seconds until memsnap itself decides a node is lost",
    "reform_s": "in place: seconds to form the new process group",
    "local_restore_gibps": "in place: a survivor's rollback from its own node's RAM, GiB/s",
    "standby_warm_s": "in place: seconds to warm a new standby after one is used",
    "live_move_gibps": "in place, replicas: a lost node's state sent by the survivors, GiB/s",
}
CLUSTER_HELP = {
    "gpus_per_node": "GPUs per node",
    "state_gib_per_gpu": "training state per GPU, GiB",
    "node_mtbf_h": "MTBF of one node, hours (default: the Llama 3 report's rate)",
    "storage_gibps": "storage bandwidth shared by every node, GiB/s",
    "node_storage_gibps": "one node's link to storage, GiB/s",
    "nic_gibps": "one node's network for snapshots, GiB/s",
    "agent_cores": "host cores per node for the memsnap agent",
    "host_ram_gib": "host RAM per node, GiB",
    "spill_every_s": "memsnap's durable spill period, s",
    "keep": "committed versions each agent keeps",
    "spares": "warm standby nodes of the in-place job",
}
EPILOG = """model (seconds, GiB; S state per node, M = node MTBF / nodes):
  goodput   tau/(tau+C) * (1 - (R + (tau+C)/2 + lag)/M)
  period    tau = max(sqrt(2*C*M), what the pipeline sustains, one step), in whole steps
  memsnap   C = stall/GiB * state/GPU; lag = max(agent CPU/GiB * S / cores, S*(k+m)/k / NIC);
            R = detect + restart + S / peer restore GiB/s
  in place  the same C and lag; R = (1-q) * (inplace detect + reform + max(S / peer, S / local
            restore GiB/s)) + q * the restart's R, q = (1 - exp(-standby warm / M)) ** spares
  disk sync C = max(S*nodes / storage GiB/s, S / node link); R = detect + restart + the same read
  disk async C = the capture stall; the write must end before the next: tau >= write, lag = write
failure rate: Llama 3 report, 419 unexpected interruptions in 54 days on 16,384 GPUs"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("goodput (--goodput)")
    g.add_argument(
        "--goodput",
        action="store_true",
        help="project goodput of memsnap (in place and restarting) and disk checkpointing at 1k-16k GPUs instead",
    )
    g.add_argument(
        "--gpus",
        type=int,
        nargs="+",
        default=list(DEFAULT_GPUS),
        help=f"cluster sizes in GPUs (default {' '.join(map(str, DEFAULT_GPUS))})",
    )
    mdef = {f.name: f.default for f in fields(gm.Measured)}
    for name, text in MEASURED_HELP.items():
        g.add_argument(
            "--" + name.replace("_", "-"), type=float, default=mdef[name], help=f"{text} (default {mdef[name]:g})"
        )
    cdef = {f.name: f.default for f in fields(gm.Cluster)}
    for name, text in CLUSTER_HELP.items():
        kind = int if isinstance(cdef[name], int) else float
        g.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=cdef[name], help=f"{text} (default {cdef[name]:g})"
        )


def inputs(args: argparse.Namespace) -> tuple[gm.Measured, list[gm.Cluster]]:
    """The model's inputs from the parsed flags; ``ConfigError`` naming the flag on a bad value."""
    try:
        measured = gm.Measured(**{n: getattr(args, n) for n in MEASURED_HELP})
        extra = {n: getattr(args, n) for n in CLUSTER_HELP}
        if args.step_seconds is not None:
            extra["step_s"] = args.step_seconds
        extra.update(k=args.k, m=args.m)
        clusters = [gm.Cluster(gpus=g, **extra) for g in args.gpus]
    except ConfigError as exc:
        name, _, rest = str(exc).partition("=")  # the field's name as its flag: --nic-gibps=0.0 ...
        raise ConfigError(f"--{name.replace('_', '-')}={rest}") from None
    return measured, clusters


def report(measured: gm.Measured, clusters: list[gm.Cluster], as_json: bool) -> str:
    rows = [(c, gm.project(c, measured)) for c in clusters]
    if as_json:
        return json.dumps(
            {
                "measured": asdict(measured),
                "rows": [
                    {
                        "cluster": asdict(c),
                        "nodes": c.nodes,
                        "job_mtbf_s": c.mtbf_s,
                        "systems": [dict(asdict(p), binding=p.binding[0]) for p in ps],
                    }
                    for c, ps in rows
                ],
            },
            indent=2,
        )

    c0 = clusters[0]
    lines = [
        f"{c0.state_gib_per_gpu:g} GiB/GPU x {c0.gpus_per_node} GPUs/node, node MTBF {c0.node_mtbf_h:.0f} h, "
        f"storage {c0.storage_gibps:g} GiB/s shared ({c0.node_storage_gibps:g} per node), NIC "
        f"{c0.nic_gibps:g} GiB/s, {c0.agent_cores:g} agent cores, step {c0.step_s:g} s, k={c0.k} m={c0.m}",
        f"measured: stall {measured.stall_s_per_gib:g} s/GiB, agent CPU {measured.agent_cpu_s_per_gib:g} "
        f"core-s/GiB, restore {measured.peer_restore_gibps:g} GiB/s peers / "
        f"{measured.storage_restore_gibps:g} GiB/s storage, detect {measured.detect_s:g} s, "
        f"restart {measured.restart_s:g} s; in place: detect {measured.inplace_detect_s:g} s, re-form "
        f"{measured.reform_s:g} s, local restore {measured.local_restore_gibps:g} GiB/s, a new standby in "
        f"{measured.standby_warm_s:g} s, {c0.spares} spare(s); replicas: the survivors' live state sent "
        f"at {measured.live_move_gibps:g} GiB/s",
        "",
    ]
    head = ("GPUs", "job MTBF", "system", "period", "stall", "recovery", "goodput", "closest to running out")
    table = [head]
    for c, ps in rows:
        for i, p in enumerate(ps):
            name, share = p.binding
            table.append(
                (
                    str(c.gpus) if i == 0 else "",
                    format_duration(c.mtbf_s) if i == 0 else "",
                    p.system,
                    format_duration(p.period_s),
                    format_duration(p.stall_s),
                    format_duration(p.recovery_s),
                    f"{100 * p.goodput:.1f}%",
                    f"{name} {100 * share:.0f}%" + (" (runs out)" if share >= 1 else ""),
                )
            )
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for i, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("goodput = share of wall time that makes lasting progress (see --help for the model)")
    return "\n".join(lines)
