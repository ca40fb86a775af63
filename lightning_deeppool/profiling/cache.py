"""On-disk cache of profiles, keyed by everything a measurement depends on."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from lightning_deeppool.ir.profile import PROFILE_VERSION, Profile


def profile_cache_key(
    graph_fingerprint: str,
    input_meta: Any,
    dtype: str,
    device_name: str,
    world_size: int,
    global_batch_size: int,
) -> str:
    """A stable hash of the profile's inputs; `input_meta` is JSON-able (per-sample shapes/dtypes)."""
    payload = {
        "version": PROFILE_VERSION,
        "graph": graph_fingerprint,
        "inputs": input_meta,
        "dtype": dtype,
        "device": device_name,
        "world_size": world_size,
        "global_batch_size": global_batch_size,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def default_cache_dir() -> Path:
    """`$DEEPPOOL_CACHE_DIR`, else `~/.cache/lightning_deeppool`."""
    configured = os.environ.get("DEEPPOOL_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "lightning_deeppool"


def load_cached_profile(cache_dir: str | Path, key: str) -> Profile | None:
    """The cached profile, or None when absent; unreadable or outdated files warn and give None."""
    path = _path(cache_dir, key)
    if not path.exists():
        return None
    try:
        return Profile.load(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"ignoring cached profile {path}: {err}; profiling again", stacklevel=2)
        return None


def save_cached_profile(cache_dir: str | Path, key: str, profile: Profile) -> Path:
    """Write atomically (temp file + os.replace), so concurrent readers never see half a file."""
    path = _path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(profile.to_dict(), file, indent=1)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def _path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / f"{key}.json"
