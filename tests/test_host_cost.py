"""What a steady-state step costs the host: under a plan with narrow layers, no round trip to the
process group's store; the ranks meet once per planned call, once where the step ends and once
before each collective Lightning issues (`self.log(..., sync_dist=True)`, the wait between steps);
and the package reads tensor values on the host (which on a GPU waits for the device) only where
those tensors live on the CPU by construction (the messages of local links, the meetings) and where
it checks a value logged across ranks."""

from __future__ import annotations

import collections
import functools
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import MLP, images, join_lightning_world, trainer_kwargs

WARMUP, COUNTED = 3, 4
STORE_CALLS = ("get", "set", "add", "wait", "check", "compare_set", "multi_get", "multi_set", "delete_key")
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
CPU_BY_CONSTRUCTION = {"comm/messages.py", "session/call_agreement.py"}
# On purpose: whether a value logged with sync_dist=True is finite, while layers a rank does not run
# hold NaN (`reads.check_reduced`): one read per such value, which a GPU waits for.
CHECKED = {"session/reads.py"}


class _Counted(pl.Callback):
    """Counts store round trips (by method) and meetings during `COUNTED` steps after `WARMUP`."""

    def __init__(self) -> None:
        self.counting = False
        self.store: collections.Counter[str] = collections.Counter()
        self.host_reads: collections.Counter[str] = collections.Counter()
        self.meetings = 0
        for kind in (dist.PrefixStore, dist.TCPStore):
            for name in STORE_CALLS:
                setattr(kind, name, self._wrap(self.store, name, getattr(kind, name)))
        for name in HOST_READS:
            setattr(torch.Tensor, name, self._wrap(self.host_reads, None, getattr(torch.Tensor, name)))

    def _wrap(self, counts: collections.Counter[str], name: str | None, method: Any) -> Any:
        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                site = name or _package_site()
                if site is not None:
                    counts[site] += 1
            return method(*args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        agreement = trainer.strategy._calls.agreement
        if trainer.global_step == WARMUP:
            self.counting, self.meetings = True, -agreement.meetings
        elif trainer.global_step == WARMUP + COUNTED:
            self.counting, self.meetings = False, self.meetings + agreement.meetings


def _package_site() -> str | None:
    """The package module (`folder/file.py`) that made the call, if the package made it."""
    frame = sys._getframe(2)
    while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or f"{os.sep}lightning_deeppool{os.sep}" not in frame.f_code.co_filename:
        return None
    return "/".join(Path(frame.f_code.co_filename).parts[-2:])


def _steady_steps(rank: int, root: str) -> tuple[dict[str, int], float, dict[str, int]]:
    join_lightning_world(rank, 2)
    counted = _Counted()
    strategy = DeepPoolStrategy(plan={"": 2, "head": 1}, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(
        **trainer_kwargs(
            devices=2,
            strategy=strategy,
            max_steps=WARMUP + COUNTED + 1,
            callbacks=[counted],
            default_root_dir=root,
        )
    )
    torch.manual_seed(0)
    trainer.fit(MLP(), DataLoader(images(64), batch_size=4))
    return dict(counted.store), counted.meetings / COUNTED, dict(counted.host_reads)


@pytest.fixture(scope="module")
def steady(tmp_path_factory) -> list[tuple[dict[str, int], float, dict[str, int]]]:
    return run_distributed(_steady_steps, 2, str(tmp_path_factory.mktemp("host_cost")))


def test_a_steady_step_under_a_narrow_plan_makes_no_store_round_trip(steady):
    assert [store for store, _, _ in steady] == [{}, {}]


def test_a_steady_step_meets_at_its_call_its_collectives_and_its_end(steady):
    # The planned call, the logged loss, the step's end, the wait between steps.
    assert [meetings for _, meetings, _ in steady] == [4, 4]


def test_a_steady_step_reads_values_on_the_host_only_from_cpu_tensors_and_logged_checks(steady):
    for _, _, host_reads in steady:
        assert set(host_reads) <= CPU_BY_CONSTRUCTION | CHECKED, host_reads
        assert host_reads.get("session/reads.py") == COUNTED  # the logged train_loss, once a step
