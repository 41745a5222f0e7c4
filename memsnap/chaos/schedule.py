"""What to inject and when: a ``Fault`` and a ``Schedule`` of them (fixed, or Poisson per node).

Pure and deterministic: the same arguments and seed give the same schedule, so two systems
benchmarked in turn meet the same faults. Times are seconds from ``Injector.start()``; steps
are the job's step numbers as the injector observes them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from memsnap.errors import ConfigError

KINDS = ("kill_node", "kill_process", "stall", "fill_disk", "preempt")
PREEMPT_HOW = ("sigterm", "drain", "both")
Target = str | int | None  # a node id (or a unique prefix), "key=value" (a label), an index, or None: any


def _number(name: str, value, hint: str, *, allow_zero: bool = True, integer: bool = False):
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        what = "an integer" if integer else "a finite number"
        raise ConfigError(f"{name}={value!r} is not {what} {'>= 0' if allow_zero else '> 0'}; {hint}")
    return value


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on node ``target`` at ``at_s`` seconds (or once step ``at_step`` is seen).

    * ``kill_node``: the node's raylet and every process on it, SIGKILL, nothing graceful.
    * ``kill_process``: one training process on the node (SIGKILL): ``process`` is a pid, or an
      actor's name or class name; None picks one of the node's actors that are not memsnap's.
    * ``stall``: the node's memsnap data plane (chunks in and out) holds still for
      ``duration_s`` (needs ``job`` on the injector and ``MEMSNAP_TESTING_HOOKS=1`` on the agents).
    * ``fill_disk``: a filler file in ``path`` (default: the job's spill directory) until the
      disk is full or ``limit_bytes`` are written; removed after ``duration_s`` (None: at ``stop()``).
    * ``preempt``: a preemption notice, ``how`` = ``sigterm`` (to the training processes, or
      ``process``), ``drain`` (a Ray drain, reason preemption, deadline ``duration_s`` from
      now, None: no deadline) or ``both``.
    """

    kind: str
    target: Target = None
    at_s: float | None = None
    at_step: int | None = None
    duration_s: float | None = None
    process: int | str | None = None
    path: str | None = None
    limit_bytes: int | None = None
    how: str = "both"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"fault kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}")
        if (self.at_s is None) == (self.at_step is None):
            raise ConfigError(
                f"{self.kind}: give exactly one of at_s (seconds after start) and at_step "
                f"(a step of the job), got at_s={self.at_s!r}, at_step={self.at_step!r}"
            )
        if self.at_s is not None:
            object.__setattr__(self, "at_s", float(_number("at_s", self.at_s, "seconds after the injector starts")))
        if self.at_step is not None:
            _number("at_step", self.at_step, "a step number of the job", integer=True)
        if isinstance(self.target, bool) or not isinstance(self.target, (str, int, type(None))):
            raise ConfigError(
                f"target={self.target!r}: give a node id (or a unique prefix of one), "
                "'key=value' (a node label), a node index, or None for any worker node"
            )
        self._check_duration()
        self._check_options()

    def _check_duration(self) -> None:
        if self.duration_s is None:
            if self.kind == "stall":
                raise ConfigError("stall: give duration_s, the seconds the data plane holds still")
            return
        if self.kind in ("kill_node", "kill_process"):
            raise ConfigError(f"{self.kind}: duration_s={self.duration_s!r} means nothing for a kill; leave it None")
        _number("duration_s", self.duration_s, "the seconds the fault lasts", allow_zero=False)
        object.__setattr__(self, "duration_s", float(self.duration_s))

    def _check_options(self) -> None:
        if self.process is not None:
            if self.kind not in ("kill_process", "preempt"):
                raise ConfigError(f"{self.kind}: process= applies to kill_process and preempt only")
            if isinstance(self.process, bool) or not isinstance(self.process, (int, str)) or self.process in ("", 0):
                raise ConfigError(f"process={self.process!r}: give a pid, or an actor's name or class name")
        if self.path is not None and self.kind != "fill_disk":
            raise ConfigError(f"{self.kind}: path= applies to fill_disk only")
        if self.limit_bytes is not None:
            if self.kind != "fill_disk":
                raise ConfigError(f"{self.kind}: limit_bytes= applies to fill_disk only")
            _number(
                "limit_bytes",
                self.limit_bytes,
                "the most bytes the filler writes (None: until the disk is full)",
                allow_zero=False,
                integer=True,
            )
        if self.how not in PREEMPT_HOW:
            raise ConfigError(f"how={self.how!r}: a preemption notice is one of {', '.join(PREEMPT_HOW)}")

    def to_dict(self) -> dict:
        """The fields that differ from the defaults, as JSON-ready values (``from_dict`` inverts it)."""
        out = {"kind": self.kind}
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Fault:
        known = {f.name for f in fields(cls)}
        extra = sorted(set(d) - known)
        if extra:
            raise ConfigError(f"fault {d!r}: unknown field(s) {extra}; the fields are {sorted(known)}")
        return cls(**d)


def _order(f: Fault) -> tuple:
    return (0, f.at_s, 0) if f.at_s is not None else (1, 0.0, f.at_step)


@dataclass(frozen=True)
class Schedule:
    """The faults of one run, in order (timed ones by time, then stepped ones by step)."""

    faults: tuple[Fault, ...]
    seed: int = 0
    source: dict | None = None  # how it was made (for the log): {"fixed": ...} or {"poisson": ...}

    def __post_init__(self):
        _number("seed", self.seed, "any integer >= 0", integer=True)
        object.__setattr__(self, "faults", tuple(sorted(self.faults, key=_order)))

    @classmethod
    def fixed(cls, faults: Iterable[Fault | dict], *, seed: int = 0) -> Schedule:
        """The given faults (``Fault``s or their dicts); ``seed`` drives the injector's choices
        of target where a fault leaves it open."""
        got = []
        for f in faults:
            if isinstance(f, dict):
                f = Fault.from_dict(f)
            if not isinstance(f, Fault):
                raise ConfigError(f"Schedule.fixed: {f!r} is not a Fault (or a dict of one)")
            got.append(f)
        return cls(tuple(got), seed, {"fixed": len(got)})

    @classmethod
    def poisson(
        cls,
        *,
        mtbf_s: float,
        kinds: Sequence[str] = ("kill_node",),
        nodes: Sequence[Target] | int,
        seed: int = 0,
        horizon_s: float,
        duration_s: float | None = None,
        start_s: float = 0.0,
        **options,
    ) -> Schedule:
        """Faults as independent Poisson processes, one per node, each with mean time between
        failures ``mtbf_s``, from ``start_s`` until ``horizon_s``; each fault's kind is drawn
        uniformly from ``kinds``. ``nodes`` is a list of targets, or a count of nodes whose
        faults each land on any live worker node (chosen when it lands: nodes killed and
        replaced keep the rate). ``duration_s`` and ``options`` (``limit_bytes``, ``how``, ...)
        go to every fault they apply to. Deterministic for a seed."""
        _number("mtbf_s", mtbf_s, "the mean seconds between failures of one node", allow_zero=False)
        _number("horizon_s", horizon_s, "the seconds after start when faults stop", allow_zero=False)
        _number("start_s", start_s, "the seconds after start when faults begin")
        kinds = _kinds(kinds)
        targets = _targets(nodes)
        rng = random.Random(seed)
        faults = []
        for target in targets:
            t = float(start_s)
            while True:
                t += rng.expovariate(1.0 / mtbf_s)
                if t >= horizon_s:
                    break
                faults.append(_fault(rng.choice(kinds), target, t, duration_s, options))
        source = {
            "poisson": {
                "mtbf_s": mtbf_s,
                "kinds": list(kinds),
                "nodes": nodes if isinstance(nodes, int) else list(targets),
                "horizon_s": horizon_s,
                "start_s": start_s,
            }
        }
        return cls(tuple(faults), seed, source)

    def to_list(self) -> list[dict]:
        return [f.to_dict() for f in self.faults]

    def __len__(self) -> int:
        return len(self.faults)


def _kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    if isinstance(kinds, str):
        kinds = (kinds,)
    kinds = tuple(kinds)
    if not kinds:
        raise ConfigError(f"kinds is empty; give one or more of {', '.join(KINDS)}")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ConfigError(f"unknown fault kind(s) {bad}; use {', '.join(KINDS)}")
    return kinds


def _targets(nodes) -> tuple[Target, ...]:
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        if nodes < 1:
            raise ConfigError(f"nodes={nodes}: give how many nodes fail (>= 1), or a list of targets")
        return (None,) * nodes
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence) or not nodes:
        raise ConfigError(f"nodes={nodes!r}: give a non-empty list of node targets, or a count of nodes")
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"nodes={list(nodes)!r} names a node twice; each node has one failure process")
    return tuple(nodes)


def _fault(kind: str, target: Target, t: float, duration_s: float | None, options: dict) -> Fault:
    applies = {
        "process": ("kill_process", "preempt"),
        "path": ("fill_disk",),
        "limit_bytes": ("fill_disk",),
        "how": ("preempt",),
    }
    unknown = set(options) - set(applies)
    if unknown:
        raise ConfigError(f"Schedule.poisson: unknown option(s) {sorted(unknown)}; use {sorted(applies)}")
    kw = {k: v for k, v in options.items() if kind in applies[k]}
    dur = None if kind in ("kill_node", "kill_process") else duration_s
    if kind == "stall" and dur is None:
        raise ConfigError("Schedule.poisson: kinds include stall; give duration_s, the seconds a stall lasts")
    return Fault(kind, target, at_s=round(t, 6), duration_s=dur, **kw)


__all__ = ["Fault", "Schedule", "KINDS", "PREEMPT_HOW"]
