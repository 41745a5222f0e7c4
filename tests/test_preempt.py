"""Preemption: a real SIGTERM to a subprocess, handler chaining, the Ray drain poll."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from memsnap.errors import ConfigError
from memsnap.preempt import PreemptionWatcher

CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from memsnap.preempt import PreemptionWatcher

    out, chain = sys.argv[1], sys.argv[2] == "chain"
    previous = []
    if chain:
        signal.signal(signal.SIGTERM, lambda signum, frame: previous.append(signum))
    calls = []

    def on_preempt(deadline):
        calls.append(deadline)
        with open(out + ".callback", "w") as f:   # the 'last snapshot'
            f.write(f"{deadline}")

    with PreemptionWatcher(on_preempt, grace_seconds=25.0) as w:
        print("ready", flush=True)
        give_up = time.monotonic() + 60
        while not w.preempted and time.monotonic() < give_up:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)      # a second notice: no second call
        time.sleep(0.05)
        left = w.seconds_left()
    restored = signal.getsignal(signal.SIGTERM)
    with open(out, "w") as f:
        json.dump({"calls": calls, "previous": previous, "reason": w.reason, "left": left,
                   "restored_default": restored == signal.SIG_DFL}, f)
""")


def run_child(tmp_path, mode: str) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None  # started with stdout piped
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the child never installed its watcher"
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    return json.loads(out.read_text()), (tmp_path / "result.json.callback").read_text()


def test_sigterm_in_a_subprocess_calls_back_once_and_exits_cleanly(tmp_path):
    result, written = run_child(tmp_path, "plain")
    assert written == "25.0"
    assert result["calls"] == [25.0]
    assert result["reason"] == "signal SIGTERM"
    assert 24.0 < result["left"] <= 25.0
    assert result["restored_default"], "stop() must put SIG_DFL back"


def test_sigterm_chains_the_previous_handler(tmp_path):
    result, written = run_child(tmp_path, "chain")
    assert written == "25.0" and result["calls"] == [25.0]
    assert result["previous"] == [signal.SIGTERM, signal.SIGTERM]
    assert not result["restored_default"]


def test_in_process_signal_and_restore():
    calls = []
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionWatcher(calls.append, grace_seconds=7.0, signals=(signal.SIGUSR1,)) as w:
        assert w.signals_installed and not w.preempted
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)
        assert w.preempted and calls == [7.0]
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_raising_callback_is_kept_not_thrown():
    def boom(deadline):
        raise RuntimeError("snapshot failed")

    w = PreemptionWatcher(boom, signals=())
    assert w.trigger(3.0, "test") is True
    assert isinstance(w.error, RuntimeError) and w.preempted
    assert w.trigger(3.0, "test") is False


def test_outside_the_main_thread_no_signal_is_installed():
    seen = {}

    def body():
        with PreemptionWatcher(lambda d: None) as w:
            seen["installed"] = w.signals_installed

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert seen == {"installed": False}


def test_drain_poll_with_a_fake_source():
    source = {"other": 0}
    calls = []
    w = PreemptionWatcher(
        calls.append,
        signals=(),
        node_id="me",
        grace_seconds=30.0,
        draining_nodes=lambda: source,
        wall_clock=lambda: 1000.0,
    )
    assert w.poll_once() is False and not calls
    source["me"] = 1_042_500  # deadline in ms: 42.5 s after the fake wall clock
    assert w.poll_once() is True
    assert calls == [42.5] and w.reason == "Ray is draining node me"
    assert w.poll_once() is True and calls == [42.5]


def test_drain_without_deadline_uses_the_grace_period():
    calls = []
    w = PreemptionWatcher(calls.append, signals=(), node_id="me", grace_seconds=12.0, draining_nodes=lambda: {"me": 0})
    w.poll_once()
    assert calls == [12.0]


def test_drain_poll_thread_fires_and_survives_source_errors():
    fired = threading.Event()
    answers = iter([RuntimeError("GCS down"), {}, {"me": 0}])

    def source():
        a = next(answers, {"me": 0})
        if isinstance(a, Exception):
            raise a
        return a

    w = PreemptionWatcher(lambda d: fired.set(), signals=(), node_id="me", poll_seconds=0.01, draining_nodes=source)
    with w:
        assert fired.wait(30), "the poll thread never saw the drain"
    assert w.preempted


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"grace_seconds": 0}, "grace_seconds=0"),
        ({"poll_seconds": -1.0}, "poll_seconds=-1.0"),
        ({"signals": (12345,)}, "12345 is not a signal"),
    ],
)
def test_bad_arguments(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        PreemptionWatcher(lambda d: None, **kwargs)
    with pytest.raises(ConfigError, match="on_preempt=3"):
        PreemptionWatcher(3)


def test_poll_without_ray_or_node_id_says_how_to_fix(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ConfigError, match="ray.init"):
        PreemptionWatcher(lambda d: None, poll_seconds=1.0).start()
    assert signal.getsignal(signal.SIGTERM) == before, "a failed start leaves no handler behind"


@pytest.mark.ray
@pytest.mark.slow
def test_real_ray_drain_is_seen_by_a_watcher_on_that_node():
    """A watcher inside an actor on node 1 finds its own node id and sees Ray drain it."""
    import time

    import ray
    from ray.core.generated import autoscaler_pb2

    from memsnap.localcluster import LocalCluster, wait_for

    @ray.remote(num_cpus=0, resources={"memsnap_node_1": 1})
    class Watched:  # keeps node 1 busy, so the drain lasts until its deadline
        def __init__(self):
            self.deadlines = []
            self.watcher = PreemptionWatcher(self.deadlines.append, signals=(), poll_seconds=0.2)
            self.watcher.start()

        def node(self):
            return ray.get_runtime_context().get_node_id()

        def seen(self):
            return list(self.deadlines), self.watcher.reason

    with LocalCluster(nodes=2, cpus_per_node=0) as cluster:
        actor = Watched.remote()
        target = ray.get(actor.node.remote(), timeout=60)
        assert target == cluster.nodes[1].node_id
        assert ray.get(actor.seen.remote(), timeout=30) == ([], None)
        gcs = ray._raylet.GcsClient(address=cluster.address)
        accepted, why = gcs.drain_node(
            target,
            autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "memsnap test",
            int(time.time() * 1000) + 60_000,
        )
        assert accepted, why
        deadlines, reason = wait_for(
            lambda: ray.get(actor.seen.remote(), timeout=10)[0] and ray.get(actor.seen.remote(), timeout=10),
            timeout=30,
            what="the watcher on node 1 to see the drain",
        )
    assert len(deadlines) == 1 and 0 < deadlines[0] <= 60.0
    assert reason == f"Ray is draining node {target}"
