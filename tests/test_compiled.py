"""Compiled models train under deeppool as on one device, and compiled: with `trainer.fit(torch.compile(
model))` (Lightning's documented way), `model.compile()` and `torch.compile` applied to a submodule,
the planned layers they cover run through the user's compiler (a counting backend here) on every
rank, and the strategy's own code is never traced. `compile_layers` compiles an uncompiled model's
layers alike (aot_eager: forward and backward through AOTAutograd)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import fx
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import (
    SEED,
    ConvNet,
    images,
    join_lightning_world,
    max_param_diff,
    parameters,
    reference_fit,
    trainer_kwargs,
)

pytestmark = pytest.mark.floors

TOLERANCE = 1e-5
LOCAL_BATCH = 4
STEPS = 3
COMPILED: list[int] = []  # per graph the counting backend compiled in this process, its node count


RUNS = [0]  # how many times compiled code ran in this process


def _counted(compiled: Any) -> Any:
    def run(*args: Any) -> Any:
        RUNS[0] += 1
        return compiled(*args)

    return run


def counting(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """A `torch.compile` backend that counts the graphs it is given and their runs, and runs them as
    they are."""
    COMPILED.append(len(gm.graph.nodes))
    return _counted(gm.forward)


def counting_aot_eager(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """Counts the graphs and their runs, compiled by the `aot_eager` backend."""
    COMPILED.append(len(gm.graph.nodes))
    return _counted(torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs))


class _RunsAfterTheFirstStep(pl.Callback):
    """How many times compiled code ran in the steps after the first (install, profiling and the
    first step's check run layers too)."""

    def __init__(self) -> None:
        self.start = self.runs = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            self.start = RUNS[0]

    def on_train_end(self, *args: Any) -> None:
        self.runs = RUNS[0] - self.start


class CompiledFeatures(ConvNet):
    """`ConvNet` whose convolutions are compiled in `__init__`, the head left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.compile(self.features, backend=counting)


CASES = {
    "whole-lightning-module": ConvNet,
    "submodule": CompiledFeatures,
    "compile-layers": ConvNet,
    "whole-lightning-module-data-parallel": ConvNet,  # every layer at full width: no layer runs
    "whole-lightning-module-compiled-in-place": ConvNet,  # model.compile(...)
}


def _model(name: str) -> pl.LightningModule:
    torch.manual_seed(0)
    return CASES[name]()


def _fit_every_case(rank: int, world: int, root: str) -> dict[str, Any]:
    join_lightning_world(rank, world)
    results = {}
    for name in CASES:
        model = _model(name)
        before = len(COMPILED)
        pl.seed_everything(SEED, verbose=False)
        compile_layers = {"backend": counting_aot_eager} if name == "compile-layers" else False
        strategy = DeepPoolStrategy(
            plan={"": world} if name.endswith("data-parallel") else {"": world, "head": 1},
            cache_dir=False,
            profile_warmup=0,
            profile_repeats=1,
            compile_layers=compile_layers,
        )
        runs = _RunsAfterTheFirstStep()
        trainer = pl.Trainer(
            **trainer_kwargs(
                devices=world, strategy=strategy, default_root_dir=root, max_steps=STEPS, callbacks=[runs]
            )
        )
        if name.endswith("in-place"):
            model.compile(backend=counting)
        compiled = (
            torch.compile(model, backend=counting)
            if name.startswith("whole") and "in-place" not in name
            else model
        )
        trainer.fit(compiled, DataLoader(images(STEPS * LOCAL_BATCH * world), batch_size=LOCAL_BATCH))
        results[name] = {"params": parameters(model), "graphs": len(COMPILED) - before, "runs": runs.runs}
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_fit_every_case, 2, 2, str(tmp_path_factory.mktemp("compiled")))


@pytest.mark.parametrize("name", list(CASES))
def test_a_compiled_model_trains_to_one_devices_weights(trained, name):
    reference = _model(name)
    reference_fit(reference, images(STEPS * LOCAL_BATCH * 2), 2 * LOCAL_BATCH, max_steps=STEPS)
    for rank in trained:
        assert max_param_diff(parameters(reference), rank[name]["params"]) < TOLERANCE


@pytest.mark.parametrize("name", list(CASES))
def test_the_users_compiler_compiles_the_planned_layers_on_every_rank(trained, name):
    assert all(rank[name]["graphs"] > 0 for rank in trained)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_code_runs_in_the_steps_after_the_first_on_every_rank(trained, name):
    assert all(rank[name]["runs"] > 0 for rank in trained)


def test_compiled_layers_launch_once_per_stage(trained):
    # {"": 2, "head": 1}: the two convolution layers are one stage on both ranks, the head another on
    # rank 0 alone; each stage's forward is one compiled call a step.
    assert [rank["compile-layers"]["runs"] for rank in trained] == [2 * (STEPS - 1), STEPS - 1]
