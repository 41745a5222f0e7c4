"""A restore from peers inside the restoring rank: each shard lands straight in the live tensors.

The rank matches the snapshot against its live state first (``apply.plan``: nothing is
touched when anything differs), then lays its byte stream over the tensors the bytes belong
to (``landing.Spans``): a live CPU tensor receives its own bytes in place; a tensor the live
state lacks (optimizer moments before the first step, RNG states) or keeps elsewhere (CUDA,
non-contiguous) gets a new CPU tensor. ``restore.gather`` then reads every data shard from
its holder into those views, rebuilds lost stripes from parity, and ``apply.apply_received``
hands the new tensors to ``load_state_dict``. No byte is copied twice on the way.

Integrity: a data shard is checked against its xxh3 when it arrives (the holder's copy of
what the owner sent); a stripe rebuilt from parity is checked again through the manifest's
per-tensor checksums of the tensors it covers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from memsnap.coding.landing import Spans
from memsnap.coding.restore import gather
from memsnap.errors import ChecksumError, SnapshotBufferError
from memsnap.records import RankSource
from memsnap.state import apply as applying
from memsnap.state.capture import tensor_bytes
from memsnap.state.checksum import checksum
from memsnap.state.manifest import Manifest


class Peers:
    """What ``gather`` needs in a rank: a transport client and the codec."""

    def __init__(self, transport, codec):
        self.transport, self.codec = transport, codec


def _verify_decoded(man: Manifest, received: dict[int, torch.Tensor], decoded: list[tuple[int, int]]) -> None:
    if not decoded:
        return
    for i, t in received.items():
        e = man.tensors[i]
        if e.checksum is None or not any(a < e.offset + e.nbytes and e.offset < b for a, b in decoded):
            continue
        got = checksum(tensor_bytes(t))
        if got != e.checksum:
            raise ChecksumError(
                f"tensor {e.path!r} rebuilt from parity hashes to {got} but the manifest records "
                f"{e.checksum}; the stripe could not be repaired"
            )


def into_state(peers: Peers, src: RankSource, manifest_json: str | bytes, state: Mapping[str, Any]) -> dict:
    """Restore the rank's bytes ``src`` names, described by ``manifest_json``, from its holders
    straight into ``state``.

    Raises before touching ``state`` when the snapshot does not match it. Once the fetch has
    begun, a failure leaves ``state`` partly written (the caller must load something else)."""
    man = Manifest.from_json(manifest_json)
    if man.nbytes > src.nbytes:
        raise SnapshotBufferError(
            f"rank {src.rank}'s manifest describes {man.nbytes} bytes but step "
            f"{src.step} holds {src.nbytes}; the manifest or the plan is damaged"
        )
    pl = applying.plan(state, man)
    received, live = applying.destinations(pl)
    landing = Spans([(man.tensors[i].offset, tensor_bytes(t)) for i, t in received.items()], src.nbytes)
    stats = gather(peers, src, landing)
    _verify_decoded(man, received, stats["decoded"])
    applying.apply_received(state, pl, received, live)
    stats["in_place_bytes"] = sum(man.tensors[i].nbytes for i in live)
    return stats
