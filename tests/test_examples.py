"""The examples run end to end with a few steps, and the README shows the command CI runs."""

import re
import subprocess
import sys
from pathlib import Path

import jsonargparse
import pytest

from lightning_deeppool import DeepPoolStrategy
from lightning_deeppool.planner.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(args, cwd):
    """Run an example as a user would (the popen launcher re-runs it for rank 1); return its stdout."""
    done = subprocess.run(
        [sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_quickstart_prints_the_plan_and_ends_with_held_out_accuracy(tmp_path):
    out = run_example([EXAMPLES / "quickstart.py", "--max-steps", "5"], tmp_path)
    assert "predicted step time" in out and "idle fraction per rank" in out
    assert "over the best plan of another shape" in out
    assert re.fullmatch(r"held-out accuracy: [01]\.\d{3}", out.strip().splitlines()[-1])
    assert (tmp_path / "outputs" / "quickstart" / "deeppool_plan.json").exists()


@pytest.mark.slow
def test_quickstart_compares_measured_step_times_with_lightnings_ddp(tmp_path):
    out = run_example([EXAMPLES / "quickstart.py", "--max-steps", "10", "--compare-ddp"], tmp_path)
    assert "held-out accuracy" in out
    assert re.fullmatch(
        r"measured median step time over 10 steps: deeppool \d+\.\d{3} ms, Lightning's DDP \d+\.\d{3} ms: "
        r"speedup \d+\.\d{2}x \(predicted \d+\.\d{2}x\)",
        out.strip().splitlines()[-1],
    )


@pytest.mark.slow
def test_resnet_example_trains_on_generated_images(tmp_path):
    out = run_example([EXAMPLES / "resnet.py", "--max-steps", "3"], tmp_path)
    assert "blocks_0_conv1" in out
    assert re.fullmatch(
        r"final train loss \d+\.\d{3}, train accuracy [01]\.\d{3}", out.strip().splitlines()[-1]
    )


@pytest.mark.slow
def test_large_images_example_trains_one_shared_image_split_by_height(tmp_path):
    out = run_example([EXAMPLES / "large_images.py", "--size", "64", "--max-steps", "3"], tmp_path)
    plan = Plan.load(tmp_path / "outputs" / "large_images" / "deeppool_plan.json")
    assert plan.global_batch_size == 1 and plan.world_size == 2
    assert "predicted step time" in out
    assert re.fullmatch(
        r"final train loss \d+\.\d{3}, pixel accuracy [01]\.\d{3}", out.strip().splitlines()[-1]
    )


FABRIC_LAUNCHERS = {
    "fabric.launch()": [],
    # Fabric's console script, as a user types it
    "fabric run": [Path(sys.executable).parent / "fabric", "run", "--accelerator", "cpu", "--devices", "2"],
    "torchrun": ["-m", "torch.distributed.run", "--nproc-per-node", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", FABRIC_LAUNCHERS)
def test_fabric_example_trains_under_each_launcher_fabric_offers(tmp_path, launcher):
    script = EXAMPLES / "fabric_loop.py"
    out = run_example([*FABRIC_LAUNCHERS[launcher], script, "--max-steps", "3"], tmp_path)
    assert "predicted step time" in out
    assert re.search(r"^epoch 0: 3 steps, held-out accuracy [01]\.\d{3}$", out, re.MULTILINE)
    assert out.strip().splitlines()[-1] == "saved outputs/fabric_loop/checkpoint.ckpt after 3 steps"
    assert (tmp_path / "outputs" / "fabric_loop" / "checkpoint.ckpt").exists()


@pytest.mark.slow
@pytest.mark.floors
def test_lightningcli_example_takes_the_strategy_from_yaml(tmp_path):
    config = EXAMPLES / "cli_config.yaml"
    out = run_example([EXAMPLES / "cli.py", "fit", "--config", config, "--trainer.max_steps", "3"], tmp_path)
    plan = tmp_path / "outputs" / "cli" / "deeppool_plan.json"
    assert "predicted step time" in out and plan.exists()
    assert Plan.load(plan).width("head") == 1  # pinned in the YAML


DDP_CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  strategy:
    class_path: lightning.pytorch.strategies.DDPStrategy
    init_args:
      find_unused_parameters: true
      static_graph: true
      gradient_as_bucket_view: true
      bucket_cap_mb: 10
      broadcast_buffers: false
      ddp_comm_hook: torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook
model:
  channels: 8
  hidden: 64
"""


@pytest.mark.slow
def test_a_lightningcli_config_written_for_ddp_runs_with_only_its_class_path_changed(tmp_path):
    ddp = tmp_path / "ddp.yaml"
    ddp.write_text(DDP_CONFIG)
    printed = run_example([EXAMPLES / "cli.py", "fit", "--config", ddp, "--print_config"], tmp_path)
    assert "find_unused_parameters: true" in printed  # a config DDPStrategy takes
    deeppool = tmp_path / "deeppool.yaml"
    deeppool.write_text(
        DDP_CONFIG.replace("lightning.pytorch.strategies.DDPStrategy", "lightning_deeppool.DeepPoolStrategy")
    )
    out = run_example([EXAMPLES / "cli.py", "fit", "--config", deeppool], tmp_path)
    assert "predicted step time" in out


@pytest.mark.floors
def test_a_lightningcli_config_may_pin_modules_to_widths_splits_and_ranks():
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(DeepPoolStrategy, "strategy")
    pins = {"": 2, "encoder": {"width": 2, "spatial": 2}, "text": {"ranks": [1]}}
    config = parser.parse_object({"strategy": {"plan": pins, "branches": False}})
    assert config.strategy.plan == pins and config.strategy.branches is False


@pytest.mark.floors
def test_readme_shows_the_test_command_ci_runs():
    command = (ROOT / "scripts" / "test.sh").read_text().strip().splitlines()[-1]
    assert command.startswith("python3 -m venv .venv && ")
    assert f"\n{command}\n" in (ROOT / "README.md").read_text()
