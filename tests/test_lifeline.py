"""Lifelines (``memsnap.collective.lifeline``): a member process that dies is named at once; one
that leaves on purpose, a stranger, or a connection that never says who it is is not."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from memsnap.collective.lifeline import Lifeline, Lifelines
from memsnap.localcluster import wait_for


@pytest.fixture
def lines():
    lifelines = Lifelines("127.0.0.1", hello_timeout_s=1.0, max_pending=4)
    try:
        yield lifelines
    finally:
        lifelines.close()


def member_process(member: str, ticket: tuple[str, int, str], fork: bool = False) -> subprocess.Popen:
    """A process that holds a lifeline and then waits to be killed; it prints ``ready`` (with
    ``fork``: ``ready <pid>`` of a child it forked after, as a data loader forks its workers,
    which lives on once its parent is killed)."""
    code = textwrap.dedent(
        f"""
        import os, sys, time
        from memsnap.collective.lifeline import Lifeline
        line = Lifeline({member!r}, {tuple(ticket)!r})
        child = os.fork() if {fork!r} else 0
        if {fork!r} and child == 0:
            time.sleep(600)
            os._exit(0)
        print("ready", child or "", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.ready = proc.stdout.readline().split()  # type: ignore[attr-defined]
    assert proc.ready[:1] == ["ready"], proc.ready  # type: ignore[attr-defined]
    return proc


def test_a_killed_member_process_is_named_gone(lines):
    proc = member_process("r1", lines.expect("r1"))
    try:
        other = member_process("r2", lines.expect("r2"))
        try:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            wait_for(lambda: "r1" in lines.gone(), timeout=10, what="the killed member named gone")
            assert "r2" not in lines.gone()  # its neighbour lives on
        finally:
            other.kill()
            other.wait(timeout=30)
    finally:
        proc.kill()


def test_a_killed_member_is_named_gone_while_a_child_it_forked_lives_on(lines):
    proc = member_process("r1", lines.expect("r1"), fork=True)
    child = int(proc.ready[1])
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # the child holds every other descriptor it was forked with, but not the lifeline
        wait_for(lambda: "r1" in lines.gone(), timeout=10, what="the killed member named gone")
        os.kill(child, 0)  # (raises if the child is gone: then the test proved nothing)
    finally:
        proc.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_member_that_says_bye_has_left_and_is_not_gone(lines):
    line = Lifeline("r0", lines.expect("r0"), timeout_s=5)
    line.close()
    wait_for(lambda: "r0" in lines.left, timeout=10, what="the bye read")
    assert lines.gone() == {}


def test_a_forgotten_member_closing_is_not_a_loss(lines):
    line = Lifeline("s0", lines.expect("s0"), timeout_s=5)
    sock = line._sock
    wait_for(lambda: "s0" in lines._held, timeout=10, what="the lifeline held")
    lines.forget("s0")
    sock.close()  # closed without bye, after the controller stopped watching it
    probe = Lifeline("p", lines.expect("p"), timeout_s=5)
    probe._sock.close()  # a loss after it, so the first close has been read too
    wait_for(lambda: "p" in lines.gone(), timeout=10, what="the probe's loss")
    assert "s0" not in lines.gone()


def test_a_stranger_cannot_hold_or_close_a_members_lifeline(lines):
    host, port, _ = lines.expect("r3")
    stranger = Lifeline("r3", (host, port, "00" * 16), timeout_s=5)  # the wrong nonce
    # refused: the controller drops it (the stranger reads the close)
    stranger._sock.settimeout(10)
    assert stranger._sock.recv(1) == b""
    stranger._sock.close()
    assert "r3" not in lines.gone()
    unknown = Lifeline("nobody", (host, port, "00" * 16), timeout_s=5)
    unknown._sock.settimeout(10)
    assert unknown._sock.recv(1) == b""
    unknown._sock.close()


@pytest.mark.parametrize("hello", [b"", b"not json\n", json.dumps({"member": "r4"}).encode() + b"\n", b"x" * 2000])
def test_a_connection_that_never_says_who_it_is_is_dropped(lines, hello):
    sock = socket.create_connection(lines.address, timeout=10)
    try:
        sock.sendall(hello)
        assert sock.recv(1) == b""  # dropped: bad hello at once, no hello after hello_timeout_s
    finally:
        sock.close()
    assert lines.gone() == {}


def test_a_flood_of_silent_connections_is_capped():
    lines = Lifelines("127.0.0.1", hello_timeout_s=600.0, max_pending=4)  # no silent one times out here
    socks = [socket.create_connection(lines.address, timeout=10) for _ in range(lines.max_pending + 3)]
    try:
        # past the cap the oldest silent ones are closed; a member, which says who it is as it
        # connects, still gets its lifeline held
        assert socks[0].recv(1) == b""
        line = Lifeline("r5", lines.expect("r5"), timeout_s=5)
        wait_for(lambda: "r5" in lines._held, timeout=10, what="the member's lifeline held")
        line.close()
    finally:
        for s in socks:
            s.close()
        lines.close()
