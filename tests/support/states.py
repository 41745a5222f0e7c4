"""The training states the tests snapshot, from one factory: a seeded MLP, its AdamW and,
optionally, an LR schedule. Each test module names the shape it needs (a ``functools.partial``
of ``make_state``). (No tests here.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import torch


class Shape(TypedDict, total=False):
    """``make_state``'s keyword arguments: the shape a test module names."""

    widths: Sequence[int]
    relu: bool
    lr: float
    warm: int
    sched: bool
    epoch: bool
    device: str


def make_state(
    seed: int = 0,
    widths: Sequence[int] = (256, 1024, 256),
    *,
    relu: bool = True,
    lr: float = 1e-3,
    warm: int = 0,
    sched: bool = False,
    epoch: bool = False,
    device: str = "cpu",
) -> dict:
    """``{"model", "optim"}`` determined by ``seed``: linear layers through ``widths`` (a ReLU
    between two when ``relu``; one layer is the ``Linear`` itself, not a ``Sequential``) on
    ``device``, and their AdamW at ``lr``. ``warm``: one backward pass and optimizer step on a
    batch of that many rows first, so the optimizer's moments exist. ``sched``: a StepLR
    (step 2, gamma 0.5) as ``"sched"``. ``epoch``: an int entry ``"epoch"`` = ``seed``."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i and relu:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(a, b))
    model = (layers[0] if len(layers) == 1 else torch.nn.Sequential(*layers)).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    state: dict = {"model": model, "optim": optim}
    if sched:
        state["sched"] = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    if warm:
        model(torch.randn(warm, widths[0]).to(device)).sum().backward()
        optim.step()
    if epoch:
        state["epoch"] = seed
    return state


def train_step(state: dict, batch: int = 16) -> float:
    """One step of ``state`` (a ``make_state`` one) learning the identity on a random batch;
    its schedule steps too, when it has one. Returns the loss."""
    model = state["model"]
    first = model if isinstance(model, torch.nn.Linear) else model[0]
    x = torch.randn(batch, first.in_features).to(first.weight.device)
    loss = (model(x) - x).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    if "sched" in state:
        state["sched"].step()
    return float(loss)
