"""The checks that the codec tests' GF(2^8) oracle (``support.gf_oracle``) is itself a field."""

from __future__ import annotations

from support.gf_oracle import gf_inv, gf_mul, rank


def test_oracle_multiplication_is_the_0x11d_field() -> None:
    assert gf_mul(0x80, 2) == 0x1D
    assert gf_mul(3, 7) == 9
    assert all(gf_mul(a, gf_inv(a)) == 1 for a in range(1, 256))
    powers = {1}
    x = 1
    for _ in range(254):
        x = gf_mul(x, 2)
        powers.add(x)
    assert len(powers) == 255  # 2 generates the multiplicative group


def test_oracle_rank() -> None:
    assert rank([[1, 2], [2, 4]]) == 1
    assert rank([[1, 0], [0, 1]]) == 2
