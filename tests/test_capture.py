"""Capture: the skeleton codec, the buffer layout, reusable buffers, aliases, checksums."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memsnap.errors import SnapshotBufferError, StateMismatchError, UnsupportedStateError
from memsnap.state import tree
from memsnap.state.capture import capture, fill_checksums, plan
from memsnap.state.checksum import checksum
from memsnap.state.manifest import ALIGN, Manifest


# --- the tagged JSON skeleton ------------------------------------------------------------------
def same(a, b) -> bool:
    """Equality that also tells bool from int, tuple from list, and nan from nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k1, k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b))
    return a == b


def roundtrip(value):
    tensors = []
    doc = json.dumps(tree.encode(value, lambda t, p: tensors.append(t) or len(tensors) - 1), allow_nan=False)
    return tree.decode(json.loads(doc), lambda i, p: tensors[i])


scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
keys = st.integers(-5, 5) | st.text(max_size=6) | st.sampled_from(sorted(tree.TAGS))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(values)
def test_skeleton_roundtrips_exactly(value):
    assert same(roundtrip(value), value)


def test_skeleton_keeps_types_json_loses():
    value = {
        0: (1, 2.0),
        "__tuple__": [True, None],
        "f": [float("inf"), float("-inf"), -0.0],
        "b": b"\x00\xff",
        "np": np.arange(3, dtype=np.int16),
        "s": np.float32(1.5),
        "dt": torch.bfloat16,
        "sz": torch.Size([2, 3]),
        "dev": torch.device("cpu"),
    }
    back = roundtrip(value)
    assert list(back) == list(value) and type(back[0]) is tuple and back[0][1] == 2.0
    assert back["f"][:2] == [math.inf, -math.inf] and math.copysign(1, back["f"][2]) == -1
    assert back["b"] == b"\x00\xff" and back["np"].dtype == np.int16 and back["np"].tolist() == [0, 1, 2]
    assert type(back["s"]) is np.float32 and back["s"] == 1.5
    assert (back["dt"], back["sz"], back["dev"]) == (torch.bfloat16, torch.Size([2, 3]), torch.device("cpu"))


def test_skeleton_rejects_unknown_types_naming_the_path():
    with pytest.raises(UnsupportedStateError, match=r"'a/1'.*object"):
        tree.encode({"a": [1, object()]}, lambda t, p: 0)


# --- layout and bytes ---------------------------------------------------------------------------
def mixed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "extra": {
            "f32": torch.randn(3, 5, generator=g),
            "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
            "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
            "mask": torch.rand(11, generator=g) > 0.5,
            "c64": torch.randn(2, 2, dtype=torch.complex64, generator=g),
            "i64": torch.arange(4),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "transposed": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
            "step": 17,
        }
    }


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_layout_is_aligned_contiguous_and_holds_raw_little_endian_bytes():
    state = mixed_state()
    m, buf = capture(state, rng=False)
    assert len(buf) == m.nbytes == plan(state, rng=False).nbytes and m.nbytes % ALIGN == 0
    end = 0
    for e in m.tensors:
        t = state["extra"][e.path.split("/")[1]]
        assert e.offset % ALIGN == 0 and e.offset >= end, e
        assert (e.dtype, e.shape) == (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        assert bytes(buf[e.offset : e.offset + e.nbytes]) == raw(t)
        end = e.offset + e.nbytes
    assert m.tree["extra"]["step"] == 17


def test_plan_matches_capture_layout():
    state = mixed_state()
    assert plan(state, rng=False).tensors == capture(state, rng=False)[0].tensors


def test_capture_into_caller_buffer_reuses_it_without_allocating():
    state = mixed_state()
    m0 = plan(state, rng=False)
    out = np.full(m0.nbytes + 100, 0xAB, dtype=np.uint8)
    for step in range(3):
        state["extra"]["f32"].add_(1.0)
        state["extra"]["step"] = step
        m, buf = capture(state, out=out, rng=False, manifest=m0)
        assert np.shares_memory(np.frombuffer(buf, dtype=np.uint8), out)
        assert m.tree["extra"]["step"] == step
        e = m.entry("extra/f32")
        assert out[e.offset : e.offset + e.nbytes].tobytes() == raw(state["extra"]["f32"])
    assert out[m0.nbytes :].tolist() == [0xAB] * 100  # nothing written past the snapshot
    stored = np.zeros(m0.nbytes, dtype=bool)
    for e in m0.tensors:
        stored[e.offset : e.offset + e.nbytes] = True
    assert not out[: m0.nbytes][~stored].any()  # padding is zeroed, not left as it was


def test_reused_manifest_that_no_longer_fits_is_refused():
    state = mixed_state()
    m0 = plan(state, rng=False)
    state["extra"]["f32"] = torch.zeros(4, 5)
    with pytest.raises(StateMismatchError, match=r"extra/f32.*float32\[4, 5\].*float32\[3, 5\]"):
        capture(state, rng=False, manifest=m0)


def test_bad_buffers_are_refused():
    state = mixed_state()
    n = plan(state, rng=False).nbytes
    with pytest.raises(SnapshotBufferError, match=f"holds {n - 1} bytes.*needs {n}"):
        capture(state, out=bytearray(n - 1), rng=False)
    with pytest.raises(SnapshotBufferError, match="read-only"):
        capture(state, out=bytes(n), rng=False)


def test_tied_tensors_are_stored_once():
    w = torch.randn(4, 3)
    m, buf = capture({"a": {"x": w, "y": w, "z": w.clone()}}, rng=False)
    x, y, z = (m.entry(f"a/{k}") for k in "xyz")
    assert y.alias_of == "a/x" and y.nbytes == 0 and y.offset == x.offset
    assert z.alias_of is None and z.offset > x.offset


def test_checksums_are_separate_and_match_the_bytes():
    m, buf = capture(mixed_state(), rng=False)
    assert all(e.checksum is None for e in m.tensors)
    summed = fill_checksums(m, buf)
    for e in summed.tensors:
        assert e.checksum == checksum(buf[e.offset : e.offset + e.nbytes])
    assert capture(mixed_state(), rng=False, checksums=True)[0].tensors == summed.tensors


def test_manifest_json_roundtrip_is_exact():
    m, buf = capture({"opt": {0: {"lr": float("nan"), "betas": (0.9, 0.99)}}, "t": torch.ones(2)}, checksums=True)
    back = Manifest.from_json(m.to_json())
    assert back.tensors == m.tensors and back.tree == m.tree and back.nbytes == m.nbytes


def test_state_keys_are_checked():
    with pytest.raises(StateMismatchError, match="__rng__"):
        plan({"__rng__": 1})
    with pytest.raises(StateMismatchError, match="dict of named objects"):
        plan([1, 2])


def test_reused_manifest_refuses_a_broken_tie_and_a_changed_tensor_count():
    w = torch.randn(4, 3)
    m0 = plan({"a": {"x": w, "y": w}}, rng=False)
    with pytest.raises(StateMismatchError, match=r"'a/y' is no longer tied to 'a/x'"):
        capture({"a": {"x": w, "y": w.clone()}}, rng=False, manifest=m0)
    with pytest.raises(StateMismatchError, match=r"'a/y' is absent"):
        capture({"a": {"x": w}}, rng=False, manifest=m0)
    with pytest.raises(StateMismatchError, match=r"'a/z' is float32\[4, 3\] but the reused manifest has absent"):
        capture({"a": {"x": w, "y": w, "z": w.clone()}}, rng=False, manifest=m0)


def test_lazily_conjugated_views_are_stored_resolved():
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()
    m, buf = capture({"c": c}, rng=False)
    assert bytes(buf[: m.entry("c").nbytes]) == c.resolve_conj().numpy().tobytes()


def test_the_plan_cache_lays_out_again_only_when_the_tensors_change():
    """A save reuses the layout (and its JSON) while the tensors are the same storage, dtype
    and shape; the skeleton (LR, step counts, RNG) is taken fresh every time."""
    from memsnap.state.capture import PlanCache, plan_sources

    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    state = {"model": model, "optim": optim, "sched": sched}
    cache = PlanCache()

    def train():
        model(torch.randn(2, 8)).sum().backward()
        optim.step()
        sched.step()

    for _ in range(3):
        man, sources = cache.plan(state)
        fresh, fresh_sources = plan_sources(state)
        assert man.to_json() == fresh.to_json()  # byte for byte: LR and step counts included
        assert [(s.dtype, s.shape) for s in sources] == [(s.dtype, s.shape) for s in fresh_sources]
        assert sources[0].data_ptr() == model.weight.data_ptr()  # the live tensors, not copies
        train()
    assert cache.replans == 2  # the first save, and once the optimizer's moments appeared
    model.weight.data = torch.zeros(4, 8, dtype=torch.float64)  # a tensor changed: laid out again
    assert cache.plan(state)[0].entry("model/weight").dtype == "float64" and cache.replans == 3


# --- tensor names and what a save refuses --------------------------------------------------------
def test_each_position_gets_its_own_name_and_the_skeleton_gives_it_back():
    """Keys that join alike as text ("a/b" beside a -> b, 0 beside "0") name distinct tensors."""
    t = [torch.full((2,), float(i)) for i in range(7)]
    state = {"x": {"a/b": t[0], "a": {"b": t[1]}, 0: t[2], "0": t[3], 1.5: t[4], "<1.5>": t[5], "%": t[6]}}
    m, _ = capture(state, rng=False)
    assert [e.path for e in m.tensors] == ["x/a%2Fb", "x/a/b", "x/0", "x/%30", "x/<1.5>", "x/%3C1.5>", "x/%25"]
    assert tree.tensor_names(m.tree) == {i: e.path for i, e in enumerate(m.tensors)}
    assert [tree.unquote(e.path.split("/")[1]) for e in m.tensors[:2]] == ["a/b", "a"]


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.just("T"),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(["a", "b", "a/b", "0", "1", "%30", "%", "<0>", "-1", ""])
                | st.integers(-1, 1)
                | st.sampled_from([1.5, -0.5, True, None]),
                inner,
                max_size=4,
            )
        ),
        max_leaves=12,
    )
)
def test_tensor_names_never_collide(value):
    def with_tensors(v):
        if v == "T":
            return torch.zeros(1)
        if isinstance(v, list):
            return [with_tensors(x) for x in v]
        return {k: with_tensors(x) for k, x in v.items()} if isinstance(v, dict) else v

    m, _ = capture({"v": with_tensors(value)}, rng=False)
    names = [e.path for e in m.tensors]
    assert len(set(names)) == len(names) and tree.tensor_names(m.tree) == dict(enumerate(names))


@pytest.mark.parametrize(
    "value, pattern",
    [
        (torch.eye(3).to_sparse(), r"tensor at 'v/w' is a sparse_coo tensor.*to_dense"),
        (torch.empty(3, device="meta"), r"tensor at 'v/w' is on the meta device.*to_empty"),
        (10**4300, r"integer at 'v/w' has about 4301 digits, more than the 4300"),
        (-(10**5000), r"integer at 'v/w' has about 5001 digits"),
        (bytearray(b"ab"), r"value at 'v/w' is a bytearray.*bytes\(value\)"),
        (np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]), r"numpy value at 'v/w' has dtype.*structured"),
        (np.zeros(1, dtype=[("a", "<i4")])[0], r"numpy value at 'v/w' has dtype.*structured"),
        (np.zeros(2, dtype="V0"), r"numpy value at 'v/w' has dtype.*zero-sized"),
    ],
    ids=["sparse", "meta", "bigint", "neg-bigint", "bytearray", "structured", "void", "V0"],
)
def test_values_a_snapshot_cannot_give_back_exactly_are_refused_in_one_line(value, pattern):
    with pytest.raises(UnsupportedStateError, match=pattern) as err:
        plan({"v": {"w": value}}, rng=False)
    assert "\n" not in str(err.value)


def test_an_integer_of_4300_digits_is_kept_and_one_of_4301_refused():
    n = 10**4300 - 1
    m, _ = capture({"v": [n, -n]}, rng=False)
    assert tree.decode(Manifest.from_json(m.to_json()).tree, None)["v"] == [n, -n]
    with pytest.raises(UnsupportedStateError, match="'v/0'"):
        plan({"v": {0: n + 1}}, rng=False)  # as a dict key too


def test_keys_that_write_out_alike_are_refused_rather_than_merged():
    with pytest.raises(UnsupportedStateError, match=r"both named 'v/<\{\"__float__\":\"nan\"\}>'"):
        plan({"v": {float("nan"): torch.zeros(1), float("nan"): torch.ones(1)}}, rng=False)
