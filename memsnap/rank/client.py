"""Every call a rank makes to its node's agent, with its deadline, returning records.

A rank never calls the coordinator: its node's agent speaks for it (``relay.py``). This
module is the only place on the rank side that knows the agent's method names, their
deadlines and the shape of their answers; the rest of ``memsnap.rank`` sees typed records.
Calls that need no answer (a failure report, a head start, a counter) are sent without
waiting and never raise.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import ray

from memsnap.config import tunable
from memsnap.errors import MemsnapError
from memsnap.records import RankPlan, RankRestore, RankSource, RoundResult


def unwrap(exc: BaseException) -> BaseException:
    """The memsnap error behind a Ray task error, so callers see the typed error."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, MemsnapError) else exc


def get(ref, timeout: float | None = None):
    """``ray.get(ref)`` within ``timeout`` (default ``call_timeout_s``), raising memsnap's own
    error where the agent raised one."""
    try:
        return ray.get(ref, timeout=timeout or tunable("call_timeout_s"))
    except ray.exceptions.RayTaskError as exc:
        raise unwrap(exc) from None


@dataclass(frozen=True)
class Joined:
    """A rank registered: the agent's data-plane address and the run id it registered under."""

    address: dict
    run: str | None


@dataclass(frozen=True)
class Members:
    """The ranks on this rank's node, whether their pieces go to peers, and why not."""

    ranks: list[int]
    peers: bool
    why: str | None


@dataclass(frozen=True)
class Begun:
    """A save's slot: the arena file to write (``path``), or why the agent skipped the step."""

    path: str | None
    skipped: str | None

    @classmethod
    def from_wire(cls, d: dict) -> Begun:
        return cls(d.get("path"), d.get("skipped"))


@dataclass(frozen=True)
class HeldCopy:
    """A rank's committed bytes of one step in an arena on this node: ``manifest`` (JSON),
    the arena file and how many bytes of it."""

    manifest: str
    path: str
    nbytes: int

    @classmethod
    def from_wire(cls, d: dict) -> HeldCopy:
        return cls(d["manifest"], d["path"], int(d["nbytes"]))


class AgentClient:
    """Rank ``rank``'s calls to its node's agent (``handle``, an ``actors.SnapshotAgent``)."""

    def __init__(self, handle, rank: int):
        self.handle, self.rank = handle, rank

    def _call(self, method: str, *args, timeout: float | None = None):
        return get(getattr(self.handle, method).remote(*args), timeout)

    def _send(self, method: str, *args) -> None:
        """``method(*args)`` without waiting for it (nothing depends on its answer)."""
        with contextlib.suppress(Exception):
            getattr(self.handle, method).remote(*args)

    # --- registration ------------------------------------------------------------------------
    def config(self) -> dict:
        return self._call("config")

    def join(self, world: int, claim: dict) -> Joined:
        timeout = tunable("membership_timeout_s") + tunable("claim_wait_s") + 60
        d = self._call("join", self.rank, world, claim, timeout=timeout)
        return Joined(d["address"], d.get("run"))

    def members(self) -> Members:
        timeout = tunable("membership_timeout_s")
        d = self._call("members", timeout, timeout=timeout + 60)
        return Members(list(d["ranks"]), bool(d["peers"]), d.get("why"))

    # --- save ----------------------------------------------------------------------------------
    def begin(self, step: int, nbytes: int, wait_s: float = 0.0) -> Begun:
        d = self._call("begin", step, self.rank, nbytes, wait_s, timeout=tunable("call_timeout_s") + wait_s)
        return Begun.from_wire(d)

    def captured(self, step: int, manifest_json: str, local_ranks: list[int]) -> None:
        self._call("captured", step, self.rank, manifest_json, local_ranks)

    def captured_later(self, step: int, manifest_json: str, local_ranks: list[int]) -> None:
        """``captured`` from a copy's completion callback (the GPU side stream): not waited for."""
        self._send("captured", step, self.rank, manifest_json, local_ranks)

    def report_failed(self, step: int, why: str) -> None:
        """``step`` cannot commit: the other nodes free their copies and ``wait(step)`` returns."""
        self._send("report_failed", step, why)

    def ready_slots(self, nbytes: int) -> None:
        """Back this rank's arena slots now, in the background (a head start for the first saves)."""
        self._send("ready_slots", self.rank, nbytes)

    # --- commit and spill ---------------------------------------------------------------------
    def wait(self, step: int, timeout: float) -> int | None:
        """The newest committed step once ``step`` is resolved (``timeout=0``: what the node knows now)."""
        return self._call("wait", step, timeout, timeout=timeout + 60)

    def request_spill(self, step: int) -> None:
        self._call("request_spill", step)

    def wait_durable(self, step: int, timeout: float) -> int | None:
        return self._call("wait_durable", step, timeout, timeout=timeout + 60)

    def job_status(self) -> dict:
        return self._call("job_status", timeout=tunable("call_timeout_s") * 3)

    # --- restore --------------------------------------------------------------------------------
    def restore_plan(self, attempt: int) -> RankPlan:
        timeout = tunable("restore_timeout_s") + 10
        return RankPlan.from_wire(self._call("restore_plan", self.rank, attempt, timeout=timeout))

    def restore_done(self, attempt: int, report: RankRestore) -> RoundResult:
        """Report this rank's load; the round's outcome. When it is ok the agent has resumed
        its node from the round's step before it answers (``NodeRelay.restore_done``)."""
        timeout = tunable("restore_timeout_s") + 10
        return RoundResult.from_wire(self._call("restore_done", self.rank, attempt, report.to_wire(), timeout=timeout))

    def local(self, step: int) -> HeldCopy | None:
        """This rank's committed bytes of ``step`` on its own node, or None."""
        d = self._call("local", step, self.rank)
        return None if d is None else HeldCopy.from_wire(d)

    def manifest(self, step: int, rank: int, source: RankSource) -> str:
        """``rank``'s manifest of ``step`` (JSON), from this node or a holder of its owner."""
        return self._call("manifest", step, rank, source.to_wire())

    def manifests(self, step: int, sources: tuple[RankSource, ...]) -> list[str]:
        """Every source's manifest of ``step``, asked at once."""
        refs = [self.handle.manifest.remote(step, src.rank, src.to_wire()) for src in sources]
        return [get(ref) for ref in refs]

    def recover(self, step: int, source: RankSource) -> HeldCopy:
        """The agent reads this rank's bytes of ``step`` from the holders into an arena here."""
        return HeldCopy.from_wire(
            self._call("recover", step, self.rank, source.to_wire(), timeout=tunable("restore_timeout_s"))
        )
