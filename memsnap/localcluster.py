"""A simulated multi-node Ray cluster on one machine, bound to 127.0.0.1 only.

Used by the tests, the benchmarks and ``memsnap demo``. Every node gets a ``memsnap_node_<i>``
custom resource so work can be pinned to it, a small object store, and fast health checks so
that a killed node is noticed in a few seconds instead of a minute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from typing import Any

_log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

# Node-loss detection in seconds instead of a minute: the GCS pings each raylet every
# 0.5 s and declares it dead after 3 missed pings (these are Ray's own config keys).
FAST_FAILURE_SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 500,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}

# Ray starts its workers at nice 15 so that its own daemons stay responsive. On a machine
# whose cores other work shares (a CI runner, a benchmark's busy loops) niced workers get a
# few percent of a core and every test runs many times slower: the loopback cluster's
# workers, ranks and agents run at the niceness of the process that started it.
LOOPBACK_SYSTEM_CONFIG = {**FAST_FAILURE_SYSTEM_CONFIG, "worker_niceness": 0}


# A node of a loaded machine can miss one of Ray's startup deadlines (the raylet gives the
# dashboard agent a fixed 15 s to write its port file, then exits): starts are tried again.
START_TRIES = 3


def _worth_retrying(exc: BaseException) -> bool:
    """A start that timed out or whose processes died is tried again; bad arguments are not."""
    return isinstance(exc, Exception) and not isinstance(exc, (ValueError, TypeError))


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_new(before: set[int]) -> None:
    """Kill this process's descendants that were not there in ``before``: what a failed
    start left running (a GCS, a dashboard, a raylet's workers)."""
    import psutil

    for pid in _descendants() - before:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


class _StartThread:
    """The one thread every node of a cluster is started from; it lives until ``close()``.

    Ray starts a node's processes with ``PR_SET_PDEATHSIG(SIGKILL)``, and Linux sends that
    signal when the *thread* that forked the child exits, not the process: a node added from a
    short-lived thread (a failure injector's) would be killed the moment that thread ended.
    """

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="memsnap-localcluster-start", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller, raised there
                box["error"] = exc
            finally:
                done.set()

    def call(self, fn):
        """``fn()`` on the start thread; its result, or its exception raised here."""
        if threading.current_thread() is self._thread:
            return fn()
        if not self._thread.is_alive():
            raise RuntimeError("this LocalCluster is closed: start a new one to add nodes")
        box: dict = {}
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        self._jobs.put(None)


def loopback_env() -> None:
    """Make every Ray process started from here bind to loopback.

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when it is imported; with it off,
    Ray takes 127.0.0.1 as the node address. If Ray was imported before this ran, the
    constant it already read is switched off too.
    """
    import sys

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    constants: Any = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


loopback_env()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous, such as gloo's)."""
    import socket

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class LocalCluster:
    """``n`` simulated nodes (the head is node 0) on 127.0.0.1.

    Use as a context manager; ``close()`` always tears every process down.
    """

    def __init__(
        self,
        nodes: int = 4,
        *,
        cpus_per_node: float = 1,
        object_store_mb: int = 128,
        connect: bool = True,
        system_config: dict | None = None,
        labels: dict[int, dict] | None = None,
        tries: int = START_TRIES,
    ):
        loopback_env()
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: a cluster needs at least 1 node")
        if tries < 1:
            raise ValueError(f"tries={tries}: a cluster start needs at least 1 try")
        self._labels = labels or {}
        self._cpus = cpus_per_node
        self._store = object_store_mb * 1024 * 1024
        cfg = dict(LOOPBACK_SYSTEM_CONFIG)
        cfg.update(system_config or {})
        self._starter = _StartThread()
        for attempt in range(1, tries + 1):
            before = _descendants()
            try:
                self._start(nodes, cfg, connect)
                return
            except BaseException as exc:
                self._teardown()
                _kill_new(before)
                if attempt == tries or not _worth_retrying(exc):
                    self._starter.close()
                    raise
                _log.warning(
                    "the %d-node loopback cluster did not start (try %d of %d: %s); trying again",
                    nodes,
                    attempt,
                    tries,
                    exc,
                )

    def _start(self, nodes: int, cfg: dict, connect: bool) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self._next = 0
        self.nodes: list[Any] = []  # ray._private.node.Node, in order of addition
        self._index: dict[str, int] = {}  # node id -> i of its memsnap_node_<i> resource
        self.cluster = Cluster(initialize_head=False)
        self.add_node(_system_config=cfg, include_dashboard=False, tries=1)
        for _ in range(nodes - 1):
            self.add_node(tries=1)
        self.cluster.wait_for_nodes()
        if connect:
            ray.init(
                address=self.cluster.address, namespace="memsnap", log_to_driver=False, logging_level=logging.WARNING
            )

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, tries: int = START_TRIES, **kwargs):
        """Start one more node; a start that fails (a node of a loaded machine can miss one of
        Ray's startup deadlines, and its raylet exits) is cleaned up and tried again."""
        for attempt in range(1, tries + 1):
            i = self._next
            self._next += 1
            args = dict(
                num_cpus=self._cpus,
                object_store_memory=self._store,
                node_ip_address=LOOPBACK,
                resources={f"memsnap_node_{i}": 1},
            )
            if i in self._labels:
                args["labels"] = self._labels[i]
            args.update(kwargs)
            before = _descendants()
            try:
                node = self._starter.call(lambda args=args: self._add_one(args))
            except Exception as exc:
                _kill_new(before)
                if attempt == tries or not _worth_retrying(exc):
                    raise
                _log.warning(
                    "node memsnap_node_%d did not start (try %d of %d: %s); trying again", i, attempt, tries, exc
                )
                continue
            self.nodes.append(node)
            self._index[node.node_id] = i
            return node

    def _add_one(self, args: dict):
        with _sigterm_hook_off_main_thread():
            return self.cluster.add_node(**args)

    def index_of(self, node) -> int:
        """The ``i`` of ``node``'s ``memsnap_node_<i>`` resource (a retried start skips one)."""
        return self._index[node.node_id]

    def kill_node(self, node) -> None:
        """Kill a node abruptly (raylet, workers and actors gone, nothing graceful)."""
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def kill_node_hard(self, node) -> float:
        """Kill ``node``'s raylet and every process under it at once, as a lost host goes
        (``kill_node`` alone leaves its workers running for a second). The wall time of the kill."""
        import signal

        import psutil

        raylet = node.all_processes["raylet"][0].process.pid
        tree = [raylet, *(p.pid for p in psutil.Process(raylet).children(recursive=True))]
        t = time.time()
        for pid in tree:  # every process at once, before Ray's teardown of the node (which takes
            try:  # a few tenths of a second, and would let the node's workers live on meanwhile)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.kill_node(node)
        return t

    def close(self) -> None:
        """Tear every process of the cluster down, even a node that died or half started."""
        self._teardown()
        starter = getattr(self, "_starter", None)
        if starter is not None:
            starter.close()

    def _teardown(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster = getattr(self, "cluster", None)
        if cluster is None:
            return
        with contextlib.suppress(Exception):
            cluster.shutdown()
        for node in [cluster.head_node, *cluster.worker_nodes, *getattr(self, "nodes", [])]:
            with contextlib.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def _sigterm_hook_off_main_thread():
    """Ray installs a SIGTERM handler when it starts a node, which only the main thread may
    do; a node added from another thread (a failure injector) skips that hook."""
    import threading

    import ray._private.utils as ray_utils

    if threading.current_thread() is threading.main_thread():
        yield
        return
    original = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def wait_for(predicate, *, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it returns a truthy value; raise naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
