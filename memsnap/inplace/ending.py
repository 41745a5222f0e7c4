"""Asking a silent member's node whether its process has ended, without waiting for the answer.

A killed process stops beating at once, but closes its sockets (its lifeline, its collectives'
connections) only at the end of its teardown, after its memory is freed: with gigabytes to free
that takes a second or more. Its node's agent sees the end from the start
(``identity.running``: the process is gone, a zombie, or exiting). The controller asks once a
member has been silent for ``suspect_after_s``, once per silence, and reads the answer on a
later poll: an agent that does not answer (its node went with the member) holds nothing up, and
the member is lost by its lifeline or its silence as before. A member named here is certain to
be lost (its process will never beat again): no false positive is possible, only a late answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class EndedAsks:
    """``ask(node, tokens)``: sends the question, returns a handle (None: nobody to ask);
    ``poll(handles)``: the answers that have come, ``{handle: tokens still running, or the
    exception the ask raised}``, without waiting."""

    def __init__(
        self,
        ask: Callable[[str, list[str]], Any],
        poll: Callable[[list], dict],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ask, self.poll, self.clock = ask, poll, clock
        self._asked: dict[str, Any] = {}  # member -> its pending ask's handle; None once answered
        self._out: dict[int, tuple[str, Any, float]] = {}  # id(handle) -> (node, handle, when sent)
        self.answered: dict[str, float] = {}  # node -> when its agent last answered (the clock's time)

    def ended(self, silent: dict[str, tuple[str, str]]) -> list[str]:
        """``silent``: ``member -> (node, process token)`` of every member silent for
        ``suspect_after_s`` now. Asks the nodes of those not asked yet in this silence (one
        ask per node); returns those whose node answered that their process no longer runs."""
        for member in [m for m in self._asked if m not in silent]:
            del self._asked[member]  # it beat again (or was dealt with): a new silence asks anew
        by_node: dict[str, list[str]] = {}
        for member, (node, _) in silent.items():
            if member not in self._asked:
                by_node.setdefault(node, []).append(member)
        for node, members in by_node.items():
            handle = self.ask(node, [silent[m][1] for m in members])
            for m in members:
                self._asked[m] = handle
            if handle is not None:
                self._out[id(handle)] = (node, handle, self.clock())
        handles = [h for _, h, _ in self._out.values()]  # (every ask not yet answered)
        out = []
        for handle, answer in (self.poll(handles) if handles else {}).items():
            entry = self._out.pop(id(handle), None)
            if entry is not None and not isinstance(answer, BaseException):
                self.answered[entry[0]] = self.clock()
            for member in [m for m, h in self._asked.items() if h is handle]:
                self._asked[member] = None
                if not isinstance(answer, BaseException) and silent[member][1] not in set(answer):
                    out.append(member)
        return out

    def unanswered(self) -> dict[str, tuple[Any, float]]:
        """``node -> (handle, when sent)`` of the oldest ask still out to each node: a node
        asked this long ago and still silent has had that long to answer (the fencing ping
        counts it), whether or not its member is still silent."""
        out: dict[str, tuple[Any, float]] = {}
        for node, handle, sent in self._out.values():
            if node not in out or sent < out[node][1]:
                out[node] = (handle, sent)
        return out

    def forget(self, node: str) -> None:
        """Stop counting the asks out to ``node`` (fenced: it never answers)."""
        self._out = {k: v for k, v in self._out.items() if v[0] != node}
