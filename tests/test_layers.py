"""The tree's layering, read from the source: the data path never imports the transports,
the agent, the rank side or the Ray faces (they import it), and the public names are where
they always were."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "memsnap"

# the data path: state -> bytes -> stripes -> parity -> back into the tensors
DATA_PATH = ["capture", "manifest", "stripes", "buffers", "codec", "encode", "restore", "receive", "apply", "landing"]
ABOVE = ("memsnap.transport", "memsnap.agent", "memsnap.rank", "memsnap.actors", "memsnap.coordinator")


def imports_of(module: str) -> set[str]:
    tree = ast.parse((ROOT / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("module", DATA_PATH)
def test_the_data_path_imports_nothing_above_it(module):
    upward = sorted(m for m in imports_of(module) if m.startswith(ABOVE))
    assert upward == [], f"memsnap/{module}.py imports {upward}"


def test_the_public_names_are_the_ones_they_always_were():
    import memsnap
    import memsnap.snapshotter
    from memsnap.rank import Snapshotter, shutdown, start_spare
    from memsnap.stripes import ChunkKey
    from memsnap.transport import ChunkKey as TransportChunkKey

    assert memsnap.Snapshotter is Snapshotter is memsnap.snapshotter.Snapshotter
    assert memsnap.shutdown is shutdown and memsnap.start_spare is start_spare
    assert TransportChunkKey is ChunkKey
