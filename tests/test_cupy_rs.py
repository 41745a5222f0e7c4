"""The GPU Reed-Solomon kernel against ``memsnap.coding.codec``, byte for byte.

Without a GPU: the numpy reference of the kernel's arithmetic (``memsnap.device.gf_ref``), and
the kernel's own per-thread code (``cupy_rs.KERNEL_CORE``) compiled as C by the host compiler
and run over an emulated grid. With a GPU (``gpu`` marker): the CuPy kernel itself.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sysconfig

import numpy as np
import pytest

from memsnap import _codec
from memsnap.coding import codec
from memsnap.device import cupy_rs, gf_ref

GEOMETRIES = [(1, 1), (2, 1), (3, 2), (4, 2), (6, 3), (8, 2), (10, 4), (4, 9), (2, 0)]
LENGTHS = [0, 1, 3, 4, 5, 63, 64, 65, 1001, 4096]


def _shards(seed: int, count: int, length: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(count)]


def _decode_cases(k: int, m: int) -> list[tuple[int, ...]]:
    n = k + m
    lost = [tuple(range(min(m, k))), tuple(range(n - m, n)), tuple(range(0, n, max(1, n // max(m, 1))))[:m]]
    return sorted({c for c in lost if len(c) <= m})


def test_reference_field_generator_and_tables_match_native() -> None:
    for k, m in GEOMETRIES:
        assert gf_ref.generator(k, m).tobytes() == _codec.generator(k, m), (k, m)
    coef = np.arange(256, dtype=np.uint8)
    assert gf_ref.nibble_tables(coef).tobytes() == _codec.tables(coef.tobytes())
    assert all(gf_ref.mul(a, gf_ref.inv(a)) == 1 for a in range(1, 256))


@pytest.mark.parametrize("k,m", GEOMETRIES)
def test_reference_kernel_arithmetic_encodes_and_decodes_like_the_codec(k: int, m: int) -> None:
    rs = codec.ReedSolomon(k, m)
    tables = gf_ref.nibble_tables(np.frombuffer(_codec.generator(k, m), np.uint8))
    for length in LENGTHS:
        data = _shards(k * 1000 + length, k, length)
        want = rs.encode(data)
        got = gf_ref.apply_words(tables, m, data) if m else []
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want], (k, m, length)
        full = data + want
        for lost in _decode_cases(k, m):
            shards = [None if i in lost else s for i, s in enumerate(full)]
            used = tuple(i for i in range(k + m) if i not in lost)[:k]
            coef = _codec.decode_matrix(np.eye(k, dtype=np.uint8).tobytes() + _codec.generator(k, m), k, used, lost)
            back = gf_ref.apply_words(
                gf_ref.nibble_tables(np.frombuffer(coef, np.uint8)), len(lost), [full[i] for i in used]
            )
            assert [b.tobytes() for b in back] == [full[i].tobytes() for i in lost], (k, m, length, lost)
            assert [rs.reconstruct(shards)[i].tobytes() for i in lost] == [b.tobytes() for b in back]


@pytest.fixture(scope="module")
def kernel_as_c(tmp_path_factory):
    """``KERNEL_CORE`` built as a host shared library, with a driver that runs every
    (emulated) thread of a grid of ``stride`` threads."""
    cc = (
        shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
        or shutil.which("cc")
        or shutil.which("gcc")
    )
    if cc is None:
        pytest.skip("no C compiler to build the kernel's code for the CPU")
    d = tmp_path_factory.mktemp("kernel")
    src = d / "kernel.c"
    src.write_text(
        "#define __device__ static\n"
        + cupy_rs.KERNEL_CORE
        + r"""
void run(const unsigned char *t, const unsigned long long *in, const unsigned long long *out,
         int k, int rows, long long nbytes, long long stride)
{
    for (long long gid = 0; gid < stride; gid++)
        rs_span(t, in, out, k, rows, nbytes, gid, stride);
}
"""
    )
    lib = d / "kernel.so"
    subprocess.run(
        [cc, "-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(lib), str(src)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    run = ctypes.CDLL(str(lib)).run
    run.restype = None
    run.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return run


def _run_kernel(run, coef: bytes, rows: int, inputs: list[np.ndarray], stride: int) -> list[np.ndarray]:
    length = len(inputs[0])
    outs = [np.full(length, 0xEE, np.uint8) for _ in range(rows)]
    tables = np.frombuffer(_codec.tables(coef), np.uint8)
    ins = np.array([a.ctypes.data for a in inputs], np.uint64)
    ptrs = np.array([a.ctypes.data for a in outs], np.uint64)
    run(tables.ctypes.data, ins.ctypes.data, ptrs.ctypes.data, len(inputs), rows, length, stride)
    return outs


@pytest.mark.parametrize("k,m", [g for g in GEOMETRIES if 0 < g[1] <= cupy_rs.MAX_ROWS])
def test_kernel_code_compiled_for_the_cpu_matches_the_codec(kernel_as_c, k: int, m: int) -> None:
    rs = codec.ReedSolomon(k, m)
    full_gen = np.eye(k, dtype=np.uint8).tobytes() + _codec.generator(k, m)
    for length in LENGTHS:
        data = _shards(k * 7 + length, k, length)
        want = rs.encode(data)
        for stride in (1, 3, 256):  # grid-stride loops of several shapes, the tail bytes included
            got = _run_kernel(kernel_as_c, _codec.generator(k, m), m, data, stride)
            assert [g.tobytes() for g in got] == [w.tobytes() for w in want], (k, m, length, stride)
        full = data + want
        for lost in _decode_cases(k, m):
            used = tuple(i for i in range(k + m) if i not in lost)[:k]
            coef = _codec.decode_matrix(full_gen, k, used, lost)
            back = _run_kernel(kernel_as_c, coef, len(lost), [full[i] for i in used], 5)
            assert [b.tobytes() for b in back] == [full[i].tobytes() for i in lost], (k, m, length, lost)


def test_without_cupy_the_gpu_codec_says_how_to_get_it(monkeypatch) -> None:
    import builtins

    real = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    rs = cupy_rs.CupyReedSolomon(4, 2)  # constructing needs no CuPy
    with pytest.raises(codec.CodecError, match=r"memsnap\[gpu\]"):
        rs.encode([np.zeros(8, np.uint8)] * 4)
    with pytest.raises(codec.CodecError, match="out of range"):
        cupy_rs.CupyReedSolomon(0, 1)


# --- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (8, 2), (10, 4), (4, 9)])
def test_cupy_kernel_is_byte_identical_to_the_codec(k: int, m: int) -> None:
    cp = pytest.importorskip("cupy")
    rs, gpu = codec.ReedSolomon(k, m), cupy_rs.CupyReedSolomon(k, m)
    for length in (1, 5, 4096, (1 << 20) + 3):
        data = _shards(length + k, k, length)
        want = rs.encode(data)
        dev = [cp.asarray(d) for d in data]
        got = gpu.encode(dev)
        assert [cp.asnumpy(g).tobytes() for g in got] == [w.tobytes() for w in want], (k, m, length)
        full = dev + got
        for lost in _decode_cases(k, m):
            back = gpu.reconstruct([None if i in lost else s for i, s in enumerate(full)])
            assert all(cp.asnumpy(back[i]).tobytes() == (data + want)[i].tobytes() for i in lost), lost
