"""The metadata every durable step records by itself: step, time, versions, code, host, world."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from memsnap.errors import ConfigError

SECRET_WORDS = ("token", "key", "password", "passwd", "secret")  # in an option's name, any case
REDACTED = "<redacted>"
ARGV_ENV = "MEMSNAP_RECORD_ARGV"  # "redact" (default), "raw", or "off"


def git_commit(cwd: str) -> dict[str, Any] | None:
    """The commit checked out in ``cwd`` (and whether the tree is dirty), or None outside git."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, timeout=5)
        if out.returncode:
            raise OSError(out.stderr.strip())
        return out.stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "-uno"))}
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str | None]:
    """The versions a step was made with: memsnap, python, torch, pyarrow, numpy and ray
    (None: not installed). Both the durable format and a spill record these; read from the
    installed packages' metadata, so that the coordinator never imports torch for them."""
    from importlib import metadata

    import memsnap

    out: dict[str, str | None] = {"memsnap": memsnap.__version__, "python": platform.python_version()}
    for pkg in ("torch", "pyarrow", "numpy", "ray"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def has_optimizer(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` holds optimizer state (a ``torch.optim.Optimizer`` or an ``optim*`` key)."""
    import torch

    return any(isinstance(v, torch.optim.Optimizer) or k.lower().startswith("optim") for k, v in state.items())


def check_user(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The caller's metadata as a JSON-safe dict; ConfigError naming the bad value otherwise."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a dict (e.g. {{'loss': 0.3}}), got {type(metadata).__qualname__}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"metadata must be JSON-serialisable (numbers, strings, lists, dicts): {exc}; "
            "convert tensors with .item() / .tolist()"
        ) from None


def _secret(name: str) -> bool:
    low = name.lower()
    return any(word in low for word in SECRET_WORDS)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of options whose name looks like a secret (holds ``token``,
    ``key``, ``password``, ``passwd`` or ``secret``) replaced by ``<redacted>``, in each form:
    ``--api-token=v``, ``--api-token v`` and ``HF_TOKEN=v`` (or ``db.password=v``)."""
    out: list[str] = []
    hide = False
    for arg in argv:
        if hide and not arg.startswith("--"):  # the value of the option before
            out.append(REDACTED)
            hide = False
            continue
        name, eq, _ = arg.partition("=")
        hide = bool(not eq and arg.startswith("-") and _secret(arg))
        out.append(f"{name}={REDACTED}" if eq and _secret(name) else arg)
    return out


def record_argv(argv: Sequence[str] | None = None) -> list[str] | None:
    """The command line a step records: redacted (``redact_argv``) unless the environment says
    ``MEMSNAP_RECORD_ARGV=raw`` (as it is) or ``off`` (not at all: None)."""
    argv = list(sys.argv if argv is None else argv)
    mode = os.environ.get(ARGV_ENV, "redact").strip().lower() or "redact"
    if mode not in ("redact", "raw", "off"):
        raise ConfigError(f"{ARGV_ENV}={mode!r} is not one of redact (the default), raw, off")
    return None if mode == "off" else argv if mode == "raw" else redact_argv(argv)


def describe(
    step: int,
    world_size: int,
    state: Mapping[str, Any],
    user: Mapping[str, Any] | None = None,
    milestone: bool = False,
    *,
    git: bool = True,
) -> dict[str, Any]:
    """Everything recorded about one step besides its tensors (``git=False``: leave ``"git"``
    None, for a caller that runs ``git_commit`` itself, e.g. alongside the data write)."""
    now = time.time()
    return {
        "step": step,
        "wall_time": now,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "versions": versions(),
        "git": git_commit(os.getcwd()) if git else None,
        "hostname": socket.gethostname(),
        "world_size": world_size,
        "argv": record_argv(),
        "has_optimizer": has_optimizer(state),
        "milestone": bool(milestone),
        "user": check_user(user),
    }
