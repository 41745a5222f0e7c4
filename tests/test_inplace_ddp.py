"""DDP through the re-formable group (``memsnap.collective.ddp``), two gloo processes and no Ray:
its buckets average to what DDP's own gloo all-reduce gives, bitwise, across a re-formed
generation; a lost peer mid-backward ends the backward at the next bucket in ``PeerLost`` (where
the reducer can be reset; otherwise the backward runs out unaveraged), the cut step leaves no
trace once the rollback's ``reset`` ran, and the same DDP module trains on in the next
generation, as a twin that never had the cut step."""

from __future__ import annotations

from support.two_ranks import run_pair

CHILD = r"""
import hashlib, json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from memsnap.collective.ddp import can_cut_a_step, replicate, reset
from memsnap.collective.group import RecoverableGroup

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
LAYERS = 6
BUCKET_MB = 0.02  # one layer of 64 x 64 (+ bias, 16.3 KiB) per bucket: a bucket per layer

def build():
    torch.manual_seed(7)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(LAYERS)])

def step(ddp, opt, i):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(100 * rank + i))
    opt.zero_grad(set_to_none=False)
    ddp(x).square().mean().backward()
    opt.step()

def digest(model, opt):
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for st in opt.state.values():
        for k in sorted(st):
            h.update(st[k].numpy().tobytes())
    return h.hexdigest()

group = RecoverableGroup("ddptest", ("127.0.0.1", port), timeout_s=30)
# both ranks here before either goes on: a re-form publishes the end of the generation it
# leaves, which would cut a peer still finishing that generation's last collective
marks = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
def meet(name):
    marks.set(f"{name}/{rank}", "1")
    marks.wait([f"{name}/0", f"{name}/1"])
group.configure(0, rank, 2)
# the reference: DDP on the generation's own gloo group, with its own all-reduce and averaging
ref_model = build()
ref = DistributedDataParallel(ref_model, find_unused_parameters=True, bucket_cap_mb=BUCKET_MB)
ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
for i in range(6):
    step(ref, ref_opt, i)

model, twin_model = build(), build()  # twin: trains the same steps, but never the cut one
ddp = replicate(model, group, bucket_cap_mb=BUCKET_MB)
twin = replicate(twin_model, group, bucket_cap_mb=BUCKET_MB)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
twin_opt = torch.optim.AdamW(twin_model.parameters(), lr=1e-2)
for i in range(3):
    step(ddp, opt, i)
    step(twin, twin_opt, i)
meet("gen0-done")
group.configure(1, rank, 2)  # re-formed in the same process: DDP is not rebuilt
for i in range(3, 6):
    step(ddp, opt, i)
    step(twin, twin_opt, i)
result = {"ref": digest(ref_model, ref_opt), "rec": digest(model, opt), "cut": can_cut_a_step()}
result["buckets"] = len(ddp.reducer._get_zeros_like_grad_buckets())
before = digest(model, opt)

# how many buckets each backward reduces: count the group's all-reduces
calls = {"n": 0}
all_reduce = group.all_reduce
def counted(tensor, op=None):
    calls["n"] += 1
    return all_reduce(tensor, op)
group.all_reduce = counted

# a peer lost mid-backward, once both ranks have reduced the buckets of layers 5 to 2: rank 1
# reports it as its backward reaches layer 1 (after rank 0's has: a failure published earlier may
# end rank 0's bucket of layer 2 before it sees its result) and takes no further part; both
# ranks' bucket of layer 1 sees it
def lose(module, grad):
    if rank == 0:
        marks.set("rank0-past-the-first-bucket", "1")
    else:
        marks.wait(["rank0-past-the-first-bucket"])
        group.fail("lost (test)")

hook = model[1].register_full_backward_pre_hook(lose)
raised = None
try:
    step(ddp, opt, 6)
except Exception as exc:
    raised = repr(exc)
hook.remove()
result["cut_calls"] = calls["n"]
result["partial_grads"] = any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
result["raised"] = raised
result["failure"] = group.failure()
reset(ddp)
result["untouched"] = digest(model, opt) == before  # no optimizer step on a cut step
result["grads_dropped"] = all(p.grad is None for p in model.parameters()) if result["cut"] else None
group.configure(2, rank, 2)
calls["n"] = 0
step(ddp, opt, 7)
step(twin, twin_opt, 7)
result["full_calls"] = calls["n"] // 2  # (both modules' buckets)
result["trained_on"] = group.failure() is None
result["as_twin"] = digest(model, opt) == digest(twin_model, twin_opt)
meet("done")  # (no peer still in the last collective when either leaves)
group.close()
open(out, "w").write(json.dumps(result))
# out at once: generation 1's abandoned all-reduce is still kept (its peer never joined it), and
# a peer's exit racing this interpreter's teardown of that group aborts in gloo's thread
os._exit(0)
"""


def test_ddp_through_the_reformable_group_is_bitwise_and_a_cut_backward_leaves_no_trace(tmp_path):
    res = run_pair(CHILD, tmp_path)
    for r in res:
        assert r["rec"] == r["ref"]  # the same sums as DDP's own averaging, across a re-form
        assert r["failure"] and "lost (test)" in r["failure"]
        assert r["trained_on"] and r["as_twin"] and r["untouched"]
        assert r["buckets"] >= 3 and r["full_calls"] == r["buckets"]
        if r["cut"]:  # the backward ended at the bucket after the loss (the last never ran), clean
            assert r["raised"] and r["raised"].startswith("PeerLost("), r["raised"]
            assert r["cut_calls"] == r["buckets"] - 1, r
            assert r["partial_grads"] and r["grads_dropped"]
        else:  # a torch whose reducer cannot be reset: the backward ran out unaveraged
            assert r["raised"] is None and r["cut_calls"] == r["buckets"]
