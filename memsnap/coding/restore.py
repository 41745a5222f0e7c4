"""Restore: reading a rank's bytes back from its peers (the decision is ``coverage.decide``).

``gather`` (run by the restoring rank itself, or by the agent on its node) fetches each
stripe's data shards straight to where they land (the rank's live tensors, or the agent's
arena: see landing.py), fetches parity only for stripes that lost a shard (holder gone,
chunk missing, or checksum failed), decodes those, and pushes repaired chunks back to
holders that answered with a bad one. ``rebuild_shard`` re-creates the shard a lost holder
had, for re-protection.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from memsnap.coding import encode
from memsnap.coding.buffers import Scatter
from memsnap.coding.landing import Flat
from memsnap.coding.stripes import ChunkKey, stripes_of
from memsnap.config import tunable
from memsnap.errors import TooFewShardsError, TransportError
from memsnap.records import NodeReady, RankSource

log = logging.getLogger("memsnap.restore")


# --- reading from peers (agent) ----------------------------------------------------------------
class _Stripes:
    """Per-stripe shard buffers of one region while it is gathered."""

    def __init__(self, region: encode.StripedRegion, m: int, out):
        self.region, self.lay, self.out = region, region.layout, out
        self.n = region.stripes
        self.shards: list[list[memoryview | None]] = [[None] * (region.k + m) for _ in range(self.n)]
        self.in_place: list[set[int]] = [set() for _ in range(self.n)]

    def dest(self, s: int, j: int):
        """Where shard ``j`` of stripe ``s`` is fetched to: its place in ``out`` when it is a
        whole data shard, else a scratch chunk (parity, the clipped last stripe)."""
        chunk = self.region.chunk
        if j < self.region.k:
            a, b = self.lay.data_range(s, j)
            if b - a == chunk:
                self.in_place[s].add(j)
                return self.out.view(a, b)
        return memoryview(bytearray(chunk))

    def contiguous(self, s: int) -> list:
        """Stripe ``s``'s shards as whole buffers, for the codec (a scatter is joined)."""
        return [x.joined() if isinstance(x, Scatter) else x for x in self.shards[s]]

    def missing(self, stripes) -> list[int]:
        k = self.region.k
        return [s for s in stripes if any(x is None for x in self.shards[s][:k])]


def _fetch(core, addr: dict | None, items: list) -> list[bool] | None:
    """``transport.fetch`` that answers None when the holder cannot be reached."""
    if addr is None or not items:
        return None if addr is None else []
    try:
        return core.transport.fetch(addr, items, timeout=tunable("push_timeout_s"))
    except TransportError as exc:
        log.warning("holder %s unreachable: %s", addr, exc)
        return None


def _fetch_shard(core, st: _Stripes, key_of, j: int, addr: dict | None, stripes: list[int]) -> list[int]:
    """Fetch shard ``j`` of ``stripes``; return the stripes whose holder answered without it."""
    items = [(key_of(s, j), st.dest(s, j)) for s in stripes]
    ok = _fetch(core, addr, items)
    bad = []
    for (_key, buf), s, good in zip(items, stripes, ok or [False] * len(items)):
        if good:
            st.shards[s][j] = buf
        else:
            st.in_place[s].discard(j)
            if ok is not None:
                bad.append(s)
    return bad


def gather(core, src: RankSource, out, stripes=None) -> dict:
    """Fill ``out`` (a buffer, or a ``landing.Spans``) with the rank's bytes ``src`` names,
    from the holders; return counters (``decoded``: the byte ranges rebuilt from parity).
    ``stripes``: read only these stripes of the rank's region (a partial read), else all.

    ``core`` needs ``transport`` (a client is enough) and ``codec``."""
    k, m = src.k, src.m
    region = encode.StripedRegion.of(src)
    st = _Stripes(region, m, out if hasattr(out, "write") else Flat(out))
    owner, base = src.owner, region.stripe_base
    addrs = list(src.addrs) + [None] * (k + m - len(src.addrs))  # (none without peers: the copy is all)

    def key_of(s: int, j: int) -> ChunkKey:
        return ChunkKey(src.step, owner, base + s, j)

    everything = list(range(st.n)) if stripes is None else sorted(set(stripes))
    if src.copy is not None:  # the owner's node holds the whole copy: every data shard from there
        with ThreadPoolExecutor(max_workers=max(1, k)) as ex:
            list(ex.map(lambda j: _fetch_shard(core, st, key_of, j, src.copy, everything), range(k)))
    with ThreadPoolExecutor(max_workers=max(1, k)) as ex:  # (what the copy did not give) from the holders
        bad = list(
            ex.map(
                lambda j: _fetch_shard(
                    core, st, key_of, j, addrs[j], [s for s in everything if st.shards[s][j] is None]
                ),
                range(k),
            )
        )
    lost = st.missing(everything)
    if lost:
        with ThreadPoolExecutor(max_workers=max(1, m)) as ex:
            list(ex.map(lambda j: _fetch_shard(core, st, key_of, j, addrs[j], lost), range(k, k + m)))
    decoded, lost_set = [], set(lost)
    for s in everything:
        shards = st.shards[s]
        if sum(x is not None for x in shards) < k:
            raise TooFewShardsError(
                f"step {src.step}, owner {owner[:12]}, stripe {base + s}: only "
                f"{sum(x is not None for x in shards)} of k={k} shards could be read from the holders"
            )
        if all(x is not None for x in shards[:k]) and len(st.in_place[s]) == k:
            continue  # every data shard already sits where it belongs
        data = encode.reconstruct_data(core.codec, st.contiguous(s), k)
        st.shards[s][:k] = data
        encode.write_stripe(st.out, st.lay, s, data, frozenset(st.in_place[s]))
        if s in lost_set:
            decoded.append((st.lay.data_range(s, 0)[0], st.lay.data_range(s, k - 1)[1]))
    repaired = _repair(core, st, key_of, bad, addrs)
    if src.copy is not None:  # read from the owner's arena, not from what it sent: check it all
        decoded = [(0, region.nbytes)]
    return {
        "stripes": len(everything),
        "decoded_stripes": len(lost),
        "repaired": repaired,
        "bytes": sum(st.lay.data_range(s, k - 1)[1] - st.lay.data_range(s, 0)[0] for s in everything),
        "decoded": decoded,
    }


def _repair(core, st: _Stripes, key_of, bad: list[list[int]], addrs: list) -> int:
    """Push rebuilt data shards back to holders that answered without them (corrupt or lost)."""
    n = 0
    for j, stripes in enumerate(bad):
        items = [(key_of(s, j), _padded(st.shards[s][j], st.region.chunk)) for s in stripes]
        if not items:
            continue
        try:
            core.transport.push(addrs[j], items, timeout=tunable("push_timeout_s"))
            n += len(items)
            log.warning("repaired %d chunk(s) of shard %d on its holder", len(items), j)
        except TransportError as exc:
            log.warning("could not repair shard %d: %s", j, exc)
    return n


def _padded(buf, chunk: int) -> memoryview:
    mv = memoryview(buf).cast("B")
    if len(mv) == chunk:
        return mv
    out = bytearray(chunk)
    out[: len(mv)] = mv
    return memoryview(out)


# --- re-protection (agent on the replacement node) ----------------------------------------
def rebuild_shard(core, step: int, k: int, m: int, info: NodeReady, addrs: dict, shard: int, batch: int = 64) -> int:
    """Recreate shard ``shard`` of every stripe of owner ``info.node`` from its other holders
    (at ``addrs``) and hold it here: re-protection on a new holder. ``core`` needs ``node``,
    ``store``, ``transport`` and ``codec`` (the agent's ``repair.Repair``)."""
    owner, chunk, total, holders = info.node, info.chunk, stripes_of(info.regions, k, info.chunk), info.holders
    sources = [j for j in range(k + m) if j != shard and holders[j] != core.node]
    n = 0
    for start in range(0, total, batch):
        stripes = list(range(start, min(total, start + batch)))
        got: dict[int, list[memoryview | None]] = {s: [None] * (k + m) for s in stripes}
        for j in sources:
            need = [s for s in stripes if sum(x is not None for x in got[s]) < k]
            if not need:
                break
            items = [(ChunkKey(step, owner, s, j), memoryview(bytearray(chunk))) for s in need]
            ok = _fetch(core, addrs.get(holders[j]), items) or [False] * len(items)
            for (key, buf), good in zip(items, ok):
                if good:
                    got[key.stripe][j] = buf
        for s in stripes:
            full = core.codec.reconstruct(got[s]) if shard >= k or got[s][shard] is None else got[s]
            core.store.put(ChunkKey(step, owner, s, shard), full[shard])
            n += 1
    return n
