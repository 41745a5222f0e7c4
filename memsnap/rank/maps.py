"""The rank's mappings of its node agent's arena files (a save writes into one, a local
restore reads one), kept until the agent replaces the file behind a slot."""

from __future__ import annotations

from memsnap import naming
from memsnap.memory.arena import Arena


class ArenaMaps:
    def __init__(self):
        self._maps: dict[str, Arena] = {}

    def view(self, path: str, nbytes: int) -> memoryview:
        """The first ``nbytes`` of arena file ``path``, mapped once and kept."""
        arena = self._maps.get(path)
        if arena is None or arena.nbytes < nbytes:
            slot = naming.arena_gen(path)[0]  # the agent replaced this slot's file: drop the old mapping
            for old in [p for p in self._maps if p != path and naming.arena_gen(p)[0] == slot]:
                self._maps.pop(old).close(unlink=False)
            arena = self._maps[path] = Arena.attach(path, nbytes)
        return arena.view(0, nbytes)

    def close(self) -> None:
        for arena in self._maps.values():
            arena.close(unlink=False)
        self._maps.clear()
