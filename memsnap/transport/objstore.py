"""The fallback transport: chunks through Ray's object store and actor calls.

Client: ``push`` puts each batch of chunks with one ``ray.put`` (their bytes end to end, as
one uint8 array, which Ray moves without pickling its bytes: one object and one reference a
batch, not one a chunk, which costs the holder's event loop ~30x less) and calls the holder
agent actor's ``objstore_push(packed_keys, ref, lengths, checksums)``; ``fetch`` calls its
``objstore_fetch(packed_keys)``. Chunks go in batches of at most ``batch_bytes`` so a large
snapshot never fills the object store at once. The peer address names the agent actor and
its namespace. Server: ``ObjStoreServer`` is a plain object; the agent actor's
``objstore_push``/``objstore_fetch`` methods delegate to its ``handle_push``/``handle_fetch``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import xxhash

from memsnap.errors import PushCancelled, StepGivenUp, TransportError
from memsnap.transport.base import ChunkKey, ChunkStore, Scatter, Transport, byte_view

log = logging.getLogger("memsnap.transport")

IN_FLIGHT = 2  # batches whose actor call is outstanding at once


class ObjStoreServer:
    """The server half: stores pushed chunks in and serves fetched chunks from a ChunkStore."""

    def __init__(self, store: ChunkStore):
        self.store = store

    def handle_push(self, packed_keys: list[bytes], data, lengths: list[int], checksums: list[int]) -> list[str | None]:
        """Store every chunk of the batch ``data`` holds end to end (``lengths`` bytes each); one
        entry per chunk: None when stored, else why it was refused. (The client passes the
        batch's reference; Ray resolves an argument's reference itself, so ``data`` is its array.)"""
        whole = byte_view(data)
        if not len(packed_keys) == len(lengths) == len(checksums) or sum(lengths) != len(whole):
            why = f"a malformed batch: {len(packed_keys)} keys, {len(lengths)} lengths, {len(whole)} bytes"
            return [why] * len(packed_keys)
        out, at = [], 0
        for raw, n, c in zip(packed_keys, lengths, checksums):
            out.append(self._store_one(ChunkKey.unpack(raw), whole[at : at + int(n)], int(c)))
            at += int(n)
        return out

    def _store_one(self, key: ChunkKey, arr: np.ndarray | memoryview, checksum: int) -> str | None:
        src = byte_view(arr)
        try:
            dest = byte_view(self.store.reserve(key, len(src)))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"  # (the class name tells the sender a given-up step)
        if len(dest) != len(src):
            self.store.discard(key)
            return f"the store reserved {len(dest)} bytes for a {len(src)}-byte chunk"
        dest[:] = src
        if xxhash.xxh3_64_intdigest(dest) != checksum:
            self.store.discard(key)
            log.warning("chunk %s arrived with a bad checksum; dropped", key)
            return "checksum mismatch on arrival"
        self.store.complete(key, checksum)
        return None

    def handle_fetch(self, packed_keys: list[bytes]) -> list[tuple[np.ndarray | None, int]]:
        """Every held chunk as ``(bytes as a uint8 array, checksum)``; ``(None, 0)`` when not held."""
        out: list[tuple[np.ndarray | None, int]] = []
        for raw in packed_keys:
            held = self.store.lookup(ChunkKey.unpack(raw))
            out.append((None, 0) if held is None else (np.frombuffer(byte_view(held[0]), np.uint8), held[1]))
        return out


def _batches(items: Sequence, limit: int) -> Iterator[list]:
    batch: list = []
    size = 0
    for item in items:
        n = len(item[1]) if isinstance(item[1], Scatter) else len(byte_view(item[1]))
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


class ObjStoreTransport(Transport):
    """Chunks through Ray's object store (see the module docstring). Needs ``ray`` connected."""

    name = "objstore"

    def __init__(
        self, *, actor_name: str | None = None, namespace: str | None = None, batch_bytes: int = 64 << 20, **_ignored
    ):
        if not isinstance(batch_bytes, int) or batch_bytes < 1:
            raise ValueError(f"batch_bytes={batch_bytes!r}: must be an int >= 1")
        self.actor_name, self.namespace, self.batch_bytes = actor_name, namespace, batch_bytes
        self.server: ObjStoreServer | None = None
        self._handles: dict[tuple[str, str], object] = {}

    # -- server half ---------------------------------------------------------------------
    def start(self, store: ChunkStore) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        name = self.actor_name or ctx.get_actor_name()
        if not name:
            raise ValueError(
                "the objstore transport needs the hosting actor's name: start it inside a "
                "named actor or pass actor_name=... to make_transport"
            )
        self.server = ObjStoreServer(store)
        return {"transport": "objstore", "actor": name, "namespace": self.namespace or ctx.namespace}

    def handle_push(self, packed_keys: list[bytes], data, lengths: list[int], checksums: list[int]) -> list[str | None]:
        return self._serving().handle_push(packed_keys, data, lengths, checksums)

    def handle_fetch(self, packed_keys: list[bytes]) -> list[tuple[np.ndarray | None, int]]:
        return self._serving().handle_fetch(packed_keys)

    def _serving(self) -> ObjStoreServer:
        if self.server is None:
            raise RuntimeError("this objstore transport was not started: call start(store) first")
        return self.server

    def close(self) -> None:
        self.server = None
        self._handles.clear()

    # -- client half ---------------------------------------------------------------------
    def push(
        self,
        peer: dict,
        items: Sequence[tuple[ChunkKey, memoryview]],
        *,
        timeout: float,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        for batch, errors in self._pipelined(peer, "objstore_push", items, self._push_args, deadline, timeout, cancel):
            for (key, _), err in zip(batch, errors):
                if err is not None:
                    error = StepGivenUp if err.startswith(f"{StepGivenUp.__name__}:") else TransportError
                    raise error(f"push to {self._describe(peer)}: the peer refused chunk {key}: {err}")

    def fetch(self, peer: dict, items: Sequence[tuple[ChunkKey, memoryview]], *, timeout: float) -> list[bool]:
        deadline = time.monotonic() + timeout
        found: list[bool] = []
        for batch, held in self._pipelined(peer, "objstore_fetch", items, self._fetch_args, deadline, timeout):
            found.extend(self._fill(peer, key, buf, arr, c) for (key, buf), (arr, c) in zip(batch, held))
        return found

    @staticmethod
    def _push_args(batch: list) -> tuple:
        import ray

        views = [byte_view(buf) for _, buf in batch]
        whole = ray.put(np.concatenate([np.frombuffer(v, np.uint8) for v in views]))
        checksums = [xxhash.xxh3_64_intdigest(v) for v in views]
        return [k.pack() for k, _ in batch], whole, [len(v) for v in views], checksums

    @staticmethod
    def _fetch_args(batch: list) -> tuple:
        return ([k.pack() for k, _ in batch],)

    def _pipelined(self, peer: dict, method: str, items, make_args, deadline: float, timeout: float, cancel=None):
        """``(batch, result)`` for every batch, with up to IN_FLIGHT calls outstanding; a batch
        is not sent once ``cancel()`` says so (``PushCancelled``)."""
        inflight: collections.deque = collections.deque()
        for batch in _batches(items, self.batch_bytes):
            if cancel is not None and cancel():
                raise PushCancelled(f"push to {self._describe(peer)} called off at chunk {batch[0][0]}")
            inflight.append((batch, self._submit(peer, method, make_args(batch), batch[0][0])))
            if len(inflight) >= IN_FLIGHT:
                batch, ref = inflight.popleft()
                yield batch, self._wait(peer, method, ref, deadline, timeout, batch[0][0])
        while inflight:
            batch, ref = inflight.popleft()
            yield batch, self._wait(peer, method, ref, deadline, timeout, batch[0][0])

    def _fill(self, peer: dict, key: ChunkKey, dest, arr, checksum: int) -> bool:
        if arr is None:
            return False
        src = byte_view(arr)
        if len(src) != len(dest):
            log.warning(
                "fetch from %s: chunk %s is %d bytes, the buffer %d", self._describe(peer), key, len(src), len(dest)
            )
            return False
        if xxhash.xxh3_64_intdigest(src) != checksum:
            log.warning("fetch from %s: chunk %s fails its checksum; treated as missing", self._describe(peer), key)
            return False
        if isinstance(dest, Scatter):
            dest.write(src)
        else:
            byte_view(dest)[:] = src
        return True

    def _submit(self, peer: dict, method: str, args: tuple, key: ChunkKey):
        from ray.exceptions import RayError

        self._ident(peer)  # a malformed address is the caller's bug: ValueError, not TransportError
        try:
            return getattr(self._handle(peer), method).remote(*args)
        except (RayError, ValueError) as exc:
            self._handles.pop(self._ident(peer), None)
            raise TransportError(
                f"{method} to {self._describe(peer)} failed at chunk {key}: {type(exc).__name__}: {exc}"
            ) from exc

    def _wait(self, peer: dict, method: str, ref, deadline: float, timeout: float, key: ChunkKey):
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            raise TransportError(
                f"{method} to {self._describe(peer)} timed out after {timeout:g} s at chunk {key}"
            ) from None
        except RayError as exc:
            self._handles.pop(self._ident(peer), None)
            raise TransportError(
                f"{method} to {self._describe(peer)} failed at chunk {key}: {type(exc).__name__}: {exc}"
            ) from exc

    def _handle(self, peer: dict):
        import ray

        ident = self._ident(peer)
        if ident not in self._handles:
            self._handles[ident] = ray.get_actor(ident[0], namespace=ident[1])
        return self._handles[ident]

    @staticmethod
    def _ident(peer: dict) -> tuple[str, str]:
        try:
            return str(peer["actor"]), str(peer["namespace"])
        except (KeyError, TypeError):
            raise ValueError(
                f"peer address {peer!r} is not an objstore address: pass the dict start() returned"
            ) from None

    @staticmethod
    def _describe(peer: dict) -> str:
        return f"actor {peer.get('namespace')}/{peer.get('actor')}" if isinstance(peer, dict) else repr(peer)
