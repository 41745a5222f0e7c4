"""Every random number generator a training step draws from: Python, NumPy, torch CPU, CUDA.

``get_state()`` returns a plain nested dict (tensors and numbers only) that the skeleton
codec in ``tree.py`` stores exactly; ``set_state()`` puts it back. CUDA generators are
captured for every visible device when CUDA is available and skipped cleanly otherwise.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def _numpy_state() -> dict[str, Any]:
    state = np.random.get_state(legacy=True)
    if not isinstance(state, tuple):  # legacy=True gives a dict only for a bit generator other than MT19937
        raise TypeError(f"numpy's global generator is {state['bit_generator']}, not MT19937")
    name, keys, pos, has_gauss, cached = state
    return {
        "name": name,
        "keys": keys.tolist(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _set_numpy_state(s: dict[str, Any], gen: Any = np.random) -> None:
    keys = np.asarray(s["keys"], dtype=np.uint32)
    gen.set_state((s["name"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"]))


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
            f"restoring the first {min(have, len(states))}",
            RuntimeWarning,
            stacklevel=3,
        )
    for i, s in enumerate(states[:have]):
        torch.cuda.set_rng_state(s.cpu(), i)


def check_state(state: Any, is_byte_tensor: Callable[[Any], bool]) -> None:
    """Raise ``ValueError`` if ``set_state(state)`` would fail, touching no generator: the
    Python and NumPy states are tried on scratch generators, tensors by ``is_byte_tensor``."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys():
        raise ValueError("is not a dict of python, numpy and torch states")
    try:
        random.Random().setstate(state["python"])
        _set_numpy_state(state["numpy"], np.random.RandomState())
    except (TypeError, ValueError, OverflowError, KeyError, IndexError) as exc:
        raise ValueError(f"does not restore: {type(exc).__name__}: {exc}") from None
    cuda = state.get("cuda") or []
    if not is_byte_tensor(state["torch"]) or not isinstance(cuda, list) or not all(is_byte_tensor(s) for s in cuda):
        raise ValueError("holds a torch or CUDA generator state that is not a 1-d uint8 tensor")


def check_generator_bytes(state: dict[str, Any]) -> None:
    """Raise ``ValueError`` if the torch CPU generator state in ``state`` (already shape-checked
    by ``check_state``) holds bytes torch refuses; tried on a scratch generator."""
    try:
        torch.Generator().set_state(state["torch"].cpu().contiguous())
    except RuntimeError as exc:
        raise ValueError(f"holds a torch CPU generator state torch refuses: {exc}") from None


def set_state(state: dict[str, Any]) -> None:
    """Put every generator back to ``state`` (from ``get_state``, possibly via a snapshot)."""
    random.setstate(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu().contiguous())
    _set_cuda_states(list(state.get("cuda") or []))
