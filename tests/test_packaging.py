"""Packaging: the dependency floors pyproject.toml declares are the versions CI tests them at."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.floors

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]


def declared_floors() -> dict[str, str]:
    """Each runtime dependency of pyproject.toml and its `>=` version."""
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for requirement in requirements:
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
        assert match, f"{requirement!r} declares no floor (>=)"
        floors[match[1].lower()] = match[2]
    return floors


def pinned_floors() -> dict[str, str]:
    lines = (ROOT / ".ci" / "floors.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {name.lower(): version for name, version in pins}


def same_version(a: str, b: str) -> bool:
    """2.6 and 2.6.0 name the same release."""
    pad = lambda v: [int(part) for part in v.split(".")] + [0] * (3 - v.count(".") - 1)  # noqa: E731
    return pad(a) == pad(b)


def test_ci_pins_every_runtime_dependency_at_the_floor_pyproject_declares() -> None:
    declared, pinned = declared_floors(), pinned_floors()
    assert sorted(pinned) == sorted(declared)
    for name, floor in declared.items():
        assert same_version(pinned[name], floor), f"{name}: pyproject says >={floor}, CI pins {pinned[name]}"


def test_ci_runs_the_suite_on_the_floors() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-c .ci/floors.txt" in ci and "bash scripts/test.sh" in ci
