"""Layer profiler: measured forward+backward time and the bytes kept for backward, per layer and batch
size; the optimizer update's time and state.

Profiling never changes training: parameters' `.grad`, buffers (BatchNorm running stats), module
training flags and the global RNG state are as they were before.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_deeppool.capture import CapturedGraph, ValueMeta
from lightning_deeppool.capture.graph import preserved
from lightning_deeppool.capture.values import rows_view, samples_view
from lightning_deeppool.ir.placement import per_device_batch
from lightning_deeppool.ir.profile import LayerProfile
from lightning_deeppool.profiling.heap import give_back


def candidate_batch_sizes(global_batch_size: int, world_size: int, max_sizes: int = 16) -> list[int]:
    """Per-device batch sizes ceil(B/w) for widths w in 1..N, increasing.

    Beyond `max_sizes` distinct sizes, a geometric subset that keeps the smallest and the largest.
    """
    if global_batch_size < 1 or world_size < 1 or max_sizes < 2:
        raise ValueError(
            f"need global_batch_size >= 1, world_size >= 1, max_sizes >= 2; got "
            f"{global_batch_size}, {world_size}, {max_sizes}"
        )
    sizes = sorted({per_device_batch(global_batch_size, w) for w in range(1, world_size + 1)})
    if len(sizes) <= max_sizes:
        return sizes
    low, high = sizes[0], sizes[-1]
    targets = [low * (high / low) ** (i / (max_sizes - 1)) for i in range(max_sizes)]
    return sorted({min(sizes, key=lambda s: abs(math.log(s / target))) for target in targets})


def assign_layers(layer_names: Sequence[str], world_size: int, rank: int) -> list[str]:
    """The layers `rank` profiles: round-robin, so cheap and expensive layers spread over ranks."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    return list(layer_names[rank::world_size])


def device_name(device: torch.device) -> str:
    """How a profile names the device it was measured on: the CUDA device's name, else the CPU's threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{torch.get_num_threads()}threads"


def parameter_dtype(module: torch.nn.Module) -> str:
    """The dtype a profile records: the module's first parameter's (float32 without parameters)."""
    return str(next((p.dtype for p in module.parameters()), torch.float32))


def progress_printer(prefix: str = "") -> Callable[[int, int], None]:
    """A `profile_layers` progress callback printing ``{prefix}profiling layers done/total`` over itself
    on one line, ended at the last layer."""

    def progress(done: int, total: int) -> None:
        end = "\n" if done == total else "\r"
        print(f"{prefix}profiling layers {done}/{total}", end=end, flush=True)

    return progress


def merge_layer_profiles(parts: Sequence[dict[str, LayerProfile]]) -> dict[str, LayerProfile]:
    """Union of the ranks' profiles; raises if a layer appears twice or batch sizes differ."""
    merged: dict[str, LayerProfile] = {}
    for part in parts:
        for name, layer in part.items():
            if name in merged:
                raise ValueError(f"layer {name!r} was profiled by more than one rank")
            first = next(iter(merged.values()), layer)
            if layer.batch_sizes != first.batch_sizes:
                raise ValueError(
                    f"layer {name!r} was profiled at batch sizes {layer.batch_sizes}, "
                    f"layer {first.name!r} at {first.batch_sizes}: ranks disagree on the candidates"
                )
            merged[name] = layer
    return merged


def profile_layers(
    captured: CapturedGraph,
    env: dict[str, Any],
    batch_sizes: Sequence[int],
    *,
    layers: Sequence[str] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device: torch.device | str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, LayerProfile]:
    """Median forward+backward seconds of each layer (default: all) at each batch size.

    `env` is `captured.bind(args, kwargs)` of an example batch. `device` defaults to the module's;
    the module must already be there. `progress(done, total)` is called after each layer.
    """
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    names = list(layers) if layers is not None else [layer.name for layer in captured.graph.layers]
    unknown = [name for name in names if name not in captured.code]
    if unknown:
        raise ValueError(f"no layers named {unknown} in the captured graph")
    gm = captured.module
    device = torch.device(device) if device is not None else _module_device(gm)
    env = {name: _to_device(value, device) for name, value in env.items()}
    scalars = {name: env[name] for name in captured.scalar_inputs}
    profiles: dict[str, LayerProfile] = {}
    with preserved(gm, device), torch.enable_grad():
        samples = _two_samples(captured, env, scalars)
        for done, name in enumerate(names, start=1):
            inputs = {value: samples[value] for value in captured.graph.layer(name).inputs}
            profiles[name] = _profile_layer(captured, name, scalars, inputs, sizes, warmup, repeats, device)
            give_back(device)
            if progress is not None:
                progress(done, len(names))
    return profiles


def _profile_layer(
    captured: CapturedGraph,
    name: str,
    scalars: dict[str, Any],
    samples: dict[str, Any],
    sizes: list[int],
    warmup: int,
    repeats: int,
    device: torch.device,
) -> LayerProfile:
    """Median time per batch size, and the runs' spread about it (`LayerProfile.spread`), over
    `repeats` rounds that each time every size once: a stretch of a slower machine lands on every size
    alike instead of on one of them."""
    params = dict(captured.module.named_parameters())
    trainable = [params[p] for p in captured.layer_params[name] if params[p].requires_grad]
    runs, kept = [], []
    for b in sizes:
        leaves = {
            value: pytree.tree_map(_leaf_input, repeat_sample(v, captured.meta[value], b))
            for value, v in samples.items()
        }
        wrt = [leaf for v in leaves.values() for leaf in pytree.tree_leaves(v) if _needs_grad(leaf)]
        run = functools.partial(_forward_backward, captured, name, scalars, b, wrt + trainable)
        runs.append((b, run, leaves))
        _failing_as(name, b, functools.partial(_warm_up, run, leaves, device, warmup))
        measure = functools.partial(_kept_bytes, captured, name, scalars, b, leaves, device)
        kept.append(_failing_as(name, b, measure))
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for position, (b, run, leaves) in enumerate(runs):
            times[position].append(_failing_as(name, b, functools.partial(_timed_once, run, leaves, device)))
    seconds = tuple(statistics.median(t) for t in times)
    spread = tuple(statistics.median(abs(x - m) for x in t) for t, m in zip(times, seconds, strict=True))
    activations, saved_inputs = zip(*kept, strict=True)
    return LayerProfile(name, tuple(sizes), seconds, activations, spread, saved_inputs)


def time_whole_model(
    captured: CapturedGraph,
    env: dict[str, Any],
    batch_size: int,
    *,
    warmup: int = 2,
    repeats: int = 5,
    device: torch.device | str | None = None,
    reduce: Callable[[list[torch.Tensor]], None] | None = None,
) -> float:
    """Median forward+backward seconds of every layer in one pass, at `batch_size` (arguments as
    `profile_layers`), then `reduce` of the parameters' gradients if given. Layers timed alone run
    with warm caches and without the autograd graph around them; a whole pass shows how far their
    sum falls short of a step."""
    gm = captured.module
    device = torch.device(device) if device is not None else _module_device(gm)
    env = {name: _to_device(value, device) for name, value in env.items()}
    scalars = {name: env[name] for name in captured.scalar_inputs}
    trainable = [p for p in gm.parameters() if p.requires_grad]
    with preserved(gm, device), torch.enable_grad():
        samples = _two_samples(captured, env, scalars)
        leaves = {
            name: pytree.tree_map(_leaf_input, repeat_sample(samples[name], captured.meta[name], batch_size))
            for name in captured.batch_inputs
        }
        wrt = [leaf for v in leaves.values() for leaf in pytree.tree_leaves(v) if _needs_grad(leaf)]

        def run(inputs: dict[str, Any]) -> None:
            values = captured.run_all(inputs, batch_size, scalars)
            outputs = [
                leaf
                for name in captured.graph.outputs
                for leaf in pytree.tree_leaves(values[name])
                if _needs_grad(leaf)
            ]
            if outputs and wrt + trainable:
                upstream = [torch.ones_like(out) for out in outputs]
                grads = torch.autograd.grad(outputs, wrt + trainable, upstream, allow_unused=True)
                if reduce is not None:
                    reduce([g for g in grads[len(wrt) :] if g is not None])

        _failing_as("(whole model)", batch_size, functools.partial(_warm_up, run, leaves, device, warmup))
        times = [
            _failing_as("(whole model)", batch_size, functools.partial(_timed_once, run, leaves, device))
            for _ in range(repeats)
        ]
    give_back(device)
    return statistics.median(times)


def _failing_as(name: str, batch_size: int, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as err:
        raise RuntimeError(
            f"profiling layer {name!r} at per-device batch size {batch_size} failed: {err}"
        ) from err


def _two_samples(captured: CapturedGraph, env: dict[str, Any], scalars: dict[str, Any]) -> dict[str, Any]:
    """Every layer's and batch input's value on the example's first two samples (no grad)."""
    inputs = {name: env[name][:2] for name in captured.batch_inputs}
    count = inputs[captured.batch_inputs[0]].shape[0]
    with torch.no_grad():
        return captured.run_all(inputs, count, scalars)


def repeat_sample(value: Any, meta: ValueMeta, batch_size: int) -> Any:
    """The value with its first sample repeated to `batch_size` samples (per-rank values unchanged)."""
    if meta.per_rank:
        return value
    leaves = pytree.tree_leaves(value)
    repeated = [
        rows_view(samples_view(t, m)[:1].expand(batch_size, *m.shape).contiguous(), m)
        for t, m in zip(leaves, meta.leaves, strict=True)
    ]
    return pytree.tree_unflatten(repeated, meta.spec)


def _warm_up(
    run: Callable[[dict[str, Any]], None], leaves: dict[str, Any], device: torch.device, warmup: int
) -> None:
    """Run `warmup` (at least one) untimed times."""
    for _ in range(max(warmup, 1)):
        _timed_once(run, leaves, device)


def _kept_bytes(
    captured: CapturedGraph,
    name: str,
    scalars: dict[str, Any],
    batch_size: int,
    leaves: dict[str, Any],
    device: torch.device,
) -> tuple[int, int]:
    """What the layer's forward at `batch_size` leaves alive for its backward: its activations (on
    CUDA, the memory allocated after it less before it; elsewhere, the bytes of the storages of its
    output and of the tensors autograd saved, less those of its inputs, parameters and buffers), and
    the bytes of its inputs autograd saved."""
    inputs = {value: pytree.tree_map(_copy_if_grad, v) for value, v in leaves.items()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # Kept as autograd keeps it, but detached: a saved output packed with its grad_fn would tie
        # the graph into a cycle that is never freed, as this forward has no backward to release it.
        saved.update(_storages([tensor]))
        return tensor.detach()

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
        output = captured.run_layer(name, inputs, batch_size, scalars)
    given = _storages(pytree.tree_leaves(inputs))
    saved_inputs = sum(size for key, size in saved.items() if key in given)
    if cuda:
        torch.cuda.synchronize(device)
        return max(torch.cuda.memory_allocated(device) - before, 0), saved_inputs
    module = captured.module
    given |= _storages([*module.parameters(), *module.buffers()])
    kept = saved | _storages(pytree.tree_leaves(output))
    return sum(size for key, size in kept.items() if key not in given), saved_inputs


def _never_unpacked(packed: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("deeppool: a profiled layer's memory was measured on a forward with no backward")


def _storages(values: Sequence[Any]) -> dict[int, int]:
    """Bytes of each distinct storage among the tensors in `values`, keyed by its address."""
    found = {}
    for value in values:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type != "meta":
            storage = value.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _timed_once(run: Callable[[dict[str, Any]], None], leaves: dict[str, Any], device: torch.device) -> float:
    # In-place layers (ReLU(inplace=True)) may not modify an autograd leaf: give them a copy.
    inputs = {name: pytree.tree_map(_copy_if_grad, v) for name, v in leaves.items()}
    return _timed(device, functools.partial(run, inputs))


def _forward_backward(
    captured: CapturedGraph,
    name: str,
    scalars: dict[str, Any],
    batch_size: int,
    wrt: list[torch.Tensor],
    inputs: dict[str, Any],
) -> None:
    """Run the layer, then backward with a ones upstream gradient (no `.grad` touched)."""
    value = captured.run_layer(name, inputs, batch_size, scalars)
    outputs = [leaf for leaf in pytree.tree_leaves(value) if _needs_grad(leaf)]
    if outputs and wrt:
        upstream = [torch.ones_like(out) for out in outputs]
        torch.autograd.grad(outputs, wrt, upstream, allow_unused=True)


def _timed(device: torch.device, fn: Callable[[], None]) -> float:
    """Seconds `fn` takes on `device`: CUDA events there, the wall clock on CPU."""
    if device.type != "cuda":
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _needs_grad(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.requires_grad


def _leaf_input(leaf: Any) -> Any:
    """A fresh autograd leaf for float tensors; integer tensors (indices) get no gradient."""
    if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
        return leaf.detach().requires_grad_(True)
    return leaf


def _copy_if_grad(leaf: Any) -> Any:
    return leaf.clone() if _needs_grad(leaf) else leaf


def _to_device(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, value)


def _module_device(gm: torch.nn.Module) -> torch.device:
    tensor = next(gm.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


@dataclass(frozen=True)
class OptimizerUpdate:
    """One update of every parameter: its `seconds`, and `states`, the optimizer-state bytes it keeps
    per parameter byte (`Profile.optimizer_states`)."""

    seconds: float
    states: float


def measure_optimizer_step(
    optimizers: Sequence[torch.optim.Optimizer], *, max_elements: int = 1 << 22, repeats: int = 3
) -> OptimizerUpdate:
    """Median seconds of one `step()` of each optimizer over all its parameters, and the state it
    keeps, measured on copies.

    Each optimizer's class and hyper-parameters run on clones of its parameters with random gradients,
    about `max_elements` in all (a large parameter's leading rows); the time is scaled to all elements
    (updates are elementwise).
    The real parameters and optimizer state are untouched. Optimizers that need a closure count 0
    seconds; without any optimizer that steps, `states` is SGD with momentum's 1.
    """
    total, state_bytes, sampled_bytes = 0.0, 0, 0
    for optimizer in optimizers:
        groups, sampled, elements = [], 0, 0
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                elements += p.numel()
                if sampled < max_elements:
                    copy = _leading_rows(p.detach(), max_elements - sampled).clone().requires_grad_(True)
                    copy.grad = torch.randn_like(copy) * 1e-3
                    params.append(copy)
                    sampled += copy.numel()
            if params:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        if not groups:
            continue
        try:
            # Torch optimizers take (params, **defaults); the groups carry every hyper-parameter.
            replica = type(optimizer)(groups)  # type: ignore[call-arg]
            device = groups[0]["params"][0].device
            replica.step()  # creates the state
            seconds = statistics.median(_timed(device, replica.step) for _ in range(repeats))
        except Exception:
            continue
        total += seconds * elements / max(sampled, 1)
        state_bytes += sum(_bytes(value) for state in replica.state.values() for value in state.values())
        sampled_bytes += sum(_bytes(p) for group in groups for p in group["params"])
        del replica, groups
        give_back(device)
    return OptimizerUpdate(total, state_bytes / sampled_bytes if sampled_bytes else 1.0)


def _leading_rows(tensor: torch.Tensor, elements: int) -> torch.Tensor:
    """The first rows (along dimension 0) of `tensor` that hold at least `elements` elements, all of
    it when smaller: a sample of a large parameter with its number of dimensions."""
    if tensor.dim() == 0 or tensor.numel() <= elements:
        return tensor
    row = tensor.numel() // tensor.shape[0]
    return tensor[: -(-elements // row)]


def _bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
