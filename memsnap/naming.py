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
    """The shared-memory file of ``rank``'s arena ``slot`` (``gen`` bumps when it is regrown;
    slot ``"prep"``: an arena prepared for a restore, renamed to its slot when used)."""
    return os.path.join(SHM_DIR, f"memsnap-{job}-{node_id[:12]}-r{rank}-s{slot}-g{gen}")


def arena_files(job: str, node_id: str | None = None) -> list[str]:
    """Every shared-memory file of ``job`` (on ``node_id`` only, if given) that exists now."""
    node = "*" if node_id is None else node_id[:12]
    return sorted(glob.glob(os.path.join(SHM_DIR, f"memsnap-{glob.escape(job)}-{node}-r*")))
