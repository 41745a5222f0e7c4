"""The test suites under load: every suite run several times in a row while busy-loop
processes keep every core of the machine busy, as on a CI machine shared with another job.
A test that fails here once is a race to fix, not noise.

    python bench/loaded_suite.py [--runs 3] [--busy 2] [--suites default slow] [--slow-runs N]
        -> bench/results/loaded_suite.md (rewritten after every suite, so a stopped run keeps
           what it measured)

``default`` is the README's test command (``pytest``), ``slow`` the multi-node Ray suites
(``pytest -m "slow and not demo"``). Each run's counts come from pytest's JUnit XML; the
machine's 1-minute load average is sampled every 5 s throughout. The busy loops are killed
at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITES = {"default": [], "slow": ["-m", "slow and not demo"]}


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


class LoadSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])


def counts(xml: Path) -> dict:
    """Tests, failures, errors and skips from pytest's JUnit XML (every <testsuite>)."""
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.parse(xml).getroot()
    for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
        for key in out:
            out[key] += int(suite.get(key, 0))
    failed, why = [], {}
    for case in root.iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            name = f"{case.get('classname')}::{case.get('name')}"
            failed.append(name)
            why[name] = _one_line(bad.get("message") or bad.text or "")
    skipped = sorted(
        {_module(case.get("classname", "")) for case in root.iter("testcase") if case.find("skipped") is not None}
    )
    return {**out, "failed": failed, "why": why, "skipped_in": skipped}


def _one_line(message: str, limit: int = 300) -> str:
    """What pytest said of a failure, on one line: kept in the report, so a failure seen once
    can be told apart from the next one even after the logs are gone."""
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _module(classname: str) -> str:
    """``tests.test_rng`` or ``tests.test_cuda.TestCuda`` -> the test module's name."""
    parts = classname.split(".")
    return next((p for p in reversed(parts) if p.startswith("test_")), parts[-1])


def run_suite(name: str, log: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="memsnap-loaded-") as tmp:
        xml = Path(tmp) / "junit.xml"
        sampler = LoadSampler()
        sampler.start()
        t = time.monotonic()
        with open(log, "ab") as f:
            rc = subprocess.call(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *SUITES[name]],
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        wall = time.monotonic() - t
        sampler.stop.set()
        sampler.join()
        got = (
            counts(xml)
            if xml.exists()
            else {
                "tests": 0,
                "failures": 0,
                "errors": 1,
                "skipped": 0,
                "failed": ["(pytest wrote no report)"],
                "why": {},
                "skipped_in": [],
            }
        )
    load = sampler.samples or [os.getloadavg()[0]]
    return {
        "suite": name,
        "rc": rc,
        "wall": wall,
        "load_min": min(load),
        "load_mean": sum(load) / len(load),
        "load_max": max(load),
        **got,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes (default: 2, one per core here)")
    ap.add_argument("--suites", nargs="+", choices=sorted(SUITES), default=["default", "slow"])
    ap.add_argument(
        "--slow-runs",
        type=int,
        default=None,
        help="run the slow suite only in the first N runs (default: every run); it takes tens of minutes under load",
    )
    ap.add_argument("--out", default=str(HERE / "results" / "loaded_suite.md"))
    ap.add_argument(
        "--log",
        default=None,
        help="pytest's output, all runs (default: memsnap-loaded-suite.log in the temp directory)",
    )
    args = ap.parse_args()
    if args.runs < 1 or args.busy < 0:
        sys.exit(f"--runs {args.runs} --busy {args.busy}: need at least 1 run and 0 or more busy loops")
    out = Path(args.out)
    log = Path(args.log) if args.log else Path(tempfile.gettempdir()) / "memsnap-loaded-suite.log"
    log.write_bytes(b"")
    begin = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.commit = _commit()  # before the report is first written: it may be a tracked file
    results = []
    loops = busy_loops(args.busy)
    try:
        for i in range(1, args.runs + 1):
            for name in args.suites:
                if name == "slow" and args.slow_runs is not None and i > args.slow_runs:
                    continue
                print(f"[loaded_suite] run {i}/{args.runs}: {name} ...", file=sys.stderr, flush=True)
                r = run_suite(name, log)
                r["run"] = i
                results.append(r)
                print(
                    f"[loaded_suite]   {r['tests']} tests, {r['failures']} failed, {r['errors']} errors, "
                    f"{r['skipped']} skipped in {r['wall'] / 60:.1f} min (load {r['load_mean']:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
                write(out, args, begin, results, log, quiet=True)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    write(out, args, begin, results, log)


def _commit() -> str:
    """The checkout's commit (``+`` when its tracked files differ from it)."""
    from memsnap.durable.meta import git_commit

    got = git_commit(str(ROOT))
    return "unknown" if got is None else got["commit"][:7] + ("+" if got["dirty"] else "")


def write(out: Path, args, begin: str, results: list[dict], log: Path, quiet: bool = False) -> None:
    green = all(r["rc"] == 0 and not r["failures"] and not r["errors"] for r in results)
    lines = [
        "# The test suites under load (`bench/loaded_suite.py`)",
        "",
        f"`python bench/loaded_suite.py --runs {args.runs} --busy {args.busy} --suites {' '.join(args.suites)}"
        f"{'' if getattr(args, 'slow_runs', None) is None else f' --slow-runs {args.slow_runs}'}`; "
        f"started {begin}; commit {getattr(args, 'commit', None) or _commit()}; {os.cpu_count()} CPUs. {args.busy} busy-loop processes (`while True: pass`) ran for "
        "the whole time, so the suites had to share every core, as on a CI machine another job shares.",
        "",
        "| run | suite | tests | passed | failed | errors | skipped | minutes | load (1-min avg) min / mean / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        passed = r["tests"] - r["failures"] - r["errors"] - r["skipped"]
        lines.append(
            f"| {r['run']} | {r['suite']} | {r['tests']} | {passed} | {r['failures']} | {r['errors']} | "
            f"{r['skipped']} | {r['wall'] / 60:.1f} | {r['load_min']:.1f} / {r['load_mean']:.1f} / "
            f"{r['load_max']:.1f} |"
        )
    lines += ["", f"**{'Every run green.' if green else 'Not green.'}**"]
    failed = [(r["run"], r["suite"], t, r.get("why", {}).get(t)) for r in results for t in r["failed"]]
    if failed:
        lines += ["", "Failed:", ""] + [f"* run {i}, {s}: `{t}`" + (f": {w}" if w else "") for i, s, t, w in failed]
    skipped_in = sorted({m for r in results for m in r["skipped_in"]})
    if skipped_in:
        lines += ["", "Skipped tests are in: " + ", ".join(f"`{m}`" for m in skipped_in) + "."]
    out.write_text("\n".join(lines) + "\n")
    if quiet:
        return
    print(out.read_text())
    print(f"pytest output: {log}", file=sys.stderr)


if __name__ == "__main__":
    main()
