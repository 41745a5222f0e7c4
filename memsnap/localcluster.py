"""A simulated multi-node Ray cluster on one machine, bound to 127.0.0.1 only.

Used by the tests, the benchmarks and ``memsnap demo``. Every node gets a ``memsnap_node_<i>``
custom resource so work can be pinned to it, a small object store, and fast health checks so
that a killed node is noticed in a few seconds instead of a minute.
"""
from __future__ import annotations

import contextlib
import os
import time

LOOPBACK = "127.0.0.1"

# Node-loss detection in seconds instead of a minute: the GCS pings each raylet every
# 0.5 s and declares it dead after 3 missed pings (these are Ray's own config keys).
FAST_FAILURE_SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 500,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


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
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


loopback_env()


class LocalCluster:
    """``n`` simulated nodes (the head is node 0) on 127.0.0.1.

    Use as a context manager; ``close()`` always tears every process down.
    """

    def __init__(self, nodes: int = 4, *, cpus_per_node: float = 1,
                 object_store_mb: int = 128, connect: bool = True,
                 system_config: dict | None = None, labels: dict[int, dict] | None = None):
        loopback_env()
        import ray
        from ray.cluster_utils import Cluster

        if nodes < 1:
            raise ValueError(f"nodes={nodes}: a cluster needs at least 1 node")
        self._labels = labels or {}
        self._cpus = cpus_per_node
        self._store = object_store_mb * 1024 * 1024
        self._next = 0
        self.nodes = []  # ray._private.node.Node, in order of addition
        cfg = dict(FAST_FAILURE_SYSTEM_CONFIG)
        cfg.update(system_config or {})
        self.cluster = Cluster(initialize_head=False)
        try:
            self.add_node(_system_config=cfg, include_dashboard=False)
            for _ in range(nodes - 1):
                self.add_node()
            self.cluster.wait_for_nodes()
            if connect:
                ray.init(address=self.cluster.address, namespace="memsnap",
                         log_to_driver=False, logging_level="WARNING")
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, **kwargs):
        i = self._next
        self._next += 1
        args = dict(num_cpus=self._cpus, object_store_memory=self._store,
                    node_ip_address=LOOPBACK, resources={f"memsnap_node_{i}": 1})
        if i in self._labels:
            args["labels"] = self._labels[i]
        args.update(kwargs)
        with _sigterm_hook_off_main_thread():
            node = self.cluster.add_node(**args)
        self.nodes.append(node)
        return node

    def kill_node(self, node) -> None:
        """Kill a node abruptly (raylet, workers and actors gone, nothing graceful)."""
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
        with contextlib.suppress(Exception):
            self.cluster.shutdown()

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
