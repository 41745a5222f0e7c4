"""What both Ray faces share: their own threads for blocking work, and the errors that mean the
actor on the other end is gone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import ray

LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class Pool:
    """An actor's own threads for blocking work, awaited from its event loop."""

    def __init__(self, threads: int, name: str):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
