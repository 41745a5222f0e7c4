"""memsnap's own verdict on a node from its agent's heartbeats (no Ray): ``Liveness`` alone,
then through ``CoordinatorCore`` (a silent agent that does not answer is fenced; one that
answers is slow, not lost; a dead actor on a live host is forgotten, not fenced)."""

from __future__ import annotations

import pytest
from support.directory import NODES, Nodes, address

from memsnap.config import SnapshotConfig
from memsnap.job.coordinator import CoordinatorCore
from memsnap.job.liveness import LOAD_WINDOW_S, PING_CAP_S, Liveness

A, B, C, D, E = NODES


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float, beats=(), live=None, period: float = 0.25) -> dict:
        """Advance ``seconds`` in ticks of ``period``; ``beats`` beat at every tick; returns
        the nodes ``live.due`` named on the way."""
        due: dict = {}
        for _ in range(round(seconds / period)):
            self.now += period
            for node in beats:
                live.beat(node)
            due.update(live.due(NODES))
        return due


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def live(clock):
    live = Liveness(1.0, clock)
    for node in NODES:
        live.beat(node)
    live.due(NODES)  # the first tick
    return live


def test_only_a_node_silent_for_lost_after_s_is_due_and_only_once(clock, live):
    others = [A, B, C, D]
    assert clock.tick(0.75, others, live) == {}  # E silent 0.75 s: not yet
    due = clock.tick(0.25, others, live)
    assert list(due) == [E] and "no heartbeat for 1.0 s" in due[E]
    assert clock.tick(1.0, others, live) == {}  # being asked: not named twice


def test_a_node_that_never_beat_is_not_judged(clock):
    live = Liveness(1.0, clock)
    live.beat(A)
    clock.tick(0.25, [], live)
    assert clock.tick(5.0, [], live).keys() == {A}


def test_an_agent_that_answers_its_ping_is_slow_and_its_clock_starts_again(clock, live):
    due = clock.tick(1.0, [A, B, C, D], live)
    verdict = live.decide(E, "answered", due[E], 1.0)
    assert not verdict.lost and verdict.outcome == "answered" and "slow, not lost" in verdict.why
    assert live.slow == {E: 1} and E not in live.lost
    assert clock.tick(0.75, NODES, live) == {}  # beating again
    assert live.beat(E)


def test_an_agent_that_does_not_answer_is_lost_for_good(clock, live):
    due = clock.tick(1.0, [A, B, C, D], live)
    verdict = live.decide(E, "silent", due[E], 1.0)
    assert verdict.lost and "did not answer a ping in 1 s" in verdict.why and verdict.silent_s >= 1.0
    assert live.beat(E) is False  # a paused host that comes back is told it is fenced
    assert clock.tick(5.0, NODES, live) == {}  # and is never asked again
    assert live.status()["lost"] == {E: verdict.why}


def test_a_dead_actor_on_a_live_host_is_forgotten_until_it_beats_again(clock, live):
    due = clock.tick(1.0, [A, B, C, D], live)
    verdict = live.decide(E, "died", due[E], 1.0)
    assert not verdict.lost and "actor is dead" in verdict.why
    assert clock.tick(5.0, [A, B, C, D], live) == {}  # not judged while it does not beat
    assert live.beat(E)  # a new agent there
    assert clock.tick(1.0, [A, B, C, D], live).keys() == {E}


def test_a_suspect_is_asked_at_the_next_tick_without_waiting_for_its_silence(clock, live):
    assert live.suspect(C, "a push to it failed: ConnectionRefusedError()")
    due = clock.tick(0.25, NODES, live)
    assert list(due) == [C] and "ConnectionRefusedError" in due[C]
    live.decide(C, "answered", due[C], 1.0)
    assert C not in live.suspects and clock.tick(0.25, NODES, live) == {}


def test_a_starved_coordinator_judges_nobody_and_starts_every_clock_again(clock, live):
    clock.now += 3.0  # the coordinator's own tick came 3 s late: every node looks silent
    assert live.due(NODES) == {}
    assert clock.tick(0.75, [], live) == {}  # the clocks started again at the late tick
    assert clock.tick(0.25, [], live).keys() == set(NODES)


def test_a_node_whose_beats_come_late_is_given_twice_its_longest_gap(clock, live):
    """A loaded host's agent beats every 0.75 s: it is not asked after the 1 s floor but after
    twice its longest recent gap; the others keep the floor."""
    for _ in range(4):
        clock.tick(0.75, [A, B, C, D], live)
        live.beat(E)
    assert live.silence_limit(E) == pytest.approx(1.5) and live.silence_limit(A) == 1.0
    assert clock.tick(1.25, [A, B, C, D], live) == {}  # 1.25 s silent: not yet, for E
    assert list(clock.tick(0.25, [A, B, C, D], live)) == [E]
    assert live.status()["silence_limit_s"][E] == 1.5


def test_a_slow_answer_lengthens_the_nodes_ping_deadline_and_silence_limit_up_to_the_cap(clock, live):
    assert live.ping_deadline(E, 0.3) == 0.3  # never asked: the floor
    due = clock.tick(1.0, [A, B, C, D], live)
    live.answered(E, 0.2)  # its answer took 0.2 s ...
    live.decide(E, "answered", due[E], 0.3)
    assert live.ping_deadline(E, 0.3) == pytest.approx(0.8)  # ... so the next ping waits 4x
    assert live.silence_limit(E) == pytest.approx(2.0)  # and it was silent 1 s: asked after 2 s
    clock.now += LOAD_WINDOW_S + 0.1  # (E's answer no longer tells how loaded the job is)
    assert live.ping_deadline(A, 0.3) == 0.3 and live.ping_deadline(E, 0.3) == pytest.approx(0.8)
    live.answered(E, 5.0)
    assert live.ping_deadline(E, 0.3) == PING_CAP_S  # a frozen host is still fenced in time
    live.forget(E)  # a node that left: what it needed is forgotten with it
    assert live.ping_deadline(E, 0.3) == 0.3 and live.silence_limit(E) == 1.0


def test_a_slow_answer_from_any_node_lengthens_every_ping_while_the_job_is_loaded(clock, live):
    """Several agents fall silent at once on a loaded host: the one asked last is given as
    long as the others needed to answer, not fenced at the floor; once the load is old news,
    the floor is back."""
    live.answered(B, 0.25)  # B (a control, or a silent node that answered) took 0.25 s
    assert live.ping_deadline(E, 0.3) == pytest.approx(1.0)  # E never answered: 4x B's
    live.answered(C, 0.01)  # a quick answer does not shorten it: the slowest recent one counts
    assert live.ping_deadline(E, 0.3) == pytest.approx(1.0)
    clock.now += LOAD_WINDOW_S + 0.1
    assert live.ping_deadline(E, 0.3) == 0.3
    live.answered(C, 2.0)
    assert live.ping_deadline(E, 0.3) == PING_CAP_S  # a frozen host is still fenced in time


def test_the_control_of_a_probe_is_the_node_heard_from_last_and_never_one_being_asked(clock, live):
    clock.tick(0.25, [A, B], live)
    clock.now += 0.1
    live.beat(C)
    assert live.control(E) == C and live.control(C) in (A, B)  # (A and B beat at one instant)
    due = clock.tick(1.0, [C], live)  # A, B, D and E fall silent: all four are being asked
    assert set(due) == {A, B, D, E}
    assert live.control(E) == C and live.control(C) is None  # nobody else is beating and free
    live.decide(E, "silent", due[E], 0.3)  # E lost: never a control again
    live.decide(A, "answered", due[A], 0.3)
    assert live.control(C) == A


def test_ticks_on_time_are_not_starvation_even_with_a_floor_below_two_periods(clock):
    """With a 0.5 s floor and the watch every 0.3 s, a tick on time is not "late": a frozen
    agent is still asked after its 0.5 s of silence."""
    live = Liveness(0.5, clock, tick_s=0.3)
    for node in NODES:
        live.beat(node)
    live.due(NODES)
    due = clock.tick(0.6, [A, B, C, D], live, period=0.3)
    assert list(due) == [E]


def test_bad_values_are_refused_naming_them(clock):
    with pytest.raises(ValueError, match="lost_after_s=0"):
        Liveness(0, clock)
    with pytest.raises(ValueError, match="tick_s=0"):
        Liveness(1.0, clock, tick_s=0)
    with pytest.raises(ValueError, match="outcome='maybe'"):
        Liveness(1.0, clock).decide(A, "maybe", "", 1.0)


@pytest.fixture
def core(clock):
    core = CoordinatorCore(SnapshotConfig("liveness", k=2, m=1).to_dict(), 3, directory=Nodes())
    core.liveness = Liveness(1.0, clock)
    core.sent = []
    core.broadcast = lambda *args: core.sent.append(args[0])
    for rank, node in enumerate([A, B, C]):
        core.join(node, address(node), [rank], 3)
    for node in NODES:
        core.beat(node)
    return core


def silence(clock, core, quiet: str) -> dict:
    """One second of ticks in which every agent but ``quiet`` beats: what comes due."""
    assert core.heartbeats_due() == {}
    due: dict = {}
    for _ in range(4):
        clock.now += 0.25
        for node in NODES:
            if node != quiet:
                core.beat(node)
        due.update(core.heartbeats_due())
    return due


def test_a_silent_spare_that_does_not_answer_is_fenced_and_the_placement_drops_it(clock, core):
    due = silence(clock, core, D)
    assert list(due) == [D]
    verdict = core.heartbeat_verdict(D, "silent", due[D], 1.0)
    assert verdict.lost and D in core.fenced and D not in core._alive()
    assert "layout_changed" in core.sent and D not in core.membership.placement.holders
    assert core.beat(D) is False
    assert core.status()["liveness"]["lost"][D] == verdict.why


def test_a_slow_agent_is_not_fenced(clock, core):
    due = silence(clock, core, D)
    assert list(due) == [D]
    verdict = core.heartbeat_verdict(D, "answered", due[D], 1.0)
    assert not verdict.lost and core.fenced == set() and core.beat(D)
    assert core.status()["liveness"]["slow"] == {D: 1}


def test_a_node_the_controller_fenced_is_never_pinged(clock, core):
    core.node_lost(B, "its ranks' process group saw it go")
    clock.now += 5.0
    assert B not in core.heartbeats_due() and core.beat(B) is False
