"""Process groups a plan needs: one per set of ranks that sums gradients, built on every rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch.distributed as dist


class PlanGroups(Mapping[tuple[int, ...], dist.ProcessGroup]):
    """Gradient-sync groups keyed by their ranks (sorted), plus `redistribution` for activation messages.

    Creating a group is collective: every rank builds every group, in one order (fewest ranks
    first), even the groups it is not a member of. The whole world gets its own group too, so
    gradient all-reduces never interleave with activation messages. On NCCL every group runs on
    high-priority streams (background jobs run at low priority beside them) and activations move
    on a high-priority copy of the world group; on gloo they use the default group.
    """

    def __init__(self, rank_sets: Iterable[Sequence[int]], world_size: int) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        options = _high_priority_options()
        wanted = {tuple(sorted(ranks)) for ranks in rank_sets if len(ranks) > 1}
        for ranks in sorted(wanted, key=lambda r: (len(r), r)):
            if ranks[0] < 0 or ranks[-1] >= world_size:
                raise ValueError(f"ranks {list(ranks)} are not all in a world of {world_size}")
            group = dist.new_group(ranks=list(ranks), pg_options=options)
            if dist.get_rank() in ranks and dist.get_world_size(group) != len(ranks):
                raise RuntimeError(f"group for ranks {list(ranks)} has {dist.get_world_size(group)} ranks")
            self._groups[ranks] = group
        self.redistribution: dist.ProcessGroup | None = None
        if options is not None:
            self.redistribution = dist.new_group(ranks=list(range(world_size)), pg_options=options)

    def __getitem__(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        try:
            return self._groups[ranks]
        except KeyError:
            raise KeyError(
                f"no process group for ranks {list(ranks)}; built: {sorted(self._groups)}"
            ) from None

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def destroy(self) -> None:
        """Destroy the groups this rank is a member of (non-members hold a placeholder)."""
        for ranks, group in self._groups.items():
            if dist.get_rank() in ranks and dist.is_initialized():
                dist.destroy_process_group(group)
        self._groups.clear()
        if self.redistribution is not None and dist.is_initialized():
            dist.destroy_process_group(self.redistribution)
        self.redistribution = None


def _high_priority_options() -> object | None:
    """NCCL options asking for high-priority streams; None on other backends."""
    if dist.get_backend() != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options
