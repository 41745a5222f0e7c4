"""The run that never fails: the demo's training in plain gloo processes on 127.0.0.1,
with no Ray and no memsnap, whose loss curve the resumed run must match bit for bit."""

from __future__ import annotations

import os
from dataclasses import replace

import torch.distributed as dist
import torch.multiprocessing as mp

from memsnap.demo.train import TrainConfig, read_log, run
from memsnap.localcluster import free_port


def _rank_main(rank: int, cfg_json: dict, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(TrainConfig.from_json(cfg_json), rank, world)
    finally:
        dist.destroy_process_group()


def reference_losses(cfg: TrainConfig, world: int, log_path: str) -> dict[int, float]:
    """Train ``cfg`` on ``world`` local processes; return step -> loss."""
    if os.path.exists(log_path):
        os.remove(log_path)
    cfg = replace(cfg, log_path=log_path)
    if world == 1:
        run(cfg, 0, 1)
    else:
        mp.start_processes(
            _rank_main, args=(cfg.to_json(), world, free_port()), nprocs=world, join=True, start_method="spawn"
        )
    return read_log(log_path)
