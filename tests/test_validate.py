"""Every parser is total: mutated real manifests, skeletons, markers and wire headers give a
memsnap error or a correct load, never another exception and never a crash."""

from __future__ import annotations

import copy
import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.forge import forge_manifest

import memsnap
from memsnap.cli import main
from memsnap.durable.storage import Store
from memsnap.errors import FormatError, MemsnapError
from memsnap.localcluster import free_port
from memsnap.state import tree, validate
from memsnap.state.apply import apply
from memsnap.state.capture import capture
from memsnap.state.manifest import Manifest
from memsnap.transport import wire

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
FAST_DISK = settings(FAST, max_examples=15)  # each example loads a checkpoint and runs the CLI
SLOW = settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
SLOW_APPLY = settings(SLOW, max_examples=3000)  # each example applies a 1,000-tensor state
SLOW_DISK = settings(SLOW, max_examples=1000)  # each example loads a checkpoint and runs the CLI
LONG = pytest.mark.timeout(1800)


# --- a real state: a small Llama-like model after one AdamW step ---------------------------------
class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(d, 2 * d, bias=False)
        self.down = torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        h = self.attn_norm(x)
        x = x + self.o(torch.softmax(self.q(h) @ self.k(h).T, -1) @ self.v(h))
        h = self.mlp_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class Llama(torch.nn.Module):
    def __init__(self, blocks: int = 28, d: int = 8, vocab: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: an alias entry in the manifest

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def llama_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = Llama()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(6)).logsumexp(-1).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "step": seed, "cfg": {"lr": 1e-3, "betas": (0.9, 0.95)}}


def tensors_of(state: dict) -> dict:
    out = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.clone() for k, v in s.items()})
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def real():
    """The captured manifest and buffer of a Llama-like state, and a live state to apply into."""
    state = llama_state(1)
    man, buf = capture(state, checksums=True)
    assert len(man.tensors) >= 1000 and any(t.alias_of for t in man.tensors)
    return {
        "manifest": man,
        "raw": man.to_json(),
        "doc": json.loads(man.to_json()),
        "buf": bytes(buf),
        "live": llama_state(2),
        "want": tensors_of(state),
    }


# --- mutations of JSON documents ------------------------------------------------------------------
NASTY = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-4096, -1, 0, 1, 63, 64, 2**31, 2**63, 2**64, 10**30]),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(
        [
            "float32",
            "bfloat16",
            "int64",
            "Shard(5)",
            "Replicate()",
            "cuda:0",
            "__tensor__",
            "model/embed.weight",
            "0" * 16,
            "inf",
            "nan",
        ]
    ),
    st.lists(st.integers(-2, 2**40), max_size=4),
    st.sampled_from(
        [
            {"__tensor__": 0},
            {"__tensor__": -1},
            {"__tensor__": 10**6},
            {"__tuple__": 3},
            {"__dict__": [[[], 1]]},
            {"__dict__": [[{"a": 1}, 1]]},
            {"__ndarray__": ["<f4", [2], "AAAA"]},
            {"__npscalar__": ["O", ""]},
            {"__bytes__": "!!"},
            {"__device__": "cuda:-1"},
            {"__float__": "1.5"},
            {"__size__": [-1]},
            {"__dtype__": "qint8"},
            [[[[]]]],
            {},
        ]
    ),
)


def paths_of(doc, prefix=()):
    """Every location in a JSON document, as a tuple of keys/indices."""
    yield prefix
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield from paths_of(v, prefix + (k,))


_PATHS: dict[tuple, list] = {}


def all_paths(doc, focus=None) -> list:
    """The locations of a fixture document (those under the key ``focus``), listed once."""
    if (id(doc), focus) not in _PATHS:
        _PATHS[id(doc), focus] = [p for p in paths_of(doc) if focus is None or p[:1] == (focus,)]
    return _PATHS[id(doc), focus]


def mutate(doc, path: tuple, how: str, value):
    """``doc`` with the value at ``path`` replaced, deleted, or wrapped in a list; only the
    containers along ``path`` are copied."""
    if not path:
        return value
    doc = copy.copy(doc)
    if len(path) > 1:
        doc[path[0]] = mutate(doc[path[0]], path[1:], how, value)
    elif how == "delete":
        del doc[path[0]]
    else:
        doc[path[0]] = [doc[path[0]]] if how == "wrap" else value
    return doc


@st.composite
def mutated_doc(draw, doc, focus=None):
    """One or two changes at locations of ``doc`` (a second one where the first left it valid)."""
    paths = all_paths(doc, focus)
    out = mutate(
        doc, draw(st.sampled_from(paths)), draw(st.sampled_from(["set", "set", "delete", "wrap"])), draw(NASTY)
    )
    if draw(st.booleans()):
        try:
            out = mutate(out, draw(st.sampled_from(paths)), "set", draw(NASTY))
        except (KeyError, IndexError, TypeError):
            pass  # the first change removed that location
    return out


@st.composite
def layout_shift(draw, doc):
    """Plausible-looking damage: one entry's offset, nbytes, shape or alias moved."""
    i = draw(st.integers(0, len(doc["tensors"]) - 1))
    doc = dict(doc, tensors=list(doc["tensors"]))
    e = doc["tensors"][i] = dict(doc["tensors"][i])
    field = draw(st.sampled_from(["offset", "nbytes", "shape", "alias_of", "dtype"]))
    if field in ("offset", "nbytes"):
        e[field] = e[field] + 64 * draw(st.integers(-(10**4), 10**4))
    elif field == "shape":
        e["shape"] = draw(st.lists(st.integers(0, 64), max_size=3))
    elif field == "alias_of":
        e["alias_of"] = draw(st.sampled_from([t["path"] for t in doc["tensors"]]))
        e["nbytes"] = draw(st.sampled_from([0, e["nbytes"]]))
    else:
        e["dtype"] = draw(st.sampled_from(list(validate.ITEMSIZE)))
    e.pop("checksum", None)
    return doc


def byte_flip(raw: bytes):
    return st.tuples(st.integers(0, len(raw) - 1), st.binary(max_size=4)).map(
        lambda t: raw[: t[0]] + t[1] + raw[t[0] + 1 :]
    )


def parse_and_apply(raw: bytes, real: dict) -> None:
    """A memsnap error, or an apply that leaves the live state holding the snapshot's bytes."""
    try:
        man = Manifest.from_json(raw)
        apply(real["live"], man, real["buf"], verify=False)
    except MemsnapError:
        return
    if man.tensors == real["manifest"].tensors and man.tree == real["manifest"].tree:
        assert same(tensors_of(real["live"]), real["want"])


def check_manifest_doc(real: dict, doc) -> None:
    parse_and_apply(json.dumps(doc).encode(), real)


def test_real_manifest_parses_and_applies(real):
    man = Manifest.from_json(real["raw"])
    assert man.tensors == real["manifest"].tensors and man.tree == real["manifest"].tree
    parse_and_apply(real["raw"], real)
    assert same(tensors_of(real["live"]), real["want"])


@FAST
@given(st.data())
def test_mutated_manifest_json(real, data):
    check_manifest_doc(real, data.draw(mutated_doc(real["doc"])))


@FAST
@given(st.data())
def test_mutated_manifest_skeleton(real, data):
    check_manifest_doc(real, data.draw(mutated_doc(real["doc"], focus="tree")))


@FAST
@given(st.data())
def test_mutated_manifest_layout(real, data):
    check_manifest_doc(real, data.draw(layout_shift(real["doc"])))


@FAST
@given(st.data())
def test_mutated_manifest_bytes(real, data):
    parse_and_apply(data.draw(byte_flip(real["raw"])), real)


@pytest.mark.thorough
@LONG
@SLOW_APPLY
@given(st.data())
def test_mutated_manifests_many(real, data):
    kind = data.draw(st.sampled_from(["json", "tree", "layout", "bytes"]))
    if kind == "bytes":
        parse_and_apply(data.draw(byte_flip(real["raw"])), real)
    elif kind == "layout":
        check_manifest_doc(real, data.draw(layout_shift(real["doc"])))
    else:
        check_manifest_doc(real, data.draw(mutated_doc(real["doc"], focus=None if kind == "json" else kind)))


# --- skeletons --------------------------------------------------------------------------------------
TAGGED = st.sampled_from(sorted(tree.TAGS))
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8))


def json_trees():
    """Arbitrary JSON with skeleton tags sprinkled in (as keys of one-key objects)."""
    return st.recursive(
        JSON_LEAF | st.sampled_from(["inf", "AAAA", "<f4", "cpu", "float32"]),
        lambda kids: st.one_of(
            st.lists(kids, max_size=4),
            st.dictionaries(st.text(max_size=6), kids, max_size=3),
            st.builds(lambda t, b: {t: b}, TAGGED, kids),
        ),
        max_leaves=20,
    )


def decode_total(skel, n_tensors: int = 3) -> None:
    """A validated skeleton decodes without error; an invalid one is a FormatError."""
    try:
        validate.skeleton(skel, n_tensors)
    except FormatError:
        return
    tree.decode(skel, lambda i, path: torch.zeros(1))


@FAST
@given(json_trees())
def test_random_skeletons(skel):
    decode_total(skel)


@pytest.mark.thorough
@SLOW
@given(json_trees())
def test_random_skeletons_many(skel):
    decode_total(skel)


@pytest.mark.parametrize("depth", [validate.MAX_DEPTH + 1, 5000])
def test_deep_skeleton_is_refused_not_recursed(depth):
    skel = 0
    for _ in range(depth):
        skel = {"__tuple__": [skel]}
    with pytest.raises(FormatError, match="nested deeper than"):
        validate.skeleton(skel, 0)


def test_deep_json_is_a_format_error(real):
    doc = dict(real["doc"], tree="@")
    raw = json.dumps(doc).replace('"@"', "[" * 100_000 + "]" * 100_000).encode()
    with pytest.raises(FormatError, match="nested deeper"):
        Manifest.from_json(raw)


def test_real_skeleton_round_trips(real):
    validate.skeleton(real["doc"]["tree"], len(real["doc"]["tensors"]))
    assert tree.decode(real["doc"]["tree"], lambda i, p: i)["cfg"] == {"lr": 1e-3, "betas": (0.9, 0.95)}


# --- the crafted negative offset -----------------------------------------------------------------
NEGATIVE_OFFSET = textwrap.dedent("""
    import json, sys, torch, memsnap
    sys.path.insert(0, {tests!r})
    from support.forge import forge_manifest
    root = {root!r}
    model = torch.nn.Linear(64, 64)
    state = {{"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}}
    memsnap.save(root, state, 1)
    path = f"{{root}}/step_000000000001/rank_00000.json"
    doc = json.load(open(path))
    for e in doc["tensors"]:
        e["offset"] -= 1 << 20
        e.pop("checksum", None)
    forge_manifest(root, 1, 0, doc)
    try:
        memsnap.load(root, state, step=1)
    except memsnap.errors.FormatError as exc:
        print("refused:", exc)
""")


def test_negative_offset_is_refused_not_copied(tmp_path):
    code = NEGATIVE_OFFSET.format(tests=os.path.dirname(__file__), root=str(tmp_path / "ckpt"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]  # a SIGSEGV would be -11
    assert "refused:" in proc.stdout and "offset: must be an integer >= 0" in proc.stdout


def test_a_generator_state_torch_refuses_is_a_format_error_and_nothing_is_written():
    w = torch.arange(8, dtype=torch.float32)
    man, buf = capture({"w": w.clone()}, checksums=False)
    torch_state = next(e for e in man.tensors if e.path == "__rng__/torch")
    raw = bytearray(memoryview(buf).cast("B"))
    raw[torch_state.offset : torch_state.offset + torch_state.nbytes] = bytes(torch_state.nbytes)
    live = {"w": torch.zeros(8)}
    before = torch.get_rng_state()
    with pytest.raises(FormatError, match="generator state torch refuses"):
        apply(live, man, raw, verify=False)
    assert torch.equal(live["w"], torch.zeros(8)), "the live state was written before the refusal"
    assert torch.equal(torch.get_rng_state(), before)


def test_copy_refuses_a_span_outside_the_buffer():
    from memsnap.state.apply import _Source

    man = Manifest([validate_entry(offset=0, nbytes=16)], {"x": {"__tensor__": 0}}, 64)
    src = _Source(man, memoryview(bytearray(8)), [])  # a buffer smaller than the manifest says
    with pytest.raises(memsnap.errors.SnapshotBufferError, match="refusing to copy"):
        src.copy_into(0, torch.zeros(4))


def validate_entry(**kw):
    from memsnap.state.manifest import TensorEntry

    return TensorEntry(**{"path": "x", "dtype": "float32", "shape": (4,), **kw})


def test_errors_survive_pickling():
    err = pickle.loads(pickle.dumps(FormatError("rank_00000.json offset: bad")))
    assert type(err) is FormatError and str(err) == "rank_00000.json offset: bad"
    assert isinstance(err, MemsnapError) and isinstance(err, ValueError)


def test_itemsizes_match_torch():
    from memsnap.state.dtypes import BY_NAME

    assert all(validate.ITEMSIZE[n] == d.itemsize for n, d in BY_NAME.items())


# --- markers and rank manifests on disk, through load and the CLI ------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Steps 1 and 2 of the Llama-like state; the pristine files of step 2 to restore."""
    root = str(tmp_path_factory.mktemp("validate") / "ckpt")
    want = {}
    for step in (1, 2):
        state = llama_state(10 + step)
        memsnap.save(root, state, step)
        want[step] = tensors_of(state)
    store = Store.open(root)
    files = {name: open(store.path(2, name), "rb").read() for name in ("COMMITTED", "rank_00000.json")}
    return {
        "root": root,
        "store": store,
        "want": want,
        "files": files,
        "live": llama_state(3),
        "marker": json.loads(files["COMMITTED"]),
        "manifest": json.loads(files["rank_00000.json"]),
    }


def restore(ckpt) -> None:
    for name, raw in ckpt["files"].items():
        with open(ckpt["store"].path(2, name), "wb") as f:
            f.write(raw)


def load_total(ckpt, exact: bool = True, cli: tuple = ("ls", "inspect")) -> None:
    """load(step=None): step 2, step 1 after a warning, or a memsnap error (the bytes of the step
    loaded when its manifest is ``exact``ly the saved one); every CLI command exits 0, 1 or 2."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = memsnap.load(ckpt["root"], ckpt["live"])
        if got == 1 or exact:
            assert same(tensors_of(ckpt["live"]), ckpt["want"][got])
    except MemsnapError:
        pass
    for argv in ([c, ckpt["root"]] for c in cli):
        with open(os.devnull, "w") as devnull:
            out, err = sys.stdout, sys.stderr
            sys.stdout = sys.stderr = devnull
            try:
                assert main(argv) in (0, 1, 2)
            finally:
                sys.stdout, sys.stderr = out, err


def with_marker(ckpt, doc) -> None:
    with open(ckpt["store"].path(2, "COMMITTED"), "w") as f:
        f.write(json.dumps(doc))


def check_marker(ckpt, doc, cli: tuple = ("ls", "inspect")) -> None:
    try:
        with_marker(ckpt, doc)
        load_total(ckpt, True, cli)
    finally:
        restore(ckpt)


def check_rank_manifest(ckpt, doc, cli: tuple = ("ls", "inspect")) -> None:
    exact = (
        {k: doc.get(k) for k in ("tensors", "tree")} == {k: ckpt["manifest"].get(k) for k in ("tensors", "tree")}
        if isinstance(doc, dict)
        else False
    )
    try:
        forge_manifest(ckpt["root"], 2, 0, doc)
        load_total(ckpt, exact, cli)
    finally:
        restore(ckpt)


@FAST_DISK
@given(st.data())
def test_mutated_markers(ckpt, data):
    check_marker(ckpt, data.draw(mutated_doc(ckpt["marker"])))


@FAST_DISK
@given(st.data())
def test_mutated_rank_manifests_on_disk(ckpt, data):
    doc = data.draw(st.one_of(mutated_doc(ckpt["manifest"]), layout_shift(ckpt["manifest"])))
    check_rank_manifest(ckpt, doc)


@pytest.mark.thorough
@LONG
@SLOW_DISK
@given(st.data())
def test_mutated_markers_and_manifests_many(ckpt, data):
    cli = ("ls", "inspect", "verify")
    if data.draw(st.booleans()):
        check_marker(ckpt, data.draw(mutated_doc(ckpt["marker"])), cli)
    else:
        check_rank_manifest(
            ckpt, data.draw(st.one_of(mutated_doc(ckpt["manifest"]), layout_shift(ckpt["manifest"]))), cli
        )


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: [m],
        lambda m: {k: v for k, v in m.items() if k != "world_size"},
        lambda m: dict(m, world_size="1"),
        lambda m: dict(m, ranks=[dict(m["ranks"][0], bin_bytes="12")]),
        lambda m: dict(m, step=1),
    ],
)
def test_damaged_newest_marker_falls_back_and_cli_says_so(ckpt, capsys, damage):
    try:
        with_marker(ckpt, damage(ckpt["marker"]))
        with pytest.warns(UserWarning, match="COMMITTED.*falling back"):
            assert memsnap.load(ckpt["root"], ckpt["live"]) == 1
        assert same(tensors_of(ckpt["live"]), ckpt["want"][1])
        capsys.readouterr()
        assert main(["inspect", ckpt["root"]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "damaged checkpoint" in err and "COMMITTED" in err
        assert main(["ls", ckpt["root"]]) == 2
        out = capsys.readouterr().out.splitlines()
        assert out[-2].split()[0] == "1" and out[-1].split()[:2] == ["2", "DAMAGED"]
        assert main(["verify", "--all", ckpt["root"]]) == 2
        assert "step 2: DAMAGED" in capsys.readouterr().out
    finally:
        restore(ckpt)


@pytest.mark.parametrize(
    "where, value, match",
    [
        (("tensors", 5, "shape"), "big", r"rank_00000.json tensors\[5\] shape: must be a list"),
        (("tree", "__rng__", "python"), [3, [1, 2], None], r"RNG state .* does not restore"),
        (("tree", "optim", "param_groups"), {"params": [0]}, r"'optim'.*'param_groups'"),
    ],
)
def test_malformed_rank_manifest_falls_back(ckpt, where, value, match):
    doc = mutate(ckpt["manifest"], where, "set", value)
    try:
        forge_manifest(ckpt["root"], 2, 0, doc)
        with pytest.warns(UserWarning, match=match + ".*falling back"):
            assert memsnap.load(ckpt["root"], ckpt["live"]) == 1
        assert same(tensors_of(ckpt["live"]), ckpt["want"][1])
        with pytest.raises(FormatError, match=match):
            memsnap.load(ckpt["root"], ckpt["live"], step=2)
    finally:
        restore(ckpt)


# --- wire headers -------------------------------------------------------------------------------------
MAX_FRAME = 64 << 20


def read_header(raw: bytes, kinds: tuple) -> None:
    """The data plane's frame reader given ``raw`` as a frame header (and plenty of bytes after it):
    a memsnap error, or a frame that authenticates (which random bytes never do)."""
    from memsnap.transport.session import Direction

    a, b = socket.socketpair()
    try:
        b.sendall(raw + bytes(0xFFFF + 64))
        try:
            wire.read_head(a, Direction(os.urandom(32), os.urandom(32), None), kinds, MAX_FRAME, time.monotonic() + 10)
        except MemsnapError:
            pass
    finally:
        a.close()
        b.close()


@FAST
@given(st.binary(min_size=wire.HEAD.size, max_size=wire.HEAD.size), st.sampled_from([wire.REQUESTS, wire.RESPONSES]))
def test_arbitrary_wire_headers(raw, kinds):
    read_header(raw, kinds)


@pytest.mark.thorough
@SLOW
@given(st.binary(min_size=wire.HEAD.size, max_size=wire.HEAD.size), st.sampled_from([wire.REQUESTS, wire.RESPONSES]))
def test_arbitrary_wire_headers_many(raw, kinds):
    read_header(raw, kinds)


@pytest.mark.parametrize(
    "fields, match",
    [
        ((3, 4, 10, 0, 0), "kind=3"),
        ((wire.PUSH, 4, MAX_FRAME + 1, 0, 1), "payload"),
    ],
)
def test_bad_frame_header_is_named(fields, match):
    raw = wire.HEAD.pack(*fields)
    with pytest.raises(FormatError, match=match):
        validate.wire_header(raw, wire.HEAD, wire.REQUESTS, MAX_FRAME, "request")
    with pytest.raises(FormatError, match="bad request header: 3 bytes"):
        validate.wire_header(raw[:3], wire.HEAD, wire.REQUESTS, MAX_FRAME, "request")


def test_good_frame_header_reads_back():
    from memsnap.transport.session import Direction

    keys = (os.urandom(32), os.urandom(32), None)
    a, b = socket.socketpair()
    with a, b:
        deadline = time.monotonic() + 10
        wire.send_frame(b, Direction(*keys), wire.PUSH, b"key", memoryview(b"payload"), 7, deadline)
        head = wire.read_head(a, Direction(*keys), wire.REQUESTS, MAX_FRAME, deadline)
        assert (head.kind, head.name, head.nbytes, head.checksum) == (wire.PUSH, b"key", 7, 7)


# --- all ranks agree when one rank's manifest is malformed ---------------------------------------------
AGREE = textwrap.dedent("""
    import os, sys, warnings, torch, torch.distributed as dist, memsnap
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
    try:
        model = torch.nn.Linear(4, 4)
        state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            print("loaded", memsnap.load(os.environ["ROOT"], state), len(seen), flush=True)
        dist.barrier()  # both ranks done before either leaves
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # without gloo's teardown, which a peer's exit can abort (tests/test_apply.py)
""")


def small_state() -> dict:
    model = torch.nn.Linear(4, 4)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def two_rank_ckpt(root: str) -> str:
    """Steps 1 and 2 saved by 2 ranks; rank 1's manifest of step 2 is malformed (re-signed)."""
    for step in (1, 2):
        for rank in (1, 0):  # rank 0 commits once rank 1's files exist
            memsnap.save(root, small_state(), step, rank=rank, world_size=2, barrier=lambda: None)
    doc = json.loads(open(Store.open(root).path(2, "rank_00001.json")).read())
    doc["tensors"] = {"not": "a list"}
    forge_manifest(root, 2, 1, doc)
    return root


class Peers:
    """Stands in for torch.distributed: the other rank reports ``theirs[i]`` at the i-th reduce."""

    class ReduceOp:
        MAX = "max"

    def __init__(self, theirs: list[int]):
        self.theirs, self.calls = theirs, 0

    def all_reduce(self, flag, op):
        assert op == "max"
        flag.fill_(max(int(flag.item()), self.theirs[self.calls]))
        self.calls += 1


@pytest.mark.parametrize(
    "rank, theirs, want",
    [
        (0, [1, 0], 1),  # rank 1 finds step 2 malformed: rank 0 falls back with it
        (1, [0, 0], 1),  # rank 1 itself: falls back, and reduces once per candidate step
        (0, [2], "failed to load on another rank"),  # the other rank hit a fatal error: raise too
    ],
)
def test_the_malformed_rank_and_its_peer_agree(tmp_path, monkeypatch, rank, theirs, want):
    from memsnap.durable import checkpoint as durable

    root = two_rank_ckpt(str(tmp_path / "ckpt"))
    peers = Peers(theirs)
    monkeypatch.setattr(durable, "_dist", lambda: peers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(want, str):
            with pytest.raises(MemsnapError, match=want):
                memsnap.load(root, small_state(), rank=rank, world_size=2)
        else:
            assert memsnap.load(root, small_state(), rank=rank, world_size=2) == want
    assert peers.calls == len(theirs)


@pytest.mark.slow
def test_ranks_agree_to_fall_back_when_one_manifest_is_malformed(tmp_path):
    root = two_rank_ckpt(str(tmp_path / "ckpt"))
    port = free_port()
    env = dict(os.environ, ROOT=root, PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", AGREE],
            env=dict(env, RANK=str(r)),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]  # a rank left waiting fails here
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("loaded 1 1" in o for o in outs), outs  # both fell back to step 1, with one warning


def test_deep_marker_metadata_is_refused(ckpt, capsys):
    deep = {}
    for _ in range(500):
        deep = {"x": deep}
    try:
        with_marker(ckpt, dict(ckpt["marker"], metadata=deep))
        assert main(["inspect", ckpt["root"]]) == 2
        assert "metadata: is nested deeper than 100 levels" in capsys.readouterr().err
    finally:
        restore(ckpt)


def nested(levels: int):
    """``levels`` lists and tuples nested around a number."""
    value: object = 1
    for i in range(levels):
        value = [value] if i % 2 else (value,)
    return value


def test_capture_refuses_what_load_would_refuse():
    """The deepest skeleton capture writes is the deepest a load accepts: no unloadable saves."""
    from memsnap.errors import UnsupportedStateError

    ok = {"x": nested(validate.MAX_DEPTH - 1)}  # the number sits MAX_DEPTH levels below the root
    man, _ = capture(ok, rng=False)
    assert Manifest.from_json(man.to_json()).tree == man.tree
    with pytest.raises(UnsupportedStateError, match="nested deeper than 100"):
        capture({"x": [ok["x"]]}, rng=False)


def test_a_checksum_with_a_trailing_newline_is_malformed(real):
    """Patterns are matched whole: ``$`` would let a trailing newline through."""
    doc = copy.deepcopy(real["doc"])
    entry = next(e for e in doc["tensors"] if e.get("checksum"))
    entry["checksum"] += "\n"
    with pytest.raises(FormatError, match="checksum"):
        Manifest.from_json(json.dumps(doc).encode())
