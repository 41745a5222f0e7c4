"""Saving and loading a ~1 GiB model + AdamW state, side by side in one run.

Save side (the stall the training loop sees):
    memcpy            ctypes.memmove of every tensor into a preallocated, touched buffer (ceiling)
    capture           memsnap.state.capture.capture into the same preallocated buffer (plan reused)
    memsnap.save      per-tensor and whole-file xxh3 + write straight from the tensors + fsync +
                      manifest + commit marker
    ... no writeback  the same with localfs.WRITEBACK = 0 (no sync_file_range hints: all the
                      writing back is left to the closing fsync)
    staged            capture into a touched buffer + fill_checksums + Store.write_rank + commit:
                      the staging path ``save`` took before (the runtime's spill still writes so)
    torch.save        torch.save of the state dicts + fsync
    dcp.save          torch.distributed.checkpoint.save (no process group) + its own fsyncs

Load side, warm page cache and cold (posix_fadvise(DONTNEED) on every file, checked with
``fincore``), each into the live model and optimizer:
    memsnap.load      read + xxh3 verify + apply
    torch.load        torch.load(weights_only=True) + load_state_dict
    dcp.load          torch.distributed.checkpoint.load in place + set_state_dict

Every configuration runs once per round, rounds interleaved so machine noise hits all alike;
the best round and the median are reported, and the ratios of both.

    python bench/state.py [--gib 1.0] [--width 4096] [--rounds 3] [--saves-only] [--dir DIR]
                          [--out bench/results/state.md]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import memsnap
from memsnap.demo.disk import evict, resident
from memsnap.durable import localfs, storage
from memsnap.state.capture import capture, fill_checksums, plan


def build(gib: float, width: int = 4096) -> dict:
    """Linear(width, width) layers + AdamW moments: ~3 x params bytes of state."""
    layers = max(1, round(gib * 2**30 / 3 / (width * (width + 1) * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optim.step()
    return {"model": model, "optim": optim}


def files_under(path: str) -> list[str]:
    p = Path(path)
    return [str(f) for f in p.rglob("*") if f.is_file()] if p.is_dir() else [str(p)]


def drop_cache(path: str) -> float:
    """Write back and drop the cached pages of every file under ``path``; return the fraction
    still resident (``mincore``)."""
    files = files_under(path)
    for f in files:
        evict(f)
    cached = total = 0
    for f in files:
        c, n = resident(f)
        cached, total = cached + c, total + n
    return cached / max(total, 1)


def fsync_tree(path: str) -> None:
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


class Bench:
    """The configurations, each a method returning seconds for one run."""

    def __init__(self, state: dict, root: str):
        self.state, self.root, self.step = state, root, 0
        self.manifest = plan(state)
        self.arena = torch.empty(self.manifest.nbytes, dtype=torch.uint8)
        self.arena.fill_(1)  # touch every page once: a snapshot never allocates its destination
        self.buf = self.arena.numpy()
        self.nbytes = self.manifest.nbytes

    def _sources(self) -> list[tuple[int, torch.Tensor, int]]:
        """(offset, tensor, nbytes) of every stored tensor, looked up afresh: a load may have
        replaced the optimizer's tensors."""
        from memsnap.state import tree
        from memsnap.state.capture import collect

        found: list[torch.Tensor] = []  # the tensors, in manifest order

        def keep(t: torch.Tensor, path) -> int:
            found.append(t)
            return len(found) - 1

        tree.encode(collect(self.state), keep)
        return [
            (e.offset, t, e.nbytes) for e, t in zip(self.manifest.tensors, found) if e.alias_of is None and e.nbytes
        ]

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def t_memcpy(self) -> float:
        base, sources = self.arena.data_ptr(), self._sources()
        t = time.perf_counter()
        for off, src, n in sources:
            ctypes.memmove(base + off, src.data_ptr(), n)
        return time.perf_counter() - t

    def t_capture(self) -> float:
        t = time.perf_counter()
        capture(self.state, out=self.buf, manifest=self.manifest)
        return time.perf_counter() - t

    def t_memsnap_save(self) -> float:
        shutil.rmtree(self.path("memsnap"), ignore_errors=True)
        self.step += 1
        t = time.perf_counter()
        memsnap.save(self.path("memsnap"), self.state, self.step, progress=False)
        return time.perf_counter() - t

    def t_memsnap_save_nowb(self) -> float:
        saved, localfs.WRITEBACK = localfs.WRITEBACK, 0
        try:
            return self.t_memsnap_save()
        finally:
            localfs.WRITEBACK = saved

    def t_staged_save(self) -> float:
        shutil.rmtree(self.path("staged"), ignore_errors=True)
        self.step += 1
        t = time.perf_counter()
        store = storage.Store.open(self.path("staged"))
        manifest, buf = capture(self.state, out=self.buf, manifest=self.manifest)
        store.write_rank(self.step, 0, fill_checksums(manifest, buf), buf)
        store.commit(self.step, 1, {})
        return time.perf_counter() - t

    def t_torch_save(self) -> float:
        sd = {k: v.state_dict() for k, v in self.state.items()}
        with contextlib.suppress(FileNotFoundError):  # untimed, as the other saves' rmtree: the
            os.unlink(self.path("torch.pt"))  # results before 2026-11-30 timed truncating it
        t = time.perf_counter()
        with open(self.path("torch.pt"), "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t

    def _dcp_sd(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.state["model"], self.state["optim"])
        return {"model": model_sd, "optim": optim_sd}

    def t_dcp_save(self) -> float:
        import torch.distributed.checkpoint as dcp

        shutil.rmtree(self.path("dcp"), ignore_errors=True)
        t = time.perf_counter()
        dcp.save(self._dcp_sd(), checkpoint_id=self.path("dcp"))
        fsync_tree(self.path("dcp"))
        return time.perf_counter() - t

    def t_memsnap_load(self) -> float:
        t = time.perf_counter()
        memsnap.load(self.path("memsnap"), self.state, progress=False)
        return time.perf_counter() - t

    def t_torch_load(self) -> float:
        t = time.perf_counter()
        sd = torch.load(self.path("torch.pt"), weights_only=True)
        for k, v in self.state.items():
            v.load_state_dict(sd[k])
        return time.perf_counter() - t

    def t_dcp_load(self) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        t = time.perf_counter()
        sd = self._dcp_sd()
        dcp.load(sd, checkpoint_id=self.path("dcp"))
        set_state_dict(
            self.state["model"], self.state["optim"], model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        return time.perf_counter() - t


SAVES = [
    ("memcpy (ceiling)", "memcpy"),
    ("memsnap capture", "capture"),
    ("memsnap.save (+fsync)", "memsnap_save"),
    ("memsnap.save, no writeback (+fsync)", "memsnap_save_nowb"),
    ("staged: capture + write_rank (+fsync)", "staged_save"),
    ("torch.save (+fsync)", "torch_save"),
    ("dcp.save (+fsync)", "dcp_save"),
]
SAVE_LABELS = {label for label, _ in SAVES}
LOADS = [
    ("memsnap.load", "memsnap_load", "memsnap"),
    ("torch.load(weights_only)", "torch_load", "torch.pt"),
    ("dcp.load", "dcp_load", "dcp"),
]


def run(b: Bench, rounds: int, saves_only: bool = False) -> tuple[dict, list[float]]:
    times: dict[str, list[float]] = {}
    residue = []
    for r in range(rounds):
        for label, name in SAVES:
            times.setdefault(label, []).append(getattr(b, "t_" + name)())
        for label, name, path in [] if saves_only else LOADS:
            times.setdefault(label + " warm", []).append(getattr(b, "t_" + name)())
            residue.append(drop_cache(b.path(path)))
            times.setdefault(label + " cold", []).append(getattr(b, "t_" + name)())
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return times, residue


def reference(label: str) -> str | None:
    """The row a row's ratio is taken against (None: no ratio)."""
    if label == "memsnap capture":
        return "memcpy (ceiling)"
    if label.startswith("memsnap.load"):
        return "torch.load(weights_only)" + label[len("memsnap.load") :]
    if label in SAVE_LABELS and label not in ("memcpy (ceiling)", "torch.save (+fsync)"):
        return "torch.save (+fsync)"
    return None


def report(times: dict, nbytes: int, residue: list[float], args, load_start: float) -> str:
    gib = nbytes / 2**30
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        f"# State save/load: {gib:.2f} GiB model + AdamW state",
        "",
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, Linear({args.width}, {args.width}) layers, "
        f"{args.rounds} interleaved rounds, directory {args.dir or tempfile.gettempdir()}; load "
        f"average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (the machine "
        "is shared).",
        "",
        "| operation | best s | median s | GiB/s (median) | ratio (best) | ratio (median) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label in times:
        ref = reference(label)
        ratios = (
            ("", "")
            if ref is None or ref not in best
            else (f"{best[ref] / best[label]:.2f}x", f"{median[ref] / median[label]:.2f}x")
        )
        lines.append(
            f"| {label} | {best[label]:.3f} | {median[label]:.3f} | "
            f"{gib / median[label]:.2f} | {ratios[0]} | {ratios[1]} |"
        )
    cold = max(residue) if residue else -1
    lines += [
        "",
        "Ratios: capture is memcpy-time / capture-time (>= 0.8 is the target); every other save "
        "and memsnap.load are torch-time / its time (>= 1 means it is not slower than torch).",
    ]
    if not args.saves_only:
        lines.append(
            f"Cold runs: after posix_fadvise(DONTNEED), at most {cold:.1%} of a file stayed resident (fincore)."
            if cold >= 0
            else "Cold runs: fincore unavailable, residency not checked."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=4096, help="the Linear layers' width (smaller: more tensors)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--saves-only", action="store_true", help="skip the load side")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    state = build(args.gib, args.width)
    root = tempfile.mkdtemp(prefix="memsnap-bench-", dir=args.dir)
    try:
        b = Bench(state, root)
        times, residue = run(b, args.rounds, args.saves_only)
        text = report(times, b.nbytes, residue, args, load_start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
