"""The arguments both front doors take, checked and turned into what the phases read (`PlanOptions`, a
layer compiler), so that `DeepPoolStrategy` means the same under the Trainer and under Fabric."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_deeppool.install import Compiler, PlanOptions
from lightning_deeppool.ir.profile import DEFAULT_BUCKET_BYTES
from lightning_deeppool.session.ddp_options import bucket_size_mb, check_ddp_kwargs, comm_hook

PlanSource = str | Path | Mapping[str, int | Mapping[str, Any]] | None
DEFAULT_BUCKET_MB = DEFAULT_BUCKET_BYTES / 2**20


def plan_options(
    *,
    amplification_limit: float,
    plan: PlanSource,
    save_plan: str | Path | None,
    leaf_modules: tuple[str, ...] | list[str],
    granularity: str,
    profile_warmup: int,
    profile_repeats: int,
    cache_dir: str | Path | Literal[False] | None,
    exempt_below_s: float,
    memory_budget_bytes: float | None,
    bucket_mb: float,
    shared_batch: bool,
    branches: bool,
    current_weights: bool,
    gradient_as_bucket_view: bool | None,
    ddp_kwargs: Mapping[str, Any],
    ddp_comm_state: object | None,
    ddp_comm_hook: Callable[..., Any] | None,
    ddp_comm_wrapper: Callable[..., Any] | None,
) -> PlanOptions:
    """The strategy's planning arguments and DDP's options, checked (ValueError/TypeError naming the
    argument)."""
    if not amplification_limit >= 1.0:
        raise ValueError(f"amplification_limit must be >= 1 (or inf), got {amplification_limit}")
    if plan is not None and not isinstance(plan, str | Path | Mapping):
        raise TypeError(
            f"plan must be None, a plan file path or a mapping of pins, got {type(plan).__name__}"
        )
    check_ddp_kwargs(ddp_kwargs)
    bucket_mb = bucket_size_mb(bucket_mb, DEFAULT_BUCKET_MB, ddp_kwargs.get("bucket_cap_mb"))
    return PlanOptions(
        amplification_limit=float(amplification_limit),
        plan_source=dict(plan) if isinstance(plan, Mapping) else plan,
        save_plan=save_plan,
        leaf_modules=tuple(leaf_modules),
        granularity=granularity,
        profile_warmup=profile_warmup,
        profile_repeats=profile_repeats,
        cache_dir=cache_dir,
        exempt_below_s=exempt_below_s,
        memory_budget_bytes=memory_budget_bytes,
        bucket_bytes=int(bucket_mb * 2**20),
        shared_batch=shared_batch,
        branches=branches,
        comm_hook=comm_hook(ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper),
        bucket_view=gradient_as_bucket_view is not False,
        current_weights=current_weights,
    )


def check_every(check_every_n_steps: int) -> int:
    if check_every_n_steps < 0:
        raise ValueError(f"check_every_n_steps must be >= 0, got {check_every_n_steps}")
    return check_every_n_steps


def compile_options(compile_layers: bool | Mapping[str, Any]) -> bool | dict[str, Any]:
    """`compile_layers` checked: True, False, or `torch.compile`'s keyword arguments."""
    if not isinstance(compile_layers, bool | Mapping):
        raise TypeError(
            "compile_layers must be True, False or a mapping of torch.compile's keyword arguments, "
            f"got {type(compile_layers).__name__}"
        )
    return dict(compile_layers) if isinstance(compile_layers, Mapping) else compile_layers


def layer_compiler(compile_layers: bool | Mapping[str, Any]) -> Compiler | None:
    """`torch.compile` with the options of `compile_layers`, where it asks for one."""
    if compile_layers is False:
        return None
    options = {} if compile_layers is True else compile_layers
    compiler: Compiler = torch.compile(**options)
    return compiler


def register_names(strategy: type, registry: Any) -> None:
    """Register `strategy` in a Lightning strategy registry (the Trainer's or Fabric's) as
    ``"deeppool"`` (subprocess launcher) and ``"deeppool_spawn"`` (spawn)."""
    for name, start_method in (("deeppool", "popen"), ("deeppool_spawn", "spawn")):
        registry.register(
            name,
            strategy,
            description=f"DeepPool burst-parallel strategy with start_method '{start_method}'",
            override=True,
            start_method=start_method,
        )
