"""Names of everything a job creates: Ray actors, shared-memory files, KV keys."""

from __future__ import annotations

import os
import re

NAMESPACE = "memsnap"
SHM_DIR = "/dev/shm"  # the tmpfs arenas live on; MEMSNAP_SHM_DIR overrides it
# matched with fullmatch (a trailing newline is not the end of a name, as it is for ``$``)
_ARENA_RE = re.compile(r"memsnap-(?P<job>.+)-(?P<node>[^-/]+)-r(?P<rank>\d+)-s(?P<slot>[^-/]+)-g(?P<gen>\d+)")


def agent(job: str, node_id: str) -> str:
    """The detached agent actor of ``job`` on node ``node_id``."""
    return f"memsnap-agent:{job}:{node_id}"


def coordinator(job: str) -> str:
    """The detached commit coordinator of ``job``."""
    return f"memsnap-coordinator:{job}"


def secret_key(job: str) -> bytes:
    """The Ray internal-KV key under which the job's data-plane secret lives."""
    return f"memsnap:{job}:secret".encode()


def shm_root() -> str:
    """The memory-backed filesystem arenas are made on: ``$MEMSNAP_SHM_DIR``, else /dev/shm."""
    return os.environ.get("MEMSNAP_SHM_DIR") or SHM_DIR


def arena_dir() -> str:
    """This user's private directory of arenas on ``shm_root()`` (``memsnap-<uid>``, mode 0700);
    the agent and the ranks it serves run as the same user, so both name the same directory."""
    return os.path.join(shm_root(), f"memsnap-{os.geteuid()}")


def arena_path(job: str, node_id: str, rank: int, slot: int | str, gen: int) -> str:
    """The shared-memory file of ``rank``'s arena ``slot`` (``gen`` bumps when it is regrown or
    replaced; slot ``"prep"``/``"rebuild"``: an arena made for a restore or a rebuilt local
    copy, renamed to its slot when used)."""
    return os.path.join(arena_dir(), f"memsnap-{job}-{node_id[:12]}-r{rank}-s{slot}-g{gen}")


def arena_gen(path: str) -> tuple[str, int]:
    """``(the path without its generation, the generation)`` of an ``arena_path``: two files of
    one rank's slot share the first."""
    base, gen = path.rsplit("-g", 1)
    return base, int(gen)


def parse_arena(name: str) -> dict | None:
    """``job``, ``node`` (its first 12 characters), ``rank``, ``slot``, ``gen`` of an arena
    file's base name, or None for any other name. A node id holds no ``-``, so a job's name
    (which may) is everything before the last five fields."""
    m = _ARENA_RE.fullmatch(name)
    if m is None:
        return None
    out = m.groupdict()
    out["rank"], out["gen"] = int(out["rank"]), int(out["gen"])
    return out


def is_arena_of(name: str, job: str, node_id: str | None = None) -> bool:
    """Whether base name ``name`` is an arena file of exactly ``job`` (and ``node_id``)."""
    parsed = parse_arena(name)
    return parsed is not None and parsed["job"] == job and (node_id is None or parsed["node"] == node_id[:12])
