"""When to snapshot: the ``Policy`` config, its ``Scheduler`` and the ``StalenessGuard``.

A ``Policy`` says when a tier takes a snapshot: every ``every_steps`` steps, every
``every_seconds`` seconds, both (whichever comes first), or ``auto``. A ``Scheduler`` applies
it to a running job: ``due(step)`` is asked on every step and costs one or two compares when
the answer is no; ``taken(step)`` records a snapshot. Every rank of a job answers the same for
the same step (a step commits only once every rank took it): see ``Scheduler``.

``auto`` uses the Young/Daly first-order optimum of the checkpoint interval::

    interval = sqrt(2 * C * M)

where ``C`` is the cost of one snapshot in seconds and ``M`` the mean time between failures
of the job in seconds. ``C`` is an exponentially weighted mean (weight ``cost_smoothing`` on
the newest value) of what each snapshot cost the training loop: not only its stall but the
steps its background work (encoding, sending, committing) slowed down, where that work shares
the rank's cores or memory bandwidth. It is measured per snapshot period: the wall time from
one snapshot to the next, less as many *quiet* steps (steps at least two after the last
snapshot, or before the first) take; the stall alone until a quiet step time is known. So the
first step after a start is snapshotted (it protects the start, and its stall is a first cost),
and the next snapshot waits until a quiet step has been measured. ``M`` is estimated as::

    M = (M0 + T) / (1 + n)     with a user prior M0 = mtbf_hours * 3600 / nodes
    M = T / max(n, 1)          without one

``T`` is the time the scheduler has watched the job (from its start, or from the earliest
failure recorded, if that is earlier; ``set_recoveries`` may give the job's age, so that a
standby that took over late agrees with the others) and ``n`` the failures recorded with
``record_failure``, or the job's recoveries told by ``set_recoveries``, whichever is more. The prior counts as one failure seen after ``M0`` seconds, so observed
failures pull the estimate towards what the cluster really does. Without a prior and before
any failure, ``T`` is a lower bound on ``M``, which starts the job with short, safe intervals
that grow as it survives. With ``initial_cost_seconds`` given, no snapshot is taken to measure
the cost: the first is due on the grid.

A snapshot saves work only for a failure that rolls the job back to it. A job that recovers
in place where its ranks are replicas goes on from the survivors' live state instead
(``memsnap.collective.live``): such a recovery loses no work a snapshot would have saved. So
the interval is set against the failures that roll back, ``M / p``, with the share of
recoveries that rolled back estimated as ``p = (r + 1) / (n + 1)`` after ``n`` recoveries of
which ``r`` rolled back (``set_recoveries``): 1 before any recovery (every failure is assumed
to roll back), 1/4 after three recoveries that all went on live (the interval doubles).

RAM snapshots and durable spills each get their own ``Policy`` and ``Scheduler``
(``tier="ram"`` / ``tier="spill"``): a spill costs more and protects against rarer events
(more node losses in a group than the code tolerates, or a whole-job restart), so its MTBF
and interval differ.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from memsnap.errors import ConfigError, StalenessError

TIERS = ("ram", "spill")
QUIET_AFTER = 2  # a step at least this many steps after the last snapshot is quiet: its work is done


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
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        kind = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ConfigError(f"{name}={value!r} is not {kind}; {hint}")
    return float(value)


def check_schedule(every_steps: object, every_seconds: object, auto: object, mtbf_hours: object, what: str) -> None:
    """The fields that say when a snapshot is due (a ``Policy``'s, and ``memsnap.options.When``'s);
    ``what`` names the whole in the message for a schedule that never snapshots."""
    if not isinstance(auto, bool):
        raise ConfigError(f"auto={auto!r} must be True or False")
    if every_steps is not None:
        require_positive_int("every_steps", every_steps, "snapshot every N >= 1 steps, or pass every_steps=None")
    if every_seconds is not None:
        require_positive_float(
            "every_seconds", every_seconds, "snapshot every T > 0 seconds, or pass every_seconds=None"
        )
    if auto and every_seconds is not None:
        raise ConfigError(
            f"auto=True picks the time interval itself, so every_seconds="
            f"{every_seconds!r} conflicts with it; drop one of the two"
        )
    if not auto and every_steps is None and every_seconds is None:
        raise ConfigError(f"{what} never snapshots: give every_steps, every_seconds, or auto=True")
    if mtbf_hours is not None:
        require_positive_float(
            "mtbf_hours", mtbf_hours, "give one node's mean time between failures in hours, e.g. 1000"
        )


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
        check_schedule(
            self.every_steps, self.every_seconds, self.auto, self.mtbf_hours, what=f"Policy(tier={self.tier!r})"
        )
        require_positive_int("nodes", self.nodes, "give the number of nodes in the job, e.g. 8")
        if self.initial_cost_seconds is not None:
            require_positive_float(
                "initial_cost_seconds",
                self.initial_cost_seconds,
                "give the expected snapshot cost in seconds, or None to measure it",
                allow_zero=True,
            )
        s = self.cost_smoothing
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 1:
            raise ConfigError(
                f"cost_smoothing={s!r} must be in (0, 1]; 0.3 weighs the newest "
                "measurement at 30%, 1 keeps only the newest"
            )
        if self.tier not in TIERS:
            raise ConfigError(f"tier={self.tier!r} is not one of {TIERS}")

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

    **Every rank of a job must pick the same steps**: a step commits only once every rank took
    it. So the answer depends on the step number, never on when this process started or what
    happened to its last snapshot: the due steps are those after which a multiple of ``G``
    steps are done (``step + 1`` a multiple of ``G``: with ``G = 3``, steps 2, 5, 8, ...), after
    the step the job started from. ``every_steps=N`` alone: ``G = N``. With a time interval
    (``every_seconds`` or ``auto``), ``G`` is the largest power of two of steps that fits the
    interval at this rank's measured step time (an exponentially weighted mean), capped by
    ``every_steps`` (then ``G = every_steps``). Ranks of a data-parallel job step in lockstep and
    get the same ``G``; two ranks whose figures straddle a power of two pick ``G`` and ``2G``,
    and every multiple of ``2G`` is taken by both, so the job still commits. A snapshot that
    failed on one rank is not retried on the next step (the others would not take that step):
    the next point of the grid is.
    """

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic, *, start_step: int = 0):
        if not isinstance(policy, Policy):
            raise ConfigError(f"policy={policy!r} is not a memsnap.policy.Policy")
        self.policy = policy
        self._clock = clock
        self._start = clock()
        self._cost = policy.initial_cost_seconds
        self._failures: list[float] = []
        self._rollback_share = 1.0  # p: the share of recoveries that rolled back (set_recoveries)
        self._failure_keys: set[str] = set()
        self._timed = policy.every_seconds is not None or policy.auto
        self._step_s: float | None = None  # this rank's smoothed seconds per step
        self._last: tuple[int, float] | None = None  # (step, clock) of the last due() call
        self._grid = policy.every_steps  # G; None until a timed policy knows the step time
        self._after = start_step  # the job (re)started after this step, or took it
        self._measure = policy.auto and self._cost is None  # the first step is snapshotted to measure the cost
        self._recoveries = 0  # the job's recoveries, told by set_recoveries
        self._quiet_s: float | None = None  # smoothed seconds of a quiet step (auto)
        self._period: tuple[int, float] | None = None  # (step, clock) of the last snapshot (auto)
        self._warm = False  # a step seen since the (re)start: the first may be slow (warm-up)

    def due(self, step: int) -> bool:
        """Whether ``step`` should be snapshotted: the same answer on every rank of the job.
        Cheap: without a time interval, two compares and no clock read."""
        self.observe(step)
        return self.next_due(step) == step

    def observe(self, step: int) -> None:
        """``step`` is done: fold its time into the step time (timed policies; ``due`` does
        this, a rank that follows a ``SharedPlan`` calls it itself)."""
        if self._timed:
            self._observe(step)

    def next_due(self, first: int) -> int | None:
        """The first step from ``first`` on that is due as things stand now, or None while none
        can be named (no step time yet; ``auto`` waiting for a quiet step to be timed)."""
        if self._measure and self._timed:  # the first step: protected at once, its stall a first cost
            return max(first, self._after)
        if self._timed and self.policy.auto and self._quiet_s is None and self._period is not None:
            return None  # the next snapshot waits for a quiet step, to count what it slows
        g = self._grid
        if g is None:
            return None
        n = max(first, self._after + 1)
        return -((n + 1) // -g) * g - 1

    def taken(self, step: int, cost_seconds: float | None = None) -> None:
        """A snapshot of ``step`` succeeded, stalling the loop ``cost_seconds`` (None: not
        measured, no cost recorded). With ``auto``, the cost recorded is what the period since the last snapshot took beyond as many quiet steps
        (see the module docstring), and at least the stall."""
        self._measure = False
        if self.policy.auto:
            now = self._clock()
            last, self._period = self._period, (step, now)
            if cost_seconds is not None and last is not None and self._quiet_s is not None and step > last[0]:
                spent = (now - last[1]) - (step - last[0]) * self._quiet_s
                cost_seconds = max(spent, cost_seconds)
        if cost_seconds is not None:
            self.record_cost(cost_seconds)
        self._after = max(self._after, step)

    def resume(self, step: int) -> None:
        """The job (re)starts after ``step`` (-1 for a fresh start)."""
        self._after = step
        self._last = None
        self._period = None
        self._warm = False

    def adopt(self, cost_s: float | None, quiet_step_s: float | None) -> None:
        """Take another rank's figures where this scheduler has none of its own yet (a standby
        that became the rank whose scheduler decides: ``collective.plan``): no snapshot to
        measure the cost, no wait for a quiet step."""
        if self._cost is None and cost_s is not None:
            self._cost = require_positive_float("cost_s", cost_s, "pass a measured snapshot cost", allow_zero=True)
            self._measure = False
        if self._quiet_s is None and quiet_step_s is not None:
            self._quiet_s = require_positive_float(
                "quiet_step_s", quiet_step_s, "pass a measured step time", allow_zero=True
            )
        self._regrid()

    def record_cost(self, seconds: float) -> None:
        """Fold one measured snapshot cost into the exponentially weighted mean."""
        seconds = require_positive_float(
            "cost seconds", seconds, "pass the measured wall time of one snapshot", allow_zero=True
        )
        a = self.policy.cost_smoothing
        self._cost = seconds if self._cost is None else a * seconds + (1 - a) * self._cost
        self._regrid()

    def record_failure(self, at: float | None = None, key: str | None = None) -> bool:
        """Count one failure of the job at clock time ``at`` (now if None); True if counted.

        ``key`` names the failure (e.g. the dead node's id) so that the same loss reported
        by several ranks or polls counts once.
        """
        when = (
            self._clock()
            if at is None
            else require_positive_float(
                "at", at, "pass a time from the scheduler's clock, or None for now", allow_zero=True
            )
        )
        if key is not None:
            if key in self._failure_keys:
                return False
            self._failure_keys.add(key)
        self._failures.append(when)
        self._regrid()
        return True

    def set_recoveries(self, total: int, rolled_back: int, age_s: float | None = None) -> None:
        """The job has recovered ``total`` times, ``rolled_back`` of them by rolling back to a
        snapshot (the others went on from live state), and has run ``age_s`` seconds: each
        recovery counts as a failure of the job, and the interval is set against the failures
        that roll back (see the module docstring). Every rank must be told the same."""
        if not 0 <= rolled_back <= total:
            raise ConfigError(f"rolled_back={rolled_back!r} must be in [0, total={total!r}]")
        if age_s is not None:
            age = require_positive_float("age_s", age_s, "give the job's age in seconds", allow_zero=True)
            self._start = min(self._start, self._clock() - age)
        self._recoveries = max(self._recoveries, total)
        self._rollback_share = (rolled_back + 1) / (total + 1)
        self._regrid()

    @property
    def rollback_share(self) -> float:
        """``p``: the estimated share of failures that roll the job back to a snapshot."""
        return self._rollback_share

    @property
    def cost_seconds(self) -> float | None:
        """The smoothed snapshot cost, or None before the first measurement."""
        return self._cost

    @property
    def failures(self) -> int:
        """``n``: the job's failures counted (recorded, or its recoveries, whichever is more)."""
        return max(len(self._failures), self._recoveries)

    @property
    def quiet_step_seconds(self) -> float | None:
        """The smoothed time of a step no snapshot work slowed (``auto``), or None."""
        return self._quiet_s

    @property
    def step_seconds(self) -> float | None:
        """This rank's smoothed step time (timed policies), or None before two steps were seen."""
        return self._step_s

    @property
    def grid_steps(self) -> int | None:
        """``G``: the due steps are its multiples; None while a timed policy has no step time."""
        return self._grid

    def mtbf_seconds(self) -> float:
        """The job's MTBF estimate now (see the module docstring for the formula)."""
        origin = min([self._start, *self._failures])
        watched = max(self._clock() - origin, 0.0)
        prior = self.policy.mtbf_prior_seconds
        n = self.failures
        if prior is None:
            return watched / max(n, 1)
        return (prior + watched) / (1 + n)

    def interval_seconds(self) -> float | None:
        """Seconds between snapshots now: ``every_seconds``, the auto value, or None."""
        if not self.policy.auto:
            return self.policy.every_seconds
        if self._cost is None:
            return 0.0
        return young_daly_interval(self._cost, self.mtbf_seconds() / self._rollback_share)

    def describe(self) -> dict[str, float | int | str | None]:
        """The scheduler's state as JSON-ready numbers, for logs and status reports."""
        g = self._grid
        return {
            "tier": self.policy.tier,
            "cost_s": self._cost,
            "failures": self.failures,
            "mtbf_s": self.mtbf_seconds(),
            "rollback_share": self._rollback_share,
            "interval_s": self.interval_seconds(),
            "step_s": self._step_s,
            "quiet_step_s": self._quiet_s,
            "grid_steps": g,
            "next_step": None if g is None else ((self._after + 1) // g + 1) * g - 1,
        }

    def _observe(self, step: int) -> None:
        """Fold the time since the previous step into the step time (timed policies only)."""
        now = self._clock()
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0]:
            return
        dt = (now - last[1]) / (step - last[0])
        self._step_s = dt if self._step_s is None else 0.3 * dt + 0.7 * self._step_s
        quiet = self._period is None or last[0] - self._period[0] >= QUIET_AFTER
        if self.policy.auto and quiet and self._warm:
            self._quiet_s = dt if self._quiet_s is None else 0.3 * dt + 0.7 * self._quiet_s
        self._warm = True
        self._regrid()

    def _regrid(self) -> None:
        """``G`` from the interval and the step time now (see the class docstring)."""
        if not self._timed:
            return
        interval, every = self.interval_seconds(), self.policy.every_steps
        if self._step_s is None:
            self._grid = every
            return
        assert interval is not None  # _timed: every_seconds or auto gives one
        fits = math.inf if self._step_s <= 0 else interval / self._step_s
        if every is not None and every <= fits:
            self._grid = every
            return
        n = int(min(fits, 1 << 62))
        self._grid = 1 << (n.bit_length() - 1) if n >= 1 else 1


class StalenessGuard:
    """Raises when training runs too far ahead of the newest committed snapshot."""

    def __init__(self, max_steps_behind: int, *, start_step: int = 0, setting: str = "max_steps_behind"):
        """``setting``: the name the user gave the bound, used in error messages."""
        self.setting = setting
        self.max_steps_behind = require_positive_int(
            setting, max_steps_behind, "give how many steps training may run past the newest committed snapshot"
        )
        self.start_step = start_step

    def check(self, step: int, newest_committed: int | None) -> None:
        """Raise ``StalenessError`` if ``step`` is more than the bound past ``newest_committed``."""
        base = self.start_step if newest_committed is None else newest_committed
        if step - base <= self.max_steps_behind:
            return
        have = (
            f"no snapshot has been committed since step {self.start_step}"
            if newest_committed is None
            else f"the newest committed snapshot is step {newest_committed}"
        )
        raise StalenessError(
            f"step {step}: {have}, {step - base} steps behind, more than "
            f"{self.setting}={self.max_steps_behind}. Snapshots are failing or too slow "
            f"(see the errors logged before this one); fix them, or raise {self.setting}."
        )
