"""Process groups a plan needs: one per owner width, ranks 0..width-1, built on every rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch.distributed as dist


class PlanGroups(Mapping[int, dist.ProcessGroup]):
    """Gradient-sync groups keyed by width.

    Creating a group is collective: every rank builds every group, in increasing width, even the
    groups it is not a member of. The width equal to the world size gets its own group too, so
    gradient all-reduces never interleave with the activation messages on the default group.
    """

    def __init__(self, widths: Iterable[int], world_size: int, backend: str | None = None) -> None:
        self._groups: dict[int, dist.ProcessGroup] = {}
        for width in sorted({w for w in widths if w > 1}):
            if width > world_size:
                raise ValueError(f"width {width} exceeds the world size {world_size}")
            group = dist.new_group(ranks=list(range(width)), backend=backend)
            if dist.get_rank() < width and dist.get_world_size(group) != width:
                raise RuntimeError(f"group for width {width} has {dist.get_world_size(group)} ranks")
            self._groups[width] = group

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
