"""The commit coordinator: membership, placement, the two-phase commit, and restore rounds.

One detached actor per job. Call protocol (who calls in brackets):

  1. [every rank, at start]  ``register(rank, node, agent_address)``; placement is made once
     all ``world_size`` ranks are known, and a rank that comes back on a new node takes the
     lost node's slot (``placement.replace_node``), which starts re-protection.
  2. [every rank]  ``members(timeout)`` -> ``{rank: node}`` once placement exists.
  3. [agent]  ``node_layout(node)`` -> the node's ``k+m`` holders and their addresses.
  4. [agent]  ``node_ready(t, node, info)`` (phase one: every chunk acknowledged) or
     ``node_failed(t, node, why)``.
  5. [coordinator]  when every node is ready: record ``t`` (which node's stream holds each
     rank, at which stripe, its manifest, the holders), keep the newest ``keep`` records,
     and ``agent.commit(t, record, keep)`` on every agent (phase two); agents free the rest.
  6. [every rank, restore]  ``restore_plan(rank, attempt)`` (a barrier: one plan for all),
     load, ``restore_done(rank, attempt, ok, report)`` (a barrier: if any rank failed, every
     rank tries the next plan).

All state is rebuilt from the agents (their ranks, addresses and committed records) when
the actor is restarted.
"""
from __future__ import annotations

import logging
import threading
import time

import ray

from memsnap import agent as agents
from memsnap import naming, restore
from memsnap.config import SnapshotConfig, tunable
from memsnap.errors import CommitError
from memsnap.placement import NodeInfo, Placement, place, place_local, replace_node

log = logging.getLogger("memsnap.coordinator")


class CoordinatorCore:
    """The coordinator's state and logic, as a plain object."""

    def __init__(self, config: dict, world_size: int):
        self.cfg = SnapshotConfig.from_dict(config)
        self.world = world_size
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.members: dict[int, str] = {}
        self.addrs: dict[str, dict] = {}
        self.placement: Placement | None = None
        self.epoch = 0
        self.records: dict[int, dict] = {}
        self.pending: dict[int, dict[str, dict]] = {}
        self.failed: dict[int, str] = {}
        self.spill_ranks: dict[int, set[int]] = {}
        self.durable_step: int | None = None
        self.spill_asked: tuple[int, float] | None = None  # (step, monotonic time) of the last spill asked
        self.rounds: dict[int, dict] = {}
        self.bad: set[int] = set()
        self.last_restore: dict = {"tier": "none", "step": None, "seconds": {}}
        self.reprotect: dict = {"running": 0, "again": False, "rebuilt_chunks": 0, "local_copies": 0,
                                "errors": []}
        self.restores = 0  # restore rounds completed; re-protection lets the next one go first
        self.gen = 0  # bumped by every completed restore; older snapshots in flight are ignored
        self.place_error: str | None = None

    # --- membership ------------------------------------------------------------------------
    def register(self, rank: int, node: str, address: dict) -> dict:
        """Add ``rank`` on ``node``. Answers ``{"restore_bytes": n}`` when the newest committed
        step holds ``n`` bytes of this rank that ``node`` has no copy of (a replacement node):
        its agent can prepare the memory a peer restore will fill."""
        self._register(rank, node, address)
        with self.lock:
            record = self.records[max(self.records)] if self.records else None
            entry = None if record is None else record["ranks"].get(str(rank))
            moved = entry is not None and (entry["owner"] != node or not self.cfg.local_copy)
            return {"restore_bytes": entry["nbytes"] if moved else None}

    def _register(self, rank: int, node: str, address: dict) -> None:
        if not 0 <= rank < self.world:
            raise CommitError(f"rank={rank}: must be in [0, world_size={self.world})")
        if self.cfg.peers and self.placement is not None and node not in self.placement.holders:
            self._await_a_dead_node()
        with self.cond:
            old = self.members.get(rank)
            self.members[rank] = node
            self.addrs[node] = address
            if self.placement is None or not self.cfg.peers:
                self._maybe_place()
            elif node not in self.placement.holders:
                self._replace(old, node)
            self.cond.notify_all()
        if self.placement is not None and self.records:
            self._kick_reprotect()

    def _maybe_place(self) -> None:
        """Place once every rank is known. Until every rank of a restarted worker group has
        registered, ``members`` can still name nodes of the old group (ranks move between
        nodes when Ray Train restarts), so too few distinct nodes is not an error yet."""
        if len(self.members) < self.world:
            return
        nodes = [NodeInfo(n) for n in sorted(set(self.members.values()))]
        if not self.cfg.peers:
            self.placement = place_local(nodes, self.cfg.k, self.cfg.m)
            self.epoch += 1
            return
        try:
            self.placement = place(nodes, self.cfg.k, self.cfg.m, self.cfg.group_size)
        except ValueError as exc:
            self.place_error = str(exc)
            log.info("not placing yet: %s", exc)
            return
        self.place_error = None
        self.epoch += 1

    def _await_a_dead_node(self) -> None:
        """A new node is joining: wait (bounded) until Ray has marked a placed node dead. Ray
        Train can restart its workers before the GCS has declared the lost node dead."""
        timeout = tunable("membership_timeout_s")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if set(self.placement.holders) - alive:
                return
            time.sleep(0.5)
        log.warning("a new node joined but no placed node was declared dead within %.0f s", timeout)

    def _replace(self, old: str | None, node: str) -> None:
        """``node`` is new: it takes the slot of a placed node that is dead (``old``, the node
        this rank ran on before, when that one is dead)."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        dead = sorted(set(self.placement.holders) - alive)
        lost = old if old in dead else (dead[0] if dead else None)
        if lost is None:
            raise CommitError(f"node {node[:12]} joined but no placed node was lost; "
                              "start the job with every node, or restart it to re-place")
        self.placement = replace_node(self.placement, lost, NodeInfo(node))
        self.epoch += 1
        log.warning("node %s replaces lost node %s", node[:12], lost[:12])

    def members_of(self, timeout: float) -> dict[int, str]:
        with self.cond:
            if not self.cond.wait_for(lambda: self.placement is not None, timeout):
                missing = sorted(set(range(self.world)) - set(self.members))
                why = f"ranks {missing} to register" if missing else f"a placement ({self.place_error})"
                raise CommitError(f"timed out after {timeout:.0f} s waiting for {why}")
            return dict(self.members)

    def node_layout(self, node: str) -> dict:
        with self.lock:
            if self.placement is None or node not in self.placement.holders:
                raise CommitError(f"node {node[:12]} is not placed yet; every rank must register first")
            holders = list(self.placement.holders[node])
            return {"holders": holders, "addrs": [self.addrs[h] for h in holders], "epoch": self.epoch}

    # --- the two-phase commit ------------------------------------------------------------------
    def node_ready(self, step: int, node: str, info: dict) -> None:
        with self.cond:
            gen = info.get("gen", 0)
            if gen < self.gen:
                log.info("ignoring step %d from node %s: taken before the last restore (generation %d < %d)",
                         step, node[:12], gen, self.gen)
                return
            self.gen = gen  # a rebuilt coordinator learns the generation from the agents
            if step in self.failed or step in self.records or self._stale(step):
                return
            self.pending.setdefault(step, {})[node] = info
            if set(self.members.values()) <= set(self.pending[step]):
                self._commit(step)

    def _stale(self, step: int) -> bool:
        return bool(self.records) and step < max(self.records)

    def node_failed(self, step: int, node: str, why: str) -> None:
        with self.cond:
            if step in self.records:
                return
            self.failed[step] = f"node {node[:12]}: {why}"
            self.pending.pop(step, None)
        log.warning("step %d failed on node %s: %s", step, node[:12], why)
        self._broadcast("abandon", step)

    def _commit(self, step: int) -> None:
        ready = self.pending.pop(step)
        record = {"step": step, "k": self.cfg.k, "m": self.cfg.m, "ranks": {}, "holders": {},
                  "addrs": dict(self.addrs), "time": time.time()}
        for node, info in ready.items():
            record["holders"][node] = list(info["holders"])
            for rank, entry in info["ranks"].items():
                record["ranks"][str(rank)] = dict(entry, chunk=info["chunk"])
        missing = sorted(set(range(self.world)) - {int(r) for r in record["ranks"]})
        if missing:
            self.failed[step] = f"ranks {missing} were not captured"
            return
        self.records[step] = record
        for s in [s for s in self.pending if s < step]:
            self.failed[s] = f"step {step} committed first"
            del self.pending[s]
        record["spill"] = self._spill_due(step)
        keep = sorted(self.records)[-self.cfg.keep:]
        for s in [s for s in self.records if s not in keep]:
            del self.records[s]
        self.cond.notify_all()
        self._broadcast("commit", step, record, keep)

    def _broadcast(self, method: str, *args) -> None:
        """Call ``method`` on every live agent from a background thread (bounded waits)."""
        def run() -> None:
            for node in self._live_nodes():
                handle = agents.find(self.cfg.job, node)
                try:
                    ray.get(getattr(handle, method).remote(*args), timeout=tunable("commit_notify_timeout_s"))
                except Exception as exc:  # a dead agent does not block the others
                    log.warning("%s to the agent on %s failed: %s", method, node[:12], exc)

        threading.Thread(target=run, daemon=True).start()

    def _live_nodes(self) -> list[str]:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        with self.lock:
            return [n for n in sorted(set(self.addrs)) if n in alive]

    def wait_committed(self, step: int, timeout: float) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: (max(self.records, default=-1) >= step) or step in self.failed, timeout)
            return max(self.records, default=None)

    # --- restore rounds --------------------------------------------------------------------------
    def restore_plan(self, rank: int, attempt: int) -> dict:
        timeout = tunable("restore_timeout_s")
        with self.cond:
            rnd = self._round(attempt)
            rnd["arrived"].add(rank)
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(rnd["arrived"]) >= self.world, timeout):
                missing = sorted(set(range(self.world)) - rnd["arrived"])
                raise CommitError(f"restore: timed out after {timeout:.0f} s waiting for ranks {missing}")
            if rnd["plan"] is None:
                rnd["plan"] = restore.decide(self.records, dict(self.members), self._inventories(),
                                             self._durable_step(), self.bad, self.cfg.local_copy)
                log.info("restore plan (attempt %d): %s", attempt, rnd["plan"])
            plan = rnd["plan"]
        return self._plan_for(plan, rank)

    def _round(self, attempt: int) -> dict:
        rnd = self.rounds.get(attempt)
        if rnd is None or (attempt == 0 and rnd["closed"]):
            if attempt == 0:
                self.rounds, self.bad = {}, set()
            rnd = self.rounds[attempt] = {"arrived": set(), "plan": None, "done": {}, "closed": False}
        return rnd

    def _plan_for(self, plan: dict, rank: int) -> dict:
        out = {"step": plan["step"], "tier": plan["ranks"][rank], "plan": plan["tier"],
               "spill": self.cfg.spill}
        if plan["tier"] == "ram":
            record = dict(self.records[plan["step"]])
            record["addrs"] = dict(record["addrs"], **self.addrs)
            out["record"] = record
        return out

    def restore_done(self, rank: int, attempt: int, ok: bool, report: dict) -> dict:
        timeout = tunable("restore_timeout_s")
        with self.cond:
            rnd = self.rounds[attempt]
            rnd["done"][rank] = (ok, report)
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(rnd["done"]) >= self.world, timeout):
                raise CommitError(f"restore: timed out waiting for ranks "
                                  f"{sorted(set(range(self.world)) - set(rnd['done']))} to finish")
            failed = {r: rep for r, (good, rep) in rnd["done"].items() if not good}
            if failed and rnd["plan"]["step"] is not None:
                self.bad.add(rnd["plan"]["step"])
            rnd["closed"] = True
            if not failed:
                self._note_restore(rnd)
                self._resume(rnd)
                if not rnd.get("counted"):
                    rnd["counted"] = True
                    self.restores += 1
                    self.cond.notify_all()
            return {"ok": not failed, "failed": {str(r): rep for r, rep in failed.items()},
                    "gen": rnd.get("gen", self.gen)}

    def _resume(self, rnd: dict) -> None:
        """Once per completed round: the job goes on from the restored step, so every step
        after it (uncommitted, failed, or committed but unloadable) may be taken again."""
        if "gen" in rnd:
            return
        self.gen += 1
        rnd["gen"] = self.gen
        log.info("restore generation %d: the job resumes from step %s", self.gen, rnd["plan"]["step"])
        last = -1 if rnd["plan"]["step"] is None else rnd["plan"]["step"]
        for table in (self.pending, self.failed, self.records):
            for s in [s for s in table if s > last]:
                del table[s]

    def _note_restore(self, rnd: dict) -> None:
        reports = [rep for _, rep in rnd["done"].values()]
        tiers = {rep.get("tier") for rep in reports}
        slowest = max(reports, key=lambda rep: sum(rep.get("seconds", {}).values()), default={})
        self.last_restore = {"tier": sorted(tiers)[0] if len(tiers) == 1 else ",".join(sorted(tiers)),
                             "step": rnd["plan"]["step"], "seconds": slowest.get("seconds", {})}

    def _inventories(self) -> dict[str, dict]:
        out = {}
        for node in self._live_nodes():
            handle = agents.find(self.cfg.job, node)
            if handle is None:
                continue
            try:
                out[node] = ray.get(handle.inventory.remote(), timeout=tunable("call_timeout_s"))
            except Exception as exc:
                log.warning("agent on %s did not answer: %s", node[:12], exc)
        return out

    def _durable_step(self) -> int | None:
        if self.cfg.spill is None:
            return None
        from memsnap.storage import Store

        try:
            return Store.open(self.cfg.spill).latest()
        except Exception as exc:  # nothing spilled yet, or storage unreachable
            log.info("no durable step at %s: %s", self.cfg.spill, exc)
            return None

    def _spill_due(self, step: int) -> bool:
        """Whether the agents spill the step committed now: the first commit in each new block
        of ``spill_every`` steps (so a failed step ``10`` moves the spill to ``11``, not ``20``),
        or ``spill_every_seconds`` after the last one asked. Decided here, once, so that every
        agent writes the same step."""
        every, secs = self.cfg.spill_every, self.cfg.spill_every_seconds
        if self.cfg.spill is None or not (every or secs):
            return False
        last = self.spill_asked
        due = last is None or last[0] > step
        due = due or bool(every) and step // every > last[0] // every
        due = due or bool(secs) and time.monotonic() - last[1] >= secs
        if due:
            self.spill_asked = (step, time.monotonic())
        return due

    # --- spill (phase two of the durable write) -----------------------------------------------------
    def spilled(self, step: int, ranks: list[int]) -> bool:
        """Agents report ranks written to durable storage; the last one makes the step visible."""
        with self.lock:
            done = self.spill_ranks.setdefault(step, set())
            done.update(ranks)
            if len(done) < self.world or step == self.durable_step:
                return False
        from memsnap.storage import Store

        Store.open(self.cfg.spill).commit(step, self.world, spill_metadata(self.cfg, step))
        with self.lock:
            self.durable_step = max(step, self.durable_step or -1)
            for s in [s for s in self.spill_ranks if s <= step]:
                del self.spill_ranks[s]
        return True

    # --- re-protection ---------------------------------------------------------------------------
    def _kick_reprotect(self) -> None:
        """Start the re-protection thread unless it runs; it rebuilds every shard whose holder left."""
        with self.lock:
            if self.reprotect["running"]:
                self.reprotect["again"] = True
                return
            self.reprotect["running"] = 1
        threading.Thread(target=self._reprotect_loop, daemon=True).start()

    def _reprotect_loop(self) -> None:
        try:
            self._let_the_restore_go_first()
            while True:
                self.reprotect["again"] = False
                for step in sorted(self.records):
                    self._reprotect_step(step)
                self._rebuild_local_copies()
                if not self.reprotect.get("again"):
                    return
        finally:
            with self.lock:
                self.reprotect["running"] = 0

    def _let_the_restore_go_first(self) -> None:
        """A rank joined on a new node, so a restore is about to run; rebuilding the lost
        node's shards moves as many bytes over the same nodes. Wait until a restore round
        completes (or ``reprotect_defer_s`` passes) so the restore has the network to itself."""
        with self.cond:
            seen = self.restores
            self.cond.wait_for(lambda: self.restores > seen, tunable("reprotect_defer_s"))

    def _reprotect_step(self, step: int) -> None:
        with self.lock:
            record = self.records.get(step)
            if record is None:
                return
            live = set(self.members.values())
            moves = [(owner, j, new) for owner, holders in record["holders"].items()
                     for j, new in self._new_holders(record, owner, holders, live)]
            record = dict(record, addrs=dict(record["addrs"], **self.addrs))
        for owner, j, new in moves:
            self._rebuild_on(record, owner, j, new)
        if moves:
            with self.lock:
                live_record = self.records.get(step)
                keep = sorted(self.records)[-self.cfg.keep:]
            if live_record is not None:  # the new holders, told again: not a new commit, no spill
                self._broadcast("commit", step, dict(live_record, spill=False), keep)

    def _rebuild_local_copies(self) -> None:
        """A rank restored from peers holds its bytes only in its live state (receive.py), so
        its node has no local copy of the newest step: that node's agent reads them from the
        holders once more. The local copy (one more loss survived, a crash restored with no
        network) is back without waiting for the next snapshot."""
        if not self.cfg.local_copy:
            return
        with self.lock:
            step = max(self.records, default=None)
            if step is None:
                return
            record = dict(self.records[step])
            record["addrs"] = dict(record["addrs"], **self.addrs)
            members = dict(self.members)
        inventories = self._inventories()
        for r in sorted(record["ranks"], key=int):
            node = members.get(int(r))
            inv = inventories.get(node)
            if inv is None or restore.has_local(inv, step, int(r)) or any(s > step for s in inv["versions"]):
                continue  # nothing to do, or the rank moved on: its next commit leaves a local copy
            try:
                ok = ray.get(agents.find(self.cfg.job, node).rebuild_local.remote(step, int(r), record),
                             timeout=tunable("push_timeout_s"))
            except Exception as exc:
                self.reprotect["errors"].append(f"local copy of rank {r} at step {step}: {exc}")
                log.warning("could not rebuild rank %s's local copy of step %d: %s", r, step, exc)
                continue
            if ok:
                with self.lock:
                    self.reprotect["local_copies"] += 1

    def _new_holders(self, record: dict, owner: str, holders: list[str], live: set[str]) -> list:
        """``(j, node)`` for every shard ``j`` whose holder is gone: a live node not yet holding one."""
        hosting = {self.members.get(int(r)) for r, e in record["ranks"].items() if e["owner"] == owner}
        taken, out = set(holders), []
        for j, h in enumerate(holders):
            if h in live:
                continue
            cands = sorted(live - taken - hosting) or sorted(live - taken)
            if cands:
                out.append((j, cands[0]))
                taken.add(cands[0])
        return out

    def _rebuild_on(self, record: dict, owner: str, j: int, new: str) -> None:
        handle = agents.find(self.cfg.job, new)
        try:
            n = ray.get(handle.rebuild.remote(record["step"], owner, j, record), timeout=tunable("push_timeout_s"))
        except Exception as exc:
            self.reprotect["errors"].append(f"step {record['step']} owner {owner[:12]} shard {j}: {exc}")
            log.warning("re-protection of step %d owner %s shard %d failed: %s", record["step"], owner[:12], j, exc)
            return
        with self.lock:
            live = self.records.get(record["step"])
            if live is not None:
                live["holders"][owner][j] = new
                live["addrs"][new] = self.addrs[new]
            self.reprotect["rebuilt_chunks"] += n
        log.info("re-protected step %d owner %s shard %d on %s (%d chunks)", record["step"], owner[:12], j, new[:12], n)

    # --- status ----------------------------------------------------------------------------------
    def status(self) -> dict:
        inventories = self._inventories()
        with self.lock:
            newest = max(self.records, default=None)
            return {
                "committed_step": newest,
                "last_commit_time": None if newest is None else self.records[newest].get("time"),
                "committed_steps": sorted(self.records),
                "failed_snapshots": len(self.failed),
                "failed_steps": {str(s): why for s, why in sorted(self.failed.items())[-10:]},
                "protection": self._protection(newest, inventories),
                "members": {str(r): n for r, n in self.members.items()},
                "epoch": self.epoch,
                "generation": self.gen,
                "durable_step": self.durable_step,
                "last_restore": dict(self.last_restore),
                "reprotect": dict(self.reprotect, errors=list(self.reprotect["errors"][-5:])),
                "agents": {n: inv["bytes"] | {"counters": inv["counters"], "spill": inv["spill"]}
                           for n, inv in inventories.items()},
            }

    def _protection(self, step: int | None, inventories: dict) -> dict:
        """Per group: how many more node losses every owner's newest committed bytes survive."""
        if step is None or self.placement is None:
            return {}
        record = self.records[step]
        out: dict[str, int] = {}
        for owner in record["holders"]:
            margin = owner_margin(record, owner, self.members, inventories, self.cfg.local_copy)
            node = owner if owner in self.placement.holders else self._node_of_owner(record, owner)
            group = str(self.placement.group_of(node)) if node in self.placement.holders else "?"
            out[group] = min(out.get(group, margin), margin)
        return out

    def _node_of_owner(self, record: dict, owner: str) -> str:
        ranks = [int(r) for r, e in record["ranks"].items() if e["owner"] == owner]
        return self.members.get(ranks[0], owner) if ranks else owner


def spill_metadata(cfg: SnapshotConfig, step: int) -> dict:
    """What a spilled step records about how it was made: job, config, package versions."""
    from importlib import metadata

    versions = {}
    for pkg in ("memsnap", "torch", "ray", "numpy", "pyarrow"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"job": cfg.job, "step": step, "source": "memsnap spill", "config": cfg.to_dict(),
            "versions": versions, "time": time.time()}


def owner_margin(record: dict, owner: str, members: dict[int, str], inventories: dict,
                 local_copy: bool = True) -> int:
    """How many more node losses ``owner``'s bytes in ``record`` survive (-1: already lost).
    The owner's own copy adds one (it must die too), except in lean mode (``local_copy=False``)."""
    lost = record["k"] + record["m"] - len(restore.holders_with(record, owner, inventories))
    ranks = [int(r) for r, e in record["ranks"].items() if e["owner"] == owner]
    local = local_copy and all(restore.has_local(inventories.get(members.get(r)), record["step"], r) for r in ranks)
    if lost > record["m"]:
        return 0 if local else -1
    return record["m"] - lost + (1 if local else 0)


def rebuild_state(core: CoordinatorCore) -> None:
    """Fill a fresh coordinator from the live agents: ranks, addresses, committed records."""
    found = 0
    for node in [n["NodeID"] for n in ray.nodes() if n.get("Alive")]:
        handle = agents.find(core.cfg.job, node)
        if handle is None:
            continue
        try:
            inv = ray.get(handle.inventory.remote(), timeout=tunable("call_timeout_s"))
            records = ray.get(handle.records.remote(), timeout=tunable("call_timeout_s"))
        except Exception as exc:
            log.warning("agent on %s did not answer the rebuild: %s", node[:12], exc)
            continue
        found += 1
        core.addrs[node] = inv["address"]
        # the restore generation goes on from the agents': restarting it at 0 would let the next
        # restore hand a new node's agent a generation below the survivors', and every step
        # that node sends afterwards would be ignored as taken before the restore
        core.gen = max(core.gen, int(inv.get("gen", 0)))
        for rank in inv["ranks"]:
            core.members.setdefault(rank, node)
        for step, record in records.items():
            core.records.setdefault(int(step), record)
    if found:
        keep = sorted(core.records)[-core.cfg.keep:]
        core.records = {s: core.records[s] for s in keep}
        core._maybe_place()
        log.warning("coordinator rebuilt from %d agents: ranks %s, committed steps %s, restore generation %d",
                    found, sorted(core.members), sorted(core.records), core.gen)


@ray.remote
class Coordinator:
    """The Ray actor around ``CoordinatorCore``; see the module docstring for the protocol."""

    def __init__(self, config: dict, world_size: int):
        logging.basicConfig(level=logging.INFO)
        self.core = CoordinatorCore(config, world_size)
        rebuild_state(self.core)

    def config(self) -> dict:
        return {"config": self.core.cfg.to_dict(), "world_size": self.core.world}

    def register(self, rank: int, node: str, address: dict) -> dict:
        return self.core.register(rank, node, address)

    def members(self, timeout: float) -> dict:
        return self.core.members_of(timeout)

    def node_layout(self, node: str) -> dict:
        return self.core.node_layout(node)

    def node_ready(self, step: int, node: str, info: dict) -> None:
        return self.core.node_ready(step, node, info)

    def node_failed(self, step: int, node: str, why: str) -> None:
        return self.core.node_failed(step, node, why)

    def wait_committed(self, step: int, timeout: float) -> int | None:
        return self.core.wait_committed(step, timeout)

    def restore_plan(self, rank: int, attempt: int) -> dict:
        return self.core.restore_plan(rank, attempt)

    def restore_done(self, rank: int, attempt: int, ok: bool, report: dict) -> dict:
        return self.core.restore_done(rank, attempt, ok, report)

    def spilled(self, step: int, ranks: list[int]) -> bool:
        return self.core.spilled(step, ranks)

    def spill_now(self, step: int) -> None:
        self.core._broadcast("spill_now", step)

    def status(self) -> dict:
        return self.core.status()


def get_or_create(cfg: SnapshotConfig, world_size: int):
    """The job's coordinator: the existing one, or a new one (rebuilt from the agents)."""
    return Coordinator.options(
        name=naming.coordinator(cfg.job), namespace=naming.NAMESPACE, lifetime="detached",
        get_if_exists=True, num_cpus=0, max_restarts=-1,
        max_concurrency=int(tunable("coordinator_max_concurrency")),
    ).remote(cfg.to_dict(), world_size)
