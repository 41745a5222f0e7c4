"""The device tier's protocol on the CPU backend, with real rank processes that are killed.

The agent (this test process) allocates a rank's buffer and hands out its handle; a rank
process (``support.device_rank``) opens it once, captures a trained state into it and is
then SIGKILLed while it still maps the buffer; the agent drains the buffer into a host arena
from its own process, and a new rank process restores from the agent's buffer: bitwise the
state the dead one had.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from memsnap import naming
from memsnap.device import backend as pick_backend
from memsnap.device.backend import BufferHandle
from memsnap.device.cpu import CpuBackend
from memsnap.device.tier import AgentTier, RankTier
from memsnap.device.visibility import NOSET, VISIBLE, agent_runtime_env, see_node_gpus
from memsnap.errors import DeviceError, MemoryBudgetError
from memsnap.memory.arena import Arena
from memsnap.state import apply
from memsnap.state.manifest import Manifest

HERE = os.path.dirname(os.path.abspath(__file__))
WAIT_S = 120  # a bound on every wait for a child's answer


class Rank:
    """A rank process; ``answer()`` is its one JSON line; ``kill()`` SIGKILLs it."""

    def __init__(self, *args: str, device: str = "cpu"):
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]),
            MEMSNAP_TEST_DEVICE=device,
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "support.device_rank", *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def answer(self) -> dict:
        assert self.proc.stdout is not None  # started with stdout piped
        line = self.proc.stdout.readline()  # the child answers once, then holds its mapping
        if not line:
            _, err = self.proc.communicate(timeout=WAIT_S)
            raise AssertionError(f"rank process exited with {self.proc.returncode}: {err[-3000:]}")
        return json.loads(line)

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=WAIT_S)
        return self.proc.returncode


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def any_agent(request):
    """The agent's side on the CPU backend and (with a GPU) on CUDA: ``(tier, device id)``."""
    prefix = f"memsnap-devtest{os.getpid()}"
    kind = request.param
    tier = AgentTier(pick_backend(kind), budget=64 << 20, prefix=f"{prefix}-x")
    if kind == "cuda":
        from memsnap.device.cuda import device_uuid

        yield tier, device_uuid(0)
    else:
        yield tier, "cpu"
    tier.close()


@pytest.fixture
def agent():
    prefix = f"memsnap-devtest{os.getpid()}"
    tier = AgentTier(CpuBackend(), budget=64 << 20, prefix=f"{prefix}-x")
    yield tier
    tier.close()
    directory = naming.arena_dir()
    left = os.listdir(directory) if os.path.isdir(directory) else []
    assert not [f for f in left if f.startswith(prefix)]  # every buffer freed, no file left


def _maps(pid: int, path: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return path in f.read()


def test_crashed_rank_loses_nothing_that_reached_the_buffer(any_agent, tmp_path):
    agent, dev = any_agent
    kind = agent.backend.name
    handle = agent.begin(rank=0, device=dev, step=7, nbytes=1 << 20)
    rank = Rank("capture", handle.to_json(), "3", "2", device=kind)
    got = rank.answer()
    assert got["opens"] == 1
    if kind == "cpu":
        assert _maps(rank.proc.pid, handle.token)  # the rank maps the agent's buffer ...
    agent.captured(0, dev, 7, got["manifest"])
    assert rank.kill() == -signal.SIGKILL  # ... and dies holding it
    assert agent.holds(0, dev) == 7

    # restore of the crashed rank from the agent's buffer (tier "device"), in a new process
    manifest_json, same = agent.source(0, dev, 7)
    assert same == handle
    path = tmp_path / "manifest.json"
    path.write_text(manifest_json)
    again = Rank("restore", same.to_json(), str(path), device=kind)
    back = again.answer()
    again.kill()
    assert back["digest"] == got["digest"]

    # the agent drains into its (pinned) host arena from its own process: the same bytes, and
    # their checksums are the ones the dead rank computed
    host = Arena.create(os.path.join(naming.arena_dir(), f"memsnap-devtest{os.getpid()}-host"), 1 << 20, pin=True)
    try:
        manifest = agent.drain(0, dev, host.view())
        n = manifest.nbytes
        assert manifest.to_json() == Manifest.from_json(got["manifest"]).to_json()
        on_device = agent._slots[(0, dev)].buffer.tensor[:n].cpu().numpy().tobytes()
        assert bytes(host.view()[:n]) == on_device
        apply.verify_checksums(manifest, host.view()[:n])
    finally:
        host.close()
    assert agent.holds(0, dev) == 7  # drained, still held for a device restore


def test_a_rank_killed_mid_capture_leaves_no_device_copy(agent):
    handle = agent.begin(rank=1, device="cpu", step=1, nbytes=1 << 16)
    agent.captured(1, "cpu", 1, Manifest(tensors=[], tree={}, nbytes=0).to_json().decode())
    agent.drain(1, "cpu", memoryview(bytearray(1)))
    assert agent.source(1, "cpu", 1) is not None
    assert agent.begin(rank=1, device="cpu", step=2, nbytes=1 << 16) == handle  # same buffer, reused
    rank = Rank("partial", handle.to_json())
    assert rank.answer() == {"wrote": handle.nbytes // 2}
    assert rank.kill() == -signal.SIGKILL
    # step 1's bytes were overwritten and step 2 never completed: the device tier holds nothing
    assert agent.holds(1, "cpu") is None
    assert agent.source(1, "cpu", 1) is None and agent.source(1, "cpu", 2) is None
    with pytest.raises(DeviceError, match="writing"):
        agent.drain(1, "cpu", memoryview(bytearray(16)))
    with pytest.raises(DeviceError, match="call begin first"):
        agent.captured(1, "cpu", 3, "{}")
    assert agent.begin(rank=1, device="cpu", step=3, nbytes=1 << 16) == handle


def test_begin_waits_for_the_drain_and_regrows_within_the_budget(agent):
    first = agent.begin(rank=0, device="cpu", step=1, nbytes=4096)
    agent.captured(0, "cpu", 1, Manifest(tensors=[], tree={}, nbytes=0).to_json().decode())
    assert agent.begin(rank=0, device="cpu", step=2, nbytes=4096) is None  # not drained: skip
    agent.drain(0, "cpu", memoryview(bytearray(1)))
    bigger = agent.begin(rank=0, device="cpu", step=2, nbytes=8192)
    assert bigger.nbytes == 8192 and bigger.token != first.token and not os.path.exists(first.token)
    with pytest.raises(MemoryBudgetError, match="device_buffer"):
        agent.begin(rank=1, device="cpu", step=2, nbytes=64 << 20)


def test_rank_opens_each_buffer_once_and_captures_in_process(agent):
    handle = agent.begin(rank=0, device="cpu", step=0, nbytes=1 << 16)
    tier = RankTier(CpuBackend())
    from memsnap.state import capture as cap

    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    done = []
    for step in range(3):
        manifest, sources = cap.plan_sources(state, rng=False)
        assert tier.capture(handle, manifest, sources, on_done=lambda s=step: done.append(s))
        tier.wait()
        tier.wait()  # on_done runs once
    assert tier.opens == 1 and done == [0, 1, 2]
    buf = agent._slots[(0, "cpu")].buffer.host_view()
    expected = memoryview(bytearray(manifest.nbytes))
    cap.copy_into(manifest, sources, expected)
    assert buf[: manifest.nbytes] == expected  # padding included: zeros
    tier.close()


def test_the_optimizer_step_waits_for_the_capture(agent):
    from memsnap.state import capture as cap

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tier = RankTier(CpuBackend())
    tier.attach([opt])
    handle = agent.begin(rank=0, device="cpu", step=0, nbytes=1 << 12)
    manifest, sources = cap.plan_sources({"model": model}, rng=False)
    done = []
    assert tier.capture(handle, manifest, sources, on_done=lambda: done.append(True))
    assert tier.pending() and not done
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # the pre-hook waited for the copies and reported them
    assert done == [True] and not tier.pending()
    tier.close()
    assert not opt._optimizer_step_pre_hooks


def test_refused_open_falls_back_and_says_why(agent, caplog):
    class Refusing(CpuBackend):
        def open(self, handle):
            raise DeviceError("cudaIpcOpenMemHandle refused (operation not supported)")

    from memsnap.state import capture as cap

    handle = agent.begin(rank=0, device="cpu", step=0, nbytes=1 << 12)
    tier = RankTier(Refusing())
    manifest, sources = cap.plan_sources({"w": torch.zeros(4)}, rng=False)
    with caplog.at_level("WARNING", logger="memsnap"):
        assert tier.capture(handle, manifest, sources) is False
    assert "refused" in tier.refused and "side-stream D2H" in caplog.text


def test_handle_json_round_trip_and_bad_handles(tmp_path):
    h = BufferHandle("cuda", "GPU-1234", 1 << 30, "ab" * 64, generation=3)
    assert BufferHandle.from_json(h.to_json()) == h
    for raw in ("not json", '{"backend": "cpu"}', '{"backend":"cpu","device":"cpu","nbytes":-1,"token":"x"}'):
        with pytest.raises(DeviceError, match="malformed"):
            BufferHandle.from_json(raw)
    with pytest.raises(DeviceError, match="same device backend"):
        CpuBackend().open(h)
    with pytest.raises(DeviceError, match="use 'cpu', 'cuda' or 'auto'"):
        pick_backend("tpu")
    with pytest.raises(DeviceError, match="positive int"):
        AgentTier(CpuBackend(), budget=0)
    with pytest.raises(DeviceError, match="cannot open"):
        CpuBackend().open(BufferHandle("cpu", "cpu", 10, str(tmp_path / "gone")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cuda_backend_refuses_cleanly_without_a_device():
    from memsnap.device.cuda import CudaBackend

    with pytest.raises(DeviceError, match="needs a CUDA device"):
        CudaBackend()
    assert pick_backend("auto").name == "cpu"


def test_agent_sees_the_node_gpus_without_reserving_them():
    env = {VISIBLE: ""}  # what Ray gives a num_gpus=0 actor
    assert "removed" in see_node_gpus(env) and VISIBLE not in env
    env = {VISIBLE: "2"}
    assert "kept" in see_node_gpus(env) and env[VISIBLE] == "2"
    env = {VISIBLE: ""}
    see_node_gpus(env, node_devices="0,1,2,3")
    assert env[VISIBLE] == "0,1,2,3"
    assert agent_runtime_env() == {"env_vars": {NOSET: "1"}}


def test_cpu_only_install_never_imports_cupy():
    code = (
        "import sys, memsnap.device, memsnap.device.tier, memsnap.device.cpu, memsnap.device.cuda, "
        "memsnap.device.cupy_rs, memsnap.device.gf_ref, memsnap.memory.pinning; "
        "print('cupy' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_device_option_is_opt_in_and_validated():
    from memsnap.errors import ConfigError
    from memsnap.options import Device, resolve
    from memsnap.rank import job_config

    assert resolve({}, {})["device"] == Device(buffer=False) and not Device().on
    opts = resolve({}, {"device_buffer": 8 << 30, "device_backend": "cuda"})
    assert opts["device"] == Device(buffer=8 << 30, backend="cuda") and opts["device"].on
    cfg = job_config("j", opts)
    assert (cfg.device_buffer, cfg.device_backend) == (8 << 30, "cuda")
    assert type(cfg).from_dict(cfg.to_dict()) == cfg
    for bad in (0, -1, 1.5, "yes"):
        with pytest.raises(ConfigError, match="device_buffer="):
            Device(buffer=bad)
    with pytest.raises(ConfigError, match="'auto', 'cuda' or 'cpu'"):
        resolve({}, {"device_backend": "rocm"})
    with pytest.raises(ConfigError, match="both given"):
        resolve({"device": Device(buffer=True)}, {"device_buffer": 1 << 30})


def test_auto_without_a_device_leaves_the_tier_off_and_says_why():
    from memsnap.device.runtime import RankDevice, resolve_kind

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only path")
    assert resolve_kind("auto") == "none" and resolve_kind("cpu") == "cpu"
    side = RankDevice(agent=None, rank=0, kind="auto", optimizers=[], get=None)
    assert "no CUDA device" in side.refused
    assert side.save(0, None, [torch.zeros(1)], [0]) is False  # the host path takes it, no agent call
    assert side.restore(0, {}) is False
    side.close()
