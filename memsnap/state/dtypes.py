"""Tensor dtypes by name: the strings the manifest stores, and their element sizes."""

from __future__ import annotations

import torch

from memsnap.errors import StateMismatchError
from memsnap.state.validate import ITEMSIZE

# Sub-byte and quantized dtypes have no plain byte layout a snapshot could copy; the rest of
# torch's dtypes (including bfloat16 and every float8 this torch has) are listed in
# validate.ITEMSIZE (kept free of torch for the manifest parser).
_NAMES = tuple(ITEMSIZE)

BY_NAME: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _NAMES if hasattr(torch, n)}
NAME_OF: dict[torch.dtype, str] = {d: n for n, d in BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return NAME_OF[dtype]
    except KeyError:
        raise StateMismatchError(
            f"dtype {dtype} cannot be snapshotted (supported: {', '.join(BY_NAME)}); "
            f"convert the tensor to one of them before capture"
        ) from None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a manifest name stands for."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise StateMismatchError(
            f"manifest dtype {name!r} is unknown to this torch {torch.__version__} "
            f"(it knows: {', '.join(BY_NAME)}); restore with the torch version that captured it"
        ) from None


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name``."""
    return dtype_of(name).itemsize
