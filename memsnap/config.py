"""Runtime configuration: the public frozen ``SnapshotConfig`` and one table of internal tunables."""

from __future__ import annotations

import math
import os
import re
from dataclasses import KW_ONLY, dataclass
from typing import Any

from memsnap.errors import ConfigError

_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch: "$" would let "train\n" by
TRANSPORTS = ("tcp", "objstore")
WIRES = ("mac", "encrypt")

# Internal tunables, one table. Override any of them with the environment variable
# MEMSNAP_<NAME upper-cased>, e.g. MEMSNAP_CALL_TIMEOUT_S=60.
TUNABLES: dict[str, float] = {
    "call_timeout_s": 30.0,  # a small remote call (begin, captured, status, ...)
    "push_timeout_s": 120.0,  # pushing one node's chunks to one holder
    "membership_timeout_s": 180.0,  # waiting for every rank to register
    "claim_wait_s": 10.0,  # a rank held by a live rank of another run waits this long for
    # that process to exit (a killed rank's may be exiting) before refusal
    "restore_timeout_s": 300.0,  # one collective restore round, all ranks
    "commit_notify_timeout_s": 30.0,
    "spill_retry_s": 5.0,  # pause before a failed spill is tried again
    "forced_save_wait_s": 120.0,  # save(force=True) waits this long at most for a busy pipeline's slot
    "chunk_target": 4 << 20,  # shard size the stripe layout aims for (bytes; 4 MiB moves
    # 1.2-1.4x faster than 1 MiB over loopback: fewer frames)
    "parity_window": 4 << 20,  # parity bytes encoded per batch (the scratch is two batches)
    "agent_threads": 16,  # an agent's threads for blocking work (its calls are asyncio)
    "heartbeat_s": 0.25,  # every agent beats to the coordinator this often (0: no heartbeats);
    # at 1,000+ nodes raise it (each beat is one small call to one actor)
    "agent_lost_after_s": 0.5,  # an agent silent this long is pinged (liveness.py) ...
    "agent_ping_s": 0.4,  # ... and its node is declared lost (fenced) if the ping is not answered by then;
    # both are floors: each node's limits grow with its own recent beat gaps and ping answers
    "doubt_wait_s": 10.0,  # a restore plan that a doubted node could make better waits this long at
    # most for its verdict (``Coordinator.doubt``), then asks its agent anyway
    "preemption_poll_s": 5.0,  # how often a rank asks Ray whether its node is draining
    "reprotect_defer_s": 20.0,  # re-protection waits this long at most for a restore to go first
    "metrics_interval_s": 15.0,  # how often the coordinator records its job's gauges (memsnap.metrics)
    "direct_restore": 1,  # 1: a peer restore reads into the rank's tensors (TCP only);
    # 0: through the agent's arena, then copied (as the objstore does)
    # the TCP data plane's server side (memsnap/transport/server.py)
    "tcp_handshake_timeout_s": 1.0,  # a new connection must finish the whole handshake by then: the
    # client's 73-byte hello is one round trip behind the greeting
    # (well under 10 ms on a LAN); the rest is room for a loaded host
    "tcp_max_unauthenticated": 64,  # connections still in their handshake; when full, a newcomer
    # evicts the oldest of the source address holding the most
    "tcp_max_unauthenticated_per_source": 32,  # of those, from one source address; a newcomer from an
    # address at it evicts that address's oldest
    "tcp_idle_timeout_s": 300.0,  # an authenticated connection with no new request for this long is closed
    "tcp_frame_timeout_s": 60.0,  # a frame must arrive (or leave) whole this long after it began
    "tcp_max_frame_bytes": 64 << 20,  # the largest payload accepted when the runtime passes no chunk bound
    "tcp_accept_backoff_s": 1.0,  # longest pause before accept() is retried after EMFILE & co.
    "tcp_refusal_log_s": 10.0,  # refused connections are logged as one line per this many seconds
    "tcp_encrypt": 0,  # 1: the TCP data plane encrypts (AES-256-GCM); every agent alike
    "store_step_window": 1 << 20,  # pushes for steps this far above the newest the store knows are refused
}


def tunable(name: str) -> float:
    """The value of internal tunable ``name``, from ``MEMSNAP_<NAME>`` if set."""
    if name not in TUNABLES:
        raise ConfigError(f"tunable {name!r} is unknown; the known ones are {sorted(TUNABLES)}")
    raw = os.environ.get("MEMSNAP_" + name.upper())
    if raw is None:
        return TUNABLES[name]
    try:
        return type(TUNABLES[name])(float(raw))
    except ValueError:
        raise ConfigError(f"MEMSNAP_{name.upper()}={raw!r}: must be a number") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(name: str, value, least: int, what: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < least:
        alt = ", or None" if allow_none else ""
        raise ConfigError(f"{name}={value!r}: must be an int >= {least} ({what}){alt}")


def _seconds(name: str, value, what: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        alt = ", or None" if allow_none else ""
        raise ConfigError(f"{name}={value!r}: must be a finite number of seconds > 0 ({what}){alt}")


def _flag(name: str, value, what: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: must be True or False ({what})")


# Each option's check, once: the groups of memsnap.options run them when made, and SnapshotConfig
# runs those of the fields it holds. Messages name the Snapshotter keyword (memsnap.options.SHORTHAND).


def check_protection(k, m, group_size, peers, local_copy) -> None:
    """``Protection``: the erasure code and where its pieces go."""
    _int_at_least("k", k, 1, "data shards per stripe; k=1 replicates")
    _int_at_least("m", m, 0, "parity shards per stripe")
    if group_size is not None and (not _is_int(group_size) or group_size < k + m + 1):
        raise ConfigError(
            f"group_size={group_size!r}: needs at least k+m+1={k + m + 1} nodes (or None: the smallest group)"
        )
    if not isinstance(local_copy, bool):
        raise ConfigError(f"local_copy={local_copy!r}: must be True (keep each node's own copy) or False (lean mode)")
    if peers is not None and not isinstance(peers, bool):
        raise ConfigError(
            f"peers={peers!r}: must be None (decided from the job's node count), True "
            "(pieces on other nodes, refused on fewer than k+m+1 nodes) or False (local RAM only)"
        )
    if peers is False and not local_copy:
        raise ConfigError(
            "peers=False with local_copy=False would hold no snapshot in RAM at all; keep local_copy=True"
        )


def check_memory(budget, keep) -> None:
    """``Memory``: each node agent's RAM."""
    _int_at_least("memory_budget", budget, 1, "bytes of RAM per node agent, e.g. 8 << 30")
    _int_at_least("keep", keep, 1, "committed versions held in RAM")


def check_spill(uri, every, every_seconds, bytes_per_s) -> None:
    """``Spill``: the durable tier."""
    if uri is not None and (not isinstance(uri, str) or not uri):
        raise ConfigError(
            f"spill={uri!r}: give the durable tier as a str, a path or a file://, s3://, gs:// "
            "or hdfs:// URI (str(path) for a pathlib.Path), or None for none"
        )
    _int_at_least("spill_every", every, 1, "spill every N-th committed step", allow_none=True)
    _seconds("spill_every_seconds", every_seconds, "spill at most this often", allow_none=True)
    _int_at_least("spill_bytes_per_s", bytes_per_s, 1, "bytes per second each node may write")
    if uri is None and (every or every_seconds):
        raise ConfigError("spill_every/spill_every_seconds are set but spill=None: pass spill=URI")


def check_failures(on_error, max_staleness_steps, preemption, preemption_grace_s) -> None:
    """``Failures``: what a failed snapshot and a preemption do."""
    if on_error not in ("warn", "raise"):
        raise ConfigError(
            f"on_error={on_error!r}: use 'warn' (log, count and keep training) "
            "or 'raise' (a failed snapshot stops training)"
        )
    _int_at_least(
        "max_staleness_steps",
        max_staleness_steps,
        1,
        "steps training may run past the newest committed snapshot",
        allow_none=True,
    )
    _flag("preemption", preemption, "react to SIGTERM and Ray drains with a last snapshot")
    _seconds("preemption_grace_s", preemption_grace_s, "time the last snapshot has to be spilled")


def check_wire(transport, chunk, mode) -> None:
    """``Wire``: the data plane."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport={transport!r}: use one of {TRANSPORTS}")
    if chunk is not None and (not _is_int(chunk) or chunk < 64 or chunk % 64):
        raise ConfigError(f"chunk={chunk!r}: must be a positive multiple of 64 bytes (or None)")
    if mode not in WIRES:
        raise ConfigError(
            f"wire_mode={mode!r}: use 'mac' (every frame authenticated) or 'encrypt' (also "
            "encrypted, for networks others can read)"
        )


def check_device(buffer, backend) -> None:
    """``Device``: the device tier."""
    if not isinstance(buffer, bool) and (not _is_int(buffer) or buffer <= 0):
        raise ConfigError(
            f"device_buffer={buffer!r}: use False (off), True (sized to each rank's "
            "snapshot) or a positive number of bytes of device memory per node"
        )
    if backend not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"device_backend={backend!r}: use 'auto', 'cuda' or 'cpu'")


@dataclass(frozen=True)
class SnapshotConfig:
    """Everything a job's snapshots are configured by; the same on every rank.

    ``k`` data + ``m`` parity shards per stripe, groups of ``group_size`` nodes (at least
    ``k+m+1``; default the smallest), ``keep`` committed versions held in RAM,
    ``memory_budget`` bytes of RAM per node agent (also its Ray ``memory`` resource),
    ``spill`` a durable URI written every ``spill_every`` steps and/or
    ``spill_every_seconds``, at most ``spill_bytes_per_s``. ``chunk`` is the shard size
    (None: about 4 MiB, see ``stripes.choose_chunk``). ``local_copy``: each node's agent
    keeps its own ranks' committed bytes, so a crashed process restores with no network
    traffic; ``False`` (lean mode) keeps only the chunks held for peers plus one reused
    staging arena per rank, every restore reads from the peers, and a group survives ``m``
    node losses instead of ``m+1``; with a spill, a step due for it is held until written.
    ``peers``: None (default) decides from the job's *nodes* (those running ranks plus spare
    agents) once every rank registered: with at least ``k+m+1`` erasure-coded pieces go to
    other nodes, with fewer (a single process, one multi-GPU machine) snapshots live in each
    node's agent RAM (a crashed process restores from there) and in the spill, and a lost
    node falls back to the durable tier. ``True`` refuses to run without peers; ``False``
    never uses them.
    """

    job: str
    _: KW_ONLY  # every field but the job by name: SnapshotConfig("train", k=4, m=2)
    k: int = 2
    m: int = 1
    group_size: int | None = None
    keep: int = 2
    memory_budget: int = 4 << 30
    spill: str | None = None
    spill_every: int | None = None
    spill_every_seconds: float | None = None
    spill_bytes_per_s: int = 256 << 20
    transport: str = "tcp"
    chunk: int | None = None
    local_copy: bool = True
    peers: bool | None = None
    wire: str = "mac"
    device_buffer: bool | int = False  # the device tier (memsnap.options.Device): off, on, or a byte budget
    device_backend: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not _JOB_RE.fullmatch(self.job):
            raise ConfigError(f"job={self.job!r}: use 1-64 characters of letters, digits, '_', '.', '-'")
        check_protection(self.k, self.m, self.group_size, self.peers, self.local_copy)
        check_memory(self.memory_budget, self.keep)
        check_spill(self.spill, self.spill_every, self.spill_every_seconds, self.spill_bytes_per_s)
        check_wire(self.transport, self.chunk, self.wire)
        check_device(self.device_buffer, self.device_backend)
        if self.spill is not None and not (self.spill_every or self.spill_every_seconds):
            object.__setattr__(self, "spill_every", 1)

    @property
    def slots(self) -> int:
        """Arena slots per rank: ``keep`` committed versions plus the one being captured (lean
        mode: one staging arena, reused once the chunks of a save are acknowledged, and with a
        spill a second one, for a committed step held until it is written)."""
        if self.local_copy:
            return self.keep + 1
        return 2 if self.spill is not None else 1

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> SnapshotConfig:
        return cls(**d)


def tcp_options(cfg: SnapshotConfig) -> dict:
    """The TCP transport's options for a job: its wire mode, and its chunk size as the largest
    frame a peer may send (when the job fixed one)."""
    opts: dict[str, Any] = {"wire": cfg.wire}
    if cfg.chunk is not None:
        opts["max_chunk"] = cfg.chunk
    return opts
