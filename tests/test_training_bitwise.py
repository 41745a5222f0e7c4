"""Proof: N steps, snapshot, a fresh process resumes for N more, bit for bit the uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import support.toytrain as toytrain
import torch

from memsnap.state.manifest import Manifest

N = 6
HERE = Path(__file__).parent


def read_params(directory: Path) -> dict[str, torch.Tensor]:
    m = Manifest.from_json((directory / "params.json").read_bytes())
    raw = bytearray((directory / "params.bin").read_bytes())
    return {e.path: torch.frombuffer(raw, dtype=torch.uint8, offset=e.offset, count=e.nbytes) for e in m.tensors}


def as_bytes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"model/{k}": v.contiguous().view(-1).view(torch.uint8) for k, v in model.state_dict().items()}


def test_resume_in_a_fresh_process_is_bitwise_identical(tmp_path):
    ref_objs = toytrain.make(0)
    ref = toytrain.train_steps(ref_objs, 2 * N)
    objs = toytrain.make(0)
    first = toytrain.train_steps(objs, N)
    assert first == ref[:N]
    toytrain.save(objs, tmp_path)
    subprocess.run(
        [sys.executable, str(HERE / "support" / "toytrain.py"), str(tmp_path), str(N)],
        check=True,
        timeout=120,
        cwd=HERE,
    )
    resumed = [float.fromhex(x) for x in json.loads((tmp_path / "losses.json").read_text())]
    assert [x.hex() for x in first + resumed] == [x.hex() for x in ref]
    got, want = read_params(tmp_path), as_bytes(ref_objs["model"])
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_resume_without_rng_state_diverges(tmp_path):
    """The control: the same resume minus RNG restore does not match, so the proof can fail."""
    ref = toytrain.train_steps(toytrain.make(0), N + 2)
    objs = toytrain.make(0)
    toytrain.train_steps(objs, N)
    toytrain.save(objs, tmp_path)
    fresh = toytrain.make(999)
    toytrain.load(fresh, tmp_path, rng=False)
    assert toytrain.train_steps(fresh, 2) != ref[N:]
