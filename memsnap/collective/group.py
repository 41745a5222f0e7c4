"""A process group that can be re-formed in the same processes after a peer is lost.

Every membership change is a *generation*: a new torch.distributed group on its own prefix
(``memsnap/<job>/pg/<gen>``) of one rendezvous store that outlives every rank (the
controller's, never a rank's). A collective that fails on one rank is told to every rank of
its generation at once through a ``failed`` key, so nobody waits out the backend's timeout:

  1. [every member]  ``configure(gen, rank, world)``: the old group, if any, is let go (kept
     alive in a graveyard until its abandoned work completes: dropping a gloo group with work
     in flight blocks the dropping thread until that work times out), and the new group is
     formed on the generation's prefix. The new group is the default group (``dist.*`` calls
     and DDP built after this use it).
  2. [every member]  ``all_reduce(tensor)`` / ``average_gradients(params)`` (and, for FSDP2,
     ``all_gather_single`` / ``reduce_scatter_single``; ``send`` / ``recv`` / ``exchange``
     for a live takeover's state): the collective is
     started asynchronously and waited for together with the generation's ``failed`` key.
     A failure on this rank publishes the key and raises ``PeerLost``; a failure published by
     another rank (or by the controller, which watches heartbeats) abandons the collective
     and raises ``PeerLost`` too. Tensors handed to an abandoned collective may still be
     written by it until the backend's timeout: callers must not reuse them (the gradient
     buckets of ``average_gradients`` are fresh per call).
  3. [the controller]  ``publish_failure(store, job, gen, why)`` for a loss it noticed
     itself (a rank that stopped beating, a dead actor).

The store keys are this module's alone; the controller writes the membership of each
generation under ``memsnap/<job>/gen``.

A generation that ends is cut at once on gloo: each member shuts down the TCP connections of
its group (found when it was formed: the sockets it opened, that end at a member's gloo
listener). Left open, an abandoned ring goes on between the survivors: one member's part
arrives at a member whose own part already failed, nobody posts a buffer for it, and gloo's
event loop wakes for the unread bytes without end (a whole core, until the backend's timeout
ends the abandoned work). Cut, every pair sees its peer go, the abandoned work fails at once
and the old group can be let go at the next generation.

NCCL (``backend="nccl"``): a communicator with a dead peer must never be destroyed (the
destroy waits on the dead peer's part) and its watchdog must not tear down the survivors'
processes. So a member's process runs with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (memsnap
handles a failed collective itself), its communicators are non-blocking (``config.blocking =
False``: an abort can interrupt them), and a generation is left by aborting its group
(``_abort_process_group``), never by ``destroy_process_group``. A collective nobody reported
is abandoned once it outlives the backend's timeout (the timer), which fails the generation.
These paths import cleanly without CUDA; they run on a GPU only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta

log = logging.getLogger("memsnap.inplace")

_ARRIVE_POLL_S = 0.02  # how often a member waiting for the others to form a group looks again


class PeerLost(Exception):
    """A member of this generation was lost (or a collective failed): the generation is over.

    The in-place runner catches it; a training loop never has to."""

    def __init__(self, message: str, gen: int = -1):
        super().__init__(message)
        self.gen = gen

    def __reduce__(self):  # survives pickling by Ray with its generation
        return (PeerLost, (str(self), self.gen))


def prefix(job: str, gen: int) -> str:
    return f"memsnap/{job}/pg/{gen}"


def failed_key(job: str, gen: int) -> str:
    return f"{prefix(job, gen)}/failed"


def over_key(job: str, gen: int) -> str:
    return f"{prefix(job, gen)}/over"


def publish_failure(store, job: str, gen: int, why: str) -> str:
    """Tell every member of generation ``gen`` that it is over; the first reason stays, and
    is what this returns."""
    first = store.compare_set(failed_key(job, gen), "", why[:500])
    store.set(over_key(job, gen), "failed")
    return first.decode(errors="replace") if isinstance(first, bytes) else why[:500]


def connect(host: str, port: int, timeout_s: float):
    """A client of the rendezvous store."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def use_loopback_if(host: str) -> None:
    """gloo binds to the host name's address unless told otherwise: a store on loopback means
    every member is on this machine, so gloo binds to loopback too."""
    if host.startswith("127.") or host in ("localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def nccl_environment(env=None) -> None:
    """The environment of a member's process for NCCL, set before its first group: memsnap,
    not the NCCL watchdog, handles a failed collective (the watchdog's error handling would
    kill the surviving ranks' processes), and the blocking wait is off (a wait is memsnap's,
    against the generation's failure key)."""
    env = os.environ if env is None else env
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    env["TORCH_NCCL_BLOCKING_WAIT"] = "0"
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def nccl_options():
    """``ProcessGroupNCCL.Options`` with non-blocking communicators (an abort interrupts a
    collective stuck on a dead peer), or None where NCCL is not built in."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = False
    return opts


def gloo_key(job: str, gen: int, rank: int) -> str:
    return f"{prefix(job, gen)}/gloo/{rank}"


def _sockets() -> dict[int, int]:
    """This process's sockets: descriptor -> inode."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                out[int(name)] = int(link[8:-1])
    return out


class _Wires:
    """The TCP connections of one generation's gloo group, as this member opened them: the
    sockets that appeared while the group was formed (``before`` is the set from just
    before). A listening one is the group's own listener; a connected one is a pair, to be
    cut only if one of its ends is a member's listener (another thread of this process may
    have opened a socket meanwhile: that one is never touched)."""

    def __init__(self, before: dict[int, int]):
        self.listen: set[int] = set()
        self.conns: list[tuple[int, int, int, int]] = []  # (fd, inode, local port, peer port)
        for fd, ino in _sockets().items():
            if before.get(fd) == ino:
                continue
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as s:
                if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                    continue
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    self.listen.add(s.getsockname()[1])
                else:
                    self.conns.append((fd, ino, s.getsockname()[1], s.getpeername()[1]))

    def cut(self, listeners: set[int]) -> int:
        """Shut down every pair with an end at one of ``listeners`` (this member's own
        included); how many were cut. A descriptor closed or reused since is left alone."""
        cut = 0
        mine = listeners | self.listen
        for fd, ino, here, there in self.conns:
            if here not in mine and there not in mine:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as s:
                    if os.fstat(s.fileno()).st_ino != ino:
                        continue  # the pair is gone and its descriptor holds another socket
                    s.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:  # closed already, or not connected any more
                pass
        self.conns = []
        return cut


def leave(backend: str) -> None:
    """Let the default group go: gloo's is destroyed; NCCL's is aborted (a destroy with a dead
    peer hangs on it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if backend == "nccl":
        c10d._abort_process_group()
    else:
        dist.destroy_process_group()


class RecoverableGroup:
    """One rank's membership of the job's process group, across generations.

    ``store_addr``: the rendezvous store (host, port); ``timeout_s``: the backend's own timeout
    (the last bound on a hung collective nobody reported; the controller's heartbeats report a
    silent peer long before it)."""

    def __init__(
        self,
        job: str,
        store_addr: tuple[str, int],
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        store_timeout_s: float = 30.0,
    ):
        self.job, self.backend, self.timeout_s = job, backend, float(timeout_s)
        self.host, self.port = store_addr
        use_loopback_if(self.host)
        if backend == "nccl":
            nccl_environment()
        self.store = connect(self.host, self.port, store_timeout_s)
        self.gen: int | None = None
        self.rank: int | None = None
        self.world: int | None = None
        self._graveyard: list = []  # (group, work) of abandoned collectives, kept until done
        self._wires: _Wires | None = None  # the current generation's gloo connections
        self._wake = threading.Condition()
        self._failed: dict[int, str] = {}  # gen -> why, as seen by this rank
        self._stop = False
        self._watcher = threading.Thread(target=self._watch, name="memsnap-pg-watch", daemon=True)
        self._watcher_store = connect(self.host, self.port, store_timeout_s)
        self._watcher.start()

    # --- generations -------------------------------------------------------------------------
    def configure(self, gen: int, rank: int, world: int) -> None:
        """Form generation ``gen`` with this rank as ``rank`` of ``world`` (every member calls it)."""
        import torch.distributed as dist

        self.reap()
        if self.gen is not None and self.failure() is None:  # leaving a generation ends it for all
            self.fail(f"re-formed as generation {gen}")
        self._cut()
        if dist.is_initialized():
            old = dist.group.WORLD
            self._graveyard.append((old, None))  # never dropped while its work may be in flight
            leave(self.backend)
        with self._wake:
            self.gen, self.rank, self.world = gen, rank, world
            self._wake.notify_all()
        self._arrive(gen, world)
        extra = {}
        if self.backend == "nccl":
            import torch

            extra = {"pg_options": nccl_options(), "device_id": torch.device("cuda", torch.cuda.current_device())}
        before = _sockets() if self.backend == "gloo" else None
        try:
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(prefix(self.job, gen), self.store),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=self.timeout_s),
                **extra,
            )
            if before is not None:
                self._wires = _Wires(before)
                self.store.set(gloo_key(self.job, gen, rank), ",".join(map(str, sorted(self._wires.listen))))
        except Exception as exc:  # a member lost between its arrival and the backend's rendezvous
            why = self.wait_failure(2.0)
            if why is None:
                self.fail(f"forming the group: {type(exc).__name__}: {str(exc)[:300]}")
                why = self.failure()
            raise PeerLost(f"generation {gen} was not formed: {why}", gen) from None

    def _arrive(self, gen: int, world: int) -> None:
        """Wait for every member of ``gen`` to come, or end in ``PeerLost`` as soon as the
        generation is failed (a member that died before forming it, named by the controller):
        the backend's own rendezvous would wait out its whole timeout, and nothing interrupts
        it. The key is checked every ``_ARRIVE_POLL_S``; a failure wakes the wait at once (a
        store wait with a timeout would do as well, but torch logs a warning for each one that
        times out)."""
        arrived, everyone = f"{prefix(self.job, gen)}/arrived", f"{prefix(self.job, gen)}/everyone"
        if self.store.add(arrived, 1) >= world:
            self.store.set(everyone, "1")
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([everyone]):
            why = self.wait_failure(_ARRIVE_POLL_S)
            if why is None and time.monotonic() > deadline:
                self.fail(f"not every member came to form the group within {self.timeout_s:.0f} s")
                why = self.failure()
            if why is not None:
                raise PeerLost(f"generation {gen} was not formed: {why}", gen)

    def reap(self) -> int:
        """Let go of abandoned groups whose work has completed; how many are still kept."""
        keep = []
        for group, work in self._graveyard:
            if work is not None and not work.is_completed():
                keep.append((group, work))
        # a group with no pending work of ours is dropped once the next generation is formed
        self._graveyard = keep
        return len(keep)

    def _cut(self) -> int:
        """Cut the current generation's gloo connections (it is over): every abandoned
        collective of it, here and at its other members, fails at once instead of at the
        backend's timeout. Once per generation; how many connections were cut."""
        wires, self._wires = self._wires, None
        if wires is None or self.gen is None or self.world is None:
            return 0
        listeners: set[int] = set()
        for r in range(self.world):
            key = gloo_key(self.job, self.gen, r)
            with contextlib.suppress(Exception):
                if r != self.rank and self.store.check([key]):
                    listeners.update(int(p) for p in self.store.get(key).decode().split(",") if p)
        return wires.cut(listeners)

    def failure(self) -> str | None:
        """Why the current generation ended, or None while it is healthy."""
        with self._wake:
            return None if self.gen is None else self._failed.get(self.gen)

    def wait_failure(self, timeout_s: float) -> str | None:
        """Why the current generation ended, waiting up to ``timeout_s`` for a failure to be
        told (an error seen elsewhere may reach this member a moment before the key does)."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while self.gen is not None and self._failed.get(self.gen) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._wake.wait(left)
            return None if self.gen is None else self._failed.get(self.gen)

    def fail(self, why: str) -> None:
        """End the current generation for every member."""
        if self.gen is not None:  # (a cause told first, by a member or the controller, stays)
            self._mark(self.gen, publish_failure(self.store, self.job, self.gen, f"rank {self.rank}: {why}"))

    # --- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor, op=None):
        """``dist.all_reduce`` that ends in ``PeerLost`` (never a hang past a published failure)."""
        import torch.distributed as dist

        self._collective(lambda: dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, async_op=True))
        return tensor

    def all_gather_single(self, output, input) -> None:
        """``dist.all_gather_single`` (every member's ``input`` laid end to end in ``output``),
        ending in ``PeerLost`` like ``all_reduce``."""
        import torch.distributed as dist

        self._collective(lambda: dist.all_gather_single(output, input, async_op=True))

    def reduce_scatter_single(self, output, input, op=None) -> None:
        """``dist.reduce_scatter_single`` (``input`` reduced across members, this member's
        slice in ``output``; ``op`` SUM or AVG), ending in ``PeerLost`` like ``all_reduce``.

        gloo's own reduce-scatter runs inside its ``wait()``, which nothing can interrupt: on
        gloo it is an all-reduce of a copy, this member's slice taken (bitwise what gloo's
        gives: it sums the same way and divides by the world for AVG)."""
        import torch.distributed as dist

        op = dist.ReduceOp.SUM if op is None else op
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"op={op!r}: the re-formable reduce-scatter takes SUM or AVG")
        if self.backend == "nccl":
            self._collective(lambda: dist.reduce_scatter_single(output, input, op=op, async_op=True))
            return
        full = input.clone()
        self._collective(lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, async_op=True))
        n = output.numel()
        assert self.rank is not None and self.world is not None  # _collective checked the group
        output.copy_(full.view(-1)[self.rank * n : (self.rank + 1) * n].view_as(output))
        if op == dist.ReduceOp.AVG:
            output.div_(self.world)

    def _collective(self, start) -> None:
        """Start a collective of the current generation (``start()`` returns its work) and wait
        for it or for the generation's failure."""
        gen = self._current()
        try:
            work = start()
        except Exception as exc:  # a group that is already broken
            self.fail(f"{type(exc).__name__}: {exc}")
            raise PeerLost(f"generation {gen}: {exc}", gen) from None
        self._wait(work, gen)

    def average_gradients(self, params) -> None:
        """Average the gradients of ``params`` across the generation's members, in one flat
        bucket (a fresh one each call, so an abandoned collective writes nothing live)."""
        import torch

        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.all_reduce(flat)
        assert self.world is not None  # all_reduce checked the group is formed
        flat /= self.world
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()

    def send(self, tensor, dst: int) -> None:
        """``dist.isend`` of ``tensor`` to rank ``dst``, ending in ``PeerLost`` like ``all_reduce``."""
        import torch.distributed as dist

        self._collective(lambda: dist.isend(tensor, dst))

    def recv(self, tensor, src: int) -> None:
        """``dist.irecv`` into ``tensor`` from rank ``src``, ending in ``PeerLost`` like ``all_reduce``."""
        import torch.distributed as dist

        self._collective(lambda: dist.irecv(tensor, src))

    def exchange(self, sends: list, recvs: list) -> None:
        """Every ``(tensor, dst)`` of ``sends`` and ``(tensor, src)`` of ``recvs`` at once (one
        peer's slice need not wait for another's), ending in ``PeerLost`` like ``all_reduce``."""
        import torch.distributed as dist

        gen = self._current()
        works = []
        try:
            works += [dist.isend(t, dst) for t, dst in sends]
            works += [dist.irecv(t, src) for t, src in recvs]
        except Exception as exc:
            self.fail(f"{type(exc).__name__}: {exc}")
            raise PeerLost(f"generation {gen}: {exc}", gen) from None
        for work in works:
            self._wait(work, gen)

    def barrier(self) -> None:
        import torch

        self.all_reduce(torch.zeros(1))

    def _current(self) -> int:
        if self.gen is None:
            raise RuntimeError("the group is not formed yet: configure(gen, rank, world) first")
        why = self.failure()
        if why is not None:
            raise PeerLost(f"generation {self.gen} is over: {why}", self.gen)
        return self.gen

    def _wait(self, work, gen: int) -> None:
        import torch.distributed as dist

        waiter = None
        try:
            fut = work.get_future()
            fut.add_done_callback(lambda _f: self._poke())
            done = fut.done
        except (RuntimeError, NotImplementedError):  # gloo's point-to-point work has no future
            waiter = _Waiter(work, self._poke)
            done = waiter.ended.is_set
        deadline = time.monotonic() + self.timeout_s  # the timer: a collective nobody reported
        with self._wake:
            while not done() and self._failed.get(gen) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(min(1.0, left))
            why = self._failed.get(gen)
        if not done() and why is None:
            self.fail(f"a collective outlived the backend's timeout ({self.timeout_s:.0f} s)")
            why = self.failure()
        if not done():  # abandoned: the group and the work stay alive until the work ends
            self._graveyard.append((dist.group.WORLD, work if waiter is None else waiter))
            self._cut()  # (which ends the work soon)
            raise PeerLost(f"generation {gen} is over: {why}", gen)
        try:
            if waiter is None:
                work.wait()
            elif waiter.error is not None:  # (waited for once: a second wait would block)
                raise waiter.error
        except Exception as exc:
            text = f"{type(exc).__name__}: {str(exc)[:300]}"
            self.fail(text)
            self._cut()
            why = self._failed.get(gen) or text  # (the first cause: perhaps another's, not this)
            raise PeerLost(f"generation {gen}: a collective failed: {why}", gen) from None

    def _poke(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _mark(self, gen: int, why: str) -> None:
        with self._wake:
            self._failed.setdefault(gen, why)
            self._wake.notify_all()

    def _watch(self) -> None:
        """Wait on the current generation's ``over`` key (one client, one thread, for the
        group's whole life). The wait blocks until the key is set: by a failure, or by a
        member closing, so it never has to time out."""
        done = None
        while True:
            with self._wake:
                while not self._stop and (self.gen is None or self.gen in self._failed or self.gen == done):
                    self._wake.wait()
                if self._stop:
                    return
                gen = self.gen
            assert gen is not None  # the wait above ends on a generation
            try:
                self._watcher_store.wait([over_key(self.job, gen)], timedelta(days=365))
                why = (
                    self._watcher_store.get(failed_key(self.job, gen)).decode(errors="replace")
                    if self._watcher_store.check([failed_key(self.job, gen)])
                    else None
                )
            except Exception as exc:  # the store went away: nothing more to watch
                log.warning("the rendezvous store is gone (%s): generation %s is over", exc, gen)
                self._mark(gen, f"the rendezvous store is gone: {exc}")
                return
            if why is not None:
                self._mark(gen, why or "a member reported a failure")
            done = gen  # closed without a failure: nothing more to watch in it

    def close(self) -> None:
        """Stop the watcher and let the group go (the process may form no more generations)."""
        import torch.distributed as dist

        with self._wake:
            self._stop = True
            self._wake.notify_all()
            gen = self.gen
        if gen is not None:  # wakes this member's watcher; the others have finished too
            with contextlib.suppress(Exception):
                self.store.set(over_key(self.job, gen), "closed")
        self._watcher.join(timeout=5)
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                self._graveyard.append((dist.group.WORLD, None))
                leave(self.backend)

    def counts(self) -> dict:
        """Threads (native ones included: gloo's are) and file descriptors of this process, and
        the old groups kept (one abandoned group is kept once, however many of its works) and
        the abandoned works that have not ended yet."""
        return {
            "threads": os_threads(),
            "fds": len(os.listdir("/proc/self/fd")),
            "graveyard": len({id(group) for group, _ in self._graveyard}),
            "pending": sum(1 for _, work in self._graveyard if work is not None and not work.is_completed()),
        }


class _Waiter:
    """A thread that waits for ``work`` once (gloo's point-to-point work has no future and is
    complete only once waited for); ``ended`` is set, and ``poke()`` called, when it returns,
    ``error`` holding what its wait raised."""

    def __init__(self, work, poke) -> None:
        self.ended = threading.Event()
        self.error: BaseException | None = None

        def wait() -> None:
            try:
                work.wait()
            except Exception as exc:
                self.error = exc
            self.ended.set()
            poke()

        threading.Thread(target=wait, name="memsnap-p2p-wait", daemon=True).start()

    def is_completed(self) -> bool:  # (what the graveyard asks of an abandoned work)
        return self.ended.is_set()


def os_threads() -> int:
    """The threads of this process as the kernel counts them (Python's count misses the
    native threads of gloo, the store clients and torch)."""
    return len(os.listdir("/proc/self/task"))
