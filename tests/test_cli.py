"""The ``memsnap`` CLI over a real checkpoint: ls, inspect, verify, export, average."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import memsnap
from memsnap.cli import main
from memsnap.durable.storage import Store


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("cli") / "ckpt")
    models = {}
    for step in (10, 20, 30):
        s = state(step)
        memsnap.save(root, s, step, {"loss": step / 100})
        models[step] = {k: v.clone() for k, v in s["model"].state_dict().items()}
    return root, models


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_ls(capsys, ckpt):
    rc, out, _ = cli(capsys, "ls", ckpt[0])
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:3] == ["STEP", "SAVED", "(UTC)"]
    assert [line.split()[0] for line in lines[2:]] == ["10", "20", "30"]
    assert "0.3" in lines[-1]


def test_inspect_newest_and_given_step(capsys, ckpt):
    rc, out, _ = cli(capsys, "inspect", ckpt[0])
    assert rc == 0 and out.startswith("step 30 of")
    assert re.search(r"model/0\.weight\s+float32\s+\[5, 6\]\s+120 B", out) and "user.loss" in out
    assert re.search(r"model/1\.num_batches_tracked\s+int64\s+\[\]", out)
    rc, out, _ = cli(capsys, "inspect", ckpt[0] + "/step_000000000010")
    assert rc == 0 and out.startswith("step 10 of") and "0.1" in out


def test_inspect_missing_step(capsys, ckpt):
    rc, _, err = cli(capsys, "inspect", ckpt[0] + "/15")
    assert rc == 1 and "step 15 is not committed" in err and "[10, 20, 30]" in err


def test_export_safetensors(capsys, ckpt, tmp_path):
    out_file = str(tmp_path / "w.safetensors")
    rc, out, _ = cli(capsys, "export", ckpt[0] + "/20", "--safetensors", out_file)
    assert rc == 0 and "step 20" in out
    got = load_file(out_file)
    assert set(got) == set(ckpt[1][20])
    assert all(torch.equal(got[k], v) for k, v in ckpt[1][20].items())


def test_export_unknown_key(capsys, ckpt, tmp_path):
    rc, _, err = cli(capsys, "export", ckpt[0], "--safetensors", str(tmp_path / "x"), "--key", "nope")
    assert rc == 1 and "--key" in err and "'model'" in err


def test_average_last_two(capsys, ckpt, tmp_path):
    out_file = str(tmp_path / "avg.safetensors")
    rc, out, _ = cli(capsys, "average", ckpt[0], "--last", "2", out_file)
    assert rc == 0 and "[20, 30]" in out
    got, a, b = load_file(out_file), ckpt[1][20], ckpt[1][30]
    w = "0.weight"
    assert torch.equal(got[w], ((a[w].double() + b[w].double()) / 2).float())
    assert torch.equal(got["1.num_batches_tracked"], b["1.num_batches_tracked"])
    rc, _, err = cli(capsys, "average", ckpt[0], "--last", "9", out_file)
    assert rc == 1 and "only 3 committed steps" in err


def test_verify_ok_then_damaged(capsys, ckpt, tmp_path):
    rc, out, _ = cli(capsys, "verify", ckpt[0], "--all")
    assert rc == 0 and out.count(": OK") == 3
    root = str(tmp_path / "ck")
    memsnap.save(root, state(1), 1)
    path = Path(Store.open(root).path(1, "rank_00000.bin"))
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 1
    path.write_bytes(raw)
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 2 and "step 1: DAMAGED" in out and "rank_00000.bin is corrupted" in out
    rc, out, _ = cli(capsys, "verify", root, "--all")
    assert rc == 2 and "step 1: DAMAGED" in out


# --- exit codes: 0 intact, 1 an error (one line), 2 a damaged or malformed checkpoint -------------
def malformed_marker_root(tmp_path) -> str:
    """A root with an intact step 1 and a step 2 whose COMMITTED is not a valid marker."""
    root = str(tmp_path / "mal")
    memsnap.save(root, state(1), 1)
    memsnap.save(root, state(2), 2)
    Path(Store.open(root).path(2, "COMMITTED")).write_text('{"format": "memsnap", "version": 1}')
    return root


def test_a_malformed_step_exits_2_from_ls_verify_and_inspect(capsys, tmp_path):
    root = malformed_marker_root(tmp_path)
    rc, out, err = cli(capsys, "ls", root)
    assert rc == 2 and re.search(r"^2\s+DAMAGED", out, re.M) and "damaged checkpoint" in err
    rc, out, _ = cli(capsys, "verify", root, "--all")
    assert rc == 2 and "step 1: OK" in out and "step 2: DAMAGED" in out
    rc, out, _ = cli(capsys, "verify", root + "/1")
    assert rc == 0 and "step 1: OK" in out
    rc, _, err = cli(capsys, "inspect", root + "/2")
    assert rc == 2 and err.startswith("memsnap inspect: damaged checkpoint:") and len(err.splitlines()) == 1


def test_other_errors_exit_1_and_bad_arguments_exit_2(capsys, ckpt, tmp_path):
    rc, _, err = cli(capsys, "verify", str(tmp_path / "nothing-here"))
    assert rc == 1 and "no committed step under" in err and len(err.splitlines()) == 1
    rc, _, err = cli(capsys, "verify", ckpt[0], "--all", "--step", "10")
    assert rc == 1 and "--all and --step 10" in err
    with pytest.raises(SystemExit) as info:
        main(["inspect"])
    assert info.value.code == 2


# --- strings from the checkpoint never reach the terminal raw --------------------------------------
HOSTILE = "\x1b[2J\x1b]52;c;SGk=\x07\u202eevil\x9b\x7f\n"


def test_ls_and_inspect_escape_control_characters_from_the_checkpoint(capsys, tmp_path):
    root = str(tmp_path / "hostile")
    memsnap.save(
        root,
        {"model": {"w" + HOSTILE: torch.ones(2), "größe": torch.zeros(1)}},
        1,
        {"note": HOSTILE, "k" + HOSTILE: 1, "plain": "größe ✓"},
        weights_only=True,
    )
    marker_path = Path(Store.open(root).path(1, "COMMITTED"))
    marker = json.loads(marker_path.read_text())
    marker["metadata"].update(time_utc=HOSTILE, git={"commit": HOSTILE})
    marker_path.write_text(json.dumps(marker))
    escaped = "\\x1b[2J\\x1b]52;c;SGk=\\x07\\u202eevil\\x9b\\x7f\\n"
    for argv in (["ls", root], ["inspect", root]):
        rc, out, err = cli(capsys, *argv)
        assert rc == 0, err
        assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", out + err)
        assert escaped in out  # time_utc, in both
    assert re.search(r"^user\.note\s+" + re.escape(escaped), out, re.M) and f"user.k{escaped}" in out
    assert f"model/w{escaped}" in out and "model/größe" in out and "größe ✓" in out


def test_console_entry_point(ckpt):
    proc = subprocess.run(
        [sys.executable, "-m", "memsnap.cli", "ls", ckpt[0]], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "30" in proc.stdout.splitlines()[-1]


def test_location_parsing():
    from memsnap.commands._common import split_location

    assert split_location("s3://b/run/step_000000000012") == ("s3://b/run", 12)
    assert split_location("/ck/7/") == ("/ck", 7)
    assert split_location("/ck/run") == ("/ck/run", None)
    assert split_location("/ck/7\n") == ("/ck/7\n", None)  # the whole last component, or no step


def test_a_root_named_like_a_step_is_a_root(capsys, tmp_path):
    data = str(tmp_path / "data")
    memsnap.save(data, state(1), 2024, {"loss": 0.5})
    memsnap.save(data + "/2024", state(2), 5, {"loss": 0.25})  # a checkpoint root named 2024 inside it
    rc, out, err = cli(capsys, "inspect", data + "/2024")
    assert rc == 0 and out.startswith(f"step 5 of {data}/2024 "), err
    rc, out, _ = cli(capsys, "inspect", data + "/step_000000002024")
    assert rc == 0 and out.startswith(f"step 2024 of {data} ")
    rc, out, _ = cli(capsys, "inspect", data, "--step", "2024")
    assert rc == 0 and out.startswith(f"step 2024 of {data} ")
    rc, out, _ = cli(capsys, "verify", data + "/2024", "--all")
    assert rc == 0 and out.splitlines() == [out.splitlines()[0]] and out.startswith("step 5: OK")
    rc, out, _ = cli(capsys, "inspect", data + "/2024/5")
    assert rc == 0 and out.startswith(f"step 5 of {data}/2024 ")
