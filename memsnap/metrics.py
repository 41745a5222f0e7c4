"""Every metric memsnap exports through ``ray.util.metrics`` (name, type, tags) and the helpers that record them.

Ray exports them on each node's Prometheus endpoint (``metrics_export_port``) with a ``ray_``
prefix, so the Ray dashboard and Grafana show them with no extra setup. Recording never
raises: outside a Ray process, or when Ray's metrics are unavailable, every helper is a no-op
(logged once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

log = logging.getLogger("memsnap.metrics")

SECONDS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]
TIERS = ("local", "peer", "durable")

# name -> (type, tag keys, description); Ray adds the ``ray_`` prefix (and ``_total`` to counters)
DEFINITIONS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "memsnap_committed_step": ("gauge", ("job",), "Newest committed snapshot step of the job"),
    "memsnap_training_step": ("gauge", ("job", "node"), "Newest step a rank on this node called save() with"),
    "memsnap_commit_lag_steps": (
        "gauge",
        ("job", "node"),
        "Steps the newest committed step trails the newest snapshot this node began",
    ),
    "memsnap_durable_step": ("gauge", ("job",), "Newest step written to durable storage (-1: none)"),
    "memsnap_protection_level": (
        "gauge",
        ("job", "group"),
        "Further node losses a group's newest committed step survives from RAM",
    ),
    "memsnap_bytes": (
        "gauge",
        ("job", "node", "tier"),
        (
            "Snapshot bytes per tier: local (own committed copy), peer (chunks held for peers "
            "and parity), durable (bytes this node spilled so far)"
        ),
    ),
    "memsnap_memory_used_bytes": ("gauge", ("job", "node"), "Bytes charged against the node's memory_budget"),
    "memsnap_memory_budget_bytes": ("gauge", ("job", "node"), "The node's memory_budget"),
    "memsnap_capture_seconds": ("histogram", ("job", "node"), "save(): capturing a rank's state into the arena"),
    "memsnap_send_seconds": ("histogram", ("job", "node"), "Checksums, parity and pushes of one node's snapshot"),
    "memsnap_commit_seconds": (
        "histogram",
        ("job", "node"),
        "From a node's last capture of a step to its commit notice",
    ),
    "memsnap_spill_seconds": ("histogram", ("job", "node"), "Writing a node's ranks of a step to durable storage"),
    "memsnap_restore_seconds": ("histogram", ("job", "node", "tier"), "One rank's restore, by the tier that served"),
    "memsnap_snapshots_failed": ("counter", ("job", "node"), "Snapshot steps that failed (by the node that failed)"),
    "memsnap_snapshots_skipped": (
        "counter",
        ("job", "node"),
        "Snapshot steps skipped or replaced because the pipeline was busy",
    ),
    "memsnap_recovery_seconds": (
        "histogram",
        ("job", "phase"),
        (
            "One in-place recovery by phase: detect (first sign -> decision), reform, "
            "restore, first_step, total (first sign -> every rank's first step)"
        ),
    ),
    "memsnap_recoveries": ("counter", ("job", "kind"), "Recoveries of the job (kind: inplace)"),
    "memsnap_fenced_nodes": ("gauge", ("job",), "Nodes memsnap declared lost and fenced"),
    "memsnap_reprotect_running": ("gauge", ("job",), "1 while re-protection rebuilds lost shards"),
    "memsnap_reprotect_rebuilt_chunks": (
        "gauge",
        ("job",),
        "Chunks re-protection rebuilt since the coordinator started",
    ),
    "memsnap_reprotect_local_copies": ("gauge", ("job",), "Local copies re-protection gave back to nodes"),
    "memsnap_reprotect_dropped": (
        "gauge",
        ("job",),
        "Steps whose re-protection was dropped because newer commits pruned them",
    ),
}

_lock = threading.Lock()
_made: dict[str, object] = {}
_off = False
_step_recorded: dict[tuple[str, str], float] = {}  # (job, node) -> when its training step was recorded
_captured: OrderedDict = OrderedDict()  # (job, step) -> monotonic time its node's last rank captured


def _metric(name: str):
    """The Ray metric object ``name`` of this process, made on first use; None when unavailable."""
    global _off
    if _off:
        return None
    with _lock:
        if name not in _made:
            try:
                _made[name] = _make(name)
            except Exception as exc:  # no Ray, or no metrics in this process
                _off = True
                log.info("memsnap metrics are off in this process: %s", exc)
                return None
        return _made[name]


def _make(name: str):
    from ray.util import metrics as rm

    kind, tags, desc = DEFINITIONS[name]
    if kind == "histogram":
        return rm.Histogram(name, desc, boundaries=SECONDS, tag_keys=tags)
    return (rm.Counter if kind == "counter" else rm.Gauge)(name, desc, tag_keys=tags)


def record(name: str, value: float, **tags: str) -> None:
    """Set a gauge, add to a counter or observe a histogram; never raises."""
    metric = _metric(name)
    if metric is None:
        return
    tags = {k: str(v) for k, v in tags.items()}
    try:
        kind = DEFINITIONS[name][0]
        if kind == "counter":
            metric.inc(value, tags=tags)
        elif kind == "histogram":
            metric.observe(value, tags=tags)
        else:
            metric.set(value, tags=tags)
    except Exception as exc:
        log.debug("metric %s not recorded: %s", name, exc)


# --- the rank (Snapshotter) -----------------------------------------------------------------------
def training_step(job: str, node: str, step: int, every_s: float = 0.0) -> None:
    """A rank of ``node`` called ``save(step)``. ``every_s``: record at most that often (a step
    the policy does not snapshot must stay cheap; Ray reports every few seconds anyway)."""
    now = time.monotonic()
    if every_s and now - _step_recorded.get((job, node), -every_s) < every_s:
        return
    _step_recorded[(job, node)] = now
    record("memsnap_training_step", step, job=job, node=node)


def capture_took(job: str, node: str, seconds: float) -> None:
    record("memsnap_capture_seconds", seconds, job=job, node=node)


def restored(job: str, node: str, tier: str, seconds: float) -> None:
    record("memsnap_restore_seconds", seconds, job=job, node=node, tier=tier)


def recovered(job: str, split: dict) -> None:
    """One in-place recovery's split (``controller.Recovery.split``)."""
    record("memsnap_recoveries", 1, job=job, kind="inplace")
    for phase, seconds in split.items():
        if seconds is not None:
            record("memsnap_recovery_seconds", seconds, job=job, phase=phase)


# --- the agent ------------------------------------------------------------------------------------
def begun(job: str, node: str, step: int, committed: int | None) -> None:
    """``step``: the newest snapshot a rank of ``node`` began; ``committed``: the newest committed."""
    record("memsnap_commit_lag_steps", step - (-1 if committed is None else committed), job=job, node=node)


def captured(job: str, step: int) -> None:
    """Every rank of this node captured ``step``: its commit time runs from here."""
    with _lock:
        _captured[(job, step)] = time.monotonic()
        while len(_captured) > 64:
            _captured.popitem(last=False)


def committed_here(job: str, node: str, step: int, begun_step: int | None) -> None:
    """``node``'s agent heard ``step`` committed; ``begun_step``: the newest snapshot it began."""
    with _lock:
        t = _captured.pop((job, step), None)
    if t is not None:
        record("memsnap_commit_seconds", time.monotonic() - t, job=job, node=node)
    if begun_step is not None:
        record("memsnap_commit_lag_steps", max(0, begun_step - step), job=job, node=node)


def sent(job: str, node: str, seconds: float) -> None:
    record("memsnap_send_seconds", seconds, job=job, node=node)


def spilled(job: str, node: str, seconds: float) -> None:
    record("memsnap_spill_seconds", seconds, job=job, node=node)


# --- the coordinator ------------------------------------------------------------------------------
def committed(job: str, step: int) -> None:
    record("memsnap_committed_step", step, job=job)


def failed(job: str, node: str) -> None:
    record("memsnap_snapshots_failed", 1, job=job, node=node)


def skipped(job: str, node: str) -> None:
    record("memsnap_snapshots_skipped", 1, job=job, node=node)


def job_status(job: str, st: dict) -> None:
    """The gauges a coordinator ``status()`` knows: committed and durable step, protection per
    group, bytes per tier and memory per node, re-protection progress."""
    if st.get("committed_step") is not None:
        committed(job, st["committed_step"])
    record("memsnap_durable_step", -1 if st.get("durable_step") is None else st["durable_step"], job=job)
    for group, level in st.get("protection", {}).items():
        record("memsnap_protection_level", level, job=job, group=group)
    for node, a in st.get("agents", {}).items():
        for tier, nbytes in tier_bytes(a).items():
            record("memsnap_bytes", nbytes, job=job, node=node, tier=tier)
        record("memsnap_memory_used_bytes", a.get("budget_used", 0), job=job, node=node)
        record("memsnap_memory_budget_bytes", a.get("budget", 0), job=job, node=node)
    rp = st.get("reprotect", {})
    record("memsnap_reprotect_running", 1 if rp.get("running") else 0, job=job)
    record("memsnap_reprotect_rebuilt_chunks", rp.get("rebuilt_chunks", 0), job=job)
    record("memsnap_reprotect_local_copies", rp.get("local_copies", 0), job=job)
    record("memsnap_reprotect_dropped", rp.get("dropped", 0), job=job)


def tier_bytes(agent: dict) -> dict[str, int]:
    """One agent's bytes per tier, from its entry in a coordinator status's ``agents``."""
    spill = agent.get("spill") or {}
    return {
        "local": agent.get("local", 0),
        "peer": agent.get("held", 0) + agent.get("parity", 0),
        "durable": spill.get("bytes", 0),
    }


def refresh_every(seconds: float, job: str, status) -> threading.Thread:
    """Record ``job_status(job, status())`` every ``seconds`` on a daemon thread (the
    coordinator's gauges stay current with nobody asking for its status)."""

    def loop() -> None:
        while True:
            try:
                job_status(job, status())
            except Exception as exc:  # agents restarting, the coordinator rebuilding
                log.debug("metrics refresh of job %s: %s", job, exc)
            time.sleep(seconds)

    thread = threading.Thread(target=loop, name="memsnap-metrics", daemon=True)
    thread.start()
    return thread
