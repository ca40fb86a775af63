"""The gradients of parameters a rank does not hold, as that rank's user code sees them.

A rank runs only the layers of its plan, so it holds no gradient for the others. Where the user reads
gradients (a hook after backward or before the optimizer step, gradient clipping), each such parameter's
`grad` is an `Unheld` tensor: it has the gradient's shape, dtype and device, and its 2-norm, sent by rank
0 (which holds every parameter) at every synchronisation. Norms are what Lightning's `grad_norm`,
`clip_grad_norm_` and norm logging read, so they give every rank the values DDP gives; any other read
raises, naming the parameter and the rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

_NORMS = {"norm", "linalg_vector_norm", "_foreach_norm"}
_SCALES = {"mul_", "_foreach_mul_"}
_ITSELF = {"detach", "detach_", "requires_grad_"}
_DATA = torch.Tensor.data  # the property: `.data` of an unheld gradient is itself


class Unheld(torch.Tensor):
    """The gradient of parameter `param` on a rank (`rank`) that does not hold it: only its 2-norm
    (`two_norm`) can be read."""

    param: str
    rank: int
    two_norm: float

    # Reads that touch only the tensor's metadata (properties, `.shape` among them, come as __get__).
    METADATA: ClassVar[set[str]] = {
        "__get__", "size", "dim", "numel", "element_size", "is_floating_point", "is_complex", "__len__",
        "nelement", "stride", "storage_offset", "is_contiguous", "__hash__",
    }  # fmt: skip

    @staticmethod
    def __new__(cls, like: torch.Tensor, param: str, rank: int, norm: float) -> Unheld:
        made = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        made.param, made.rank, made.two_norm = param, rank, norm
        return made  # type: ignore[no-any-return]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Unheld({self.param!r}, rank={self.rank}, norm={self.two_norm})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if getattr(func, "__self__", None) is _DATA or name in _ITSELF:
            return args[0]
        if name in cls.METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in _NORMS:
            return _norm(func, name, args, kwargs)
        if name in _SCALES:
            return _scale(func, name, args)
        unheld = next(t for t in _tensors(args, kwargs) if isinstance(t, Unheld))
        raise RuntimeError(
            f"deeppool: rank {unheld.rank} does not hold the gradient of {unheld.param!r} (it runs none of "
            f"the layers that use it), so {name or func} cannot read it there; only its norm can be read "
            "(grad_norm, clip_grad_norm_). Read gradients on rank 0 (`if trainer.is_global_zero:`), which "
            "holds every parameter, or pin the layer to every device (DeepPoolStrategy(plan={...}))"
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        unheld = next(t for t in _tensors(args, kwargs or {}) if isinstance(t, Unheld))
        raise RuntimeError(
            f"deeppool: rank {unheld.rank} does not hold the gradient of {unheld.param!r}; {func} cannot "
            "read it there"
        )


def _tensors(args: Any, kwargs: Mapping[str, Any]) -> list[Any]:
    found: list[Any] = []
    for value in (*args, *kwargs.values()):
        found.extend(value if isinstance(value, list | tuple) else [value])
    return found


def _norm(func: Any, name: str, args: Any, kwargs: Mapping[str, Any]) -> Any:
    """A norm of gradients, some unheld: each unheld one's from its norm, the others' as asked."""
    if name == "_foreach_norm":
        tensors, rest = args[0], args[1:]
        return [_norm(torch.linalg.vector_norm, "linalg_vector_norm", (t, *rest), kwargs) for t in tensors]
    tensor, rest = args[0], list(args[1:])
    if not isinstance(tensor, Unheld):
        with torch._C.DisableTorchFunctionSubclass():
            return func(tensor, *rest, **kwargs)
    order = kwargs.get("ord", kwargs.get("p", rest[0] if rest else 2))
    if order not in (2, 2.0, "fro", None) or kwargs.get("dim", None) is not None:
        raise RuntimeError(
            f"deeppool: rank {tensor.rank} knows only the 2-norm of the gradient of {tensor.param!r}, which "
            f"it does not hold; the {order}-norm over all its values cannot be read there"
        )
    dtype = kwargs.get("dtype") or tensor.dtype
    return torch.tensor(tensor.two_norm, dtype=dtype, device=tensor.device)


def _scale(func: Any, name: str, args: Any) -> Any:
    """Scaling (as gradient clipping does) scales an unheld gradient's norm; held ones as asked."""
    tensors = args[0] if name == "_foreach_mul_" else [args[0]]
    factor = args[1]
    factors = factor if isinstance(factor, list | tuple) else [factor] * len(tensors)
    held = [(t, f) for t, f in zip(tensors, factors) if not isinstance(t, Unheld)]
    for t, f in zip(tensors, factors):
        if isinstance(t, Unheld):
            t.two_norm *= abs(float(f))
    with torch._C.DisableTorchFunctionSubclass():
        for t, f in held:
            t.mul_(f)
    return args[0]


class UnheldGradients:
    """Puts an `Unheld` gradient on every parameter this rank does not hold whose gradient rank 0
    holds, after each synchronisation (`publish`, collective)."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        owners: Mapping[str, Sequence[int]],
        *,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        self.params = params
        self.owners = owners
        self.rank = rank
        self.world_size = world_size
        self.device = device

    def publish(self) -> None:
        """Rank 0 sends the 2-norm of every gradient some rank does not hold (NaN where it has none);
        each rank that does not hold one puts its `Unheld` in place. Collective."""
        owners = self.owners
        narrow = sorted(name for name, ranks in owners.items() if len(ranks) < self.world_size)
        if not narrow:
            return
        norms = torch.full((len(narrow),), float("nan"), dtype=torch.float64, device=self.device)
        if self.rank == 0:
            grads = [self.params[name].grad for name in narrow]
            present = [i for i, g in enumerate(grads) if g is not None]
            if present:
                found = _norms([grads[i] for i in present])  # type: ignore[misc]
                norms[present] = torch.stack([n.to(self.device, torch.float64) for n in found])
        dist.broadcast(norms, src=0)
        self._install(narrow, norms.tolist(), owners)

    def _install(
        self, narrow: Sequence[str], norms: Sequence[float], owners: Mapping[str, Sequence[int]]
    ) -> None:
        for name, norm in zip(narrow, norms):
            if self.rank in owners[name]:
                continue
            p = self.params[name]
            p.grad = None if norm != norm else Unheld(p, name, self.rank, norm)  # NaN: no gradient


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, computed as gradient clipping computes it (by device and dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    found: list[torch.Tensor] = [torch.empty(0)] * len(grads)
    for indices in groups.values():
        for i, norm in zip(indices, torch._foreach_norm([grads[i] for i in indices])):
            found[i] = norm
    return found
