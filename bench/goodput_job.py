"""The training job of ``bench/goodput.py`` and the four ways of protecting it.

One rank of a data-parallel job: a small MLP trained with AdamW (gradients averaged with a
gloo all-reduce; or, ``workload="fsdp"``, sharded with FSDP2) beside a frozen buffer that
brings the rank's state up to ``state_mb``.
A step's compute is the real model on the CPU (``compute="model"``) or a sleep of
``step_s`` seconds standing in for GPU time that leaves the CPU to the agents
(``compute="sleep"``; the model still does its all-reduce and optimizer step).

Every rank appends JSON events (``built``, ``restored``, ``step``, ``save``) to one file
per run; ``bench/goodput.py`` rebuilds the timeline from them. ``setup_inplace`` and
``train_inplace`` run the same job under ``memsnap.inplace.InplaceJob`` (the
``memsnap-inplace`` system).
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist

from memsnap.demo.worker import event, read_events  # noqa: F401 (the demo's JSON-lines event log; bench/goodput.py reads it through here)

if TYPE_CHECKING:
    from concurrent.futures import Future

MIB = 1 << 20
# the MLP: 4 layers of WIDTH x WIDTH. ddp: 256 (about 1 MiB of weights, 3 MiB with AdamW, the
# same on every rank); fsdp: 1024 (16 MiB of weights, sharded: 12 MiB with AdamW per rank of 4)
WIDTH = {"ddp": 256, "fsdp": 1024}


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a tensor (a DTensor's shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


class Job:
    """One rank's state and step; ``cfg`` is the run's JSON-ready configuration.

    ``cfg["workload"]``: ``ddp`` (the model replicated, its gradients all-reduced) or ``fsdp``
    (FSDP2 ``fully_shard`` per layer: no rank holds another's parameters or moments). An fsdp
    job is sharded on the default group at once, or, with ``shard_later``, when ``shard`` is
    called (an in-place member has no rank until then)."""

    def __init__(self, rank: int, world: int, cfg: dict, shard_later: bool = False):
        torch.set_num_threads(1)
        torch.manual_seed(cfg["seed"])
        self.rank, self.world, self.cfg = rank, world, cfg
        self.sharded = cfg.get("workload", "ddp") == "fsdp"
        width = WIDTH["fsdp" if self.sharded else "ddp"]
        self.width = width
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers[:-1])
        if cfg["compute"] == "layers":
            _compute_in_layers(self.model, cfg["step_s"])
        self.gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
        # the frozen buffer brings the rank's state to state_mb (its model part as sharded)
        full = sum(p.numel() * 4 * 3 for p in self.model.parameters())
        model_bytes = full // world if self.sharded else full
        n = max(1, (cfg["state_mb"] * MIB - model_bytes) // 4)
        self.bulk = torch.empty(n, dtype=torch.float32).fill_(self._fill(rank))  # every page touched
        if not self.sharded:
            self._optimizer()
        elif not shard_later:
            self.shard(lambda model, modules: _fully_shard(model, modules))

    def _fill(self, rank: int) -> float:
        """The buffer's first value: a replicated (ddp) state is the same on every rank; a
        sharded one's buffer is each rank's own."""
        return float(rank + 1) if self.sharded else 1.0

    def shard(self, fully_shard) -> None:
        """FSDP2: ``fully_shard(model, modules)`` (each linear layer, then the whole), then the
        optimizer over the sharded parameters."""
        fully_shard(self.model, [m for m in self.model if isinstance(m, torch.nn.Linear)])
        self._optimizer()

    def _optimizer(self) -> None:
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        for p in self.model.parameters():  # the AdamW moments exist from the start
            p.grad = torch.zeros_like(p)
        self.optim.step()

    @property
    def nbytes(self) -> int:
        return self.bulk.numel() * 4 + sum(local(p).numel() * 4 * 3 for p in self.model.parameters())

    def state(self) -> dict:
        return {"model": self.model, "optim": self.optim, "bulk": {"frozen": self.bulk}}

    def take_rank(self, rank: int, world: int, fresh: bool) -> None:
        """Make the parts of the state that depend on the rank and are not snapshotted right for
        ``rank`` (an in-place member builds rank 0's state before it has a rank): the input
        generator starts again from the rank's seed, as a rank rebuilt by a restart does, and a
        ``fresh`` state (nothing restored) gets the rank's buffer fill."""
        self.rank, self.world = rank, world
        self.gen = torch.Generator().manual_seed(self.cfg["seed"] * 1000 + rank)
        if fresh:
            self.bulk.fill_(self._fill(rank))

    def step(self, step: int, average=None) -> None:
        """One step; ``average(params)`` averages the gradients (default: a ``dist.all_reduce``
        per parameter)."""
        x = torch.randn(64, self.width, generator=self.gen)
        if self.cfg["compute"] == "model":
            for _ in range(self.cfg["model_passes"]):
                loss = self.model(x).square().mean()
                self.optim.zero_grad(set_to_none=True)
                loss.backward()
        else:
            loss = self.model(x).square().mean()
            self.optim.zero_grad(set_to_none=True)
            loss.backward()
            if self.cfg["compute"] == "sleep":
                time.sleep(self.cfg["step_s"])  # ("layers": slept in the forward and backward)
        if self.sharded:
            pass  # FSDP2 reduce-scattered the gradients in the backward
        elif average is not None:
            average(self.model.parameters())
        elif self.world > 1:
            for p in self.model.parameters():
                assert p.grad is not None  # the backward above filled every gradient
                dist.all_reduce(p.grad)
                p.grad /= self.world
        self.optim.step()
        self.bulk[step % self.bulk.numel()] += 1.0  # the buffer changes a little every step

    # --- torch.save / torch.load (also the files of a Ray Train checkpoint) ----------------------
    def torch_state(self, step: int) -> dict:
        if self.sharded:  # this rank's shards, as plain tensors (the same world size restores them)
            params = [local(p).detach() for p in self.model.parameters()]
            moments = [{k: local(v) for k, v in self.optim.state[p].items()} for p in self.model.parameters()]
            return {"params": params, "moments": moments, "bulk": self.bulk, "step": step}
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict(), "bulk": self.bulk, "step": step}

    def write_torch(self, path: str, step: int) -> int:
        with open(path + ".tmp", "wb") as f:
            torch.save(self.torch_state(step), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        return os.path.getsize(path)

    def read_torch(self, path: str) -> int:
        sd = torch.load(path, weights_only=True)
        if self.sharded:
            with torch.no_grad():
                for p, saved, moments in zip(self.model.parameters(), sd["params"], sd["moments"]):
                    local(p).copy_(saved)
                    for k, v in moments.items():
                        local(self.optim.state[p][k]).copy_(v)
        else:
            self.model.load_state_dict(sd["model"])
            self.optim.load_state_dict(sd["optim"])
        self.bulk.copy_(sd["bulk"])
        return int(sd["step"])


def _compute_in_layers(model, step_s: float) -> None:
    """``--compute layers``: the step's simulated compute, ``step_s`` in all, slept in equal
    parts in each linear layer's forward and backward, between the collectives FSDP2 runs per
    layer (where a GPU's compute is), instead of in one block after the backward."""
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    part = step_s / (2 * len(linears))

    def backward(grad):
        time.sleep(part)
        return grad

    def forward(module, args, out):
        time.sleep(part)
        if out.requires_grad:
            out.register_hook(backward)  # runs as the layer's backward begins
        return out

    for m in linears:
        m.register_forward_hook(forward)


def _fully_shard(model, modules) -> None:
    """FSDP2's own ``fully_shard`` on the default group (the jobs that restart)."""
    from torch.distributed.fsdp import fully_shard

    for m in modules:
        fully_shard(m)
    fully_shard(model)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


class NoProtection:
    def __init__(self, job: Job, cfg: dict):
        pass

    def restore(self, job: Job) -> int | None:
        return None

    def save(self, job: Job, step: int) -> dict | None:
        return None

    def close(self) -> None:
        pass


def memsnap_options(cfg: dict) -> dict:
    """The Snapshotter options of a memsnap run: RS(``k``, ``m``) (default 2, 1), a snapshot
    every ``interval`` steps (or ``auto``), a spill every ``spill_every`` steps."""
    when = (
        {"auto": True, "every_steps": None, "mtbf_hours": cfg["node_mtbf_s"] / 3600}
        if cfg["interval"] == "auto"
        else {"every_steps": int(cfg["interval"])}
    )
    return dict(
        k=cfg.get("k", 2),
        m=cfg.get("m", 1),
        memory_budget=cfg["memory_budget"],
        spill=cfg["storage"],
        spill_every=cfg["spill_every"],
        spill_bytes_per_s=cfg["spill_bytes_per_s"],
        preemption=False,
        **when,
    )


class MemsnapProtection:
    """``Snapshotter.save`` every step (or ``auto``), spill every ``spill_every`` steps."""

    def __init__(self, job: Job, cfg: dict):
        from memsnap.rank import Snapshotter

        self.snap = Snapshotter(job=cfg["job"], rank=job.rank, world_size=job.world, **memsnap_options(cfg))

    def restore(self, job: Job) -> int | None:
        return self.snap.restore(job.state())

    def save(self, job: Job, step: int) -> dict | None:
        taken, stall = _timed(lambda: self.snap.save(step, job.state()))
        return {"stall": stall, "bytes": 0} if taken else None

    def wait(self, step: int) -> int | None:
        return self.snap.wait(step, timeout=300)

    def close(self) -> None:
        self.snap.close()


class TorchSaveProtection:
    """``torch.save`` + fsync of every rank's state every N steps into ``storage``; a step's
    checkpoint counts once every rank wrote its file (a barrier, then rank 0's marker)."""

    def __init__(self, job: Job, cfg: dict):
        self.root, self.every = cfg["storage"], int(cfg["interval"])

    def restore(self, job: Job) -> int | None:
        done = sorted(
            int(os.path.basename(d)[5:])
            for d in glob.glob(os.path.join(self.root, "step-*"))
            if os.path.exists(os.path.join(d, "COMMITTED"))
        )
        if not done:
            return None
        return job.read_torch(os.path.join(self.root, f"step-{done[-1]}", f"rank-{job.rank}.pt"))

    def save(self, job: Job, step: int) -> dict | None:
        if (step + 1) % self.every:
            return None
        d = os.path.join(self.root, f"step-{step}")
        t = time.perf_counter()
        os.makedirs(d, exist_ok=True)
        job.write_torch(os.path.join(d, f"rank-{job.rank}.pt"), step)
        dist.barrier()
        if job.rank == 0:
            open(os.path.join(d, "COMMITTED"), "w").close()
            for old in glob.glob(os.path.join(self.root, "step-*")):  # keep the newest two
                if int(os.path.basename(old)[5:]) < step - self.every:
                    shutil.rmtree(old, ignore_errors=True)
        return {"stall": time.perf_counter() - t, "bytes": 0}

    def close(self) -> None:
        pass


class DcpProtection:
    """``torch.distributed.checkpoint.async_save`` every N steps into ``storage`` through its
    own gloo group (the training all-reduces keep the default one). ddp: the model and
    optimizer are replicated across ranks, so DCP writes them once; fsdp: each rank writes its
    own shards. Each rank's buffer is its own."""

    def __init__(self, job: Job, cfg: dict):
        self.root, self.every, self.events = cfg["storage"], int(cfg["interval"]), cfg["events"]
        self.group = dist.new_group(backend="gloo")
        self.future: Future | None = None

    def _sd(self, job: Job) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(job.model, job.optim)
        return {"model": model, "optim": optim, f"bulk.{job.rank}": job.bulk}

    def restore(self, job: Job) -> int | None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        done = sorted(
            int(os.path.basename(d)[5:])
            for d in glob.glob(os.path.join(self.root, "step-*"))
            if os.path.exists(os.path.join(d, ".metadata"))
        )
        if not done:
            return None
        sd = self._sd(job)
        dcp.load(sd, checkpoint_id=os.path.join(self.root, f"step-{done[-1]}"), process_group=self.group)
        set_state_dict(job.model, job.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return done[-1]

    def save(self, job: Job, step: int) -> dict | None:
        import torch.distributed.checkpoint as dcp

        if (step + 1) % self.every:
            return None
        t = time.perf_counter()
        if self.future is not None:
            self.future.result()
        # with no async_stager, staging is synchronous and async_save returns the upload's Future
        self.future = cast(
            "Future",
            dcp.async_save(
                self._sd(job), checkpoint_id=os.path.join(self.root, f"step-{step}"), process_group=self.group
            ),
        )
        stall = time.perf_counter() - t
        began, events = time.time(), self.events
        self.future.add_done_callback(
            lambda _: event(events, ev="written", rank=job.rank, step=step, lag=time.time() - began)
        )
        if job.rank == 0:
            for old in glob.glob(os.path.join(self.root, "step-*")):
                if int(os.path.basename(old)[5:]) < step - 2 * self.every:
                    shutil.rmtree(old, ignore_errors=True)
        return {"stall": stall, "bytes": 0}

    def close(self) -> None:
        if self.future is not None:
            self.future.result()


class Protection(Protocol):
    """What every system's protection does for a rank (``MemsnapProtection`` can also ``wait``)."""

    def restore(self, job: Job) -> int | None: ...

    def save(self, job: Job, step: int) -> dict | None: ...

    def close(self) -> None: ...


PROTECTIONS: dict[str, Callable[[Job, dict], Protection]] = {
    "none": NoProtection,
    "memsnap": MemsnapProtection,
    "torch.save": TorchSaveProtection,
    "dcp": DcpProtection,
}


def go_on(job: Job, deadline: float) -> bool:
    """Whether to run another step: rank 0's clock decides for every rank (one tiny broadcast),
    so no rank starts a step whose all-reduce the others never join."""
    flag = torch.tensor([1 if time.time() < deadline else 0])
    if job.world > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def train(job: Job, prot, cfg: dict, first: int, attempt: int, deadline: float) -> int:
    """Steps from ``first`` until the wall clock passes ``deadline``; returns the next step."""
    step = first
    while go_on(job, deadline):
        job.step(step)
        saved = prot.save(job, step)
        if job.rank == 0:
            event(cfg["events"], ev="step", step=step, attempt=attempt)
        if saved is not None:
            event(cfg["events"], ev="save", rank=job.rank, step=step, attempt=attempt, **saved)
        step += 1
    return step


# --- in place (the memsnap-inplace system) ------------------------------------------------------
DEADLINE_KEY = "goodput/deadline"  # in the in-place job's rendezvous store: the run's end, wall clock


def setup_inplace(ctx, cfg: dict, world: int) -> Job:
    """``InplaceJob``'s ``setup``: a member has no rank yet (a standby may take any), so every
    member builds rank 0's state; ``train_inplace`` makes it the rank's after its restore. An
    fsdp job is sharded when the member first has a rank (``ctx.on_rank``)."""
    job = Job(0, world, cfg, shard_later=True)
    if job.sharded:
        ctx.on_rank(lambda ctx, job: job.shard(lambda model, modules: ctx.fully_shard(model, modules=modules)))
    return job


def train_inplace(ctx, job: Job, cfg: dict) -> int:
    """``InplaceJob``'s ``train``, called in each generation (survivors and the standby that
    took a lost rank alike): the ``built`` event (the rank is in the new group, ready to
    restore), ``ctx.restore``, then ``train``'s loop with the gradients averaged through the
    re-formable group. Rank 0's clock ends it for every rank (a one-element all-reduce each
    step) at the deadline the driver writes to ``DEADLINE_KEY`` when the timed part starts
    (rank 0 reads it each step: the driver may bring it forward to stop the job)."""
    import ray

    rank, gen, store = ctx.rank, ctx.generation, ctx.store
    event(cfg["events"], ev="built", rank=rank, gen=gen, pid=os.getpid(), node=ray.get_runtime_context().get_node_id())
    t = time.perf_counter()
    first = ctx.restore(job.state())
    wall = time.perf_counter() - t
    job.take_rank(rank, ctx.world_size, fresh=first == 0)
    phases = {k: round(v, 4) for k, v in ctx.snapshotter.last_restore.seconds.items()}
    event(cfg["events"], ev="restored", rank=rank, gen=gen, step=first - 1 if first else None, wall=wall, phases=phases)
    store.wait([DEADLINE_KEY])

    def go_on() -> bool:
        flag = torch.tensor([1.0 if rank == 0 and time.time() < float(store.get(DEADLINE_KEY)) else 0.0])
        ctx.all_reduce(flag)
        return flag.item() > 0

    step = first
    while go_on():
        job.step(step, average=ctx.average_gradients)
        taken, stall = _timed(lambda step=step: ctx.save(step, job.state()))
        if rank == 0:
            event(cfg["events"], ev="step", step=step, attempt=gen)
        if taken:
            event(cfg["events"], ev="save", rank=rank, step=step, attempt=gen, stall=stall, bytes=0)
        step += 1
    return step


def ray_train_loop(cfg: dict) -> None:
    """``train_loop_per_worker`` of the Ray Train run: restore from ``ray.train.get_checkpoint``,
    train, ``ray.train.report(checkpoint=...)`` every N steps (every rank writes its own file
    into the checkpoint directory, which Ray Train copies to ``storage_path``)."""
    import tempfile

    import ray
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    ckpt = ray.train.get_checkpoint()
    attempt = 0 if ckpt is None else 1
    node = ray.get_runtime_context().get_node_id()
    job = Job(rank, world, cfg)
    event(cfg["events"], ev="built", rank=rank, node=node)
    t = time.perf_counter()
    first = 0
    if ckpt is not None:
        with ckpt.as_directory() as d:
            first = job.read_torch(os.path.join(d, f"rank-{rank}.pt")) + 1
    event(cfg["events"], ev="restored", rank=rank, step=first - 1 if first else None, wall=time.perf_counter() - t)
    path = cfg["deadline_file"]  # the bench writes the run's deadline once every rank is up
    limit = time.monotonic() + 900
    while not os.path.exists(path):
        if time.monotonic() > limit:
            raise TimeoutError(f"rank {rank}: no start signal in {path}")
        time.sleep(0.05)
    deadline = float(open(path).read())
    every, step = int(cfg["interval"]), first
    while go_on(job, deadline):
        job.step(step)
        if rank == 0:
            event(cfg["events"], ev="step", step=step, attempt=attempt)
        if (step + 1) % every == 0:
            t = time.perf_counter()
            with tempfile.TemporaryDirectory(dir=cfg["scratch"]) as d:
                job.write_torch(os.path.join(d, f"rank-{rank}.pt"), step)
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))
            event(cfg["events"], ev="save", rank=rank, step=step, stall=time.perf_counter() - t, bytes=0)
        step += 1


# --- torchft (the torchft system) ----------------------------------------------------------------
def loopback_torchft() -> None:
    """torchft's Manager binds its server to every interface (``[::]``): bind it to loopback,
    where this bench keeps all of its traffic, and gloo to ``lo``."""
    import torchft.manager as manager

    if getattr(manager, "_bench_loopback", False):
        return
    real = manager.ManagerServer

    def server(**kw):
        kw["bind"] = str(kw["bind"]).replace("[::]", "127.0.0.1")
        return real(**kw)

    manager.ManagerServer = server
    manager._bench_loopback = True
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def torchft_loop(cfg: dict) -> None:
    """``train_loop_per_worker`` of the torchft run (Ray Train v2's ``TorchftConfig``), as Ray's
    ``torchft_linear_example`` runs it: every worker is its own replica group; torchft's DDP
    averages the gradients across the groups through its Manager. When a worker is lost the
    others go on with the groups left (``min_replicas=1``); Ray Train starts a new worker alone,
    which is sent a live peer's state (model, AdamW, buffer) over torchft's PGTransport.
    Nothing goes to disk. Only the quorum's rank 0 logs steps (one event per step)."""
    from datetime import timedelta

    import ray
    import ray.train
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    if cfg.get("workload", "ddp") != "ddp":
        raise ValueError("the torchft system runs the ddp workload (its FSDP needs HSDP replica groups)")
    loopback_torchft()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    node = ray.get_runtime_context().get_node_id()
    job = Job(rank, 1, cfg)  # one rank in its replica group: torchft averages across the groups
    event(cfg["events"], ev="built", rank=rank, node=node)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    transport = PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu"))
    restored: dict = {}

    def state_dict():
        return {"model": job.model.state_dict(), "optim": job.optim.state_dict(), "bulk": job.bulk}

    def load_state_dict(sd):
        t = time.perf_counter()
        job.model.load_state_dict(sd["model"])
        job.optim.load_state_dict(sd["optim"])
        job.bulk.copy_(sd["bulk"])
        restored["wall"] = time.perf_counter() - t

    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        world_size=1,
        rank=0,
        replica_id=f"goodput_{rank}",
        timeout=timedelta(seconds=60),
        checkpoint_transport=transport,
    )
    model = DistributedDataParallel(manager, job.model)
    optim = Optimizer(manager, job.optim)
    path = cfg["deadline_file"]  # the bench writes the run's deadline once every worker is up
    first = True
    try:
        while True:
            if os.path.exists(path) and time.time() >= float(open(path).read()):
                break
            x = torch.randn(64, job.width, generator=job.gen)
            optim.zero_grad(set_to_none=True)  # (starts the step's quorum)
            loss = model(x).square().mean()
            loss.backward()
            time.sleep(cfg["step_s"])
            before = manager.current_step()
            optim.step()  # the averaged gradients applied, if every group's all-reduce held
            step = manager.current_step() - 1
            if first:  # the first step joined the quorum: a new worker has received a peer's state by now
                first = False
                event(cfg["events"], ev="restored", rank=rank, step=step - 1, wall=restored.get("wall", 0.0))
            if step >= before:  # committed
                job.bulk[step % job.bulk.numel()] += 1.0
                if manager.participating_rank() == 0:  # (a step of fewer groups averages fewer samples)
                    event(cfg["events"], ev="step", step=step, attempt=0, participants=manager.num_participants())
    finally:
        manager.shutdown()
