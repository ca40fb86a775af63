"""The gradients of parameters a rank does not hold, as that rank's user code sees them.

A rank runs only the layers of its plan, so it holds no gradient for the others. Where the user reads
gradients (a hook after backward or before the optimizer step, gradient clipping), each such parameter's
`grad` is an `Unheld` tensor: it has the gradient's shape, dtype and device, and its 1-, 2- and
max-norms, sent by rank 0 (which holds every parameter) at every synchronisation. Norms are what
Lightning's `grad_norm`, `clip_grad_norm_` and norm logging read, so they give every rank the values DDP
gives; scaling (clipping by norm) scales them, clamping (`clip_grad_value_`) and zeroing are allowed
(the rank never steps the parameter), moves and casts (`Module.to`, `cpu`) keep it unheld; any other
read raises, naming the parameter and the rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

ORDERS = (1.0, 2.0, math.inf)  # the norms rank 0 sends
_NORMS = {"norm", "linalg_vector_norm", "_foreach_norm"}
_SCALES = {"mul_", "_foreach_mul_"}
_CLAMPS = {"clamp_", "clamp_min_", "clamp_max_", "_foreach_clamp_min_", "_foreach_clamp_max_"}
_ZEROS = {"zero_", "_foreach_zero_"}
_MOVES = {"to", "cpu", "cuda", "double", "float", "half", "bfloat16"}
_ITSELF = {"detach", "detach_", "requires_grad_"}
_DATA = torch.Tensor.data  # the property: `.data` of an unheld gradient is itself


class Unheld(torch.Tensor):
    """The gradient of parameter `param` on a rank (`rank`) that does not hold it: only its norms
    (`norms`, by order; none once clamped) can be read."""

    param: str
    rank: int
    norms: dict[float, float]

    # Reads that touch only the tensor's metadata (properties, `.shape` among them, come as __get__).
    METADATA: ClassVar[set[str]] = {
        "__get__", "size", "dim", "numel", "element_size", "is_floating_point", "is_complex", "__len__",
        "nelement", "stride", "storage_offset", "is_contiguous", "__hash__",
        "_has_compatible_shallow_copy_type",
    }  # fmt: skip

    @staticmethod
    def __new__(cls, like: torch.Tensor, param: str, rank: int, norms: Mapping[float, float]) -> Unheld:
        """Shaped, typed and placed like `like`."""
        made = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        made.param, made.rank, made.norms = param, rank, dict(norms)
        return made  # type: ignore[no-any-return]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Unheld({self.param!r}, rank={self.rank}, norms={self.norms})"

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
            return _in_place(func, name, args, kwargs, _scaled)
        if name in _CLAMPS:
            return _in_place(func, name, args, kwargs, _clamped)
        if name in _ZEROS:
            return _in_place(func, name, args, kwargs, _zeroed)
        if name in _MOVES and isinstance(args[0], Unheld):
            return _moved(func, args, kwargs)
        unheld = next(t for t in _tensors(args, kwargs) if isinstance(t, Unheld))
        raise RuntimeError(
            f"deeppool: rank {unheld.rank} does not hold the gradient of {unheld.param!r} (it runs none of "
            f"the layers that use it), so {name or func} cannot read it there; only its norms can be read "
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
    """A norm of gradients, some unheld: each unheld one's from its norms, the others' as asked."""
    if name == "_foreach_norm":
        tensors, rest = args[0], args[1:]
        return [_norm(torch.linalg.vector_norm, "linalg_vector_norm", (t, *rest), kwargs) for t in tensors]
    tensor, rest = args[0], list(args[1:])
    if not isinstance(tensor, Unheld):
        with torch._C.DisableTorchFunctionSubclass():
            return func(tensor, *rest, **kwargs)
    order = kwargs.get("ord", kwargs.get("p", rest[0] if rest else 2))
    order = 2.0 if order in ("fro", None) else order
    known = isinstance(order, int | float) and float(order) in ORDERS
    if kwargs.get("dim", None) is not None or not known:
        raise RuntimeError(
            f"deeppool: rank {tensor.rank} knows only the 1-, 2- and max-norms of the gradient of "
            f"{tensor.param!r}, which it does not hold; the {order}-norm cannot be read there"
        )
    if float(order) not in tensor.norms:
        raise RuntimeError(
            f"deeppool: rank {tensor.rank} no longer knows the norms of the gradient of {tensor.param!r}: "
            "it was clamped (clip_grad_value_) there, and only rank 0 holds its values. Read norms before "
            "clamping, or on rank 0"
        )
    dtype = kwargs.get("dtype") or tensor.dtype
    return torch.tensor(tensor.norms[float(order)], dtype=dtype, device=tensor.device)


def _in_place(
    func: Any, name: str, args: Any, kwargs: Mapping[str, Any], unheld: Callable[[Unheld, Any], None]
) -> Any:
    """An in-place operation on gradients (one, or a list for a `_foreach_` one), some unheld: held
    ones as asked; `unheld(t, arg)` for each unheld one, `arg` its share of the second argument."""
    many = name.startswith("_foreach_")
    tensors = list(args[0]) if many else [args[0]]
    arg: Any = args[1] if len(args) > 1 else None
    each = many and isinstance(arg, list | tuple)  # a list of per-tensor arguments
    shares = list(arg) if each else [arg] * len(tensors)
    held = [(t, a) for t, a in zip(tensors, shares) if not isinstance(t, Unheld)]
    for t, a in zip(tensors, shares):
        if isinstance(t, Unheld):
            unheld(t, a)
    if held:
        with torch._C.DisableTorchFunctionSubclass():
            if not many:
                func(*args, **kwargs)
            elif each:
                func([t for t, _ in held], [a for _, a in held], *args[2:], **kwargs)
            else:
                func([t for t, _ in held], *args[1:], **kwargs)
    return args[0]


def _scaled(tensor: Unheld, factor: Any) -> None:
    """Scaling (clipping by norm) scales every norm."""
    tensor.norms = {order: norm * abs(float(factor)) for order, norm in tensor.norms.items()}


def _clamped(tensor: Unheld, bound: Any) -> None:
    """Clamping (clipping by value) leaves norms only rank 0 can compute."""
    tensor.norms = {}


def _zeroed(tensor: Unheld, _: Any) -> None:
    tensor.norms = dict.fromkeys(ORDERS, 0.0)


def _moved(func: Any, args: Any, kwargs: Mapping[str, Any]) -> Unheld:
    """A move or cast (`Module.to`, `cpu` at teardown): the same unheld gradient, where and as asked."""
    tensor = args[0]
    with torch._C.DisableTorchFunctionSubclass():
        like = func(torch.empty(0, dtype=tensor.dtype, device=tensor.device), *args[1:], **kwargs)
    if (like.dtype, like.device) == (tensor.dtype, tensor.device):
        return tensor  # type: ignore[no-any-return]
    shaped = like.new_empty(1).expand(tensor.shape) if tensor.dim() else like.new_empty(())
    return Unheld(shaped, tensor.param, tensor.rank, tensor.norms)


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
        """Rank 0 sends the norms (`ORDERS`) of every gradient some rank does not hold (NaN where it
        has none); each rank that does not hold one puts its `Unheld` in place. Collective."""
        owners = self.owners
        narrow = sorted(name for name, ranks in owners.items() if len(ranks) < self.world_size)
        if not narrow:
            return
        norms = torch.full((len(narrow), len(ORDERS)), math.nan, dtype=torch.float64, device=self.device)
        if self.rank == 0:
            grads = [self.params[name].grad for name in narrow]
            present = [i for i, g in enumerate(grads) if g is not None]
            if present:
                held: list[torch.Tensor] = [grads[i] for i in present]  # type: ignore[misc]
                norms[present] = torch.stack([_norms(held, order, self.device) for order in ORDERS], 1)
        dist.broadcast(norms, src=0)
        self._install(narrow, norms.tolist(), owners)

    def _install(
        self, narrow: Sequence[str], norms: Sequence[Sequence[float]], owners: Mapping[str, Sequence[int]]
    ) -> None:
        for name, row in zip(narrow, norms):
            if self.rank in owners[name]:
                continue
            p = self.params[name]
            p.grad = None if row[0] != row[0] else Unheld(p, name, self.rank, dict(zip(ORDERS, row)))


def _norms(grads: list[torch.Tensor], order: float, device: torch.device) -> torch.Tensor:
    """Each gradient's `order`-norm, computed as gradient clipping computes it (by device and dtype),
    in float64 on `device`."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    found = torch.empty(len(grads), dtype=torch.float64, device=device)
    for indices in groups.values():
        for i, norm in zip(indices, torch._foreach_norm([grads[i] for i in indices], order)):
            found[i] = norm.to(device, torch.float64)
    return found
