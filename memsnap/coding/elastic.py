"""Elastic restore from RAM: load a step that W ranks took into W' ranks, from their peers.

The coordinator's plan gives every rank where each saved rank's bytes live (``RankSource``:
the owner node's whole copy, or ``k`` of ``k+m`` shards per stripe at the holders). The
rank reads every saved rank's manifest, and ``reshard`` (the same box logic as a resharding
load from disk) says which saved tensors it needs: for each of its DTensor shards the saved
shards that overlap it (``Shard``/``Replicate``; a replicated tensor is read once, from a
saved rank whose old node still holds its copy if one does), and its plain tensors and
non-tensor leaves from saved rank ``r % W``. Of each saved rank it then
fetches only the stripes those tensors lie in (``restore.gather`` with a stripe subset,
decoding from parity where a holder is gone) straight into one buffer per tensor, checks
every tensor read against the checksum its manifest records, and lays the overlaps out
like the live state. The result is a ``(Manifest, buffer)`` for ``apply.apply``: nothing of
the live state is written until every byte is read and checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from memsnap.coding.landing import Spans
from memsnap.coding.restore import gather
from memsnap.errors import ChecksumError, FormatError
from memsnap.records import RankSource
from memsnap.state import reshard
from memsnap.state.checksum import checksum
from memsnap.state.dtypes import dtype_of
from memsnap.state.manifest import Manifest, TensorEntry


def read_plan(
    saved: Sequence[Manifest], live: Manifest, rank: int, order=None
) -> tuple[Manifest, dict[int, list[str]]]:
    """``(target, reads)``: rank ``rank``'s manifest in the layout of the ``live`` plan, and
    ``{saved rank: [tensor paths]}`` it reads to fill it (pure). ``order``: the saved ranks in
    the order a replicated tensor is looked for (default 0..W-1)."""
    saved = list(saved)
    target = reshard.layout(saved, live, rank)
    return target, reshard.reads(saved, target, rank, order)


def replica_order(sources: Sequence[RankSource], rank: int) -> list[int]:
    """Where new rank ``rank`` reads a replicated tensor: a saved rank whose old node still
    holds its whole copy first (no decode), starting at its own number so that the new ranks
    spread over the copies."""
    n = len(sources)
    return sorted(range(n), key=lambda r: (sources[r].copy is None, (r - rank) % n))


def stripe_span(
    entries: Sequence[TensorEntry], k: int, chunk: int, nbytes: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """``(stripes, ranges)``: the stripes of a region of ``nbytes`` (``k`` data shards of
    ``chunk`` bytes a stripe) that hold the bytes of ``entries``, and those stripes as merged
    ``[start, stop)`` byte ranges of the region (pure)."""
    per = k * chunk
    stripes: set[int] = set()
    for e in entries:
        if e.nbytes:
            stripes.update(range(e.offset // per, (e.offset + e.nbytes - 1) // per + 1))
    ranges: list[tuple[int, int]] = []
    for s in sorted(stripes):
        a, b = s * per, min((s + 1) * per, nbytes)
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    return sorted(stripes), ranges


def fetch(peers, source: RankSource, saved: Manifest, paths: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Saved tensors ``paths`` of one saved rank, read from its holders (only the stripes they
    lie in) and checked against their recorded checksums: ``({path: tensor}, gather's stats)``."""
    entries = [_entry(saved, p) for p in paths]
    if saved.nbytes > source.nbytes:
        raise FormatError(
            f"saved rank {source.rank}'s manifest describes {saved.nbytes} bytes but step "
            f"{source.step} holds {source.nbytes}; the manifest or the plan is damaged"
        )
    bufs = {e.path: torch.empty(e.nbytes, dtype=torch.uint8) for e in entries}
    stripes, ranges = stripe_span(entries, source.k, source.chunk, source.nbytes)
    landing = Spans([(e.offset, bufs[e.path].numpy()) for e in entries], source.nbytes, within=ranges)
    stats = gather(peers, source, landing, stripes)
    out = {}
    for e in entries:
        raw = bufs[e.path]
        if e.checksum is None:
            raise ChecksumError(
                f"saved rank {source.rank}'s tensor {e.path!r} of step {source.step} has no "
                "recorded checksum; it cannot be verified (load the step from durable storage)"
            )
        got = checksum(raw.numpy())
        if got != e.checksum:
            raise ChecksumError(
                f"saved rank {source.rank}'s tensor {e.path!r} of step {source.step} hashes to "
                f"{got} but its manifest records {e.checksum}; the RAM copy is damaged"
            )
        out[e.path] = raw.view(dtype_of(e.dtype)).view(e.shape)
    return out, stats


def _entry(man: Manifest, path: str) -> TensorEntry:
    try:
        return man.entry(path)
    except KeyError:
        raise FormatError(f"the saved manifest has no tensor {path!r}; the step is damaged") from None


class _Fetched:
    """What ``reshard.fill`` reads from: the tensors fetched, by saved rank and path."""

    def __init__(self, saved: list[Manifest], tensors: dict[tuple[int, str], torch.Tensor], order: list[int]):
        self.saved, self.tensors, self.order = saved, tensors, order

    def tensor(self, rank: int, path: str) -> torch.Tensor:
        e = self.saved[rank].entry(path)
        return self.tensors[(rank, e.alias_of or path)]


def assemble(
    peers, sources: Sequence[RankSource], manifests: Sequence[str | bytes], live: Manifest, rank: int, threads: int = 4
) -> tuple[Manifest, Any, dict]:
    """Rank ``rank``'s manifest and buffer of a step saved by ``len(sources)`` ranks, in the
    layout of the ``live`` plan, read from RAM: ``(manifest, buffer, stats)``. ``sources`` and
    ``manifests`` are in saved rank order. ``peers`` has ``transport`` and ``codec``."""
    if len(sources) != len(manifests) or [s.rank for s in sources] != list(range(len(sources))):
        raise FormatError(
            f"an elastic plan must name saved ranks 0..{len(manifests) - 1} in order, got {[s.rank for s in sources]}"
        )
    saved = [Manifest.from_json(m, f"saved rank {r}'s manifest") for r, m in enumerate(manifests)]
    order = replica_order(sources, rank)
    target, reads = read_plan(saved, live, rank, order)

    def one(item):
        r, paths = item
        return r, fetch(peers, sources[r], saved[r], paths)

    tensors: dict[tuple[int, str], torch.Tensor] = {}
    stats = {"ranks_read": sorted(reads), "bytes": 0, "decoded_stripes": 0, "repaired": 0}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(reads)))) as ex:
        for r, (got, st) in ex.map(one, sorted(reads.items())):
            tensors.update({(r, p): t for p, t in got.items()})
            for key in ("bytes", "decoded_stripes", "repaired"):
                stats[key] += st.get(key, 0)
    buf = reshard.fill(target, saved, _Fetched(saved, tensors, order), rank)
    return target, buf, stats
