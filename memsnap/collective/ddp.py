"""DDP whose gradients go through the re-formable group, so DDP is built once per process
and never rebuilt when members change.

The ``DistributedDataParallel`` module sits on a private one-rank group (its own broadcasts
and buffer syncs are no-ops), and a communication hook averages each gradient bucket across
the current generation through ``RecoverableGroup``. A lost peer does not raise inside the
autograd engine (that would leave DDP's reducer broken for the next step): the hook hands
the bucket back unaveraged and the generation is marked over, so the step's ``ctx.save``
ends it in ``PeerLost`` and the rollback undoes whatever the optimizer did with it. Each
bucket is reduced through a copy: a collective abandoned by a lost peer may still write into
its tensor until the backend's timeout, and DDP reuses its bucket buffers.

The buckets are fixed at construction (``find_unused_parameters=True``, as torchft does), so
every member, a standby built later included, reduces the same buckets in the same order and
a replayed step is bitwise equal to its first run.
"""

from __future__ import annotations

from memsnap.collective.group import PeerLost, RecoverableGroup


def local_group():
    """A one-rank gloo process group of this process alone (for DDP's own bookkeeping)."""
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, dist.default_pg_timeout)  # one rank: it never waits
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def average_bucket(group: RecoverableGroup, bucket):
    """DDP communication hook: the bucket averaged across the generation's members."""
    import torch

    buf = bucket.buffer()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    try:
        reduced = group.all_reduce(buf.clone())
        buf.copy_(reduced.div_(group.world))
    except PeerLost:
        pass  # the generation is over (group.failure() says why); the step's save ends it
    fut.set_result(buf)
    return fut


def replicate(model, group: RecoverableGroup, **ddp_options):
    """``model`` wrapped in DDP for in-place recovery (call it once, in ``setup``)."""
    from torch.nn.parallel import DistributedDataParallel

    # Buckets are laid out once and never rebuilt (DDP rebuilds them after the first backward
    # unless it looks for unused parameters): a standby that joins later must reduce the same
    # buckets, in the same order, as the survivors, or the sums differ in their last bits.
    ddp_options.setdefault("find_unused_parameters", True)
    ddp = DistributedDataParallel(model, process_group=local_group(), **ddp_options)
    ddp.register_comm_hook(group, average_bucket)
    return ddp
