"""A rank process for the device-tier tests: ``python -m support.device_rank <command>``.

The state lives on ``$MEMSNAP_TEST_DEVICE`` (default ``cpu``; ``cuda`` for the GPU test).
It speaks JSON lines on stdin/stdout (nothing is pickled) and, after answering, keeps its
mapping of the agent's buffer open until it is killed or its stdin closes, like a training
process that crashes while holding the mapping.

  capture <handle-json> <seed> <steps>  train, capture into the buffer, print manifest + digest
  partial <handle-json>                  scribble over the first half of the buffer, print "wrote"
  restore <handle-json> <manifest-file>  restore a fresh state from the buffer, print its digest
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

import torch
import xxhash

from memsnap.device import backend as pick_backend
from memsnap.device.backend import BufferHandle
from memsnap.device.tier import RankTier
from memsnap.state import capture as cap
from support import states

FEATURES = 64
DEVICE = os.environ.get("MEMSNAP_TEST_DEVICE", "cpu")


make_state = partial(states.make_state, widths=(FEATURES, 96, FEATURES), device=DEVICE)


def train(state: dict, steps: int) -> None:
    for _ in range(steps):
        states.train_step(state, batch=8)


def digest(state: dict) -> str:
    """Equal iff the parameters, the optimizer's tensors and step counts and the torch RNG
    are bitwise equal."""
    h = xxhash.xxh3_64()
    for t in state["model"].state_dict().values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    for per_param in state["optim"].state_dict()["state"].values():
        for v in per_param.values():
            h.update(v.cpu().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def _answer(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    command, handle = argv[0], BufferHandle.from_json(argv[1])
    tier = RankTier(pick_backend(handle.backend))
    if command == "capture":
        state = make_state(int(argv[2]))
        train(state, int(argv[3]))
        manifest, sources = cap.plan_sources(state)
        manifest = cap.fill_checksums(manifest, _captured_bytes(manifest, sources))
        assert tier.capture(handle, manifest, sources), tier.refused
        tier.wait()
        _answer({"manifest": manifest.to_json().decode(), "digest": digest(state), "opens": tier.opens})
    elif command == "partial":
        buf = tier.buffer(handle)
        buf.tensor[: handle.nbytes // 2].fill_(0xA5)
        _answer({"wrote": handle.nbytes // 2})
    elif command == "restore":
        state = make_state(12345)  # other weights: the restore must overwrite every byte
        train(state, 1)
        with open(argv[2]) as f:
            tier.restore(state, f.read(), handle)
        _answer({"digest": digest(state), "opens": tier.opens})
    else:
        raise SystemExit(f"unknown command {command!r}")
    sys.stdin.read()  # hold the mapping until killed (or stdin closes)


def _captured_bytes(manifest, sources) -> memoryview:
    """The bytes a capture writes, for the checksums the agent would compute."""
    out = memoryview(bytearray(max(manifest.nbytes, 1)))[: manifest.nbytes]
    cap.copy_into(manifest, sources, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
