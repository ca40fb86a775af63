"""Shared test setup: one thread per process (spawned ranks share 2 cores) and no stray caches."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Profiles go to a per-test cache directory unless a test sets its own."""
    monkeypatch.setenv("DEEPPOOL_CACHE_DIR", str(tmp_path / "deeppool-cache"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
