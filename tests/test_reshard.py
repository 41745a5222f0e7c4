"""Resharding DTensor state across world sizes with gloo processes on CPU: 4 -> 2 -> 4.

Four processes run three phases in turn. Phase A: 4 ranks build a model whose weights are DTensors (row shards, column shards, an
uneven split, replicated biases) with AdamW state, and save step 1. Phase B: 2 ranks load it,
take one more optimizer step and save step 2. Phase C: 4 ranks load step 2. After every phase
rank 0 writes the gathered full tensors; they must match bitwise across the load.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memsnap.cli import main as cli_main
from memsnap.manifest import Manifest, TensorEntry
from memsnap.reshard import fill, layout, overlap

TESTS = Path(__file__).parent
LAYOUT = {  # parameter -> (full shape, placement)
    "l1.weight": ((12, 6), "shard0"), "l1.bias": ((12,), "shard0"),
    "l2.weight": ((7, 12), "shard1"), "l2.bias": ((7,), "replicate"),
    "l3.weight": ((7, 7), "shard0"), "l3.bias": ((7,), "replicate"),  # 7 rows over 4 ranks: 2,2,2,1
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


def _phase(phase: str, rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import memsnap

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{os.environ['PORT_' + phase]}")
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
    finally:
        dist.destroy_process_group()


def worker() -> None:
    """One of 4 processes: phase A with 4 ranks, B with the first 2, C with all 4 again."""
    rank = int(os.environ["RANK"])
    _phase("A", rank, 4)
    if rank < 2:
        _phase("B", rank, 2)  # ranks 2 and 3 wait in phase C's rendezvous meanwhile
    _phase("C", rank, 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(root: str) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_reshard; test_reshard.worker()"
    env = dict(os.environ, ROOT=root, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", **{f"PORT_{p}": str(free_port()) for p in "ABC"})
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(4)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    bad = [(r, p.returncode, o[-3000:]) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    assert not bad, f"ranks failed: {bad}"


def assert_same(a: str, b: str) -> None:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    assert set(x) == set(y)
    for k in x:
        assert torch.equal(x[k], y[k]), k


def test_overlap_boxes():
    assert overlap(((0, 0), (6, 4)), ((3, 2), (6, 6))) == ((3, 2), (3, 2))
    assert overlap(((0,), (3,)), ((3,), (3,))) is None
    assert overlap(((2, 0), (2, 7)), ((0, 0), (7, 7))) == ((2, 0), (2, 7))


def _shard(path: str, start: int, n: int, mesh: int, offset: int = 0) -> TensorEntry:
    return TensorEntry(path=path, dtype="float32", shape=(n,), offset=offset, nbytes=4 * n, global_shape=(4,),
                       global_offset=(start,), placements=("Shard(0)",), mesh_shape=(mesh,))


def test_saved_shards_are_matched_to_the_live_tensor_at_their_skeleton_position():
    """Two sharded tensors whose keys join alike as text ("a/b" beside a -> b); the saved entries
    carry the names an older memsnap gave them ("m/a/b", "m/a/b#1"), the live plan its own."""
    skeleton = {"m": {"a/b": {"__tensor__": 0}, "a": {"b": {"__tensor__": 1}}}}
    saved = [Manifest([_shard("m/a/b", 2 * r, 2, 2), _shard("m/a/b#1", 2 * r, 2, 2, offset=64)],
                      skeleton, 128) for r in range(2)]
    live = Manifest([_shard("m/a%2Fb", 0, 4, 1), _shard("m/a/b", 0, 4, 1)], skeleton, 0)
    target = layout(saved, live, 0)
    assert [(e.path, e.shape, e.global_offset) for e in target.tensors] == [("m/a/b", (4,), (0,)),
                                                                            ("m/a/b#1", (4,), (0,))]
    values = {(r, e.path): torch.arange(2.0) + 2 * r + 10 * i
              for r in range(2) for i, e in enumerate(saved[r].tensors)}
    reader = type("Reader", (), {"saved": saved, "tensor": lambda self, r, path: values[(r, path)]})()
    buf = torch.from_numpy(fill(target, saved, reader, 0).copy())
    got = [buf[e.offset:e.offset + e.nbytes].view(torch.float32).tolist() for e in target.tensors]
    assert got == [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]]


@pytest.mark.slow
def test_reshard_4_to_2_to_4(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    run_workers(root)
    assert_same(f"{root}/saved_A.safetensors", f"{root}/loaded_B.safetensors")  # 4 -> 2
    assert_same(f"{root}/saved_B.safetensors", f"{root}/loaded_C.safetensors")  # 2 -> 4
    # the CLI gathers a sharded checkpoint's weights whole
    out = str(tmp_path / "w.safetensors")
    assert cli_main(["export", root + "/2", "--safetensors", out]) == 0
    from safetensors.torch import load_file

    exported, saved = load_file(out), load_file(f"{root}/saved_B.safetensors")
    assert set(exported) == set(LAYOUT)
    assert all(torch.equal(exported[k], saved[k]) for k in LAYOUT)
