"""Data-plane throughput, side by side in one run: raw loopback socket vs memsnap's TCP
transport with authenticated frames (``wire="mac"``) and with encrypted ones
(``wire="encrypt"``), each moving 256 MiB-1 GiB between two processes; optionally the Ray
object-store transport too.

    python bench/transport.py [--sizes-mib 256 1024] [--rounds 5] [--objstore] [--out bench/results/transport.md]

Every receiver writes into memory it allocated and touched before the clock starts (as the
agent's arena does); every sender sends from a touched buffer. GiB/s = bytes / wall time
from the first byte sent until the receiver acknowledged the last. Each round runs the raw
socket, then each TCP mode (push, then fetch) back to back, so all see the same load; the
table reports the median of ``--rounds`` rounds (the machine is shared).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from typing import TYPE_CHECKING, cast

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memsnap.coding.stripes import choose_chunk  # noqa: E402
from memsnap.transport import ChunkKey, make_transport  # noqa: E402

if TYPE_CHECKING:
    from ray.actor import ActorHandle

GIB = 1 << 30
PIECE = 4 << 20
SECRET = b"bench-secret-0123456789abcdef"


class ArenaStore:
    """A ChunkStore over one preallocated, touched arena; chunk ``stripe`` sits at stripe*chunk."""

    def __init__(self, nbytes: int, chunk: int):
        self.arena = np.ones(nbytes + chunk, np.uint8)
        self.chunk = chunk
        self.sums: dict[ChunkKey, int] = {}
        self.sizes: dict[ChunkKey, int] = {}

    def reserve(self, key, nbytes):
        start = key.stripe * self.chunk
        self.sizes[key] = nbytes
        return memoryview(self.arena)[start : start + nbytes]

    def complete(self, key, checksum):
        self.sums[key] = checksum

    def discard(self, key):
        self.sums.pop(key, None)

    def lookup(self, key):
        if key not in self.sums:
            return None
        start = key.stripe * self.chunk
        return memoryview(self.arena)[start : start + self.sizes[key]], self.sums[key]


def _items(buf: np.ndarray, chunk: int, step: int) -> list:
    view = memoryview(buf)  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    return [(ChunkKey(step, "bench", i, 0), view[o : o + chunk]) for i, o in enumerate(range(0, len(buf), chunk))]


# --- raw socket --------------------------------------------------------------------------
def _raw_receiver(conn, nbytes: int, rounds: int) -> None:
    dst = memoryview(np.ones(nbytes, np.uint8))  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            got += sock.recv_into(dst[got : got + PIECE], min(PIECE, nbytes - got), socket.MSG_WAITALL)
        sock.sendall(b"k")
    sock.close()


def _raw_round(sock: socket.socket, src: np.ndarray) -> float:
    view, t0 = memoryview(src), time.perf_counter()  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    for o in range(0, len(src), PIECE):
        sock.sendall(view[o : o + PIECE])
    sock.recv(1)
    return len(src) / GIB / (time.perf_counter() - t0)


# --- memsnap TCP transport -----------------------------------------------------------------
MODES = ("mac", "encrypt")


def _tcp_server(conn, nbytes: int, chunk: int, mode: str) -> None:
    transport = make_transport("tcp", secret=SECRET, host="127.0.0.1", wire=mode, max_chunk=chunk)
    conn.send(transport.start(ArenaStore(nbytes, chunk)))
    conn.recv()  # run until told to stop
    transport.close()


def _tcp_round(client, addr: dict, src: np.ndarray, back: np.ndarray, chunk: int, step: int) -> tuple[float, float]:
    items = _items(src, chunk, step)
    t0 = time.perf_counter()
    client.push(addr, items, timeout=600)
    push = len(src) / GIB / (time.perf_counter() - t0)
    outs = [(k, memoryview(back)[i * chunk : i * chunk + len(v)]) for i, (k, v) in enumerate(items)]  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
    t0 = time.perf_counter()
    ok = client.fetch(addr, outs, timeout=600)
    fetch = len(src) / GIB / (time.perf_counter() - t0)
    assert all(ok) and np.array_equal(back[: len(src)], src), "TCP round trip lost bytes"
    return push, fetch


def bench_raw_and_tcp(src: np.ndarray, chunk: int, rounds: int) -> dict[str, list[float]]:
    """GiB/s of every round: ``raw``, and ``<mode>_push`` / ``<mode>_fetch`` per wire mode;
    each round runs them all back to back."""
    ctx = mp.get_context("spawn")
    raw_pipe, raw_child = ctx.Pipe()
    pipes = {m: ctx.Pipe() for m in MODES}
    procs = [ctx.Process(target=_raw_receiver, args=(raw_child, len(src), rounds), daemon=True)]
    procs += [ctx.Process(target=_tcp_server, args=(pipes[m][1], len(src), chunk, m), daemon=True) for m in MODES]
    for proc in procs:
        proc.start()
    clients = {m: make_transport("tcp", secret=SECRET, host="127.0.0.1", wire=m, max_chunk=chunk) for m in MODES}
    out: dict[str, list[float]] = {"raw": [], **{f"{m}_{d}": [] for m in MODES for d in ("push", "fetch")}}
    try:
        sock = socket.create_connection(("127.0.0.1", raw_pipe.recv()), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        addrs, back = {m: pipes[m][0].recv() for m in MODES}, np.ones(len(src) + chunk, np.uint8)
        for r in range(rounds):
            out["raw"].append(_raw_round(sock, src))
            for m in MODES:
                p, f = _tcp_round(clients[m], addrs[m], src, back, chunk, r)
                out[f"{m}_push"].append(p)
                out[f"{m}_fetch"].append(f)
        sock.close()
        return out
    finally:
        for m in MODES:
            clients[m].close()
            pipes[m][0].send("stop")
        for proc in procs:
            proc.join(timeout=60)


# --- Ray object store transport ------------------------------------------------------------
def bench_objstore(sizes: list[int], chunk_of, repeats: int) -> dict[int, tuple[float, float]]:
    import ray
    from tqdm import tqdm

    from memsnap.localcluster import LocalCluster

    biggest = max(sizes)
    with LocalCluster(2, object_store_mb=max(512, biggest // (1 << 20) + 256)) as _:
        Holder = ray.remote(num_cpus=0)(_Holder)
        out = {}
        for nbytes in tqdm(sizes, desc="Ray object store", unit="size"):
            chunk = chunk_of(nbytes)
            # ray annotates ActorClass.remote() as "ActorHandle[T] | type[T]"; it is the handle
            holder = cast(
                "ActorHandle[_Holder]",
                Holder.options(name=f"bench-holder-{nbytes}", resources={"memsnap_node_1": 0.01}).remote(nbytes, chunk),
            )
            addr = ray.get(holder.address.remote(), timeout=120)
            out[nbytes] = _objstore_rounds(addr, nbytes, chunk, repeats)
            ray.kill(holder)
        return out


class _Holder:
    def __init__(self, nbytes: int, chunk: int):
        from memsnap.transport.objstore import ObjStoreTransport

        self.transport = ObjStoreTransport()
        self.addr = self.transport.start(ArenaStore(nbytes, chunk))

    def address(self):
        return self.addr

    def objstore_push(self, keys, data, lengths, sums):
        return self.transport.handle_push(keys, data, lengths, sums)

    def objstore_fetch(self, keys):
        return self.transport.handle_fetch(keys)


def _objstore_rounds(addr: dict, nbytes: int, chunk: int, repeats: int) -> tuple[float, float]:
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    back = np.ones(nbytes + chunk, np.uint8)
    client = make_transport("objstore", secret=SECRET, host="127.0.0.1")
    push, fetch = [], []
    for r in range(repeats):
        items = _items(src, chunk, r)
        t0 = time.perf_counter()
        client.push(addr, items, timeout=600)
        push.append(nbytes / GIB / (time.perf_counter() - t0))
        outs = [(k, memoryview(back)[i * chunk : i * chunk + len(v)]) for i, (k, v) in enumerate(items)]  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
        t0 = time.perf_counter()
        ok = client.fetch(addr, outs, timeout=600)
        fetch.append(nbytes / GIB / (time.perf_counter() - t0))
        assert all(ok) and np.array_equal(back[:nbytes], src), "object-store round trip lost bytes"
    return statistics.median(push), statistics.median(fetch)


# --- report --------------------------------------------------------------------------------
COLUMNS = [
    ("raw", "raw socket"),
    ("mac_push", "MAC push"),
    ("mac_fetch", "MAC fetch"),
    ("encrypt_push", "encrypted push"),
    ("encrypt_fetch", "encrypted fetch"),
]


def _table(rows: list[dict], objstore: bool) -> str:
    cols = COLUMNS + ([("obj_push", "Ray objstore push"), ("obj_fetch", "Ray objstore fetch")] if objstore else [])
    head = ["size", *(c[1] for c in cols), "MAC push / raw", "MAC fetch / raw", "encrypted push / raw"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            f"{r['mib']} MiB",
            *(f"{r[c]:.2f}" for c, _ in cols),
            *(f"{r[c] / r['raw']:.2f}x" for c in ("mac_push", "mac_fetch", "encrypt_push")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="target shard size (choose_chunk)")
    ap.add_argument("--objstore", action="store_true", help="also measure the Ray object-store transport")
    ap.add_argument("--out", default=None, help="append the markdown table to this file")
    args = ap.parse_args(argv)
    sizes = [s << 20 for s in args.sizes_mib]

    def chunk_of(n: int) -> int:
        return choose_chunk(n, 1, int(args.chunk_mib * (1 << 20)))

    rows, load = [], os.getloadavg()[0]
    for nbytes in sizes:
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        runs = bench_raw_and_tcp(src, chunk_of(nbytes), args.rounds)
        rows.append({"mib": nbytes >> 20, **{k: statistics.median(v) for k, v in runs.items()}})
        print(nbytes >> 20, "MiB", {k: [round(x, 2) for x in v] for k, v in runs.items()}, flush=True)
    if args.objstore:
        obj = bench_objstore(sizes, chunk_of, args.rounds)
        for r, nbytes in zip(rows, sizes):
            r["obj_push"], r["obj_fetch"] = obj[nbytes]
    table = _table(rows, args.objstore)
    header = (
        f"GiB/s, median of {args.rounds} interleaved rounds; chunks of {chunk_of(sizes[0])} B; "
        f"{os.cpu_count()} CPUs; {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    print(header)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n{header}\n\n{table}\n")


if __name__ == "__main__":
    main()
