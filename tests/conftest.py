"""Shared test set-up: the codec ISA in the header, loopback-only Ray, GPU skips, and the
``job`` fixture of the modules that run one job on their own loopback cluster."""

from __future__ import annotations

import os

import pytest

# Every Ray process a test starts binds to loopback only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The agents of the clusters the tests start accept fault injection (memsnap.testing).
os.environ.setdefault("MEMSNAP_TESTING_HOOKS", "1")
# Scripts the tests run in subprocesses import this checkout and the test helpers, whatever
# copy of memsnap (if any) is installed in the environment.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in [_ROOT, os.path.join(_ROOT, "tests"), os.environ.get("PYTHONPATH", "")] if p
)


# Property tests: the default and CI runs draw the same examples every time (a failure there
# reproduces on any machine); `-m thorough` (or HYPOTHESIS_PROFILE=explore) draws fresh ones.
def pytest_configure(config):
    try:
        from hypothesis import settings
    except ImportError:  # hypothesis is a test extra; conftest must still load without it
        return
    settings.register_profile("repeatable", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    expr = config.getoption("markexpr", "") or ""
    exploring = "thorough" in expr and "not thorough" not in expr
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "explore" if exploring else "repeatable"))


def pytest_report_header(config):
    try:
        from memsnap.coding import codec

        return f"memsnap codec ISA: {codec.isa()} (available: {', '.join(codec.available_isas())})"
    except Exception as exc:  # the header must never break collection
        return f"memsnap codec ISA: unavailable ({exc})"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def job(request, tmp_path_factory):
    """The job the module names as ``JOB_SPEC`` (a ``support.runtime.JobSpec``), running on its
    own loopback cluster for the whole module; see ``support.runtime.running_job``."""
    from support.runtime import running_job

    spec = getattr(request.module, "JOB_SPEC", None)
    if spec is None:
        pytest.fail(f"{request.module.__name__} uses the job fixture but names no JOB_SPEC")
    with running_job(spec, tmp_path_factory) as running:
        yield running
