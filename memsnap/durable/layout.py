"""The names of a step directory: step and rank file names, the commit marker's name, what
``write_rank`` records of a rank's files, and the shape of a rank's data produced as a stream.

    step_000000001234/
        rank_00000.bin     the rank's flat snapshot buffer (``Manifest.nbytes`` bytes)
        rank_00000.json    its Manifest, with per-tensor checksums and the .bin's size + xxh3
        COMMITTED          JSON written last: step, world size, metadata, per-rank files

A step saved again (by another run, over a step number already taken) names its rank files
with a tag, ``rank_00000.r<16 hex>.bin``, which its ``COMMITTED`` names (``files``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from memsnap.errors import FormatError
from memsnap.state.manifest import Manifest

MARKER = "COMMITTED"
STEP_RE = re.compile(r"^step_(\d{12})$")
TAG_RE = re.compile(r"^r[0-9a-f]{16}$")  # the name tag of a re-saved step's rank files
RANK_FILE_RE = re.compile(r"^rank_\d{5}(\.r[0-9a-f]{16})?\.(bin|json)$")


class RankStream(Protocol):
    """A rank's data file produced piece by piece instead of from one buffer.

    Iterating yields the file's bytes in order (``nbytes`` in all, as buffers); once the
    iteration is complete, ``manifest()`` is the rank's manifest with every tensor's checksum.
    ``stream.TensorStream`` is the one that reads straight from the tensors.
    """

    nbytes: int

    def __iter__(self) -> Iterator[memoryview]: ...

    def manifest(self) -> Manifest: ...


def step_name(step: int) -> str:
    return f"step_{step:012d}"


def rank_name(rank: int, ext: str, tag: str | None = None) -> str:
    """A rank's file name; ``tag`` (a re-saved step's files) goes before the extension."""
    return f"rank_{rank:05d}.{ext}" if tag is None else f"rank_{rank:05d}.{tag}.{ext}"


@dataclass(frozen=True)
class RankRecord:
    """What ``write_rank`` wrote for one rank: file sizes and whole-file xxh3 checksums."""

    rank: int
    bin_bytes: int
    bin_xxh3: str
    json_bytes: int
    json_xxh3: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def files_tag(marker: dict, where: str) -> str | None:
    """The name tag a marker gives its rank files (None: the plain names)."""
    tag = marker.get("files")
    if tag is not None and not (isinstance(tag, str) and TAG_RE.fullmatch(tag)):
        raise FormatError(
            f"{where} files: must be 'r' and 16 hex digits, the name tag of the "
            f"step's rank files, got {tag!r}; the step is damaged, load another step"
        )
    return tag
