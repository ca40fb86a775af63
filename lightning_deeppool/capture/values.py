"""Batch values: the per-sample structure of what flows between layers, and views by sample.

A batch tensor holds ``rows`` consecutive rows per sample in dimension 0: ``rows == 1`` for the usual
``(batch, ...)`` tensor, ``rows == k`` for a batch-major flattened ``(batch * k, ...)`` one (a language
model's ``logits.view(-1, vocab)``). Its *per-sample shape* is the shape of one sample viewed as
``(rows, ...)`` when ``rows > 1``, so moving samples between ranks is slicing along dimension 0 of
``samples_view(tensor)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class LeafMeta:
    """Per-sample shape, dtype and rows per sample of one tensor in a batch value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: int = 1

    @property
    def sample_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def tensor_shape(self, samples: int) -> tuple[int, ...]:
        """Shape of the tensor holding `samples` samples."""
        if self.rows == 1:
            return (samples, *self.shape)
        return (samples * self.rows, *self.shape[1:])


@dataclass(frozen=True)
class ValueMeta:
    """Structure of a value between layers: its pytree spec and one `LeafMeta` per tensor leaf.

    ``per_rank`` values (a loss reduced over the rank's own samples) have no per-sample structure:
    their leaves' shapes are whole shapes and they never move between ranks.
    """

    spec: pytree.TreeSpec
    leaves: tuple[LeafMeta, ...]
    per_rank: bool = False

    @property
    def sample_bytes(self) -> int:
        return 0 if self.per_rank else sum(leaf.sample_bytes for leaf in self.leaves)


def samples_view(tensor: torch.Tensor, leaf: LeafMeta) -> torch.Tensor:
    """`tensor` viewed as ``(samples, *leaf.shape)``."""
    if leaf.rows == 1:
        return tensor
    return tensor.reshape(-1, *leaf.shape)


def rows_view(tensor: torch.Tensor, leaf: LeafMeta) -> torch.Tensor:
    """Inverse of `samples_view`: back to the value's own layout."""
    if leaf.rows == 1:
        return tensor
    return tensor.reshape(-1, *leaf.shape[1:])


def take_samples(value: Any, count: int) -> Any:
    """`count` samples of every batch tensor leaf, cycling through the samples it has."""

    def take(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return leaf
        index = torch.arange(count, device=leaf.device) % leaf.shape[0]
        return leaf.index_select(0, index)

    return pytree.tree_map(take, value)
