"""FSDP2 through the re-formable group (``memsnap.collective.fsdp``), two gloo processes and no Ray:
its collectives give what FSDP2's own give, bitwise, across a re-formed generation; a lost
peer mid-step ends the step at once in ``PeerLost`` (where torch can reset FSDP2's iteration;
with an older torch the step runs out on zeros), the cut step leaves no trace once the
rollback's ``reshard`` ran, and the same sharded model trains on in the next generation."""

from __future__ import annotations

from support.two_ranks import run_pair

CHILD = r"""
import hashlib, json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from memsnap.collective.fsdp import can_cut_a_step, reshard, shard
from memsnap.collective.group import RecoverableGroup

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)

def build():
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))  # 13, 5 rows: uneven
    return model

def step(model, opt, i):  # gradients zeroed after the step: a cut step's must not carry over
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + i))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()

def digest(model, opt):
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.to_local().detach().numpy().tobytes())
    for st in opt.state.values():
        for k in sorted(st):
            t = st[k]
            h.update((t.to_local() if hasattr(t, "to_local") else t).numpy().tobytes())
    return h.hexdigest()

group = RecoverableGroup("fsdptest", ("127.0.0.1", port), timeout_s=30)
# both ranks here before either goes on: a re-form publishes the end of the generation it
# leaves, which would cut a peer still finishing that generation's last collective
marks = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
def meet(name):
    marks.set(f"{name}/{rank}", "1")
    marks.wait([f"{name}/0", f"{name}/1"])
group.configure(0, rank, 2)
ref = build()
for m in ref:
    if isinstance(m, torch.nn.Linear):
        fully_shard(m)
fully_shard(ref)  # FSDP2's own collectives, on generation 0's group
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
for i in range(6):
    step(ref, ref_opt, i)

model, twin = build(), build()  # twin: trains the same steps, but never the cut one
shard(model, group, modules=[m for m in model if isinstance(m, torch.nn.Linear)])
shard(twin, group, modules=[m for m in twin if isinstance(m, torch.nn.Linear)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
for i in range(3):
    step(model, opt, i)
    step(twin, twin_opt, i)
meet("gen0-done")
group.configure(1, rank, 2)  # re-formed in the same process: the model is not rebuilt
for i in range(3, 6):
    step(model, opt, i)
    step(twin, twin_opt, i)
result = {"ref": digest(ref, ref_opt), "rec": digest(model, opt), "cut": can_cut_a_step()}
before = digest(model, opt)
# a peer lost mid-backward, once the last layer's gradients are reduce-scattered on both ranks:
# rank 1 reports it as the backward reaches the first layer (after rank 0's has too: a failure
# published earlier may end rank 0's last reduce-scatter before it sees its result) and takes no
# further part; rank 0's next collective sees it
def lose(module, grad):
    if rank == 0:
        marks.set("rank0-past-the-last-layer", "1")
    else:
        marks.wait(["rank0-past-the-last-layer"])
        group.fail("lost (test)")

hook = model[0].register_full_backward_pre_hook(lose)
raised = None
try:
    step(model, opt, 6)
except Exception as exc:
    raised = repr(exc)
hook.remove()
result["partial_grads"] = any(p.grad is not None for p in model.parameters())
result["raised"] = raised
result["failure"] = group.failure()
reshard(model)
result["untouched"] = digest(model, opt) == before  # no optimizer step on a cut step's zeros
group.configure(2, rank, 2)
step(model, opt, 7)
step(twin, twin_opt, 7)
result["trained_on"] = group.failure() is None
result["as_twin"] = digest(model, opt) == digest(twin, twin_opt)
meet("done")  # (no peer still in the last collective when either leaves)
group.close()
open(out, "w").write(json.dumps(result))
# out at once: generation 1's abandoned all-gather is still kept (its peer never joined it), and
# a peer's exit racing this interpreter's teardown of that group aborts in gloo's thread
os._exit(0)
"""


def test_fsdp2_through_the_reformable_group_is_bitwise_and_a_cut_step_leaves_no_trace(tmp_path):
    res = run_pair(CHILD, tmp_path)
    for r in res:
        assert r["rec"] == r["ref"]  # sharded shapes and sums as FSDP2's own, across a re-form
        assert r["failure"] and "lost (test)" in r["failure"]
        assert r["trained_on"]
        if r["cut"]:  # the step ended at its first collective, and left nothing behind
            assert r["raised"] and r["raised"].startswith("PeerLost(")
            assert r["partial_grads"]  # (the last layer's were reduce-scattered before the cut)
            assert r["untouched"] and r["as_twin"]
        else:  # an older torch: the step ran out on zeros (the rollback undoes it)
            assert r["raised"] is None
    assert res[0]["rec"] != res[1]["rec"]  # each rank holds its own shards (no replica)
