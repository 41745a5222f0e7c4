"""One process of the 4 -> 2 -> 4 resharding test (``tests/test_reshard.py``): DTensor state
saved and loaded by gloo ranks on CPU. Run as ``python -m support.reshard_worker`` with
``RANK``, ``ROOT`` and ``PORT_A``/``PORT_B``/``PORT_C`` set. (No tests here.)"""

from __future__ import annotations

import os
import sys

import torch

LAYOUT = {  # parameter -> (full shape, placement)
    "l1.weight": ((12, 6), "shard0"),
    "l1.bias": ((12,), "shard0"),
    "l2.weight": ((7, 12), "shard1"),
    "l2.bias": ((7,), "replicate"),
    "l3.weight": ((7, 7), "shard0"),
    "l3.bias": ((7,), "replicate"),  # 7 rows over 4 ranks: 2,2,2,1
}


def build(mesh, seed: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    place = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}
    torch.manual_seed(seed)
    model = torch.nn.Module()
    for name in ("l1", "l2", "l3"):
        setattr(model, name, torch.nn.Module())
    params = {}
    for path, (shape, kind) in LAYOUT.items():
        mod, attr = path.split(".")
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [place[kind]]))
        getattr(model, mod).register_parameter(attr, p)
        params[path] = (p, place[kind])
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    step(mesh, params, optim, seed)
    return {"model": model, "optim": optim, "_params": params}


def step(mesh, params: dict, optim, seed: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(seed + 1000)
    for p, placement in params.values():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g), mesh, [placement])
    optim.step()


def dump(objs: dict, out: str) -> None:
    """Rank 0 writes every parameter and AdamW moment, gathered whole, to ``out``."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    full = {}
    for path, (p, _) in objs["_params"].items():
        full[path] = p.full_tensor()
        st = objs["optim"].state[p]
        full[path + ".exp_avg"] = st["exp_avg"].full_tensor()
        full[path + ".exp_avg_sq"] = st["exp_avg_sq"].full_tensor()
        full[path + ".step"] = st["step"].clone()
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, out)


def _phase(phase: str, rank: int, world: int, last: bool = False) -> None:
    """One phase in its own process group. The group is destroyed after a barrier for the next
    phase to form its own; after the ``last`` the process leaves without gloo's teardown (as
    the other two-process group tests do: a peer closing its sockets while another still reads
    its last message must not abort it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import memsnap

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{os.environ['PORT_' + phase]}"
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        root = os.environ["ROOT"]
        objs = build(mesh, seed=0 if phase == "A" else 7)
        state = {"model": objs["model"], "optim": objs["optim"]}
        if phase == "A":
            memsnap.save(root, state, 1)
        else:
            assert memsnap.load(root, state) == (1 if phase == "B" else 2)
            dump(objs, f"{root}/loaded_{phase}.safetensors")
        if phase == "B":
            step(mesh, objs["_params"], objs["optim"], seed=3)
            memsnap.save(root, state, 2)
        dump(objs, f"{root}/saved_{phase}.safetensors")
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    if last:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def worker() -> None:
    """One of 4 processes: phase A with 4 ranks, B with the first 2, C with all 4 again."""
    rank = int(os.environ["RANK"])
    _phase("A", rank, 4)
    if rank < 2:
        _phase("B", rank, 2)  # ranks 2 and 3 wait in phase C's rendezvous meanwhile
    _phase("C", rank, 4, last=True)


if __name__ == "__main__":
    worker()
