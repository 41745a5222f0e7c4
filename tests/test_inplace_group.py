"""``RecoverableGroup`` across real processes (no Ray): the store is hosted here, as the
in-place controller hosts it; the members are separate processes (``support.pg_members``).

A lost member ends every survivor's collective in ``PeerLost``: a killed one at once (its
sockets close), a hung one as soon as the controller publishes the failure, long before the
backend's own timeout. Re-forming in the same processes keeps threads and descriptors flat,
and closing ends the watcher."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from support.pg_members import Members

from memsnap.collective.group import _sockets, _Wires, failed_key, over_key, publish_failure

BACKEND_TIMEOUT_S = 120.0  # gloo's own bound: no wait below comes near it
WAIT_S = 30.0  # the deadline of every answer a member gives after it is up
UP_S = 300.0  # the first member waits for the fork server to import torch (a loaded machine)


@pytest.fixture
def members() -> Iterator[Callable[[list[str]], Members]]:
    made: list[Members] = []

    def start(names: list[str]) -> Members:
        m = Members(names, backend_timeout_s=BACKEND_TIMEOUT_S)
        made.append(m)
        for name in names:
            m.answer(f"{name}/up", UP_S)
        return m

    yield start
    for m in made:
        m.close()


def formed(m: Members, gen: int, names: list[str], sums: int | None = None) -> dict[str, dict]:
    """Every one of ``names`` formed ``gen`` and summed correctly: their counts then."""
    m.form(gen, names, sums)
    return {name: m.answer(f"{name}/ready/{gen}", WAIT_S) for name in names}


def spare(m: Members, name: str) -> str:
    m.start(name)
    m.answer(f"{name}/up", UP_S)
    return name


def test_a_member_killed_mid_all_reduce_ends_every_survivors_collective_in_peer_lost(members):
    m = members(["a", "b", "c"])
    formed(m, 0, ["a", "b", "c"])  # all three are in all_reduce after all_reduce
    m.signal("b", signal.SIGKILL)
    for name in ("a", "c"):
        left = m.answer(f"{name}/left/0", WAIT_S)
        assert left["kind"] == "PeerLost" and left["gen"] == 0, left
        assert left["failure"], left
    why = m.store.get(failed_key(m.job, 0)).decode()
    # the reason names the survivor that saw the collective fail, and the backend's error
    assert re.match(r"rank [02]: \w+: .*peer", why), why
    assert m.store.get(over_key(m.job, 0)) == b"failed"


def test_a_hung_member_ends_the_survivors_collective_once_the_controller_publishes_the_failure(members):
    """SIGSTOP closes no socket: the survivors' all_reduce would wait out the backend's timeout.
    The controller's word ends it; their next generation forms without the hung member, which
    still holds the old group's sockets: the survivors keep that group (once) until its work ends."""
    m = members(["a", "b", "c"])
    formed(m, 0, ["a", "b", "c"])
    m.signal("b", signal.SIGSTOP)
    assert not m.store.check([failed_key(m.job, 0)])  # no member noticed anything itself
    publish_failure(m.store, m.job, 0, "controller: rank 1 stopped beating")
    for name in ("a", "c"):
        left = m.answer(f"{name}/left/0", WAIT_S)
        assert left["kind"] == "PeerLost" and left["gen"] == 0, left
        assert left["failure"] == "controller: rank 1 stopped beating"
        assert "controller: rank 1 stopped beating" in left["message"]
    after = formed(m, 1, ["a", spare(m, "s0"), "c"])  # b is still stopped, its sockets open
    for name in ("a", "c"):
        # generation 0's group is kept once by a survivor that abandoned its work; one whose work
        # ended first (failed by the other survivor's cut) has nothing left to keep
        assert after[name]["graveyard"] <= 1, after[name]
    assert any(after[name]["graveyard"] == 1 for name in ("a", "c")), after


def test_a_generation_left_is_cut_so_its_abandoned_collective_ends_long_before_the_backend_timeout(members):
    """The survivors of a hung member abandon their all_reduce; left open, its ring would go on
    between them until gloo's timeout (a survivor's event loop can spin a core on the parts
    nobody takes). Cut, every abandoned work fails at once: none is still pending a few
    seconds later, with the backend's timeout at two minutes."""
    m = members(["a", "b", "c"])
    formed(m, 0, ["a", "b", "c"])
    m.signal("b", signal.SIGSTOP)
    publish_failure(m.store, m.job, 0, "controller: rank 1 stopped beating")
    for name in ("a", "c"):
        assert m.answer(f"{name}/left/0", WAIT_S)["kind"] == "PeerLost"
    start, tag = time.monotonic(), 0
    while True:
        for name in ("a", "c"):
            m.send(name, op="counts", tag=tag)
        counts = {name: m.answer(f"{name}/counts/{tag}", WAIT_S) for name in ("a", "c")}
        if all(c["pending"] == 0 for c in counts.values()):
            break
        waited = time.monotonic() - start
        assert waited < WAIT_S, f"abandoned work still pending {waited:.0f} s after the cut: {counts}"
        tag += 1
        time.sleep(0.05)  # (the next look; the deadline above bounds the wait)
    # a survivor whose work was abandoned keeps generation 0's group once, however many works;
    # one whose work ended first (failed by the other survivor's cut) has nothing to keep
    assert all(c["graveyard"] <= 1 for c in counts.values()), counts
    formed(m, 1, ["a", spare(m, "s0"), "c"])


def test_the_cut_shuts_only_connections_with_an_end_at_a_members_listener():
    """A generation's sockets are those that appeared while it was formed; of those only the
    pairs (an end at this member's listener or a peer's) are shut down, never a socket another
    thread opened meanwhile, nor one that took a closed pair's descriptor."""
    other = socket.create_server(("127.0.0.1", 0))  # a server of this process from before
    before = _sockets()
    listener = socket.create_server(("127.0.0.1", 0))  # the group's own listener
    peer = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())  # a pair a peer opened to us...
    accepted, _ = listener.accept()  # ...and our end of it
    outward = socket.create_connection(peer.getsockname())  # a pair we opened to a peer
    unrelated = socket.create_connection(other.getsockname())  # another thread's connection
    served, _ = other.accept()
    reused = socket.create_connection(other.getsockname())  # will take a pair's descriptor
    served2, _ = other.accept()
    wires = _Wires(before)
    peer_listen = peer.getsockname()[1]
    assert wires.listen == {listener.getsockname()[1], peer_listen}  # (both listen here)
    wires.listen.discard(peer_listen)  # the peer's listener is in another process
    os.dup2(reused.fileno(), outward.fileno())  # the pair's descriptor now holds another socket
    try:
        for s in (accepted, unrelated, served, served2, ours):
            s.settimeout(10)
        assert wires.cut({peer_listen}) == 2  # our end of the accepted pair, and the peer's to us
        assert accepted.recv(1) == b"" and ours.recv(1) == b""  # both ends see the pair end
        unrelated.sendall(b"x")
        assert served.recv(1) == b"x"  # untouched
        reused.sendall(b"y")
        assert served2.recv(1) == b"y"  # the descriptor's new socket is untouched
        assert wires.cut({peer_listen}) == 0  # once
    finally:
        for s in (other, listener, peer, ours, accepted, outward, unrelated, served, reused, served2):
            s.close()


def test_a_member_that_never_comes_ends_the_others_rendezvous_once_the_failure_is_published(members):
    """A generation's member dies before forming it (a standby on a node lost with the
    ranks'): the backend's rendezvous would wait out its whole timeout for it. The
    controller's word ends the wait; the next generation forms without it."""
    m = members(["a", "b"])
    formed(m, 0, ["a", "b"])
    publish_failure(m.store, m.job, 0, "controller: a standby takes a rank")
    for name in ("a", "b"):
        assert m.answer(f"{name}/left/0", WAIT_S)["kind"] == "PeerLost"
    for rank, name in enumerate(["a", "b"]):  # a third member never starts
        m.send(name, op="form", gen=1, rank=rank, world=3, sums=None)
    assert not m.has("a/left/1") and not m.has("b/left/1")
    publish_failure(m.store, m.job, 1, "controller: rank 2 never beat")
    for name in ("a", "b"):
        left = m.answer(f"{name}/left/1", WAIT_S)
        assert left["kind"] == "PeerLost" and left["gen"] == 1, left
        assert "rank 2 never beat" in left["message"], left
    formed(m, 2, ["a", "b"])


def test_reforming_ten_times_with_a_spare_for_each_killed_member_keeps_threads_and_fds_flat(members) -> None:
    """Rank 0 stays in one process through ten generations; each generation a member is killed
    and a fresh spare takes its rank. What the survivor holds beyond its live group is the old
    groups it keeps (the last generation's, until the next one forms; one whose abandoned work
    has not ended yet): at most two, and they explain every thread and descriptor above the
    second generation's (give or take the cut pairs gloo has not closed yet)."""
    m = members(["a", "b", "c"])
    names = ["a", "b", "c"]
    seen: list[dict] = []
    for gen in range(10):
        seen.append(formed(m, gen, names)["a"])
        if gen == 9:
            break
        victim = names[1 + gen % 2]
        m.signal(victim, signal.SIGKILL)
        for name in names:
            if name != victim:
                assert m.answer(f"{name}/left/{gen}", WAIT_S)["kind"] == "PeerLost"
        names[names.index(victim)] = spare(m, f"s{gen}")
    first, second, last = seen[0], seen[1], seen[-1]
    assert first["graveyard"] == 0 and second["graveyard"] >= 1
    cost = {k: (second[k] - first[k]) / second["graveyard"] for k in ("threads", "fds")}
    assert cost["threads"] > 0 and cost["fds"] > 0, (first, second)  # a kept group's gloo threads and sockets
    for gen, counts in enumerate(seen[1:], start=1):
        assert counts["graveyard"] <= 2, (gen, counts)
        for k in ("threads", "fds"):
            expected = second[k] + cost[k] * (counts["graveyard"] - second["graveyard"])
            # a kept group's pairs, cut when it ended, are closed as gloo's loop reaches them:
            # up to one descriptor per peer of it (world - 1) may still be open, or not
            slack = len(names) - 1 if k == "fds" else 0
            assert abs(counts[k] - expected) <= slack, (gen, k, seen)
    assert last["graveyard"] <= 2


def test_closing_every_member_ends_the_watchers_and_records_no_failure(members):
    m = members(["a", "b", "c"])
    m.form(0, ["a", "b", "c"], sums=5)
    for name in ("a", "b", "c"):
        m.answer(f"{name}/done/0", WAIT_S)
    for name in ("a", "b", "c"):
        m.send(name, op="close")
    for name in ("a", "b", "c"):
        closed = m.answer(f"{name}/closed", WAIT_S)
        assert closed["watcher_alive"] is False and "memsnap-pg-watch" not in closed["threads"], closed
        assert closed["failed"] == {}, closed
    assert not m.store.check([failed_key(m.job, 0)])
    assert m.store.get(over_key(m.job, 0)) == b"closed"
