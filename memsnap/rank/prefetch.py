"""A standby's read of its new rank's bytes from the peers, ahead of the restore plan.

A standby that takes a lost rank whose state is sharded (FSDP2) first runs ``on_rank``: the
sharding and the optimizer over the sharded parameters, which its live tensors do not exist
before. Its restore from the peers could only start after that, and both take seconds at
scale. So, once its ``Snapshotter`` has registered, a thread of its own reads the rank's
bytes of the newest committed step (``Coordinator.newest_source``: its holders on the live
nodes; a doubted node's shards are rebuilt from parity) into a staging buffer while
``on_rank`` runs. ``Loader.load`` uses them when the round's plan loads that step from RAM
(``peer`` or ``copy``): the bytes are checked against the manifest's checksums before any is
written, and applied. Any other plan, a read that failed or bytes that do not check, and the
buffer is dropped and the plan read as usual: the read ahead can cost time, never state.

The buffer is the rank's snapshot size in host memory for as long as the read and the apply
take; ranks larger than ``prefetch_max_gib`` (a tunable) are not read ahead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from memsnap.records import RankPlan, RankSource

if TYPE_CHECKING:
    from memsnap.coding.receive import Peers
    from memsnap.rank.client import AgentClient

log = logging.getLogger("memsnap")


@dataclass
class Staged:
    """Rank ``source.rank``'s bytes of ``source.step``, read from the peers: ``manifest`` (JSON)
    describes ``buf``; ``seconds``: from the start of the read until the bytes were in."""

    source: RankSource
    manifest: str
    buf: Any
    seconds: float
    stats: dict = field(default_factory=dict)

    def serves(self, plan: RankPlan) -> bool:
        """Whether ``plan`` loads these bytes: the same step of the same rank, from RAM."""
        return plan.tier in ("peer", "copy") and plan.step == self.source.step and plan.source is not None


class Prefetch:
    """The read of ``client.rank``'s newest committed bytes, on a thread of its own from
    construction on. ``peers()``: a data-plane client and codec for this read alone (closed
    when it ends: the rank's own reads never share it)."""

    def __init__(self, client: AgentClient, peers: Callable[[], Peers], max_bytes: int):
        self._client, self._peers, self._max_bytes = client, peers, max_bytes
        self._staged: Staged | None = None
        self.skipped: str | None = None  # why nothing was read ahead (no step, too large, an error)
        self._thread = threading.Thread(target=self._read, name="memsnap-prefetch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        from memsnap.coding.restore import gather

        t = time.perf_counter()
        peers = None
        try:
            source = self._client.newest_source()
            if source is None:
                self.skipped = "no committed step of this world size"
                return
            if source.nbytes > self._max_bytes:
                self.skipped = f"{source.nbytes} bytes: over prefetch_max_gib"
                return
            manifest = self._client.manifest(source.step, self._client.rank, source)
            buf = np.empty(source.nbytes, dtype=np.uint8)  # (no memset: every byte is received)
            peers = self._peers()
            stats = gather(peers, source, buf)
            self._staged = Staged(source, manifest, buf, time.perf_counter() - t, stats)
        except Exception as exc:  # the plan is read as usual
            self.skipped = f"{type(exc).__name__}: {exc}"
            log.warning("rank %d: the read ahead of the restore failed: %s", self._client.rank, exc)
        finally:
            if peers is not None:
                peers.transport.close()

    @property
    def reading(self) -> bool:
        return self._thread.is_alive()

    def result(self, timeout: float) -> Staged | None:
        """The staged bytes once the read ended (None: nothing staged, or still reading after
        ``timeout`` seconds; then they are never used)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.skipped = f"still reading after {timeout:.0f} s"
            return None
        staged, self._staged = self._staged, None
        return staged
