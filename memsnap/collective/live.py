"""Live takeover: where every rank holds the same state (data parallel), nobody rolls back.

A rollback to the newest committed step costs every step trained since that commit. Where
the ranks are replicas of each other, the survivors' own live state is newer and just as
good, and a replacement can take it from them (as torchft does), losing only the step in
flight. Three parts make that exact:

1. **The step boundary** (``Live.mark``, at every ``ctx.save(S)``): the state's layout and
   skeleton (step counts, a sampler's position, Python's RNG: the non-tensor values) and the
   bytes of its small tensors that no optimizer owns (RNG states, norm statistics, counters:
   under ``SMALL_BYTES`` each). Large tensors and the optimizers' own (parameters, moments,
   step counts) are not copied: between two boundaries only ``optimizer.step()`` changes them.
2. **The guard** (``Live.guard``): each optimizer of the state gets a step pre-hook that ends
   a step whose collective failed in ``PeerLost`` before the optimizer touches anything, and
   otherwise notes that the state has moved past its boundary. A member whose optimizer has
   not stepped since its boundary can put the state back to that boundary exactly
   (``Live.roll_back``): its large tensors are as they were, its small ones, skeleton and
   RNGs are put back as recorded (the partial step's draws and data-loader advance undone).
3. **The exchange** (``take_over``, the first thing ``ctx.restore`` does in a recovery): one
   all-reduce tells every member each one's boundary step and the digest (xxh3-64) of its
   state at that boundary (read in place) and of each RNG stream. ``decide`` (pure: every
   member reaches the same verdict from the same table) goes on from the newest boundary if
   at least two members hold it with one digest (``trust=True``: one is enough); they keep
   their state, and every other member (the standby, a survivor a step behind, one whose
   optimizer stepped after its boundary) receives it, a slice from each holder at once (each
   large tensor sent from the holder's own memory, uncopied, straight into the receiver's own
   tensor; the rest laid out between them), and checks it against the digests the holders
   agreed on before applying it (a refused state that was written into leaves the member
   ``dirty``: a loaded step must follow, never a fresh start). Anything else
   (ranks whose states differ: sharded, per-rank RNG or buffers; nobody clean; the world size
   changed; a member that refuses) rolls everyone back to the newest committed step, as
   before, and the verdict says why.

Nothing here is pickled: the manifest travels as its JSON, the bytes as a uint8 tensor.
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from memsnap.collective.group import PeerLost, RecoverableGroup

log = logging.getLogger("memsnap.inplace")

SMALL_BYTES = 1 << 20  # tensors below this are copied at every step boundary
DIRECT_BYTES = SMALL_BYTES  # a takeover sends a tensor this large from its own memory, uncopied
MODES = ("verified", "trusted", "off")


@dataclass(frozen=True)
class Boundary:
    """The state at a step boundary, less its large tensors (unchanged until the optimizer's
    next step): the manifest (layout and skeleton) and the small tensors' bytes by entry."""

    step: int
    manifest: Any  # memsnap.state.manifest.Manifest
    small: dict[int, bytes]
    rng: dict[str, int]  # RNG stream (python, numpy, torch, cuda) -> the digest of its state
    rng_static: frozenset[str] = frozenset()  # the streams no draw moved since the boundary before


@dataclass(frozen=True)
class Verdict:
    """What a recovery's members agreed: go on from ``step`` (None: roll back, ``why``)."""

    step: int | None
    holders: tuple[int, ...] = ()  # the ranks that hold it (they send it)
    receivers: tuple[int, ...] = ()  # the ranks that take it
    digest: int = 0  # the holders' ``state_digest`` (the state less its RNG streams)
    nbytes: int = 0
    own_rng: tuple[str, ...] = ()  # RNG streams that differ across ranks, unused: each keeps its own
    rng: tuple[int, ...] = ()  # the holders' digest of each RNG stream (``STREAMS``)
    why: str = ""


def optimizers(state: Mapping[str, Any]) -> list:
    """The ``torch.optim.Optimizer`` values of ``state`` (top level)."""
    import torch

    return [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]


def optimizer_tensors(state: Mapping[str, Any]) -> set[tuple[int, int]]:
    """Where the tensors the optimizers of ``state`` own live (their parameters and their
    state: moments, step counts): only ``optimizer.step()``, which the guard watches, changes
    them, so the boundary need not copy them, however small. A model of 1,400 tensors under
    1 MiB each would otherwise be copied whole at every save."""
    import torch

    out: set[tuple[int, int]] = set()
    for opt in optimizers(state):
        for group in opt.param_groups:
            out.update(_where(p) for p in group["params"])
        for per_param in opt.state.values():
            out.update(_where(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return out


def _where(t) -> tuple[int, int]:
    """A tensor's memory (first byte, size): a state_dict's detached views of a parameter are
    other tensor objects over the same bytes."""
    return (t.data_ptr(), t.numel() * t.element_size())


class Live:
    """One member's step boundary and guard (``Member`` holds one for its whole life)."""

    def __init__(self, group: RecoverableGroup, mode: str = "verified"):
        if mode not in MODES:
            from memsnap.errors import ConfigError

            raise ConfigError(f"live_takeover={mode!r}: must be one of {list(MODES)}")
        from memsnap.state.capture import PlanCache

        self.group, self.mode = group, mode
        self.cache = PlanCache()
        self.boundary: Boundary | None = None
        self.moved = False  # the optimizer stepped since the boundary
        self.unguarded = "no optimizer in the state"  # why the state cannot be trusted (or "")
        self._hooked: set[int] = set()
        self.refuse: str | None = None  # set when a takeover's bytes arrived damaged: roll back
        # a refused takeover had written into the live tensors: only a loaded step may follow
        self.dirty = False

    # --- the guard ------------------------------------------------------------------------------
    def guard(self, state: Mapping[str, Any]) -> None:
        """A step pre-hook on each optimizer of ``state`` (once per optimizer)."""
        opts = optimizers(state)
        for opt in opts:
            if id(opt) not in self._hooked:
                self._hooked.add(id(opt))
                opt.register_step_pre_hook(self._pre_step)
        if opts:
            self.unguarded = ""

    def _pre_step(self, optimizer, args, kwargs):
        why = self.group.failure()
        if why is not None:  # its gradients were not averaged: the step never happens
            gen = self.group.gen
            raise PeerLost(f"generation {gen} is over: {why}", -1 if gen is None else gen)
        self.moved = True
        return None

    # --- the boundary -------------------------------------------------------------------------
    def mark(self, step: int, state: Mapping[str, Any]) -> None:
        """``ctx.save(step)`` (or a restore of ``step``): the state is at the end of ``step``.
        Never raises: a state it cannot record only leaves this member out of the next
        takeover (the snapshot of the same state reports its own error)."""
        if self.mode == "off":
            return
        try:
            self._mark(step, state)
        except Exception as exc:
            self.boundary = None
            if not getattr(self, "_warned", False):
                self._warned = True
                log.warning(
                    "step %d: no step boundary recorded (%s: %s): no live takeover from here",
                    step,
                    type(exc).__name__,
                    exc,
                )

    def _mark(self, step: int, state: Mapping[str, Any]) -> None:
        from memsnap.state.capture import tensor_bytes

        self.guard(state)
        manifest, sources = self.cache.plan(state)
        owned = optimizer_tensors(state)
        small = {}
        for i, (e, src) in enumerate(zip(manifest.tensors, sources)):
            if e.alias_of is None and 0 < e.nbytes < SMALL_BYTES and _where(src) not in owned:
                t = src.detach().cpu().contiguous()
                small[i] = bytes(tensor_bytes(t, e.nbytes))
        streams = rng_digests(manifest, small)
        last = self.boundary.rng if self.boundary is not None else {}
        static = frozenset(k for k, d in streams.items() if last.get(k) == d)
        self.boundary = Boundary(step, manifest, small, streams, static)
        self.moved = False

    def clean_step(self) -> int | None:
        """The boundary this member can rebuild, or None (none yet, or moved past it)."""
        if self.boundary is None or self.moved or self.unguarded:
            return None
        return self.boundary.step

    def sources(self, state: Mapping[str, Any]) -> list | None:
        """The live tensors in the boundary's layout (``clean_step`` not None), or None when
        the layout changed since the boundary (nothing to go on from)."""
        b = self.boundary
        assert b is not None
        now, sources = self.cache.plan(state)
        if [(e.path, e.nbytes) for e in now.tensors] != [(e.path, e.nbytes) for e in b.manifest.tensors]:
            return None
        return sources

    def roll_back(self, state: Mapping[str, Any], sources: list) -> None:
        """Put ``state`` back to the boundary: its small tensors, its skeleton values and its
        RNGs as recorded; its large tensors are already what they were (nothing is copied)."""
        from memsnap.state.apply import apply_received
        from memsnap.state.apply import plan as plan_apply

        b = self.boundary
        assert b is not None
        received, live = {}, set()
        for i, e in enumerate(b.manifest.tensors):
            if e.alias_of is not None or not e.nbytes:
                continue
            if i in b.small:
                received[i] = _as_tensor(e, b.small[i])
            else:
                received[i] = sources[i]
                live.add(i)
        apply_received(state, plan_apply(state, b.manifest), received, live)


def _as_tensor(e, raw):
    """A new tensor of entry ``e``'s dtype and shape holding the bytes ``raw``."""
    import torch

    from memsnap.state.dtypes import dtype_of

    if not e.nbytes:
        return torch.empty(e.shape, dtype=dtype_of(e.dtype))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype_of(e.dtype)).view(e.shape)


def entry_bytes(b: Boundary, sources: list, i: int):
    """Entry ``i``'s bytes at the boundary: recorded (small) or the live tensor's (large)."""
    from memsnap.state.capture import tensor_bytes

    if i in b.small:
        return b.small[i]
    e = b.manifest.tensors[i]
    t = sources[i].detach().cpu().contiguous()
    return tensor_bytes(t, e.nbytes), t  # (the tensor keeps the view's memory alive)


STREAMS = ("python", "numpy", "torch", "cuda")


def _is_rng(path: str) -> bool:
    from memsnap.state.capture import RNG_KEY

    return path == RNG_KEY or path.startswith(RNG_KEY + "/")


def rng_digests(manifest, small: dict[int, bytes]) -> dict[str, int]:
    """Each RNG stream's digest: its values in the skeleton and its tensors' bytes."""
    from memsnap.state.capture import RNG_KEY

    saved = manifest.tree.get(RNG_KEY, {}) if isinstance(manifest.tree, dict) else {}
    out = {}
    for k in STREAMS:
        h = xxhash.xxh3_64(json.dumps(saved.get(k), sort_keys=True, default=str).encode())
        for i, e in enumerate(manifest.tensors):
            if _in_stream(e.path, k):
                h.update(small.get(i, b""))
        out[k] = h.intdigest()
    return out


def _digest(manifest, entry: Callable[[int], Any]) -> int:
    """The state less its RNG streams: its skeleton, then each tensor's header and bytes
    (``entry(i)``). One digest for both sides, so a holder's and a receiver's can agree."""
    from memsnap.state.capture import RNG_KEY

    tree_ = manifest.tree
    rest = {k: v for k, v in tree_.items() if k != RNG_KEY} if isinstance(tree_, dict) else tree_
    h = xxhash.xxh3_64(json.dumps(rest, sort_keys=True, default=str).encode())
    for i, e in enumerate(manifest.tensors):
        if _is_rng(e.path):
            continue
        h.update(f"{e.path}:{e.dtype}:{list(e.shape)}:{e.alias_of};".encode())
        if e.nbytes:
            h.update(entry(i))
    return h.intdigest()


def state_digest(manifest, buf) -> int:
    """The digest of the state less its RNG streams (compared across ranks on their own)."""
    mv = memoryview(buf.numpy())
    es = manifest.tensors
    return _digest(manifest, lambda i: mv[es[i].offset : es[i].offset + es[i].nbytes])


def boundary_digest(b: Boundary, sources: list) -> int:
    """``state_digest`` of the state at the boundary, read in place (no copy of it is made)."""

    held: list = [None]  # the tensor behind the bytes being hashed stays alive until the next

    def entry(i: int):
        got = held[0] = entry_bytes(b, sources, i)
        return got if isinstance(got, bytes) else got[0]

    return _digest(b.manifest, entry)


class _Layout:
    """The manifest's entries in the order of their bytes, to find those in a byte range
    without a pass over every entry (a takeover lays out a range between each pair of large
    tensors: with a scan each, hundreds of scans of a thousand entries)."""

    def __init__(self, manifest):
        es = manifest.tensors
        self.order = sorted(range(len(es)), key=lambda i: (es[i].offset, es[i].offset + es[i].nbytes))
        self.starts = [es[i].offset for i in self.order]
        self.ends = [es[i].offset + es[i].nbytes for i in self.order]
        # entries only ever share bytes as aliases (the same range): then the ends rise with
        # the starts; a layout where they do not is searched whole
        self.sorted_ends = all(x <= y for x, y in zip(self.ends, self.ends[1:]))

    def within(self, lo: int, hi: int) -> list[int]:
        """The entries with bytes in ``[lo, hi)``, in the order of their bytes (and perhaps empty
        ones at its edges, or around it where it is empty itself)."""
        if not self.sorted_ends:
            return self.order
        return self.order[bisect.bisect_right(self.ends, lo) : bisect.bisect_left(self.starts, hi)]


def _slice(b: Boundary, sources: list, lo: int, hi: int, own: tuple[str, ...], layout: _Layout | None = None):
    """Bytes ``[lo, hi)`` of the state at the boundary laid out as its manifest says (padding
    and the RNG streams each rank keeps its own of: zeros)."""
    import torch

    out = torch.zeros(max(hi - lo, 1), dtype=torch.uint8)
    mv = memoryview(out.numpy())  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    for i in (layout or _Layout(b.manifest)).within(lo, hi):
        e = b.manifest.tensors[i]
        a, z = max(lo, e.offset), min(hi, e.offset + e.nbytes)
        if e.alias_of is not None or a >= z or any(_in_stream(e.path, k) for k in own):
            continue
        got = entry_bytes(b, sources, i)
        raw = got if isinstance(got, bytes) else got[0]
        mv[a - lo : z - lo] = raw[a - e.offset : z - e.offset]
    return out[: hi - lo]


def _pieces(
    manifest, lo: int, hi: int, own: tuple[str, ...], layout: _Layout | None = None
) -> list[tuple[int, int, int | None]]:
    """Bytes ``[lo, hi)`` of the layout as the messages one holder sends, in order: each
    tensor of ``DIRECT_BYTES`` or more, its part in the range (its entry's index: sent from the
    tensor's own memory, no copy), and the ranges between them (None: laid out by ``_slice``).
    Together they tile ``[lo, hi)``; both sides compute them from the manifest alone."""
    out: list[tuple[int, int, int | None]] = []
    at = lo
    for i in (layout or _Layout(manifest)).within(lo, hi):
        e = manifest.tensors[i]
        a, z = max(lo, e.offset), min(hi, e.offset + e.nbytes)
        if e.alias_of is not None or e.nbytes < DIRECT_BYTES or a >= z or a < at:
            continue
        if any(_in_stream(e.path, k) for k in own):
            continue
        if a > at:
            out.append((at, a, None))
        out.append((a, z, i))
        at = z
    if hi > at:
        out.append((at, hi, None))
    return out


def _direct(b: Boundary, sources: list, i: int, a: int, z: int, keep: list):
    """Bytes ``[a, z)`` of the layout, all inside entry ``i``: a uint8 view of its live tensor
    (``keep`` holds the tensor until the send is done), or of its recorded bytes."""
    import torch

    e = b.manifest.tensors[i]
    got = entry_bytes(b, sources, i)
    if isinstance(got, bytes):
        return torch.frombuffer(bytearray(got[a - e.offset : z - e.offset]), dtype=torch.uint8)
    raw, t = got
    keep.append(t)
    return torch.frombuffer(raw[a - e.offset : z - e.offset], dtype=torch.uint8)


def _in_stream(path: str, k: str) -> bool:
    """``path`` is a tensor of RNG stream ``k`` (``_is_rng``: of any stream)."""
    from memsnap.state.capture import RNG_KEY

    return path == f"{RNG_KEY}/{k}" or path.startswith(f"{RNG_KEY}/{k}/")


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _unsigned(s: int) -> int:
    return s + (1 << 64) if s < 0 else s


# why a member takes no part (its row's refusal column): the same text on every member
REFUSALS = {
    1: "the state of its last live takeover arrived damaged",
    2: "the world size changed",
}


ROW_WIDTH = 5 + len(STREAMS)  # the columns of a ``Row``


@dataclass(frozen=True)
class Row:
    """What one member offers: its boundary step (None: none it can rebuild), the digest of
    its state less RNG, its size, why it takes no part (0: it does), each RNG stream's digest
    and which streams stood still over its last step."""

    step: int | None
    digest: int = 0
    nbytes: int = 0
    refusal: int = 0
    rng: tuple[int, ...] = (0,) * len(STREAMS)
    static: frozenset[str] = frozenset()

    def encode(self) -> list[int]:
        mask = sum(1 << i for i, k in enumerate(STREAMS) if k in self.static)
        step = 0 if self.step is None else self.step + 1
        return [step, _signed(self.digest), self.nbytes, self.refusal, *map(_signed, self.rng), mask]

    @classmethod
    def decode(cls, v: list[int]) -> Row:
        n = len(STREAMS)
        static = frozenset(k for i, k in enumerate(STREAMS) if v[4 + n] >> i & 1)
        step = None if v[0] <= 0 else v[0] - 1
        return cls(step, _unsigned(v[1]), v[2], v[3], tuple(_unsigned(d) for d in v[4 : 4 + n]), static)


def decide(rows: list[Row], trust: bool) -> Verdict:
    """The verdict from every rank's row (the same on every rank: a pure function of them)."""
    refusing = [r for r, row in enumerate(rows) if row.refusal]
    if refusing:
        r = refusing[0]
        return Verdict(None, why=f"rank {r} takes no part: {REFUSALS.get(rows[r].refusal, 'unknown reason')}")
    steps = [row.step for row in rows if row.step is not None]
    if not steps:
        return Verdict(None, why="no rank holds a step boundary it can rebuild")
    step = max(steps)
    holders = tuple(r for r, row in enumerate(rows) if row.step == step)
    first = rows[holders[0]]
    other = next((r for r in holders if rows[r].digest != first.digest or rows[r].nbytes != first.nbytes), None)
    if other is not None:
        return Verdict(
            None, why=f"ranks {holders[0]} and {other} hold different states at step {step}: they are not replicas"
        )
    own = []
    for i, k in enumerate(STREAMS):
        other = next((r for r in holders if rows[r].rng[i] != first.rng[i]), None)
        if other is None:
            continue
        if all(k in rows[r].static for r in holders):
            own.append(k)  # per-rank and never drawn from: each rank keeps its own
            continue
        return Verdict(
            None,
            why=f"ranks {holders[0]} and {other} hold different {k} RNG states at step {step}, drawn from "
            "during the step: each rank's stream is its own, and the lost rank's cannot be rebuilt",
        )
    if len(holders) < 2 and not trust:
        return Verdict(
            None,
            why=f"only rank {holders[0]} holds step {step}: one state cannot show that the ranks are replicas "
            "(live_takeover='trusted' takes it on trust)",
        )
    receivers = tuple(r for r in range(len(rows)) if r not in holders)
    return Verdict(step, holders, receivers, first.digest, first.nbytes, tuple(own), first.rng)


def _slices(nbytes: int, n: int) -> list[tuple[int, int]]:
    per = -(-nbytes // n)
    return [(i * per, min(nbytes, (i + 1) * per)) for i in range(n) if i * per < nbytes]


@dataclass(frozen=True)
class Takeover:
    """What one rank did in a live takeover: went on from ``step``, as a holder that ``kept``
    its state or as a receiver that took the ``live`` state of ``holders`` (``nbytes``),
    keeping its own RNG streams ``own_rng``; ``phases``: seconds of digest, agree, move, apply;
    ``in_place``: of a receiver, the bytes that landed straight in its live tensors."""

    step: int
    role: str
    seconds: float
    nbytes: int
    holders: tuple[int, ...]
    own_rng: tuple[str, ...]
    phases: Mapping[str, float]
    in_place: int = 0


def take_over(
    live: Live, state: Mapping[str, Any], rank: int, world: int, resized: bool = False
) -> tuple[Takeover | None, str]:
    """(collective: every member of the generation) Go on from the newest step boundary the
    members agree on. Returns ``(what this rank did, "")`` or ``(None, why)`` to roll back.
    ``resized``: this member knows the world size changed (then nobody goes on live)."""
    import torch

    t0 = time.perf_counter()
    clock = {}  # where the seconds went: digest, agree (the all-reduce: waits for the slowest), move, apply
    group = live.group
    live.guard(state)
    step = None if resized else live.clean_step()
    sources = live.sources(state) if step is not None else None
    mine = Row(None, refusal=1 if live.refuse is not None else 2 if resized else 0)
    b = live.boundary
    if sources is not None:
        assert b is not None
        digests = tuple(b.rng[k] for k in STREAMS)
        mine = Row(b.step, boundary_digest(b, sources), b.manifest.nbytes, mine.refusal, digests, b.rng_static)
    table = torch.zeros((world, ROW_WIDTH), dtype=torch.int64)
    table[rank] = torch.tensor(mine.encode(), dtype=torch.int64)
    t = clock["digest"] = time.perf_counter() - t0
    group.all_reduce(table)
    verdict = decide([Row.decode(v) for v in table.tolist()], trust=live.mode == "trusted")
    clock["agree"] = time.perf_counter() - t0 - t
    if verdict.step is None:
        return None, verdict.why
    t = time.perf_counter()
    in_place = 0
    if rank in verdict.holders:
        assert b is not None and sources is not None
        live.roll_back(state, sources)  # the small state and the RNGs, as at the boundary
        clock["apply"] = time.perf_counter() - t
        _send(group, verdict, rank, b, sources)
        clock["move"] = time.perf_counter() - t - clock["apply"]
        role = "kept"
    else:
        in_place = _receive(live, verdict, state, clock, t)
        live.refuse, live.dirty = None, False
        live.mark(verdict.step, state)  # its state is the boundary now: it may hold it next time
        clock["apply"] = time.perf_counter() - t - clock["move"]
        role = "live"
    return Takeover(
        verdict.step,
        role,
        time.perf_counter() - t0,
        verdict.nbytes,
        tuple(verdict.holders),
        tuple(verdict.own_rng),
        {k: round(v, 4) for k, v in clock.items()},
        in_place,
    ), ""


def _send(group: RecoverableGroup, verdict: Verdict, rank: int, b: Boundary, sources: list) -> None:
    """A holder's part: the first sends the manifest, each holder its slice of the bytes (laid
    out from the live tensors and the recorded small ones), to every receiver."""
    import torch

    if not verdict.receivers:
        return
    j = verdict.holders.index(rank)
    if j == 0:
        mjson = b.manifest.to_json()
        head = torch.tensor([len(mjson)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(mjson), dtype=torch.uint8)
        group.exchange([(t, r) for r in verdict.receivers for t in (head, body)], [])
    cuts = _slices(verdict.nbytes, len(verdict.holders))
    if j < len(cuts):
        keep: list = []  # the live tensors behind the views being sent
        layout = _Layout(b.manifest)
        parts = [
            _slice(b, sources, a, z, verdict.own_rng, layout) if i is None else _direct(b, sources, i, a, z, keep)
            for a, z, i in _pieces(b.manifest, *cuts[j], verdict.own_rng, layout)
        ]
        group.exchange([(part, r) for part in parts for r in verdict.receivers], [])
        del keep


def _receive(live: Live, verdict: Verdict, state: Mapping[str, Any], clock: dict, t: float) -> int:
    """A receiver's part: the manifest from the first holder, then a slice from each, each
    piece landing where it belongs: a large tensor's bytes straight in the live tensor (or
    a new one, where the live state lacks it, as for optimizer moments before the first
    step), the small ones between them in a buffer of their own and copied out. Checked
    against what the holders agreed on (the state's digest and each RNG stream's) before
    anything is applied; the bytes received in place (returned) need no copy at all.

    A state the snapshot does not match is received into buffers (the holders' sends must
    complete) and refused (``StateMismatchError``) with nothing written."""
    import torch

    from memsnap.errors import StateMismatchError
    from memsnap.state import apply as apply_mod
    from memsnap.state.manifest import Manifest

    group, first = live.group, verdict.holders[0]
    head = torch.zeros(1, dtype=torch.int64)
    group.recv(head, first)
    body = torch.empty(int(head[0]), dtype=torch.uint8)
    group.recv(body, first)
    manifest = Manifest.from_json(bytes(body.numpy()), what="live takeover manifest")
    try:
        pl = apply_mod.plan(state, manifest, rng=False)
    except StateMismatchError:  # the holders' sends complete first, then the state is refused
        group.exchange([], _Landing(manifest, {}, verdict).targets())
        raise
    received, in_place = apply_mod.destinations(pl)
    landing = _Landing(manifest, received, verdict)
    group.exchange([], landing.targets())
    landing.scatter()
    why = _check(manifest, landing, verdict)
    if why is not None:
        live.refuse = why
        live.dirty = live.dirty or bool(in_place)  # its live tensors took bytes that were refused
        group.fail(f"a live takeover's state arrived damaged: {why}")
        raise PeerLost(f"generation {group.gen}: {why}", -1 if group.gen is None else group.gen)
    clock["move"] = time.perf_counter() - t
    apply_mod.apply_received(state, pl, received, in_place)
    _take_rng(manifest, landing, verdict.own_rng)
    clock["apply"] = time.perf_counter() - t - clock["move"]
    return sum(manifest.tensors[i].nbytes for i in in_place)


class _Landing:
    """Where each piece of a receiver's bytes lands. ``received``: the tensor each stored entry
    is received into (``state.apply.destinations``); a piece of one large entry goes into
    its tensor's own bytes, every other piece (the small entries between large ones, RNG
    states, padding) into a buffer of its own, copied into its entries' tensors afterwards."""

    def __init__(self, manifest, received: dict, verdict: Verdict):
        self.manifest, self.received = manifest, received
        self.layout = _Layout(manifest)
        cuts = _slices(verdict.nbytes, len(verdict.holders))
        self.pieces = [
            (a, z, verdict.holders[j], i)
            for j, cut in enumerate(cuts)
            for a, z, i in _pieces(manifest, *cut, verdict.own_rng, self.layout)
        ]
        self.staged: list[tuple[int, int, Any]] = []  # (lo, hi, uint8 tensor) of the buffered pieces

    def _bytes(self, i: int) -> memoryview:
        from memsnap.state.capture import tensor_bytes

        return tensor_bytes(self.received[i], self.manifest.tensors[i].nbytes)

    def targets(self) -> list:
        """``(uint8 tensor, holder)`` for every piece, in the order the holders send them."""
        import torch

        out = []
        for a, z, holder, i in self.pieces:
            if i is not None and i in self.received:
                off = self.manifest.tensors[i].offset
                out.append((torch.frombuffer(self._bytes(i)[a - off : z - off], dtype=torch.uint8), holder))
            else:
                buf = torch.empty(z - a, dtype=torch.uint8)
                self.staged.append((a, z, buf))
                out.append((buf, holder))
        return out

    def scatter(self) -> None:
        """The buffered pieces' bytes into the tensors of the entries they hold."""
        for a, z, buf in self.staged:
            mv = memoryview(buf.numpy())
            for i in self.layout.within(a, z):
                e = self.manifest.tensors[i]
                lo, hi = max(a, e.offset), min(z, e.offset + e.nbytes)
                if i in self.received and lo < hi:
                    self._bytes(i)[lo - e.offset : hi - e.offset] = mv[lo - a : hi - a]

    def entry(self, i: int):
        """Entry ``i``'s bytes as received (``received`` never holds an alias: it has none)."""
        if i in self.received:
            return self._bytes(i)
        e = self.manifest.tensors[i]
        return self.read(e.offset, e.offset + e.nbytes)

    def read(self, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of the layout, from the tensors and buffers they landed in."""
        out = bytearray(hi - lo)
        for a, z, buf in self.staged:
            if a < hi and lo < z:
                out[max(a, lo) - lo : min(z, hi) - lo] = memoryview(buf.numpy())[max(a, lo) - a : min(z, hi) - a]
        for i in self.layout.within(lo, hi):
            e = self.manifest.tensors[i]
            a, z = max(lo, e.offset), min(hi, e.offset + e.nbytes)
            if i in self.received and a < z:
                out[a - lo : z - lo] = self._bytes(i)[a - e.offset : z - e.offset]
        return bytes(out)


def _check(manifest, landing: _Landing, verdict: Verdict) -> str | None:
    """Why the received state is not what the holders agreed on, or None."""
    if manifest.nbytes != verdict.nbytes:
        return f"step {verdict.step} arrived as {manifest.nbytes} bytes, not {verdict.nbytes}"
    got = _digest(manifest, landing.entry)
    if got != verdict.digest:
        return f"step {verdict.step} arrived with digest {got:016x}, not {verdict.digest:016x}"
    small = {i: bytes(landing.entry(i)) for i, e in enumerate(manifest.tensors) if _is_rng(e.path)}
    streams = rng_digests(manifest, small)
    for k, want in zip(STREAMS, verdict.rng):
        if k not in verdict.own_rng and streams[k] != want:
            return f"step {verdict.step} arrived with another {k} RNG state than its holders'"
    return None


def _take_rng(manifest, landing: _Landing, own: tuple[str, ...]) -> None:
    """The holders' RNG streams, but those each rank keeps its own of."""
    from memsnap.state import rng as rng_state
    from memsnap.state.apply import rng_of_entries

    saved = rng_of_entries(manifest, lambda i: _as_tensor(manifest.tensors[i], landing.entry(i)))
    if saved is None:
        return
    merged = rng_state.get_state()
    for k in STREAMS:
        if k not in own and k in saved:
            merged[k] = saved[k]
    rng_state.set_state(merged)
