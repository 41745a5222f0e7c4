"""The job store's keys, and what the controller writes there for each generation of the
process group: which member is which rank, of how many, or that the job is done (every member
leaves). Members read it when they wait for their next generation (``rank.member.Member.run``);
the key layout is in ``rank/member.py``'s docstring."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Assignment:
    world: int
    members: Mapping[str, int] = field(default_factory=dict)  # member name -> its rank
    done: bool = False
    recoveries: int = 0  # the job's recoveries before this generation
    rollbacks: int = 0  # of those, the ones that rolled back (the rest went on from live state)
    age_s: float = 0.0  # how long the job had run when this generation was written

    def rank_of(self, member: str) -> int | None:
        """``member``'s rank in this generation, or None: a standby, or left out."""
        return self.members.get(member)

    def to_json(self) -> str:
        return json.dumps(
            {
                "world": self.world,
                "members": dict(self.members),
                "done": self.done,
                "recoveries": self.recoveries,
                "rollbacks": self.rollbacks,
                "age_s": self.age_s,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Assignment:
        d = json.loads(text)
        return cls(
            int(d["world"]),
            {str(m): int(r) for m, r in d["members"].items()},
            bool(d.get("done", False)),
            int(d.get("recoveries", 0)),
            int(d.get("rollbacks", 0)),
            float(d.get("age_s", 0.0)),
        )


def gen_key(job: str, gen: int) -> str:
    return f"memsnap/{job}/gen/{gen}"


def report_key(job: str, gen: int, rank: int) -> str:
    return f"memsnap/{job}/gen/{gen}/report/{rank}"


def fenced_key(job: str, gen: int) -> str:
    return f"memsnap/{job}/gen/{gen}/fenced"


def done_key(job: str, rank: int) -> str:
    return f"memsnap/{job}/done/{rank}"


def leave_key(job: str, member: str) -> str:
    return f"memsnap/{job}/leave/{member}"


def handover_key(job: str, gen: int) -> str:
    return f"memsnap/{job}/gen/{gen}/handover"
