"""A data-parallel toy job for the in-place recovery tests: a small MLP, AdamW, a buffer that
is not a parameter, every RNG. A step's data is a function of (rank, step), and each rank
records the digest of its whole state after every step in the rendezvous store: a step
trained again after a rollback must give the digest it gave the first time (bitwise equal to
a run that never failed)."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

WIDTH = 64


def setup(ctx, ddp: bool = False):
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt, "extra": {"bulk": torch.zeros(4096), "seen": 0}}
    if ddp:
        state["ddp"] = ctx.ddp(model)  # not part of the snapshot: the runner drops it (below)
    return state


def setup_ddp(ctx):
    return setup(ctx, ddp=True)


def setup_fsdp(ctx):
    """The same model sharded with FSDP2 (each linear layer, then the whole): no rank holds a
    replica of another's shards. Sharding and the optimizer need the rank: ``on_rank``."""
    import torch

    state = setup(ctx)
    del state["optim"]  # built over the sharded parameters, below

    def shard(ctx, state):
        model = state["model"]
        ctx.fully_shard(model, modules=[m for m in model if isinstance(m, torch.nn.Linear)])
        state["optim"] = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ctx.on_rank(shard)
    state["fsdp"] = True  # a marker the training loop drops (like "ddp")
    return state


def snapshot_of(state) -> dict:
    return {k: v for k, v in state.items() if k not in ("ddp", "fsdp")}


def local(t):
    """A tensor's bytes on this rank (a DTensor's own shard)."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().numpy().tobytes()


def digest(state) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in state["model"].parameters():
        h.update(local(p))
    for st in state["optim"].state.values():
        for k in sorted(st):
            h.update(local(st[k]))
    h.update(state["extra"]["bulk"].numpy().tobytes())
    h.update(str(state["extra"]["seen"]).encode())
    return h.hexdigest()


def hold_gil(seconds: float) -> None:
    """Keep this thread on the GIL for ``seconds`` (a long pure-Python loop with the switch
    interval raised past it): no other thread of the process runs, its heartbeat's neither."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 5.0)
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    finally:
        sys.setswitchinterval(old)


def hold_sockets(release: str, limit_s: float = 600.0) -> int:
    """Fork a child that keeps this process's sockets open, its lifeline among them, until the
    file ``release`` exists or for ``limit_s``: once this process is killed, its peers and its
    controller see no socket close, as for a killed process whose teardown frees many GiB
    before its kernel closes its sockets. (A forked child is made to close its copy of the
    lifeline, ``collective.lifeline._close_in_child``: this one keeps a duplicate of it.) The
    child only sleeps and looks at the file (nothing that could take a lock another thread held
    at the fork)."""
    from memsnap.collective import lifeline

    kept = [os.dup(line._sock.fileno()) for line in list(lifeline._HELD)]
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + limit_s
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.1)
        os._exit(0)
    for fd in kept:
        os.close(fd)
    return pid


def make_train(
    steps: int,
    step_s: float = 0.0,
    slow: tuple[int, int, float] | None = None,
    gil: tuple[int, int, float] | None = None,
    bug: tuple[int, int] | None = None,
    hold: tuple[int, str] | None = None,
):
    """``slow``: (rank, step, seconds) — that rank spends that long in that step, once (a slow
    rank, which must not be taken for a lost one); ``gil``: the same, holding the GIL all along
    (its heartbeat stops: only its node's word keeps it in the job); ``bug``: (rank, step) —
    that rank raises there (a bug in the training function); ``hold``: (rank, path) — as it
    starts, that rank forks a child that keeps its sockets open until ``path`` exists
    (``hold_sockets``)."""

    def train(ctx, state):
        import torch

        store = ctx.store
        forward = state.get("ddp")
        sharded = state.get("fsdp", False)  # FSDP2 averages the gradients in its backward
        state = snapshot_of(state)
        if (
            ctx.generation
            and ctx.recoveries == 0
            and store.check(["test/die_on_takeover"])
            and store.add("test/takeovers", 1) == 1
        ):
            os.kill(os.getpid(), signal.SIGKILL)  # the first standby dies as it takes over
        if hold is not None and ctx.rank == hold[0] and ctx.generation == 0:
            hold_sockets(hold[1])
        start = ctx.restore(state)
        # the rolled-back state is bitwise the state the first run had after that step
        key = f"test/d/{ctx.rank}/{start - 1}"
        if start and store.check([key]):
            if store.get(key).decode() != digest(state):
                store.set(f"test/mismatch/{ctx.rank}/{start - 1}", "restored")
            store.add(f"test/restore_checked/{ctx.rank}", 1)
        model, opt = state["model"], state["optim"]
        for step in range(start, steps):
            g = torch.Generator().manual_seed(1_000_003 * (ctx.rank + 1) + step)
            x = torch.randn(16, WIDTH, generator=g)
            loss = (forward or model)(x).square().mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            if slow is not None and (ctx.rank, step) == slow[:2] and not store.check(["test/slow"]):
                store.set("test/slow", str(ctx.rank))
                time.sleep(slow[2])  # a long step (compute stand-in); its heartbeat thread runs on
            if bug is not None and (ctx.rank, step) == bug:
                raise ValueError(f"a bug in the training function at step {step}")
            if gil is not None and (ctx.rank, step) == gil[:2] and not store.check(["test/gil"]):
                store.set("test/gil", str(ctx.rank))
                hold_gil(gil[2])
            if forward is None and not sharded:
                ctx.average_gradients(model.parameters())
            opt.step()
            state["extra"]["bulk"][step % 4096] += 1.0
            state["extra"]["seen"] += 1
            ctx.save(step, state)  # a step whose collective failed ends here, before it is recorded
            d = digest(state)
            key = f"test/d/{ctx.rank}/{step}"
            if store.check([key]):
                if store.get(key).decode() != d:
                    store.set(f"test/mismatch/{ctx.rank}/{step}", d)
                store.add("test/replayed", 1)
            else:
                store.set(key, d)
            store.set(f"test/progress/{ctx.rank}", str(step))
            if step_s:
                time.sleep(step_s)  # a stand-in for the step's compute, so a kill lands mid-run
        return {"rank": ctx.rank, "digest": digest(state), "recoveries": ctx.recoveries}

    return train
