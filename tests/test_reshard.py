"""Resharding DTensor state across world sizes with gloo processes on CPU: 4 -> 2 -> 4.

Four processes run three phases in turn. Phase A: 4 ranks build a model whose weights are DTensors (row shards, column shards, an
uneven split, replicated biases) with AdamW state, and save step 1. Phase B: 2 ranks load it,
take one more optimizer step and save step 2. Phase C: 4 ranks load step 2. After every phase
rank 0 writes the gathered full tensors; they must match bitwise across the load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.reshard_worker import LAYOUT

from memsnap.cli import main as cli_main
from memsnap.localcluster import free_port
from memsnap.state.manifest import Manifest, TensorEntry
from memsnap.state.reshard import fill, layout, overlap

TESTS = Path(__file__).parent


def run_workers(root: str) -> None:
    env = dict(
        os.environ,
        ROOT=root,
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        **{f"PORT_{p}": str(free_port()) for p in "ABC"},
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "support.reshard_worker"],
            env=dict(env, RANK=str(r)),
            cwd=TESTS,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(4)
    ]
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
    return TensorEntry(
        path=path,
        dtype="float32",
        shape=(n,),
        offset=offset,
        nbytes=4 * n,
        global_shape=(4,),
        global_offset=(start,),
        placements=("Shard(0)",),
        mesh_shape=(mesh,),
    )


def test_saved_shards_are_matched_to_the_live_tensor_at_their_skeleton_position():
    """Two sharded tensors whose keys join alike as text ("a/b" beside a -> b); the saved entries
    carry the names an older memsnap gave them ("m/a/b", "m/a/b#1"), the live plan its own."""
    skeleton = {"m": {"a/b": {"__tensor__": 0}, "a": {"b": {"__tensor__": 1}}}}
    saved = [
        Manifest([_shard("m/a/b", 2 * r, 2, 2), _shard("m/a/b#1", 2 * r, 2, 2, offset=64)], skeleton, 128)
        for r in range(2)
    ]
    live = Manifest([_shard("m/a%2Fb", 0, 4, 1), _shard("m/a/b", 0, 4, 1)], skeleton, 0)
    target = layout(saved, live, 0)
    assert [(e.path, e.shape, e.global_offset) for e in target.tensors] == [
        ("m/a/b", (4,), (0,)),
        ("m/a/b#1", (4,), (0,)),
    ]
    values = {(r, e.path): torch.arange(2.0) + 2 * r + 10 * i for r in range(2) for i, e in enumerate(saved[r].tensors)}
    reader = type("Reader", (), {"saved": saved, "tensor": lambda self, r, path: values[(r, path)]})()
    buf = torch.from_numpy(fill(target, saved, reader, 0).copy())
    got = [buf[e.offset : e.offset + e.nbytes].view(torch.float32).tolist() for e in target.tensors]
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
