"""``Snapshotter``: the user API of one rank — save, restore, status, close.

Call protocol (every rank of the job, each in its own Ray worker or driver):

  1. ``snap = Snapshotter(job=..., rank=r, world_size=n, ...)`` — finds or creates the job's
     coordinator and this node's agent, registers the rank.
  2. ``snap.restore(state)`` at start (collective: every rank calls it) -> the restored step
     or None.
  3. ``snap.save(step, state)`` after each step to snapshot; returns once the bytes are in
     the agent's RAM (encoding, sending and the commit run in the background).
  4. ``snap.status()`` any time; ``snap.close()`` at the end (agents stay up; see ``shutdown``).
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Mapping

import ray

from memsnap import agent as agents
from memsnap import coordinator as coordinators
from memsnap import naming
from memsnap.arena import Arena
from memsnap.config import SnapshotConfig, tunable
from memsnap.errors import ChecksumError, ConfigError, MemsnapError
from memsnap.manifest import Manifest

log = logging.getLogger("memsnap")


def job_secret(job: str) -> bytes:
    """The job's data-plane secret: made once by the first rank, kept in Ray's GCS key-value store."""
    import secrets

    from ray.experimental import internal_kv

    key = naming.secret_key(job)
    internal_kv._internal_kv_put(key, secrets.token_bytes(32), overwrite=False, namespace=naming.NAMESPACE)
    return internal_kv._internal_kv_get(key, namespace=naming.NAMESPACE)


def _unwrap(exc: BaseException) -> BaseException:
    """The memsnap error behind a Ray task error, so callers see the typed error."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, MemsnapError) else exc


def _get(ref, timeout: float | None = None):
    try:
        return ray.get(ref, timeout=timeout or tunable("call_timeout_s"))
    except ray.exceptions.RayTaskError as exc:
        raise _unwrap(exc) from None


class Snapshotter:
    """Snapshots of one rank's ``state`` into the job's erasure-coded RAM tier (and spill)."""

    def __init__(self, job: str, rank: int, world_size: int, *, k: int = 2, m: int = 1,
                 group_size: int | None = None, keep: int = 2, memory_budget: int = 4 << 30,
                 spill: str | None = None, spill_every: int | None = None,
                 spill_every_seconds: float | None = None, spill_bytes_per_s: int = 256 << 20,
                 transport: str = "tcp", chunk: int | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r}: must be an int >= 1")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank!r}: must be an int in [0, world_size={world_size})")
        self.config = SnapshotConfig(job, k, m, group_size, keep, memory_budget, spill, spill_every,
                                     spill_every_seconds, spill_bytes_per_s, transport, chunk)
        if not ray.is_initialized():
            raise ConfigError("Snapshotter needs Ray: create it inside a Ray task/actor or after ray.init()")
        self.rank, self.world = rank, world_size
        self.node = ray.get_runtime_context().get_node_id()
        self._agent = agents.get_or_create(self.config, self.node, job_secret(job))
        self._address = _get(self._agent.register.remote(rank, world_size))
        self._coord = coordinators.get_or_create(self.config, world_size)
        self._ccall("register", rank, self.node, self._address)
        self._local: list[int] | None = None
        self._maps: dict[str, Arena] = {}
        self.counters = {"saves": 0, "failed_saves": 0}
        self.last_restore: dict = {"tier": "none", "step": None, "seconds": {}}

    # --- calls to the coordinator, surviving its loss ------------------------------------------
    def _ccall(self, method: str, *args, timeout: float | None = None):
        for attempt in range(6):  # a restarting coordinator is waited for ~30 s in all
            try:
                return _get(getattr(self._coord, method).remote(*args), timeout)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                log.warning("coordinator lost (%s); finding it again", type(exc).__name__)
                time.sleep(min(0.5 * 2 ** attempt, 10.0))
                self._coord = coordinators.get_or_create(self.config, self.world)
                if method != "register":
                    _get(self._coord.register.remote(self.rank, self.node, self._address))
        return _get(getattr(self._coord, method).remote(*args), timeout)

    def _local_ranks(self) -> list[int]:
        if self._local is None:
            timeout = tunable("membership_timeout_s")
            members = self._ccall("members", timeout, timeout=timeout + 10)
            self._local = sorted(r for r, n in members.items() if n == self.node)
        return self._local

    def _map(self, path: str, nbytes: int) -> memoryview:
        arena = self._maps.get(path)
        if arena is None or arena.nbytes < nbytes:
            arena = self._maps[path] = Arena.attach(path, nbytes)
        return arena.view(0, nbytes)

    # --- save --------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot ``state`` as ``step`` (after finishing that step); returns once captured."""
        from memsnap.capture import capture, plan

        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r}: must be an int >= 0")
        local = self._local_ranks()
        try:
            layout = plan(state)
            info = _get(self._agent.begin.remote(step, self.rank, layout.nbytes))
            man, _ = capture(state, out=self._map(info["path"], layout.nbytes), manifest=layout)
            man.meta.update(step=step, rank=self.rank, world_size=self.world, job=self.config.job)
            _get(self._agent.captured.remote(step, self.rank, man.to_json().decode(), local))
        except BaseException:
            self.counters["failed_saves"] += 1
            raise
        self.counters["saves"] += 1

    def wait(self, step: int, timeout: float = 60.0) -> int | None:
        """Block until ``step`` (or a later one) is committed or failed; return the newest committed."""
        return self._ccall("wait_committed", step, timeout, timeout=timeout + 10)

    # --- restore -----------------------------------------------------------------------------
    def restore(self, state: Mapping[str, Any]) -> int | None:
        """(collective) Load the newest step every rank can load, through the fastest tier."""
        t0 = time.perf_counter()
        timeout = tunable("restore_timeout_s") + 10
        error: Exception | None = None
        for attempt in range(3):
            t = time.perf_counter()
            plan = self._ccall("restore_plan", self.rank, attempt, timeout=timeout)
            seconds = {"plan": time.perf_counter() - t}
            try:
                tier = self._load(plan, state, seconds)
                ok, report = True, {"tier": tier, "seconds": seconds}
            except Exception as exc:
                log.warning("rank %d: restore of step %s failed: %s", self.rank, plan["step"], exc)
                ok, report, tier = False, {"error": f"{type(exc).__name__}: {exc}"}, None
                error = exc
            result = self._ccall("restore_done", self.rank, attempt, ok, report, timeout=timeout)
            if result["ok"]:
                seconds["total"] = time.perf_counter() - t0
                return self._restored(plan, tier, seconds)
        raise error if error is not None else MemsnapError(f"restore failed on ranks {sorted(result['failed'])}: "
                                                f"{result['failed']}")

    def _restored(self, plan: dict, tier: str, seconds: dict) -> int | None:
        self.last_restore = {"tier": tier, "step": plan["step"], "seconds": seconds}
        if plan["plan"] == "durable":
            msg = (f"memsnap: restored step {plan['step']} from durable storage {plan['spill']}: "
                   "the RAM tiers could not serve every rank")
            self.last_restore["warning"] = msg
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.info("rank %d restored step %s from %s in %s", self.rank, plan["step"], tier,
                 {k: round(v, 3) for k, v in seconds.items()})
        return plan["step"]

    def _load(self, plan: dict, state, seconds: dict) -> str:
        tier, step = plan["tier"], plan["step"]
        if tier == "none":
            return "none"
        if tier == "durable":
            return self._load_durable(plan, state, seconds)
        if tier == "local":
            info = _get(self._agent.local.remote(step, self.rank))
            if info is not None:
                try:
                    self._apply(info, state, seconds)
                    return "local"
                except ChecksumError as exc:
                    log.warning("rank %d: local copy of step %d is corrupt (%s); reading peers", self.rank, step, exc)
        t = time.perf_counter()
        info = _get(self._agent.recover.remote(step, self.rank, plan["record"]), tunable("restore_timeout_s"))
        seconds["fetch"] = time.perf_counter() - t
        self._apply(info, state, seconds)
        return "peer"

    def _apply(self, info: dict, state, seconds: dict) -> None:
        from memsnap.apply import apply

        t = time.perf_counter()
        apply(state, Manifest.from_json(info["manifest"]), self._map(info["path"], info["nbytes"]), verify=True)
        seconds["apply"] = time.perf_counter() - t

    def _load_durable(self, plan: dict, state, seconds: dict) -> str:
        from memsnap.apply import apply
        from memsnap.storage import Store

        from tqdm import tqdm

        t = time.perf_counter()
        store = Store.open(plan["spill"])
        man = store.manifest(plan["step"], self.rank)
        buf = bytearray(man.nbytes)
        with tqdm(total=man.nbytes, unit="B", unit_scale=True, disable=None,
                  desc=f"rank {self.rank}: step {plan['step']} from {plan['spill']}") as bar:
            store.read_rank_into(plan["step"], self.rank, buf, progress=lambda done, total: bar.update(done - bar.n))
        seconds["fetch"] = time.perf_counter() - t
        t = time.perf_counter()
        apply(state, man, buf, verify=True)
        seconds["apply"] = time.perf_counter() - t
        return "durable"

    # --- status / close ------------------------------------------------------------------------
    def status(self) -> dict:
        """JSON-serialisable state of the job's snapshots, as this rank sees it."""
        st = self._ccall("status")
        agents_ = st.pop("agents")
        st["bytes"] = {
            "local": sum(a["arena"] for a in agents_.values()),
            "peer": sum(a["held"] + a["parity"] for a in agents_.values()),
            "durable_step": st["durable_step"],
        }
        st["agents"] = agents_
        st["failed_snapshots"] += sum(a["counters"]["failed_snapshots"] for a in agents_.values())
        st["failed_saves"] = self.counters["failed_saves"]
        st["last_restore"] = dict(self.last_restore)
        return st

    def close(self) -> None:
        """Drop this rank's mappings (the agents keep the snapshots)."""
        for arena in self._maps.values():
            arena.close(unlink=False)
        self._maps.clear()


def shutdown(job: str, timeout: float = 30.0) -> None:
    """Stop the job's coordinator and every agent (their shared memory is unlinked)."""
    for node in [n["NodeID"] for n in ray.nodes() if n.get("Alive")]:
        handle = agents.find(job, node)
        if handle is not None:
            try:
                ray.get(handle.shutdown.remote(), timeout=timeout)
            except Exception:  # exit_actor ends the call with an actor error
                pass
    try:
        ray.kill(ray.get_actor(naming.coordinator(job), namespace=naming.NAMESPACE), no_restart=True)
    except ValueError:
        pass
