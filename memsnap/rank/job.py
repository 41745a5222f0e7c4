"""The job-wide calls of the rank side: the configuration every agent of a job shares (and
the check that a job name is not reused with another), starting a spare agent, stopping a
job, and connecting to Ray."""

from __future__ import annotations

from typing import Any

import ray

from memsnap import actors, naming
from memsnap.config import SnapshotConfig
from memsnap.errors import ConfigError
from memsnap.options import resolve_options
from memsnap.rank.client import get
from memsnap.secret import job_secret


def ensure_ray() -> None:
    """Connect to the Ray cluster in ``RAY_ADDRESS`` unless Ray is initialised already, or
    start a local one bound to 127.0.0.1."""
    import os

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=naming.NAMESPACE)
    else:
        from memsnap.localcluster import loopback_env

        loopback_env()
        ray.init(namespace=naming.NAMESPACE, include_dashboard=False)


def check_same_job(mine: SnapshotConfig, running: dict) -> None:
    """A job name reused with another configuration would silently run on the old agents:
    refuse it, naming what differs. (The world size is membership, not configuration: a job
    back with another number of ranks is an elastic restart.)"""
    theirs = SnapshotConfig.from_dict(running)
    diff = {k: (getattr(theirs, k), v) for k, v in mine.to_dict().items() if getattr(theirs, k) != v}
    if diff:
        fields_ = ", ".join(f"{k}={new!r} (running: {old!r})" for k, (old, new) in sorted(diff.items()))
        raise ConfigError(
            f"job {mine.job!r} is already running with another configuration: {fields_}. "
            f"Use the same options, another job name, or stop the old one first with "
            f"memsnap.shutdown({mine.job!r})"
        )


def job_config(job: str, opts: dict) -> SnapshotConfig:
    """The job-wide configuration the agents share, from a Snapshotter's resolved options."""
    pro, mem, sp, wi = opts["protection"], opts["memory"], opts["spill"], opts["wire"]
    dev = opts["device"]
    uri = None if sp.uri is None else sp.uri.replace("{job}", job)  # each job (a Tune trial) its own directory
    return SnapshotConfig(
        job,
        k=pro.k,
        m=pro.m,
        group_size=pro.group_size,
        local_copy=pro.local_copy,
        peers=pro.peers,
        keep=mem.keep,
        memory_budget=mem.budget,
        spill=uri,
        spill_every=sp.every,
        spill_every_seconds=sp.every_seconds,
        spill_bytes_per_s=sp.bytes_per_s,
        transport=wi.transport,
        chunk=wi.chunk,
        wire=wi.mode,
        device_buffer=dev.buffer,
        device_backend=dev.backend,
    )


def start_spare(job: str, node_id: str, **options: Any):
    """Start ``job``'s agent on ``node_id``, a node that runs no rank: a *spare* that holds
    erasure-coded pieces of the other nodes (and so lets a job on ``k+m`` nodes be protected).
    ``options`` are the job's Snapshotter options (``k``, ``m``, ``memory_budget``, ...); call
    it before the ranks start, e.g. from the driver. Returns the agent's actor handle."""
    if not ray.is_initialized():
        raise ConfigError("start_spare needs Ray: call it after ray.init()")
    cfg = job_config(job, resolve_options(options))
    job_secret(job)  # made now if no rank made it yet: the agent reads it from Ray's key-value store
    handle = actors.agent_for(cfg, node_id)
    address = get(handle.address.remote())
    try:  # a job already placed takes the spare in now (a standby's node, a node added later)
        coordinator = ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE)
    except ValueError:
        return handle  # no coordinator yet: the first placement finds the spare itself
    get(coordinator.spare_joined.remote(node_id, address))
    return handle


def shutdown(job: str, timeout: float = 30.0) -> None:
    """Stop the job's coordinator and every agent (their shared memory is unlinked), and
    delete the job's secret."""
    from memsnap.secret import drop_secret

    for node in [n["NodeID"] for n in ray.nodes() if n.get("Alive")]:
        handle = actors.find(job, node)
        if handle is not None:
            try:
                ray.get(handle.shutdown.remote(), timeout=timeout)
            except Exception:  # exit_actor ends the call with an actor error
                pass
    try:
        ray.kill(ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE), no_restart=True)
    except ValueError:
        pass
    drop_secret(job)
