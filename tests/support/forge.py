"""Forging a durable checkpoint the way an attacker with write access could. (No tests here.)"""

from __future__ import annotations

import json

import xxhash

from memsnap.durable.storage import Store


def forge_manifest(root: str, step: int, rank: int, doc: dict) -> None:
    """Write ``doc`` as a rank manifest and re-sign it in COMMITTED (a forger can)."""
    store = Store.open(root)
    raw = json.dumps(doc).encode()
    with open(store.path(step, f"rank_{rank:05d}.json"), "wb") as f:
        f.write(raw)
    mpath = store.path(step, "COMMITTED")
    with open(mpath) as f:
        marker = json.load(f)
    marker["ranks"][rank].update(json_bytes=len(raw), json_xxh3=xxhash.xxh3_64_hexdigest(raw))
    with open(mpath, "w") as f:
        json.dump(marker, f)
