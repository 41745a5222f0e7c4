"""``bench/loaded_suite.py``: its counts come from pytest's own JUnit XML, failed and skipped
tests are named, and a failure makes the report say it is not green."""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import loaded_suite  # noqa: E402

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6">
<testcase classname="tests.test_a" name="test_ok"/>
<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2"/></testcase>
<testcase classname="tests.test_b" name="test_setup"><error message="fixture"/></testcase>
<testcase classname="tests.test_cuda.TestCuda" name="test_gpu"><skipped message="no CUDA"/></testcase>
<testcase classname="tests.test_b" name="test_ok2"/>
<testcase classname="tests.test_rng" name="test_cuda_rng"><skipped message="no CUDA"/></testcase>
</testsuite></testsuites>"""


def test_counts_name_the_failed_and_skipped_tests(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(XML)
    got = loaded_suite.counts(xml)
    assert (got["tests"], got["failures"], got["errors"], got["skipped"]) == (6, 1, 1, 2)
    assert got["failed"] == ["tests.test_a::test_bad", "tests.test_b::test_setup"]
    assert got["why"] == {"tests.test_a::test_bad": "assert 1 == 2", "tests.test_b::test_setup": "fixture"}
    assert got["skipped_in"] == ["test_cuda", "test_rng"]


def test_the_report_is_green_only_when_every_run_passed(tmp_path):
    args = argparse.Namespace(runs=2, busy=2, suites=["default"])
    row = {
        "suite": "default",
        "rc": 0,
        "wall": 60.0,
        "load_min": 3.0,
        "load_mean": 4.0,
        "load_max": 5.0,
        "tests": 10,
        "failures": 0,
        "errors": 0,
        "skipped": 1,
        "failed": [],
        "skipped_in": ["test_cuda"],
    }
    out = tmp_path / "r.md"
    loaded_suite.write(out, args, "now", [dict(row, run=1), dict(row, run=2)], tmp_path / "log")
    assert "**Every run green.**" in out.read_text() and "| 2 | default | 10 | 9 | 0 |" in out.read_text()
    bad = dict(
        row,
        run=2,
        rc=1,
        failures=1,
        failed=["tests.test_x::test_race"],
        why={"tests.test_x::test_race": "BrokenPipeError: [Errno 32] Broken pipe"},
    )
    loaded_suite.write(out, args, "now", [dict(row, run=1), bad], tmp_path / "log")
    text = out.read_text()
    assert "**Not green.**" in text
    assert "run 2, default: `tests.test_x::test_race`: BrokenPipeError: [Errno 32] Broken pipe" in text
    assert "; commit " in text  # the code the runs measured


def test_a_failure_message_is_kept_on_one_bounded_line():
    assert loaded_suite._one_line("E  assert 1\n  == 2\n") == "E assert 1 == 2"
    long = loaded_suite._one_line("x" * 1000)
    assert len(long) == 300 and long.endswith("...")
