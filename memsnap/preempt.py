"""Preemption notices: SIGTERM and Ray node drains, turned into one ``on_preempt(deadline)`` call.

A ``PreemptionWatcher`` watches two sources and, on the first notice from either, sets
``preempted`` and calls ``on_preempt(deadline_seconds)`` exactly once, with the seconds left
before the node goes away. The training loop uses it to take one last snapshot, spill it
before the deadline and exit cleanly.

* **Signals** (SIGTERM by default): installed only when ``start()`` runs in the main thread
  (Python delivers signals there only); elsewhere, e.g. inside a Ray Train worker thread, the
  signals are skipped and the drain poll is the source. The deadline of a signal is
  ``grace_seconds`` (Kubernetes' default termination grace period is 30 s). A previous Python
  handler is chained: it runs after ``on_preempt``, on every signal; if it asks to exit
  (``SystemExit``, as the handler ``ray.init`` installs in every driver does), that is not
  passed on. A previous ``SIG_DFL`` is not re-raised either, so the process is not killed
  before its last snapshot; exiting is up to the training loop. Python runs handlers between bytecodes of the main thread, so a notice that
  arrives during a long native call (a CUDA kernel, a big copy) is handled when it returns.
* **Ray drains** (optional, ``poll_seconds``): a daemon thread asks the GCS every
  ``poll_seconds`` for the nodes being drained, ``ray._private.state.state.
  get_draining_nodes()`` (``{node_id_hex: deadline_ms}``, 0 meaning no deadline; the source
  Ray Train's own preemption watcher uses), and fires when this node is in it. One small GCS
  call per poll, off the training thread.

``on_preempt`` runs in the main thread (from the signal handler) or in the poll thread. An
exception it raises is logged and kept in ``error``, never thrown into the training loop at
an arbitrary bytecode.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from memsnap.errors import ConfigError
from memsnap.policy import require_positive_float

# what signal.signal takes and returns as a handler
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

log = logging.getLogger(__name__)

DrainSource = Callable[[], Mapping[str, int]]


def ray_draining_nodes() -> Mapping[str, int]:
    """Ray's nodes being drained, ``{node_id_hex: deadline_ms}`` (0: no deadline)."""
    import ray

    return ray._private.state.state.get_draining_nodes()


def _check_signal(sig: Any) -> signal.Signals:  # any value: Signals() rejects a non-signal
    try:
        return signal.Signals(sig)
    except (ValueError, TypeError):
        raise ConfigError(
            f"signals: {sig!r} is not a signal number; pass e.g. (signal.SIGTERM, signal.SIGUSR1)"
        ) from None


def _current_ray_node() -> str:
    import ray

    if not ray.is_initialized():
        raise ConfigError(
            "poll_seconds is set but Ray is not initialised: call ray.init() "
            "first, or pass node_id= and draining_nodes="
        )
    return ray.get_runtime_context().get_node_id()


class PreemptionWatcher:
    """Turns SIGTERM or a Ray drain of this node into one ``on_preempt(deadline_seconds)``.

    Call protocol: ``start()`` (or ``with``), train while checking ``preempted`` if wanted,
    ``stop()`` (restores the previous signal handlers, ends the poll thread).
    """

    def __init__(
        self,
        on_preempt: Callable[[float], None],
        *,
        grace_seconds: float = 30.0,
        signals: Sequence[int] = (signal.SIGTERM,),
        poll_seconds: float | None = None,
        node_id: str | None = None,
        draining_nodes: DrainSource | None = None,
        wall_clock: Callable[[], float] = time.time,
    ):
        if not callable(on_preempt):
            raise ConfigError(
                f"on_preempt={on_preempt!r} is not callable; pass a function "
                "taking the seconds left before the node goes away"
            )
        self.grace_seconds = require_positive_float(
            "grace_seconds", grace_seconds, "give the seconds a signalled process has before it is killed"
        )
        if poll_seconds is not None:
            require_positive_float(
                "poll_seconds", poll_seconds, "give the seconds between drain polls, or None to not poll"
            )
        self._on_preempt = on_preempt
        self._signals = tuple(_check_signal(s) for s in signals)
        self._poll_seconds = poll_seconds
        self._node_id = node_id
        self._draining_nodes = draining_nodes or ray_draining_nodes
        self._wall = wall_clock
        self._lock = threading.RLock()
        self._fired = False
        self._previous: dict[int, _Handler] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_warned = False
        self.deadline_at: float | None = None  # time.monotonic() of the deadline
        self.reason: str | None = None
        self.error: BaseException | None = None

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> PreemptionWatcher:
        """Install the signal handlers (main thread only) and start the drain poll."""
        polls = self._poll_seconds is not None and self._thread is None
        if polls and self._node_id is None:
            self._node_id = _current_ray_node()
        self._install_signals()
        if polls:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll_loop, daemon=True, name="memsnap-preempt-poll")
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Restore the previous signal handlers and end the poll thread."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._thread = None
        self._restore_signals()

    def __enter__(self) -> PreemptionWatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def signals_installed(self) -> bool:
        return bool(self._previous)

    # --- state -------------------------------------------------------------------------
    @property
    def preempted(self) -> bool:
        return self._fired

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (never below 0), or None before a notice."""
        if self.deadline_at is None:
            return None
        return max(self.deadline_at - time.monotonic(), 0.0)

    def trigger(self, deadline_seconds: float, reason: str) -> bool:
        """Record a notice; the first one calls ``on_preempt``. True if this call fired."""
        with self._lock:
            if self._fired:
                return False
            self._fired = True
            self.deadline_at = time.monotonic() + deadline_seconds
            self.reason = reason
        log.warning("memsnap: preemption notice (%s), %.1f s left", reason, deadline_seconds)
        try:
            self._on_preempt(deadline_seconds)
        except Exception as exc:  # noqa: BLE001 - must not escape into the training loop
            self.error = exc
            log.exception("memsnap: on_preempt raised; the last snapshot may be missing")
        return True

    # --- signals -------------------------------------------------------------------------
    def _install_signals(self) -> None:
        if not self._signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            log.info(
                "memsnap: not in the main thread, signal handlers not installed; use poll_seconds to catch Ray drains"
            )
            return
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, prev in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:  # leave a newer handler in place
                signal.signal(sig, prev)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        self.trigger(self.grace_seconds, f"signal {signal.Signals(signum).name}")
        prev = self._previous.get(signum)
        if callable(prev):
            try:
                prev(signum, frame)
            except SystemExit as exc:  # e.g. Ray's driver handler: sys.exit(signum)
                log.warning(
                    "memsnap: the previous %s handler asked to exit (%s); the training loop "
                    "exits after its last snapshot instead",
                    signal.Signals(signum).name,
                    exc.code,
                )

    # --- Ray drain poll ------------------------------------------------------------------
    def poll_once(self) -> bool:
        """Ask the drain source once; fire if this node is draining. True if it is."""
        try:
            draining = self._draining_nodes() or {}
        except Exception as exc:  # noqa: BLE001 - a GCS hiccup must not stop training
            if not self._poll_warned:
                log.warning("memsnap: cannot read Ray's draining nodes (%s); retrying", exc)
                self._poll_warned = True
            return False
        node = self._node_id
        if node is None or node not in draining:
            return False
        deadline_ms = draining[node]
        left = self.grace_seconds if not deadline_ms else max(deadline_ms / 1000.0 - self._wall(), 0.0)
        self.trigger(left, f"Ray is draining node {self._node_id}")
        return True

    def _poll_loop(self) -> None:
        while not self._stop.is_set() and not self._fired:
            if self.poll_once():
                return
            self._stop.wait(self._poll_seconds)
