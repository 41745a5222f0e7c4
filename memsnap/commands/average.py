"""``memsnap average URI --last N OUT``: the mean of the last N steps' weights, as safetensors."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tqdm import tqdm

from memsnap.commands._common import write_safetensors
from memsnap.commands.export import weights
from memsnap.durable.storage import Store
from memsnap.errors import ConfigError, StateMismatchError

if TYPE_CHECKING:
    import torch


def _add(acc: dict, dtypes: dict, new: dict, step: int) -> None:
    """Add ``new`` (step ``step``'s weights) to the float64 sums ``acc``; ``dtypes`` records
    each weight's dtype, which every step must share."""
    if acc and set(acc) != set(new):
        raise StateMismatchError(
            f"step {step} has weights {sorted(set(new) ^ set(acc))[:3]} that other "
            "steps lack; average steps of the same model"
        )
    for name, t in new.items():
        if name in acc and acc[name].shape != t.shape:
            raise StateMismatchError(
                f"{name!r} is {list(t.shape)} at step {step} but {list(acc[name].shape)} at a later step"
            )
        if name in dtypes and dtypes[name] != t.dtype:
            raise StateMismatchError(
                f"{name!r} is {t.dtype} at step {step} but {dtypes[name]} at a later "
                "step; average steps whose weights have the same dtypes"
            )
        dtypes.setdefault(name, t.dtype)
        if t.is_floating_point():
            acc[name] = acc[name] + t.double() if name in acc else t.double()
        else:
            acc.setdefault(name, t)  # integer buffers: the newest step's value


def average(store: Store, steps: list[int], key: str | None) -> dict:
    """The element-wise mean (in float64, cast back) of the weights of ``steps``."""
    acc: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for step in tqdm(steps[::-1], desc="average", unit="step", disable=None):
        new = weights(store, step, store.marker(step), key)
        _add(acc, dtypes, new, step)
    return {k: (t / len(steps)).to(dtypes[k]) if dtypes[k].is_floating_point else t for k, t in acc.items()}


def run(args: argparse.Namespace) -> int:
    if args.last < 1:
        raise ConfigError(f"--last {args.last}: average at least 1 step")
    store = Store.open(args.location, args.endpoint)
    steps = store.steps()[-args.last :]
    if len(steps) < args.last:
        raise ConfigError(
            f"--last {args.last} but only {len(steps)} committed steps under "
            f"{args.location}; pass --last {len(steps) or 1} or fewer"
        )
    tensors = average(store, steps, args.key)
    size = write_safetensors(tensors, args.out, {"memsnap_steps": ",".join(map(str, steps)), "source": store.uri})
    print(f"wrote the mean of steps {steps} ({len(tensors)} tensors, {size}) to {args.out}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("average", help="average the last N steps' weights", description=__doc__.split("\n")[0])
    ap.add_argument("location", metavar="URI", help="checkpoint root")
    ap.add_argument("--last", type=int, required=True, metavar="N", help="how many newest steps")
    ap.add_argument("out", metavar="OUT", help="output .safetensors file")
    ap.add_argument("--key", default=None, help="state key of the model (default: 'model')")
    ap.add_argument("--endpoint", default=None, help="S3 endpoint URL (default: $AWS_ENDPOINT_URL)")
    ap.set_defaults(func=run)
    return ap
