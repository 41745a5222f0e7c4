"""PyTorch Lightning: ``Trainer(callbacks=[MemsnapCallback(job=...)])``.

The callback creates a ``Snapshotter`` for the trainer's rank (world size and rank from the
trainer; Ray from ``RAY_ADDRESS`` or a local loopback instance, as ``Snapshotter.from_env``),
restores the newest committed step when the fit starts, and snapshots every optimizer step
the policy asks for (``every_steps=1`` by default), once Lightning has finished it (LR
scheduler stepped, batch counted: at the next batch's start), and the last step of the fit
whatever the policy says. A snapshot holds the LightningModule,
every optimizer and LR scheduler, the fit loop's progress counters (so ``global_step`` and
``current_epoch`` continue where they stopped) and every RNG.

Lightning re-creates a mid-epoch DataLoader from the start of its epoch, so a run resumed
from a step inside an epoch sees that epoch's first batches again unless its sampler is
resumable; snapshot at epoch ends (``every_steps`` = batches per epoch) or put the sampler's
state into ``extra`` (for example ``memsnap.sampler.ResumableSampler``) to resume exactly.

Needs ``pytorch_lightning`` or ``lightning`` (``pip install memsnap[lightning]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memsnap.rank import Snapshotter

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as exc:
        raise ImportError(
            "memsnap.integrations.lightning needs PyTorch Lightning: "
            "pip install 'memsnap[lightning]' (or pytorch_lightning / lightning)"
        ) from exc


class _FitLoop:
    """The fit loop's progress counters as a stateful object (plain ints, JSON-safe)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return self.trainer.fit_loop.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.fit_loop.load_state_dict(state)


class MemsnapCallback(Callback):
    """Snapshot a Lightning fit into memsnap and resume it from the fastest tier.

    ``job``: the memsnap job name (the same on every rank and across restarts). ``extra``:
    more stateful objects or values to snapshot with the trainer's (a sampler, a data
    iterator position). Other keyword arguments go to ``memsnap.Snapshotter``.
    """

    def __init__(self, job: str, extra: dict[str, Any] | None = None, **snapshotter_kwargs: Any):
        super().__init__()
        self.job = job
        self.extra = dict(extra or {})
        self.kwargs = snapshotter_kwargs
        self.snap: Snapshotter | None = None  # from setup(stage="fit") on
        self.restored_step: int | None = None
        self._saved: int | None = None  # the newest step captured
        self._tried: int | None = None  # the newest step offered to the policy

    def state(self, trainer, pl_module) -> dict:
        """What one snapshot holds."""
        state: dict[str, Any] = {"model": pl_module, "fit_loop": _FitLoop(trainer)}
        state.update({f"optimizer_{i}": opt for i, opt in enumerate(trainer.optimizers)})
        state.update({f"scheduler_{i}": cfg.scheduler for i, cfg in enumerate(trainer.lr_scheduler_configs)})
        state.update({f"extra_{k}": v for k, v in self.extra.items()})
        return state

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.snap is not None:
            return
        from memsnap.rank import Snapshotter, ensure_ray

        ensure_ray()
        self.snap = Snapshotter(job=self.job, rank=trainer.global_rank, world_size=trainer.world_size, **self.kwargs)

    def on_fit_start(self, trainer, pl_module) -> None:
        """Load the newest step every rank can load (collective): optimizers exist and the fit
        loop has not started (where Lightning itself restores a ``ckpt_path``)."""
        assert self.snap is not None, "setup(stage='fit') comes first"
        self.restored_step = self.snap.restore(self.state(trainer, pl_module))
        self._saved = self.restored_step  # already held: a fit that resumes at its end saves nothing

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Snapshot the step that just finished. Here, not in ``on_train_batch_end``: Lightning
        steps step-interval LR schedulers and marks the batch completed after that hook."""
        self._snapshot(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        """The last step, whatever the policy says (a forced save: where the snapshots still in
        flight hold every slot, it waits for one instead of skipping the step), so that a
        finished fit always resumes from its end."""
        self._snapshot(trainer, pl_module, force=True)

    def _snapshot(self, trainer, pl_module, force: bool = False) -> None:
        step = trainer.global_step - 1  # global_step counts finished optimizer steps
        if step < 0 or step == self._saved or (step == self._tried and not force):
            return  # (with gradient accumulation, not every batch finishes a step)
        self._tried = step
        assert self.snap is not None, "setup(stage='fit') comes first"
        if self.snap.save(step, self.state(trainer, pl_module), force=force):
            self._saved = step

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self.snap is not None:
            if self._saved is not None:  # let the last snapshot commit before fit returns
                self.snap.wait(self._saved, timeout=60)
            self.snap.close()
            self.snap = None
