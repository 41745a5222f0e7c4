"""How faults are carried out: on any Ray cluster by a task pinned to the target node, and on
``memsnap.localcluster`` by removing the node's processes from the simulated cluster.

Every method takes a resolved ``nodes.Node`` and returns the event's detail (a small JSON-ready
dict) or raises; the ``Injector`` records either. The driver must already be connected to Ray.
"""

from __future__ import annotations

import functools
import signal
import time
from typing import Any

import ray

from memsnap import naming
from memsnap.chaos.nodes import Node, ray_nodes
from memsnap.errors import ConfigError

MEMSNAP_ACTORS = ("SnapshotAgent", "Coordinator")  # the job's own actors: never "training processes"
CALL_TIMEOUT_S = 60.0


@functools.cache
def _hand_task():
    @ray.remote(num_cpus=0, max_retries=0)
    def chaos_hand(op: str, *args):
        from memsnap.chaos import hand as on_node

        return getattr(on_node, op)(*args)

    return chaos_hand


def on_node(node: Node, op: str, *args, timeout: float | None = CALL_TIMEOUT_S):
    """Run ``hand.<op>(*args)`` on ``node`` (a task pinned there, never retried) and wait for it
    (``timeout`` None: for as long as it takes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = _hand_task().options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.id, soft=False))
    return ray.get(task.remote(op, *args), timeout=timeout)


def training_actors(node_id: str, process: str | None = None) -> list[dict]:
    """The live actors on ``node_id`` that are not memsnap's own, sorted by pid; with
    ``process``, only those with that actor name or class name."""
    found = []
    for info in ray._private.state.actors().values():
        if info.get("State") != "ALIVE" or (info.get("Address") or {}).get("NodeID") != node_id:
            continue
        cls, name = info.get("ActorClassName") or "", info.get("Name") or ""
        if cls in MEMSNAP_ACTORS or name.startswith("memsnap-"):
            continue
        if process is not None and process not in (cls, name):
            continue
        found.append({"pid": int(info["Pid"]), "class": cls, "name": name})
    return sorted(found, key=lambda a: a["pid"])


class RayBackend:
    """Faults on the Ray cluster this driver is connected to (a real one, or a loopback one)."""

    local = False

    def __init__(self, job: str | None = None):
        self.job = job

    def nodes(self) -> list[Node]:
        return ray_nodes()

    # --- the kinds ----------------------------------------------------------------------------
    def kill_node(self, node: Node) -> dict:
        """A task on the node SIGKILLs its raylet and every process under it, itself last."""
        started = time.monotonic()
        try:
            got = on_node(node, "kill_raylet")
        except (ray.exceptions.GetTimeoutError, ray.exceptions.TaskUnschedulableError):
            raise
        except ray.exceptions.RayTaskError as exc:  # the hand raised: nothing was killed
            raise RuntimeError(f"the kill task failed on node {node.id[:12]}: {exc.cause or exc}") from None
        except ray.exceptions.RayError:  # its worker died with the node, as it must
            return {
                "how": "raylet and its processes SIGKILLed by a task on the node",
                "dispatch_s": round(time.monotonic() - started, 3),
            }
        raise RuntimeError(f"the node's kill task returned {got!r} instead of dying with its node")

    def kill_process(self, node: Node, process, rng) -> dict:
        if isinstance(process, int):
            victim = {"pid": process}
        else:
            actors = training_actors(node.id, process)
            if not actors:
                raise ConfigError(
                    f"no training process{'' if process is None else f' {process!r}'} on node "
                    f"{node.id[:12]}: pass process= a pid, or an actor's name or class name"
                )
            victim = rng.choice(actors)
        got = on_node(node, "signal_pids", [victim["pid"]], int(signal.SIGKILL))
        if not got["pids"]:
            raise RuntimeError(f"process {victim['pid']} on node {node.id[:12]} was already gone")
        return dict(victim, signal="SIGKILL")

    def stall(self, node: Node, seconds: float) -> dict:
        from memsnap import testing

        return dict(testing.stall_data_plane(self._agent(node, "stall"), seconds), seconds=seconds)

    def end_stall(self, node: Node, early: bool) -> dict:
        """The stall's end: ended now (``early``, at ``stop()``), else read (the agent ended it)."""
        from memsnap import testing

        agent = self._agent(node, "stall")
        return testing.end_data_plane_stall(agent) if early else testing.data_plane_stall(agent)

    def fill_disk(self, node: Node, path: str | None, limit_bytes: int | None) -> dict:
        directory = path or self._spill_dir(node)
        return on_node(node, "fill", directory, limit_bytes, timeout=None if limit_bytes is None else CALL_TIMEOUT_S)

    def unfill(self, node: Node, path: str) -> dict:
        return on_node(node, "unfill", path)

    def preempt(self, node: Node, how: str, deadline_s: float | None, process) -> dict:
        out: dict[str, Any] = {"how": how}
        if how in ("sigterm", "both"):
            pids = [process] if isinstance(process, int) else [a["pid"] for a in training_actors(node.id, process)]
            if not pids and how == "sigterm":
                raise ConfigError(
                    f"no training process on node {node.id[:12]} to send SIGTERM to: pass process= "
                    "a pid, or an actor's name or class name"
                )
            out["sigterm"] = on_node(node, "signal_pids", pids, int(signal.SIGTERM)) if pids else {"pids": []}
        if how in ("drain", "both"):
            out["drain"] = drain(node.id, deadline_s)
        return out

    def step(self) -> int | None:
        """The job's newest committed step (for faults ``at_step``), or None before the first."""
        if self.job is None:
            raise ConfigError(
                "faults at_step need the job's step: pass job= (--job) so the injector reads its "
                "newest committed step, or call injector.observe_step(step) from the training loop"
            )
        try:
            coord = ray.get_actor(naming.coordinator(self.job), namespace=naming.NAMESPACE)
        except ValueError:
            return None  # not started yet
        return ray.get(coord.wait_committed.remote(-1, 0.0), timeout=CALL_TIMEOUT_S)

    # --- helpers -------------------------------------------------------------------------------
    def _agent(self, node: Node, kind: str):
        if self.job is None:
            raise ConfigError(f"{kind} acts on a memsnap job's agent: pass job= (--job) to the injector")
        try:
            return ray.get_actor(naming.agent(self.job, node.id), namespace=naming.NAMESPACE)
        except ValueError:
            raise ConfigError(
                f"job {self.job!r} has no agent on node {node.id[:12]} (`memsnap jobs` lists the jobs and their nodes)"
            ) from None

    def _spill_dir(self, node: Node) -> str:
        cfg = ray.get(self._agent(node, "fill_disk").config.remote(), timeout=CALL_TIMEOUT_S)
        uri = cfg.get("spill")
        if not uri:
            raise ConfigError(f"job {self.job!r} does not spill; pass path= (--fault ... path=DIR) for fill_disk")
        if uri.startswith("file://"):
            uri = uri[len("file://") :]
        if "://" in uri:
            raise ConfigError(
                f"job {self.job!r} spills to {uri!r}, not a local disk; pass path= a directory "
                "on the node's disk for fill_disk"
            )
        return uri


class LocalBackend(RayBackend):
    """Faults on a ``memsnap.localcluster.LocalCluster``: a node kill removes the simulated node
    (its raylet and every process on it, SIGKILL), and ``replace_killed`` adds a fresh node in its
    place, as a cluster's autoscaler would."""

    local = True

    def __init__(self, cluster, job: str | None = None, replace_killed: bool = False):
        super().__init__(job)
        self.cluster = cluster
        self.replace_killed = replace_killed

    def kill_node(self, node: Node) -> dict:
        found = [n for n in self.cluster.nodes if n.node_id == node.id]
        if not found:
            raise ConfigError(f"node {node.id[:12]} is not one of this LocalCluster's live nodes")
        self.cluster.kill_node(found[0])
        out = {"how": "removed from the simulated cluster (SIGKILL)"}
        if self.replace_killed:
            out["replacement"] = self.cluster.add_node().node_id
        return out


def drain(node_id: str, deadline_s: float | None) -> dict:
    """Ask the GCS to drain ``node_id`` for preemption (the notice ``memsnap.preempt`` polls for),
    with a deadline ``deadline_s`` from now (None: none). Ray does not kill the node at the deadline."""
    from ray.core.generated import autoscaler_pb2

    deadline_ms = 0 if deadline_s is None else int((time.time() + deadline_s) * 1000)
    # ray._raylet is a compiled module and autoscaler_pb2 generated code: neither declares these names
    client = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)  # type: ignore[attr-defined]
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
    accepted, why = client.drain_node(node_id, reason, "memsnap.chaos preemption notice", deadline_ms)
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id[:12]}: {why}")
    return {"accepted": True, "deadline_ms": deadline_ms}
