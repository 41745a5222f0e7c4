"""``memsnap status JOB``: the live state of a running job's snapshots, from its coordinator."""

from __future__ import annotations

import argparse
import json
import sys
import time

from memsnap import metrics, naming
from memsnap.commands._cluster import add_address, connect, jobs, not_found
from memsnap.commands._common import human, printable, table
from memsnap.errors import CommitError

CLEAR = "\033[H\033[2J"


def summary(job: str, st: dict) -> dict:
    """The coordinator's ``status()`` plus what the table derives from it: the newest snapshot
    any node began and how many steps the committed one trails it."""
    begun = [a.get("counters", {}).get("newest_begun", -1) for a in st.get("agents", {}).values()]
    newest = max(begun, default=-1)
    newest = None if newest < 0 else newest
    committed = st.get("committed_step")
    lag = None if newest is None else newest - (-1 if committed is None else committed)
    return dict(st, job=job, newest_begun=newest, lag_steps=None if lag is None else max(0, lag))


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _ago(t: float | None, now: float) -> str:
    return "" if not t else f" ({max(0.0, now - t):.0f} s ago)"


def _restore_line(last: dict) -> str:
    if not last or last.get("tier") in (None, "none"):
        return "last restore: none"
    secs = last.get("seconds") or {}
    total = secs.get("total", sum(secs.values()))
    return f"last restore: step {_dash(last.get('step'))} from {last['tier']} in {total:.2f} s"


def _recovery_line(recoveries: list) -> str | None:
    """The newest in-place recovery: who was lost, who took over, where the seconds went."""
    if not recoveries:
        return None
    rec = recoveries[-1]
    split = rec.get("split") or {}
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in split.items() if k != "total" and v is not None)
    total = split.get("total")
    lost = ", ".join(f"rank {r}" for r in sorted(rec.get("lost") or {}, key=int)) or "none"
    return f"last in-place recovery ({len(recoveries)} in all): lost {lost}, generation {rec.get('gen')}, {parts}" + (
        f"; {total:.2f} s to every rank's first step" if total is not None else ""
    )


def _liveness_line(fenced: list, liveness: dict) -> str | None:
    """The nodes memsnap declared lost (fenced), and those whose agent was only slow."""
    slow = liveness.get("slow") or {}
    if not fenced and not slow:
        return None
    parts = []
    if fenced:
        lost = liveness.get("lost") or {}
        parts.append(
            "nodes declared lost (fenced): "
            + "; ".join(f"{n[:12]}" + (f" ({lost[n]})" if n in lost else "") for n in sorted(fenced))
        )
    if slow:
        parts.append(
            "slow agents (answered when silent): " + ", ".join(f"{n[:12]} x{c}" for n, c in sorted(slow.items()))
        )
    return "; ".join(parts)


def _reprotect_line(rp: dict) -> str:
    state = "running" if rp.get("running") else "idle"
    line = (
        f"re-protection: {state}, {rp.get('rebuilt_chunks', 0)} chunk(s) rebuilt, "
        f"{rp.get('local_copies', 0)} local cop{'y' if rp.get('local_copies', 0) == 1 else 'ies'} given back"
    )
    if rp.get("dropped"):
        line += f", {rp['dropped']} step(s) dropped as newer commits pruned them"
    errors = rp.get("errors") or []
    return line + (f", last error: {errors[-1]}" if errors else "")


def _spill_cell(spill: dict | None) -> str:
    if spill is None:
        return "off"
    cell = f"step {_dash(spill.get('spilled_step'))}"
    if spill.get("writing") is not None:
        cell += f", writing {spill['writing']}"
    if spill.get("failures"):
        cell += f", {spill['failures']} failed"
    return cell


def node_rows(st: dict) -> list[list]:
    """One row per agent: its ranks, RAM against its budget, bytes per tier, spill progress."""
    ranks: dict[str, list[int]] = {}
    for rank, node in st.get("members", {}).items():
        ranks.setdefault(node, []).append(int(rank))
    rows = []
    for node, a in sorted(st.get("agents", {}).items()):
        used, budget = a.get("budget_used", 0), a.get("budget", 0)
        tiers = metrics.tier_bytes(a)
        rows.append(
            [
                node[:12],
                ",".join(map(str, sorted(ranks.get(node, [])))) or "spare",
                human(used),
                human(budget),
                f"{100 * used / budget:.0f}%" if budget else "-",
                human(tiers["local"]),
                human(tiers["peer"]),
                human(tiers["durable"]),
                _spill_cell(a.get("spill")),
            ]
        )
    return rows


def render(s: dict, now: float | None = None) -> str:
    """The text table of ``summary(...)``."""
    now = time.time() if now is None else now
    protection = s.get("protection") or {}
    prot = (
        ", ".join(f"group {g}: {lvl}{' (UNPROTECTED)' if lvl <= 0 else ''}" for g, lvl in sorted(protection.items()))
        or "- (nothing committed or not placed yet)"
    )
    head = (
        f"job {s['job']}: committed step {_dash(s.get('committed_step'))}{_ago(s.get('last_commit_time'), now)}, "
        f"lag {_dash(s.get('lag_steps'))} step(s) behind snapshot {_dash(s.get('newest_begun'))}, "
        f"durable step {_dash(s.get('durable_step'))}"
    )
    counts = (
        f"snapshots: {s.get('failed_snapshots', 0)} failed, {s.get('skipped_snapshots', 0)} skipped busy; "
        f"peers {'on' if s.get('peers') else 'off'}, restore generation {s.get('generation', 0)}"
    )
    lines = [
        printable(line)
        for line in (
            head,
            f"protection (further node losses survived): {prot}",
            counts,
            _restore_line(s.get("last_restore") or {}),
            _recovery_line(s.get("recoveries") or []),
            _liveness_line(s.get("fenced") or [], s.get("liveness") or {}),
            _reprotect_line(s.get("reprotect") or {}),
        )
        if line is not None
    ] + [
        "",
        table(["NODE", "RANKS", "RAM USED", "BUDGET", "USE", "LOCAL", "PEER", "SPILLED", "SPILL"], node_rows(s)),
    ]
    return "\n".join(lines)


def fetch(handle, job: str, timeout: float) -> dict:
    """The job's summary from its coordinator; a coordinator that does not answer is a
    ``CommitError`` naming the job and the timeout."""
    import ray

    try:
        return summary(job, ray.get(handle.status.remote(), timeout=timeout))
    except (ray.exceptions.RayError, TimeoutError) as exc:
        raise CommitError(
            f"the coordinator of job {job!r} did not answer within {timeout:.0f} s "
            f"({type(exc).__name__}); is the job restarting? try again, or --timeout"
        ) from None


def run(args: argparse.Namespace) -> int:
    import ray

    connect(args)
    try:
        handle = ray.get_actor(naming.coordinator(args.job), namespace=naming.NAMESPACE)
    except ValueError:
        return not_found("status", args.job, args, jobs())
    try:
        return _show(handle, args)
    except KeyboardInterrupt:  # --watch ends with Ctrl-C
        return 0


def _show(handle, args: argparse.Namespace) -> int:
    while True:
        try:
            s = fetch(handle, args.job, args.timeout)
        except CommitError as exc:
            if not args.watch:
                raise
            print(f"memsnap status: {printable(exc)}", file=sys.stderr, flush=True)  # --watch goes on
            time.sleep(args.interval)
            continue
        if args.json:
            print(json.dumps(s, sort_keys=True), flush=True)
        else:
            print((CLEAR if args.watch and sys.stdout.isatty() else "") + render(s), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.interval)


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("status", help="live state of a running job", description=__doc__.split("\n")[0])
    ap.add_argument("job", metavar="JOB", help="the job name given to Snapshotter(job=...)")
    add_address(ap)
    ap.add_argument("--watch", action="store_true", help="refresh until interrupted (Ctrl-C)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    ap.add_argument("--json", action="store_true", help="one JSON object (per refresh with --watch)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the coordinator's answer")
    ap.set_defaults(func=run)
    return ap
