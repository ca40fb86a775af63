"""Several nodes: 2 nodes with one CPU device each (global rank 1 is local rank 0 of node 1)."""

import os
from typing import Any

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import SEED, images, make_model, max_param_diff, parameters, reference_fit, trainer_kwargs

pytestmark = pytest.mark.floors

GLOBAL_BATCH = 16
SAMPLES = 4 * GLOBAL_BATCH
PINS = {"": 2, "head": 1}


def _node(rank: int, root: str) -> dict[str, Any]:
    # The process group is up; these say Lightning's cluster environment is node `rank` of 2,
    # with one process (local rank 0) created externally.
    os.environ.update(
        LOCAL_RANK="0",
        NODE_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )
    pl.seed_everything(SEED, verbose=False)  # the DistributedSampler's shuffling seed
    model = make_model("resnet")
    strategy = DeepPoolStrategy(plan=PINS, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(
        **trainer_kwargs(devices=1, num_nodes=2, strategy=strategy, max_epochs=1, default_root_dir=root)
    )
    trainer.fit(model, DataLoader(images(SAMPLES), batch_size=GLOBAL_BATCH // 2))
    return {
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "owned": sum(len(g["params"]) for g in trainer.optimizers[0].param_groups),
        "params": parameters(model),
    }


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_node, 2, str(tmp_path_factory.mktemp("nodes")))


def test_ranks_come_from_the_cluster_environment(nodes):
    assert [(n["global_rank"], n["node_rank"], n["local_rank"]) for n in nodes] == [(0, 0, 0), (1, 1, 0)]


def test_two_nodes_train_like_one_device(nodes):
    reference = make_model("resnet")
    reference_fit(reference, images(SAMPLES), GLOBAL_BATCH, max_epochs=1)
    for node in nodes:
        assert max_param_diff(node["params"], parameters(reference)) < 1e-5


def test_the_second_node_owns_no_head_parameters(nodes):
    total = len(list(make_model("resnet").parameters()))
    assert nodes[0]["owned"] == total
    assert nodes[1]["owned"] == total - 2
