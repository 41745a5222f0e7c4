"""Every random number generator a training step draws from: Python, NumPy, torch CPU, CUDA.

``get_state()`` returns a plain nested dict (tensors and numbers only) that the skeleton
codec in ``tree.py`` stores exactly; ``set_state()`` puts it back. CUDA generators are
captured for every visible device when CUDA is available and skipped cleanly otherwise.
"""
from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {"name": name, "keys": keys.tolist(), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy_state(s: dict[str, Any]) -> None:
    keys = np.asarray(s["keys"], dtype=np.uint32)
    np.random.set_state((s["name"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"]))


def _cuda_states() -> list[torch.Tensor]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]


def get_state() -> dict[str, Any]:
    """The state of every generator, as tensors and plain values."""
    return {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "cuda": _cuda_states(),
    }


def _set_cuda_states(states: list[torch.Tensor]) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if states and have != len(states):
        warnings.warn(
            f"snapshot holds RNG state for {len(states)} CUDA device(s) but {have} are visible; "
            f"restoring the first {min(have, len(states))}", RuntimeWarning, stacklevel=3)
    for i, s in enumerate(states[:have]):
        torch.cuda.set_rng_state(s.cpu(), i)


def set_state(state: dict[str, Any]) -> None:
    """Put every generator back to ``state`` (from ``get_state``, possibly via a snapshot)."""
    random.setstate(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu().contiguous())
    _set_cuda_states(list(state.get("cuda") or []))
