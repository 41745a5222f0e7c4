"""Durable storage: the standalone checkpoint format (``save``, ``load``) and the spill's files.

``checkpoint`` (``save``/``load``: a directory per step, readable without Ray), ``storage``
(a step directory written, listed, read and pruned on local disk, NFS, S3 or GCS through
``pyarrow.fs``), ``layout`` (its file names), ``verify`` (a rank file checked as it is read),
``localfs`` (local files written safely), ``meta`` (what every step records of itself),
``lineage`` (which run took each committed step) and ``reshard`` (a step of another world
size, read from the rank files).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # ``memsnap.durable.save`` without importing torch up front
    if name in ("save", "load"):
        from memsnap.durable import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'memsnap.durable' has no attribute {name!r}")
