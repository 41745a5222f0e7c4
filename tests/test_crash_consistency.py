"""SIGKILL the writer at random points of a save: load must return a whole committed step.

The seed of the kill points is printed (run with ``-s`` to see it) and can be set with
``MEMSNAP_CRASH_SEED`` to replay a failure.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from functools import partial

import torch
from support import states

import memsnap
from memsnap.durable.storage import Store

KILLS = 5
# One writer process imports torch once, then forks a fresh child per save, so a kill costs a
# fork instead of a Python start-up. The child runs every torch op; the parent runs none.
ZYGOTE = """
import os, sys
sys.path.insert(0, {tests!r})
import memsnap, memsnap.durable.checkpoint
from support.states import make_state
for line in sys.stdin:
    step = int(line)
    pid = os.fork()
    if pid == 0:
        state = make_state(step, **{state!r})
        print("saving", os.getpid(), flush=True)
        memsnap.save({uri!r}, state, step)
        print("done", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


STATE: states.Shape = dict(widths=(1024,) * 5, relu=False, warm=2)  # ~50 MiB of model + AdamW state
make_state = partial(states.make_state, **STATE)


def same_model(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sb = b.state_dict()
    return all(torch.equal(v, sb[k]) for k, v in a.state_dict().items())


def run_and_kill(zygote: subprocess.Popen, step: int, delay: float) -> bool:
    """Fork a writer saving ``step``, SIGKILL it ``delay`` s into the save; True if it finished."""
    assert zygote.stdin is not None and zygote.stdout is not None  # started with both piped
    zygote.stdin.write(f"{step}\n")
    zygote.stdin.flush()
    word, pid = zygote.stdout.readline().split()
    assert word == "saving"
    time.sleep(delay)
    try:
        os.kill(int(pid), signal.SIGKILL)
    except ProcessLookupError:
        pass  # already exited (and reaped)
    lines: list[str] = []
    while not lines or lines[-1] != "reaped":
        line = zygote.stdout.readline()
        assert line, "the writer process died"
        lines.append(line.strip())
    return "done" in lines


def test_sigkill_during_save_leaves_a_whole_step(tmp_path):
    seed = int(os.environ.get("MEMSNAP_CRASH_SEED", "20261129"))
    print(f"crash-consistency seed: {seed} (set MEMSNAP_CRASH_SEED to replay)")
    rng = random.Random(seed)
    uri = str(tmp_path / "ckpt")
    expected = {1: make_state(1)}
    t0 = time.perf_counter()
    memsnap.save(uri, expected[1], 1)
    save_s = time.perf_counter() - t0
    probe, outcomes = make_state(0), []
    code = ZYGOTE.format(tests=os.path.dirname(__file__), uri=uri, state=STATE)
    zygote = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for i in range(KILLS):
            step = 2 + i
            delay = rng.uniform(0.0, save_s)
            finished = run_and_kill(zygote, step, delay)
            committed = Store.open(uri).steps()
            got = memsnap.load(uri, probe)
            assert got == committed[-1]
            if got not in expected:
                expected[got] = make_state(got)
            assert same_model(probe["model"], expected[got]["model"]), f"step {got} loaded damaged"
            outcomes.append((round(delay, 3), finished, got == step))
    finally:
        zygote.stdin.close()
        try:
            zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait(timeout=10)
    print(f"save took {save_s:.2f}s; (delay, writer finished, new step committed): {outcomes}")
    assert all(c or not f for _, f, c in outcomes)  # a writer that finished always committed
