"""Two processes of one child script, as rank 0 and rank 1 of the in-place group tests that run
without Ray: beside a rendezvous store this process holds, each child is given its rank, the
store's port and the file to write its results to (JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from memsnap.localcluster import free_port


def run_pair(child: str, tmp_path: Path, timeout_s: float = 120.0) -> list[dict]:
    """``child`` (a script's source) run as ranks 0 and 1, ``argv``: rank, store port, results
    file. Both must exit 0; their results, by rank."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    script = tmp_path / "child.py"
    script.write_text(child)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(port), str(tmp_path / f"r{r}.json")])
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            p.kill()
        del store  # (held until both children are done)
    assert codes == [0, 0]
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
