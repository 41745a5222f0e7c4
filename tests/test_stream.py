"""stream.TensorStream and Store.write_rank_stream: the data file written straight from the
tensors is byte for byte the captured buffer, with the same checksums, and loads verified."""

from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash

import memsnap
from memsnap.durable import localfs
from memsnap.durable.storage import Store
from memsnap.errors import ChecksumError
from memsnap.state.capture import capture, fill_checksums, plan_sources
from memsnap.state.stream import TensorStream

PIECE, SMALL = 4096, 1024  # tiny, so a small state takes every path: gathered, sliced, padded


def awkward_state() -> dict:
    """Tensors of every kind the stream treats differently."""
    torch.manual_seed(0)
    big = torch.randn(64, 100)  # 25,600 bytes: written from its own memory, in several pieces
    shared = torch.randn(7)
    values = {
        "big": big,
        "transposed": big.t(),  # not contiguous: made contiguous on the side
        "slice": big[3:5, 1:9],  # a view with a storage offset
        "tied": shared,
        "tied_again": shared,  # stored once, the second an alias
        "empty": torch.empty(0, 3),
        "odd": torch.arange(13, dtype=torch.uint8),  # 13 bytes: padding after it
        "half": torch.randn(33).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "conj": torch.randn(5, dtype=torch.complex64).conj(),  # a lazily conjugated view
        "neg": torch.randn(6)._neg_view(),  # a lazily negated view
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "exact": torch.randn(256),  # exactly SMALL bytes: the large path with one piece
    }
    return {"values": values}


def stream_of(state: dict) -> TensorStream:
    layout, sources = plan_sources(state)
    return TensorStream(layout, sources, piece=PIECE, small=SMALL)


def test_stream_bytes_and_checksums_equal_the_capture():
    state = awkward_state()
    stream = stream_of(state)
    pieces = list(stream)  # held, not copied: no piece may be reused for a later one
    written = b"".join(bytes(p) for p in pieces)
    manifest, buf = capture(state, checksums=True)
    assert written == bytes(buf)
    assert len(written) == stream.nbytes == manifest.nbytes
    assert [e.checksum for e in stream.manifest().tensors] == [e.checksum for e in manifest.tensors]
    assert max(p.nbytes for p in pieces) <= PIECE
    by_path = {e.path: e for e in stream.manifest().tensors}
    assert by_path["values/tied_again"].alias_of == "values/tied" and by_path["values/tied_again"].checksum is None
    assert by_path["values/empty"].checksum == xxhash.xxh3_64_hexdigest(b"")


def test_the_default_piece_sizes_give_the_same_bytes():
    state = awkward_state()
    layout, sources = plan_sources(state)
    stream = TensorStream(layout, sources)
    _, buf = capture(state)
    assert b"".join(bytes(p) for p in stream) == bytes(buf)


def test_checksums_are_unknown_until_the_stream_was_written():
    stream = stream_of(awkward_state())
    with pytest.raises(RuntimeError, match="not been written"):
        stream.manifest()


def test_write_rank_stream_writes_the_capture_buffer_and_its_checksums(tmp_path):
    state = awkward_state()
    store = Store.open(str(tmp_path))
    rec = store.write_rank_stream(1, 0, stream_of(state))
    store.commit(1, 1)
    manifest, buf = capture(state, checksums=True)
    data = (tmp_path / "step_000000000001" / "rank_00000.bin").read_bytes()
    assert data == bytes(buf)
    assert rec.bin_xxh3 == xxhash.xxh3_64_hexdigest(bytes(buf)) and rec.bin_bytes == len(data)
    on_disk = json.loads((tmp_path / "step_000000000001" / "rank_00000.json").read_bytes())
    assert [t.get("checksum") for t in on_disk["tensors"]] == [e.checksum for e in manifest.tensors]
    out = memoryview(bytearray(rec.bin_bytes))
    store.read_rank_into(1, 0, out)  # whole-file xxh3 checked against COMMITTED
    assert fill_checksums(store.manifest(1, 0), out).tensors == store.manifest(1, 0).tensors


def test_a_stream_that_comes_short_leaves_no_file(tmp_path):
    class Short:
        nbytes = 100

        def __iter__(self):
            yield memoryview(b"x" * 60)

        def manifest(self):
            raise AssertionError("never asked: the data file failed")

    store = Store.open(str(tmp_path))
    with pytest.raises(ValueError, match="60 bytes, 100"):
        store.write_rank_stream(1, 0, Short())
    assert os.listdir(tmp_path / "step_000000000001") == []


def test_writeback_is_started_along_the_file_and_the_file_is_intact(tmp_path, monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    real = localfs._SYNC_FILE_RANGE

    def record(fd, off, n, flags):
        calls.append((off, n))
        return real(fd, off, n, flags) if real else 0

    monkeypatch.setattr(localfs, "WRITEBACK", 8192)
    monkeypatch.setattr(localfs, "_SYNC_FILE_RANGE", record)
    state = awkward_state()
    rec = Store.open(str(tmp_path)).write_rank_stream(1, 0, stream_of(state))
    _, buf = capture(state)
    assert (tmp_path / "step_000000000001" / "rank_00000.bin").read_bytes() == bytes(buf)
    restarts = [i for i, (off, _) in enumerate(calls) if off == 0] + [len(calls)]
    ranges = calls[: restarts[1]]  # the data file's (the manifest, written next, starts at 0 again)
    assert ranges[0][0] == 0 and all(n >= 8192 for _, n in ranges)
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))  # consecutive ranges
    assert ranges[-1][0] + ranges[-1][1] <= rec.bin_bytes


def test_save_writes_from_the_tensors_and_loads_bitwise_verified(tmp_path):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LayerNorm(200))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 300)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    memsnap.save(str(tmp_path), state, 3)
    _, buf = capture(state)
    bin_path = tmp_path / "step_000000000003" / "rank_00000.bin"
    assert bin_path.read_bytes()[: 300 * 200 * 4] == bytes(buf)[: 300 * 200 * 4]  # the first tensor, raw

    torch.manual_seed(2)
    fresh = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LayerNorm(200))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert memsnap.load(str(tmp_path), {"model": fresh, "optim": fresh_optim}) == 3
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    for a, b in zip(optim.state.values(), fresh_optim.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)

    data = bytearray(bin_path.read_bytes())
    data[100] ^= 1
    bin_path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        memsnap.load(str(tmp_path), {"model": fresh, "optim": fresh_optim}, step=3)


@pytest.mark.gpu
def test_cuda_tensors_are_copied_to_the_host_one_at_a_time_and_give_the_capture_bytes():
    state = {
        "values": {
            "w": torch.randn(300, 70, device="cuda"),
            "t": torch.randn(40, 30, device="cuda").t(),
            "b": torch.randn(9, device="cuda").to(torch.bfloat16),
        }
    }
    stream = stream_of(state)
    written = b"".join(bytes(p) for p in stream)
    manifest, buf = capture(state, checksums=True)
    assert written == bytes(buf)
    assert [e.checksum for e in stream.manifest().tensors] == [e.checksum for e in manifest.tensors]
