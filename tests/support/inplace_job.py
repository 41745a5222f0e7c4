"""A data-parallel toy job for the in-place recovery tests: a small MLP, AdamW, a buffer that
is not a parameter, every RNG. A step's data is a function of (rank, step), and each rank
records the digest of its whole state after every step in the rendezvous store: a step
trained again after a rollback must give the digest it gave the first time (bitwise equal to
a run that never failed)."""

from __future__ import annotations

import hashlib
import os
import signal
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


def snapshot_of(state) -> dict:
    return {k: v for k, v in state.items() if k != "ddp"}


def digest(state) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in state["model"].parameters():
        h.update(p.detach().numpy().tobytes())
    for st in state["optim"].state.values():
        for k in sorted(st):
            h.update(st[k].detach().numpy().tobytes())
    h.update(state["extra"]["bulk"].numpy().tobytes())
    h.update(str(state["extra"]["seen"]).encode())
    return h.hexdigest()


def make_train(steps: int, step_s: float = 0.0, slow: tuple[int, int, float] | None = None):
    """``slow``: (rank, step, seconds) — that rank spends that long in that step, once (a slow
    rank, which must not be taken for a lost one)."""

    def train(ctx, state):
        import torch

        store = ctx.store
        forward = state.get("ddp")
        state = snapshot_of(state)
        if (
            ctx.generation
            and ctx.recoveries == 0
            and store.check(["test/die_on_takeover"])
            and store.add("test/takeovers", 1) == 1
        ):
            os.kill(os.getpid(), signal.SIGKILL)  # the first standby dies as it takes over
        start = ctx.restore(state)
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
            if forward is None:
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
