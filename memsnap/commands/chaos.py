"""``memsnap chaos``: inject faults into a running Ray job on a seeded schedule, and log when each landed."""

from __future__ import annotations

import argparse
import json
import sys
import time

from memsnap.commands._cluster import add_address, address
from memsnap.commands._common import printable
from memsnap.errors import ConfigError

_INTS = ("at_step", "limit_bytes")
_FLOATS = ("at_s", "duration_s")

EXAMPLES = """examples:
  memsnap chaos --dry-run --mtbf 300 --kinds kill_node,stall --nodes 4 --horizon 1800 --duration 10 --seed 7
  memsnap chaos --address HEAD:6379 --yes-kill-nodes --job train --log faults.jsonl \\
      --fault "kill_node at_s=60" --fault "stall at_s=120 target=ab12cd duration_s=20" \\
      --fault "preempt at_step=500 target=pool=spot how=both duration_s=30"
  memsnap chaos --timeline faults.jsonl
"""


def parse_fault(spec: str):
    """``"KIND key=value ..."`` -> ``Fault`` (e.g. ``"stall at_s=30 target=3 duration_s=5"``)."""
    from memsnap.chaos import Fault

    words = spec.split()
    if not words:
        raise ConfigError("--fault is empty; give e.g. --fault 'kill_node at_s=30'")
    fields: dict = {"kind": words[0]}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not value:
            raise ConfigError(f"--fault {spec!r}: {word!r} is not key=value")
        fields[key] = _value(key, value, spec)
    return Fault.from_dict(fields)


def _value(key: str, value: str, spec: str):
    try:
        if key in _INTS:
            return int(value)
        if key in _FLOATS:
            return float(value)
    except ValueError:
        raise ConfigError(f"--fault {spec!r}: {key}={value!r} is not a number") from None
    if key == "process" and value.isdigit():
        return int(value)
    if key == "target" and value.lower() in ("any", "none"):
        return None
    return value


def schedule(args: argparse.Namespace):
    from memsnap.chaos import Schedule

    if args.fault and args.mtbf is not None:
        raise ConfigError("give either --fault (a fixed schedule) or --mtbf (a Poisson one), not both")
    if args.fault:
        return Schedule.fixed([parse_fault(s) for s in args.fault], seed=args.seed)
    if args.mtbf is None:
        raise ConfigError(
            "no faults to inject: give --fault 'KIND at_s=T ...' (repeatable) or --mtbf SECONDS "
            "--horizon SECONDS for a Poisson schedule"
        )
    if args.horizon is None:
        raise ConfigError("--mtbf needs --horizon SECONDS, when the Poisson schedule ends")
    nodes = args.nodes or "1"
    nodes = int(nodes) if nodes.isdigit() else [n for n in nodes.split(",") if n]
    options = {} if args.limit_bytes is None else {"limit_bytes": args.limit_bytes}
    return Schedule.poisson(
        mtbf_s=args.mtbf,
        kinds=args.kinds.split(","),
        nodes=nodes,
        seed=args.seed,
        horizon_s=args.horizon,
        duration_s=args.duration,
        **options,
    )


def run(args: argparse.Namespace) -> int:
    if args.timeline:
        return show_timeline(args.timeline)
    sched = schedule(args)
    if args.dry_run:
        for f in sched.to_list():
            print(json.dumps(f, sort_keys=True))
        print(f"{len(sched)} fault(s), seed {sched.seed} (dry run: nothing injected)", file=sys.stderr)
        return 0
    from memsnap.chaos import Injector

    log_path = args.log or time.strftime("memsnap-chaos-%Y%m%d-%H%M%S.jsonl")
    inj = Injector(
        sched,
        address=address(args),
        log=log_path,
        job=args.job,
        confirm=args.yes_kill_nodes,
        allow_head=args.allow_head,
    )
    print(
        f"injecting {len(sched)} fault(s) (seed {sched.seed}) into the Ray cluster at {address(args)}; log: {log_path}",
        file=sys.stderr,
    )
    shown = 0
    deadline = time.monotonic() + (args.timeout if args.timeout else _span(sched) + 120)
    inj.start()
    try:
        while not inj.wait(0.5) and time.monotonic() < deadline:
            shown = _print_new(inj.events, shown)
    except KeyboardInterrupt:
        print("interrupted: stopping (faults not yet landed will not land)", file=sys.stderr)
    finally:
        events = inj.stop()
    _print_new(events, shown)
    failed = [e for e in events if not e.ok]
    print(
        f"{sum(e.phase == 'fault' for e in events)} of {len(sched)} fault(s) landed, {len(failed)} failed; "
        f"timeline in {log_path}",
        file=sys.stderr,
    )
    return 1 if failed else 0


def _span(sched) -> float:
    return max([f.at_s + (f.duration_s or 0) for f in sched.faults if f.at_s is not None], default=3600.0)


def _print_new(events, shown: int) -> int:
    for e in events[shown:]:
        print(_line(e), flush=True)
    return len(events)


def _line(e) -> str:
    when = f"t={e.planned_s:.1f}s" if e.planned_s is not None else f"step {e.planned_step}"
    what = "ok" if e.ok else f"FAILED {e.error}"
    target = (e.target or "-")[:12]
    return printable(
        f"{time.strftime('%H:%M:%S', time.localtime(e.landed))}  +{e.landed_s:8.2f}s  {e.kind:<12} "
        f"{e.phase:<5} {target:<12} ({when})  {what}  {json.dumps(e.detail, sort_keys=True)}"
    )


def show_timeline(path: str) -> int:
    from memsnap.chaos import read_log

    tl = read_log(path)
    print(
        f"run started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(tl.header['time']))} on "
        f"{printable(tl.header['cluster'])}, seed {tl.header['seed']}, {len(tl.header['schedule'])} fault(s) planned"
    )
    for e in tl.events:
        print(_line(e))
    if tl.stopped is None:
        print("(no stop record: the injector did not stop cleanly)")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser(
        "chaos",
        help="inject faults into a running Ray job on a seeded schedule",
        description=__doc__.split("\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_address(ap)
    ap.add_argument(
        "--yes-kill-nodes",
        action="store_true",
        help="confirm: the faults kill real nodes and processes of the cluster (required)",
    )
    ap.add_argument("--job", default=None, help="the memsnap job (stall, fill_disk's spill directory, at_step)")
    ap.add_argument(
        "--fault",
        action="append",
        metavar="'KIND key=value ...'",
        help="one fault of a fixed schedule (repeatable); KIND is kill_node, kill_process, stall, "
        "fill_disk or preempt; keys: at_s, at_step, target, duration_s, process, path, limit_bytes, how",
    )
    ap.add_argument(
        "--mtbf", type=float, default=None, help="a Poisson schedule: mean seconds between failures per node"
    )
    ap.add_argument("--kinds", default="kill_node", help="comma-separated fault kinds of the Poisson schedule")
    ap.add_argument("--nodes", default=None, help="how many nodes fail (a count), or comma-separated node targets")
    ap.add_argument("--horizon", type=float, default=None, help="seconds after start when the Poisson schedule ends")
    ap.add_argument("--duration", type=float, default=None, help="seconds a stall, fill or drain deadline lasts")
    ap.add_argument("--limit-bytes", type=int, default=None, help="the most bytes a fill_disk writes")
    ap.add_argument("--seed", type=int, default=0, help="the schedule's seed (same seed, same faults)")
    ap.add_argument("--allow-head", action="store_true", help="let faults land on the head node too")
    ap.add_argument("--log", default=None, help="the JSON-lines timeline (default: memsnap-chaos-DATE.jsonl)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="stop after this many seconds (default: the schedule's span + 120 s)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the schedule and exit; inject nothing")
    ap.add_argument("--timeline", metavar="LOG", default=None, help="print the timeline of a log and exit")
    ap.set_defaults(func=run)
    return ap
