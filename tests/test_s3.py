"""The durable format against a real S3-compatible server (moto, loopback) through pyarrow.fs."""

from __future__ import annotations

import boto3
import pytest
from support.s3server import moto_s3
from support.snapshots import make_snapshot, save_step

from memsnap.durable.storage import Retention, Store
from memsnap.errors import ChecksumError

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def endpoint():
    with moto_s3("ckpt") as ep:
        yield ep


def test_roundtrip_with_explicit_endpoint(endpoint):
    store = Store.open("s3://ckpt/run-a", endpoint=endpoint)
    bufs = save_step(store, 3, world=2)
    m, buf = make_snapshot(0)
    store.write_rank(4, 0, m, buf)  # no marker: invisible
    assert store.steps() == [3]
    for rank in range(2):
        out = bytearray(store.manifest(3, rank).nbytes)
        store.read_rank_into(3, rank, out)
        assert out == bufs[rank]


def test_endpoint_from_environment(endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = Store.open("s3://ckpt/run-b")
    save_step(store, 1)
    assert Store.open("s3://ckpt/run-b").steps() == [1]


def test_corrupted_object_named(endpoint):
    store = Store.open("s3://ckpt/run-c", endpoint=endpoint)
    save_step(store, 2)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    key = "run-c/step_000000000002/rank_00000.bin"
    raw = bytearray(s3.get_object(Bucket="ckpt", Key=key)["Body"].read())
    raw[5] ^= 1
    s3.put_object(Bucket="ckpt", Key=key, Body=bytes(raw))
    with pytest.raises(ChecksumError, match="rank_00000.bin is corrupted"):
        store.read_rank_into(2, 0, bytearray(store.manifest(2, 0).nbytes))


def test_retention_on_object_store(endpoint):
    store = Store.open("s3://ckpt/run-d", endpoint=endpoint)
    for step in range(1, 5):
        save_step(store, step)
    assert store.retain(Retention(keep_last=2)) == [1, 2]
    assert store.steps() == [3, 4]


def test_save_load_through_s3_uri(endpoint, monkeypatch):
    import warnings

    import torch

    import memsnap

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)

    def state(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(16, 8)
        return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}

    saved = state(1)
    memsnap.save("s3://ckpt/run-e", saved, 11, {"loss": 0.5}, keep_last=1)
    memsnap.save("s3://ckpt/run-e", state(2), 12, keep_last=1)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.delete_object(Bucket="ckpt", Key="run-e/step_000000000012/rank_00000.bin")  # lost object
    live = state(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match="no intact committed step"):
            memsnap.load("s3://ckpt/run-e", live)  # retention removed step 11 after 12 committed
    assert any("step 12" in str(w.message) and "missing" in str(w.message) for w in caught)
    memsnap.save("s3://ckpt/run-e", saved, 13)
    assert memsnap.load("s3://ckpt/run-e", live) == 13
    assert torch.equal(live["model"].weight, saved["model"].weight)


def test_cli_on_s3(endpoint, capsys):
    from memsnap.cli import main

    store = Store.open("s3://ckpt/run-f", endpoint=endpoint)
    save_step(store, 8, world=2)
    assert main(["ls", "s3://ckpt/run-f", "--endpoint", endpoint]) == 0
    assert main(["verify", "s3://ckpt/run-f/8", "--endpoint", endpoint]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[:3] == ["8", "?", "2"] and "step 8: OK (2 ranks" in out
