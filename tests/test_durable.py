"""memsnap.save / memsnap.load: bitwise resume in a fresh process, fallback, metadata, refusals."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from support import states

import memsnap
from memsnap.durable import localfs, meta, storage
from memsnap.durable.storage import Store
from memsnap.errors import (
    ChecksumError,
    ConfigError,
    SnapshotNotFoundError,
    StateMismatchError,
    StorageError,
    UnsupportedStateError,
    WeightsOnlyError,
)

TESTS = Path(__file__).parent
REPO = TESTS.parent
N = 5

RESUME = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import memsnap
from support import toytrain
objs = toytrain.make(seed=999)  # a different seed: all that matters must come from the checkpoint
step = memsnap.load({ckpt!r}, objs)
losses = toytrain.train_steps(objs, {n})
memsnap.save({out!r}, {{"model": objs["model"]}}, step + {n}, weights_only=True)
print(json.dumps([x.hex() for x in losses]))
"""


SMALL: states.Shape = dict(widths=(8, 4), lr=0.1, warm=3)  # one Linear(8, 4) and its AdamW, after a step
small_state = partial(states.make_state, **SMALL)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resume_in_fresh_process_is_bitwise(tmp_path):
    sys.path.insert(0, str(TESTS))
    import support.toytrain as toytrain

    ref_objs = toytrain.make(seed=0)
    reference = toytrain.train_steps(ref_objs, 2 * N)
    objs = toytrain.make(seed=0)
    first = toytrain.train_steps(objs, N)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    memsnap.save(ckpt, objs, N, {"loss": first[-1]})
    code = RESUME.format(tests=str(TESTS), ckpt=ckpt, out=out, n=N)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    second = [float.fromhex(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]
    assert first + second == reference  # exact float equality, step by step
    model = toytrain.make(seed=5)["model"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weights-only warning is expected here
        assert memsnap.load(out, {"model": model}) == 2 * N
    for name, value in ref_objs["model"].state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_load_newest_and_explicit_step(tmp_path):
    saved = {}
    for step in (1, 2, 3):
        state = small_state(step)
        memsnap.save(str(tmp_path), state, step)
        saved[step] = params(state["model"])
    state = small_state(99)
    assert memsnap.load(str(tmp_path), state) == 3
    assert all(torch.equal(v, saved[3][k]) for k, v in state["model"].state_dict().items())
    assert memsnap.load(str(tmp_path), state, step=1) == 1
    assert all(torch.equal(v, saved[1][k]) for k, v in state["model"].state_dict().items())


def test_corrupt_newest_falls_back_with_warning(tmp_path):
    for step in (1, 2):
        memsnap.save(str(tmp_path), small_state(step), step)
    good = params(small_state(1)["model"])
    path = Store.open(str(tmp_path)).path(2, "rank_00000.bin")
    raw = bytearray(Path(path).read_bytes())
    raw[3] ^= 0x40
    Path(path).write_bytes(raw)
    state = small_state(99)
    with pytest.warns(UserWarning, match=r"step 2 .*rank_00000.bin is corrupted.*previous committed step"):
        assert memsnap.load(str(tmp_path), state) == 1
    assert all(torch.equal(v, good[k]) for k, v in state["model"].state_dict().items())
    with pytest.raises(ChecksumError, match="step_000000000002/rank_00000.bin"):
        memsnap.load(str(tmp_path), state, step=2)


def test_truncated_only_step_raises(tmp_path):
    memsnap.save(str(tmp_path), small_state(), 4)
    path = Store.open(str(tmp_path)).path(4, "rank_00000.bin")
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.warns(UserWarning, match="truncated"):
        with pytest.raises(SnapshotNotFoundError, match="no intact committed step"):
            memsnap.load(str(tmp_path), small_state())


def test_nothing_to_load(tmp_path):
    with pytest.raises(SnapshotNotFoundError, match="no committed step under"):
        memsnap.load(str(tmp_path / "empty"), small_state())


def test_weights_only_refused_then_warned(tmp_path):
    model = small_state()["model"]
    with pytest.raises(WeightsOnlyError, match="weights_only=True"):
        memsnap.save(str(tmp_path), {"model": model}, 1)
    assert Store.open(str(tmp_path)).steps() == []
    memsnap.save(str(tmp_path), {"model": model}, 1, weights_only=True)
    with pytest.warns(UserWarning, match="no optimizer state"):
        memsnap.load(str(tmp_path), {"model": torch.nn.Linear(8, 4)})


def test_weights_only_warning_from_manifest_without_flag(tmp_path):
    """Steps spilled by the runtime carry no has_optimizer flag: the manifest tree decides."""
    from memsnap.state.capture import capture

    store = Store.open(str(tmp_path))
    for step, state in ((1, small_state()), (2, {"model": small_state()["model"]})):
        manifest, buf = capture(state, checksums=True)
        store.write_rank(step, 0, manifest, buf)
        store.commit(step, 1, {"source": "spill"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # step 1 has an optimizer: no warning
        memsnap.load(str(tmp_path), small_state(5), step=1)
    with pytest.warns(UserWarning, match="no optimizer state"):
        memsnap.load(str(tmp_path), {"model": torch.nn.Linear(8, 4)}, step=2)


def git(cwd: Path, *args: str) -> str:
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.invalid",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.invalid",
    )
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_metadata_recorded(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    (work / "train.py").write_text("print('hi')\n")
    git(work, "add", "train.py")
    git(work, "commit", "-q", "-m", "x")
    monkeypatch.chdir(work)
    memsnap.save(str(tmp_path / "ckpt"), small_state(), 7, {"loss": 0.25, "config": {"lr": 0.1}})
    md = Store.open(str(tmp_path / "ckpt")).marker(7)["metadata"]
    head = git(work, "rev-parse", "HEAD")
    assert md["step"] == 7 and md["world_size"] == 1 and md["has_optimizer"] is True
    assert md["user"] == {"loss": 0.25, "config": {"lr": 0.1}}
    assert md["git"]["commit"] == head
    assert md["versions"]["torch"] == torch.__version__ and md["versions"]["memsnap"] == memsnap.__version__
    assert md["git"]["dirty"] is False and md["hostname"] and md["wall_time"] > 0
    monkeypatch.chdir(tmp_path)  # outside any repository: recorded as None
    memsnap.save(str(tmp_path / "ckpt"), small_state(), 8)
    assert Store.open(str(tmp_path / "ckpt")).marker(8)["metadata"]["git"] is None


ARGV = [
    "train.py",
    "--api-token=tok1",
    "--password",
    "pw2",
    "HF_TOKEN=hf3",
    "db.secret_key=k4",
    "--lr",
    "0.1",
    "--keep-last",
    "3",
    "--use-key",
    "--verbose",
    "data=/x",
]


def test_argv_secrets_are_redacted_in_each_form(tmp_path, monkeypatch):
    monkeypatch.delenv(meta.ARGV_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ARGV)
    memsnap.save(str(tmp_path), small_state(), 1)
    raw = open(Store.open(str(tmp_path)).path(1, "COMMITTED")).read()
    assert json.loads(raw)["metadata"]["argv"] == [
        "train.py",
        "--api-token=<redacted>",
        "--password",
        "<redacted>",
        "HF_TOKEN=<redacted>",
        "db.secret_key=<redacted>",
        "--lr",
        "0.1",
        "--keep-last",
        "3",
        "--use-key",
        "--verbose",
        "data=/x",
    ]
    assert not any(secret in raw for secret in ("tok1", "pw2", "hf3", "k4"))


@pytest.mark.parametrize("mode, recorded", [("raw", ARGV), ("off", None), ("redact", meta.redact_argv(ARGV))])
def test_argv_recording_can_be_raw_or_off(tmp_path, monkeypatch, mode, recorded):
    monkeypatch.setenv(meta.ARGV_ENV, mode)
    monkeypatch.setattr(sys, "argv", ARGV)
    memsnap.save(str(tmp_path), small_state(), 1)
    assert Store.open(str(tmp_path)).marker(1)["metadata"]["argv"] == recorded


def test_argv_recording_mode_is_checked(monkeypatch):
    monkeypatch.setenv(meta.ARGV_ENV, "plain")
    with pytest.raises(ConfigError, match="MEMSNAP_RECORD_ARGV='plain'.*redact.*raw.*off"):
        meta.record_argv(["x"])


def test_bad_metadata_and_step_rejected(tmp_path):
    with pytest.raises(ConfigError, match="JSON-serialisable"):
        memsnap.save(str(tmp_path), small_state(), 1, {"loss": torch.tensor(1.0)})
    with pytest.raises(ConfigError, match="step must be a non-negative int"):
        memsnap.save(str(tmp_path), small_state(), -1)
    memsnap.save(str(tmp_path), small_state(), 1)
    with pytest.raises(ConfigError, match="already committed"):
        memsnap.save(str(tmp_path), small_state(), 1)


def test_full_disk_during_save_keeps_previous(tmp_path, monkeypatch):
    memsnap.save(str(tmp_path), small_state(1), 1)
    good = params(small_state(1)["model"])
    real = localfs.write_all

    def full(fd, mv):
        real(fd, mv[: mv.nbytes // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(localfs, "write_all", full)
    with pytest.raises(StorageError, match="No space left on device.*previous|No space left"):
        memsnap.save(str(tmp_path), small_state(2), 2)
    monkeypatch.undo()
    assert Store.open(str(tmp_path)).steps() == [1]
    state = small_state(99)
    assert memsnap.load(str(tmp_path), state) == 1
    assert all(torch.equal(v, good[k]) for k, v in state["model"].state_dict().items())


def test_retention_through_save(tmp_path):
    for step in range(1, 8):
        memsnap.save(str(tmp_path), small_state(), step, keep_last=2, milestone_every=3, milestone=(step == 1))
    assert Store.open(str(tmp_path)).steps() == [1, 3, 6, 7]


def test_multi_rank_without_barrier_refused(tmp_path):
    with pytest.raises(ConfigError, match="barrier="):
        memsnap.save(str(tmp_path), small_state(), 1, rank=0, world_size=2)


FRESH_LOAD = """
import sys, torch
sys.path.insert(0, {tests!r})
import memsnap
from support.states import make_state
print(memsnap.load({ckpt!r}, make_state(99, **{small!r})))
"""


def test_rollback_then_crash_resumes_the_new_run(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_RESUMED", {}, raising=False)
    monkeypatch.setattr(storage, "_WARNED", set(), raising=False)
    ckpt = str(tmp_path)
    for step in (100, 200):
        memsnap.save(ckpt, small_state(step), step, keep_last=2)
    state = small_state(99)
    assert memsnap.load(ckpt, state, step=100) == 100  # a loss spike: roll back
    with pytest.warns(
        UserWarning,
        match=r"saving step 110 behind newer committed step 200 of another "
        r"lineage.*load\(step=None\) will resume this lineage; step 200 is kept",
    ):
        memsnap.save(ckpt, small_state(110), 110, keep_last=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process and lineage
        memsnap.save(ckpt, small_state(120), 120, keep_last=2)
    assert Store.open(ckpt).steps() == [100, 110, 120]
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_LOAD.format(tests=str(TESTS), ckpt=ckpt, small=SMALL)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "120"


def test_rollback_with_keep_last_1_keeps_the_new_save(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_RESUMED", {}, raising=False)
    for step in (100, 200):
        memsnap.save(str(tmp_path), small_state(step), step)
    memsnap.load(str(tmp_path), small_state(99), step=100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memsnap.save(str(tmp_path), small_state(110), 110, keep_last=1)
    assert Store.open(str(tmp_path)).steps() == [100, 110]
    state = small_state(99)
    assert memsnap.load(str(tmp_path), state) == 110
    assert all(torch.equal(v, params(small_state(110)["model"])[k]) for k, v in state["model"].state_dict().items())


def test_rollback_can_save_a_step_number_of_the_abandoned_run(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_RESUMED", {}, raising=False)
    for step in (100, 200):
        memsnap.save(str(tmp_path), small_state(step), step)
    memsnap.load(str(tmp_path), small_state(99), step=100)
    memsnap.save(str(tmp_path), small_state(7), 200)  # the same number, a different run
    state = small_state(99)
    assert memsnap.load(str(tmp_path), state) == 200
    assert all(torch.equal(v, params(small_state(7)["model"])[k]) for k, v in state["model"].state_dict().items())
    assert Store.open(str(tmp_path)).marker(200)["lineage"]["parent"] == 100
    with pytest.raises(ConfigError, match="step 200 is already committed.*continues from it"):
        memsnap.save(str(tmp_path), small_state(8), 200)  # but never over its own step


def test_damaged_newest_step_can_be_saved_again(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_RESUMED", {}, raising=False)
    for step in (1, 2):
        memsnap.save(str(tmp_path), small_state(step), step)
    path = Path(Store.open(str(tmp_path)).path(2, "rank_00000.bin"))
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x40
    path.write_bytes(raw)
    with pytest.warns(UserWarning, match="step 2 .*corrupted"):
        assert memsnap.load(str(tmp_path), small_state(99)) == 1
    memsnap.save(str(tmp_path), small_state(22), 2)
    state = small_state(99)
    assert memsnap.load(str(tmp_path), state) == 2
    assert all(torch.equal(v, params(small_state(22)["model"])[k]) for k, v in state["model"].state_dict().items())


def test_step_with_unreadable_marker_can_be_saved_again(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_RESUMED", {}, raising=False)
    memsnap.save(str(tmp_path), small_state(1), 1)
    Path(Store.open(str(tmp_path)).path(1, "COMMITTED")).write_text('{"format": "mem')
    monkeypatch.setattr(storage, "_RESUMED", {}, raising=False)  # a new process
    memsnap.save(str(tmp_path), small_state(11), 1)
    assert memsnap.load(str(tmp_path), small_state(99)) == 1


# --- tensor names, meta-device models, what a save refuses -------------------------------------------
def tricky_state(seed: int) -> dict:
    """A state whose keys join alike as text: "a/b" beside a -> b, 0 beside "0"."""
    state = small_state(seed)
    g = torch.Generator().manual_seed(seed)
    state["extra"] = {
        "a/b": torch.randn(3, generator=g),
        "a": {"b": torch.randn(3, generator=g)},
        0: torch.randn(3, generator=g),
        "0": torch.randn(3, generator=g),
    }
    return state


def tricky_tensors(state: dict) -> list[torch.Tensor]:
    x = state["extra"]
    return [x["a/b"], x["a"]["b"], x[0], x["0"]]


def assert_loaded(saved: dict, live: dict, held: list[torch.Tensor]) -> None:
    got = tricky_tensors(live)
    assert all(a is b for a, b in zip(got, held)), "each tensor is restored in place, into its own object"
    assert all(torch.equal(a, b) for a, b in zip(got, tricky_tensors(saved)))
    want = params(saved["model"])
    assert all(torch.equal(t, want[k]) for k, t in params(live["model"]).items())


def save_two_ranks(root: str, state: dict, step: int) -> None:
    for rank in (1, 0):  # rank 0 commits once rank 1's files exist
        memsnap.save(root, state, step, rank=rank, world_size=2, barrier=lambda: None)


def test_keys_that_join_alike_load_back_into_their_own_tensors(tmp_path):
    saved = tricky_state(0)
    memsnap.save(str(tmp_path), saved, 1)
    live = tricky_state(1)
    held = tricky_tensors(live)
    assert memsnap.load(str(tmp_path), live) == 1
    assert_loaded(saved, live, held)


def test_keys_that_join_alike_survive_a_load_by_another_world_size(tmp_path):
    saved = tricky_state(0)
    save_two_ranks(str(tmp_path), saved, 1)
    live = tricky_state(1)
    held = tricky_tensors(live)
    assert memsnap.load(str(tmp_path), live) == 1  # 2 saved ranks -> 1: through reshard
    assert_loaded(saved, live, held)


OLD_NAMES = {"extra/a%2Fb": "extra/a/b", "extra/a/b": "extra/a/b#1", "extra/%30": "extra/0#1"}


def test_checkpoints_with_the_older_text_names_still_load_by_position(tmp_path):
    """An older memsnap joined keys as text and numbered repeats ("extra/a/b#1"); the tensors of
    such a step are still matched by their position in the skeleton, at any world size."""
    from support.forge import forge_manifest

    saved = tricky_state(0)
    save_two_ranks(str(tmp_path), saved, 1)
    store = Store.open(str(tmp_path))
    for rank in (0, 1):
        with open(store.path(1, storage.rank_name(rank, "json"))) as f:
            doc = json.load(f)
        for e in doc["tensors"]:
            e["path"] = OLD_NAMES.get(e["path"], e["path"])
        assert [e["path"] for e in doc["tensors"] if e["path"].startswith("extra/")] == [
            "extra/a/b",
            "extra/a/b#1",
            "extra/0",
            "extra/0#1",
        ]
        forge_manifest(str(tmp_path), 1, rank, doc)
    for world in (1, 2):
        live = tricky_state(1)
        held = tricky_tensors(live)
        assert memsnap.load(str(tmp_path), live, rank=0, world_size=world) == 1
        assert_loaded(saved, live, held)


def test_loading_into_a_model_on_the_meta_device_is_refused_naming_the_fix(tmp_path):
    memsnap.save(str(tmp_path), small_state(0), 1)
    memsnap.save(str(tmp_path), small_state(0), 2)
    with torch.device("meta"):
        model = torch.nn.Linear(8, 4)
    live = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.1)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to step 1: no older step would fare better
        with pytest.raises(StateMismatchError, match=r"'model/weight' is on the meta device.*to_empty"):
            memsnap.load(str(tmp_path), live)
    model.to_empty(device="cpu")
    assert memsnap.load(str(tmp_path), live) == 2
    want = params(small_state(0)["model"])
    assert all(torch.equal(t, want[k]) for k, t in params(model).items())


@pytest.mark.parametrize(
    "value",
    [torch.eye(2).to_sparse(), torch.empty(2, device="meta"), 10**5000, bytearray(b"x")],
    ids=["sparse", "meta", "bigint", "bytearray"],
)
def test_a_save_of_what_cannot_come_back_exactly_is_refused_in_one_line(tmp_path, value):
    state = dict(small_state(), extra={"v": value})
    with pytest.raises(UnsupportedStateError, match=r"at 'extra/v'") as err:
        memsnap.save(str(tmp_path), state, 1)
    assert "\n" not in str(err.value) and Store.open(str(tmp_path)).steps() == []
