"""Helpers the live-cluster commands share: ``--address``, connecting (never starting) Ray, finding jobs."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from memsnap import naming
from memsnap.commands._common import printable
from memsnap.errors import ConfigError

NOT_FOUND = 2  # the exit code of a command naming a job the cluster does not run


def add_address(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--address", default=None, help="the running Ray cluster (default: $RAY_ADDRESS, else 'auto'); never starts one"
    )


def address(args: argparse.Namespace) -> str:
    return args.address or os.environ.get("RAY_ADDRESS") or "auto"


def connect(args: argparse.Namespace) -> None:
    """Join the existing cluster at ``--address`` as a driver in memsnap's namespace."""
    import ray

    addr = address(args)
    _reachable(addr)
    if addr.split(":")[0] in ("127.0.0.1", "localhost"):
        from memsnap.localcluster import loopback_env

        loopback_env()
    try:
        ray.init(
            address=addr,
            namespace=naming.NAMESPACE,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"no Ray cluster reachable at --address {addr!r} ({exc}); start one with "
            "`ray start --head`, or pass --address HOST:PORT or set RAY_ADDRESS"
        ) from None


def _reachable(addr: str, timeout: float = 5.0) -> None:
    """Refuse at once an address nothing listens on (Ray would retry it for minutes)."""
    import socket

    host, sep, port = addr.replace("ray://", "").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"no Ray cluster reachable at --address {addr!r} ({exc}); pass the head's "
            "GCS address HOST:PORT (`ray status` prints it) or set RAY_ADDRESS"
        ) from None


def jobs() -> dict[str, dict]:
    """``{job: {"coordinator": bool, "agents": [node ids]}}`` from the named actors in memsnap's namespace."""
    import ray.util

    found: dict[str, dict] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor.get("namespace") != naming.NAMESPACE:
            continue
        parsed = parse_actor(actor["name"])
        if parsed is None:
            continue
        job, node = parsed
        entry = found.setdefault(job, {"coordinator": False, "agents": []})
        if node is None:
            entry["coordinator"] = True
        else:
            entry["agents"].append(node)
    return found


def parse_actor(name: str) -> tuple[str, str | None] | None:
    """``(job, node)`` of an agent's actor name, ``(job, None)`` of a coordinator's, else None.
    A job's name may hold ``:``; a node id never does."""
    kind, sep, rest = name.partition(":")
    if not sep or not rest:
        return None
    if kind == "memsnap-coordinator":
        return rest, None
    if kind == "memsnap-agent" and ":" in rest:
        job, _, node = rest.rpartition(":")
        return (job, node) if job and node else None
    return None


def not_found(command: str, job: str, args: argparse.Namespace, known: dict) -> int:
    """Say in one line that ``job`` does not run on the cluster; the exit code."""
    others = ", ".join(sorted(known)) or "none"
    print(
        printable(
            f"memsnap {command}: no memsnap job {job!r} on the Ray cluster at {address(args)} "
            f"(jobs there: {others}); `memsnap jobs` lists them"
        ),
        file=sys.stderr,
    )
    return NOT_FOUND
