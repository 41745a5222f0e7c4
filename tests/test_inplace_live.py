"""Live takeover's parts, without Ray: the verdict every member reaches from the same table,
the step boundary a member rebuilds after a step cut short, the optimizer guard, and the
exchange itself between processes of a real gloo group (``memsnap.collective.live``)."""

from __future__ import annotations

import hashlib
import multiprocessing
import random
from datetime import timedelta

import numpy as np
import pytest
import torch

from memsnap.collective.group import PeerLost
from memsnap.collective.live import STREAMS, Live, Row, decide, take_over


def row(step, digest=7, rng=(1, 2, 3, 4), static=(), refusal=0, nbytes=100):
    return Row(step, digest, nbytes, refusal, tuple(rng), frozenset(static))


def test_replicas_at_the_newest_boundary_go_on_and_the_others_receive_it():
    v = decide([row(9), row(9), row(8), row(None)], trust=False)
    assert v.step == 9 and v.holders == (0, 1) and v.receivers == (2, 3) and v.own_rng == ()


def test_ranks_whose_states_differ_roll_back_and_say_which():
    v = decide([row(9, digest=1), row(9, digest=2), row(None)], trust=False)
    assert v.step is None and "ranks 0 and 1 hold different states at step 9" in v.why


def test_one_holder_is_not_enough_unless_trusted():
    rows = [row(9), row(None), row(None)]
    assert decide(rows, trust=False).step is None
    assert "only rank 0 holds step 9" in decide(rows, trust=False).why
    assert decide(rows, trust=True).step == 9


def test_per_rank_rng_streams_are_kept_when_unused_and_roll_back_when_drawn_from():
    py = STREAMS.index("python")
    a, b = [1, 2, 3, 4], [1, 2, 3, 4]
    b[py] = 99
    unused = decide([row(5, rng=a, static={"python"}), row(5, rng=b, static={"python"}), row(None)], trust=False)
    assert unused.step == 5 and unused.own_rng == ("python",)
    drawn = decide([row(5, rng=a, static={"python"}), row(5, rng=b), row(None)], trust=False)
    assert drawn.step is None and "different python RNG states" in drawn.why


def test_a_refusing_rank_or_nobody_clean_rolls_everyone_back():
    assert "world size changed" in decide([row(5), row(5), row(None, refusal=2)], trust=False).why
    assert "arrived damaged" in decide([row(5), row(5, refusal=1)], trust=False).why
    assert "no rank holds" in decide([row(None), row(None)], trust=False).why


def test_a_row_survives_its_encoding():
    r = Row(12, (1 << 64) - 5, 4096, 0, ((1 << 63) + 1, 2, 0, 3), frozenset({"numpy", "cuda"}))
    assert Row.decode(r.encode()) == r


class FakeGroup:
    def __init__(self):
        self.why = None
        self.gen = 3

    def failure(self):
        return self.why


def toy_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "loader": {"consumed": 0}}


def one_step(state, x):
    model, opt = state["model"], state["optim"]
    opt.zero_grad()
    model(x).square().mean().backward()  # (norm statistics move in the forward)
    state["loader"]["consumed"] += len(x)
    return opt


def whole(state, rng: bool = True) -> bytes:
    from memsnap.state.capture import capture

    m, mv = capture(state, rng=rng)
    return m.to_json() + bytes(mv)


def test_a_step_cut_short_is_undone_to_the_boundary_and_its_optimizer_never_steps():
    state = toy_state()
    group = FakeGroup()
    live = Live(group)
    for _ in range(2):
        one_step(state, torch.randn(16, 8)).step()
    live.mark(1, state)
    at_boundary = whole(state)
    # the next step draws from every RNG, moves the loader and the norm statistics, and then
    # its gradient average fails: the optimizer's step is refused before it changes anything
    random.random(), np.random.rand(), torch.rand(3)
    opt = one_step(state, torch.randn(16, 8))
    group.why = "rank 2: connection reset"
    with pytest.raises(PeerLost):
        opt.step()
    assert live.clean_step() == 1
    live.roll_back(state, live.sources(state))
    assert whole(state) == at_boundary


def test_the_boundary_copies_only_the_small_tensors_no_optimizer_owns():
    from memsnap.state.capture import RNG_KEY

    state = toy_state()
    one_step(state, torch.randn(16, 8)).step()
    live = Live(FakeGroup())
    live.mark(1, state)
    b = live.boundary
    assert b is not None
    copied = {b.manifest.tensors[i].path for i in b.small}
    # the norm statistics (moved by the forward) and the RNG states are copied ...
    assert any("running_mean" in p for p in copied) and any(p.startswith(RNG_KEY) for p in copied)
    # ... the parameters and the optimizer's moments and step counts (changed only by its
    # guarded step) are read live, however small they are
    assert not any(p.endswith(("weight", "bias")) or "exp_avg" in p for p in copied), sorted(copied)


def test_a_member_whose_optimizer_stepped_after_its_boundary_has_none_to_offer():
    state = toy_state()
    live = Live(FakeGroup())
    live.mark(0, state)
    one_step(state, torch.randn(16, 8)).step()  # applied, but its save never came
    assert live.clean_step() is None
    live.mark(1, state)
    assert live.clean_step() == 1


def test_a_state_without_an_optimizer_is_not_guarded_and_offers_nothing():
    live = Live(FakeGroup())
    live.mark(0, {"w": torch.zeros(4)})
    assert live.clean_step() is None and live.unguarded


# --- the exchange between processes ------------------------------------------------------------
def _member(port: int, rank: int, fresh: bool, out, damage: bool = False, direct: bool = False) -> None:
    """Rank ``rank`` of generation 1 of a 3-member group; ``fresh``: a standby that holds
    only its setup's state. The others trained three steps in generation 0 and then lost a
    step in flight (their RNGs moved, their optimizer refused)."""
    import torch.distributed as dist

    from memsnap.collective.group import RecoverableGroup

    torch.set_num_threads(1)
    if direct:  # every tensor goes from the holder's own memory (the toy's are all small)
        from memsnap.collective import live as live_mod

        live_mod.DIRECT_BYTES = 1
    group = RecoverableGroup("livetest", ("127.0.0.1", port), timeout_s=60)
    live = Live(group)
    state = toy_state()
    g = torch.Generator().manual_seed(5)
    if not fresh:
        for step in range(3):
            one_step(state, torch.randn(16, 8, generator=g)).step()
            live.mark(step, state)
        torch.rand(7)  # the lost step's draws
    if damage and rank == 2:  # a piece of its slice is damaged on the way (one byte)
        from memsnap.collective import live as live_mod

        name = "_direct" if direct else "_slice"
        cut = getattr(live_mod, name)

        def damaged(*args):
            part = cut(*args).clone()  # (a direct piece is a view of the holder's own tensor)
            part[-1] ^= 1
            return part

        setattr(live_mod, name, damaged)
    storages = {n: p.data_ptr() for n, p in state["model"].state_dict().items()}
    try:
        group.configure(1, rank, 3)
        try:
            done, why = take_over(live, state, rank, 3)
        except PeerLost as exc:
            out.put((rank, None, f"{exc} | refuse: {live.refuse} | dirty: {live.dirty}", None, None))
            return
        digest = hashlib.sha256(whole(state, rng=False)).hexdigest()
        kept = storages == {n: p.data_ptr() for n, p in state["model"].state_dict().items()}
        out.put((rank, done, f"{why}{'' if kept else ' | the model has new storage'}", digest, torch.rand(1).item()))
    finally:
        group.close()
        dist.destroy_process_group() if dist.is_initialized() else None


def _exchange(damage: bool = False, direct: bool = False) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(store.port, r, r == 1, out, damage, direct)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, done, why, digest, draw = out.get(timeout=120)
            got[rank] = (done, why, digest, draw)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def test_the_pieces_of_a_holders_slice_tile_it_and_send_large_tensors_whole():
    from types import SimpleNamespace

    from memsnap.collective import live as live_mod
    from memsnap.state.capture import RNG_KEY

    big = live_mod.DIRECT_BYTES

    def entry(path, offset, nbytes, alias_of=None):
        return SimpleNamespace(path=path, offset=offset, nbytes=nbytes, alias_of=alias_of)

    # small, big (after 8 bytes of padding), an alias of it, an RNG stream kept per rank, small
    tensors = [
        entry("a", 0, 100),
        entry("w", 108, 2 * big),
        entry("w2", 108, 2 * big, alias_of=1),
        entry(f"{RNG_KEY}/python", 108 + 2 * big, big),
        entry("b", 108 + 3 * big, 50),
    ]
    manifest = SimpleNamespace(tensors=tensors)
    end = 108 + 3 * big + 50
    for lo, hi in [(0, end), (0, 150), (150, end), (108 + big, 108 + big + 1)]:
        pieces = live_mod._pieces(manifest, lo, hi, ("python",))
        assert pieces[0][0] == lo and pieces[-1][1] == hi  # they tile [lo, hi), in order
        assert all(p[1] == q[0] and p[0] < p[1] for p, q in zip(pieces, pieces[1:]))
        assert {i for _, _, i in pieces} - {None} <= {1}  # only the big tensor goes whole
    assert live_mod._pieces(manifest, 0, end, ("python",)) == [
        (0, 108, None),
        (108, 108 + 2 * big, 1),
        (108 + 2 * big, end, None),
    ]
    assert live_mod._pieces(manifest, 0, end, ())[2] == (108 + 2 * big, 108 + 3 * big, 3)  # a stream sent


def test_the_layout_finds_exactly_the_entries_a_byte_range_touches():
    from types import SimpleNamespace

    from memsnap.collective import live as live_mod

    def entry(offset, nbytes, alias_of=None):
        return SimpleNamespace(path="p", offset=offset, nbytes=nbytes, alias_of=alias_of)

    # out of order, with padding, an alias (the same range) and an empty entry between two
    tensors = [entry(40, 30), entry(0, 16), entry(24, 16), entry(0, 16, alias_of=1), entry(70, 0), entry(72, 8)]
    layout = live_mod._Layout(SimpleNamespace(tensors=tensors))
    assert layout.sorted_ends
    for lo in range(0, 81):
        for hi in range(lo + 1, 81):
            touched = {i for i, e in enumerate(tensors) if max(lo, e.offset) < min(hi, e.offset + e.nbytes)}
            found = layout.within(lo, hi)
            assert touched <= set(found), (lo, hi)  # every entry with bytes in the range
            assert all(tensors[i].nbytes == 0 or i in touched for i in found), (lo, hi)  # and no other
            assert [tensors[i].offset for i in found] == sorted(tensors[i].offset for i in found)
    # entries that overlap without being aliases: no search, every entry (as a scan would)
    odd = live_mod._Layout(SimpleNamespace(tensors=[entry(0, 100), entry(10, 5), entry(50, 10)]))
    assert not odd.sorted_ends and sorted(odd.within(60, 70)) == [0, 1, 2]


def test_two_survivors_send_their_live_state_to_a_standby_which_ends_bitwise_equal():
    got = _exchange()
    assert got[0][0].role == "kept" and got[2][0].role == "kept", got
    assert got[1][0].role == "live" and got[1][0].holders == (0, 2), got
    assert {got[r][0].step for r in range(3)} == {2}
    # every rank holds the same state, and the same torch RNG (the next draw agrees); each
    # keeps its own unseeded Python and NumPy streams, which no step drew from
    assert len({got[r][2] for r in range(3)}) == 1
    assert len({got[r][3] for r in range(3)}) == 1
    assert got[1][0].own_rng == ("python", "numpy")


def test_a_live_state_sent_from_the_holders_tensors_themselves_lands_in_the_receivers_own():
    got = _exchange(direct=True)
    assert got[1][0].role == "live" and got[1][0].holders == (0, 2), got
    assert len({got[r][2] for r in range(3)}) == 1 and len({got[r][3] for r in range(3)}) == 1
    # the standby's model took the bytes in its own tensors (no new storage, nothing staged:
    # every model tensor in place); its optimizer had no moments yet: those came as new tensors
    state = toy_state()
    model_bytes = sum(t.numel() * t.element_size() for t in state["model"].state_dict().values())
    assert got[1][1] == "" and got[1][0].in_place == model_bytes, got
    assert got[1][0].nbytes > model_bytes  # (the moments and the rest were received too)


def test_a_live_state_damaged_in_a_tensor_received_in_place_is_refused_and_marks_the_state_written():
    got = _exchange(damage=True, direct=True)
    assert got[1][0] is None and "refuse: step 2 arrived with" in got[1][1], got
    assert got[1][1].endswith("dirty: True"), got  # the restore after it refuses a fresh start
    assert got[0][0].role == "kept" and got[2][0].role == "kept", got


def test_a_live_state_damaged_on_the_way_is_refused_and_the_receiver_will_not_take_one_again():
    got = _exchange(damage=True)
    # the receiver ended the generation (the holders' sends completed) and will refuse the
    # next live takeover, so the next generation rolls back instead
    assert got[1][0] is None and "refuse: step 2 arrived with" in got[1][1], got
    assert got[0][0].role == "kept" and got[2][0].role == "kept", got
