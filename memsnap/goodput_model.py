"""Goodput under failures: projected for memsnap and for disk checkpointing, from measured figures.

Pure functions, seconds and GiB throughout. The model (first order, the same one Young and
Daly optimise):

* job MTBF ``M = node_mtbf / nodes`` (any node's loss interrupts the job);
* a protection scheme snapshots every ``tau`` seconds of training and stalls training ``C``
  seconds per snapshot; a failure costs the recovery ``R = detect + restart + restore`` plus
  the work since the newest *completed* snapshot: on average half a period ``(tau + C) / 2``
  plus the time a snapshot takes to complete after the stall (``lag``);
* goodput, the share of wall time that makes lasting progress::

      G = tau / (tau + C) * max(0, 1 - (R + (tau + C) / 2 + lag) / M)

* the best period is Young/Daly ``sqrt(2 C M)``, but never below what the scheme's
  pipeline sustains (the background work of one snapshot must finish before the next) or
  one training step.

In place (``memsnap.inplace``), a failure costs no restart: the surviving ranks keep their
processes and (where they are not replicas) roll back from their own node's RAM, a warm standby takes the lost node's ranks
from its peers, and memsnap notices the loss itself (a failed collective, a missed heartbeat)
instead of waiting for the cluster manager::

      R_inplace = detect_inplace + reform + max(S / peer restore, S / local restore)

Where the ranks are replicas (data parallel), an in-place recovery rolls nothing back
(``memsnap.collective.live``): the survivors keep their live state and the standby receives it
from them, so a failure loses only the step in flight (half a step on average), not half a
period plus the lag, and the recovery moves a node's state from the replicas::

      R_live = detect_inplace + reform + S / live_move
      G_live = tau / (tau + C) * max(0, 1 - (R + W) / M),  W = step / 2

(the snapshots still run: they are what the job falls back to when no standby is left, and
for losses the replicas do not cover).

A used standby is replaced in the background within ``standby_warm_s``; a second failure
before then finds no standby and the job restarts as a whole (the ``R`` above). With a
Poisson failure process that happens with probability ``p = 1 - exp(-standby_warm_s / M)``
for each of ``spares`` standbys used up in a row (first order: ``p ** spares``), so::

      R = (1 - p**spares) * R_inplace + p**spares * R_restart

memsnap's stall is the capture of the state into the agent's RAM (``stall_s_per_gib``); the
agents then checksum, encode and send ``S (k+m)/k`` bytes per node in the background (agent
CPU ``agent_cpu_s_per_gib`` over ``agent_cores``, the NIC); a lost node restores from its
peers, the others from their own RAM. Disk checkpointing writes every node's state through
storage whose bandwidth all nodes share; synchronous (``torch.save``) it stalls for the whole
write, asynchronous (DCP ``async_save``) for a staging copy, but the next checkpoint cannot
start before the write is done; after a failure every node reads its state back.

Failure rates: the Llama 3 report (Dubey et al., "The Llama 3 Herd of Models", 2024, sec.
3.3.4) counts 419 unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs
(2,048 nodes of 8): a job MTBF of 3.1 h, about 6,300 h per node (``LLAMA3_NODE_MTBF_H``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memsnap.errors import ConfigError
from memsnap.policy import agent_ram, require_positive_int

LLAMA3_NODE_MTBF_H = 54 * 24 / 419 * 2048  # 6,335 h: 419 interruptions / 54 days / 2,048 nodes


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The Young/Daly optimum period ``sqrt(2 * cost * mtbf)``, seconds."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def goodput_losing(period_s: float, stall_s: float, mtbf_s: float, recovery_s: float, lost_s: float) -> float:
    """``tau / (tau + C) * max(0, 1 - (R + W) / M)``: ``W`` the work a failure throws away."""
    cycle = period_s + stall_s
    return period_s / cycle * max(0.0, 1.0 - (recovery_s + lost_s) / mtbf_s)


def periodic_goodput(period_s: float, stall_s: float, mtbf_s: float, recovery_s: float, lag_s: float = 0.0) -> float:
    """``tau / (tau + C) * max(0, 1 - (R + (tau + C) / 2 + lag) / M)`` (module docstring)."""
    cycle = period_s + stall_s
    return period_s / cycle * max(0.0, 1.0 - (recovery_s + cycle / 2.0 + lag_s) / mtbf_s)


def lost_steps_per_failure(every_steps: int, lag_s: float, step_s: float) -> float:
    """Expected completed steps a failure throws away when a snapshot is taken after every
    ``every_steps``-th step and completes ``lag_s`` after it: ``(N - 1) / 2 + lag / step``."""
    return (every_steps - 1) / 2.0 + lag_s / step_s


def run_goodput(
    *,
    fault_times_s: list[float],
    horizon_s: float,
    step_s: float,
    every_steps: int,
    lag_s: float,
    detect_s: float,
    restart_s: float,
    restore_s: float,
    live: bool = False,
) -> float:
    """Goodput of a finite run against the same system's failure-free run: failures at
    ``fault_times_s`` (seconds into a run of ``horizon_s``), each costing the recovery, the lost
    steps and (on average) half a step in progress, but never more than the time the run had
    left. ``step_s`` is the failure-free wall time per step (stalls included). ``live``: the
    recoveries roll nothing back (replicas in place): no steps are lost but the one in flight."""
    lost_steps = 0.0 if live else lost_steps_per_failure(every_steps, lag_s, step_s)
    per_failure = detect_s + restart_s + restore_s + (lost_steps + 0.5) * step_s
    lost = sum(min(per_failure, max(0.0, horizon_s - t)) for t in fault_times_s)
    return max(0.0, 1.0 - lost / horizon_s)


def replay_goodput(
    *,
    fault_times_s: list[float],
    horizon_s: float,
    step_s: float,
    every_steps: int,
    lag_s: float,
    detect_s: float,
    restart_s: float,
    restore_s: float,
    live: bool = False,
    stall_s: float = 0.0,
) -> float:
    """As ``run_goodput``, but each failure loses what it loses where it falls, not the mean:
    the run is played step by step. Steps take ``step_s``; a snapshot is taken after every
    ``every_steps``-th step (completed steps a multiple of it, as ``policy.Scheduler`` and the
    bench's disk systems pick them) and counts ``lag_s`` after that step; a failure at ``t``
    throws away the steps since the newest snapshot counted by ``t`` and the step in progress,
    and training resumes from that snapshot ``detect + restart + restore`` later (``live``:
    from the step the failure cut, nothing rolled back). Returns the steps done by
    ``horizon_s`` over the failure-free run's. Over kill times spread evenly across a
    period, its loss averages ``run_goodput``'s (``tests/test_goodput_model.py``); on a run
    of a few failures, where each falls in its period decides most of what it costs."""
    for name, value in (("step_s", step_s), ("horizon_s", horizon_s)):
        _positive(name, value)
    require_positive_int("every_steps", every_steps, "give the steps between snapshots")
    recovery = detect_s + restart_s + restore_s
    stall = min(max(stall_s, 0.0), step_s * every_steps)
    compute = step_s - stall / every_steps  # a step without its snapshot's stall
    start, base, saved = 0.0, 0, 0  # the segment trains from ``base`` at ``start``; ``saved``: newest counted

    def at(c: int) -> float:
        """When step ``c`` (completed steps) ends in this segment: each snapshot step stalls."""
        return start + (c - base) * compute + (c // every_steps - base // every_steps) * stall

    def done_by(t: float) -> int:
        c = base + max(0, math.floor((t - start) / step_s))
        while at(c + 1) <= t:
            c += 1
        while c > base and at(c) > t:
            c -= 1
        return c

    for t in sorted(fault_times_s):
        if t >= horizon_s:
            break
        t = max(t, start)  # (a failure during a recovery lands once the job trains again)
        done = done_by(t)
        c = done - done % every_steps  # the newest snapshot step reached, back to one counted by ``t``
        while c > base and at(c) + lag_s > t:
            c -= every_steps
        if c > base:
            saved = c
        base, start = (done if live else saved), t + recovery
    return done_by(horizon_s) / (horizon_s / step_s)


@dataclass(frozen=True)
class Measured:
    """Figures measured on real runs: ``bench/goodput.py`` measures each of them (on loopback
    nodes; bench/results/goodput.md). The defaults are round illustrative values, not a
    measurement: pass the ones of your own cluster."""

    stall_s_per_gib: float = 0.5  # memsnap capture stall per GiB of one GPU's state
    agent_cpu_s_per_gib: float = 1.5  # agent core-seconds per GiB snapshotted
    peer_restore_gibps: float = 1.0  # one lost node's state read from its peers
    storage_restore_gibps: float = 1.0  # one node's read from storage (before sharing)
    detect_s: float = 3.0
    restart_s: float = 60.0
    # in place (bench/inplace.py measures them on loopback nodes; bench/results/inplace.md)
    inplace_detect_s: float = 1.0  # a loss -> memsnap's own verdict (lifeline, failed collective, heartbeat)
    reform_s: float = 0.05  # the surviving ranks and the standby form the new group
    local_restore_gibps: float = 2.0  # a survivor rolls back from its own node's RAM
    live_move_gibps: float = 0.5  # replicas: a lost node's state sent by the survivors (live takeover)
    standby_warm_s: float = 30.0  # a used standby replaced: start, the user's setup, warm

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            _positive(name, value)


@dataclass(frozen=True)
class Cluster:
    """The job to project: sizes, failure rate, and the resources that can run out."""

    gpus: int
    gpus_per_node: int = 8
    state_gib_per_gpu: float = 10.0
    node_mtbf_h: float = LLAMA3_NODE_MTBF_H
    storage_gibps: float = 100.0  # shared by every node
    node_storage_gibps: float = 2.0  # one node's own link to storage
    nic_gibps: float = 10.0  # one node's network for snapshots
    agent_cores: float = 4.0  # host cores one node gives its memsnap agent
    host_ram_gib: float = 2048.0
    step_s: float = 10.0
    k: int = 2
    m: int = 1
    keep: int = 2
    spill_every_s: float = 3600.0  # memsnap's durable spill
    spares: int = 1  # warm standby nodes of the in-place job

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name != "spares":
                _positive(name, value)
        if not isinstance(self.spares, int) or isinstance(self.spares, bool) or self.spares < 0:
            raise ConfigError(
                f"spares={self.spares!r} is not an int >= 0; give how many warm standby nodes "
                "the in-place job keeps (0: every failure restarts the job)"
            )
        if self.gpus % self.gpus_per_node:
            raise ConfigError(
                f"gpus={self.gpus} is not a multiple of gpus_per_node={self.gpus_per_node}; give whole nodes"
            )
        if self.nodes < self.k + self.m + 1:
            raise ConfigError(
                f"gpus={self.gpus} make {self.nodes} nodes, too few for k={self.k} m={self.m} "
                f"(needs {self.k + self.m + 1})"
            )

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def state_gib_per_node(self) -> float:
        return self.state_gib_per_gpu * self.gpus_per_node

    @property
    def mtbf_s(self) -> float:
        return self.node_mtbf_h * 3600.0 / self.nodes


@dataclass(frozen=True)
class Projection:
    """One system at one size: its best period, goodput and the resources it uses."""

    system: str
    period_s: float
    stall_s: float
    recovery_s: float
    lag_s: float
    goodput: float
    use: dict[str, float] = field(default_factory=dict)  # resource -> share of it used

    @property
    def binding(self) -> tuple[str, float]:
        """The resource closest to running out, and its share used."""
        name = max(self.use, key=lambda n: self.use[n])
        return name, self.use[name]


def _period(cost_s: float, mtbf_s: float, floor_s: float, step_s: float) -> float:
    """Young/Daly, at least ``floor_s``, in whole steps."""
    tau = max(young_daly(cost_s, mtbf_s), floor_s, step_s)
    return math.ceil(tau / step_s - 1e-9) * step_s


def memsnap(c: Cluster, x: Measured) -> Projection:
    s = c.state_gib_per_node
    stall = x.stall_s_per_gib * c.state_gib_per_gpu
    cpu_s = x.agent_cpu_s_per_gib * s / c.agent_cores
    net_s = s * (c.k + c.m) / c.k / c.nic_gibps
    lag = max(cpu_s, net_s)
    period = _period(stall, c.mtbf_s, max(stall, lag), c.step_s)
    recovery = restart_recovery(c, x)
    ram = agent_ram(s, c.k, c.m, c.keep)
    use = {
        "agent CPU": cpu_s / period,
        "NIC": net_s / period,
        "host RAM": ram / c.host_ram_gib,
        "storage (spill)": s * c.nodes / c.spill_every_s / c.storage_gibps,
    }
    return Projection(
        "memsnap", period, stall, recovery, lag, periodic_goodput(period, stall, c.mtbf_s, recovery, lag), use
    )


def restart_recovery(c: Cluster, x: Measured) -> float:
    """memsnap's recovery by a whole-job restart: detect, restart, the lost node's state from its peers."""
    return x.detect_s + x.restart_s + c.state_gib_per_node / x.peer_restore_gibps


def inplace_recovery(c: Cluster, x: Measured) -> tuple[float, float, float]:
    """``(R, R_inplace, p_no_standby)`` of a failure in place (module docstring)."""
    s = c.state_gib_per_node
    fast = x.inplace_detect_s + x.reform_s + max(s / x.peer_restore_gibps, s / x.local_restore_gibps)
    slow = restart_recovery(c, x)
    p = (1.0 - math.exp(-x.standby_warm_s / c.mtbf_s)) ** c.spares
    return (1.0 - p) * fast + p * slow, fast, p


def live_recovery(c: Cluster, x: Measured) -> tuple[float, float, float]:
    """``(R, R_live, p_no_standby)`` of a failure in place where the ranks are replicas."""
    fast = x.inplace_detect_s + x.reform_s + c.state_gib_per_node / x.live_move_gibps
    _, _, p = inplace_recovery(c, x)
    return (1.0 - p) * fast + p * restart_recovery(c, x), fast, p


def memsnap_live(c: Cluster, x: Measured) -> Projection:
    """memsnap in place where the ranks are replicas (data parallel): the same snapshots; a
    failure with a standby at hand loses only the step in flight; without one the job restarts
    and rolls back (``inplace_recovery``'s ``p``)."""
    base = memsnap(c, x)
    recovery, _, p = live_recovery(c, x)
    rollback = (base.period_s + base.stall_s) / 2.0 + base.lag_s
    lost = (1.0 - p) * c.step_s / 2.0 + p * rollback
    goodput = goodput_losing(base.period_s, base.stall_s, c.mtbf_s, recovery, lost)
    use = dict(base.use, **{"no standby left": p})
    return Projection("memsnap in place, replicas", base.period_s, base.stall_s, recovery, base.lag_s, goodput, use)


def memsnap_inplace(c: Cluster, x: Measured) -> Projection:
    """memsnap with in-place recovery: the same snapshots, the recovery of ``inplace_recovery``.
    Both memsnap rows assume a node to replace the lost one is at hand (a warm standby here, a
    node the cluster manager gives for the restart), so neither is charged for spare nodes."""
    base = memsnap(c, x)
    recovery, _, p = inplace_recovery(c, x)
    goodput = periodic_goodput(base.period_s, base.stall_s, c.mtbf_s, recovery, base.lag_s)
    use = dict(base.use, **{"no standby left": p})
    return Projection("memsnap in place", base.period_s, base.stall_s, recovery, base.lag_s, goodput, use)


def disk(c: Cluster, x: Measured, *, asynchronous: bool = False) -> Projection:
    s = c.state_gib_per_node
    write_s = max(s * c.nodes / c.storage_gibps, s / c.node_storage_gibps)
    read_s = max(s * c.nodes / c.storage_gibps, s / min(c.node_storage_gibps, x.storage_restore_gibps))
    recovery = x.detect_s + x.restart_s + read_s
    if asynchronous:
        stall, lag = x.stall_s_per_gib * c.state_gib_per_gpu, write_s
        period = _period(stall, c.mtbf_s, write_s, c.step_s)
    else:
        stall, lag = write_s, 0.0
        period = _period(stall, c.mtbf_s, 0.0, c.step_s)
    use = {"storage bandwidth": write_s / (period + stall), "checkpoint cost vs MTBF": stall / (c.mtbf_s / 2.0)}
    return Projection(
        "disk (async)" if asynchronous else "disk (sync)",
        period,
        stall,
        recovery,
        lag,
        periodic_goodput(period, stall, c.mtbf_s, recovery, lag),
        use,
    )


def project(c: Cluster, x: Measured) -> list[Projection]:
    """memsnap in place (replicas: nothing rolled back; else a rollback in place), memsnap
    restarting the job, synchronous and asynchronous disk checkpointing, for cluster ``c``."""
    return [memsnap_live(c, x), memsnap_inplace(c, x), memsnap(c, x), disk(c, x), disk(c, x, asynchronous=True)]


def _positive(name: str, value) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(f"{name}={value!r} is not a finite number > 0; give a positive value")
