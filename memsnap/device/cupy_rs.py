"""Reed-Solomon coding on the GPU: a CuPy ``RawKernel`` byte-identical to ``native/``.

NOT YET RUN ON A GPU: the kernel has been compiled and checked only as C on the CPU
(``tests/test_cupy_rs.py`` builds ``KERNEL_CORE`` with the host compiler and compares its
output with ``memsnap.coding.codec`` byte for byte); ``bench/gpu.py`` and the ``gpu``-marked tests
run it under CUDA on the first machine with a GPU.

The code is the one of ``memsnap.coding.codec``: GF(2^8) with polynomial 0x11d, generator rows from
``_codec.generator`` (RAID-6 P/Q for ``m == 2``, a scaled Cauchy matrix otherwise), decode
rows from ``_codec.decode_matrix``, and the split-nibble product tables of
``_codec.tables``: 32 bytes per coefficient, ``t[n] = c*n`` and ``t[16+n] = c*(n<<4)``, so
``c*x = t[x & 15] ^ t[16 + (x >> 4)]``. The kernel copies the tables of one launch into
shared memory, and each thread takes one 32-bit word of every input shard at a time
(a grid-stride loop), looks up its four bytes and XORs them into up to ``MAX_ROWS`` output
words held in registers; the bytes past the last whole word are done one by one. More output
rows than ``MAX_ROWS`` run as several launches.

CuPy is imported on first use only (``pip install memsnap[gpu]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from memsnap import _codec
from memsnap.errors import CodecError, ShardSizeError, TooFewShardsError

MAX_ROWS = 8  # output rows per launch (registers per thread)
THREADS = 256

# The per-thread work, valid C as well as CUDA: the tests compile it for the CPU.
KERNEL_CORE = r"""
#define RS_MAX_ROWS 8
__device__ void rs_span(const unsigned char *t, const unsigned long long *in, const unsigned long long *out,
                        int k, int rows, long long nbytes, long long gid, long long stride)
{
    long long nwords = nbytes >> 2;
    for (long long w = gid; w < nwords; w += stride) {
        unsigned int acc[RS_MAX_ROWS];
        for (int j = 0; j < RS_MAX_ROWS; j++)
            acc[j] = 0;
        for (int i = 0; i < k; i++) {
            unsigned int d = ((const unsigned int *)in[i])[w];
            for (int j = 0; j < rows; j++) {
                const unsigned char *c = t + (j * k + i) * 32;
                acc[j] ^= (unsigned int)(c[d & 15] ^ c[16 + ((d >> 4) & 15)])
                        | (unsigned int)(c[(d >> 8) & 15] ^ c[16 + ((d >> 12) & 15)]) << 8
                        | (unsigned int)(c[(d >> 16) & 15] ^ c[16 + ((d >> 20) & 15)]) << 16
                        | (unsigned int)(c[(d >> 24) & 15] ^ c[16 + (d >> 28)]) << 24;
            }
        }
        for (int j = 0; j < rows; j++)
            ((unsigned int *)out[j])[w] = acc[j];
    }
    for (long long b = (nwords << 2) + gid; b < nbytes; b += stride) {
        for (int j = 0; j < rows; j++) {
            unsigned char a = 0;
            for (int i = 0; i < k; i++) {
                unsigned char x = ((const unsigned char *)in[i])[b];
                const unsigned char *c = t + (j * k + i) * 32;
                a ^= c[x & 15] ^ c[16 + (x >> 4)];
            }
            ((unsigned char *)out[j])[b] = a;
        }
    }
}
"""

KERNEL = (
    KERNEL_CORE
    + r"""
extern "C" __global__ void rs_apply(const unsigned char *tables, const unsigned long long *in,
                                    const unsigned long long *out, int k, int rows, long long nbytes)
{
    extern __shared__ unsigned char t[];
    for (int x = threadIdx.x; x < rows * k * 32; x += blockDim.x)
        t[x] = tables[x];
    __syncthreads();
    rs_span(t, in, out, k, rows, nbytes,
            (long long)blockIdx.x * blockDim.x + threadIdx.x, (long long)gridDim.x * blockDim.x);
}
"""
)


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415 (optional extra)
    except ImportError:
        raise CodecError(
            "GPU erasure coding needs CuPy: pip install 'memsnap[gpu]' (cupy-cuda12x); "
            "memsnap.coding.codec codes on the CPU without it"
        ) from None
    return cupy


_kernels: dict[int, Any] = {}


def _kernel(cp: Any) -> Any:
    dev = cp.cuda.Device().id
    if dev not in _kernels:
        _kernels[dev] = cp.RawKernel(KERNEL, "rs_apply")
    return _kernels[dev]


class CupyReedSolomon:
    """``ReedSolomon(k, m)`` of ``memsnap.coding.codec`` on CuPy device arrays (``uint8``, 1-D,
    contiguous, all shards of a call on the current device and of one length)."""

    def __init__(self, k: int, m: int):
        if not (isinstance(k, int) and isinstance(m, int)) or k < 1 or m < 0 or k + m > 256:
            raise CodecError(f"k={k!r}, m={m!r} out of range: need 1 <= k, 0 <= m and k + m <= 256")
        self.k, self.m = k, m
        self._parity = _codec.generator(k, m)
        self._full = np.eye(k, dtype=np.uint8).tobytes() + self._parity
        self._dev_tables: dict[bytes, Any] = {}

    def encode(self, data: Sequence[Any]) -> list[Any]:
        cp = _cupy()
        parity = [cp.empty(_length(data), dtype=cp.uint8) for _ in range(self.m)]
        self.encode_into(data, parity)
        return parity

    def encode_into(self, data: Sequence[Any], parity: Sequence[Any]) -> None:
        _count(data, self.k, "data shards")
        _count(parity, self.m, "parity buffers")
        self._apply(self._parity, self.m, list(data), list(parity))

    def reconstruct(self, shards: Sequence[Any], *, data_only: bool = False) -> list[Any]:
        """All ``k + m`` shards, the ``None`` ones rebuilt from the first ``k`` present."""
        cp = _cupy()
        _count(shards, self.k + self.m, "shards (k + m)")
        lost = [i for i, s in enumerate(shards) if s is None]
        present = [i for i, s in enumerate(shards) if s is not None]
        if len(present) < self.k:
            raise TooFewShardsError(
                f"only {len(present)} of {self.k + self.m} shards present; at least "
                f"k={self.k} are needed to rebuild a stripe"
            )
        used = present[: self.k]
        wanted = [i for i in lost if i < self.k] if data_only else lost
        out = list(shards)
        if not wanted:
            return out
        coef = _codec.decode_matrix(self._full, self.k, tuple(used), tuple(wanted))
        length = _length([shards[i] for i in used])
        rebuilt = [cp.empty(length, dtype=cp.uint8) for _ in wanted]
        self._apply(coef, len(wanted), [shards[i] for i in used], rebuilt)
        for i, arr in zip(wanted, rebuilt):
            out[i] = arr
        return out

    def _apply(self, coef: bytes, rows: int, inputs: list[Any], outputs: list[Any]) -> None:
        cp = _cupy()
        length = _length(inputs + outputs)
        if not rows or not length:
            return
        aligned = all(a.data.ptr % 4 == 0 for a in inputs + outputs)
        if not aligned:
            raise ShardSizeError("GPU coding needs every shard to start on a 4-byte boundary")
        ins = cp.asarray(np.array([a.data.ptr for a in inputs], dtype=np.uint64))
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        blocks = max(1, min(-(-(length // 4 or 1) // THREADS), sms * 16))
        for r0 in range(0, rows, MAX_ROWS):
            r = min(MAX_ROWS, rows - r0)
            part = coef[r0 * self.k : (r0 + r) * self.k]
            tables = self._tables(cp, part)
            outs = cp.asarray(np.array([a.data.ptr for a in outputs[r0 : r0 + r]], dtype=np.uint64))
            _kernel(cp)(
                (blocks,),
                (THREADS,),
                (tables, ins, outs, np.int32(self.k), np.int32(r), np.int64(length)),
                shared_mem=r * self.k * 32,
            )

    def _tables(self, cp: Any, coef: bytes) -> Any:
        if coef not in self._dev_tables:  # decode plans repeat per loss pattern
            self._dev_tables[coef] = cp.asarray(np.frombuffer(_codec.tables(coef), dtype=np.uint8))
        return self._dev_tables[coef]


def _count(items: Sequence[Any], expected: int, what: str) -> None:
    if len(items) != expected:
        raise CodecError(f"expected {expected} {what}, got {len(items)}")


def _length(arrays: Sequence[Any]) -> int:
    sizes = {int(a.nbytes) for a in arrays}
    if len(sizes) > 1:
        raise ShardSizeError(f"shards of one stripe must have one length, got {sorted(sizes)} bytes")
    for a in arrays:
        if a.ndim != 1 or str(a.dtype) != "uint8" or not a.flags.c_contiguous:
            raise ShardSizeError(f"GPU shards must be 1-D contiguous uint8 arrays, got {a.dtype} {a.shape}")
    return sizes.pop() if sizes else 0
