import json
from pathlib import Path

import pytest

from lightning_deeppool.ir.profile import AlphaBeta, CommProfile, LayerProfile, Profile
from lightning_deeppool.profiling.cache import (
    default_cache_dir,
    load_cached_profile,
    profile_cache_key,
    save_cached_profile,
)

pytestmark = pytest.mark.floors

KEY_ARGS = ("abc123", {"x": [[3, 32, 32], "float32"]}, "float32", "cpu", 2, 64)
OTHER_VALUES = ("def456", {"x": [[3, 64, 64], "float32"]}, "bfloat16", "NVIDIA H100", 4, 128)


def _profile() -> Profile:
    return Profile(
        graph_fingerprint="abc123",
        device="cpu",
        dtype="float32",
        layers={"fc": LayerProfile("fc", (1, 2), (0.5, 0.75))},
        comm=CommProfile(
            allreduce={2: AlphaBeta(1e-4, 2e-9)}, redistribute=AlphaBeta(5e-5, 1e-9), measured=True
        ),
    )


def test_saved_profile_loads_back_equal(tmp_path):
    save_cached_profile(tmp_path, "k", _profile())
    assert load_cached_profile(tmp_path, "k") == _profile()


def test_missing_profile_loads_as_none(tmp_path):
    assert load_cached_profile(tmp_path / "absent", "k") is None


def test_save_leaves_only_the_profile_file(tmp_path):
    path = save_cached_profile(tmp_path / "cache", "k", _profile())
    assert list((tmp_path / "cache").iterdir()) == [path]


def test_cache_key_is_stable():
    assert profile_cache_key(*KEY_ARGS) == profile_cache_key(*KEY_ARGS)


@pytest.mark.parametrize("index", range(len(KEY_ARGS)))
def test_cache_key_changes_with_each_component(index):
    changed = list(KEY_ARGS)
    changed[index] = OTHER_VALUES[index]
    assert profile_cache_key(*changed) != profile_cache_key(*KEY_ARGS)


def test_corrupt_cache_file_is_ignored_with_a_warning(tmp_path):
    (tmp_path / "k.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring cached profile"):
        assert load_cached_profile(tmp_path, "k") is None


def test_cache_file_of_another_version_is_ignored_with_a_warning(tmp_path):
    data = {**_profile().to_dict(), "version": 0}
    (tmp_path / "k.json").write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="profile version 0"):
        assert load_cached_profile(tmp_path, "k") is None


def test_cache_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPPOOL_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path


def test_cache_dir_defaults_to_the_user_cache(monkeypatch):
    monkeypatch.delenv("DEEPPOOL_CACHE_DIR", raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "lightning_deeppool"
