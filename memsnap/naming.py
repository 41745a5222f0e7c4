"""Names of everything a job creates: Ray actors, shared-memory files, KV keys."""
from __future__ import annotations

import glob
import os

NAMESPACE = "memsnap"
SHM_DIR = "/dev/shm"


def agent(job: str, node_id: str) -> str:
    """The detached agent actor of ``job`` on node ``node_id``."""
    return f"memsnap-agent:{job}:{node_id}"


def coordinator(job: str) -> str:
    """The detached commit coordinator of ``job``."""
    return f"memsnap-coordinator:{job}"


def secret_key(job: str) -> bytes:
    """The Ray internal-KV key under which the job's data-plane secret lives."""
    return f"memsnap:{job}:secret".encode()


def arena_path(job: str, node_id: str, rank: int, slot: int | str, gen: int) -> str:
    """The shared-memory file of ``rank``'s arena ``slot`` (``gen`` bumps when it is regrown or
    replaced; slot ``"prep"``/``"rebuild"``: an arena made for a restore or a rebuilt local
    copy, renamed to its slot when used)."""
    return os.path.join(SHM_DIR, f"memsnap-{job}-{node_id[:12]}-r{rank}-s{slot}-g{gen}")


def arena_gen(path: str) -> tuple[str, int]:
    """``(the path without its generation, the generation)`` of an ``arena_path``: two files of
    one rank's slot share the first."""
    base, gen = path.rsplit("-g", 1)
    return base, int(gen)


def arena_files(job: str, node_id: str | None = None) -> list[str]:
    """Every shared-memory file of ``job`` (on ``node_id`` only, if given) that exists now."""
    node = "*" if node_id is None else node_id[:12]
    return sorted(glob.glob(os.path.join(SHM_DIR, f"memsnap-{glob.escape(job)}-{node}-r*")))
