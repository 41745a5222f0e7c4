"""``memsnap --help`` and the manual agree: docs/cli.md's table names every command the CLI
has and no other, and every option it names for a command is one that command takes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from memsnap.cli import build_parser

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def documented() -> dict[str, set[str]]:
    """``{command: the options its row names}`` from the table of docs/cli.md."""
    rows = {}
    for line in CLI_MD.read_text().splitlines():
        m = re.match(r"\| `memsnap (\w+)[^`]*` \|(.*)", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
    return rows


def subcommands() -> dict[str, argparse.ArgumentParser]:
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_manual_lists_every_command_and_no_other():
    rows = documented()
    assert len(rows) >= 10, "the table of docs/cli.md was not read"
    assert sorted(rows) == sorted(subcommands())


def test_every_option_the_manual_names_is_one_its_command_takes():
    parsers = subcommands()
    unknown = {}
    for name, options in documented().items():
        takes = {s for a in parsers[name]._actions for s in a.option_strings}
        if options - takes:
            unknown[name] = sorted(options - takes)
    assert unknown == {}
