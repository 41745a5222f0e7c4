"""Heartbeats through the rendezvous store: each member beats from its own thread; the
controller reads every member's counter and calls a member lost when its counter stops.

A slow member is not a lost one: the beat comes from a thread of its own, which keeps beating
while the training thread is stuck in a long step, a long collective or a GC pause. Only a
process that stops as a whole (killed, frozen by SIGSTOP, its host gone) stops beating. A
member whose beats stop for ``lost_after_s`` is fenced (killed and left out of every later
generation), so a frozen process that wakes up later finds itself out of the job.
"""

from __future__ import annotations

import threading
import time


def beat_key(job: str, member: str) -> str:
    return f"memsnap/{job}/hb/{member}"


class Beater:
    """Beats ``member``'s counter every ``interval_s`` from a daemon thread. ``store``: a client
    no other thread uses (a store client serves one call at a time: a wait on it stops the beats)."""

    def __init__(self, store, job: str, member: str, interval_s: float):
        self.store, self.key, self.interval = store, beat_key(job, member), float(interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memsnap-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(self.key, 1)
            except Exception:  # the controller went away; nothing to beat for
                return
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Monitor:
    """The controller's view of every member's beats (``poll`` from one thread)."""

    def __init__(self, store, job: str, clock=time.monotonic):
        self.store, self.job, self.clock = store, job, clock
        self._last: dict[str, tuple[int, float]] = {}  # member -> (counter, when it last moved)

    def watch(self, member: str) -> None:
        """Start watching ``member`` (its counter starts at 0; the clock starts now)."""
        self.store.set(beat_key(self.job, member), "0")
        self._last[member] = (0, self.clock())

    def forget(self, member: str) -> None:
        self._last.pop(member, None)

    def poll(self) -> dict[str, float]:
        """``{member: seconds since its counter last moved}`` for every watched member."""
        members = list(self._last)
        if not members:
            return {}
        values = self.store.multi_get([beat_key(self.job, m) for m in members])
        now = self.clock()
        ages = {}
        for member, raw in zip(members, values):
            count = int(raw or b"0")
            last, since = self._last[member]
            if count != last:
                self._last[member] = (count, now)
                since = now
            ages[member] = now - since
        return ages
