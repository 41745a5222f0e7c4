"""The GPU path measured on one GPU, without Ray: one run, under 6 minutes on an H200.

    python bench/gpu.py             # measure and write bench/results/gpu.md
    python bench/gpu.py --check     # say what this machine can run (CUDA, CuPy, IPC), measure nothing

What it measures (each part in its own try: a part that fails is reported, the rest runs):

1. D2H GB/s of a 1 GiB tensor into pageable memory, pinned memory (``pin_memory=True``)
   and a shared-memory arena registered once with ``cudaHostRegister`` (``Arena.create(pin=True)``).
2. D2D capture time into an agent-owned device buffer for 1, 4 and 16 GiB: an agent process
   (this script with ``--agent``) allocates the buffer with ``cudaMalloc`` and shares it by
   CUDA IPC; this process opens it once and captures into it on a side stream
   (``memsnap.device.tier``). The bytes are compared afterwards.
3. The stall a training loop sees per snapshot: a ~0.7 B-parameter transformer with AdamW on
   the GPU, a snapshot every step, with no snapshot / side-stream D2H into a pinned arena
   (``memsnap.state.cuda_capture``) / the device tier (D2D into the agent's buffer, which the agent
   drains into its pinned host arena from its own process while training goes on).
4. CuPy Reed-Solomon encode and decode GB/s for RS(2,1), RS(4,2), RS(8,2) against the CPU
   codec (all cores), parity checked byte for byte against the CPU codec first.
5. The ``gpu``-marked tests (``pytest -m gpu`` on the test files that have them).

Whatever CUDA refuses (IPC, host registration) is caught, reported in the results, and the
fallback that ran instead is named. Without CUDA the script prints why and exits 0 without
touching the results file.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "bench", "results", "gpu.md")
GiB = 1 << 30
REPLY_S = 120.0  # bound on every wait for the agent process


# --- what the machine can do ------------------------------------------------------------------
def probe() -> dict:
    info: dict = {"python": platform.python_version()}
    try:
        import torch
    except ImportError as exc:
        return {**info, "cuda": False, "why": f"torch does not import: {exc}"}
    info["torch"] = torch.__version__
    info["cuda"] = torch.cuda.is_available()
    if not info["cuda"]:
        info["why"] = (
            f"torch {torch.__version__} sees no CUDA device (built with CUDA "
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    else:
        info["device"] = torch.cuda.get_device_name(0)
        info["devices"] = torch.cuda.device_count()
        info["cuda_version"] = torch.version.cuda
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as exc:  # ImportError, or a CuPy built for another CUDA
        info["cupy"] = None
        info["cupy_why"] = f"{type(exc).__name__}: {exc}"
    try:  # not imported: the GPU path needs no Ray, and importing it costs seconds
        info["ray"] = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        info["ray"] = None
    return info


def ensure_codec() -> None:
    """The native codec, built here if this checkout has no build for this Python."""
    try:
        import memsnap._codec  # noqa: F401 (built?)
    except ImportError:
        subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=300,
        )


# --- the agent process ------------------------------------------------------------------------
def agent_main() -> None:
    """``--agent``: owns device buffers and a pinned host arena; JSON lines on stdin/stdout.

    {"op": "begin", "step", "nbytes"} -> {"handle": json | null}   (null: still draining)
    {"op": "captured", "step", "manifest"} -> {"ok": true}; the drain runs in a thread
    {"op": "drains"} -> {"seconds": [...]} ; {"op": "quit"}
    """
    import torch

    from memsnap import naming
    from memsnap.device.cuda import CudaBackend, device_uuid
    from memsnap.device.tier import AgentTier
    from memsnap.memory.arena import Arena

    torch.cuda.init()
    device = device_uuid(0)
    tier = AgentTier(CudaBackend(), budget=64 * GiB, prefix=f"memsnap-gpubench{os.getpid()}")
    lock, drains, pin, threads = threading.Lock(), [], {}, []
    host: dict[str, Arena | _TorchHost] = {}

    def reply(doc: dict) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    def drain(nbytes: int) -> None:
        t = time.perf_counter()  # no lock: while it drains the buffer is "held" and begin says so
        tier.drain(0, device, host["arena"].view(0, nbytes))
        drains.append(time.perf_counter() - t)

    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "begin":
                with lock:
                    handle = tier.begin(0, device, msg["step"], msg["nbytes"])
                reply({"handle": None if handle is None else handle.to_json()})
            elif msg["op"] == "captured":
                with lock:
                    tier.captured(0, device, msg["step"], msg["manifest"])
                nbytes = json.loads(msg["manifest"])["nbytes"]
                if "arena" not in host or host["arena"].nbytes < nbytes:
                    if "arena" in host:
                        host.pop("arena").close()
                    path = os.path.join(naming.arena_dir(), f"memsnap-gpubench{os.getpid()}-host")
                    try:
                        arena = Arena.create(path, nbytes, pin=True)
                        assert arena.pinning is not None  # pin=True registers it, or says why not
                        host["arena"] = arena
                        pin["reason"] = arena.pinning.reason
                    except Exception as exc:  # a small /dev/shm: a pinned torch buffer instead
                        host["arena"] = _TorchHost(nbytes)
                        pin["reason"] = f"no shared-memory arena ({exc}); pinned torch buffer instead"
                threads.append(threading.Thread(target=drain, args=(nbytes,), daemon=True))
                threads[-1].start()
                reply({"ok": True})
            elif msg["op"] == "drains":
                reply({"seconds": list(drains), "host": pin.get("reason")})
                drains.clear()
            elif msg["op"] == "quit":
                break
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})
    for t in threads:
        t.join(timeout=REPLY_S)
    tier.close()
    if "arena" in host:
        host["arena"].close()


class _TorchHost:
    def __init__(self, nbytes: int):
        import torch

        self.nbytes = nbytes
        self.t: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def view(self, offset: int = 0, nbytes: int | None = None):
        assert self.t is not None, "closed"
        return memoryview(self.t.numpy())[offset : offset + (nbytes or self.nbytes)]  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12

    def close(self) -> None:
        self.t = None


class Agent:
    """The agent process, from the training side."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--agent"],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_S)
        if not ready:
            raise TimeoutError(f"the agent process did not answer {msg['op']} within {REPLY_S:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the agent process exited ({self.proc.wait(timeout=REPLY_S)})")
        doc = json.loads(line)
        if "error" in doc:
            raise RuntimeError(f"agent: {doc['error']}")
        return doc

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=REPLY_S)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=REPLY_S)


# --- measurements -----------------------------------------------------------------------------
def _timed(fn, reps: int = 5) -> float:
    """Best wall time of ``fn`` (synchronised) after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def d2h(notes: list) -> list[tuple]:
    import torch

    from memsnap import naming
    from memsnap.memory.arena import Arena

    n = GiB
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    rows = []
    pageable = torch.empty(n, dtype=torch.uint8)
    rows.append(("pageable", n / _timed(functools.partial(pageable.copy_, src, non_blocking=True)) / 1e9, ""))
    del pageable
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    rows.append(
        ("pinned (pin_memory=True)", n / _timed(functools.partial(pinned.copy_, src, non_blocking=True)) / 1e9, "")
    )
    del pinned
    path = os.path.join(naming.arena_dir(), f"memsnap-gpubench{os.getpid()}-d2h")
    for size in (n, 256 << 20):
        try:
            arena = Arena.create(path, size, pin=True)
            assert arena.pinning is not None  # pin=True registers it, or says why not
        except Exception as exc:
            notes.append(f"D2H: a {size >> 20} MiB shared-memory arena could not be created: {exc}")
            continue
        try:
            dst = torch.frombuffer(arena.view(), dtype=torch.uint8)
            part = src[:size]
            gbs = size / _timed(functools.partial(dst.copy_, part, non_blocking=True)) / 1e9
            same = torch.equal(dst[:4096], part[:4096].cpu())
            rows.append(
                (
                    f"shared-memory arena, {size >> 20} MiB",
                    gbs,
                    f"{arena.pinning.reason}; bytes {'match' if same else 'DIFFER'}",
                )
            )
            if not arena.pinning.pinned:
                notes.append(f"cudaHostRegister of the shared-memory arena: {arena.pinning.reason}")
            del dst
        finally:
            arena.close()
        break
    return rows


def d2d(notes: list) -> list[tuple]:
    import torch

    from memsnap.device import backend as pick_backend
    from memsnap.device.backend import BufferHandle
    from memsnap.device.tier import RankTier
    from memsnap.state import capture as cap

    agent = Agent()
    rows, handle, tier = [], None, None
    try:
        try:
            handle = BufferHandle.from_json(agent.ask(op="begin", step=0, nbytes=16 * GiB)["handle"])
            tier = RankTier(pick_backend("cuda"))
        except Exception as exc:  # cudaMalloc/cudaIpcGetMemHandle refused in the agent, or no CuPy here
            notes.append(f"device buffer not shared by the agent ({exc}); D2D below is into a local allocation")
        for size in (GiB, 4 * GiB, 16 * GiB):
            src = torch.empty(size, dtype=torch.uint8, device="cuda")
            src[: 1 << 20].random_(0, 255)
            manifest, sources = cap.plan_sources({"x": src}, rng=False)
            if tier is not None and handle is not None and tier.capture(handle, manifest, sources):
                tier.wait()

                def once(manifest, sources):
                    tier.capture(handle, manifest, sources)
                    tier.wait()

                seconds = _timed(functools.partial(once, manifest, sources))
                same = torch.equal(tier.buffer(handle).tensor[: 1 << 20], src[: 1 << 20])
                rows.append(
                    (
                        size,
                        seconds,
                        f"agent's buffer over CUDA IPC; bytes {'match' if same else 'DIFFER'}; "
                        f"handle opened {tier.opens}x",
                    )
                )
            else:
                if tier is not None and tier.refused and not any("IPC refused" in n for n in notes):
                    notes.append(f"CUDA IPC refused: {tier.refused}. D2D below is into a local allocation")
                dst = torch.empty(size, dtype=torch.uint8, device="cuda")
                seconds = _timed(functools.partial(dst.copy_, src, non_blocking=True))
                rows.append((size, seconds, "a local allocation (no shared device buffer)"))
                del dst
            del src, sources
            torch.cuda.empty_cache()
    finally:
        if tier is not None:
            tier.close()  # unmapped before the agent frees the buffer
        agent.close()
    return rows


def _model():
    import torch

    from memsnap.demo.model import ModelConfig, TinyTransformer

    cfg = ModelConfig(vocab=32000, dim=2048, heads=16, layers=12, seq=256, dropout=0.0)
    model = TinyTransformer(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return cfg, model, opt


def stall(notes: list, steps: int) -> list[tuple]:
    import torch

    from memsnap import naming
    from memsnap.device import backend as pick_backend
    from memsnap.device.backend import BufferHandle
    from memsnap.device.tier import RankTier
    from memsnap.memory.arena import Arena
    from memsnap.state import capture as cap
    from memsnap.state import cuda_capture

    torch.backends.cuda.matmul.allow_tf32 = True
    cfg, model, opt = _model()
    tokens = torch.randint(0, cfg.vocab, (8, cfg.seq), device="cuda")

    def step() -> float:
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab), tokens.view(-1))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return float(loss)  # a real loop reads its loss: one sync per step

    def run(after_step) -> list[float]:
        times = []
        for i in range(steps):
            t = time.perf_counter()
            step()
            after_step(i)  # no device-wide sync here: that would wait for the side stream too
            times.append(time.perf_counter() - t)
        return times[2:]  # warm-up

    for _ in range(3):
        step()  # optimizer state exists from here on
    state = {"model": model, "optim": opt}
    manifest, sources = cap.plan_sources(state)
    nbytes = manifest.nbytes
    rows = []
    base = run(lambda i: None)
    rows.append(("no snapshot", statistics.median(base), 0.0, ""))

    # side-stream D2H into a pinned shared-memory arena (memsnap.state.cuda_capture)
    path = os.path.join(naming.arena_dir(), f"memsnap-gpubench{os.getpid()}-stall")
    try:
        arena = Arena.create(path, nbytes, pin=True)
        assert arena.pinning is not None  # pin=True registers it, or says why not
        out, what = arena.view(0, nbytes), f"shared-memory arena, {arena.pinning.reason}"
    except Exception as exc:
        arena = None
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out, what = memoryview(host.numpy()), f"pinned torch buffer (no arena: {exc})"  # type: ignore[arg-type]  # numpy declares __buffer__ only from 3.12
        notes.append(f"stall: the {nbytes / GiB:.1f} GiB shared-memory arena could not be created ({exc})")
    side = cuda_capture.SideStreamCapture()
    side.attach([opt])
    try:
        t = run(lambda i, out=out: side.start(manifest, sources, out, on_done=lambda: None))
        side.wait()
        rows.append(("side-stream D2H", statistics.median(t), statistics.median(t) - statistics.median(base), what))
    finally:
        side.close()
        del out
        if arena is not None:
            arena.close()

    # the device tier: D2D into the agent's buffer, drained by the agent while training goes on
    agent = Agent()
    tier = RankTier(pick_backend("cuda"))
    tier.attach([opt])
    skipped = [0]
    manifest_json = manifest.to_json().decode()
    try:

        def snap(i: int) -> None:
            got = agent.ask(op="begin", step=i, nbytes=nbytes)["handle"]
            if got is None:  # the agent is still draining the last one: this step is skipped
                skipped[0] += 1
                return
            ok = tier.capture(
                BufferHandle.from_json(got),
                manifest,
                sources,
                on_done=lambda: agent.ask(op="captured", step=i, manifest=manifest_json),
            )
            if not ok:
                raise RuntimeError(f"device tier refused: {tier.refused}")

        t = run(snap)
        tier.wait()
        drains = agent.ask(op="drains")
        drain_s = statistics.median(drains["seconds"]) if drains["seconds"] else float("nan")
        rows.append(
            (
                "device tier (D2D)",
                statistics.median(t),
                statistics.median(t) - statistics.median(base),
                f"handle opened {tier.opens}x; {skipped[0]} of {steps} snapshots skipped while the agent "
                f"drained; agent drain {nbytes / GiB / drain_s:.1f} GiB/s into {drains['host']}",
            )
        )
    except Exception as exc:
        notes.append(f"device tier stall: {type(exc).__name__}: {exc}; the side-stream D2H row is the fallback")
    finally:
        tier.close()
        agent.close()
    rows.append(
        ("state", nbytes / GiB, 0.0, f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params + AdamW moments")
    )
    return rows


def coding(notes: list) -> list[tuple]:
    import numpy as np

    from memsnap.coding import codec
    from memsnap.device.cupy_rs import CupyReedSolomon

    try:
        import cupy as cp
    except Exception as exc:
        notes.append(f"CuPy coding not measured: {exc}")
        return []
    rows = []
    shard = 256 << 20
    for k, m in ((2, 1), (4, 2), (8, 2)):
        rs, gpu = codec.ReedSolomon(k, m, threads=0), CupyReedSolomon(k, m)
        rng = np.random.default_rng(k)
        small = [rng.integers(0, 256, (1 << 20) + 3, dtype=np.uint8) for _ in range(k)]
        same = all(
            cp.asnumpy(g).tobytes() == c.tobytes()
            for g, c in zip(gpu.encode([cp.asarray(s) for s in small]), rs.encode(small))
        )
        data = [cp.random.randint(0, 256, shard, dtype=cp.uint8) for _ in range(k)]
        parity = gpu.encode(data)
        full = data + parity
        lost = [None if i < m else s for i, s in enumerate(full)]

        def gpu_time(fn) -> float:
            fn()
            cp.cuda.Device().synchronize()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(10):
                fn()
            end.record()
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) / 1e3 / 10

        enc = k * shard / gpu_time(functools.partial(gpu.encode_into, data, parity)) / 1e9
        dec = k * shard / gpu_time(functools.partial(gpu.reconstruct, lost)) / 1e9
        host = [cp.asnumpy(d[: 64 << 20]) for d in data]
        cpu_enc = k * (64 << 20) / _best(functools.partial(rs.encode, host)) / 1e9
        hp = rs.encode(host)
        hl = [None if i < m else s for i, s in enumerate(host + hp)]
        cpu_dec = k * (64 << 20) / _best(functools.partial(rs.reconstruct, hl)) / 1e9
        rows.append((f"RS({k},{m})", enc, dec, cpu_enc, cpu_dec, "yes" if same else "NO"))
        del data, parity, full, lost
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def _best(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gpu_tests() -> tuple[str, int]:
    tests = os.path.join(ROOT, "tests")
    files = sorted(
        os.path.join(tests, f)
        for f in os.listdir(tests)
        if f.startswith("test_") and f.endswith(".py") and "mark.gpu" in open(os.path.join(tests, f)).read()
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, tests, os.environ.get("PYTHONPATH", "")]))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "-q", "-rs", *files],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired as exc:
        tail = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return f"pytest -m gpu timed out after 240 s:\n{tail[-3000:]}", 124
    return (out.stdout + out.stderr)[-4000:], out.returncode


# --- report -------------------------------------------------------------------------------------
def report(info: dict, parts: dict, notes: list, seconds: float) -> str:
    lines = [
        "# GPU path: D2H, device tier, CuPy coding",
        "",
        f"Run of `python bench/gpu.py` on {info.get('device')} ({info.get('devices')} visible), torch "
        f"{info.get('torch')} (CUDA {info.get('cuda_version')}), CuPy {info.get('cupy')}, Ray {info.get('ray')}, "
        f"Python {info['python']}; {seconds:.0f} s in all.",
        "",
    ]
    if "d2h" in parts:
        lines += ["## D2H copy of 1 GiB", "", "| destination | GB/s | notes |", "|---|---|---|"]
        lines += [f"| {a} | {b:.1f} | {c} |" for a, b, c in parts["d2h"]] + [""]
    if "d2d" in parts:
        lines += [
            "## D2D capture into the agent's device buffer",
            "",
            "| size | ms | GB/s | into |",
            "|---|---|---|---|",
        ]
        lines += [f"| {s / GiB:.0f} GiB | {t * 1e3:.2f} | {s / t / 1e9:.0f} | {w} |" for s, t, w in parts["d2d"]] + [""]
    if "stall" in parts:
        rows = parts["stall"]
        gib = next(r[1] for r in rows if r[0] == "state")
        lines += [
            f"## Stall per snapshot, a snapshot every step ({gib:.2f} GiB of state)",
            "",
            "| capture | step ms (median) | stall ms | stall ms per GiB | notes |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {a} | {b * 1e3:.1f} | {c * 1e3:.1f} | {c * 1e3 / gib:.2f} | {d} |"
            for a, b, c, d in rows
            if a != "state"
        ]
        lines += ["", f"State: {next(r[3] for r in rows if r[0] == 'state')}.", ""]
    if "coding" in parts:
        lines += [
            "## Reed-Solomon: CuPy kernel vs the CPU codec (GB/s of data)",
            "",
            "| geometry | GPU encode | GPU decode (m data shards lost) | CPU encode (all cores) | CPU decode | parity identical |",
            "|---|---|---|---|---|---|",
        ]
        lines += [f"| {g} | {a:.1f} | {b:.1f} | {c:.1f} | {d:.1f} | {e} |" for g, a, b, c, d, e in parts["coding"]]
        lines += [""]
    if "tests" in parts:
        text, rc = parts["tests"]
        lines += [f"## `pytest -m gpu` (exit {rc})", "", "```", text.strip(), "```", ""]
    lines += targets(parts)
    lines += ["## Refused, failed or fallen back", ""]
    lines += [f"- {n}" for n in notes] or ["- nothing"]
    return "\n".join(lines) + "\n"


def targets(parts: dict) -> list[str]:
    """The issue's targets, met or not, from what was measured (a target not measured says so)."""
    rows = []
    stall_rows = {r[0]: r for r in parts.get("stall", [])}
    if "device tier (D2D)" in stall_rows and "state" in stall_rows:
        per_gib = stall_rows["device tier (D2D)"][2] * 1e3 / stall_rows["state"][1]
        rows.append(("device-tier stall < 5 ms per GiB", f"{per_gib:.2f} ms/GiB", per_gib < 5))
    else:
        rows.append(("device-tier stall < 5 ms per GiB", "not measured", None))
    d2h_rows = {r[0]: r[1] for r in parts.get("d2h", [])}
    pinned = d2h_rows.get("pinned (pin_memory=True)")
    if pinned and "side-stream D2H" in stall_rows and "state" in stall_rows:
        step, stall_s = stall_rows["side-stream D2H"][1], stall_rows["side-stream D2H"][2]
        rate = stall_rows["state"][1] * GiB / 1e9 / max(step, 1e-9)  # a lower bound: the copy ran within the step
        rows.append(
            (
                "side-stream D2H >= 80% of pinned D2H",
                f"copy done within a {step * 1e3:.0f} ms step "
                f"(>= {rate:.1f} GB/s, pinned {pinned:.1f} GB/s; stall {stall_s * 1e3:.1f} ms)",
                rate >= 0.8 * pinned,
            )
        )
    else:
        rows.append(("side-stream D2H >= 80% of pinned D2H", "not measured", None))
    coding_rows = {r[0]: r for r in parts.get("coding", [])}
    if "RS(4,2)" in coding_rows:
        enc = coding_rows["RS(4,2)"][1]
        rows.append(("CuPy RS(4,2) encode >= 200 GB/s", f"{enc:.1f} GB/s", enc >= 200))
    else:
        rows.append(("CuPy RS(4,2) encode >= 200 GB/s", "not measured", None))
    out = ["## Targets (issue #14)", "", "| target | measured | met |", "|---|---|---|"]
    out += [f"| {t} | {m} | {'n/a' if ok is None else ('yes' if ok else 'NO')} |" for t, m, ok in rows]
    return out + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="say what this machine can run, measure nothing")
    ap.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=20, help="training steps per stall configuration")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--skip", nargs="*", default=[], choices=["d2h", "d2d", "stall", "coding", "tests"])
    args = ap.parse_args()
    if args.agent:
        agent_main()
        return 0
    info = probe()
    if args.check or not info["cuda"]:
        print(json.dumps(info, indent=1))
        if not info["cuda"]:
            print(
                f"bench/gpu.py: no CUDA: {info['why']}. Nothing measured; {os.path.relpath(args.out, ROOT)} "
                "is left as it is. Run it on a machine with a GPU."
            )
        return 0
    ensure_codec()
    t0, parts, notes = time.perf_counter(), {}, []
    if info.get("cupy") is None:
        notes.append(
            f"CuPy missing ({info.get('cupy_why')}): no device tier over CUDA IPC and no GPU coding; "
            "pip install 'memsnap[gpu]'"
        )
    for name, fn in (
        ("d2h", lambda: d2h(notes)),
        ("d2d", lambda: d2d(notes)),
        ("stall", lambda: stall(notes, args.steps)),
        ("coding", lambda: coding(notes)),
        ("tests", gpu_tests),
    ):
        if name in args.skip:
            continue
        t = time.perf_counter()
        try:
            parts[name] = fn()
        except Exception as exc:
            notes.append(f"{name} failed: {type(exc).__name__}: {exc}\n\n```\n{traceback.format_exc()[-2000:]}```")
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
        import torch

        torch.cuda.empty_cache()
    text = report(info, parts, notes, time.perf_counter() - t0)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
