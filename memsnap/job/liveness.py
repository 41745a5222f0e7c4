"""memsnap's own verdict on a node: every agent beats to the coordinator, and a silent one is asked.

Each node's agent sends ``beat(node)`` to the job's coordinator every ``heartbeat_s`` from
its own thread (``actors.SnapshotAgent``). The coordinator keeps the clock here and, every
tick, asks each node whose agent has been silent for ``agent_lost_after_s`` a ping with a
deadline of ``agent_ping_s`` (``actors.Coordinator``). The ping's outcome decides:

  ``answered``  the agent is slow, not lost (its beats were late: a loaded host, a starved
                thread). Its clock starts again; the node counts one more ``slow`` verdict.
  ``died``      Ray says the agent's actor is dead while its node is alive: the process is
                gone, not the host (Ray answers at once; every call on it fails at once too).
                The node is forgotten until an agent of it beats again; nothing is fenced.
  ``silent``    no answer by the deadline, or Ray cannot reach the actor (its host vanished
                without closing its sockets, or is frozen): the node is **lost** and the
                coordinator fences it (``CoordinatorCore.node_lost``).

A reset on the data plane (a push to a holder refused or reset: its process is gone) makes
its node a *suspect*: it is asked at once instead of after ``agent_lost_after_s``.

The two limits adapt to each node, as a phi-accrual detector's do (but in plain seconds):
``agent_lost_after_s`` and ``agent_ping_s`` are floors. A node's silence limit is the larger
of the floor and ``GAP_FACTOR`` times the longest gap between its last ``HISTORY`` beats; its
ping deadline the larger of the floor and ``RTT_FACTOR`` times its slowest recent answer,
capped at ``PING_CAP_S``. A healthy agent on an idle host (beats every 0.25 s) is asked
after 0.5 s of silence and fenced 0.4 s later: a frozen agent costs about 0.9-1.2 s from its
last beat to the fence (the watch ticks every ``heartbeat_s``). One on a loaded host, whose
beats come 0.6 s apart, is asked only after 1.2 s; one whose pings took 0.2 s to answer
gets 0.8 s. A silence that was answered counts as a gap, so a node that was once slow is
given longer from then on.

A ping's deadline also reads the load on the whole job, since one silent node among many
loaded ones is most likely just as loaded: every ping answered in the last
``LOAD_WINDOW_S`` (by any node) counts as the probed node's own, and each probe also pings
one *control* node that is beating (``control``). A frozen agent among idle ones is fenced
at the floor; one that falls silent while the others answer slowly, or while the control's
own ping is still out, is waited for as long as they needed (never beyond ``PING_CAP_S``).

False positives, and how they are avoided: a node is never declared lost from its silence
alone, only when a ping also goes unanswered; the beats come from a thread of the agent's
own, so an agent busy with its work (its data plane runs on other threads, the codec
releases the GIL) keeps beating; the limits grow with what each node was seen to need; and a
coordinator that was itself starved (its tick came more than half a silence floor later than
its period) judges nobody on that tick and starts every clock again, since the silence it
would see is its own.

This module is the pure state (a clock passed in), tested without Ray; the Ray faces send
the beats and pings.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable

OUTCOMES = ("answered", "died", "silent")
HISTORY = 32  # the beat gaps and ping answers remembered per node
GAP_FACTOR = 2.0  # a node is asked after this many times its longest recent gap between beats
RTT_FACTOR = 4.0  # a ping waits this many times the node's slowest recent answer ...
PING_CAP_S = 2.0  # ... but never longer than this (a frozen host must still be fenced)
LOAD_WINDOW_S = 10.0  # a ping any node answered this recently tells every ping how loaded the job is


@dataclasses.dataclass
class Verdict:
    """What one probe decided about ``node``: ``lost`` (fence it), ``slow``, or ``gone``."""

    node: str
    outcome: str  # one of OUTCOMES
    silent_s: float  # how long the node had not beaten when it was asked
    why: str

    @property
    def lost(self) -> bool:
        return self.outcome == "silent"


class Liveness:
    """The coordinator's clock of every agent's beats; ``due`` names the nodes to ask."""

    def __init__(self, lost_after_s: float, clock: Callable[[], float] = time.monotonic, tick_s: float = 0.25):
        if not lost_after_s > 0:
            raise ValueError(f"lost_after_s={lost_after_s!r}: must be > 0 seconds")
        if not tick_s > 0:
            raise ValueError(f"tick_s={tick_s!r}: the watch's period must be > 0 seconds")
        self.lost_after_s = float(lost_after_s)  # the floor of every node's silence limit
        self.tick_s = float(tick_s)  # how often ``due`` is called
        self.clock = clock
        self.gaps: dict[str, deque[float]] = {}  # node -> its recent gaps between beats
        self.rtts: dict[str, deque[float]] = {}  # node -> its recent ping answer times
        self.recent: deque[tuple[float, str, float]] = deque(maxlen=HISTORY)  # (when, node, seconds)
        self.last: dict[str, float] = {}  # node -> when its agent last beat (or was last heard)
        self.probing: set[str] = set()
        self.suspects: dict[str, str] = {}  # node -> why the data plane suspects it
        self.slow: dict[str, int] = {}  # node -> how many times a silent agent answered its ping
        self.lost: dict[str, str] = {}  # node -> why it was declared lost (never watched again)
        self._tick: float | None = None

    def beat(self, node: str) -> bool:
        """``node``'s agent beat. False when the node was declared lost (its agent is fenced)."""
        if node in self.lost:
            return False
        now = self.clock()
        if node in self.last:
            self._remember(self.gaps, node, now - self.last[node])
        self.last[node] = now
        return True

    def silence_limit(self, node: str) -> float:
        """How long ``node`` may be silent before it is asked: the floor, or twice its longest
        recent gap between beats."""
        gaps = self.gaps.get(node)
        return max(self.lost_after_s, GAP_FACTOR * max(gaps)) if gaps else self.lost_after_s

    def ping_deadline(self, node: str, floor_s: float) -> float:
        """How long a ping of ``node`` waits: ``floor_s``, or four times the slowest answer
        among its own recent ones and any node's in the last ``LOAD_WINDOW_S``, never above
        ``PING_CAP_S`` (nor below ``floor_s``)."""
        now = self.clock()
        seen = [*self.rtts.get(node, ()), *(s for t, _, s in self.recent if now - t <= LOAD_WINDOW_S)]
        if not seen:
            return floor_s
        return max(floor_s, min(PING_CAP_S, RTT_FACTOR * max(seen)))

    def answered(self, node: str, seconds: float) -> None:
        """A ping of ``node`` was answered in ``seconds`` (a probe's, or a control's)."""
        self._remember(self.rtts, node, seconds)
        self.recent.append((self.clock(), node, max(0.0, seconds)))

    def control(self, node: str) -> str | None:
        """The node to ping beside a probe of ``node``, to tell a frozen agent from a loaded
        job: the one heard from last (not ``node``, not being asked, not lost), or None."""
        others = [(t, n) for n, t in self.last.items() if n != node and n not in self.probing]
        return max(others)[1] if others else None

    @staticmethod
    def _remember(table: dict[str, deque[float]], node: str, seconds: float) -> None:
        table.setdefault(node, deque(maxlen=HISTORY)).append(max(0.0, seconds))

    def suspect(self, node: str, why: str) -> bool:
        """The data plane saw ``node`` reset a connection: ask it at the next ``due``. False for
        a node not watched (it never beat) or already lost."""
        if node in self.lost or node not in self.last:
            return False
        self.suspects.setdefault(node, why)
        return True

    def due(self, nodes: Iterable[str]) -> dict[str, str]:
        """``{node: why}`` of ``nodes`` to ask now: silent past its ``silence_limit``, or
        suspected. Each is marked as being asked until ``decide`` (one probe at a time per
        node). Nodes that never beat are not judged (an agent of an older version, or one
        still starting)."""
        now = self.clock()
        starved = self._tick is not None and now - self._tick > self.tick_s + self.lost_after_s / 2
        self._tick = now
        if starved:  # the coordinator itself was not running: the silence would be its own
            for node in self.last:
                self.last[node] = now
            return {}
        out = {}
        for node in nodes:
            if node in self.probing or node in self.lost or node not in self.last:
                continue
            age = now - self.last[node]
            if node in self.suspects:
                out[node] = f"{self.suspects[node]}; last beat {age:.1f} s ago"
            elif age >= self.silence_limit(node):
                out[node] = f"no heartbeat for {age:.1f} s"
            else:
                continue
            self.probing.add(node)
        return out

    def decide(self, node: str, outcome: str, why: str, ping_s: float) -> Verdict:
        """The probe of ``node`` ended with ``outcome`` (``OUTCOMES``); ``why`` said why it was
        asked. Returns the verdict and updates the clock."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome={outcome!r}: must be one of {OUTCOMES}")
        now = self.clock()
        silent_s = now - self.last.get(node, now)
        self.probing.discard(node)
        self.suspects.pop(node, None)
        if outcome == "answered":
            self.slow[node] = self.slow.get(node, 0) + 1
            self._remember(self.gaps, node, silent_s)  # it needed this long: allow it next time
            self.last[node] = now
            return Verdict(node, outcome, silent_s, f"{why}, but its agent answered a ping: slow, not lost")
        self.last.pop(node, None)
        if outcome == "died":
            return Verdict(node, outcome, silent_s, f"{why}: its agent's actor is dead (the host is up)")
        verdict = Verdict(node, outcome, silent_s, f"{why}, and its agent did not answer a ping in {ping_s:g} s")
        self.lost[node] = verdict.why
        return verdict

    def forget(self, node: str) -> None:
        """``node`` left the job (or was fenced another way): its silence means nothing."""
        self.last.pop(node, None)
        self.probing.discard(node)
        self.suspects.pop(node, None)
        self.gaps.pop(node, None)
        self.rtts.pop(node, None)
        self.recent = deque((e for e in self.recent if e[1] != node), maxlen=HISTORY)

    def fenced(self, node: str, why: str) -> None:
        """``node`` was declared lost by another route (the in-place controller): never judged
        again, and its agent's beats are answered "fenced"."""
        self.forget(node)
        self.lost.setdefault(node, why)

    def status(self) -> dict:
        now = self.clock()
        return {
            "beating": {n: round(now - t, 3) for n, t in sorted(self.last.items())},
            "silence_limit_s": {n: round(self.silence_limit(n), 3) for n in sorted(self.last)},
            "slow": dict(sorted(self.slow.items())),
            "lost": dict(sorted(self.lost.items())),
        }
