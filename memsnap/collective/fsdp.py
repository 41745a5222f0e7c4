"""FSDP2 (``fully_shard``) whose all-gathers and reduce-scatters go through the re-formable
group, so the sharded model and its optimizer are built once per process and never rebuilt
when members change.

No rank holds a replica of another's shards here: a lost rank's parameters and optimizer
moments exist only in memsnap's snapshot, which the standby restores from its peers while
the survivors roll back from their own node's RAM.

``fully_shard`` needs the rank and a formed group, which a standby does not have in
``setup``: call ``ctx.fully_shard`` (and build the optimizer over the sharded parameters) in
a function given to ``ctx.on_rank`` in ``setup``; it runs once per process, when it first
becomes a rank, after its group is formed.

FSDP2 is given its own communication objects (``set_custom_all_gather`` and
``set_custom_reduce_scatter``), which ignore the group FSDP2 holds (the generation it was
sharded on, left when the group is re-formed) and use the current generation. A member keeps
its rank across generations and the world its size, so every shard keeps its shape.

A lost peer ends the step at the next all-gather or reduce-scatter: ``PeerLost`` goes up
through FSDP2's hooks and out of the training function (the member catches it; the user's
code never handles it), so the survivors stop within one layer instead of computing the rest
of the step on zeros (on a GPU, up to a whole step before they could join the recovery).
The rollback (``reshard``) then resets FSDP2's per-iteration state
(``FSDPModule.reset_iter_state``: every group resharded, the iteration's trackers cleared)
and drops the cut step's gradients; no optimizer step was taken. With a torch that has no
``reset_iter_state`` (before 2.13), raising would leave FSDP2 mid-iteration, so there the
collective leaves zeros instead, the step runs out and its ``ctx.save`` ends it in
``PeerLost``. Each collective runs on buffers of its own (an abandoned one may still write
into them until the backend's timeout).

Collectives over the parameters' device mesh (``clip_grad_norm_`` on DTensors, ``full_tensor``)
go to the generation the model was sharded on: use ``ctx.all_reduce`` instead.
"""

from __future__ import annotations

from memsnap.collective.group import PeerLost, RecoverableGroup


def can_cut_a_step() -> bool:
    """Whether FSDP2 can be left mid-iteration and reset (``FSDPModule.reset_iter_state``):
    then a lost peer's ``PeerLost`` is raised through its hooks."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "reset_iter_state")


def _comm_classes():
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    cut = can_cut_a_step()

    class RecoverableAllGather(AllGather):
        def __init__(self, group: RecoverableGroup):
            self.group = group

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            out = torch.empty_like(output_tensor)
            try:
                self.group.all_gather_single(out, input_tensor.clone())
                output_tensor.copy_(out)
            except PeerLost:
                if cut:
                    raise
                output_tensor.zero_()  # the generation is over; the step's save ends it
            return None

    class RecoverableReduceScatter(ReduceScatter):
        def __init__(self, group: RecoverableGroup):
            self.group = group

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            out = torch.empty_like(output_tensor)
            try:
                self.group.reduce_scatter_single(out, input_tensor.clone(), op)
                output_tensor.copy_(out)
            except PeerLost:
                if cut:
                    raise
                output_tensor.zero_()
            return None

    return RecoverableAllGather, RecoverableReduceScatter


def shard(model, group: RecoverableGroup, *, modules=(), **options):
    """``fully_shard`` each of ``modules`` (for example the transformer blocks) and then
    ``model``, on a 1-D mesh over the current generation, with the re-formable collectives.
    ``options``: those of ``torch.distributed.fsdp.fully_shard`` (``mesh`` is memsnap's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if group.gen is None or group.world is None:
        raise RuntimeError(
            "fully_shard needs this process's rank and a formed group, which setup does not "
            "have (a standby runs it before it has a rank): call ctx.fully_shard in a function "
            "given to ctx.on_rank(fn) in setup"
        )
    if "mesh" in options:
        raise ValueError("mesh=...: memsnap shards over its own re-formable group; leave mesh out")
    mesh = init_device_mesh("cuda" if group.backend == "nccl" else "cpu", (group.world,))
    for module in modules:
        fully_shard(module, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    gather_cls, scatter_cls = _comm_classes()
    gather, scatter = gather_cls(group), scatter_cls(group)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
    return model


def reshard(model) -> None:
    """``model`` (the root ``shard`` returned) back to a step boundary before the rollback
    writes into it: FSDP2's iteration state reset and the cut step's gradients dropped where
    the step was cut (``can_cut_a_step``), every FSDP2 module back to its sharded parameters
    otherwise (a step run out on zeros may have left some gathered)."""
    from torch.distributed.fsdp import FSDPModule

    if can_cut_a_step() and isinstance(model, FSDPModule):
        model.reset_iter_state()
        for p in model.parameters():  # type: ignore[attr-defined]  # (an FSDPModule is an nn.Module)
            p.grad = None  # partial: a backward cut at a layer (no optimizer step took them)
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def warm_up() -> float:
    """Pay FSDP2's first-call costs now (its imports and lazy set-up: 1-2.5 s here, against
    0.2 s for the next ``fully_shard``), on a throwaway model over a one-rank group of this
    process alone, formed and left again: a member does it in ``prepare``, before it has a
    rank (off a standby's takeover path). Seconds taken (0 where a group is already formed)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        return 0.0
    t = time.perf_counter()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 8)).sum().backward()
        optim.step()
    finally:
        dist.destroy_process_group()
    return time.perf_counter() - t
