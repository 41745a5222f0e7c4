"""Checksums of byte ranges: xxh3-64, as 16 lowercase hex digits."""
from __future__ import annotations

import xxhash


def checksum(buf) -> str:
    """The xxh3-64 of ``buf`` (anything with the buffer protocol)."""
    return xxhash.xxh3_64_hexdigest(memoryview(buf).cast("B"))
