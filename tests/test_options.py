"""Every option group refuses a bad value when made, naming it and the fix; SnapshotConfig
shares the same checks and takes its fields by name."""

import re
from typing import Any

import pytest

from memsnap.config import SnapshotConfig
from memsnap.errors import ConfigError
from memsnap.options import GROUPS, SHORTHAND, Device, Failures, Memory, Protection, Spill, When, Wire, resolve

BAD: list[tuple[type, dict[str, Any], str]] = [
    (Protection, {"k": -1}, "k=-1: must be an int >= 1 (data shards per stripe; k=1 replicates)"),
    (Protection, {"k": 2.0}, "k=2.0: must be an int >= 1"),
    (Protection, {"m": "x"}, "m='x': must be an int >= 0 (parity shards per stripe)"),
    (Protection, {"m": True}, "m=True: must be an int >= 0"),
    (Protection, {"k": 2, "m": 1, "group_size": 3}, "group_size=3: needs at least k+m+1=4 nodes"),
    (Protection, {"peers": "yes"}, "peers='yes': must be None (decided from the job's node count), True"),
    (Protection, {"local_copy": "no"}, "local_copy='no': must be True (keep each node's own copy) or False"),
    (
        Protection,
        {"peers": False, "local_copy": False},
        "peers=False with local_copy=False would hold no snapshot in RAM at all; keep local_copy=True",
    ),
    (Memory, {"budget": 0}, "memory_budget=0: must be an int >= 1 (bytes of RAM per node agent, e.g. 8 << 30)"),
    (Memory, {"budget": 1.5e9}, "memory_budget=1500000000.0: must be an int >= 1"),
    (Memory, {"keep": 0}, "keep=0: must be an int >= 1 (committed versions held in RAM)"),
    (Spill, {"uri": 5}, "spill=5: give the durable tier as a str"),
    (Spill, {"uri": ""}, "spill='': give the durable tier as a str"),
    (Spill, {"uri": "/x", "every": 0}, "spill_every=0: must be an int >= 1 (spill every N-th committed step), or None"),
    (Spill, {"uri": "/x", "every_seconds": -3}, "spill_every_seconds=-3: must be a finite number of seconds > 0"),
    (Spill, {"uri": "/x", "every_seconds": float("nan")}, "spill_every_seconds=nan: must be a finite number"),
    (Spill, {"uri": "/x", "bytes_per_s": -1}, "spill_bytes_per_s=-1: must be an int >= 1"),
    (Spill, {"every": 5}, "spill_every/spill_every_seconds are set but spill=None: pass spill=URI"),
    (When, {"every_steps": 0}, "every_steps=0 is not a positive integer; snapshot every N >= 1 steps"),
    (When, {"every_seconds": -1.0}, "every_seconds=-1.0 is not a finite number > 0"),
    (When, {"auto": "yes"}, "auto='yes' must be True or False"),
    (When, {"auto": True, "every_seconds": 5.0}, "every_seconds=5.0 conflicts with it; drop one of the two"),
    (
        When,
        {"every_steps": None},
        "when=When(every_steps=None, every_seconds=None, auto=False) never snapshots: "
        "give every_steps, every_seconds, or auto=True",
    ),
    (When, {"auto": True, "mtbf_hours": 0}, "mtbf_hours=0 is not a finite number > 0; give one node's mean time"),
    (Failures, {"on_error": "loud"}, "on_error='loud': use 'warn' (log, count and keep training) or 'raise'"),
    (
        Failures,
        {"max_staleness_steps": 0},
        "max_staleness_steps=0: must be an int >= 1 (steps training may run "
        "past the newest committed snapshot), or None",
    ),
    (Failures, {"preemption": "on"}, "preemption='on': must be True or False (react to SIGTERM"),
    (Failures, {"preemption_grace_s": 0}, "preemption_grace_s=0: must be a finite number of seconds > 0"),
    (Wire, {"transport": "udp"}, "transport='udp': use one of ('tcp', 'objstore')"),
    (Wire, {"chunk": 100}, "chunk=100: must be a positive multiple of 64 bytes (or None)"),
    (Wire, {"mode": "plain"}, "wire_mode='plain': use 'mac' (every frame authenticated) or 'encrypt'"),
    (
        Device,
        {"buffer": -1},
        "device_buffer=-1: use False (off), True (sized to each rank's snapshot) or a positive number of bytes",
    ),
    (Device, {"backend": "rocm"}, "device_backend='rocm': use 'auto', 'cuda' or 'cpu'"),
]


@pytest.mark.parametrize("group, kwargs, says", BAD, ids=[f"{g.__name__}-{'-'.join(k)}" for g, k, _ in BAD])
def test_a_group_made_with_a_bad_value_names_it_and_the_fix(group, kwargs, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        group(**kwargs)


def test_every_group_has_a_bad_value_tested():
    assert {group for group, _, _ in BAD} == set(GROUPS.values())


def _as_keywords(group, kwargs):
    """The same bad value through Snapshotter's keywords: (groups, flat) for ``resolve``."""
    short = {(GROUPS[g], name): key for key, (g, name) in SHORTHAND.items()}
    groups = {"spill": kwargs["uri"]} if "uri" in kwargs else {}  # spill="..." is Spill(uri=...)
    return groups, {short[group, name]: value for name, value in kwargs.items() if name != "uri"}


AS_KEYWORDS = [b for b in BAD if isinstance(b[1].get("uri", ""), str)]


@pytest.mark.parametrize(
    "group, kwargs, says", AS_KEYWORDS, ids=[f"{g.__name__}-{'-'.join(k)}" for g, k, _ in AS_KEYWORDS]
)
def test_the_same_bad_value_as_shorthand_keywords_says_the_same(group, kwargs, says):
    groups, flat = _as_keywords(group, kwargs)
    with pytest.raises(ConfigError, match=re.escape(says)):
        resolve(groups, flat)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"k": -1}, "k=-1: must be an int >= 1"),
        ({"memory_budget": 0}, "memory_budget=0: must be an int >= 1"),
        ({"spill": "/x", "spill_every_seconds": float("inf")}, "spill_every_seconds=inf"),
        ({"wire": "plain"}, "wire_mode='plain'"),
        ({"device_buffer": 0}, "device_buffer=0"),
        ({"device_backend": "rocm"}, "device_backend='rocm'"),
    ],
)
def test_snapshot_config_runs_the_same_checks(kwargs, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        SnapshotConfig("j", **kwargs)


def test_snapshot_config_takes_all_but_the_job_by_name():
    with pytest.raises(TypeError):
        SnapshotConfig("j", 4, 2)
    cfg = SnapshotConfig("j", k=4, m=2)
    assert (cfg.job, cfg.k, cfg.m) == ("j", 4, 2)
    assert SnapshotConfig.from_dict(cfg.to_dict()) == cfg


def test_valid_groups_build_the_same_config_as_before():
    from memsnap.rank import job_config

    opts = resolve(
        {
            "protection": Protection(k=4, m=2, group_size=8, peers=True, local_copy=False),
            "memory": Memory(budget=1 << 30, keep=3),
            "spill": Spill("s3://b/{job}", every_seconds=60.0, bytes_per_s=1 << 20),
            "wire": Wire(transport="objstore", chunk=1 << 20, mode="encrypt"),
            "device": Device(buffer=True, backend="cpu"),
        },
        {},
    )
    assert job_config("train", opts) == SnapshotConfig(
        "train",
        k=4,
        m=2,
        group_size=8,
        peers=True,
        local_copy=False,
        keep=3,
        memory_budget=1 << 30,
        spill="s3://b/train",
        spill_every_seconds=60.0,
        spill_bytes_per_s=1 << 20,
        transport="objstore",
        chunk=1 << 20,
        wire="encrypt",
        device_buffer=True,
        device_backend="cpu",
    )
    assert When(every_steps=None, auto=True, mtbf_hours=1000).auto
    fail = Failures(on_error="raise", max_staleness_steps=10, preemption=False, preemption_grace_s=5)
    assert (fail.on_error, fail.max_staleness_steps) == ("raise", 10)
