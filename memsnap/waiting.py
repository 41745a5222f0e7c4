"""Waiting without a thread per waiter: a condition for asyncio code, notified from any thread.

The coordinator and the agents are asyncio actors: a barrier of N participants costs N
futures on one event loop, not N parked threads, so no concurrency number limits a job's size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Signal:
    """``await wait_for(predicate, timeout)`` until ``predicate()`` holds; ``notify()`` (from any
    thread, or the loop itself) makes every waiter look again."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def _bind(self) -> asyncio.Event:
        if self._event is None:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        return self._event

    def notify(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # nobody has waited yet: the next waiter looks at the predicate first
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake()
        else:
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        old, self._event = self._event, asyncio.Event()
        if old is not None:
            old.set()

    async def wait_for(self, predicate: Callable[[], object], timeout: float) -> bool:
        """True once ``predicate()`` holds (is true); False if ``timeout`` seconds pass first."""
        self._bind()
        loop = self._loop
        assert loop is not None  # bound
        deadline = loop.time() + timeout
        while not predicate():
            left = deadline - loop.time()
            if left <= 0:
                return False
            event = self._event
            assert event is not None  # bound, and _wake always leaves a fresh one
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True

    async def next(self, timeout: float) -> bool:
        """Until the next ``notify()``; False if ``timeout`` seconds pass first. (A notify just
        before the call is not seen: a caller that re-checks its state loops with a short
        ``timeout``.)"""
        if timeout <= 0:
            return False
        try:
            await asyncio.wait_for(self._bind().wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class Batch:
    """Calls from many callers, sent in as few calls as possible: one ``send(items)`` in flight
    at a time, carrying everything that arrived meanwhile; every caller gets the answer of the
    call its item went out in. A node's agent uses it so that its ranks reach the coordinator
    once per node, not once per rank."""

    def __init__(self, send: Callable[[list], Awaitable]):
        self._send = send
        self._items: list = []
        self._futures: list[asyncio.Future] = []
        self._running = False

    async def add(self, item):
        fut = asyncio.get_running_loop().create_future()
        self._items.append(item)
        self._futures.append(fut)
        if not self._running:
            self._running = True
            asyncio.ensure_future(self._flush())
        return await fut

    async def _flush(self) -> None:
        try:
            while self._items:
                items, futures = self._items, self._futures
                self._items, self._futures = [], []
                try:
                    answer = await self._send(items)
                except BaseException as exc:  # every caller of this call sees the error
                    for f in futures:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                for f in futures:
                    if not f.done():
                        f.set_result(answer)
        finally:
            self._running = False
