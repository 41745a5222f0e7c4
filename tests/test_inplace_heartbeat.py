"""Heartbeats (no Ray): the controller's ``Monitor`` on a fake clock, a ``Beater`` that really
beats, and a member whose beats go on while its training thread is blocked on the store."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from memsnap.collective.heartbeat import Beater, Monitor, beat_key
from memsnap.localcluster import wait_for

JOB = "hbtest"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ages_grow_while_a_counter_stands_still_and_reset_when_it_moves():
    store, clock = dist.HashStore(), Clock()
    mon = Monitor(store, JOB, clock=clock)
    mon.watch("r0")
    mon.watch("r1")
    assert mon.poll() == {"r0": 0.0, "r1": 0.0}
    clock.now += 2.5
    assert mon.poll() == {"r0": 2.5, "r1": 2.5}
    store.add(beat_key(JOB, "r1"), 1)  # r1 beats once
    clock.now += 1.0
    assert mon.poll() == {"r0": 3.5, "r1": 0.0}
    clock.now += 0.5
    assert mon.poll() == {"r0": 4.0, "r1": 0.5}  # the age counts from when the counter moved
    store.add(beat_key(JOB, "r0"), 3)
    clock.now += 0.25
    assert mon.poll() == {"r0": 0.0, "r1": 0.75}


def test_watching_again_starts_the_clock_and_the_counter_anew():
    store, clock = dist.HashStore(), Clock()
    mon = Monitor(store, JOB, clock=clock)
    mon.watch("s0")
    store.add(beat_key(JOB, "s0"), 7)
    clock.now += 5
    mon.watch("s0")  # a member started again under the same name
    assert store.get(beat_key(JOB, "s0")) == b"0"
    clock.now += 1
    assert mon.poll() == {"s0": 1.0}


def test_forget_stops_watching():
    store, clock = dist.HashStore(), Clock()
    mon = Monitor(store, JOB, clock=clock)
    assert mon.poll() == {}
    mon.watch("r0")
    mon.watch("r1")
    mon.forget("r1")
    mon.forget("never-watched")  # nothing to forget: no error
    clock.now += 3
    assert mon.poll() == {"r0": 3.0}
    mon.forget("r0")
    assert mon.poll() == {}


def test_a_beater_really_beats_and_stops_when_closed():
    store = dist.HashStore()
    mon = Monitor(store, JOB)
    mon.watch("r0")
    beater = Beater(store, JOB, "r0", interval_s=0.005)
    try:
        wait_for(lambda: int(store.get(beat_key(JOB, "r0"))) >= 3, timeout=10, what="three beats")
    finally:
        beater.close()
    assert not beater._thread.is_alive()  # closed: its thread has ended, nothing beats any more


@pytest.fixture
def master():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def test_a_member_beats_while_its_process_group_waits_on_the_store(master):
    """Forming a group waits on the rendezvous store until every member has come (gloo's
    rendezvous, through the group's store client); a client serves one call at a time. The
    member's beats must go on meanwhile, or a member waiting for a slow peer looks lost."""
    from memsnap.rank.member import Member

    member = Member(
        JOB,
        "r0",
        ("127.0.0.1", master.port),
        setup=lambda ctx: None,
        train=lambda ctx, st: None,
        snapshot_options={},
        beat_s=0.005,
        preemption_poll_s=None,
    )
    blocked = threading.Thread(target=lambda: member.group.store.get("memsnap/hbtest/pg/0/peer-address"), daemon=True)
    try:
        blocked.start()
        key = beat_key(JOB, "r0")
        wait_for(lambda: master.check([key]), timeout=10, what="the first beat")
        before = int(master.get(key))
        wait_for(
            lambda: int(master.get(key)) >= before + 10,
            timeout=10,
            what="ten beats while the group's store client waits",
        )
    finally:
        master.set("memsnap/hbtest/pg/0/peer-address", "x")  # the wait ends
        blocked.join(timeout=30)
        member.close()
