"""The ``memsnap`` subcommands: every public module here is one command with ``register``.

A command module defines ``register(subparsers) -> ArgumentParser``, which adds its subparser
and sets ``func`` (``args -> exit code``). Adding a command is adding one file; modules whose
name starts with ``_`` are helpers, not commands.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType


def modules() -> list[ModuleType]:
    """Every command module, by name; one that fails to import is reported and skipped."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        try:
            mod = importlib.import_module(f"{__name__}.{info.name}")
        except Exception as exc:  # one broken command must not take the CLI down
            print(f"memsnap: command module {info.name!r} failed to import: {exc}", file=sys.stderr)
            continue
        if callable(getattr(mod, "register", None)):
            found.append(mod)
    return found
