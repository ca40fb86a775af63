"""This rank's part of samples split by height: the one description halos, BatchNorm and layers share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_deeppool.comm.messages import WORLD, Messages, Posted, gather_over
from lightning_deeppool.ir.rows import part_rows


@dataclass(frozen=True)
class SpatialPart:
    """Part `index` of a sample group whose samples are split by height over the global `ranks` (in
    part order); the parts exchange halos and statistics by `messages`."""

    ranks: tuple[int, ...]
    index: int
    messages: Messages = WORLD

    @property
    def parts(self) -> int:
        return len(self.ranks)

    def rows(self, size: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of a dimension of `size` rows this part holds."""
        return part_rows(size, self.parts, self.index)

    def post(self, outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor]) -> Posted:
        """Send each `outgoing` tensor to its part and receive each `incoming` buffer from its part
        (keys are part indices)."""
        ranks = self.ranks
        return self.messages.post(
            {ranks[p]: t for p, t in outgoing.items()}, {ranks[p]: t for p, t in incoming.items()}
        )

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every part's `mine` (the same shape on each), stacked in part order."""
        return gather_over(self.messages, mine, self.ranks, self.index)
