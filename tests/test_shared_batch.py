"""A shared batch's summary, which every rank compares to catch ranks that read different batches."""

from __future__ import annotations

import pytest
import torch

from lightning_deeppool.runtime.shared_batch import checksum

pytestmark = pytest.mark.floors


def _batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 16, 24, generator=g), torch.randint(0, 4, (2, 4, 6), generator=g)]


def test_equal_batches_have_equal_summaries_however_they_are_laid_out_in_memory() -> None:
    x, y = _batch()
    strided = torch.empty(2, 3, 16, 48)[..., ::2]
    strided.copy_(x)
    assert checksum([x, y]) == checksum([x.clone(), y.clone()]) == checksum([strided, y])


def test_a_summary_changes_with_any_value() -> None:
    x, y = _batch()
    nudged = x.clone()
    nudged[1, 2, 7, 5] = torch.nextafter(nudged[1, 2, 7, 5], torch.tensor(1.0))
    relabelled = y.clone()
    relabelled[0, 0, 0] += 1
    assert checksum([nudged, y]) != checksum([x, y])
    assert checksum([x, relabelled]) != checksum([x, y])


def test_a_summary_changes_when_values_change_places() -> None:
    x, y = _batch()
    reference = checksum([x, y])
    moved = [x.flip(3), x.flip(2), x.flip(0), x.roll(1, 3), x.transpose(2, 3).reshape(x.shape)]
    assert all(checksum([m, y]) != reference for m in moved)
    assert checksum([y, x]) != reference


def test_a_summary_covers_tensors_of_any_dtype_and_size() -> None:
    odd = torch.arange(7, dtype=torch.int8)
    assert checksum([odd]) != checksum([odd.flip(0)])
    assert checksum([odd[1:]]) != checksum([odd[:-1]])
    assert checksum([torch.tensor([True, False])]) != checksum([torch.tensor([False, True])])
    assert checksum([torch.ones(3, dtype=torch.bfloat16)]) != checksum([torch.ones(3)])
    assert checksum([torch.empty(0)]) == 0
