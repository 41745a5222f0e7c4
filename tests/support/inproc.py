"""A job of real agents and a real coordinator in one process, without Ray.

One ``AgentCore`` per node (its arenas, its encoder, its TCP data plane on loopback) and one
``CoordinatorCore``; the Ray boundary between them is replaced by direct calls that convert
records the way the Ray faces in ``memsnap.actors`` do. A rank's capture is written straight
into the arena its agent hands out; everything after it (checksums, stripes, parity, pushes,
``node_ready``/``node_failed``, the commit broadcast, re-protection) is the library's own code.
A lost node stops serving and says nothing more, as a dead process would.
"""

from __future__ import annotations

import logging
import threading
import types
from typing import TYPE_CHECKING, cast

import torch

from memsnap import identity
from memsnap.coding.codec import codec_for
from memsnap.coding.receive import Peers
from memsnap.coding.restore import gather
from memsnap.config import SnapshotConfig
from memsnap.job.coordinator import CoordinatorCore
from memsnap.localcluster import wait_for
from memsnap.node.agent import AgentCore
from memsnap.records import CommitNotice, RankSource
from memsnap.state.capture import capture
from memsnap.transport import make_transport

if TYPE_CHECKING:
    from memsnap.directory import Directory as RayDirectory

log = logging.getLogger("tests.inproc")
SECRET = b"i" * 32


class Face:
    """What ``actors.SnapshotAgent`` does with a call from the coordinator or another agent."""

    def __init__(self, core: AgentCore):
        self.core = core

    def commit(self, notice: dict) -> None:
        self.core.commit(CommitNotice.from_wire(notice))

    def layout_changed(self) -> None:
        self.core.sender.holders = None

    def inventory(self) -> dict:
        return self.core.inventory().to_wire()

    def address(self) -> dict:
        return self.core.address

    def rebuild_local(self, step: int, rank: int, source: dict, replace: bool = False) -> bool:
        return self.core.rebuild_local(step, rank, RankSource.from_wire(source), replace)

    def rebuild(self, step: int, k: int, m: int, info: dict, addrs: dict, shard: int) -> int:
        return self.core.repair.rebuild(step, k, m, info, addrs, shard)

    def hold_manifests(self, step: int, owner: str, info: dict, manifests: dict) -> None:
        self.core.repair.hold_manifests(step, owner, info, manifests)

    def held_manifests(self, step: int, owner: str) -> dict:
        return self.core.repair.held_manifests(step, owner)

    @staticmethod
    def running(tokens: list[str]) -> list[str]:
        return identity.running(tokens)

    @staticmethod
    def working(tokens: list[str]) -> list[str]:
        return identity.working(tokens)

    def __getattr__(self, name: str):
        return getattr(self.core, name)


class Handle:
    """An actor handle's shape (``handle.method.remote(*args)``), answered at once; ``ray.get``
    of the answer is the answer itself (see ``Job.ray``)."""

    def __init__(self, face: Face):
        self._face = face

    def __getattr__(self, name: str):
        return types.SimpleNamespace(remote=getattr(self._face, name))


class Directory:
    """``memsnap.directory.Directory`` over in-process agents: a lost node's agent is gone."""

    def __init__(self) -> None:
        self.faces: dict[str, Face] = {}
        self.lost: set[str] = set()

    def alive(self) -> set[str]:
        return set(self.faces) - self.lost

    def agent(self, node: str):
        return Handle(self.faces[node]) if node in self.alive() else None

    def forget(self, node: str) -> None:
        pass

    def call_all(self, nodes, method: str, *args, timeout: float) -> dict:
        out = {}
        for node in nodes:
            if node not in self.alive():
                continue
            try:
                out[node] = getattr(self.faces[node], method)(*args)
            except Exception as exc:  # a failing agent does not stop the others
                log.warning("%s on the agent of %s failed: %s", method, node[:12], exc)
        return out


class Job:
    """``ranks``: ``{node: [its ranks]}`` (a node with no rank is a spare agent)."""

    ray = types.SimpleNamespace(get=lambda answer, timeout=None: answer)  # for modules that ray.get a Handle

    def __init__(self, ranks: dict[str, list[int]], **config):
        self.cfg = SnapshotConfig("inproc", **config)
        self.ranks = {n: list(r) for n, r in ranks.items()}
        self.world = sum(len(r) for r in ranks.values())
        self.dir = Directory()
        self.cores: dict[str, AgentCore] = {}
        self.coord = CoordinatorCore(self.cfg.to_dict(), self.world, directory=cast("RayDirectory", self.dir))
        self.saved: dict[int, dict[int, bytes]] = {}  # step -> rank -> the bytes it captured
        for node in ranks:
            self.start_agent(node)
        for node, rs in ranks.items():
            if rs:
                self.join(node, rs)
        for node in self.placed_agents():
            self.cores[node].placed(self.coord.answer(node))

    # --- agents ----------------------------------------------------------------------------------
    def start_agent(self, node: str) -> AgentCore:
        core = AgentCore(self.cfg.to_dict(), node, SECRET)
        core.dir = cast("RayDirectory", self.dir)  # the same interface, over in-process agents
        core.call = lambda method, *args: self._coordinator_call(method, *args)  # type: ignore[method-assign]  # a stand-in for the real method
        self.cores[node] = core
        self.dir.faces[node] = Face(core)
        return core

    def _coordinator_call(self, method: str, *args):
        if method == "node_holders":  # (the Ray face reads it under the coordinator's lock)
            with self.coord.lock:
                return self.coord.membership.holders_of(*args).to_wire()
        return getattr(self.coord, method)(*args)

    def join(self, node: str, ranks: list[int]) -> None:
        """``ranks`` register on ``node`` as the node's relay does it: the coordinator first,
        then the agent learns the answer (the job's run and restore generation)."""
        got = self.coord.join(node, self.cores[node].address, ranks, self.world)
        for rank in ranks:
            self.cores[node].joined(rank, self.world, None, got.gen)
        self.ranks[node] = list(ranks)

    def placed_agents(self) -> list[str]:
        return sorted(set(self.cores) - self.dir.lost)

    def live(self) -> dict[str, AgentCore]:
        return {n: c for n, c in self.cores.items() if n not in self.dir.lost}

    def lose(self, node: str) -> None:
        """``node`` dies: its data plane stops answering and it tells nobody anything more."""
        core = self.cores[node]

        def gone(method, *args):
            raise ConnectionError(f"node {node[:12]} is lost")

        core.call = gone  # type: ignore[method-assign]  # a stand-in for the real method
        self.dir.lost.add(node)
        core.transport.close()

    def close(self) -> None:
        for core in self.cores.values():
            core.pool.shutdown(wait=True, cancel_futures=True)
            core.shutdown()

    # --- saving ------------------------------------------------------------------------------------
    def save(self, step: int, states: dict[int, dict]) -> None:
        """Every rank of every live node captures ``states[rank]`` for ``step`` into its agent's
        arena and tells it so; the agents send in the background."""
        self.saved[step] = {}
        for node, ranks in self.ranks.items():
            if node in self.dir.lost or not ranks:
                continue
            core = self.cores[node]
            for rank in ranks:
                man, buf = capture(states[rank], rng=False)
                self.saved[step][rank] = bytes(buf)
                slot = core.begin(step, rank, man.nbytes)["slot"]
                core.slots.arenas[(rank, slot)].view(0, man.nbytes)[:] = buf
                core.captured(step, rank, man.to_json().decode(), ranks)

    def resolved(self, step: int, timeout: float = 60) -> None:
        """Until the coordinator and every live agent have settled ``step`` (committed or dropped)."""
        wait_for(
            lambda: self.coord.resolved(step) and all(c.resolved(step) for c in self.live().values()),
            timeout=timeout,
            what=f"step {step} to be committed or dropped everywhere",
        )

    def layouts_current(self, timeout: float = 60) -> None:
        """Until every live agent has dropped a cached layout older than the placement (the
        ``layout_changed`` broadcast arrived)."""
        epoch = self.coord.membership.epoch
        wait_for(
            lambda: all(c.sender.holders is None or c.sender.holders.epoch == epoch for c in self.live().values()),
            timeout=timeout,
            what="the new layout to reach every agent",
        )

    # --- reading back ----------------------------------------------------------------------------------
    def read_from_holders(self, step: int, rank: int) -> tuple[bytes, dict]:
        """``rank``'s bytes of committed ``step`` as a restore from peers reads them (the
        holders the coordinator's record names, no local copy), and the gather's counters."""
        with self.coord.lock:
            record = self.coord.log.records[step]
            src = record.source(rank, dict(self.coord.membership.addrs))
        out = bytearray(src.nbytes)
        client = make_transport("tcp", secret=SECRET, host="127.0.0.1")
        try:
            stats = gather(Peers(client, codec_for(self.cfg.k, self.cfg.m)), src, memoryview(out))
        finally:
            client.close()
        return bytes(out), stats

    def local_copy(self, node: str, step: int, rank: int) -> bytes | None:
        info = self.cores[node].local(step, rank)
        if info is None:
            return None
        with open(info["path"], "rb") as f:
            return f.read(info["nbytes"])


class EncodeGate:
    """Holds a node's encoder when it starts the parity of its next snapshot: ``reached`` is
    set once it is there; it goes on when ``release()`` is called."""

    def __init__(self, core: AgentCore):
        self.reached, self._go = threading.Event(), threading.Event()
        assert core.codec is not None  # this job's RS(k, m) has parity to encode
        codec, encode_into = core.codec, core.codec.encode_into

        def held(data, parity):
            if not self._go.is_set():
                self.reached.set()
                if not self._go.wait(60):
                    raise TimeoutError("the encode gate was never released")
            return encode_into(data, parity)

        codec.encode_into = held  # type: ignore[method-assign]  # a stand-in for the real method

    def release(self) -> None:
        self._go.set()


def model_state(seed: int, width: int = 48) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 5))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, width)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}
