"""DDP whose gradients go through the re-formable group, so DDP is built once per process
and never rebuilt when members change.

The ``DistributedDataParallel`` module sits on a private one-rank group (its own broadcasts
and buffer syncs are no-ops), and a communication hook averages each gradient bucket across
the current generation through ``RecoverableGroup``.

A lost peer ends the step at the next bucket: ``PeerLost`` goes up from the hook through the
autograd engine and out of the training function (the member catches it; the user's code
never handles it), so the survivors stop within one bucket instead of computing the rest of
the backward (on a GPU, up to a whole backward before they could join the recovery). The
rollback (``reset``) then resets DDP's reducer (``Reducer._reset_state``: the iteration's
bucket counting and unused-parameter map cleared, so the next forward starts a fresh
iteration) and drops the cut step's gradients; no optimizer step was taken. With a torch whose
reducer has no ``_reset_state``, raising would leave the reducer mid-iteration for good, so
there the hook hands the bucket back unaveraged, the backward runs out and the step's
``ctx.save`` ends it in ``PeerLost``. Each bucket is reduced through a copy: a collective
abandoned by a lost peer may still write into its tensor until the backend's timeout, and DDP
reuses its bucket buffers.

The buckets are fixed at construction (``find_unused_parameters=True``, as torchft does), so
every member, a standby built later included, reduces the same buckets in the same order and
a replayed step is bitwise equal to its first run. A reset does not re-lay them out (DDP
rebuilds buckets only where it does not look for unused parameters).
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


def can_cut_a_step() -> bool:
    """Whether DDP's reducer can be left mid-backward and reset (``Reducer._reset_state``):
    then a lost peer's ``PeerLost`` is raised through the hook."""
    from torch._C._distributed_c10d import Reducer

    return hasattr(Reducer, "_reset_state")


def average_bucket(group: RecoverableGroup, bucket):
    """DDP communication hook: the bucket averaged across the generation's members."""
    import torch

    buf = bucket.buffer()
    try:
        reduced = group.all_reduce(buf.clone())
    except PeerLost:
        if can_cut_a_step():
            raise  # out of the backward: the rest of it is not computed (``reset`` repairs DDP)
        # the generation is over (group.failure() says why); the step's save ends it
    else:
        buf.copy_(reduced.div_(group.world))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
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


def reset(ddp) -> None:
    """``ddp`` back to a step boundary before the rollback (or a live takeover) goes on with
    it: its reducer reset where a lost peer may have cut the backward (``can_cut_a_step``), and
    the cut step's gradients dropped (partial, and never averaged: no optimizer step took
    them). A step that ran out (an older torch) left the reducer finished: nothing to do."""
    if not can_cut_a_step():
        return
    ddp.reducer._reset_state()
    for p in ddp.module.parameters():
        p.grad = None
