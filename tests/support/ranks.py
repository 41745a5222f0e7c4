"""Many ranks in one process per node: the shape of an 8-GPU host, cheaply on 2 cores.

``NodeRanks`` is one Ray actor pinned to a simulated node that runs several ranks, each a
thread with its own small state (a linear layer + AdamW) and its own ``Snapshotter``, all
saving and restoring at once as the ranks of a real node do.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ray
import torch

from memsnap.identity import running
from memsnap.localcluster import wait_for
from support.runtime import digest


def small_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": optim}


def step(state: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 32, generator=g)
    loss = state["model"](x).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()


@ray.remote(num_cpus=0)
class NodeRanks:
    def __init__(self, job: str, ranks: list[int], world: int, opts: dict):
        from memsnap.rank import Snapshotter

        self.ranks = list(ranks)
        self.states = {r: small_state(r) for r in ranks}
        self.pool = ThreadPoolExecutor(max(1, len(ranks)))
        make = lambda r: Snapshotter(job=job, rank=r, world_size=world, preemption=False, **opts)  # noqa: E731
        self.snaps = dict(zip(ranks, self.pool.map(make, ranks)))

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def process(self) -> str:
        from memsnap.identity import process_token

        return process_token()

    def _all(self, fn) -> dict:
        return dict(zip(self.ranks, self.pool.map(fn, self.ranks)))

    def train_and_save(self, s: int, force: bool = False) -> dict:
        """Every rank trains step ``s`` and saves it at once (``force``: as a run's last step is
        saved, waiting for a busy pipeline's slot): ``{rank: (saved, digest)}``."""

        def one(r):
            step(self.states[r], 1000 * s + r)
            return self.snaps[r].save(s, self.states[r], force=force), digest(self.states[r], rng=False)

        return self._all(one)

    def wait(self, s: int, timeout: float = 120.0):
        return self.snaps[self.ranks[0]].wait(s, timeout)

    def restore(self) -> dict:
        """Every rank restores at once: ``{rank: (step, tier, digest)}``."""

        def one(r):
            got = self.snaps[r].restore(self.states[r])
            return got, self.snaps[r].last_restore.tier, digest(self.states[r], rng=False)

        return self._all(one)

    def status(self) -> dict:
        return self.snaps[self.ranks[0]].status()

    def counters(self) -> dict:
        return {r: dict(s.counters) for r, s in self.snaps.items()}

    def close(self) -> None:
        for s in self.snaps.values():
            s.close()


def _create(job: str, layout: dict[int, list[int]], opts: dict) -> list:
    world = sum(len(r) for r in layout.values())
    return [
        NodeRanks.options(resources={f"memsnap_node_{i}": 0.01}).remote(job, ranks, world, opts)  # type: ignore[attr-defined]  # @ray.remote makes an ActorClass; ray's annotation keeps the bare class
        for i, ranks in layout.items()
    ]


def start_node_ranks(job: str, layout: dict[int, list[int]], opts: dict) -> list:
    """One ``NodeRanks`` per simulated node index in ``layout`` (``{node index: ranks}``)."""
    actors = _create(job, layout, opts)
    ray.get([a.node.remote() for a in actors], timeout=240)
    return actors


def refused_node_ranks(job: str, layout: dict[int, list[int]], opts: dict) -> list[str]:
    """Start ``layout``'s ranks as ``start_node_ranks`` does, expecting every one to be refused:
    the error of each (waited for, all of them: a rank still waiting to register could
    otherwise take its rank later, once the holder's process is gone)."""
    errors = []
    for actor in _create(job, layout, opts):
        try:
            ray.get(actor.node.remote(), timeout=240)
            errors.append("registered")
            ray.kill(actor, no_restart=True)
        except ray.exceptions.ActorDiedError as exc:
            errors.append(str(exc))
    return errors


def kill_node_ranks(actors: list, timeout: float = 120) -> None:
    """Kill ``actors`` and return once their processes are gone (``ray.kill`` only asks:
    on a loaded machine a killed process can take many seconds to exit)."""
    tokens = ray.get([a.process.remote() for a in actors], timeout=60)
    for a in actors:
        ray.kill(a, no_restart=True)
    wait_for(lambda: not running(tokens), timeout=timeout, what=f"{len(tokens)} killed rank processes to exit")


def merged(answers: list[dict]) -> dict:
    out = {}
    for a in answers:
        out.update(a)
    return out
