"""The ``Injector``: lands a ``Schedule``'s faults on a running Ray job and records when each landed.

Call protocol: ``Injector(schedule, cluster=... | address=..., log=path)``; ``start()`` (or
``with``) starts the clock and a daemon thread that lands each fault when it is due (``at_s``
seconds after ``start()``, or once the job's step reaches ``at_step``); ``wait(timeout)``
returns once every fault has landed and ended; ``stop()`` ends the thread and undoes what is
still in place (filler files, stalls), then closes the log. ``events`` holds one ``Event`` per fault
landed and one per fault ended, in order; the log is the same, as JSON lines (``read_log``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TextIO

from memsnap.chaos import nodes as nodes_
from memsnap.chaos.schedule import Fault, Schedule
from memsnap.errors import ConfigError

log = logging.getLogger("memsnap.chaos")

CONFIRM_HINT = "pass --yes-kill-nodes (memsnap chaos) or confirm=True (memsnap.chaos.Injector)"
LOG_VERSION = 1


@dataclass
class Event:
    """One record of the timeline: a fault landed (``phase="fault"``) or ended (``phase="end"``)."""

    seq: int
    index: int  # the fault's position in the schedule
    kind: str
    phase: str
    target: str | None  # the node id it landed on (None when no node could be chosen)
    planned_s: float | None
    planned_step: int | None
    landed: float  # time.time() when the action returned (or failed)
    landed_s: float  # seconds since start(), on the monotonic clock
    ok: bool
    detail: dict = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Timeline:
    """A log read back: the header (schedule, seed, cluster, start time), the events, the stop record."""

    header: dict
    events: list[Event]
    stopped: dict | None


def read_log(path: str) -> Timeline:
    """Rebuild a run's timeline from its JSON-lines log."""
    header, events, stopped = None, [], None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                kind = rec.pop("type", None)
                if kind == "event":
                    events.append(Event(**rec))
            except (ValueError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{path}:{n}: not a memsnap.chaos log record ({exc})") from None
            if kind == "start":
                header = rec
            elif kind == "event":
                pass
            elif kind == "stop":
                stopped = rec
            else:
                raise ConfigError(f"{path}:{n}: record type {kind!r} is not start, event or stop")
    if header is None:
        raise ConfigError(f"{path} has no start record: not a memsnap.chaos log")
    return Timeline(header, events, stopped)


class Injector:
    """Lands ``schedule`` on a job: a loopback ``cluster`` (``memsnap.localcluster.LocalCluster``)
    or the Ray cluster at ``address`` (this driver connects to it if it is not yet). A real
    cluster needs ``confirm=True``: faults there kill real nodes. ``job`` names the memsnap job
    (needed by ``stall``, by ``fill_disk`` without ``path``, and by faults ``at_step`` unless the
    loop calls ``observe_step``). The head node is spared unless ``allow_head``."""

    def __init__(
        self,
        schedule: Schedule,
        *,
        cluster=None,
        address: str | None = None,
        log: str | None = None,
        job: str | None = None,
        confirm: bool = False,
        allow_head: bool = False,
        replace_killed: bool = False,
        step_poll_s: float = 0.5,
        backend=None,
    ):
        if not isinstance(schedule, Schedule):
            raise ConfigError(f"schedule={schedule!r}: give a memsnap.chaos.Schedule (Schedule.fixed or .poisson)")
        if backend is None:
            backend = _backend(cluster, address, job, confirm, replace_killed)
        elif replace_killed and not getattr(backend, "local", False):
            raise ConfigError("replace_killed adds nodes to a memsnap.localcluster.LocalCluster only")
        if not (isinstance(step_poll_s, (int, float)) and step_poll_s > 0):
            raise ConfigError(f"step_poll_s={step_poll_s!r}: give the seconds between reads of the job's step (> 0)")
        self.schedule, self.backend, self.allow_head = schedule, backend, allow_head
        self.where = "local" if getattr(backend, "local", False) else (address or "connected")
        self.events: list[Event] = []
        self._log_path = log
        self._log: TextIO | None = None
        self._rng = random.Random(schedule.seed)
        self._pending = list(range(len(schedule.faults)))
        self._undo: list[tuple[float, int, object]] = []  # (due, fault index, undo(early) -> (node, detail))
        self._step: int | None = None
        self._step_poll_s = step_poll_s
        self._stepped = any(f.at_step is not None for f in schedule.faults)
        self._observed = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._landed = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0: float | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Injector:
        if self._thread is not None:
            raise ConfigError("this Injector was started already; make a new one for another run")
        self._t0 = time.monotonic()
        if self._log_path:
            os.makedirs(os.path.dirname(os.path.abspath(self._log_path)), exist_ok=True)
            self._log = open(self._log_path, "w", encoding="utf-8")
        self._write(
            {
                "type": "start",
                "version": LOG_VERSION,
                "time": time.time(),
                "seed": self.schedule.seed,
                "cluster": self.where,
                "source": self.schedule.source,
                "schedule": self.schedule.to_list(),
            }
        )
        self._thread = threading.Thread(target=self._run, name="memsnap-chaos", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 120.0) -> list[Event]:
        """End the schedule (faults not yet landed never land) and undo what is in place."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for _due, i, undo in sorted(self._undo, key=lambda u: u[0]):
            self._end(i, undo, early=True)
        self._undo.clear()
        if self._log is not None:
            self._write(
                {
                    "type": "stop",
                    "time": time.time(),
                    "landed": sum(e.phase == "fault" for e in self.events),
                    "not_landed": list(self._pending),
                }
            )
            self._log.close()
            self._log = None
        return self.events

    def wait(self, timeout: float, *, ended: bool = True) -> bool:
        """Whether every fault landed (and with ``ended``, every one with a duration ended)
        within ``timeout`` seconds."""
        return (self._done if ended else self._landed).wait(timeout)

    def observe_step(self, step: int) -> None:
        """The training loop reached ``step``: faults ``at_step <= step`` land now."""
        with self._lock:
            self._step = step if self._step is None else max(self._step, step)
            self._observed = True
        self._wake.set()

    def __enter__(self) -> Injector:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def elapsed(self) -> float:
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    # --- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # never silent: the faults after this one do not land
            log.exception("memsnap.chaos: the injector's loop failed; later faults will not land")

    def _loop(self) -> None:
        next_poll = 0.0
        while not self._stop.is_set():
            now = self.elapsed
            if self._stepped and not self._observed and now >= next_poll and self._pending_steps():
                next_poll = now + self._step_poll_s
                self._poll_step()
            for i in [i for i in self._pending if self._due(self.schedule.faults[i], now)]:
                if self._stop.is_set():
                    return
                self._pending.remove(i)
                self._land(i)
            for u in [u for u in self._undo if u[0] <= self.elapsed]:
                self._undo.remove(u)
                self._end(u[1], u[2], early=False)
            if not self._pending:
                self._landed.set()
            if not self._pending and all(u[0] == float("inf") for u in self._undo):
                self._done.set()  # (fills without a duration stay until stop())
                if not self._undo:
                    return
            self._wake.wait(self._sleep(next_poll))
            self._wake.clear()

    def _pending_steps(self) -> bool:
        return any(self.schedule.faults[i].at_step is not None for i in self._pending)

    def _poll_step(self) -> None:
        try:
            step = self.backend.step()
        except ConfigError as exc:  # no job to read: only observe_step() can land them
            log.warning("faults at_step wait for observe_step(): %s", exc)
            self._stepped = False
            return
        except Exception as exc:  # the job may be restarting: try again at the next poll
            log.info("could not read the job's step: %s", exc)
            return
        if step is not None:
            with self._lock:
                self._step = step if self._step is None else max(self._step, step)

    def _due(self, f: Fault, now: float) -> bool:
        if f.at_s is not None:
            return f.at_s <= now
        with self._lock:
            return self._step is not None and f.at_step is not None and self._step >= f.at_step

    def _sleep(self, next_poll: float) -> float:
        now = self.elapsed
        times = [t for t in (self.schedule.faults[i].at_s for i in self._pending) if t is not None]
        times += [u[0] for u in self._undo if u[0] != float("inf")]
        if self._stepped and not self._observed and self._pending_steps():
            times.append(next_poll)
        return min([max(t - now, 0.0) for t in times], default=3600.0)

    # --- landing one fault -------------------------------------------------------------------------
    def _land(self, i: int) -> None:
        f = self.schedule.faults[i]
        node, detail, error = None, {}, None
        try:
            node = nodes_.resolve(f.target, self.backend.nodes(), self._rng, allow_head=self.allow_head)
            detail = self._act(i, f, node) or {}
        except Exception as exc:  # recorded, never raised: the run goes on
            error = f"{type(exc).__name__}: {exc}"
            log.warning("fault %d (%s) on %s did not land: %s", i, f.kind, node.id[:12] if node else f.target, error)
        self._record(i, f, "fault", node.id if node else None, detail, error)

    def _act(self, i: int, f: Fault, node: nodes_.Node) -> dict:
        b = self.backend
        if f.kind == "kill_node":
            return b.kill_node(node)
        if f.kind == "kill_process":
            return b.kill_process(node, f.process, self._rng)
        if f.kind == "stall":  # the agent ends it itself; the undo records the end (or ends it at stop())
            assert f.duration_s is not None  # Fault checks a stall has one
            detail = b.stall(node, f.duration_s)
            self._undo.append((self.elapsed + f.duration_s, i, lambda early: (node.id, b.end_stall(node, early))))
            return detail
        if f.kind == "preempt":
            return b.preempt(node, f.how, f.duration_s, f.process)
        detail = b.fill_disk(node, f.path, f.limit_bytes)
        due = float("inf") if f.duration_s is None else self.elapsed + f.duration_s
        self._undo.append((due, i, lambda early: (node.id, b.unfill(node, detail["path"]))))
        return detail

    def _end(self, i: int, undo, early: bool) -> None:
        f = self.schedule.faults[i]
        target, detail, error = None, {}, None
        try:
            target, detail = undo(early)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("fault %d (%s) could not be undone: %s", i, f.kind, error)
        self._record(i, f, "end", target, detail, error)

    def _record(self, i: int, f: Fault, phase: str, target: str | None, detail: dict, error: str | None) -> None:
        ev = Event(
            len(self.events),
            i,
            f.kind,
            phase,
            target,
            f.at_s,
            f.at_step,
            time.time(),
            round(self.elapsed, 6),
            error is None,
            detail,
            error,
        )
        self.events.append(ev)
        self._write(dict(type="event", **ev.to_dict()))

    def _write(self, rec: dict) -> None:
        if self._log is not None:
            self._log.write(json.dumps(rec, sort_keys=True) + "\n")
            self._log.flush()


def _backend(cluster, address, job, confirm, replace_killed):
    from memsnap.chaos.backend import LocalBackend, RayBackend

    if (cluster is None) == (address is None):
        raise ConfigError(
            "give exactly one of cluster= (a memsnap.localcluster.LocalCluster) and address= (a running Ray cluster)"
        )
    if cluster is not None:
        return LocalBackend(cluster, job, replace_killed)
    if replace_killed:
        raise ConfigError(
            "replace_killed adds nodes to a memsnap.localcluster.LocalCluster only; on a real "
            "cluster the autoscaler replaces nodes"
        )
    if confirm is not True:
        raise ConfigError(
            f"refusing to inject faults into the Ray cluster at {address!r} without confirmation: "
            f"they kill real nodes and processes; {CONFIRM_HINT}"
        )
    _connect(address)
    return RayBackend(job)


def _connect(address: str) -> None:
    import ray

    from memsnap import naming

    if ray.is_initialized():
        return
    if address.replace("ray://", "").split(":")[0] in ("127.0.0.1", "localhost"):
        from memsnap.localcluster import loopback_env

        loopback_env()
    ray.init(address=address, namespace=naming.NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
