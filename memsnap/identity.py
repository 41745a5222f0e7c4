"""Which run a rank belongs to: its run id (the job's incarnation) and its process.

A *job name* names the snapshots; a *run* is one training run using it: every rank of the
run, and every restart of it (new processes, maybe on new nodes), carries the same run id.
The id comes from the launcher where one exists (``run=``, ``MEMSNAP_RUN_ID``, torchrun's
``TORCHELASTIC_RUN_ID``, the Ray Train run or Tune trial) and is otherwise made by the
coordinator at the job's first registration and handed to every rank. A rank's *process
token* (pid and start time) lets the node's agent tell whether the process that holds a rank
still runs: a rank of another run may only take over a rank whose holder is gone.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from dataclasses import dataclass

from memsnap.errors import ConfigError

_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_NOT_JOB = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Claim:
    """A rank's registration: ``run`` (None: no id given, the job's is taken) and ``process``
    (``process_token()`` of the rank's process)."""

    run: str | None
    process: str

    def to_wire(self) -> dict:
        return {"run": self.run, "process": self.process}

    @classmethod
    def from_wire(cls, d: dict | None) -> Claim:
        d = d or {}
        return cls(d.get("run"), str(d.get("process", "")))


def check_run(run) -> str | None:
    """``run`` (None allowed) if it is a usable run id."""
    if run is None:
        return None
    if not isinstance(run, str) or not _RUN_RE.fullmatch(run):
        raise ConfigError(
            f"run={run!r}: use 1-128 characters of letters, digits, '_', '.', ':', '-' "
            "(the same on every rank and every restart of one run)"
        )
    return run


def run_from_env() -> str | None:
    """The run id the launcher set: ``MEMSNAP_RUN_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``
    (its default ``none`` is no id), else None."""
    for var in ("MEMSNAP_RUN_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(var)
        if value and value != "none":
            try:
                return check_run(value)
            except ConfigError as exc:
                raise ConfigError(f"{var}={value!r}: {str(exc).split(': ', 1)[1]}") from None
    return None


def new_run_id() -> str:
    """A fresh run id (the coordinator makes one at a job's first registration without one)."""
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def job_name(text: str) -> str:
    """A valid job name made from ``text`` (a Ray Train run or Tune trial name): other characters
    become '-', and a name over 64 characters keeps its start and a hash of the whole."""
    name = _NOT_JOB.sub("-", str(text)).strip("-._") or "job"
    if len(name) > 64:
        name = f"{name[:55].rstrip('-._')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return name


def process_token(pid: int | None = None) -> str:
    """``"<pid>-<start time>"`` of a process (this one by default): a pid reused later by
    another process does not match."""
    pid = os.getpid() if pid is None else pid
    stat = _stat(pid)
    return f"{pid}-{stat[1] if stat else 0}"


PF_EXITING = 0x4  # a task's flag (/proc/<pid>/stat field 9) from the start of its exit


def running(tokens) -> list[str]:
    """The ``tokens`` whose process still runs on this machine: not a zombie, and not exiting
    (a killed process is torn down first and closes its sockets last: with gigabytes of
    memory to free that takes seconds, and its flag says so from the start)."""
    out = []
    for token in tokens:
        try:
            pid, start = (int(x) for x in str(token).split("-", 1))
        except ValueError:
            continue
        stat = _stat(pid)
        if stat is None:
            if not os.path.exists("/proc/self/stat") and _signalable(pid):
                out.append(token)  # no /proc: a pid that exists counts
            continue
        state, started, flags = stat
        if state not in ("Z", "X") and not flags & PF_EXITING and (start == 0 or started == start):
            out.append(token)
    return out


def working(tokens) -> list[str]:
    """The ``tokens`` whose process runs on this machine and is not stopped (SIGSTOP, a
    tracer's stop): a process that may beat again, however slow it is now."""
    out = []
    for token in running(tokens):
        pid = int(str(token).split("-", 1)[0])
        stat = _stat(pid)
        if stat is None or stat[0] not in ("T", "t"):
            out.append(token)
    return out


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, start time in clock ticks, flags) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read())
    except OSError:
        return None


def parse_stat(text: str) -> tuple[str, int, int] | None:
    """(state, start time, flags) from the text of a /proc/<pid>/stat, or None."""
    try:
        fields = text.rsplit(")", 1)[1].split()
        return fields[0], int(fields[19]), int(fields[6])
    except (IndexError, ValueError):
        return None


def _signalable(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_identity(ctx, v2_run_id=None) -> tuple[str, str]:
    """``(job name, run id)`` of the Ray Train run a worker belongs to (``ctx``: its
    ``ray.train.get_context()``): a Tune trial's name and id where the run is a trial, else
    the run's name (``RunConfig(name=...)``) with its id. The run id stays the same across the
    worker group's restarts and differs between trials, so the default job name is one per
    trial. ``v2_run_id``: reads Ray Train's id of the run (tests pass their own)."""
    try:
        trial, trial_id = ctx.get_trial_name(), ctx.get_trial_id()
    except (DeprecationWarning, AttributeError):  # Ray Train v2 has no trials: its run has a name and an id
        trial, trial_id = None, None
    if trial and trial_id:
        return job_name(trial), job_name(trial_id)
    name = ctx.get_experiment_name()
    run_id = (v2_run_id or _v2_run_id)()
    if run_id is None:
        return job_name(name), job_name(name)
    return job_name(f"{name}-{run_id[:8]}"), job_name(f"{name}-{run_id}")


def _v2_run_id() -> str | None:
    """Ray Train's unique id of this worker's run (v2), or None where it cannot be read."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return str(get_train_context().train_run_context.run_id)
    except Exception:  # noqa: BLE001 (a private API: any failure means "not readable")
        return None
