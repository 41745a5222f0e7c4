"""The ``memsnap`` console script: a small dispatcher over ``memsnap.commands``."""

from __future__ import annotations

import argparse
import sys

from memsnap import __version__, commands
from memsnap.commands._common import DAMAGED, printable
from memsnap.errors import ChecksumError, FormatError, MemsnapError


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="memsnap", description="memsnap: training-state snapshots in peer RAM, with a durable checkpoint format"
    )
    ap.add_argument("--version", action="version", version=f"memsnap {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in commands.modules():
        mod.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command; errors memsnap raises on purpose print as one line (controls escaped),
    exit code 1, or 2 when the checkpoint is damaged (a malformed file or a checksum mismatch)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ChecksumError, FormatError) as exc:
        print(f"memsnap {args.command}: damaged checkpoint: {printable(exc)}", file=sys.stderr)
        return DAMAGED
    except MemsnapError as exc:
        print(f"memsnap {args.command}: error: {printable(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `memsnap ls URI | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
