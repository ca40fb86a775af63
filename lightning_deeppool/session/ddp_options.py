"""`DDPStrategy`'s options under deeppool, so that code and LightningCLI configs written for it run.

`DistributedDataParallel`'s keyword arguments (which `DDPStrategy` forwards, and LightningCLI fills in
with their defaults) are honoured where deeppool's gradient synchronisation has their meaning
(`bucket_cap_mb`; `gradient_as_bucket_view` is the strategy's own argument), accepted where it has
nothing to change, and refused where it cannot do what they ask: the README's "Switching from DDP"
says why for each. A communication hook sums deeppool's gradient buckets (`runtime.comm_hook`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
from torch.nn.parallel import DistributedDataParallel

from lightning_deeppool.runtime.comm_hook import CommHook

# Accepted whatever their value: deeppool already does what they ask, or they have no object here.
WITHOUT_EFFECT = frozenset(
    {
        "find_unused_parameters",  # gradients that arrive are tracked: unused parameters cost nothing
        "skip_all_reduce_unused_params",  # their gradients are never reduced
        "static_graph",  # the plan is fixed at the first step
        "check_reduction",  # a no-op in DDP too
        "broadcast_buffers",  # buffers are rank 0's wherever they are read (evaluation, end of fit)
        "forward_sync_buffers",
        "init_sync",  # rank 0's weights are broadcast at the start of every fit
        "output_device",  # for one process driving several devices; Lightning runs one per process
        "dim",
        "batched_grad_copy",  # how DDP copies gradients into its buckets
    }
)
_HONOURED = frozenset({"bucket_cap_mb"})
_SET_BY_LIGHTNING = frozenset({"self", "module", "device_ids"})


def check_ddp_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Raise unless each of `kwargs` is a `DistributedDataParallel` keyword argument deeppool can honour
    or accept: TypeError for no such argument, ValueError for one deeppool cannot honour."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    for name, value in kwargs.items():
        if name not in parameters or name in _SET_BY_LIGHTNING:
            raise TypeError(f"DeepPoolStrategy got an unexpected keyword argument {name!r}")
        default = parameters[name].default
        if name in WITHOUT_EFFECT or name in _HONOURED or value is default or value == default:
            continue
        raise ValueError(
            f"DeepPoolStrategy({name}={value!r}): deeppool cannot honour this DistributedDataParallel "
            f"argument (it synchronises gradients over process groups of its own plan); leave it at "
            f"its default ({default!r}) or use strategy='ddp'"
        )


def bucket_size_mb(bucket_mb: float, default_mb: float, bucket_cap_mb: float | None) -> float:
    """The bucket size: deeppool's `bucket_mb`, or DDP's `bucket_cap_mb` for it; both given must agree."""
    if bucket_cap_mb is None:
        return bucket_mb
    if bucket_mb != default_mb and bucket_mb != bucket_cap_mb:
        raise ValueError(
            f"DeepPoolStrategy: bucket_mb={bucket_mb} and bucket_cap_mb={bucket_cap_mb} (DDP's name for "
            "it) disagree; give one"
        )
    return float(bucket_cap_mb)


def comm_hook(
    state: object, hook: Callable[..., Any] | None, wrapper: Callable[..., Any] | None
) -> CommHook | None:
    """DDPStrategy's `ddp_comm_state`, `ddp_comm_hook` and `ddp_comm_wrapper` as deeppool applies them
    (None without a hook, as in DDP)."""
    if hook is None:
        return None
    for name, given in (("ddp_comm_hook", hook), ("ddp_comm_wrapper", wrapper)):
        if given is not None and not callable(given):
            raise TypeError(f"DeepPoolStrategy({name}=...) must be callable, got {type(given).__name__}")
    if isinstance(state, PostLocalSGDState):
        raise ValueError(
            "DeepPoolStrategy: post-local SGD (PostLocalSGDState, model_averaging_period) averages whole "
            "models across ranks, but deeppool's ranks hold and train different layers; use another "
            "communication hook, or strategy='ddp'"
        )
    return CommHook(wrapper(hook) if wrapper is not None else hook, state)
