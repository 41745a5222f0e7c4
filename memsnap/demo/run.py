"""What the demo's two drivers share: the options, a run and its failures, and the choice of
the node to kill and of the moment to kill it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from memsnap.demo.model import ModelConfig
from memsnap.demo.worker import read_events


@dataclass(frozen=True)
class DemoOptions:
    nodes: int = 4
    k: int = 2
    m: int = 1
    model: str = "small"
    steps: int = 40
    failure_steps: tuple[int, ...] = (15,)
    spill_every: int = 10
    frozen_mib: float = 128.0
    out: str = "memsnap-demo"
    seed: int = 0
    timeout_s: float = 900.0
    mode: str = "inplace"  # or "restart": Ray Train restarts the whole worker group

    def __post_init__(self):
        ModelConfig.sized(self.model)  # validates the name
        if self.mode not in ("inplace", "restart"):
            raise ValueError(f"mode={self.mode!r}: must be 'inplace' (the default) or 'restart'")
        if self.nodes < self.k + self.m + 1:
            raise ValueError(
                f"--nodes {self.nodes} is too few for k={self.k}, m={self.m}: "
                f"RS({self.k},{self.m}) needs at least k+m+1 = {self.k + self.m + 1} nodes"
            )
        if self.frozen_mib < 0:
            raise ValueError(f"--frozen-mib {self.frozen_mib}: must be >= 0 (0: the model's state only)")
        if self.steps < 2:
            raise ValueError(f"--steps {self.steps}: needs at least 2 steps")
        fs = list(self.failure_steps)
        if fs != sorted(set(fs)) or any(not 0 < s < self.steps - 1 for s in fs):
            raise ValueError(f"--failure-step {fs}: failure steps must be increasing and inside (0, {self.steps - 1})")
        if len(fs) > self.nodes - 1:
            raise ValueError(f"{len(fs)} failures need more than {self.nodes} nodes")

    @property
    def job(self) -> str:
        return "demo"

    @property
    def cluster_nodes(self) -> int:
        """In place: a head (controller, coordinator), a node per rank, a spare per failure."""
        return self.nodes if self.mode == "restart" else 1 + self.nodes + len(self.failure_steps)


@dataclass
class Failure:
    step: int
    rank: int
    node: str
    t_kill: float
    t_dead: float | None = None


@dataclass
class Run:
    opts: DemoOptions
    log_path: str
    events_path: str
    failures: list[Failure] = field(default_factory=list)
    result: object = None
    error: BaseException | None = None


def say(msg: str) -> None:
    print(f"[memsnap demo] {msg}", file=sys.stderr, flush=True)


def rank_nodes(events: list[dict]) -> dict[int, str]:
    """rank -> node of the newest worker group."""
    nodes: dict[int, str] = {}
    for e in events:
        if e["ev"] == "start":
            nodes[e["rank"]] = e["node"]
    return nodes


def pick_victim(cluster, events: list[dict], head: str) -> tuple[int, str, object] | None:
    by_id = {n.node_id: n for n in cluster.nodes}
    for rank, node in sorted(rank_nodes(events).items(), reverse=True):
        if rank != 0 and node != head and node in by_id:
            return rank, node, by_id[node]
    return None


def held_at(run: Run, step: int) -> int | None:
    """The step (``step`` or later, committed) at which the current worker group holds for
    the next failure, or None while it has not got there."""
    since = run.failures[-1].t_kill if run.failures else 0.0
    held = [
        e["step"]
        for e in read_events(run.events_path)
        if e["ev"] == "at_failure_step" and e["step"] >= step and e["t"] > since
    ]
    return min(held, default=None)
