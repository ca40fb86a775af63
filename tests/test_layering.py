"""The layering of the package, enforced on its imports (`layering.MAY_IMPORT` states the rules)."""

from __future__ import annotations

from pathlib import Path

import pytest

from layering import (
    MAY_IMPORT,
    PACKAGE,
    cycles,
    imported_layers,
    layer,
    layer_cycles,
    reached,
    sources,
    violations,
)

pytestmark = pytest.mark.floors

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def package() -> dict[str, str]:
    return sources(ROOT)


def test_every_module_belongs_to_a_layer(package):
    assert {layer(module) for module in package} <= set(MAY_IMPORT)


def test_no_import_crosses_the_layering(package):
    assert violations(package) == []


def test_no_modules_import_each_other(package):
    assert cycles(package) == []


FRONT_DOORS = ("strategy", "fabric")  # the Trainer's and Fabric's


def test_the_fabric_front_door_reaches_the_same_phases_as_the_trainers(package):
    edges = imported_layers(package)
    phases = {"capture", "planner", "lowering", "profiling", "comm", "spatial", "runtime", "install"}
    assert reached(edges, "fabric") == reached(edges, "strategy") >= phases | {"session"}


def test_no_phase_imports_either_front_door(package):
    edges = imported_layers(package)
    importers = {name for name, targets in edges.items() if targets & set(FRONT_DOORS)}
    assert importers == {"__init__"}


def test_the_rules_themselves_have_no_cycle():
    assert layer_cycles() == []


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("planner.bad", "import torch", "layer 'planner' must not import torch"),
        ("ir.bad", "import numpy", "layer 'ir' imports only the standard library"),
        ("lowering.bad", "from torch import nn", "layer 'lowering' must not import torch"),
        ("runtime.bad", "import lightning.pytorch as pl", "may import Lightning"),
        ("ir.bad", f"from {PACKAGE}.planner.plan import Plan", "layer 'ir' may not import layer 'planner'"),
        (
            "capture.bad",
            f"from {PACKAGE}.planner import cost",
            "layer 'capture' may not import layer 'planner'",
        ),
        (
            "runtime.bad",
            f"from {PACKAGE}.strategy import deeppool",
            "layer 'runtime' may not import layer 'strategy'",
        ),
        ("planner.bad", "from ..runtime import grad_sync", "layer 'planner' may not import layer 'runtime'"),
        ("background.bad", f"from {PACKAGE}.runtime.grad_sync import GradSync", "may import only"),
        (
            "runtime.bad",
            f"if TYPE_CHECKING:\n    from {PACKAGE}.install import InstalledPlan",
            "layer 'runtime' may not import layer 'install'",
        ),
        (
            "comm.bad",
            f"def f():\n    from {PACKAGE}.ir import graph",
            "layer 'comm' may not import layer 'ir'",
        ),
    ],
)
def test_a_forbidden_import_is_reported(package, module, line, expected):
    name = f"{PACKAGE}.{module}"
    found = violations({**package, name: line})
    assert len(found) == 1
    assert found[0].startswith(f"{name}:") and expected in found[0]


def test_modules_that_import_each_other_are_reported(package):
    a, b = f"{PACKAGE}.runtime.a", f"{PACKAGE}.runtime.b"
    loop = {
        a: f"from {PACKAGE}.runtime import b",
        b: f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {PACKAGE}.runtime.a import x",
    }
    assert [a, b] in cycles({**package, **loop})
