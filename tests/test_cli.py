"""The `deeppool` command: plan, show and simulate on a tiny model, and its usage errors (exit 2)."""

import json
from pathlib import Path

import pytest

from lightning_deeppool.cli import main
from lightning_deeppool.planner.plan import Plan

from planner_fixtures import chain, linear_profile

pytestmark = pytest.mark.floors

TINY = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = nn.Linear(8, hidden)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))
"""
FAST = ["--warmup", "0", "--repeats", "1"]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """``tiny.py:Tiny``, importable from the working directory (tmp_path)."""
    (tmp_path / "tiny.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    return "tiny.py:Tiny"


def usage_error(capsys, argv):
    """Run the command expecting argparse's exit 2; return its error line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_plan_prints_the_table_and_writes_the_plan_file(tiny, capsys):
    main(["plan", tiny, "--input-shape", "8", "--devices", "2", "--global-batch-size", "8", *FAST])
    out = capsys.readouterr().out
    plan = Plan.load("plan.json")
    assert (plan.world_size, plan.global_batch_size) == (2, 8)
    assert [layer.module for layer in plan.layers] == ["body", "head"]  # the relu joins the body
    assert "predicted step time" in out and "plan written to plan.json" in out


def test_plan_pins_widths_and_takes_module_arguments_from_a_lightningcli_config(tiny, tmp_path):
    (tmp_path / "model.yaml").write_text("model:\n  class_path: tiny.Tiny\n  init_args:\n    hidden: 5\n")
    config = ["--config", "model.yaml", "--pin", "head=1", "--pin", "body=2", "--out", "p.json"]
    main(
        [
            "plan",
            "tiny:Tiny",
            *config,
            "--input-shape",
            "8",
            "--devices",
            "2",
            "--global-batch-size",
            "8",
            *FAST,
        ]
    )
    plan = Plan.load("p.json")
    assert plan.width("head") == 1 and plan.width("body") == 2
    assert plan.layers[0].params == 8 * 5 + 5


def test_plan_costs_transfers_and_syncs_with_the_given_link(tiny):
    args = ["--input-shape", "8", "--devices", "2", "--global-batch-size", "8", *FAST]
    main(
        [
            "plan",
            tiny,
            *args,
            "--pin",
            "=2",
            "--bandwidth",
            "0.000001",
            "--latency-us",
            "0",
            "--out",
            "a.json",
        ]
    )
    slow = Plan.load("a.json")
    # head: 16*3 + 3 weights, 4 bytes each, all-reduced between 2 ranks at 1 kB/s: 2 * 1/2 * 204 B / 1e3 B/s.
    assert slow.layers[1].sync_s == pytest.approx(0.204)


def test_plan_writes_a_profile_that_plan_and_simulate_reuse(tiny, tmp_path, capsys):
    args = ["--input-shape", "8", "--global-batch-size", "8", *FAST]
    main(["plan", tiny, *args, "--devices", "4", "--profile-out", "profile.json", "--out", "a.json"])
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["layers"]["body"]["batch_sizes"] == [2, 3, 4, 8]
    assert [layer["name"] for layer in profile["graph"]["layers"]] == ["body", "head"]
    main(["plan", tiny, *args, "--devices", "4", "--profile", "profile.json", "--out", "b.json"])
    assert Plan.load("a.json").widths() == Plan.load("b.json").widths()
    capsys.readouterr()
    main(["simulate", "--profile", "profile.json", "--global-batch-size", "8", "--devices", "2,4"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[0] == "devices" and [row.split()[0] for row in rows[1:3]] == ["2", "4"]


def test_simulate_profiles_every_per_device_batch_it_needs(tiny, capsys):
    main(["simulate", tiny, "--input-shape", "8", "--global-batch-size", "8", "--devices", "8,2,4", *FAST])
    rows = capsys.readouterr().out.splitlines()
    table = rows[rows.index(next(r for r in rows if r.lstrip().startswith("devices"))) :]
    assert [row.split()[0] for row in table[1:4]] == ["2", "4", "8"]


def test_show_prints_the_table_and_saves_charts(tiny, tmp_path, capsys):
    args = ["--input-shape", "8", "--global-batch-size", "8", *FAST]
    main(["plan", tiny, *args, "--devices", "2", "--profile-out", "profile.json"])
    capsys.readouterr()
    main(["show", "plan.json", "--chart", "charts/plan.png"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["layer", "module", "width"]
    assert "chart written to charts/plan.png" in out
    main(
        [
            "simulate",
            "--profile",
            "profile.json",
            "--global-batch-size",
            "8",
            "--devices",
            "2",
            "--chart",
            "s.png",
        ]
    )
    for chart in ("charts/plan.png", "s.png"):
        assert (tmp_path / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_paths_without_a_class_are_usage_errors(tiny, capsys):
    common = ["--input-shape", "8", "--devices", "2", "--global-batch-size", "8"]
    assert usage_error(capsys, ["plan", "tiny", *common]).endswith(
        "module path 'tiny' must look like pkg.module:ClassName"
    )
    assert "cannot import 'no_such_module'" in usage_error(capsys, ["plan", "no_such_module:Net", *common])
    assert usage_error(capsys, ["plan", "tiny:Nope", *common]).endswith("module 'tiny' has no class 'Nope'")


def test_classes_that_are_not_modules_are_usage_errors(tiny, capsys):
    common = ["--input-shape", "8", "--devices", "2", "--global-batch-size", "8"]
    assert usage_error(capsys, ["plan", "pathlib:PurePath", *common]).endswith(
        "pathlib:PurePath is a PurePosixPath, not a LightningModule or nn.Module"
    )


def test_bad_shapes_and_unknown_pins_are_usage_errors(tiny, capsys):
    common = ["--devices", "2", "--global-batch-size", "8", *FAST]
    assert usage_error(capsys, ["plan", tiny, "--input-shape", "8,x", *common]).endswith(
        "--input-shape '8,x' must be comma-separated positive integers, e.g. 3,32,32"
    )
    error = usage_error(capsys, ["plan", tiny, "--input-shape", "5", *common])
    assert "running Tiny.forward on the example batch failed" in error and "(4x5 and 8x16)" in error
    assert "pin 'classifier' matches no layer" in usage_error(
        capsys, ["plan", tiny, "--input-shape", "8", "--pin", "classifier=1", *common]
    )


def test_simulate_needs_a_profile_or_a_model(capsys):
    assert usage_error(capsys, ["simulate", "--global-batch-size", "8", "--devices", "2"]).endswith(
        "give a profile (--profile profile.json) or a model (MODULE_PATH --input-shape ...)"
    )


def test_missing_plan_files_are_usage_errors(tmp_path, capsys):
    assert usage_error(capsys, ["show", str(tmp_path / "none.json")]).endswith(
        f"plan file '{tmp_path / 'none.json'}' does not exist"
    )


def test_simulate_needs_the_graph_that_profile_out_writes(tmp_path, capsys):
    graph = chain(2)
    linear_profile(graph, {"l0": (0.0, 1e-3), "l1": (0.0, 1e-3)}, max_batch=8).save(tmp_path / "p.json")
    argv = ["simulate", "--profile", str(tmp_path / "p.json"), "--global-batch-size", "8", "--devices", "2"]
    assert usage_error(capsys, argv).endswith(
        "it has no graph; write profiles with `deeppool plan ... --profile-out FILE`"
    )


def test_a_pin_may_split_by_height_as_widthsspatial_and_is_checked_against_the_layer(tiny, capsys):
    common = ["--input-shape", "8", "--devices", "2", "--global-batch-size", "8", *FAST]
    assert usage_error(capsys, ["plan", tiny, *common, "--pin", "head=2s2"]).endswith(
        "pin 'head': layer 'head' cannot be split by height (spatial 2): only convolutions, pooling, "
        "BatchNorm and pointwise layers can; give it spatial 1"
    )
    assert usage_error(capsys, ["plan", tiny, *common, "--pin", "head=2x2"]).endswith(
        "--pin 'head=2x2' must look like name=width or name=WIDTHsSPATIAL, e.g. classifier=1 or features=4s2"
    )


def test_a_link_figure_given_replaces_only_itself_and_keeps_the_profiles_overlap_and_contention(capsys):
    vgg16 = str(Path(__file__).parents[1] / "benchmarks" / "profiles" / "a100" / "vgg16.json")
    main(["simulate", "--profile", vgg16, "--global-batch-size", "32", "--devices", "8", "--latency-us", "5"])
    out = capsys.readouterr().out
    assert "assumes point-to-point: 266 GB/s, 5 us per message" in out  # the profile's bandwidth
    assert "assumes gradient all-reduces beside backward" in out
    assert "compute beside them at 54% of its speed" in out
