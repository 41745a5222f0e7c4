"""The PyTorch Lightning callback: a fit that crashes resumes from the local agent's RAM.

A single process on a one-node loopback cluster (``peers=False``: world size 1). The model has
no dropout and every batch holds the same samples, so the comparison with an uninterrupted
fit does not depend on Lightning replaying an interrupted epoch's first batches (see the
callback's docstring); weights, AdamW moments, the step-interval LR schedule and the fit
loop's step counter must all come back exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import pytorch_lightning as pl
else:
    pl = pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from memsnap.integrations.lightning import MemsnapCallback  # noqa: E402
from memsnap.localcluster import LocalCluster  # noqa: E402
from memsnap.rank import shutdown  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = "lightning-crash"
SPARSE = "lightning-sparse"


class Crash(RuntimeError):
    pass


class Model(pl.LightningModule):
    def __init__(self, crash_at: int | None = None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.crash_at, self.steps_run = crash_at, 0

    def training_step(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise Crash(f"killed at step {self.global_step}")
        self.steps_run += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Paced(MemsnapCallback):
    """One snapshot in flight at a time, however loaded the machine (the steps here take
    microseconds; a real step outlasts a commit)."""

    def _snapshot(self, trainer, pl_module, force: bool = False) -> None:
        super()._snapshot(trainer, pl_module, force=force)
        if self._saved is not None:
            assert self.snap is not None  # the fit set it up
            self.snap.wait(self._saved, timeout=60)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    return DataLoader(TensorDataset(x.repeat(5, 1), y.repeat(5, 1)), batch_size=8)  # 5 equal batches


def fit(model: Model, max_steps: int, callbacks: list, seed: int) -> pl.Trainer:
    pl.seed_everything(seed, verbose=False)
    trainer = pl.Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader())
    return trainer


@pytest.fixture(scope="module")
def one_node():
    with LocalCluster(1) as c:
        try:
            yield c
        finally:
            for job in (JOB, SPARSE):
                shutdown(job, timeout=30)


def test_a_crashed_fit_resumes_from_local_ram_bitwise(one_node):
    pl.seed_everything(0, verbose=False)
    reference = Model()
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    fit(reference, 10, [], seed=0)

    crashed = Model(crash_at=7)
    crashed.load_state_dict(init)
    first = Paced(JOB, preemption=False)
    with pytest.raises(Crash):
        fit(crashed, 10, [first], seed=0)
    assert first.snap.wait(6, timeout=60) == 6  # step 6 was snapshotted at step 7's start
    first.snap.close()

    resumed = Model()  # a new process would build a fresh model: different weights, other seed
    second = MemsnapCallback(JOB, preemption=False)
    trainer = fit(resumed, 10, [second], seed=123)
    assert second.restored_step == 6
    assert resumed.steps_run == 3 and trainer.global_step == 10  # steps 7, 8, 9 only
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == [0.01 * 0.5**3]
    for (name, want), got in zip(reference.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(want, got), name


def test_the_last_step_of_a_fit_is_snapshotted_whatever_the_policy_says(one_node):
    """``every_steps=4`` over 10 steps asks for steps 3 and 7; the fit's end (step 9) is saved
    as well, so a rerun of the finished fit resumes at its end and runs no step."""
    model = Model()
    done = MemsnapCallback(SPARSE, every_steps=4, preemption=False)
    fit(model, 10, [done], seed=0)
    assert (done._saved, done.restored_step) == (9, None)

    again = Model()
    rerun = MemsnapCallback(SPARSE, every_steps=4, preemption=False)
    trainer = fit(again, 10, [rerun], seed=1)
    assert rerun.restored_step == 9
    assert again.steps_run == 0 and trainer.global_step == 10
    for (name, want), got in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(want, got), name
