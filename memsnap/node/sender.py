"""Sending one snapshot of a node: tensor checksums, stripes, parity a batch at a time,
shard ``j`` of every stripe pushed to holder ``j``, the ranks' manifests handed to the
holders with the chunks, and the node's ``NodeReady`` report to the coordinator.

One snapshot is sent at a time (one parity scratch buffer); the node's holders (and their
addresses) is cached until the placement changes or a send fails. A snapshot the job gives
up while it is sent (a restore plan rolls the job back below it, a node is lost) stops at its
next chunk, and so do the pushes of a snapshot one of whose pushes failed: the data plane is
the restore's, not a step's that will never commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import xxhash

from memsnap import metrics
from memsnap.coding import encode
from memsnap.config import tunable
from memsnap.errors import CommitError, PushCancelled, StepGivenUp, TransportError
from memsnap.memory.arena import OwnedBuffer
from memsnap.node.versions import Version
from memsnap.records import Holders, NodeReady, Region
from memsnap.state.checksum import fill_checksums
from memsnap.state.manifest import Manifest

log = logging.getLogger("memsnap.agent")


class Throughput:
    """The send pipeline's measured rate over its last few snapshots (for the busy warning)."""

    def __init__(self, window: int = 8):
        self.sends: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, nbytes: int, seconds: float) -> None:
        self.sends.append((nbytes, max(seconds, 1e-6)))

    def describe(self) -> tuple[str, str]:
        if not self.sends:
            return "nothing yet (no snapshot sent)", "? s"
        nbytes = sum(b for b, _ in self.sends)
        seconds = sum(s for _, s in self.sends)
        return f"{nbytes / seconds / 2**20:.0f} MiB/s", f"{seconds / len(self.sends):.2f} s"


class Sender:
    """One snapshot of the node out at a time. What it uses, and nothing else:

    - ``node``, ``cfg``: this node and the job's configuration;
    - ``lock``: the agent's lock, under which ``versions`` (the version table: a version goes
      queued -> sending -> ready, or failed) and ``infos`` (this node's ``NodeReady`` by
      step, written once a send is acknowledged) change;
    - ``slots``: the arenas the ranks captured into (read), whose pages it gives back when
      the slot policy says so (``Slots.release``);
    - ``transport``, ``codec``: the data plane and the Reed-Solomon code (None when m=0);
      ``budget``: charged for the parity scratch; ``counters``: ``pushed_bytes``;
    - ``call(method, *args)`` and ``tell(method, *args)``: the coordinator, waited for, or
      logged when it fails; ``call_all(nodes, method, *args, timeout)``: the holders' agents;
    - ``world()``: the job's world size as this node knows it (None before it joined)."""

    def __init__(
        self,
        *,
        node: str,
        cfg,
        lock,
        versions,
        slots,
        transport,
        codec,
        budget,
        counters: dict,
        infos: dict,
        call: Callable,
        tell: Callable,
        call_all: Callable,
        world: Callable[[], int | None],
    ):
        self.node, self.cfg, self.agent_lock, self.versions, self.slots = node, cfg, lock, versions, slots
        self.transport, self.codec, self.budget, self.counters, self.infos = transport, codec, budget, counters, infos
        self.call, self.tell, self.call_all, self.world = call, tell, call_all, world
        self.lock = threading.Lock()  # one snapshot is encoded and sent at a time
        self.parity: OwnedBuffer | None = None
        self.holders: Holders | None = None  # this node's holders and addresses, until the placement changes
        self.throughput = Throughput()

    def send(self, v: Version, local_ranks: list[int]) -> None:
        """Send ``v`` (queued: every local rank captured) and report it; never raises."""
        try:
            with self.lock:
                with self.agent_lock:
                    if not self.versions.sending(v):
                        return  # replaced by a newer capture while it waited
                t = time.monotonic()
                info = self._encode_and_push(v, local_ranks)
                self.throughput.add(sum(v.sizes[r] for r in local_ranks), time.monotonic() - t)
                metrics.sent(self.cfg.job, self.node, time.monotonic() - t)
        except StepGivenUp as exc:  # the job gave the step up before this node heard so
            log.info("node %s: step %d not sent: %s", self.node[:12], v.step, exc)
            with self.agent_lock:
                self.versions.given_up(v, str(exc))
            return
        except PushCancelled as exc:  # given up here while it was sent: its pushes stopped
            log.info("node %s: step %d given up while it was sent: %s", self.node[:12], v.step, exc)
            return
        except Exception as exc:  # reported, never raised into the pool
            with self.agent_lock:
                self.holders = None  # a holder may be gone: ask for them again
                if not self.versions.held(v):
                    return  # the job gave it up (or resumed below it) while it was sent: no news
                log.warning("node %s: step %d not sent: %s", self.node[:12], v.step, exc)
                self.versions.failed(v, f"{type(exc).__name__}: {exc}")
            self.tell("node_failed", v.step, self.node, v.error)
            return
        with self.agent_lock:
            if not self.versions.sent(v):
                return  # given up while it was sent
            self.infos[v.step] = info
            if self.versions.policy.releases_when_sent:
                self.slots.release(v)
        self.call("node_ready", info.to_wire())

    def _holders(self) -> Holders:
        holders = self.holders
        if holders is None:
            holders = self.holders = Holders.from_wire(self.call("node_holders", self.node))
        return holders

    def _encode_and_push(self, v: Version, local_ranks: list[int]) -> NodeReady:
        cfg = self.cfg
        holders = self._holders()
        sizes = {r: v.sizes[r] for r in local_ranks}
        chunk = cfg.chunk or _choose_chunk(max(sizes.values(), default=0), cfg.k)
        regs = encode.regions(sizes, cfg.k, chunk)
        encs, digest = [], xxhash.xxh3_64()
        for reg in regs:
            if not self.versions.held(v):
                raise PushCancelled(f"step {v.step} was given up before its rank {reg.rank} was checksummed")
            data = self.slots.arenas[(reg.rank, v.slot)].view(0, reg.nbytes)
            man = fill_checksums(Manifest.from_json(v.manifests[reg.rank]), data)
            self.versions.checksummed(v, reg.rank, man.to_json().decode())
            digest.update(v.manifests[reg.rank].encode())
            encs.append(encode.Encoded(reg, data))
        info = NodeReady(
            v.step,
            self.node,
            v.gen,
            chunk,
            tuple(Region(r.rank, r.nbytes, r.stripe_base) for r in regs),
            holders.holders,
            digest.hexdigest(),
            self.world() or 0,
        )
        if holders.holders:  # without peers the local copy (and the spill) is all there is
            self._push_all(v, encs, holders.addrs, chunk, holders.holders)
            self._hand_manifests(info, {r: v.manifests[r] for r in local_ranks})
        return info

    def _hand_manifests(self, info: NodeReady, manifests: dict[int, str]) -> None:
        """The ranks' manifests go to every holder with the chunks (a restore on another node
        reads them there); a holder that does not take them fails the step like a lost push."""
        got = self.call_all(
            info.holders,
            "hold_manifests",
            info.step,
            self.node,
            info.to_wire(),
            manifests,
            timeout=tunable("call_timeout_s"),
        )
        missing = sorted(set(info.holders) - set(got))
        if missing:
            raise CommitError(f"step {info.step}: holders {[h[:12] for h in missing]} did not take the manifests")

    def _push_all(self, v: Version, encs: list, addrs: Sequence[dict], chunk: int, holders: Sequence[str]) -> None:
        """Data shards stream to their holders straight from the arenas while parity is encoded
        a batch of stripes at a time into two halves of a small scratch buffer: a half is
        reused once the pushes of the batch it held are acknowledged. Every push stops at its
        next chunk once ``v`` is given up here or another push failed (that failure is raised;
        ``PushCancelled`` when nothing failed but ``v`` was given up)."""
        k, m, step = self.cfg.k, self.cfg.m, v.step
        timeout = tunable("push_timeout_s")
        failed = threading.Event()

        def called_off() -> bool:  # (``held``: one read of the version table, no lock needed)
            return failed.is_set() or not self.versions.held(v)

        def push(j: int, items: list) -> None:
            try:
                self.transport.push(addrs[j], items, timeout=timeout, cancel=called_off)
            except PushCancelled:
                raise
            except TransportError as exc:
                failed.set()
                if isinstance(exc.__cause__, ConnectionError):
                    # refused or reset: the holder's process is gone; its node is asked at once
                    self.tell("suspect", holders[j], f"a push to it failed: {exc.__cause__!r}")
                raise
            except BaseException:
                failed.set()
                raise
            self.counters["pushed_bytes"] += sum(len(mv) for _, mv in items)

        total = sum(enc.lay.stripes for enc in encs)
        per = max(1, min(total, int(tunable("parity_window")) // max(1, m * chunk)))
        with ThreadPoolExecutor(max_workers=k + 2 * m) as ex:
            futures = [
                ex.submit(push, j, [it for enc in encs for it in enc.items(step, self.node, j)]) for j in range(k)
            ]
            if m:
                scratch = self._parity(min(2, -(-total // per)) * per * m * chunk)
                halves: list[list[Future]] = [[], []]
                for b, members in enumerate(encode.batches(encs, per)):
                    wait(halves[b % 2])  # the half is reused once its pushes ended
                    if called_off():
                        break
                    half = scratch.view((b % 2) * per * m * chunk, len(members) * m * chunk)
                    batch = encode.ParityBatch(members, m, chunk, half)
                    batch.encode(self.codec)
                    halves[b % 2] = [ex.submit(push, j, batch.items(step, self.node, j)) for j in range(k, k + m)]
                futures += halves[0] + halves[1]
            wait(futures)
        errors = [exc for fut in futures if (exc := fut.exception()) is not None]
        real = [exc for exc in errors if not isinstance(exc, PushCancelled)]
        if real:
            raise real[0]
        if errors or called_off():
            raise PushCancelled(f"step {step} was given up while it was sent")

    def _parity(self, nbytes: int) -> OwnedBuffer:
        """The node's parity scratch (reused by every snapshot), grown when needed."""
        if self.parity is None or self.parity.nbytes < nbytes:
            if self.parity is not None:
                self.parity.free()
            self.parity = OwnedBuffer(self.budget, nbytes, "the parity scratch buffer")
        return self.parity

    def parity_bytes(self) -> int:
        return 0 if self.parity is None else max(self.parity.nbytes, 0)


def _choose_chunk(nbytes: int, k: int) -> int:
    from memsnap.coding.stripes import choose_chunk

    return choose_chunk(nbytes, k, int(tunable("chunk_target")))
