"""Background, throttled spill of committed snapshots to durable storage (one thread per agent).

After a commit the coordinator marked as due (the first commit in each block of
``spill_every`` steps, or ``spill_every_seconds`` after the last; ``CoordinatorCore._spill_due``),
the agent's spill thread writes each local rank's bytes straight from its arena with
``storage.Store.write_rank`` (capped at ``spill_bytes_per_s`` for the whole node), then
reports the ranks to the coordinator, which writes the commit marker once every rank of the
step is written. The version is pinned (not freed) while it is written. A failure (disk
full, permission, network) is logged and counted and the step is retried; it never touches
the in-memory tier. A newer due step replaces an older one that has not started.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from memsnap import metrics
from memsnap.config import tunable
from memsnap.state.manifest import Manifest

log = logging.getLogger("memsnap.spill")


class Spiller:
    """The spill thread of one agent: it reads committed versions from the agent's version
    table (``versions``, under ``lock``) and their bytes from its ``arenas``."""

    def __init__(self, *, cfg, node: str, lock, versions, arenas: dict, report):
        """``report(step, ranks)`` runs after the ranks are written (the agent's ``spilled``:
        tell the coordinator, and in lean mode free the version)."""
        self.cfg, self.node, self.lock, self.versions, self.arenas = cfg, node, lock, versions, arenas
        self.report = report
        self.cond = threading.Condition()
        self.want: int | None = None
        self.urgent: set[int] = set()  # steps to write unthrottled (a preemption notice)
        self.current: int | None = None
        self.state: dict[str, Any] = {"spilled_step": None, "failures": 0, "last_error": None, "bytes": 0}
        self._stop = False
        self._store: Any = None  # the spill root's storage.Store, opened on the first write
        self.thread = threading.Thread(target=self._loop, name="memsnap-spill", daemon=True)
        self.thread.start()

    def committed(self, step: int, due: bool) -> None:
        """``step`` committed; the coordinator says whether it is due for a spill."""
        if due or step in self.urgent:  # urgent: requested before the commit reached us
            with self.cond:
                self.want = max(step, self.want or -1)
                self.cond.notify_all()

    def request(self, step: int) -> None:
        """Spill ``step`` now, unthrottled, due or not (the job is being preempted)."""
        with self.cond:
            self.urgent.add(step)
            self.want = max(step, self.want or -1)
            self.cond.notify_all()

    @classmethod
    def of(cls, core, report) -> Spiller:
        """The spill thread of agent ``core`` (an ``AgentCore``)."""
        return cls(
            cfg=core.cfg, node=core.node, lock=core.lock, versions=core.versions, arenas=core.arenas, report=report
        )

    def busy_with(self, step: int) -> bool:
        return self.current == step

    def status(self) -> dict:
        return dict(self.state, pending=self.want, writing=self.current)

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._stop or self.want is not None)
                if self._stop:
                    return
                step, self.want, self.current = self.want, None, self.want
                assert step is not None  # the wait above ends on a wanted step
            try:
                self._spill(step)
            except Exception as exc:  # reported and retried; RAM is untouched
                self._failed(step, exc)
            finally:
                self.current = None

    def _failed(self, step: int, exc: Exception) -> None:
        self.state["failures"] += 1
        self.state["last_error"] = f"step {step}: {type(exc).__name__}: {exc}"
        log.warning("spill of step %d to %s failed (will retry): %s", step, self.cfg.spill, exc)
        time.sleep(tunable("spill_retry_s"))
        with self.cond:
            if self.want is None and self._version(step) is not None:
                self.want = step

    def _version(self, step: int):
        with self.lock:
            v = self.versions.get(step)
            return v if v is not None and v.state == "committed" else None

    def _spill(self, step: int) -> None:
        from memsnap.durable.storage import Store

        v = self._version(step)
        if v is None:
            return
        if self._store is None:
            self._store = Store.open(self.cfg.spill)
        ranks = sorted(v.manifests)
        t = time.monotonic()
        bps = None if step in self.urgent else self.cfg.spill_bytes_per_s / max(1, len(ranks))
        for rank in ranks:
            man = Manifest.from_json(v.manifests[rank])
            view = self.arenas[(rank, v.slot)].view(0, v.sizes[rank])
            self._store.write_rank(step, rank, man, view, throttle_bps=bps)
            self.state["bytes"] += v.sizes[rank]
        self.report(step, ranks)
        metrics.spilled(self.cfg.job, self.node, time.monotonic() - t)
        self.state["spilled_step"] = step
        self.urgent.discard(step)
