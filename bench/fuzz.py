"""Coverage-guided fuzzing of memsnap's parsers: any exception other than a memsnap error fails.

Targets (``--target``):
    manifest   rank-manifest JSON -> Manifest.from_json -> apply into a live Llama-like state
    skeleton   skeleton JSON -> validate.skeleton -> tree.decode
    marker     COMMITTED JSON -> validate.marker -> the ``memsnap ls`` row
    store      COMMITTED JSON written into a saved step -> every rank read as all readers read it
               (``Store.read_rank``: sizes, caps, checksums) -> the weights gathered as ``export`` does
    tiling     bytes -> saved shard boxes of one tensor -> ``reshard.sources`` for the whole tensor,
               which must accept exactly the exact tilings (checked by counting every element)
    header     24 bytes -> validate.wire_header (request and response layouts)
    all        each of the above for ``--seconds``, one child process each (the default)

Seeds are real documents: a small Llama-like model after one AdamW step, captured and saved.
With atheris installed, libFuzzer drives the run (memsnap's modules instrumented); without
it, a random byte- and JSON-level mutator runs the same checks for the same time.

    python bench/fuzz.py [--target all] [--seconds 60] [--corpus DIR]

Exit code 0: nothing but memsnap errors; 1: a crash (the input is written as crash-*).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, cast

import torch

try:
    import atheris
except ImportError:  # the random fallback below
    atheris = None

if TYPE_CHECKING:  # bound at run time by _import_memsnap (instrumented when atheris drives the run)
    from memsnap.commands.export import weights as export_weights
    from memsnap.commands.ls import _row as ls_row
    from memsnap.durable.checkpoint import save
    from memsnap.durable.storage import Store
    from memsnap.errors import MemsnapError
    from memsnap.state import reshard, tree, validate
    from memsnap.state.apply import apply
    from memsnap.state.capture import capture
    from memsnap.state.manifest import Manifest, TensorEntry
    from memsnap.transport import wire

TARGETS = ("manifest", "skeleton", "marker", "store", "tiling", "header")
MAX_PAYLOAD = 1 << 40  # a sanity bound on a header's payload length


def _import_memsnap():
    """Import memsnap's parsers, instrumented for coverage when atheris drives the run."""
    global MemsnapError, validate, tree, Manifest, TensorEntry, apply, capture, save, ls_row, wire
    global Store, reshard, export_weights
    if atheris is not None:
        ctx = atheris.instrument_imports(include=["memsnap"])
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx:
        from memsnap.commands.export import weights as export_weights
        from memsnap.commands.ls import _row as ls_row
        from memsnap.durable.checkpoint import save
        from memsnap.durable.storage import Store
        from memsnap.errors import MemsnapError
        from memsnap.state import reshard, tree, validate
        from memsnap.state.apply import apply
        from memsnap.state.capture import capture
        from memsnap.state.manifest import Manifest, TensorEntry
        from memsnap.transport import wire


def llama_state(blocks: int = 2, d: int = 8, vocab: int = 16) -> dict:
    """A small Llama-like model (attention, gated MLP, RMSNorms, tied head) after one AdamW step."""
    torch.manual_seed(0)
    lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
    layers = [
        torch.nn.ModuleDict(
            {
                "attn_norm": torch.nn.RMSNorm(d),
                "q": lin(d, d),
                "k": lin(d, d),
                "v": lin(d, d),
                "o": lin(d, d),
                "mlp_norm": torch.nn.RMSNorm(d),
                "gate": lin(d, 2 * d),
                "up": lin(d, 2 * d),
                "down": lin(2 * d, d),
            }
        )
        for _ in range(blocks)
    ]
    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(vocab, d),
            "blocks": torch.nn.ModuleList(layers),
            "norm": torch.nn.RMSNorm(d),
            "head": lin(d, vocab),
        }
    )
    model["head"].weight = model["embed"].weight
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = cast(torch.Tensor, sum(p.sum() for p in model.parameters()))
    loss.backward()
    optim.step()
    return {"model": model, "optim": optim, "cfg": {"lr": 1e-3, "betas": (0.9, 0.95)}}


class Harness:
    """The real documents the seeds come from, and one check per target."""

    def __init__(self):
        self.state = llama_state()
        self.manifest, buf = capture(self.state, checksums=True)
        self.buf = bytes(buf)
        root = tempfile.mkdtemp(prefix="memsnap-fuzz-")
        save(root, self.state, 7)
        self.store = Store.open(root)
        with open(self.store.path(7, "COMMITTED"), "rb") as f:
            self.marker = f.read()

    def seeds(self, target: str) -> list[bytes]:
        if target == "manifest":
            return [self.manifest.to_json()]
        if target == "skeleton":
            return [json.dumps(self.manifest.tree).encode()]
        if target in ("marker", "store"):
            return [self.marker]
        if target == "tiling":  # 1-d of 8 in two halves (exact); 2-d 4x4 in overlapping quarters
            return [bytes([1, 8, 0, 4, 4, 4]), bytes([2, 4, 4, 0, 0, 2, 2, 1, 1, 2, 2, 2, 2, 2, 2])]
        return [
            b"\0" + wire.REQUEST.pack(wire.PUSH, 40, 1 << 20, 12345, 1),
            b"\xff" + wire.RESPONSE.pack(wire.OK, 0, 64, 1, 1),
        ]

    def check(self, target: str, data: bytes) -> None:
        """Run one input; memsnap errors are the expected way to refuse it."""
        try:
            getattr(self, "_" + target)(data)
        except MemsnapError:
            pass

    def _manifest(self, data: bytes) -> None:
        apply(self.state, Manifest.from_json(data), self.buf, verify=False)

    def _skeleton(self, data: bytes) -> None:
        skel = validate.parse_json(data, "skeleton")
        validate.skeleton(skel, len(self.manifest.tensors))
        tree.decode(skel, lambda i, path: torch.zeros(1))

    def _marker(self, data: bytes) -> None:
        ls_row(7, validate.marker(validate.parse_json(data, "COMMITTED"), 7))

    def _store(self, data: bytes) -> None:
        with open(self.store.path(7, "COMMITTED"), "wb") as f:
            f.write(data)
        marker = self.store.marker(7)
        for rank in range(marker["world_size"]):
            self.store.read_rank(7, rank, marker=marker)
        export_weights(self.store, 7, marker, None)

    def _tiling(self, data: bytes) -> None:
        if len(data) < 2:
            return
        ndim = 1 + data[0] % 2
        whole = tuple(1 + b % 8 for b in data[1 : 1 + ndim])
        boxes, rest = [], data[1 + ndim :]
        for at in range(0, len(rest) - 2 * ndim + 1, 2 * ndim):
            lo = tuple(rest[at + d] % (n + 1) for d, n in enumerate(whole))
            boxes.append((lo, tuple(rest[at + ndim + d] % (n - o + 1) for d, (o, n) in enumerate(zip(lo, whole)))))
        if not boxes or len(whole) != ndim:
            return
        saved = [
            Manifest(
                [
                    TensorEntry(
                        "w",
                        "float32",
                        shape,
                        0,
                        4 * validate.numel(shape),
                        global_shape=whole,
                        global_offset=lo,
                        placements=("Shard(0)",),
                        mesh_shape=(len(boxes),),
                    )
                ],
                {"w": {"__tensor__": 0}},
                0,
            )
            for lo, shape in boxes
        ]
        live = TensorEntry(
            "w",
            "float32",
            whole,
            0,
            4 * validate.numel(whole),
            global_shape=whole,
            global_offset=(0,) * ndim,
            placements=("Shard(0)",),
            mesh_shape=(1,),
        )
        count = torch.zeros(whole, dtype=torch.int64)
        for lo, shape in set(boxes):
            count[tuple(slice(o, o + n) for o, n in zip(lo, shape))] += 1
        exact = bool((count == 1).all())
        try:
            reshard.sources(live, saved)
        except MemsnapError:
            if exact:
                raise AssertionError(f"an exact tiling {boxes} of {whole} was refused") from None
            raise
        if not exact:
            raise AssertionError(f"boxes {boxes} do not tile {whole} but were accepted")

    def _header(self, data: bytes) -> None:
        layout, kinds, what = (
            (wire.REQUEST, (wire.PUSH, wire.FETCH), "request")
            if data[:1] != b"\xff"
            else (wire.RESPONSE, (wire.OK, wire.MISSING, wire.FAILED), "response")
        )
        validate.wire_header(data[1:], layout, kinds, MAX_PAYLOAD, what)


# --- drivers ------------------------------------------------------------------------------------
def run_atheris(target: str, seconds: int, corpus: str) -> None:
    """libFuzzer on one target; never returns (exits 0, or non-zero on a crash)."""
    h = Harness()
    os.makedirs(corpus, exist_ok=True)
    for i, seed in enumerate(h.seeds(target)):
        with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
            f.write(seed)
    max_len = 2 * max(len(x) for x in h.seeds(target))
    extra = {} if target in ("header", "tiling") else {"custom_mutator": _json_mutator}
    atheris.Setup(
        [
            sys.argv[0],
            f"-max_total_time={seconds}",
            f"-max_len={max_len}",
            "-print_final_stats=1",
            f"-artifact_prefix={target}-",
            corpus,
        ],
        lambda data: h.check(target, data),
        **extra,
    )
    atheris.Fuzz()


def _json_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    """Half the time a JSON-aware change (a value replaced by a nasty one), else libFuzzer's own."""
    rng = random.Random(seed)
    if rng.random() < 0.5:
        try:
            out = _mutate(rng, data, list(_locations(json.loads(data))), json_only=True)
            if len(out) <= max_size:
                return out
        except (ValueError, RecursionError):
            pass
    return atheris.Mutate(data, max_size)


NASTY: list[object] = [
    None,
    True,
    -1,
    -4096,
    0,
    63,
    2**63,
    2**64,
    1.5,
    "",
    "x" * 300,
    [],
    {},
    [[[]]],
    {"__tensor__": -1},
    {"__tuple__": 1},
    {"__dict__": [[[], 0]]},
    {"__ndarray__": ["O", [1], ""]},
]


def _locations(doc, path=()):
    yield path
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield from _locations(v, path + (k,))


def _mutate(rng: random.Random, seed: bytes, locations: list, json_only: bool = False) -> bytes:
    """A byte-level change (flip, insert, delete), or one JSON value replaced by a nasty one."""
    if locations and (json_only or rng.random() < 0.6):
        doc = json.loads(seed)
        path = rng.choice(locations[1:] or locations)
        if not path:
            return json.dumps(rng.choice(NASTY)).encode()
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = rng.choice(NASTY + [rng.randint(-(2**70), 2**70)])
        return json.dumps(doc).encode()
    data = bytearray(seed)
    at = rng.randrange(len(data) + 1)
    op = rng.randrange(3)
    if op == 0 and at < len(data):
        data[at] ^= 1 << rng.randrange(8)
    elif op == 1:
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    else:
        del data[at : at + rng.randint(1, 8)]
    return bytes(data)


def run_random(target: str, seconds: int, seed: int = 0) -> int:
    """The fallback without atheris: random mutations of the seeds for ``seconds``."""
    h, rng = Harness(), random.Random(seed)
    seeds = h.seeds(target)
    locations = {s: (list(_locations(json.loads(s))) if target not in ("header", "tiling") else []) for s in seeds}
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        base = rng.choice(seeds)
        data = _mutate(rng, base, locations[base])
        try:
            h.check(target, data)
        except Exception:
            name = f"{target}-crash-{n}"
            with open(name, "wb") as f:
                f.write(data)
            import traceback

            traceback.print_exc()
            print(f"#{n} CRASH (random mutator): input written to {name}", file=sys.stderr)
            return 1
        n += 1
    print(f"#{n} DONE random mutator (no coverage feedback), {n / seconds:.0f} exec/s", file=sys.stderr)
    return 0


_DONE = re.compile(r"#(\d+)\s+DONE\s+(?:cov: (\d+) ft: (\d+))?")


def run_all(seconds: int, corpus_root: str) -> int:
    """Each target in a child process; print one summary line per target."""
    worst = 0
    for target in TARGETS:
        cmd = [
            sys.executable,
            __file__,
            "--target",
            target,
            "--seconds",
            str(seconds),
            "--corpus",
            os.path.join(corpus_root, target),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        m = _DONE.search(proc.stderr)
        execs, cov, ft = (m.group(1), m.group(2) or "-", m.group(3) or "-") if m else ("?", "?", "?")
        status = "ok" if proc.returncode == 0 else f"CRASH (exit {proc.returncode})"
        print(f"{target:9s} {seconds:4d} s  execs {execs:>9s}  cov {cov:>5s}  ft {ft:>6s}  {status}", flush=True)
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
            worst = 1
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=TARGETS + ("all",), default="all")
    ap.add_argument("--seconds", type=int, default=60, help="fuzzing time per target")
    ap.add_argument("--corpus", default=None, help="corpus directory (default: a fresh temporary one)")
    args = ap.parse_args()
    corpus = args.corpus or tempfile.mkdtemp(prefix="memsnap-corpus-")
    if args.target == "all":
        return run_all(args.seconds, corpus)
    _import_memsnap()
    if atheris is None:
        return run_random(args.target, args.seconds)
    run_atheris(args.target, args.seconds, corpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
