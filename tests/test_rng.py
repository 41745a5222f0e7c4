"""RNG state: every generator comes back, directly and through a snapshot."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from memsnap.state import rng
from memsnap.state.apply import apply
from memsnap.state.capture import capture


def draw():
    return random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist()


def test_get_set_restores_python_numpy_and_torch():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    saved = rng.get_state()
    first = draw()
    assert draw() != first
    rng.set_state(saved)
    assert draw() == first


def test_rng_state_goes_through_a_snapshot_as_json_and_bytes():
    random.seed(3)
    m, buf = capture({}, checksums=True)
    assert m.entry("__rng__/torch").dtype == "uint8"
    first = draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    apply({}, type(m).from_json(m.to_json()), bytes(buf))
    assert draw() == first


def test_without_cuda_no_device_state_is_kept():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert rng.get_state()["cuda"] == []


@pytest.mark.gpu
def test_every_cuda_device_is_captured_and_restored():
    saved = rng.get_state()
    assert len(saved["cuda"]) == torch.cuda.device_count()
    first = [torch.rand(2, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())]
    rng.set_state(saved)
    assert [torch.rand(2, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())] == first
