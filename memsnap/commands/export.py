"""``memsnap export URI[/step] --safetensors OUT``: a step's model weights for inference."""

from __future__ import annotations

import argparse

from memsnap.commands._common import add_location, open_step, weight_paths, write_safetensors
from memsnap.durable.reshard import full_tensors
from memsnap.durable.storage import Store
from memsnap.state.tree import segment, unquote


def weights(store: Store, step: int, marker: dict, key: str | None) -> dict:
    """``{name: full tensor}`` of the weights under ``key``; sharded tensors gathered whole."""
    key, paths = weight_paths(store.manifest(step, 0, marker), key)
    return {_weight_name(path[len(segment(key)) + 1 :]): t for path, t in full_tensors(store, step, paths, marker)}


def _weight_name(rest: str) -> str:
    """A model's state-dict key from its tensor's name below the model (``"%30"`` -> ``"0"``)."""
    return rest if "/" in rest else unquote(rest)


def run(args: argparse.Namespace) -> int:
    store, step, marker = open_step(args)
    tensors = weights(store, step, marker, args.key)
    size = write_safetensors(tensors, args.safetensors, {"memsnap_step": str(step), "source": store.uri})
    print(f"wrote {len(tensors)} tensors ({size}) of step {step} to {args.safetensors}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("export", help="export model weights (safetensors)", description=__doc__.split("\n")[0])
    add_location(ap)
    ap.add_argument("--safetensors", required=True, metavar="OUT", help="output .safetensors file")
    ap.add_argument("--key", default=None, help="state key of the model (default: 'model')")
    ap.set_defaults(func=run)
    return ap
