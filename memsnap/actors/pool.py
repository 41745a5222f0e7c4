"""What both Ray faces share: their own threads for blocking work, the errors that mean the
actor on the other end is gone, and how their logs are written."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import ray

LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def log_to_stderr() -> None:
    """An actor's log lines (Ray keeps its stderr in the session's ``logs/worker-*.err``), each
    with its wall time to the millisecond, so that a recovery can be read across actors."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )


class Pool:
    """An actor's own threads for blocking work, awaited from its event loop."""

    def __init__(self, threads: int, name: str):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
