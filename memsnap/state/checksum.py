"""Checksums of byte ranges: xxh3-64, as 16 lowercase hex digits. No torch: the agent's send
path (``fill_checksums``) runs in a process that never imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from memsnap.state.manifest import Manifest


def checksum(buf) -> str:
    """The xxh3-64 of ``buf`` (anything with the buffer protocol)."""
    return xxhash.xxh3_64_hexdigest(memoryview(buf).cast("B"))


def fill_checksums(manifest: Manifest, buf) -> Manifest:
    """``manifest`` with the xxh3-64 of every stored tensor's bytes in ``buf`` (aliases: None)."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < manifest.nbytes:
        raise ValueError(f"buffer holds {mv.nbytes} bytes but the manifest describes {manifest.nbytes}")
    sums = [None if t.alias_of else checksum(mv[t.offset : t.offset + t.nbytes]) for t in manifest.tensors]
    return manifest.with_checksums(sums)
