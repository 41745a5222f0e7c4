"""An independent pure-Python GF(2^8) oracle for the codec tests (no memsnap code involved).
(No tests here: ``tests/test_codec_oracle.py`` checks that the oracle itself is a field.)"""

from __future__ import annotations

import functools

import numpy as np

POLY = 0x11D


def gf_mul(a: int, b: int) -> int:
    """Carry-less multiply modulo x^8 + x^4 + x^3 + x^2 + 1, bit by bit."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        a <<= 1
        if a & 0x100:
            a ^= POLY
        b >>= 1
    return out


@functools.cache
def gf_inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return next(b for b in range(1, 256) if gf_mul(a, b) == 1)


@functools.cache
def mul_table() -> np.ndarray:
    return np.array([[gf_mul(a, b) for b in range(256)] for a in range(256)], dtype=np.uint8)


def generator(k: int, m: int) -> list[list[int]]:
    """The documented generator: RAID-6 P+Q for m == 2, else a doubly normalised Cauchy matrix."""
    if m == 2:
        q, row = 1, []
        for _ in range(k):
            row.append(q)
            q = gf_mul(q, 2)
        return [[1] * k, row]
    g = [[gf_inv((k + j) ^ i) for i in range(k)] for j in range(m)]
    for i in range(k):
        s = gf_inv(g[0][i])
        for j in range(m):
            g[j][i] = gf_mul(g[j][i], s)
    for j in range(m):
        s = gf_inv(g[j][0])
        g[j] = [gf_mul(x, s) for x in g[j]]
    return g


def matvec(rows: list[list[int]], shards: list[np.ndarray]) -> list[np.ndarray]:
    """out[j] = sum_i rows[j][i] * shards[i], with numpy lookups into the oracle's table."""
    table = mul_table()
    outs = []
    for row in rows:
        acc = np.zeros(len(shards[0]), dtype=np.uint8)
        for c, s in zip(row, shards):
            acc ^= table[c][s]
        outs.append(acc)
    return outs


def rank(matrix: list[list[int]]) -> int:
    """Rank over GF(2^8) by Gaussian elimination."""
    a = [list(r) for r in matrix]
    r = 0
    for c in range(len(a[0]) if a else 0):
        pivot = next((i for i in range(r, len(a)) if a[i][c]), None)
        if pivot is None:
            continue
        a[r], a[pivot] = a[pivot], a[r]
        s = gf_inv(a[r][c])
        a[r] = [gf_mul(x, s) for x in a[r]]
        for i in range(len(a)):
            if i != r and a[i][c]:
                f = a[i][c]
                a[i] = [x ^ gf_mul(f, y) for x, y in zip(a[i], a[r])]
        r += 1
    return r
