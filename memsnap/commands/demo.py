"""``memsnap demo``: a node killed mid-training on a simulated Ray cluster, recovered in place
(the survivors keep their processes; a warm standby takes the lost rank from peers' RAM)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import textwrap

DEFAULT_FROZEN_MIB = 128.0
QUICK_FROZEN_MIB = 4.0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser(
        "demo",
        help="kill a node mid-training on a local Ray cluster and recover in place from RAM",
        description="Starts a simulated multi-node Ray cluster on 127.0.0.1, trains a small "
        "transformer (with a frozen table beside it, so each rank's state has a "
        "realistic size) on Ray actors, snapshots every step into peers' RAM, and kills "
        "a rank's node. By default the job recovers in place (memsnap.inplace): the "
        "surviving ranks keep their processes and roll back from their own node's RAM, "
        "a warm standby takes the lost rank from its peers' RAM; the summary shows where "
        "the seconds went and the survivors' process ids. With --restart, Ray Train "
        "restarts the whole worker group instead. Then it checks the loss curve and every "
        "rank's final state against a run that never failed, bit for bit, and compares "
        "the lost rank's restore from peers with reading its bytes back from disk.",
    )
    ap.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    ap.add_argument("-k", type=int, default=2, help="Reed-Solomon data shards (default 2)")
    ap.add_argument("-m", type=int, default=1, help="Reed-Solomon parity shards (default 1)")
    ap.add_argument("--model", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    ap.add_argument(
        "--failure-step",
        type=int,
        action="append",
        dest="failure_steps",
        help="kill a node after this step (repeat for more failures; default 15)",
    )
    ap.add_argument(
        "--failures",
        type=int,
        default=None,
        help="number of node kills, spread over the run (instead of --failure-step)",
    )
    ap.add_argument(
        "--frozen-mib",
        type=float,
        default=None,
        help=f"MiB of frozen state per rank beside the model, snapshotted and restored with it "
        f"(default {DEFAULT_FROZEN_MIB:g}; --quick: {QUICK_FROZEN_MIB:g}; 0: the model's state only)",
    )
    ap.add_argument("--spill-every", type=int, default=10, help="spill to disk every N steps")
    ap.add_argument("--out", default="memsnap-demo", help="directory for logs, spill and the plot")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"a smaller, faster run (tiny model, 3 nodes with RS(1,1), 16 steps, {QUICK_FROZEN_MIB:g} MiB frozen)",
    )
    ap.add_argument(
        "--restart",
        action="store_true",
        help="recover by restarting the whole job under Ray Train (every rank's process), "
        "as without memsnap.inplace, instead of in place",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    ap.set_defaults(func=run)
    return ap


def options(args: argparse.Namespace):
    from memsnap.demo.driver import DemoOptions

    nodes, steps, model = args.nodes, args.steps, args.model
    frozen = DEFAULT_FROZEN_MIB
    if args.quick:
        nodes, steps, model, frozen = 3, 16, "tiny", QUICK_FROZEN_MIB
        if args.k + args.m + 1 > nodes:  # RS(2,1) needs 4 nodes: replicate instead
            args.k, args.m = 1, 1
    if args.failure_steps:
        fails = tuple(args.failure_steps)
    elif args.failures:
        fails = tuple(steps * (i + 1) // (args.failures + 1) for i in range(args.failures))
    else:
        fails = (max(1, steps * 3 // 8),)
    return DemoOptions(
        nodes=nodes,
        k=args.k,
        m=args.m,
        model=model,
        steps=steps,
        failure_steps=fails,
        spill_every=min(args.spill_every, max(1, steps // 4)),
        out=args.out,
        frozen_mib=frozen if args.frozen_mib is None else args.frozen_mib,
        mode="restart" if args.restart else "inplace",
    )


def run(args: argparse.Namespace) -> int:
    from memsnap.demo.driver import run_demo

    try:
        opts = options(args)
    except ValueError as exc:
        print(f"memsnap demo: {exc}", file=sys.stderr)
        return 2
    # Ray's driver prints node-death notices (with raylet log dumps) to stdout while the demo
    # kills nodes: with --json they go to stderr, so stdout is one JSON object; in the summary
    # mode they are kept aside and shown (on stderr) only if the demo fails.
    if args.json:
        with _stdout_to(2):
            report = run_demo(opts, progress=False)
        print(json.dumps(report, indent=2))
    else:
        with tempfile.TemporaryFile() as notices:
            try:
                with _stdout_to(notices.fileno()):
                    report = run_demo(opts, progress=True)
            except BaseException:
                notices.seek(0)
                sys.stderr.write(notices.read().decode(errors="replace"))
                raise
        print(summary(report))
    ok = report["bitwise_identical"] and report["final_params_identical"]
    return 0 if ok and report.get("survivors_kept_their_processes") is not False else 1


@contextlib.contextmanager
def _stdout_to(fd: int):
    """Point file descriptor 1 at ``fd`` for the block (Ray writes to it from C++ too)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(fd, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        with contextlib.suppress(OSError):  # seen closed already after Ray's shutdown
            os.close(saved)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / (1 << 20):.1f} MiB"


def _rate(side: dict) -> str:
    if not side.get("seconds"):
        return "n/a"
    gib = side["gib_per_s"]
    rate = f"{gib:.2f} GiB/s" if gib >= 0.1 else f"{gib * 1024:.1f} MiB/s"
    return f"{_mib(side['bytes'])} in {side['seconds']:.2f} s = {rate}"


def _recovery_line(r: dict) -> list[str]:
    rec = r["recovery_seconds"]
    fmt = lambda v: "n/a" if v is None else f"{v:.2f} s"  # noqa: E731
    if r.get("mode", "restart") == "restart":
        return [
            f"  failure -> training again    detect {fmt(rec['detect'])}, restart {fmt(rec['restart'])}, "
            f"restore {fmt(rec['restore'])} (slowest rank, from its first call)"
        ]
    first = r["failures"][0] if r["failures"] else {}
    pids = ", ".join(
        f"rank {k} {a} -> {b}"
        for k, (a, b) in sorted(first.get("survivor_pids", {}).items(), key=lambda kv: int(kv[0]))
    )
    tiers = sorted(set(first.get("survivor_tiers", {}).values()))
    kept = "kept" if r.get("survivors_kept_their_processes") else "NOT kept"
    return [
        f"  failure -> training again    {fmt(rec['total'])} in place: first sign {fmt(rec['first_sign'])}, "
        f"detect {fmt(rec['detect'])}, re-form {fmt(rec['reform'])}, restore {fmt(rec['restore'])}, "
        f"first step {fmt(rec['first_step'])}",
        f"  survivors' processes         {kept} ({pids}); rolled back from: {', '.join(tiers) or 'n/a'}",
    ]


def summary(r: dict) -> str:
    cmp_ = r["restore_compare"]
    peer, disk = cmp_["peer"], cmp_["disk"]
    lines = [
        "",
        f"memsnap demo: {r['nodes']} nodes, RS({r['k']},{r['m']}), {r['steps']} steps, "
        f"{_mib(peer['bytes'] or disk['bytes'])} of state per rank "
        + (f"({r['frozen_mib']:g} MiB of it a frozen table)" if r["frozen_mib"] else "(the model's alone)"),
        f"  node killed after step       {r['failure_step']}",
        f"  training resumed from step   {r['resumed_from_step']}  (served by: {r['restore_tier']})",
        *_recovery_line(r),
        f"  lost rank, from peers' RAM   {_rate(peer)}  (step {peer['step']}, into the live tensors, "
        f"verified; {peer['restoring_ranks']} ranks restoring at once)",
        f"  same rank, from disk         {_rate(disk)}  (step {disk['step']}: read {disk['read_s']:.2f} s, "
        f"verify and load {disk['apply_s']:.2f} s)",
        f"                               the job's spill directory, page cache dropped ({disk['cache_drop']}): "
        f"{disk['cached_pages_before']} of {disk['pages']} pages cached when the read began",
    ]
    final = r.get("final_spill") or {}
    if disk["step"] != r["steps"] - 1:  # the final step's spill did not land: say what the job saw
        lines.append(
            f"  NOTE: the disk holds step {disk['step']}, not the final step {r['steps'] - 1}: the final step "
            f"committed as {final.get('committed')}, its spill returned {final.get('durable')}"
        )
    if cmp_["why_disk_wins"]:
        close = disk["gib_per_s"] <= 1.1 * peer["gib_per_s"]  # within 10%: a tie, not a win
        lines.append("  why disk keeps up here:" if close else "  why disk is ahead here:")
        for why in cmp_["why_disk_wins"]:
            lines += textwrap.wrap(why, 100, initial_indent="    - ", subsequent_indent="      ")
    lines += [
        f"  loss curve vs. no failure    {'bitwise identical' if r['bitwise_identical'] else 'DIFFERENT'}",
        f"  final state vs. no failure   {'bitwise identical' if r['final_params_identical'] else 'DIFFERENT'}"
        " (every rank's weights and frozen table)",
        f"  plot                         {r['plot']}",
        f"  total                        {r['total_seconds']:.0f} s",
    ]
    return "\n".join(lines)
