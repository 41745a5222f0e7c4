"""``bench/gpu.py`` on a machine without CUDA: a clear "no CUDA" answer, exit 0, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_gpu_bench_says_no_cuda_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu.md"
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert run.returncode == 0, run.stderr
    assert "no CUDA" in run.stdout and "Nothing measured" in run.stdout
    assert '"cuda": false' in run.stdout
    assert not out.exists()


def test_gpu_results_do_not_claim_a_run_that_did_not_happen():
    with open(os.path.join(ROOT, "bench", "results", "gpu.md")) as f:
        text = f.read()
    if "Not run on a GPU yet" in text:
        assert "| " not in text  # no table of numbers in the placeholder
    else:
        assert "Run of `python bench/gpu.py` on" in text
