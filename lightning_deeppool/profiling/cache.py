"""On-disk cache of profiles, keyed by everything a measurement depends on."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from lightning_deeppool.ir.profile import PROFILE_VERSION, Profile
from lightning_deeppool.private_files import open_own, write_privately


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
    """The cached profile, or None when absent; unreadable, outdated or untrusted files (`open_own`)
    warn and give None."""
    path = _path(cache_dir, key)
    try:
        with open_own(path) as file:
            return Profile.from_dict(json.load(file))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"ignoring cached profile {path}: {err}; profiling again", stacklevel=2)
        return None


def save_cached_profile(cache_dir: str | Path, key: str, profile: Profile) -> Path:
    """Write for this user only (`write_privately`)."""
    path = _path(cache_dir, key)
    write_privately(path, lambda file: file.write(json.dumps(profile.to_dict(), indent=1).encode()))
    return path


def _path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / f"{key}.json"
