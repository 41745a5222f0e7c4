"""Reed-Solomon throughput, side by side: memsnap, ISA-L (C, via ctypes), pyeclib, zfec, memcpy.

Run: ``python bench/codec.py [--quick] [--repeat N]``.  Prints a table and writes it to
bench/results/codec.md.  Every number is GB/s of *data* bytes (k shards), the best of N runs
after a warm-up.  Encode writes m parity shards into preallocated buffers; decode rebuilds the
first m data shards from the other k shards.  "1 MiB" is one stripe holding 1 MiB of data (in
cache); "256 MiB" is 256 MiB of data in stripes of 1 MiB shards (out of cache).  The k shards
of a stripe are staggered by an odd number of cache lines (see ``--layout``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from memsnap.coding import codec

MiB = 1 << 20
GEOMETRIES = [(2, 1), (4, 1), (4, 2), (6, 3), (8, 2), (10, 4)]
STAGGER = 3 * 64  # an odd number of cache lines between consecutive shards
RESULTS = Path(__file__).resolve().parent / "results" / "codec.md"
THREADS = os.cpu_count() or 1


@dataclass
class Stripes:
    """Data, parity and rebuild buffers of `count` stripes carved out of one arena."""

    data: list[list[np.ndarray]]
    parity: list[list[np.ndarray]]
    rebuilt: list[list[np.ndarray]]

    @property
    def data_bytes(self) -> int:
        return sum(s.nbytes for stripe in self.data for s in stripe)


def carve(count: int, k: int, m: int, shard: int, stagger: int) -> Stripes:
    stride = shard + stagger
    arena = np.empty(count * (k + 2 * m) * stride + 4096, dtype=np.uint8)
    arena[:] = np.random.default_rng(1).integers(0, 256, arena.size, dtype=np.uint8)
    base = (-arena.ctypes.data) % 4096  # the first shard page aligned
    views = [arena[base + i * stride : base + i * stride + shard] for i in range(count * (k + 2 * m))]
    per = k + 2 * m
    return Stripes(
        data=[views[s * per : s * per + k] for s in range(count)],
        parity=[views[s * per + k : s * per + k + m] for s in range(count)],
        rebuilt=[views[s * per + k + m : (s + 1) * per] for s in range(count)],
    )


def clock_for(name: str) -> Callable[[], int]:
    """One-thread ops are timed by the CPU time of the calling thread (the time it is
    descheduled by other processes on a shared machine does not count); multi-thread ops by
    the wall clock."""
    return time.thread_time_ns if name.endswith("1t") else time.perf_counter_ns


def interleaved_best(ops: dict[str, Callable[[], None]], nbytes: int, rounds: int, inner: int = 1) -> dict[str, float]:
    """GB/s of each op, best of `rounds`; every round runs every op `inner` times in a row (the
    first warms the cache for in-cache sizes), op after op, so that a burst of load from other
    processes hits all of them alike."""
    best = dict.fromkeys(ops, float("inf"))
    for run in ops.values():
        run()  # warm-up
    for _ in range(rounds):
        for name, run in ops.items():
            clock = clock_for(name)
            for _ in range(inner):
                t0 = clock()
                run()
                best[name] = min(best[name], max(clock() - t0, 1))
    return {name: nbytes / t for name, t in best.items()}


# --- memsnap ---------------------------------------------------------------------------------
def memsnap_ops(st: Stripes, k: int, m: int, threads: int):
    rs = codec.ReedSolomon(k, m, threads=threads)
    for d, p in zip(st.data, st.parity):
        rs.encode_into(d, p)
    lost: list[np.ndarray | None] = [None] * m  # the first m data shards of every stripe
    calls = [([*lost, *d[m:], *p], dict(zip(range(m), r))) for d, p, r in zip(st.data, st.parity, st.rebuilt)]

    def encode() -> None:
        for d, p in zip(st.data, st.parity):
            rs.encode_into(d, p)

    def decode() -> None:
        for shards, out in calls:
            rs.reconstruct_data(shards, out=out)

    return encode, decode


# --- ISA-L, the C library called directly --------------------------------------------------------
def load_isal():
    name = ctypes.util.find_library("isal") or "libisal.so.2"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def isal_ops(lib, st: Stripes, k: int, m: int, threads: int):
    u8p = ctypes.POINTER(ctypes.c_ubyte)
    full = (ctypes.c_ubyte * ((k + m) * k))()
    lib.gf_gen_cauchy1_matrix(full, k + m, k)
    enc_tbl = (ctypes.c_ubyte * (k * m * 32))()
    lib.ec_init_tables(k, m, ctypes.byref(full, k * k), enc_tbl)
    # decode: survivors are data shards m..k-1 then parity 0..m-1; rebuild data 0..m-1
    rows = list(range(m, k)) + list(range(k, k + m))
    sub = (ctypes.c_ubyte * (k * k))(*[full[r * k + c] for r in rows for c in range(k)])
    inv = (ctypes.c_ubyte * (k * k))()
    if lib.gf_invert_matrix(sub, inv, k) != 0:
        raise RuntimeError("ISA-L: singular decode matrix")
    dec_rows = (ctypes.c_ubyte * (m * k))(*[inv[r * k + c] for r in range(m) for c in range(k)])
    dec_tbl = (ctypes.c_ubyte * (k * m * 32))()
    lib.ec_init_tables(k, m, dec_rows, dec_tbl)

    def ptrs(arrs):
        return (u8p * len(arrs))(*[a.ctypes.data_as(u8p) for a in arrs])

    enc_args = [(ptrs(d), ptrs(p)) for d, p in zip(st.data, st.parity)]
    dec_args = [(ptrs(d[m:] + p), ptrs(r)) for d, p, r in zip(st.data, st.parity, st.rebuilt)]
    n = st.data[0][0].nbytes
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def call(tbl, ins, outs):
        if pool is None:
            lib.ec_encode_data(n, k, m, tbl, ins, outs)
            return
        # split each call's length across threads (ctypes releases the GIL)
        step = (n // threads + 63) & ~63
        parts = []
        for off in range(0, n, step):
            size = min(step, n - off)
            i2 = (u8p * k)(*[ctypes.cast(ctypes.addressof(ins[i].contents) + off, u8p) for i in range(k)])
            o2 = (u8p * m)(*[ctypes.cast(ctypes.addressof(outs[j].contents) + off, u8p) for j in range(m)])
            parts.append(pool.submit(lib.ec_encode_data, size, k, m, tbl, i2, o2))
        for f in parts:
            f.result()

    def encode() -> None:
        for ins, outs in enc_args:
            call(enc_tbl, ins, outs)

    def decode() -> None:
        for ins, outs in dec_args:
            call(dec_tbl, ins, outs)

    return encode, decode


# --- pyeclib and zfec, through their Python APIs -------------------------------------------------
def pyeclib_backend() -> str | None:
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError:
        return None
    for name in ("isa_l_rs_vand", "liberasurecode_rs_vand"):
        try:
            ECDriver(k=2, m=1, ec_type=name)
            return name
        except Exception:
            continue
    return None


def pyeclib_ops(backend: str, st: Stripes, k: int, m: int):
    from pyeclib.ec_iface import ECDriver

    drv = ECDriver(k=k, m=m, ec_type=backend)
    blobs = [b"".join(bytes(s) for s in d) for d in st.data]
    frags = [drv.encode(b) for b in blobs]

    def encode() -> None:
        for b in blobs:
            drv.encode(b)

    def decode() -> None:
        for f in frags:
            drv.reconstruct(f[m:], list(range(m)))

    return encode, decode


def zfec_ops(st: Stripes, k: int, m: int):
    import zfec

    enc, dec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
    blocks = [[bytes(s) for s in d] for d in st.data]
    coded = [enc.encode(b) for b in blocks]
    ids = list(range(m, k + m))

    def encode() -> None:
        for b in blocks:
            enc.encode(b, list(range(k, k + m)))

    def decode() -> None:
        for c in coded:
            dec.decode(c[m:], ids)

    return encode, decode


def memcpy_op(st: Stripes):
    """numpy copy of the same data bytes into a second set of buffers: the bandwidth ceiling."""
    src = [s for d in st.data for s in d]
    dst = [np.empty_like(s) for s in src]

    def copy() -> None:
        for a, b in zip(src, dst):
            np.copyto(b, a)

    return copy


# --- the run ---------------------------------------------------------------------------------------
def geometry_stripes(k: int, m: int, total: int) -> Stripes:
    if total <= MiB:
        return carve(1, k, m, (total // k + 63) & ~63, STAGGER)
    return carve(max(1, total // (k * MiB)), k, m, MiB, STAGGER)


def measure(k: int, m: int, total: int, rounds: int, isal, eclib: str | None) -> dict[str, float]:
    st = geometry_stripes(k, m, total)
    ops: dict[str, Callable[[], None]] = {}
    for threads, tag in ((1, "1t"), (THREADS, f"{THREADS}t")):
        ops[f"memsnap enc {tag}"], ops[f"memsnap dec {tag}"] = memsnap_ops(st, k, m, threads)
        if isal is not None:
            ops[f"ISA-L enc {tag}"], ops[f"ISA-L dec {tag}"] = isal_ops(isal, st, k, m, threads)
    if eclib is not None:
        ops["pyeclib enc 1t"], ops["pyeclib dec 1t"] = pyeclib_ops(eclib, st, k, m)
    ops["zfec enc 1t"], ops["zfec dec 1t"] = zfec_ops(st, k, m)
    ops["memcpy 1t"] = memcpy_op(st)
    if total <= MiB:  # in-cache runs are short: more rounds, each op 3 times in a row
        return interleaved_best(ops, st.data_bytes, rounds * 4, inner=3)
    return interleaved_best(ops, st.data_bytes, rounds)


LAYOUT_COLUMNS = (
    "memsnap enc",
    "memsnap dec",
    "ISA-L enc",
    "ISA-L dec",
    "pyeclib enc",
    "pyeclib dec",
    "zfec enc",
    "zfec dec",
    "memcpy",
)


def layout_check(rounds: int, isal, eclib: str | None) -> list[str]:
    """k=4, m=2 over 64 MiB in 1 MiB shards, one thread: shards a power of two apart vs staggered."""
    lines = []
    for name, stagger in (("power-of-two apart", 0), ("staggered 3 cache lines", STAGGER)):
        st = carve(16, 4, 2, MiB, stagger)
        ops: dict[str, Callable[[], None]] = {}
        ops["memsnap enc 1t"], ops["memsnap dec 1t"] = memsnap_ops(st, 4, 2, 1)
        if isal is not None:
            ops["ISA-L enc 1t"], ops["ISA-L dec 1t"] = isal_ops(isal, st, 4, 2, 1)
        if eclib is not None:
            ops["pyeclib enc 1t"], ops["pyeclib dec 1t"] = pyeclib_ops(eclib, st, 4, 2)
        ops["zfec enc 1t"], ops["zfec dec 1t"] = zfec_ops(st, 4, 2)
        ops["memcpy 1t"] = memcpy_op(st)
        r = {n[:-3]: v for n, v in interleaved_best(ops, st.data_bytes, rounds).items()}
        ratio = (
            f"{r['memsnap enc'] / r['ISA-L enc']:.2f}x / {r['memsnap dec'] / r['ISA-L dec']:.2f}x"
            if isal is not None
            else "-"
        )
        cells = [f"{r[c]:.2f}" if c in r else "-" for c in LAYOUT_COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def cpu_description() -> tuple[str, str]:
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                wanted = ("sse", "ssse3", "avx", "avx2", "avx512", "gfni", "pclmul", "vpclmul")
                flags = " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(wanted))
    except OSError:
        pass
    return model, flags


def render(rows: dict[str, dict[str, float]], layout: list[str], eclib: str | None, isal, repeat: int) -> str:
    model, flags = cpu_description()
    cols = sorted({c for r in rows.values() for c in r}, key=lambda c: (c.split()[0] != "memsnap", c))
    out = [
        "# Reed-Solomon codec throughput",
        "",
        f"CPU: {model}, {os.cpu_count()} logical cores; flags: {flags}",
        f"memsnap ISA: {codec.isa()}; pyeclib backend: {eclib or 'unavailable'}; "
        f"ISA-L (ctypes): {'libisal ' if isal else 'unavailable'}",
        f"GB/s of data bytes, best of {repeat} interleaved rounds after a warm-up (1 MiB: "
        f"{repeat * 4} rounds of 3 back-to-back runs); every round runs every library in turn. `1t` columns: CPU time of the "
        "calling thread; `2t`: wall clock.",
        "",
        "| geometry | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for name, r in rows.items():
        out.append(f"| {name} | " + " | ".join(f"{r[c]:.2f}" if c in r else "-" for c in cols) + " |")
    out += [
        "",
        "## k=4 m=2, 64 MiB of data in 1 MiB shards, one thread, by stripe layout",
        "",
        "| layout | " + " | ".join(LAYOUT_COLUMNS) + " | memsnap/ISA-L enc / dec |",
        "|---" * (len(LAYOUT_COLUMNS) + 2) + "|",
        *layout,
        "",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds; the best counts")
    ap.add_argument("--quick", action="store_true", help="k=4 m=2 only, no results file")
    args = ap.parse_args()
    isal, eclib = load_isal(), pyeclib_backend()
    geoms = [(4, 2)] if args.quick else GEOMETRIES
    cases = [(k, m, size) for size in (MiB, 256 * MiB) for k, m in geoms]
    rows = {}
    for k, m, size in tqdm(cases, desc="codec bench", unit="case"):
        rows[f"{k}+{m} {size // MiB} MiB"] = measure(k, m, size, args.repeat, isal, eclib)
    layout = layout_check(args.repeat, isal, eclib)
    text = render(rows, layout, eclib, isal, args.repeat)
    print(text)
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
