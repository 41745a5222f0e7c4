"""A coordinator's directory without Ray: five nodes whose agents answer until taken out of
``up`` (for ``CoordinatorCore`` tests of fencing and heartbeats)."""

from __future__ import annotations

NODES = [c * 40 for c in "abcde"]
A, B, C, D, E = NODES  # ranks 0, 1, 2 on A, B, C; D and E are spares


class Nodes:
    """The coordinator's directory: every node's agent answers until Ray stops seeing it."""

    def __init__(self) -> None:
        self.up = set(NODES)
        self.forgotten: list[str] = []

    def alive(self) -> set[str]:
        return set(self.up)

    def forget(self, node: str) -> None:
        self.forgotten.append(node)

    def agent(self, node: str):
        return None

    def call_all(self, nodes, method: str, *args, timeout: float) -> dict:
        if method == "address":
            return {n: address(n) for n in nodes if n in self.up}
        return {}  # "running": no other run's process is alive


def address(node: str) -> dict:
    return {"host": "127.0.0.1", "port": NODES.index(node) + 1}
