"""Processes that are members of one ``RecoverableGroup`` job, driven from the test through
the rendezvous store the test hosts (the controller's side), as the in-place controller does.

Each process (``serve``) holds one ``RecoverableGroup`` for its whole life and obeys the
commands the test writes under ``test/<name>/cmd/<i>`` (JSON), one after another:

  ``{"op": "form", "gen": g, "rank": r, "world": w, "sums": n}``: form generation ``g``, then
      all_reduce until the generation ends (``n`` null) or ``n`` times; ``test/<name>/ready/<g>``
      is written after the first few correct sums (with the process's counts),
      ``test/<name>/left/<g>`` when the generation ends under it (the exception's type and
      message, the group's ``failure()``, the counts), ``test/<name>/done/<g>`` after ``n``.
  ``{"op": "counts", "tag": t}``: write the group's counts under ``test/<name>/counts/<t>``.
  ``{"op": "close"}``: ``close()`` the group, write ``test/<name>/closed`` (whether the
      watcher thread still runs, the failures recorded, the threads left) and exit.

Only JSON crosses between the processes. ``Members`` is the test's side: it starts the
processes, writes commands, waits for answers with a deadline and kills every process it
started when it is closed. The processes are forked by multiprocessing's fork server: a
fresh interpreter (no state of the test's process) that imported torch once, so a spare is
started in milliseconds instead of one torch import each.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
from datetime import timedelta
from multiprocessing.process import BaseProcess

JOB = "pgtest"
SUMS_BEFORE_READY = 3


def _put(store, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def _form(group, store, name: str, cmd: dict) -> None:
    import torch

    gen, world, limit = cmd["gen"], cmd["world"], cmd.get("sums")
    sums = 0
    try:
        group.configure(gen, cmd["rank"], world)
        while limit is None or sums < limit:
            x = torch.ones(1024)
            group.all_reduce(x)
            if float(x[0]) != world:
                raise AssertionError(f"all_reduce of ones over {world} members gave {float(x[0])}")
            sums += 1
            if sums == SUMS_BEFORE_READY:
                _put(store, f"test/{name}/ready/{gen}", group.counts())
    except Exception as exc:
        _put(
            store,
            f"test/{name}/left/{gen}",
            {
                "kind": type(exc).__name__,
                "message": str(exc),
                "gen": getattr(exc, "gen", None),
                "failure": group.failure(),
                "counts": group.counts(),
            },
        )
        return
    _put(store, f"test/{name}/done/{gen}", group.counts())


def serve(port: int, name: str, backend_timeout_s: float) -> None:
    """One member process: obey the commands until ``close``."""
    import torch
    import torch.distributed as dist

    from memsnap.collective.group import RecoverableGroup

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=300))
    group = RecoverableGroup(JOB, ("127.0.0.1", port), timeout_s=backend_timeout_s)
    _put(store, f"test/{name}/up", {"pid": os.getpid()})
    i = 0
    while True:
        key = f"test/{name}/cmd/{i}"
        store.wait([key])
        cmd = json.loads(store.get(key))
        i += 1
        if cmd["op"] == "form":
            _form(group, store, name, cmd)
        elif cmd["op"] == "counts":
            _put(store, f"test/{name}/counts/{cmd['tag']}", group.counts())
        elif cmd["op"] == "close":
            group.close()
            _put(
                store,
                f"test/{name}/closed",
                {
                    "watcher_alive": group._watcher.is_alive(),
                    "failed": {str(g): w for g, w in group._failed.items()},
                    "threads": sorted(t.name for t in threading.enumerate()),
                },
            )
            return


class Members:
    """The test's side: member processes by name, the store they rendezvous on (hosted here)."""

    def __init__(self, names: list[str], backend_timeout_s: float = 120.0):
        import torch.distributed as dist

        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.job = JOB
        self.backend_timeout_s = backend_timeout_s
        self.procs: dict[str, BaseProcess] = {}
        self._sent: dict[str, int] = {}
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "torch.distributed", "memsnap.collective.group", __name__])
        for name in names:
            self.start(name)

    def start(self, name: str) -> None:
        proc = self._ctx.Process(
            target=serve, args=(self.store.port, name, self.backend_timeout_s), name=f"member-{name}", daemon=True
        )
        proc.start()
        self.procs[name] = proc
        self._sent[name] = 0

    def send(self, name: str, **cmd) -> None:
        _put(self.store, f"test/{name}/cmd/{self._sent[name]}", cmd)
        self._sent[name] += 1

    def form(self, gen: int, members: list[str], sums: int | None = None) -> None:
        """Every one of ``members`` (rank = its position) forms generation ``gen`` and sums
        until it ends (or ``sums`` times)."""
        for rank, name in enumerate(members):
            self.send(name, op="form", gen=gen, rank=rank, world=len(members), sums=sums)

    def answer(self, key: str, timeout_s: float = 60.0) -> dict:
        """The JSON a member wrote under ``test/<key>``, waiting for it up to ``timeout_s``."""
        try:
            self.store.wait([f"test/{key}"], timedelta(seconds=timeout_s))
        except Exception as exc:
            raise AssertionError(f"no answer under test/{key} within {timeout_s:.0f} s ({exc})") from None
        return json.loads(self.store.get(f"test/{key}"))

    def has(self, key: str) -> bool:
        return self.store.check([f"test/{key}"])

    def signal(self, name: str, sig: int) -> None:
        pid = self.procs[name].pid
        assert pid is not None  # started by start()
        os.kill(pid, sig)

    def close(self) -> None:
        """Kill every process started (a stopped one too) and reap it."""
        for proc in self.procs.values():
            if proc.is_alive():
                assert proc.pid is not None  # a live process has one
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            proc.join(timeout=30)
