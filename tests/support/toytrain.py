"""A tiny, complete training set-up for state tests: dropout, AdamW, an LR schedule, and
shuffled synthetic data read by 2 DataLoader workers through memsnap's resumable sampler.

    objs = make(seed)                 # {"model", "optim", "sched", "data"}: pass it to capture/apply
    losses = train_steps(objs, n)     # n more steps, continuing the data stream across calls

Run as a script it resumes from a snapshot in a fresh process (used by the bitwise test):
    python tests/toytrain.py DIR N    # reads DIR/state.json + DIR/state.bin, trains N steps,
                                      # writes DIR/losses.json and DIR/params.json + DIR/params.bin
"""

from __future__ import annotations

import atexit
import json
import random
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from memsnap.sampler import ResumableLoader, ResumableSampler
from memsnap.state.apply import apply
from memsnap.state.capture import capture
from memsnap.state.manifest import Manifest

DATASET_LEN, BATCH, FEATURES = 36, 8, 6
_ITERS: weakref.WeakKeyDictionary[ResumableLoader, Any] = weakref.WeakKeyDictionary()
# Dropping the live iterators at exit stops their workers cleanly, before multiprocessing's own
# exit handler (registered earlier, so run later) would terminate them and leave each one's
# /tmp/pymp-* directory behind.
atexit.register(_ITERS.clear)


class ToyData(Dataset):
    """A fixed synthetic regression set (the same whatever seed the run uses)."""

    def __init__(self, n: int = DATASET_LEN):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make(seed: int) -> dict[str, Any]:
    """Fresh model, optimizer, scheduler and resumable loader, all seeded by ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=4, gamma=0.5)
    data = ToyData()
    sampler = ResumableSampler(data, shuffle=True, seed=seed)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2)
    return {"model": model, "optim": optim, "sched": sched, "data": ResumableLoader(loader)}


def _next_batch(loader: ResumableLoader):
    it = _ITERS.get(loader)
    if it is not None:
        batch = next(it, None)
        if batch is not None:
            return batch
    loader.set_epoch(loader.sampler.epoch + (it is not None))
    _ITERS[loader] = it = iter(loader)
    return next(it)


def train_steps(objs: dict[str, Any], n: int) -> list[float]:
    """Run ``n`` training steps; return each step's loss."""
    model, optim, sched = objs["model"], objs["optim"], objs["sched"]
    model.train()
    losses = []
    for _ in range(n):
        x, y = _next_batch(objs["data"])
        loss = torch.nn.functional.mse_loss(model(x), y + 0.01 * torch.randn_like(y))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        losses.append(loss.item())
    return losses


def save(objs: dict[str, Any], directory: Path, name: str = "state", *, rng: bool = True) -> None:
    """Capture ``objs`` into ``directory/name.json`` (manifest) and ``name.bin`` (bytes)."""
    manifest, buf = capture(objs, rng=rng, checksums=True)
    (directory / f"{name}.json").write_bytes(manifest.to_json())
    (directory / f"{name}.bin").write_bytes(buf)


def load(objs: dict[str, Any], directory: Path, name: str = "state", *, rng: bool = True) -> None:
    """Apply ``directory/name.json`` + ``name.bin`` to ``objs``."""
    manifest = Manifest.from_json((directory / f"{name}.json").read_bytes())
    apply(objs, manifest, (directory / f"{name}.bin").read_bytes(), rng=rng)


def resume_main(directory: Path, n: int) -> None:
    objs = make(seed=999)  # a different seed: everything that matters must come from the snapshot
    load(objs, directory)
    losses = train_steps(objs, n)
    (directory / "losses.json").write_text(json.dumps([x.hex() for x in losses]))
    save({"model": objs["model"]}, directory, "params", rng=False)


if __name__ == "__main__":
    resume_main(Path(sys.argv[1]), int(sys.argv[2]))
