"""A numpy reference of the GPU kernel's arithmetic, derived without the native codec.

GF(2^8) with polynomial 0x11d built here from scratch, the generator rows of
``native/gf256.c`` re-derived, the split-nibble tables in the kernel's layout (32 bytes per
coefficient: ``t[n] = c*n``, ``t[16+n] = c*(n<<4)``), and ``apply_words``, which does per
32-bit word exactly what a thread of ``memsnap.device.cupy_rs.KERNEL`` does (four nibble-pair
lookups XORed into each output word; the bytes past the last whole word one by one). The
tests hold all of it to ``memsnap.coding.codec`` byte for byte, on any machine.
"""

from __future__ import annotations

import numpy as np

POLY = 0x11D


def _exp_log() -> tuple[np.ndarray, np.ndarray]:
    exp, log = np.zeros(512, dtype=np.int64), np.zeros(256, dtype=np.int64)
    x = 1
    for i in range(255):
        exp[i], log[x] = x, i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    exp[255:510] = exp[:255]
    return exp, log


EXP, LOG = _exp_log()


def mul(a: int, b: int) -> int:
    return 0 if a == 0 or b == 0 else int(EXP[LOG[a] + LOG[b]])


def inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(EXP[255 - LOG[a]])


def generator(k: int, m: int) -> np.ndarray:
    """The ``m x k`` parity rows of ``native/gf256.c``'s ``gf_generator``."""
    g = np.zeros((m, k), dtype=np.uint8)
    if m == 0:
        return g
    if m == 2:
        g[0, :] = 1
        g[1, :] = [int(EXP[i % 255]) for i in range(k)]
        return g
    for j in range(m):
        for i in range(k):
            g[j, i] = inv((k + j) ^ i)
    for i in range(k):  # columns: row 0 all ones
        s = inv(int(g[0, i]))
        for j in range(m):
            g[j, i] = mul(int(g[j, i]), s)
    for j in range(m):  # rows: column 0 all ones
        s = inv(int(g[j, 0]))
        for i in range(k):
            g[j, i] = mul(int(g[j, i]), s)
    return g


def nibble_tables(coef: np.ndarray) -> np.ndarray:
    """``(len(coef), 32)`` tables: ``[c*n for n < 16] + [c*(n << 4) for n < 16]``."""
    flat = np.asarray(coef, dtype=np.uint8).reshape(-1)
    out = np.zeros((flat.size, 32), dtype=np.uint8)
    for r, c in enumerate(flat):
        out[r, :16] = [mul(int(c), n) for n in range(16)]
        out[r, 16:] = [mul(int(c), n << 4) for n in range(16)]
    return out


def apply_words(tables: np.ndarray, rows: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """``rows`` outputs from ``k = len(inputs)`` equal-length ``uint8`` inputs, computed as the
    kernel does: ``tables`` is ``(rows * k, 32)``, row-major by output row then input."""
    k, n = len(inputs), len(inputs[0])
    words = n // 4
    t = tables.reshape(rows, k, 32).astype(np.uint32)
    out = []
    for j in range(rows):
        acc = np.zeros(words, dtype=np.uint32)
        tail = np.zeros(n - 4 * words, dtype=np.uint8)
        for i in range(k):
            d = np.frombuffer(inputs[i][: 4 * words].tobytes(), dtype="<u4")
            lo, hi = t[j, i, :16], t[j, i, 16:]
            for shift in (0, 8, 16, 24):
                acc ^= (lo[(d >> shift) & 15] ^ hi[(d >> (shift + 4)) & 15]) << shift
            x = inputs[i][4 * words :]
            tail ^= (lo[x & 15] ^ hi[x >> 4]).astype(np.uint8)
        out.append(np.concatenate([acc.astype("<u4").view(np.uint8), tail]))
    return out
