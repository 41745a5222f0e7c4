"""When to snapshot: the ``Policy`` config, its ``Scheduler`` and the ``StalenessGuard``.

A ``Policy`` says when a tier takes a snapshot: every ``every_steps`` steps, every
``every_seconds`` seconds, both (whichever comes first), or ``auto``. A ``Scheduler`` applies
it to a running job: ``due(step)`` is asked on every step and costs one or two compares when
the answer is no; ``taken(step)`` restarts the interval after a snapshot.

``auto`` uses the Young/Daly first-order optimum of the checkpoint interval::

    interval = sqrt(2 * C * M)

where ``C`` is the cost of one snapshot in seconds (measured: an exponentially weighted mean
of ``record_cost`` with weight ``cost_smoothing`` on the newest value) and ``M`` the mean
time between failures of the job in seconds, estimated as::

    M = (M0 + T) / (1 + n)     with a user prior M0 = mtbf_hours * 3600 / nodes
    M = T / max(n, 1)          without one

``T`` is the time the scheduler has watched the job (from its start, or from the earliest
failure recorded, if that is earlier) and ``n`` the failures recorded with
``record_failure``. The prior counts as one failure seen after ``M0`` seconds, so observed
failures pull the estimate towards what the cluster really does. Without a prior and before
any failure, ``T`` is a lower bound on ``M``, which starts the job with short, safe intervals
that grow as it survives. Until the first cost is known (``initial_cost_seconds`` unset), the
first step is due so that a snapshot measures it.

RAM snapshots and durable spills each get their own ``Policy`` and ``Scheduler``
(``tier="ram"`` / ``tier="spill"``): a spill costs more and protects against rarer events
(more node losses in a group than the code tolerates, or a whole-job restart), so its MTBF
and interval differ.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from memsnap.errors import ConfigError, StalenessError

TIERS = ("ram", "spill")


def young_daly_interval(cost_seconds: float, mtbf_seconds: float) -> float:
    """The Young/Daly optimum checkpoint interval ``sqrt(2 * cost * mtbf)``, in seconds."""
    return math.sqrt(2.0 * cost_seconds * mtbf_seconds)


def agent_ram(state_per_node: float, k: int, m: int, keep: int) -> float:
    """The most RAM one node's agent holds, steady, for ``state_per_node`` of its ranks' state
    (any unit; the answer is in the same unit): what its ``memory_budget`` must cover.

    ``keep + 1`` arena slots of the node's own state (the committed versions and the capture
    in progress), and the pieces it holds for its peers: with every node's pieces spread evenly
    over the others, ``S * (k + m) / k`` per version, for the ``keep`` committed versions and
    two more in flight (one landing while the one before waits for its commit).
    """
    return state_per_node * ((keep + 1) + (keep + 2) * (k + m) / k)


def require_positive_int(name: str, value: object, hint: str) -> int:
    """``value`` if it is an int >= 1 (not a bool); else a ``ConfigError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is not a positive integer; {hint}")
    return value


def require_positive_float(name: str, value: object, hint: str, *, allow_zero: bool = False) -> float:
    """``value`` as a float if it is a finite number > 0 (or >= 0); else a ``ConfigError``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        kind = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ConfigError(f"{name}={value!r} is not {kind}; {hint}")
    return float(value)


@dataclass(frozen=True)
class Policy:
    """When one tier snapshots. Give ``every_steps``, ``every_seconds``, both, or ``auto``.

    ``auto=True`` picks the time interval by Young/Daly (see the module docstring); it may be
    combined with ``every_steps`` as an upper bound on the steps between snapshots, not with
    ``every_seconds``. ``mtbf_hours`` is the MTBF of one node and ``nodes`` the number of
    nodes whose failure interrupts the job (job MTBF = mtbf_hours / nodes).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    auto: bool = False
    mtbf_hours: float | None = None
    nodes: int = 1
    initial_cost_seconds: float | None = None
    cost_smoothing: float = 0.3
    tier: str = "ram"

    def __post_init__(self) -> None:
        self._check_triggers()
        if self.mtbf_hours is not None:
            require_positive_float("mtbf_hours", self.mtbf_hours,
                                   "give one node's mean time between failures in hours, e.g. 1000")
        require_positive_int("nodes", self.nodes, "give the number of nodes in the job, e.g. 8")
        if self.initial_cost_seconds is not None:
            require_positive_float("initial_cost_seconds", self.initial_cost_seconds,
                                   "give the expected snapshot cost in seconds, or None to measure it",
                                   allow_zero=True)
        s = self.cost_smoothing
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 1:
            raise ConfigError(f"cost_smoothing={s!r} must be in (0, 1]; 0.3 weighs the newest "
                              "measurement at 30%, 1 keeps only the newest")
        if self.tier not in TIERS:
            raise ConfigError(f"tier={self.tier!r} is not one of {TIERS}")

    def _check_triggers(self) -> None:
        if not isinstance(self.auto, bool):
            raise ConfigError(f"auto={self.auto!r} must be True or False")
        if self.every_steps is not None:
            require_positive_int("every_steps", self.every_steps,
                                 "snapshot every N >= 1 steps, or pass every_steps=None")
        if self.every_seconds is not None:
            require_positive_float("every_seconds", self.every_seconds,
                                   "snapshot every T > 0 seconds, or pass every_seconds=None")
        if self.auto and self.every_seconds is not None:
            raise ConfigError(f"auto=True picks the time interval itself, so every_seconds="
                              f"{self.every_seconds!r} conflicts with it; drop one of the two")
        if not self.auto and self.every_steps is None and self.every_seconds is None:
            raise ConfigError(f"Policy(tier={self.tier!r}) never snapshots: give every_steps, "
                              "every_seconds, or auto=True")

    @property
    def mtbf_prior_seconds(self) -> float | None:
        """The job's MTBF from the user's per-node figure, in seconds, or None."""
        if self.mtbf_hours is None:
            return None
        return self.mtbf_hours * 3600.0 / self.nodes


class Scheduler:
    """Applies a ``Policy`` to a running job; one per tier, used from one thread.

    Call protocol, per step: ``due(step)``; if True, take the snapshot, then
    ``taken(step, cost_seconds)``. ``record_failure()`` whenever a node failure is observed.
    A snapshot that failed is not ``taken``: ``due`` keeps answering True until one succeeds.
    """

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic,
                 *, start_step: int = 0):
        if not isinstance(policy, Policy):
            raise ConfigError(f"policy={policy!r} is not a memsnap.policy.Policy")
        self.policy = policy
        self._clock = clock
        self._start = clock()
        self._cost = policy.initial_cost_seconds
        self._failures: list[float] = []
        self._failure_keys: set[str] = set()
        self._timed = policy.every_seconds is not None or policy.auto
        self._restart(start_step, self._start)
        if policy.auto and self._cost is None:
            self._next_step = start_step  # measure the cost on the first step

    def due(self, step: int) -> bool:
        """Whether ``step`` should be snapshotted. Cheap: one or two compares when not."""
        if step >= self._next_step:
            return True
        return self._timed and self._clock() >= self._next_time

    def taken(self, step: int, cost_seconds: float | None = None) -> None:
        """A snapshot of ``step`` succeeded (costing ``cost_seconds``): restart the interval."""
        if cost_seconds is not None:
            self.record_cost(cost_seconds)
        self._restart(step, self._clock())

    def resume(self, step: int) -> None:
        """The job (re)starts after ``step`` (-1 for a fresh start): count the interval from there."""
        self._restart(step, self._clock())

    def record_cost(self, seconds: float) -> None:
        """Fold one measured snapshot cost into the exponentially weighted mean."""
        seconds = require_positive_float("cost seconds", seconds,
                                         "pass the measured wall time of one snapshot", allow_zero=True)
        a = self.policy.cost_smoothing
        self._cost = seconds if self._cost is None else a * seconds + (1 - a) * self._cost
        self._retime()

    def record_failure(self, at: float | None = None, key: str | None = None) -> bool:
        """Count one failure of the job at clock time ``at`` (now if None); True if counted.

        ``key`` names the failure (e.g. the dead node's id) so that the same loss reported
        by several ranks or polls counts once.
        """
        when = self._clock() if at is None else require_positive_float(
            "at", at, "pass a time from the scheduler's clock, or None for now", allow_zero=True)
        if key is not None:
            if key in self._failure_keys:
                return False
            self._failure_keys.add(key)
        self._failures.append(when)
        self._retime()
        return True

    @property
    def cost_seconds(self) -> float | None:
        """The smoothed snapshot cost, or None before the first measurement."""
        return self._cost

    @property
    def failures(self) -> int:
        return len(self._failures)

    def mtbf_seconds(self) -> float:
        """The job's MTBF estimate now (see the module docstring for the formula)."""
        origin = min([self._start, *self._failures])
        watched = max(self._clock() - origin, 0.0)
        prior = self.policy.mtbf_prior_seconds
        if prior is None:
            return watched / max(len(self._failures), 1)
        return (prior + watched) / (1 + len(self._failures))

    def interval_seconds(self) -> float | None:
        """Seconds between snapshots now: ``every_seconds``, the auto value, or None."""
        if not self.policy.auto:
            return self.policy.every_seconds
        if self._cost is None:
            return 0.0
        return young_daly_interval(self._cost, self.mtbf_seconds())

    def describe(self) -> dict[str, float | int | str | None]:
        """The scheduler's state as JSON-ready numbers, for logs and status reports."""
        return {"tier": self.policy.tier, "cost_s": self._cost, "failures": len(self._failures),
                "mtbf_s": self.mtbf_seconds(), "interval_s": self.interval_seconds(),
                "next_step": None if math.isinf(self._next_step) else self._next_step,
                "next_in_s": None if math.isinf(self._next_time) else self._next_time - self._clock()}

    def _restart(self, step: int, now: float) -> None:
        every = self.policy.every_steps
        self._next_step = math.inf if every is None else step + every
        self._last_time = now
        self._retime()

    def _retime(self) -> None:
        """Recompute the time of the next snapshot from the last one and the interval now."""
        interval = self.interval_seconds()
        self._next_time = math.inf if interval is None else self._last_time + interval


class StalenessGuard:
    """Raises when training runs too far ahead of the newest committed snapshot."""

    def __init__(self, max_steps_behind: int, *, start_step: int = 0, setting: str = "max_steps_behind"):
        """``setting``: the name the user gave the bound, used in error messages."""
        self.setting = setting
        self.max_steps_behind = require_positive_int(
            setting, max_steps_behind,
            "give how many steps training may run past the newest committed snapshot")
        self.start_step = start_step

    def check(self, step: int, newest_committed: int | None) -> None:
        """Raise ``StalenessError`` if ``step`` is more than the bound past ``newest_committed``."""
        base = self.start_step if newest_committed is None else newest_committed
        if step - base <= self.max_steps_behind:
            return
        have = ("no snapshot has been committed since step "
                f"{self.start_step}" if newest_committed is None
                else f"the newest committed snapshot is step {newest_committed}")
        raise StalenessError(
            f"step {step}: {have}, {step - base} steps behind, more than "
            f"{self.setting}={self.max_steps_behind}. Snapshots are failing or too slow "
            f"(see the errors logged before this one); fix them, or raise {self.setting}.")
