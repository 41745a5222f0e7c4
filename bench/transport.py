"""Data-plane throughput, side by side in one run: raw loopback socket vs memsnap's TCP
transport vs the Ray object-store transport, each moving 256 MiB-1 GiB between two processes.

    python bench/transport.py [--sizes-mib 256 1024] [--repeats 3] [--out bench/results/transport.md]

Every receiver writes into memory it allocated and touched before the clock starts (as the
agent's arena does); every sender sends from a touched buffer. GiB/s = bytes / wall time
from the first byte sent until the receiver acknowledged the last. Each repeat runs the raw
socket and then the TCP transport back to back (so both see the same load), and the best
of ``--repeats`` is reported (the machine is shared; the best run is the least disturbed).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memsnap.stripes import choose_chunk  # noqa: E402
from memsnap.transport import ChunkKey, make_transport  # noqa: E402

GIB = 1 << 30
PIECE = 4 << 20
SECRET = b"bench-secret-0123456789abcdef"


class ArenaStore:
    """A ChunkStore over one preallocated, touched arena; chunk ``stripe`` sits at stripe*chunk."""

    def __init__(self, nbytes: int, chunk: int):
        self.arena = np.ones(nbytes + chunk, np.uint8)
        self.chunk, self.sums, self.sizes = chunk, {}, {}

    def reserve(self, key, nbytes):
        start = key.stripe * self.chunk
        self.sizes[key] = nbytes
        return memoryview(self.arena)[start:start + nbytes]

    def complete(self, key, checksum):
        self.sums[key] = checksum

    def discard(self, key):
        self.sums.pop(key, None)

    def lookup(self, key):
        if key not in self.sums:
            return None
        start = key.stripe * self.chunk
        return memoryview(self.arena)[start:start + self.sizes[key]], self.sums[key]


def _items(buf: np.ndarray, chunk: int, step: int) -> list:
    view = memoryview(buf)
    return [(ChunkKey(step, "bench", i, 0), view[o:o + chunk]) for i, o in enumerate(range(0, len(buf), chunk))]


# --- raw socket --------------------------------------------------------------------------
def _raw_receiver(conn, nbytes: int, rounds: int) -> None:
    dst = memoryview(np.ones(nbytes, np.uint8))
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            got += sock.recv_into(dst[got:got + PIECE], min(PIECE, nbytes - got), socket.MSG_WAITALL)
        sock.sendall(b"k")
    sock.close()


def _raw_round(sock: socket.socket, src: np.ndarray) -> float:
    view, t0 = memoryview(src), time.perf_counter()
    for o in range(0, len(src), PIECE):
        sock.sendall(view[o:o + PIECE])
    sock.recv(1)
    return len(src) / GIB / (time.perf_counter() - t0)


# --- memsnap TCP transport -----------------------------------------------------------------
def _tcp_server(conn, nbytes: int, chunk: int) -> None:
    transport = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    conn.send(transport.start(ArenaStore(nbytes, chunk)))
    conn.recv()  # run until told to stop
    transport.close()


def _tcp_round(client, addr: dict, src: np.ndarray, back: np.ndarray, chunk: int, step: int) -> tuple[float, float]:
    items = _items(src, chunk, step)
    t0 = time.perf_counter()
    client.push(addr, items, timeout=600)
    push = len(src) / GIB / (time.perf_counter() - t0)
    outs = [(k, memoryview(back)[i * chunk:i * chunk + len(v)]) for i, (k, v) in enumerate(items)]
    t0 = time.perf_counter()
    ok = client.fetch(addr, outs, timeout=600)
    fetch = len(src) / GIB / (time.perf_counter() - t0)
    assert all(ok) and np.array_equal(back[:len(src)], src), "TCP round trip lost bytes"
    return push, fetch


def bench_raw_and_tcp(src: np.ndarray, chunk: int, repeats: int) -> tuple[float, float, float]:
    """Best raw, TCP push and TCP fetch GiB/s; each repeat runs raw then TCP back to back."""
    ctx = mp.get_context("spawn")
    raw_pipe, raw_child = ctx.Pipe()
    tcp_pipe, tcp_child = ctx.Pipe()
    procs = [ctx.Process(target=_raw_receiver, args=(raw_child, len(src), repeats), daemon=True),
             ctx.Process(target=_tcp_server, args=(tcp_child, len(src), chunk), daemon=True)]
    for proc in procs:
        proc.start()
    client = make_transport("tcp", secret=SECRET, host="127.0.0.1")
    try:
        sock = socket.create_connection(("127.0.0.1", raw_pipe.recv()), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        addr, back = tcp_pipe.recv(), np.ones(len(src) + chunk, np.uint8)
        raw = push = fetch = 0.0
        for r in range(repeats):
            raw = max(raw, _raw_round(sock, src))
            p, f = _tcp_round(client, addr, src, back, chunk, r)
            push, fetch = max(push, p), max(fetch, f)
        sock.close()
        return raw, push, fetch
    finally:
        client.close()
        tcp_pipe.send("stop")
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
            holder = Holder.options(name=f"bench-holder-{nbytes}", resources={"memsnap_node_1": 0.01}).remote(
                nbytes, chunk)
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

    def objstore_push(self, keys, refs, sums):
        return self.transport.handle_push(keys, refs, sums)

    def objstore_fetch(self, keys):
        return self.transport.handle_fetch(keys)


def _objstore_rounds(addr: dict, nbytes: int, chunk: int, repeats: int) -> tuple[float, float]:
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    back = np.ones(nbytes + chunk, np.uint8)
    client = make_transport("objstore", secret=SECRET, host="127.0.0.1")
    push = fetch = 0.0
    for r in range(repeats):
        items = _items(src, chunk, r)
        t0 = time.perf_counter()
        client.push(addr, items, timeout=600)
        push = max(push, nbytes / GIB / (time.perf_counter() - t0))
        outs = [(k, memoryview(back)[i * chunk:i * chunk + len(v)]) for i, (k, v) in enumerate(items)]
        t0 = time.perf_counter()
        ok = client.fetch(addr, outs, timeout=600)
        fetch = max(fetch, nbytes / GIB / (time.perf_counter() - t0))
        assert all(ok) and np.array_equal(back[:nbytes], src), "object-store round trip lost bytes"
    return push, fetch


# --- report --------------------------------------------------------------------------------
def _table(rows: list[dict]) -> str:
    head = ("| size | raw socket | memsnap TCP push | memsnap TCP fetch | Ray objstore push "
            "| Ray objstore fetch | TCP push / raw | TCP push / objstore push |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['mib']} MiB | {r['raw']:.2f} | {r['tcp_push']:.2f} | {r['tcp_fetch']:.2f} "
            f"| {r['obj_push']:.2f} | {r['obj_fetch']:.2f} | {r['tcp_push'] / r['raw']:.2f}x "
            f"| {r['tcp_push'] / r['obj_push']:.1f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="target shard size (choose_chunk)")
    ap.add_argument("--out", default=None, help="append the markdown table to this file")
    args = ap.parse_args(argv)
    sizes = [s << 20 for s in args.sizes_mib]

    def chunk_of(n: int) -> int:
        return choose_chunk(n, 1, int(args.chunk_mib * (1 << 20)))

    rows = []
    for nbytes in tqdm(sizes, desc="raw + TCP", unit="size"):
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        raw, tcp_push, tcp_fetch = bench_raw_and_tcp(src, chunk_of(nbytes), args.repeats)
        rows.append({"mib": nbytes >> 20, "raw": raw, "tcp_push": tcp_push, "tcp_fetch": tcp_fetch})
    obj = bench_objstore(sizes, chunk_of, args.repeats)
    for r, nbytes in zip(rows, sizes):
        r["obj_push"], r["obj_fetch"] = obj[nbytes]
    table = _table(rows)
    header = (f"GiB/s, best of {args.repeats}; chunks of {chunk_of(sizes[0])} B; {os.cpu_count()} CPUs; "
              f"{platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"load average {os.getloadavg()[0]:.1f} at the end")
    print(header)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n{header}\n\n{table}\n")


if __name__ == "__main__":
    main()
