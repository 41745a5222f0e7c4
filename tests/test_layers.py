"""The tree's layering, read from the source: each package imports only the ones below it
(the data path never imports the transports, the agent, the rank side or the Ray faces: they
import it), and the public names are where they always were."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "memsnap"

# the data path: state -> bytes -> stripes -> parity -> back into the tensors
DATA_PATH = [
    "state/capture",
    "state/manifest",
    "coding/stripes",
    "coding/buffers",
    "coding/codec",
    "coding/encode",
    "coding/restore",
    "coding/receive",
    "state/apply",
    "coding/landing",
]
ABOVE = ("memsnap.transport", "memsnap.node.agent", "memsnap.rank", "memsnap.actors", "memsnap.job.coordinator")


def imports_of(module: str) -> set[str]:
    tree = ast.parse((ROOT / f"{module}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            # ``from memsnap.job import coordinator`` imports memsnap.job.coordinator
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


# what each package must never import, anywhere in it (imports inside functions too)
NEVER = {
    "state": ("coding", "transport", "node", "job", "durable", "rank", "inplace", "actors"),
    "coding": ("transport", "node", "job", "durable", "rank", "inplace", "actors"),
    "durable": ("coding", "transport", "node", "job", "rank", "inplace", "actors"),
    "transport": ("node", "job", "durable", "rank", "inplace", "actors"),
    "job": ("transport", "node", "rank", "inplace", "actors"),
    "node": ("job", "rank", "inplace"),
    "rank": ("inplace",),
    "collective": ("coding", "transport", "node", "job", "durable", "rank", "inplace", "actors"),
    "memory": ("state", "coding", "transport", "node", "job", "durable", "rank", "inplace", "actors", "device"),
}


@pytest.mark.parametrize("package", sorted(NEVER))
def test_a_package_imports_nothing_above_it(package):
    found = []
    for path in sorted((ROOT / package).glob("*.py")):
        module = f"{package}/{path.stem}"
        for m in sorted(imports_of(module)):
            parts = m.split(".")
            if parts[0] == "memsnap" and len(parts) > 1 and parts[1] in NEVER[package]:
                found.append(f"memsnap/{module}.py imports {m}")
    assert found == []


def _unit_imports() -> dict[str, set[str]]:
    """Each top-level unit of the package (a subpackage, or a module beside them) -> the other
    units it imports, anywhere in it."""
    units: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        unit = rel.parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        module = str(rel.with_suffix(""))
        for m in imports_of(module):
            parts = m.split(".")
            if parts[0] == "memsnap" and len(parts) > 1 and parts[1] != unit:
                if (ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").exists():
                    units.setdefault(unit, set()).add(parts[1])
        units.setdefault(unit, set())
    return units


def test_no_two_units_of_the_package_import_each_other_even_through_others() -> None:
    graph = _unit_imports()
    assert {"node", "job", "coding", "memory", "records"} <= set(graph)  # it read the tree
    cycles = []
    for start in sorted(graph):
        # every unit reachable from ``start``; a path back to ``start`` is a cycle
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            u = todo.pop()
            if u == start:
                cycles.append(start)
                break
            if u not in seen:
                seen.add(u)
                todo.extend(graph.get(u, ()))
    assert cycles == [], f"units on an import cycle: {cycles}"


@pytest.mark.parametrize("module", DATA_PATH)
def test_the_data_path_imports_nothing_above_it(module):
    upward = sorted(m for m in imports_of(module) if m.startswith(ABOVE))
    assert upward == [], f"memsnap/{module}.py imports {upward}"


def test_the_public_names_are_the_ones_they_always_were():
    import memsnap
    import memsnap.snapshotter
    from memsnap.coding.stripes import ChunkKey
    from memsnap.rank import Snapshotter, shutdown, start_spare
    from memsnap.transport import ChunkKey as TransportChunkKey

    assert memsnap.Snapshotter is Snapshotter is memsnap.snapshotter.Snapshotter
    assert memsnap.shutdown is shutdown and memsnap.start_spare is start_spare
    assert TransportChunkKey is ChunkKey
