"""One FSDP-style rank per Ray actor: a gloo process group, DTensor parameters on a 1-D mesh
(``Shard(0)`` or ``Replicate``) with their AdamW moments, and its own ``Snapshotter``.

Used by the elastic restore tests and ``bench/recovery.py``. (No tests here.)
"""

from __future__ import annotations

import time

import ray
import torch

from memsnap.localcluster import free_port

SMALL = {
    "l1.weight": ((24, 16), "shard"),
    "l1.bias": ((16,), "replicate"),
    "l2.weight": ((10, 16), "shard"),
}  # 10 rows: uneven over 3 and 4 ranks


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, job: str, rank: int, world: int, port: int, opts: dict, layout: dict | None = None):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from memsnap.rank import Snapshotter

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank, self.world, self.opts = rank, world, opts
        self.layout = layout or SMALL
        self.mesh = init_device_mesh("cpu", (world,))
        self.state = self._build(seed=0)
        self.snap = Snapshotter(job=job, rank=rank, world_size=world, preemption=False, **opts)

    def _build(self, seed: int) -> dict:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        torch.manual_seed(seed)
        model = torch.nn.Module()
        for path in self.layout:
            mod = path.split(".")[0]
            if not hasattr(model, mod):
                setattr(model, mod, torch.nn.Module())
        for path, (shape, kind) in self.layout.items():
            mod, attr = path.split(".")
            place = Shard(0) if kind == "shard" else Replicate()
            getattr(model, mod).register_parameter(
                attr, torch.nn.Parameter(distribute_tensor(torch.randn(shape), self.mesh, [place]))
            )
        optim = torch.optim.AdamW(model.parameters(), lr=0.05)
        state = {"model": model, "optim": optim}
        self._step(state, seed + 1000)  # the moments exist (a resharded load needs every sharded tensor)
        return state

    def _step(self, state: dict, seed: int) -> None:
        from torch.distributed.tensor import distribute_tensor

        g = torch.Generator().manual_seed(seed)
        for p in state["model"].parameters():
            p.grad = distribute_tensor(torch.randn(p.shape, generator=g), p.device_mesh, p.placements)
        state["optim"].step()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def restore(self) -> tuple:
        """``(step, tier, digest of this rank's shards, wall seconds, the restore's phases)``."""
        t = time.perf_counter()
        step = self.snap.restore(self.state)
        wall = time.perf_counter() - t
        last = self.snap.last_restore
        return step, last.tier, self.local_digest(self.state), wall, dict(last.seconds)

    def train_and_save(self, step: int) -> bool:
        self._step(self.state, step)
        return self.snap.save(step, self.state)

    def wait(self, step: int) -> int | None:
        return self.snap.wait(step, timeout=180)

    def spill(self, step: int) -> int | None:
        return self.snap.spill(step, timeout=600)

    def durable(self, step: int) -> tuple[str, float]:
        """The same step loaded by ``memsnap.load`` from the spill into a fresh state of this
        world size (collective: every rank calls it): ``(digest, seconds of the load)``."""
        import memsnap

        fresh = self._build(seed=99)
        t = time.perf_counter()
        memsnap.load(self.opts["spill"], fresh, step=step, rank=self.rank, world_size=self.world)
        wall = time.perf_counter() - t
        return self.local_digest(fresh), wall

    @staticmethod
    def local_digest(state: dict) -> str:
        """This rank's shards of every parameter and moment, and the optimizer's step counts."""
        import xxhash

        h = xxhash.xxh3_64()
        for name, p in state["model"].named_parameters():
            h.update(name.encode())
            h.update(p._local_tensor.contiguous().numpy().tobytes())
            for key, v in sorted(state["optim"].state[p].items()):
                t = v._local_tensor if hasattr(v, "_local_tensor") else v
                h.update(key.encode() + t.contiguous().numpy().tobytes())
        return h.hexdigest()

    def status(self) -> dict:
        return self.snap.status()


def start(job: str, opts: dict, nodes: list[int], layout: dict | None = None, timeout: float = 240) -> list:
    """Rank i on node index ``nodes[i]``, created together (they meet in one gloo group)."""
    port, world = free_port(), len(nodes)
    ranks = [
        Rank.options(resources={f"memsnap_node_{n}": 0.01}).remote(job, r, world, port, opts, layout)  # type: ignore[attr-defined]  # @ray.remote makes an ActorClass; ray's annotation keeps the bare class
        for r, n in enumerate(nodes)
    ]
    ray.get([r.node.remote() for r in ranks], timeout=timeout)
    return ranks
