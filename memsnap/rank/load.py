"""The load tiers: one rank's part of a restore plan, read into its live state.

The coordinator's plan (``coverage.decide``) names one tier for the whole job and this rank's
source (``records.RankPlan``); ``Loader.load`` reads it:

  ``local``    the node's own committed copy (``agent.local``): mapped and applied, no network
               (``device`` first, when the agent's device buffer still holds the step); a
               corrupt copy falls through to the peers, and is rebuilt in the background;
  ``copy``     the whole copy on the rank's old node (a rank that moved between live nodes);
  ``peer``     ``k`` shards per stripe from the holders, decoded where a shard is lost: over
               TCP straight into the live tensors (``receive.into_state``), else through an
               arena of the agent (``agent.recover``);
  ``elastic``  the step was taken by another world size: the parts of every saved rank this
               rank needs, from RAM, resharded (``elastic.assemble``);
  ``durable``  the spilled step (``durable.read_step``), resharded if need be;
  ``none``     nothing to load: a fresh start.

A direct read that fails after it began writing leaves the live state partly written:
``dirty`` says so, and the restore loop refuses a fresh start on top of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from memsnap.config import SnapshotConfig, tcp_options
from memsnap.errors import ChecksumError, ConfigError
from memsnap.rank.client import AgentClient, HeldCopy
from memsnap.rank.maps import ArenaMaps
from memsnap.records import RankPlan, RankSource
from memsnap.state.manifest import Manifest

if TYPE_CHECKING:
    from memsnap.coding.receive import Peers

log = logging.getLogger("memsnap")


class Loader:
    """Rank ``client.rank``'s reads of a restore plan. ``direct``: peer reads go straight into
    the live tensors (TCP); ``device_restore(step, state, seconds)``: the device tier's load,
    False when it does not hold the step."""

    def __init__(
        self,
        client: AgentClient,
        maps: ArenaMaps,
        config: SnapshotConfig,
        world: int,
        secret: bytes,
        direct: bool,
        device_restore: Callable[[int, Any, dict], bool] | None = None,
    ):
        self.client, self.maps, self.config, self.world = client, maps, config, world
        self.rank = client.rank
        self.secret, self.direct = secret, direct
        self.device_restore = device_restore
        self.dirty = False  # a failed direct read left the live state partly written
        self.durable_run: str | None = None  # the run that spilled the step a durable read loaded
        # of the last load, for its report (the agent acts on them): chunks repaired at holders,
        # and whether the node's own copy was corrupt (the agent then reads it back)
        self.repaired, self.rebuild = 0, False
        self._peers: Peers | None = None

    def load(self, plan: RankPlan, state: Mapping[str, Any], seconds: dict) -> str:
        """Read ``plan`` into ``state``; the tier it came from (``seconds``: where time went)."""
        tier, step = plan.tier, plan.step
        self.repaired, self.rebuild = 0, False
        if tier == "none":
            return "none"
        if tier == "durable":
            return self._durable(plan, state, seconds)
        if tier == "elastic":
            return self._elastic(plan, state, seconds)
        assert step is not None  # a RAM tier loads a step
        corrupt = False
        if tier == "local" and self.device_restore is not None and self.device_restore(step, state, seconds):
            return "device"  # the agent's device buffer still holds the step
        if tier == "local":
            held = self.client.local(step)
            if held is not None:
                try:
                    self.apply(held, state, seconds)
                    return "local"
                except ChecksumError as exc:
                    log.warning("rank %d: local copy of step %d is corrupt (%s); reading peers", self.rank, step, exc)
                    corrupt = True
        t = time.perf_counter()
        assert plan.source is not None  # a RAM tier names where its bytes live
        read = "copy" if tier == "copy" else "peer"  # copy: the old node's whole copy, else k of k+m
        if self.direct:
            self.receive(plan.source, self.client.manifest(step, self.rank, plan.source), state)
            seconds["fetch"] = time.perf_counter() - t
            self.rebuild = corrupt  # the agent reads the node's copy back once the round succeeds
            return read
        held = self.client.recover(step, plan.source)
        seconds["fetch"] = time.perf_counter() - t
        self.apply(held, state, seconds)
        return read

    def peers(self):
        """This rank's own data-plane client and codec, made on its first read from peers."""
        if self._peers is None:
            import ray

            from memsnap.coding import receive
            from memsnap.coding.codec import codec_for
            from memsnap.transport import make_transport

            client = make_transport(
                "tcp", secret=self.secret, host=ray.util.get_node_ip_address(), **tcp_options(self.config)
            )
            self._peers = receive.Peers(client, codec_for(self.config.k, self.config.m))
        return self._peers

    def receive(self, source: RankSource, manifest_json: str, state) -> None:
        """Read this rank's bytes from the holders straight into ``state`` (``receive.py``)."""
        from memsnap.coding import receive
        from memsnap.errors import StateMismatchError

        try:
            stats = receive.into_state(self.peers(), source, manifest_json, state)
        except StateMismatchError:
            raise  # refused before anything was written
        except BaseException:
            self.dirty = True
            raise
        self.repaired += stats.get("repaired", 0)

    def apply(self, held: HeldCopy, state, seconds: dict) -> None:
        """Apply a copy held in an arena on this node (checked against its checksums)."""
        from memsnap.state.apply import apply

        t = time.perf_counter()
        apply(state, Manifest.from_json(held.manifest), self.maps.view(held.path, held.nbytes), verify=True)
        seconds["apply"] = time.perf_counter() - t

    def _elastic(self, plan: RankPlan, state, seconds: dict) -> str:
        """The step was taken by another world size: read the parts of every saved rank this
        rank needs from RAM, reshard them (``elastic.py``), and load; the live state is only
        written once everything was read and checked."""
        from memsnap.coding import elastic
        from memsnap.state.apply import apply
        from memsnap.state.capture import plan as layout_of

        if not self.direct:
            raise ConfigError(
                "an elastic restore from RAM reads the saved ranks over the tcp transport; with "
                f"transport={self.config.transport!r} it loads from durable storage instead"
            )
        assert plan.step is not None  # an elastic plan loads a step
        t = time.perf_counter()
        manifests = self.client.manifests(plan.step, plan.sources)
        seconds["manifests"] = time.perf_counter() - t
        t = time.perf_counter()
        man, buf, stats = elastic.assemble(self.peers(), plan.sources, manifests, layout_of(state), self.rank)
        seconds["fetch"] = time.perf_counter() - t
        self.repaired += stats.get("repaired", 0)
        t = time.perf_counter()
        apply(state, man, buf, verify=False)  # (every tensor read was checked against its checksum)
        seconds["apply"] = time.perf_counter() - t
        log.info(
            "rank %d: step %d resharded from %d saved ranks in RAM (read %s of them, %.1f MiB)",
            self.rank,
            plan.step,
            len(plan.sources),
            stats["ranks_read"],
            stats["bytes"] / 2**20,
        )
        return "elastic"

    def _durable(self, plan: RankPlan, state, seconds: dict) -> str:
        """The spilled step, resharded when another world size took it (as ``memsnap.load``)."""
        from memsnap.durable.checkpoint import read_step
        from memsnap.durable.storage import Store
        from memsnap.state.apply import apply

        t = time.perf_counter()
        assert plan.spill is not None and plan.step is not None  # a durable plan names both
        man, buf, marker = read_step(Store.open(plan.spill), plan.step, self.rank, self.world, state)
        seconds["fetch"] = time.perf_counter() - t
        self.durable_run = marker.get("metadata", {}).get("run")
        t = time.perf_counter()
        apply(state, man, buf, verify=True)
        seconds["apply"] = time.perf_counter() - t
        return "durable"

    def close(self) -> None:
        if self._peers is not None:
            self._peers.transport.close()
            self._peers = None
