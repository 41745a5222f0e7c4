"""Every durable read path (load, resharding load, verify, export, average) checks what verify
checks, reads only within the sizes COMMITTED records and fixed caps, and fails typed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memsnap
from memsnap.cli import main
from memsnap.commands.export import weights
from memsnap.commands.verify import verify_step
from memsnap.durable.storage import Store
from memsnap.errors import ChecksumError, FormatError, MemsnapError, StateMismatchError
from memsnap.state import reshard, validate
from memsnap.state.capture import capture
from memsnap.state.checksum import fill_checksums
from memsnap.state.manifest import Manifest, TensorEntry, align_up

PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))


def small_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def save_two_ranks(root: str, step: int) -> None:
    """``step`` saved by two ranks of plain (unsharded) state, as two processes would."""
    for rank in (1, 0):  # rank 0 commits, after rank 1 wrote its files
        memsnap.save(root, small_state(step * 10 + rank), step, rank=rank, world_size=2, barrier=lambda: None)


def resign(store: Store, step: int, rank: int, *, bin_raw: bytes | None = None, json_doc: dict | None = None) -> None:
    """Rewrite rank ``rank``'s files of ``step`` and their sizes and xxh3s in COMMITTED (a forger can)."""
    mpath = store.path(step, "COMMITTED")
    marker = json.loads(open(mpath, "rb").read())
    rec = marker["ranks"][rank]
    if bin_raw is not None:
        with open(store.path(step, f"rank_{rank:05d}.bin"), "wb") as f:
            f.write(bin_raw)
        rec.update(bin_bytes=len(bin_raw), bin_xxh3=xxhash.xxh3_64_hexdigest(bin_raw))
    if json_doc is not None:
        raw = json.dumps(json_doc).encode()
        with open(store.path(step, f"rank_{rank:05d}.json"), "wb") as f:
            f.write(raw)
        rec.update(json_bytes=len(raw), json_xxh3=xxhash.xxh3_64_hexdigest(raw))
    with open(mpath, "w") as f:
        json.dump(marker, f)


def readers(root: str, tmp_path) -> dict:
    """Each read path on step 1 of the two-rank checkpoint at ``root``: None if it refused the
    step as damaged, else what it produced."""
    out = {}
    rc = main(["verify", root])
    out["verify"] = None if rc else "OK"
    st_path = str(tmp_path / "w.safetensors")
    out["export"] = None if main(["export", root, "--safetensors", st_path]) == 2 else "exported"
    out["average"] = None if main(["average", root, "--last", "1", st_path]) == 2 else "averaged"
    for name, world in (("load", 2), ("load 2->1", 1)):
        try:
            memsnap.load(root, small_state(99), step=1, rank=0, world_size=world)
            out[name] = "loaded"
        except (ChecksumError, FormatError):
            out[name] = None
    return out


def pad_changed(raw: bytes, manifest: dict) -> bytes:
    """``raw`` with a byte of the padding after a tensor changed (every tensor intact)."""
    at = next(t["offset"] + t["nbytes"] for t in manifest["tensors"] if (t["offset"] + t["nbytes"]) % 64)
    return raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1 :]


@pytest.mark.parametrize("damage", ["padding", "symlink to a copy", "symlink to a changed copy"])
def test_every_reader_refuses_a_data_file_committed_does_not_vouch_for(tmp_path, capsys, damage):
    root = str(tmp_path / "ckpt")
    save_two_ranks(root, 1)
    store = Store.open(root)
    path = store.path(1, "rank_00000.bin")
    raw, doc = open(path, "rb").read(), json.loads(open(store.path(1, "rank_00000.json"), "rb").read())
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(raw if damage == "symlink to a copy" else pad_changed(raw, doc))
    os.unlink(path)
    if damage == "padding":
        shutil.copy(outside, path)
    else:
        os.symlink(outside, path)
    got = readers(root, tmp_path)
    capsys.readouterr()
    assert got == dict.fromkeys(["verify", "export", "average", "load", "load 2->1"])


def test_a_stored_tensor_without_a_checksum_is_damage_for_every_reader(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    save_two_ranks(root, 1)
    store = Store.open(root)
    doc = json.loads(open(store.path(1, "rank_00000.json"), "rb").read())
    raw = bytearray(open(store.path(1, "rank_00000.bin"), "rb").read())
    weight = next(t for t in doc["tensors"] if t["path"] == "model/weight")
    raw[weight["offset"]] ^= 0x40  # forged bytes, the checksum that would catch them removed
    del weight["checksum"]
    resign(store, 1, 0, bin_raw=bytes(raw), json_doc=doc)
    got = readers(root, tmp_path)
    assert "has no checksum" in capsys.readouterr().out
    assert got == dict.fromkeys(["verify", "export", "average", "load", "load 2->1"])


def test_write_rank_records_a_checksum_for_every_stored_tensor(tmp_path):
    state = small_state(1)
    man, buf = capture(state)  # no checksums
    assert all(t.checksum is None for t in man.tensors)
    store = Store.open(str(tmp_path))
    store.write_rank(3, 0, man, buf)
    store.commit(3, 1)
    on_disk = store.manifest(3, 0)
    assert on_disk.tensors == fill_checksums(man, buf).tensors
    assert memsnap.load(str(tmp_path), small_state(2)) == 3


# --- shards must tile their tensor ------------------------------------------------------------------
def sharded(whole: tuple, boxes: list) -> list[Manifest]:
    """One saved manifest per box: rank i holds ``boxes[i]`` = (offset, shape) of float32 ``whole``."""
    out = []
    for lo, shape in boxes:
        n = 4 * validate.numel(shape)
        e = TensorEntry(
            "model/w",
            "float32",
            tuple(shape),
            0,
            n,
            "0" * 16,
            global_shape=tuple(whole),
            global_offset=tuple(lo),
            placements=("Shard(0)",),
            mesh_shape=(len(boxes),),
        )
        out.append(Manifest([e], {"model": {"w": {"__tensor__": 0}}}, align_up(n)))
    return out


def write_sharded(root: str, whole: tuple, boxes: list) -> None:
    store = Store.open(root)
    for rank, man in enumerate(sharded(whole, boxes)):
        buf = (torch.arange(man.nbytes // 4, dtype=torch.float32) + 100 * rank).numpy().tobytes()
        store.write_rank(1, rank, fill_checksums(man, buf), buf)
    store.commit(1, len(boxes))


@pytest.mark.parametrize(
    "boxes",
    [
        [((0,), (4,)), ((1,), (4,))],  # overlap and a gap, the element counts adding up
        [((0,), (4,)), ((4,), (3,))],  # a gap
    ],
)
def test_shards_that_do_not_tile_the_tensor_are_damage(tmp_path, capsys, boxes):
    root = str(tmp_path / "ckpt")
    write_sharded(root, (8,), boxes)
    out_path = tmp_path / "w.safetensors"
    main(["verify", root])
    out = capsys.readouterr().out
    assert "step 1: DAMAGED" in out and "'model/w'" in out
    assert main(["export", root, "--safetensors", str(out_path)]) == 2
    assert "damaged checkpoint" in capsys.readouterr().err and not out_path.exists()


def test_shards_that_tile_the_tensor_export_whole(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    write_sharded(root, (8,), [((4,), (4,)), ((0,), (4,)), ((0,), (4,))])  # rank 2 a replica of rank 1
    assert main(["export", root, "--safetensors", str(tmp_path / "w.safetensors")]) == 0
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "w.safetensors"))["w"]
    assert torch.equal(got, torch.cat([torch.arange(4.0) + 100, torch.arange(4.0)]))


@st.composite
def box_sets(draw):
    """A global shape (1 or 2 dims) and saved boxes in it: an exact grid tiling (its boxes
    shuffled, some repeated as replicas) or arbitrary boxes."""
    whole = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
    if draw(st.booleans()):
        cuts = [sorted({0, n} | set(draw(st.lists(st.integers(0, n), max_size=3)))) for n in whole]
        grid = [[]]
        for c in cuts:
            grid = [g + [(a, b)] for g in grid for a, b in zip(c, c[1:])]
        boxes = [(tuple(a for a, _ in g), tuple(b - a for a, b in g)) for g in grid]
        boxes += draw(st.lists(st.sampled_from(boxes), max_size=2))
        return whole, draw(st.permutations(boxes))
    spans = [st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted) for n in whole]
    boxes = draw(st.lists(st.tuples(*spans), min_size=1, max_size=5))
    return whole, [(tuple(a for a, _ in b), tuple(z - a for a, z in b)) for b in boxes]


def exact_tiling(whole: tuple, boxes: list) -> bool:
    """Brute force: every element of ``whole`` in exactly one distinct box."""
    count = torch.zeros(whole, dtype=torch.int64)
    for lo, shape in set(boxes):
        count[tuple(slice(o, o + n) for o, n in zip(lo, shape))] += 1
    return bool((count == 1).all())


@PROPERTY
@given(box_sets())
def test_sources_accepts_exactly_the_tilings(case):
    whole, boxes = case
    saved = sharded(whole, boxes)
    live = TensorEntry(
        "model/w",
        "float32",
        whole,
        0,
        4 * validate.numel(whole),
        global_shape=whole,
        global_offset=(0,) * len(whole),
        placements=("Shard(0)",),
        mesh_shape=(1,),
    )
    if exact_tiling(whole, boxes):
        got = reshard.sources(live, saved)
        assert sum(validate.numel(box[1]) for _, _, box in got) == validate.numel(whole)
    else:
        with pytest.raises(FormatError):
            reshard.sources(live, saved)


def test_shards_of_another_dtype_or_global_shape_are_damage():
    saved = sharded((8,), [((0,), (4,)), ((4,), (4,))])
    live = TensorEntry(
        "model/w",
        "float32",
        (8,),
        0,
        32,
        global_shape=(8,),
        global_offset=(0,),
        placements=("Shard(0)",),
        mesh_shape=(1,),
    )
    assert len(reshard.sources(live, saved)) == 2
    for change in ({"dtype": "int32"}, {"global_shape": (9,)}):
        other = [
            saved[0],
            Manifest([TensorEntry(**{**saved[1].tensors[0].__dict__, **change})], saved[1].tree, saved[1].nbytes),
        ]
        with pytest.raises(FormatError, match="saved rank 1"):
            reshard.sources(live, other)
    with pytest.raises(StateMismatchError):  # the live state, not the checkpoint, is what differs
        reshard.sources(TensorEntry(**{**live.__dict__, "global_shape": (9,), "shape": (9,)}), saved)


# --- reads are bounded and never hang -----------------------------------------------------------------
@pytest.fixture
def two_steps(tmp_path):
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        memsnap.save(root, small_state(step), step)
    return root, Store.open(root)


def finishes(fn, unblock: str | None = None, deadline_s: float = 60.0):
    """``fn()``'s result, or a test failure if it is still running after ``deadline_s`` (a reader
    blocked on the FIFO ``unblock`` is then released, so the thread ends)."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        if unblock:
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        t.join(deadline_s)
        pytest.fail(f"{fn} still blocked after {deadline_s} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_a_fifo_as_a_manifest_is_damage_not_a_hang(two_steps, capsys, tmp_path):
    root, store = two_steps
    fifo = store.path(2, "rank_00000.json")
    os.unlink(fifo)
    os.mkfifo(fifo)

    def load():
        with pytest.warns(UserWarning, match="rank_00000.json is not a regular file.*falling back"):
            return memsnap.load(root, small_state(5))

    assert finishes(load, fifo) == 1
    assert finishes(lambda: main(["inspect", root]), fifo) == 2
    assert finishes(lambda: main(["export", root, "--safetensors", str(tmp_path / "x")]), fifo) == 2
    finishes(lambda: main(["verify", "--all", root]), fifo)
    assert "step 2: DAMAGED" in capsys.readouterr().out


BOUNDED = """
import json, resource, sys, warnings
from memsnap.cli import main
import memsnap, torch
vsz = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vsz + (1 << 30), resource.RLIM_INFINITY))  # 1 GiB more at most
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step = memsnap.load(sys.argv[1], {"model": model, "optim": torch.optim.AdamW(model.parameters())})
codes = [main([c, sys.argv[1]]) for c in ("ls", "inspect")]
print(json.dumps({"step": step, "codes": codes, "warned": [str(w.message) for w in caught]}))
"""


@pytest.mark.parametrize("damage", ["manifest -> /dev/zero", "sparse 3 GiB COMMITTED"])
def test_a_huge_or_endless_small_file_is_damage_within_a_memory_limit(two_steps, damage):
    root, store = two_steps
    if damage == "manifest -> /dev/zero":
        os.unlink(store.path(2, "rank_00000.json"))
        os.symlink("/dev/zero", store.path(2, "rank_00000.json"))
    else:
        os.truncate(store.path(2, "COMMITTED"), 3 << 30)
    proc = subprocess.run([sys.executable, "-c", BOUNDED, root], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    ls = 0 if damage.startswith("manifest") else 2  # ls reads markers only
    assert got["step"] == 1 and got["codes"] == [ls, 2], got  # falls back; the CLI says damaged
    assert any("falling back" in w for w in got["warned"])
    assert "Traceback" not in proc.stderr


def test_a_declared_size_is_checked_against_the_file_before_it_is_allocated(two_steps, capsys):
    root, store = two_steps
    doc = json.loads(open(store.path(2, "rank_00000.json"), "rb").read())
    doc["nbytes"] = 1 << 45  # 32 TiB claimed by a re-signed manifest and marker
    resign(store, 2, 0, json_doc=doc)
    marker = json.loads(open(store.path(2, "COMMITTED"), "rb").read())
    marker["ranks"][0]["bin_bytes"] = 1 << 45
    with open(store.path(2, "COMMITTED"), "w") as f:
        json.dump(marker, f)
    problems = verify_step(store, 2, store.marker(2))
    assert len(problems) == 1 and f"COMMITTED recorded {1 << 45}" in problems[0]
    with pytest.warns(UserWarning, match="falling back"):
        assert memsnap.load(root, small_state(5)) == 1


@pytest.mark.s3
def test_on_an_object_store_a_declared_size_is_checked_before_it_is_allocated():
    import boto3
    from support.s3server import moto_s3

    with moto_s3("reads") as endpoint:
        uri = "s3://reads/run"
        for step in (1, 2):
            memsnap.save(uri, small_state(step), step, endpoint=endpoint)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        key = "run/step_000000000002/"
        doc = json.loads(s3.get_object(Bucket="reads", Key=key + "rank_00000.json")["Body"].read())
        doc["nbytes"] = 1 << 45  # 32 TiB claimed by a re-signed manifest and marker
        raw = json.dumps(doc).encode()
        marker = json.loads(s3.get_object(Bucket="reads", Key=key + "COMMITTED")["Body"].read())
        marker["ranks"][0].update(bin_bytes=1 << 45, json_bytes=len(raw), json_xxh3=xxhash.xxh3_64_hexdigest(raw))
        s3.put_object(Bucket="reads", Key=key + "rank_00000.json", Body=raw)
        s3.put_object(Bucket="reads", Key=key + "COMMITTED", Body=json.dumps(marker).encode())
        with pytest.warns(UserWarning, match=f"COMMITTED recorded {1 << 45}.*falling back"):
            assert memsnap.load(uri, small_state(5), endpoint=endpoint) == 1


def test_a_huge_number_in_the_marker_is_damage(two_steps, capsys):
    root, store = two_steps
    marker = json.loads(open(store.path(2, "COMMITTED"), "rb").read())
    marker["ranks"][0]["bin_bytes"] = 10**4299  # 4300 digits: the most Python parses
    with open(store.path(2, "COMMITTED"), "w") as f:
        json.dump(marker, f)
    assert main(["ls", root]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].split()[:2] == ["2", "DAMAGED"] and "bin_bytes" in err
    assert main(["verify", "--all", root]) != 0
    assert "step 2: DAMAGED" in capsys.readouterr().out


def test_a_manifest_with_more_entries_than_the_cap_is_refused_before_it_is_built():
    assert validate.MAX_TENSORS >= 2 * 10**5  # a large MoE model with its optimizer state loads
    n = validate.MAX_TENSORS + 1
    entry = '{"path":"t","dtype":"uint8","shape":[0],"offset":0,"nbytes":0}'
    raw = ('{"version":1,"nbytes":0,"meta":{},"tensors":[' + ",".join([entry] * n) + '],"tree":null}').encode()
    built = []
    orig = TensorEntry.from_dict
    try:
        TensorEntry.from_dict = classmethod(lambda cls, d: built.append(1) or orig(d))
        with pytest.raises(FormatError, match=f"lists {n} entries"):
            Manifest.from_json(raw)
    finally:
        TensorEntry.from_dict = orig
    assert not built


# --- export and verify stay linear in the tensor count -----------------------------------------------
class Counted(list):
    """A tensor list that counts the entries read from it and fails past ``budget``."""

    def __init__(self, items, budget: int):
        super().__init__(items)
        self.reads, self.budget = 0, budget

    def _count(self, n: int) -> None:
        self.reads += n
        if self.reads > self.budget:
            raise AssertionError(f"read more than {self.budget} entries of a {len(self)}-entry manifest")

    def __iter__(self):
        for item in super().__iter__():
            self._count(1)
            yield item

    def __getitem__(self, i):
        self._count(1)
        return super().__getitem__(i)


def test_export_and_verify_read_each_entry_a_bounded_number_of_times(tmp_path, monkeypatch):
    n = 100_000
    entries = [TensorEntry(f"model/t{i}", "float32", (1,), 64 * i, 4) for i in range(n)]
    tree = {"model": {f"t{i}": {"__tensor__": i} for i in range(n)}}
    buf = torch.zeros(16 * n, dtype=torch.float32)
    buf[::16] = torch.arange(n, dtype=torch.float32)
    buf = buf.numpy().tobytes()
    man = fill_checksums(Manifest(entries, tree, 64 * n), buf)
    store = Store.open(str(tmp_path))
    store.write_rank(1, 0, man, buf)
    marker = store.commit(1, 1)
    orig = Manifest.from_json.__func__
    lists = []

    def counted(cls, raw, what="manifest"):
        m = orig(cls, raw, what)
        m.tensors = Counted(m.tensors, budget=20 * n)
        lists.append(m.tensors)
        return m

    monkeypatch.setattr(Manifest, "from_json", classmethod(counted))
    got = weights(store, 1, marker, None)
    assert len(got) == n and got["t77"].item() == 77.0
    assert verify_step(store, 1, marker) == []
    assert lists and all(c.reads <= c.budget for c in lists)


# --- CLI: one-line errors -----------------------------------------------------------------------------
def test_export_of_a_dtype_safetensors_lacks_is_one_line(tmp_path, capsys):
    model = torch.nn.Module()
    model.register_buffer("z", torch.zeros(3, dtype=torch.complex32))
    root = str(tmp_path / "ckpt")
    memsnap.save(root, {"model": model}, 1, weights_only=True)
    assert main(["export", root, "--safetensors", str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'z'" in err and "complex32" in err


def test_average_refuses_a_weight_whose_dtype_changes(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    for step, value in ((1, torch.tensor([10.0])), (2, torch.tensor([20])), (3, torch.tensor([15.0]))):
        model = torch.nn.Module()
        model.register_buffer("b", value)
        memsnap.save(root, {"model": model}, step, weights_only=True)
    assert main(["average", root, "--last", "3", str(tmp_path / "avg.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'b'" in err and "int64" in err and "float32" in err
    assert not (tmp_path / "avg.safetensors").exists()


# --- property: whatever the marker records and whatever sits where a file should, a typed outcome --------
KINDS = ["longer", "shorter", "symlink to rank 1", "fifo", "directory", "/dev/zero", "absent"]
SIZES = st.one_of(
    st.sampled_from([0, 1, 63, 64, 1 << 31, 1 << 45, (1 << 63) - 1, 1 << 63, 10**4299, -1]), st.integers(0, 1 << 20)
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reads") / "ckpt")
    memsnap.save(root, small_state(1), 1)
    save_two_ranks(root, 2)
    return root


@PROPERTY
@given(st.data())
def test_any_sizes_and_file_kinds_give_a_load_or_a_typed_refusal(pristine, tmp_path_factory, data):
    root = str(tmp_path_factory.mktemp("case") / "ckpt")
    shutil.copytree(pristine, root, symlinks=True)
    store = Store.open(root)
    marker = json.loads(open(store.path(2, "COMMITTED"), "rb").read())
    for _ in range(data.draw(st.integers(0, 2))):
        rec = marker["ranks"][data.draw(st.integers(0, 1))]
        rec[data.draw(st.sampled_from(["bin_bytes", "json_bytes"]))] = data.draw(SIZES)
    with open(store.path(2, "COMMITTED"), "w") as f:
        json.dump(marker, f)
    if data.draw(st.booleans()):
        name = data.draw(st.sampled_from(["rank_00000.bin", "rank_00000.json", "COMMITTED"]))
        damage_file(
            store.path(2, name), store.path(2, name.replace("00000", "00001")), data.draw(st.sampled_from(KINDS))
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for world in (1, 2):
            try:
                assert memsnap.load(root, small_state(7), rank=0, world_size=world) in (1, 2)
            except MemsnapError:
                pass
    with open(os.devnull, "w") as devnull:
        out, err = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = devnull
        try:
            for argv in (
                ["ls", root],
                ["inspect", root],
                ["verify", "--all", root],
                ["export", root, "--safetensors", os.path.join(root, "x.safetensors")],
            ):
                assert main(argv) in (0, 1, 2)
        finally:
            sys.stdout, sys.stderr = out, err


def damage_file(path: str, other: str, kind: str) -> None:
    raw = open(path, "rb").read()
    os.unlink(path)
    if kind == "longer":
        open(path, "wb").write(raw + b"\0" * 64)
    elif kind == "shorter":
        open(path, "wb").write(raw[: len(raw) // 2])
    elif kind == "symlink to rank 1":
        os.symlink(other if os.path.exists(other) else "/dev/null", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "/dev/zero":
        os.symlink("/dev/zero", path)
