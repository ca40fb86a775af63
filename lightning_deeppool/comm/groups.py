"""Process groups a plan needs: one per owner width, ranks 0..width-1, built on every rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch.distributed as dist


class PlanGroups(Mapping[int, dist.ProcessGroup]):
    """Gradient-sync groups keyed by width, plus `redistribution` for activation messages.

    Creating a group is collective: every rank builds every group, in increasing width, even the
    groups it is not a member of. The width equal to the world size gets its own group too, so
    gradient all-reduces never interleave with activation messages. On NCCL every group runs on
    high-priority streams (background jobs run at low priority beside them) and activations move
    on a high-priority copy of the world group; on gloo they use the default group.
    """

    def __init__(self, widths: Iterable[int], world_size: int) -> None:
        self._groups: dict[int, dist.ProcessGroup] = {}
        options = _high_priority_options()
        for width in sorted({w for w in widths if w > 1}):
            if width > world_size:
                raise ValueError(f"width {width} exceeds the world size {world_size}")
            group = dist.new_group(ranks=list(range(width)), pg_options=options)
            if dist.get_rank() < width and dist.get_world_size(group) != width:
                raise RuntimeError(f"group for width {width} has {dist.get_world_size(group)} ranks")
            self._groups[width] = group
        self.redistribution: dist.ProcessGroup | None = None
        if options is not None:
            self.redistribution = dist.new_group(ranks=list(range(world_size)), pg_options=options)

    def __getitem__(self, width: int) -> dist.ProcessGroup:
        try:
            return self._groups[width]
        except KeyError:
            raise KeyError(f"no process group for width {width}; built: {sorted(self._groups)}") from None

    def __iter__(self) -> Iterator[int]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def destroy(self) -> None:
        """Destroy the groups this rank is a member of (non-members hold a placeholder)."""
        for width, group in self._groups.items():
            if dist.get_rank() < width and dist.is_initialized():
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
