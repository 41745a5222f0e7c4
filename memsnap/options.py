"""A Snapshotter's options, in groups: frozen, validated when made (by the checks in
``memsnap.config``, which ``SnapshotConfig`` shares), each message naming the bad value by its
shorthand keyword and saying how to fix it. Flat keywords (``k=2, spill="s3://..."``) are a
shorthand for the same fields.

    Snapshotter(job, rank, world,
                protection=Protection(k=4, m=2),          # the erasure code and where pieces go
                memory=Memory(budget=64 << 30, keep=2),   # each node agent's RAM
                spill=Spill("s3://bucket/run", every=100),  # the durable tier
                when=When(every_steps=1),                 # which steps are snapshotted
                failures=Failures(on_error="raise"),      # what a failed snapshot does
                wire=Wire(transport="tcp"),               # the data plane
                device=Device(buffer=8 << 30))            # the device tier (GPU, opt-in)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from memsnap.config import check_device, check_failures, check_memory, check_protection, check_spill, check_wire
from memsnap.errors import ConfigError
from memsnap.policy import check_schedule


@dataclass(frozen=True)
class Protection:
    """``k`` data + ``m`` parity shards per stripe (``k=1``: replication) on other nodes of a
    group of ``group_size`` (default ``k+m+1``). ``peers``: None decides from the job's node
    count, True refuses to run without peers, False never uses them. ``local_copy=False``
    (lean mode) keeps no copy of a node's own bytes: less RAM, ``m`` losses instead of ``m+1``."""

    k: int = 2
    m: int = 1
    group_size: int | None = None
    peers: bool | None = None
    local_copy: bool = True

    def __post_init__(self) -> None:
        check_protection(self.k, self.m, self.group_size, self.peers, self.local_copy)


@dataclass(frozen=True)
class Memory:
    """Each node agent's RAM: at most ``budget`` bytes; ``keep`` committed versions held."""

    budget: int = 4 << 30
    keep: int = 2

    def __post_init__(self) -> None:
        check_memory(self.budget, self.keep)


@dataclass(frozen=True)
class Spill:
    """The durable tier at ``uri`` (a path, ``file://``, ``s3://``, ``gs://``, ``hdfs://``), written
    every ``every`` steps and/or ``every_seconds``, at most ``bytes_per_s`` per node."""

    uri: str | None = None
    every: int | None = None
    every_seconds: float | None = None
    bytes_per_s: int = 256 << 20

    def __post_init__(self) -> None:
        check_spill(self.uri, self.every, self.every_seconds, self.bytes_per_s)


@dataclass(frozen=True)
class When:
    """Which steps are snapshotted: every ``every_steps``, every ``every_seconds``, or ``auto``
    (the Young/Daly interval from the measured cost and ``mtbf_hours``, one rank's MTBF)."""

    every_steps: int | None = 1
    every_seconds: float | None = None
    auto: bool = False
    mtbf_hours: float | None = None

    def __post_init__(self) -> None:
        check_schedule(
            self.every_steps,
            self.every_seconds,
            self.auto,
            self.mtbf_hours,
            what="when=When(every_steps=None, every_seconds=None, auto=False)",
        )


@dataclass(frozen=True)
class Failures:
    """``on_error``: ``"warn"`` (log, count, go on) or ``"raise"``; ``max_staleness_steps``:
    raise when the newest committed step falls further behind; ``preemption``: react to
    SIGTERM and Ray drains with a last snapshot, spilled within ``preemption_grace_s``."""

    on_error: str = "warn"
    max_staleness_steps: int | None = None
    preemption: bool = True
    preemption_grace_s: float = 30.0

    def __post_init__(self) -> None:
        check_failures(self.on_error, self.max_staleness_steps, self.preemption, self.preemption_grace_s)


@dataclass(frozen=True)
class Wire:
    """The data plane: ``transport`` ``"tcp"`` (direct streams between agents, every frame
    authenticated) or ``"objstore"`` (Ray's object store); ``mode`` ``"mac"`` or ``"encrypt"``
    (TCP frames also encrypted, for networks others can read); ``chunk``: the shard size
    (None: about 4 MiB)."""

    transport: str = "tcp"
    chunk: int | None = None
    mode: str = "mac"

    def __post_init__(self) -> None:
        check_wire(self.transport, self.chunk, self.mode)


@dataclass(frozen=True)
class Device:
    """The device tier (opt-in; see ``memsnap.device``): the node's agent keeps one buffer per
    local rank on the rank's GPU, a capture is a device-to-device copy into it, and the agent
    drains it to its host arena itself. ``buffer``: False (off), True (each buffer as large as
    its rank's snapshot) or a byte budget for all of a node's device buffers. ``backend``:
    ``"auto"`` (CUDA when the process sees a GPU and CuPy imports), ``"cuda"`` or ``"cpu"``
    (shared memory standing in for device memory: for tests, it makes CPU state take the
    device path too). Where CUDA IPC is refused at run time the side-stream D2H capture runs
    instead, and the log says why. Not yet run on a GPU."""

    buffer: bool | int = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_device(self.buffer, self.backend)

    @property
    def on(self) -> bool:
        return self.buffer is not False


GROUPS = {
    "protection": Protection,
    "memory": Memory,
    "spill": Spill,
    "when": When,
    "failures": Failures,
    "wire": Wire,
    "device": Device,
}

# the flat shorthand: keyword -> (group, field)
SHORTHAND = {
    "k": ("protection", "k"),
    "m": ("protection", "m"),
    "group_size": ("protection", "group_size"),
    "peers": ("protection", "peers"),
    "local_copy": ("protection", "local_copy"),
    "memory_budget": ("memory", "budget"),
    "keep": ("memory", "keep"),
    "spill_every": ("spill", "every"),
    "spill_every_seconds": ("spill", "every_seconds"),
    "spill_bytes_per_s": ("spill", "bytes_per_s"),
    "every_steps": ("when", "every_steps"),
    "every_seconds": ("when", "every_seconds"),
    "auto": ("when", "auto"),
    "mtbf_hours": ("when", "mtbf_hours"),
    "on_error": ("failures", "on_error"),
    "max_staleness_steps": ("failures", "max_staleness_steps"),
    "preemption": ("failures", "preemption"),
    "preemption_grace_s": ("failures", "preemption_grace_s"),
    "transport": ("wire", "transport"),
    "chunk": ("wire", "chunk"),
    "wire_mode": ("wire", "mode"),
    "device_buffer": ("device", "buffer"),
    "device_backend": ("device", "backend"),
}


def resolve(groups: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """Every group as an object, from the groups given and the flat shorthand (a group given
    whole and a flat keyword of the same group is refused: say it once)."""
    spill = groups.get("spill")
    if isinstance(spill, str):  # spill="s3://..." is the shorthand for Spill(uri=...)
        groups["spill"] = Spill(uri=spill)
    unknown = sorted(set(flat) - set(SHORTHAND))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown}: the options are the groups {sorted(GROUPS)} "
            f"(memsnap.options) or their shorthand keywords {sorted(SHORTHAND)}"
        )
    fields_of: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    for key, value in flat.items():
        group, name = SHORTHAND[key]
        if groups.get(group) is not None and not (group == "spill" and isinstance(spill, str)):
            raise ConfigError(
                f"{key}={value!r} and {group}={groups[group]!r} both given: set "
                f"{group}.{name} in the group, or drop the group and use keywords"
            )
        fields_of[group][name] = value
    out = {}
    for group, cls in GROUPS.items():
        given = groups.get(group)
        if given is not None and not isinstance(given, cls):
            raise ConfigError(f"{group}={given!r}: pass a memsnap.options.{cls.__name__}")
        base = given if given is not None else cls()
        out[group] = cls(**{**{f.name: getattr(base, f.name) for f in fields(cls)}, **fields_of[group]})
    return out


def resolve_options(options: dict[str, Any]) -> dict[str, Any]:
    """``resolve`` for options given as one mapping (a Snapshotter's keyword arguments: groups
    by their names beside shorthand keywords), as ``start_spare`` and the in-place controller
    take them."""
    groups = {name: value for name, value in options.items() if name in GROUPS}
    return resolve(groups, {name: value for name, value in options.items() if name not in GROUPS})
